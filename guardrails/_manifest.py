"""A checkpoint's files as bytes on disk: the manifest, its checks, the ``step_*`` names.

Everything about a checkpoint that needs no tensor: which directories are checkpoints,
whether one is intact (its ``manifest.json`` parses and matches its own hash, names no
file outside its directory, and every file it lists has the recorded size and sha256)
and what its manifest says. :mod:`guardrails._checkpoint` (the format's writer and
:func:`guardrails.resume`) and ``python -m guardrails inspect`` both judge a checkpoint
here, so ``inspect`` answers "which one would ``resume`` pick?" exactly as resume does,
without importing torch (``inspect``: 3.3-4.0 s median before, 0.15 s after, on a loaded
2-core VM; benchmarks/RESULTS.md).

Problems are returned as ``(file, why)`` or raised as :class:`ManifestError`, not as
:class:`guardrails.CheckpointError`: the exception tree imports torch
(``OutOfMemoryError`` is also a ``torch.OutOfMemoryError``); ``_checkpoint`` turns them
into the public errors.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from guardrails import _digest
from guardrails._text import shorten
from guardrails._version import __version__

FORMAT = "guardrails-checkpoint"
#: 2: RNG streams moved from rng.* into per-rank rank<R>.* files (format 1 still reads).
#: 3: several optimizers / schedulers (optimizer.<name>.*), optimizer state saved per
#: rank where the ranks hold different parts (rank<R>.optimizer.*), the parameter
#: shapes each optimizer state was saved for, and a "contents" table in the manifest
#: (formats 1 and 2 still read).
#: 4: files over 64 MiB carry a tree sha256 (``sha256_chunk_bytes``): a format-3 reader
#: would call them corrupt, so it must refuse the format instead (formats 1-3 still read).
FORMAT_VERSION = 4
MANIFEST = "manifest.json"
#: The manifest's checksum of itself (sha256 of its JSON without this key): the file
#: sizes and hashes protect the other files, this protects the step, the file list and
#: those hashes (a 1-bit flip turned "step": 6 into 7 and the run went on at step 7).
#: Optional on read: checkpoints written before it still load.
SELF_HASH = "manifest_sha256"
STEP_RE = re.compile(r"^step_(\d+)$")
#: A checkpoint a same-step re-save renamed aside, before renaming the new one in (see
#: ``_checkpoint.commit``): while ``step_<N>`` itself is missing, it is that checkpoint.
ASIDE_RE = re.compile(r"^\.aside-(step_(\d+))$")


class ManifestError(Exception):
    """A manifest that cannot be used: ``path`` names the file, ``message`` says why.
    ``too_new``: intact, but written in a format newer than this guardrails reads (a
    resume error, not corruption); ``hint`` then says what to do."""

    def __init__(
        self, message: str, *, path: str, too_new: bool = False, hint: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.path = path
        self.too_new = too_new
        self.hint = hint


def read_manifest(ckpt: Path) -> dict[str, Any]:
    """``ckpt``'s manifest, checked (format, version, its own hash, file names inside
    ``ckpt``); raises :class:`ManifestError`. The files it lists are not read here."""
    f = ckpt / MANIFEST
    if not f.is_file():
        raise ManifestError(
            f"{f} is missing: the save that wrote {ckpt.name} did not finish", path=str(f)
        )
    try:
        manifest = json.loads(f.read_text())
        files = manifest["files"]
        fmt, version = manifest["format"], int(manifest["format_version"])
        if int(manifest["step"]) < 0:
            raise ValueError(f"step {manifest['step']} is negative")
        if not isinstance(files, dict):
            raise TypeError("files is not a mapping")
        for name in files:
            # Every file inside the checkpoint directory: no absolute paths, no "..".
            if Path(name).is_absolute() or ".." in Path(name).parts:
                raise ValueError(f"file {name!r} is outside the checkpoint directory")
    except (ValueError, KeyError, TypeError, OverflowError, AttributeError) as e:
        raise ManifestError(f"{f} is corrupt: {e}", path=str(f)) from e
    if fmt != FORMAT:
        raise ManifestError(f"{f} is not a guardrails checkpoint manifest", path=str(f))
    if version > FORMAT_VERSION:
        raise ManifestError(
            f"{ckpt} has checkpoint format {version}; this guardrails ({__version__}) "
            f"reads up to format {FORMAT_VERSION}",
            path=str(ckpt),
            too_new=True,
            hint=f"upgrade guardrails to the version that wrote it ({manifest.get('guardrails')}).",
        )
    if SELF_HASH in manifest and manifest[SELF_HASH] != _self_hash(manifest):
        raise ManifestError(
            f"{f} is corrupt: its own checksum does not match its contents (the step, the "
            "file list or a file's size or hash was changed after it was written)",
            path=str(f),
        )
    return manifest


def problem(ckpt: Path) -> tuple[str, str] | None:
    """``(file, why)`` for the first problem found in ``ckpt``, or ``None``. Reads every
    byte once (sha256, in parallel for large files: :mod:`guardrails._digest`). A
    format newer than this guardrails reads is not a problem of the checkpoint: it
    raises :class:`ManifestError` (``too_new``)."""
    try:
        manifest = read_manifest(ckpt)
    except ManifestError as e:
        if e.too_new:
            raise
        return e.path, e.message
    world = int(manifest.get("world_size", 1))
    for name, entry in _contents(manifest)["optimizers"].items():
        if not entry.get("per_rank"):
            continue
        missing = [
            r
            for r in range(world)
            if f"{_rank_name(r)}.{entry['file']}.json" not in manifest["files"]
        ]
        if missing:
            f = ckpt / f"{_rank_name(missing[0])}.{entry['file']}.json"
            return str(f), (
                f"rank(s) [{shorten(missing, 5)}]'s part of optimizer {name!r}'s state is "
                f"missing from {ckpt.name} (each of the {world} ranks holds a different part)"
            )
    inside = ckpt.resolve()
    for name, rec in manifest["files"].items():
        f = ckpt / name
        if f.is_symlink() or not f.resolve().is_relative_to(inside):
            why = f"{f} is a link (to {f.resolve()}): a checkpoint holds only its own files"
            return str(f), why
        if not f.is_file():
            return str(f), f"{f} is missing"
        size = f.stat().st_size
        if size != rec["bytes"]:
            why = f"{f} is truncated or overwritten: {size} bytes, the manifest says {rec['bytes']}"
            return str(f), why
        try:
            matches = _digest.digest(f, rec) == rec["sha256"]
        except (OSError, ValueError) as e:
            return str(f), f"{f} cannot be verified: {e}"
        if not matches:
            return str(f), f"{f} is corrupt: its sha256 does not match the manifest"
    return None


def list_checkpoints(root: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """``(step, dir)`` of every ``step_*`` directory under ``root``, oldest first,
    valid or not (temp and trash dirs of unfinished saves are never listed), and of a
    re-saved step's old copy renamed aside whose ``step_*`` is missing (a re-save cut
    between its renames)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = STEP_RE.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
        elif (a := ASIDE_RE.match(p.name)) and p.is_dir() and not (root / a.group(1)).exists():
            found.append((int(a.group(2)), p))
    return sorted(found)


def resume_order(found: list[tuple[int, Path]]) -> list[tuple[int, Path]]:
    """``found`` (:func:`list_checkpoints`) in the order a resume tries them: the run
    that saved last first, each run's checkpoints highest step first.

    Runs apart: a fresh run (``resume=None``) started beside another run's checkpoints
    saves low steps next to its high ones, and "the highest step" was the other run's.
    Each checkpoint's manifest names its run (``run.id``, carried over by every
    resume); runs are ordered by the time of their newest save, and within a run by
    step (the step order of one run is exact; clocks are only compared between runs).
    Checkpoints without a run id (written before it, or by ``save_checkpoint``) and
    those whose manifest cannot be read form one group; a directory holding only those
    is tried by step, as before. Reads only the manifests (no hashing)."""
    groups: dict[str | None, list[tuple[int, Path]]] = {}
    newest: dict[str | None, float] = {}
    for step, ckpt in found:
        run_id, when = _run_and_time(ckpt)
        groups.setdefault(run_id, []).append((step, ckpt))
        newest[run_id] = max(newest.get(run_id, -1.0), when)
    out: list[tuple[int, Path]] = []
    for run_id in sorted(groups, key=lambda r: newest[r], reverse=True):
        out += sorted(groups[run_id], key=lambda sp: sp[0], reverse=True)
    return out


def run_of(ckpt: Path) -> str | None:
    """The id of the run that saved ``ckpt`` (its manifest's ``run.id``), or ``None``."""
    return _run_and_time(ckpt)[0]


def _run_and_time(ckpt: Path) -> tuple[str | None, float]:
    """``(run id, save time)`` from ``ckpt``'s manifest, unverified; ``(None, -1)``
    when it cannot be read. Only a regular file of sane size is opened: a FIFO named
    manifest.json would block the read forever."""
    f = ckpt / MANIFEST
    try:
        st = os.lstat(f)
        if not stat.S_ISREG(st.st_mode) or st.st_size > _MANIFEST_MAX_BYTES:
            return None, -1.0
        manifest = json.loads(f.read_bytes())
        run = manifest.get("run") or {}
        run_id = run.get("id") if isinstance(run, dict) else None
        when = manifest.get("time")
        return (
            run_id if isinstance(run_id, str) else None,
            float(when) if isinstance(when, (int, float)) else -1.0,
        )
    except (OSError, ValueError, AttributeError):
        return None, -1.0


#: A manifest is a few KB per file it lists; one over this is not one.
_MANIFEST_MAX_BYTES = 64 << 20


def _contents(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """A manifest's ``contents``; for formats 1-2 (one optimizer and scheduler, saved
    by rank 0), what its file names say."""
    if "contents" in manifest:
        return manifest["contents"]
    files = manifest["files"]
    return {
        "optimizers": (
            {"optimizer": {"file": "optimizer", "per_rank": False}}
            if "optimizer.json" in files
            else {}
        ),
        "schedulers": (
            {"scheduler": "scheduler"}
            if "scheduler.json" in files or "scheduler.pt" in files
            else {}
        ),
    }


def _rank_name(rank: int) -> str:
    return f"rank{rank:05d}"


def _self_hash(manifest: Mapping[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != SELF_HASH}
    return hashlib.sha256(_dumps(body)).hexdigest()


def _dumps(obj: Any) -> bytes:
    # allow_nan: a scheduler's best=inf must round-trip exactly; these files are read
    # back by Python's json, which reads Infinity/NaN.
    return json.dumps(obj, indent=1, allow_nan=True).encode()
