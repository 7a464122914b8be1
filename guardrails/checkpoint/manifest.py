"""A checkpoint's manifest and the whole check of a checkpoint: the manifest's schema,
each listed file's size, hash and content, the ``step_*`` names and the order a resume
tries them. The listed files' own schemas are :mod:`guardrails.checkpoint.schema`;
their safe reads (no link, no FIFO, bounded) :mod:`guardrails.checkpoint.files`.

Everything about a checkpoint that needs no tensor: which directories are checkpoints,
whether one is intact and what its manifest says. A checkpoint is valid when

* ``manifest.json`` is a regular file, UTF-8 JSON without duplicate keys, matches its own
  ``manifest_sha256`` and fits the schema below (:func:`read_manifest`);
* every file it lists is a regular file inside the checkpoint directory (no link, FIFO,
  device or directory, no name with ``..``; a non-regular file is never opened: a FIFO
  would block the reader forever), of the recorded size and sha256;
* every listed file's content fits what guardrails writes there
  (:func:`content_problem`): the JSON files parse and hold what their readers expect
  (types, ranges, the tensors they reference), and each ``.safetensors`` header's
  tensors tile the file exactly.

Only listed files are ever read: a file the manifest does not name is not part of the
checkpoint. :mod:`guardrails.checkpoint` (the format's writer and
:func:`guardrails.resume`) and ``python -m guardrails inspect`` both judge a checkpoint
here, so ``inspect`` answers "which one would ``resume`` pick?" exactly as resume does,
without importing torch (``inspect`` starts in 0.15 s median on a loaded CPU host,
where torch's import alone takes ~2.3 s). The one check that needs torch, DCP's pickled
metadata, is passed in by the caller (``metadata_check``).

Problems are returned as ``(file, why)`` or raised as :class:`ManifestError`, not as
:class:`guardrails.CheckpointError`: the exception tree imports torch
(``OutOfMemoryError`` is also a ``torch.OutOfMemoryError``); ``checkpoint/common.py``
turns them into the public errors. Every message names the file and the field.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import stat
from collections.abc import Callable, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from guardrails._version import __version__
from guardrails.checkpoint import digest
from guardrails.checkpoint.files import (
    _target,
    not_regular,
    parse_json,
    read_bytes,
    read_json,
    safetensors_header,
)
from guardrails.checkpoint.schema import (
    Bad,
    _check_extras,
    _int,
    _json_type,
    _key,
    _list,
    _mapping,
    _number,
    _rank_check,
    _show,
    _str,
    check_optimizer_state,
    check_rng,
    check_scaler_state,
    check_scheduler_state,
)
from guardrails.util.text import shorten

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
#: The manifest's save sequence number: 1 + the highest under the checkpoint directory
#: when its writer first saved there, then one more per save. Orders the runs that
#: saved in one directory without comparing clocks (one run writes there at a time:
#: the run_dir's lock). Absent from checkpoints written before it (seq 0).
SEQ = "seq"
#: The manifest's checksum of itself (sha256 of its JSON without this key): the file
#: sizes and hashes protect the other files, this protects the step, the file list and
#: those hashes (a 1-bit flip turned "step": 6 into 7 and the run went on at step 7).
#: Optional on read: checkpoints written before it still load. A manifest of a format
#: newer than this guardrails reads counts as "too new" only when it carries this
#: checksum and it matches (a flipped bit turns format_version 4 into 5: that is
#: damage, to fall back from, not a reason to stop); later formats must keep it.
SELF_HASH = "manifest_sha256"
#: A failure save's record (``guards/checkpointer/failure.py``): ``cause`` (the error's
#: class and first line), ``state`` (``"live"``: the last finished step's;
#: ``"after_update"``: the failing step's update was over, ``after_update`` naming the
#: ranks saved then), ``missing`` (the ranks whose own files, RNG streams and data
#: position, could not be written: a dead or stuck rank), ``from_peers`` (the ranks whose
#: files a live rank wrote from their published copy), ``committed_by`` (when not 0).
#: Absent from every other checkpoint. A failure save with missing ranks is
#: *incomplete*: intact on disk, readable by ``inspect``, never resumed from.
FAILURE = "failure"
STEP_RE = re.compile(r"^step_(\d+)$")
#: A checkpoint a same-step re-save renamed aside, before renaming the new one in (see
#: ``commit._replace``): while ``step_<N>`` itself is missing, it is that checkpoint.
ASIDE_RE = re.compile(r"^\.aside-(step_(\d+))$")
#: The largest manifest read (a 1,024-rank sharded checkpoint's is ~1 MB): a bigger
#: ``manifest.json`` is not one guardrails wrote, and is not read into memory.
MAX_MANIFEST_BYTES = 256 << 20


class ManifestError(Exception):
    """A manifest that cannot be used: ``path`` names the file, ``field`` the field
    (``None``: the file as a whole), ``message`` says why. ``too_new``: intact, but
    written in a format newer than this guardrails reads (a resume error, not
    corruption); ``hint`` then says what to do."""

    def __init__(
        self,
        message: str,
        *,
        path: str,
        field: str | None = None,
        too_new: bool = False,
        hint: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.path = path
        self.field = field
        self.too_new = too_new
        self.hint = hint


# ---------------------------------------------------------------- the manifest's schema


_STEM_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def _file_name(name: Any, field: str) -> str:
    """A listed file's name: relative, normalised, inside the checkpoint directory."""
    if not isinstance(name, str) or not name:
        raise Bad(field, f"names a file {_show(name)}, not a relative path")
    p = PurePosixPath(name)
    if p.is_absolute() or name.startswith("\\") or ".." in p.parts or "\\" in name:
        raise Bad(field, f"names {name!r}, which is outside the checkpoint directory")
    if "\x00" in name or str(p) != name or "." in p.parts or name == MANIFEST:
        raise Bad(field, f"names {name!r}, not a file name guardrails writes")
    return name


def check_manifest(m: Any) -> None:
    """The manifest's schema (format 1-4): raises :class:`Bad` naming the field. Keys
    it does not know are allowed (a later guardrails of the same format may add some);
    a wrong type, a negative or impossible number, a name outside the directory is not.
    The format and version are checked by :func:`read_manifest`, before this."""
    _int(m["step"], "step")
    files = _mapping(m["files"], "files")
    for name, entry in files.items():
        field = _key("files", name)
        _file_name(name, field)
        entry = _mapping(entry, field)
        for key in ("bytes", "sha256"):
            if key not in entry:
                raise Bad(f"{field}.{key}", "is missing")
        _int(entry["bytes"], f"{field}.bytes")
        if not _HEX64.match(_str(entry["sha256"], f"{field}.sha256")):
            raise Bad(f"{field}.sha256", f"is {_show(entry['sha256'])}, not 64 hex digits")
        if digest.CHUNK_KEY in entry:
            _int(entry[digest.CHUNK_KEY], f"{field}.{digest.CHUNK_KEY}", low=1)
    world = _int(m.get("world_size", 1), "world_size", low=1, high=2**31)
    if "ranks" in m:
        for i, r in enumerate(_list(m["ranks"], "ranks")):
            _int(r, f"ranks[{i}]", high=world - 1)
    if m.get("time") is not None:
        _number(m["time"], "time")
    if SEQ in m:
        _int(m[SEQ], SEQ, low=1)
    for key in ("guardrails", "torch"):
        if m.get(key) is not None:
            _str(m[key], key)
    if SELF_HASH in m:
        _str(m[SELF_HASH], SELF_HASH)
    if "contents" in m:
        contents = _contents(m)  # a key it lacks: what the file names say (formats 1-2)
        _mapping(m["contents"], "contents")
        for name, entry in _mapping(contents["optimizers"], "contents.optimizers").items():
            field = _key("contents.optimizers", name)
            entry = _mapping(entry, field)
            if "file" not in entry:
                raise Bad(f"{field}.file", "is missing")
            if not _STEM_RE.match(_str(entry["file"], f"{field}.file")) or ".." in entry["file"]:
                raise Bad(f"{field}.file", f"is {entry['file']!r}, not a file stem")
            if not isinstance(entry.get("per_rank", False), bool):
                raise Bad(f"{field}.per_rank", f"is {_show(entry['per_rank'])}, not true/false")
        for name, stem in _mapping(contents["schedulers"], "contents.schedulers").items():
            field = _key("contents.schedulers", name)
            if not _STEM_RE.match(_str(stem, field)) or ".." in stem:
                raise Bad(field, f"is {stem!r}, not a file stem")
        if contents.get("classes") is not None:
            for key, cls in _mapping(contents["classes"], "contents.classes").items():
                _str(cls, _key("contents.classes", key))
    if m.get("run") is not None:
        run = _mapping(m["run"], "run")
        for key in ("config", "optimizer_settings"):
            if run.get(key) is not None:
                _mapping(run[key], f"run.{key}")
        if run.get("finished_at") is not None:
            _number(run["finished_at"], "run.finished_at")
    if m.get(FAILURE) is not None:
        failure = _mapping(m[FAILURE], FAILURE)
        for key in ("cause", "state"):
            _str(failure.get(key), f"{FAILURE}.{key}")
        for i, r in enumerate(_list(failure.get("missing", []), f"{FAILURE}.missing")):
            _int(r, f"{FAILURE}.missing[{i}]", high=world - 1)


def read_manifest(ckpt: Path) -> dict[str, Any]:
    """``ckpt``'s manifest, checked (a regular file, strict JSON, its own hash, format
    and version, the schema: :func:`check_manifest`); raises :class:`ManifestError`
    naming the field. The files it lists are not read here."""
    f = ckpt / MANIFEST
    why = not_regular(f)
    if why is not None:
        if why.endswith("is missing"):
            why = f"{f} is missing: the save that wrote {ckpt.name} did not finish"
        raise ManifestError(why, path=str(f))
    try:
        manifest = parse_json(read_bytes(f, limit=MAX_MANIFEST_BYTES))
        if not isinstance(manifest, dict):
            raise Bad("", f"is a {_json_type(manifest)} ({_show(manifest)}), not an object")
        if SELF_HASH in manifest and manifest[SELF_HASH] != _self_hash(manifest):
            raise ManifestError(
                f"{f} is corrupt: its own checksum does not match its contents (field "
                f"{SELF_HASH}: the step, the file list or a file's size or hash was changed "
                "after it was written)",
                path=str(f),
                field=SELF_HASH,
            )
        for key in ("format", "format_version", "step", "files"):
            if key not in manifest:
                raise Bad(key, "is missing")
        if manifest["format"] != FORMAT:
            raise Bad("format", f"is {_show(manifest['format'])}, not {FORMAT!r}")
        version = _int(manifest["format_version"], "format_version", low=1, high=1000)
        if version > FORMAT_VERSION:
            if SELF_HASH not in manifest:  # every format past 4 writes it
                raise Bad(
                    "format_version",
                    f"is {version}, newer than this guardrails reads ({FORMAT_VERSION}), "
                    f"and the manifest has no {SELF_HASH}, which every newer format writes",
                )
            raise ManifestError(
                f"{ckpt} has checkpoint format {version} (field format_version of {f}); "
                f"this guardrails ({__version__}) reads up to format {FORMAT_VERSION}",
                path=str(ckpt),
                field="format_version",
                too_new=True,
                hint="upgrade guardrails to the version that wrote it "
                f"({manifest.get('guardrails')}).",
            )
        check_manifest(manifest)
        named = STEP_RE.match(ckpt.name) or STEP_RE.match(ckpt.resolve().name)
        if named and int(named.group(1)) != manifest["step"]:
            raise Bad("step", f"is {manifest['step']}, but the directory is {named.group(0)}")
    except Bad as e:
        raise ManifestError(f"{f} is corrupt: {e}", path=str(f), field=e.field or None) from None
    except (OSError, RecursionError) as e:  # a read error; a _self_hash of a deep value
        raise ManifestError(f"{f} cannot be read: {e}", path=str(f)) from None
    return manifest


# --------------------------------------------------------------------- the whole check


def problem(
    ckpt: Path,
    *,
    entry: bool = False,
    metadata_check: Callable[[Path], str | None] | None = None,
    hash_bytes: bool = True,
) -> tuple[str, str] | None:
    """``(file, why)`` for the first problem found in ``ckpt``, or ``None``. Reads every
    listed byte once (sha256, in parallel for large files: :mod:`guardrails.checkpoint.digest`),
    then checks each listed file's content (:func:`content_problem`). ``entry``:
    ``ckpt`` was found under a root (not named by the user), so it must be a directory
    of its own, not a link. ``metadata_check(path)``: why DCP's ``.metadata`` cannot be
    read, or ``None`` (it needs torch; :mod:`guardrails.checkpoint.sharded`). A format newer than
    this guardrails reads is not a problem of the checkpoint: it raises
    :class:`ManifestError` (``too_new``). ``hash_bytes=False``: every check but the
    files' sha256 (sizes, headers and contents still), for ``report``, which marks the
    checkpoints resume would refuse without reading every byte of each."""
    if entry:
        try:
            st = os.lstat(ckpt)
        except OSError as e:
            return str(ckpt), f"{ckpt} cannot be read: {e.strerror or e}"
        if stat.S_ISLNK(st.st_mode):
            return str(ckpt), (
                f"{ckpt} is a link (to {_target(ckpt)}): a checkpoint found under the run's "
                "checkpoint directory must be a directory of its own (name it explicitly "
                "to resume from it)"
            )
    try:
        manifest = read_manifest(ckpt)
    except ManifestError as e:
        if e.too_new:
            raise
        return e.path, e.message
    found = incomplete(ckpt, manifest)
    if found is not None:
        return found
    files = manifest["files"]
    world = int(manifest.get("world_size", 1))
    contents = _contents(manifest)
    for name, opt in contents["optimizers"].items():
        if not opt.get("per_rank"):
            continue
        missing = [r for r in range(world) if f"{_rank_name(r)}.{opt['file']}.json" not in files]
        if missing:
            f = ckpt / f"{_rank_name(missing[0])}.{opt['file']}.json"
            return str(f), (
                f"rank(s) [{shorten(missing, 5)}]'s part of optimizer {name!r}'s state is "
                f"missing from {ckpt.name} (each of the {world} ranks holds a different part)"
            )
    for name, rec in files.items():
        f = ckpt / name
        # Which of the two changed, the file or its entry, cannot be told: say both.
        entry = f'{MANIFEST}, field files["{name}"]'
        why = not_regular(f, inside=ckpt)
        if why is not None:
            return str(f), why + (f" (listed in {entry})" if why.endswith("missing") else "")
        size = f.stat().st_size
        if size != rec["bytes"]:
            why = (
                f"{f} is truncated or overwritten: {size} bytes, the manifest says "
                f"{rec['bytes']} ({entry}.bytes)"
            )
            return str(f), why
        if not hash_bytes:
            continue
        try:
            matches = digest.digest(f, rec) == rec["sha256"]
        except (OSError, ValueError) as e:
            return str(f), f"{f} cannot be verified: {e}"
        if not matches:
            return str(
                f
            ), f"{f} is corrupt: its sha256 does not match the manifest ({entry}.sha256)"
    found = content_problem(ckpt, manifest)
    if found is None and metadata_check is not None and "dcp/.metadata" in files:
        why = metadata_check(ckpt / "dcp")
        if why is not None:
            found = str(ckpt / "dcp" / ".metadata"), why
    return found


def incomplete(ckpt: Path, manifest: Mapping[str, Any]) -> tuple[str, str] | None:
    """``(manifest, why)`` when ``ckpt`` is a failure save that not every rank could
    write (:data:`FAILURE`'s ``missing``), else ``None``: its files are intact, but the
    missing ranks' RNG streams and data position are not there to resume."""
    failure = manifest.get(FAILURE) or {}
    missing = failure.get("missing") or []
    if not missing:
        return None
    return str(ckpt / MANIFEST), (
        f"{ckpt.name} is an incomplete failure save (after {failure.get('cause')}): "
        f"rank(s) [{shorten(missing, 5)}] died or were stuck and could not write their "
        "RNG streams and data position"
    )


def only_incomplete(ckpts: list[Path]) -> bool:
    """Whether ``ckpts`` holds at least one checkpoint and every one is an incomplete
    failure save (:func:`incomplete`): ``resume="auto"`` then starts fresh, as it would
    have before that save, instead of calling the directory invalid. A checkpoint whose
    manifest cannot be read is not one of them: it is left to the full check, which
    names the damage."""
    if not ckpts:
        return False
    for ckpt in ckpts:
        try:
            if incomplete(ckpt, read_manifest(ckpt)) is None:
                return False
        except (ManifestError, OSError, ValueError, KeyError, TypeError):
            return False
    return True


def content_problem(ckpt: Path, manifest: Mapping[str, Any]) -> tuple[str, str] | None:
    """``(file, why)`` for the first listed file whose content does not fit what
    guardrails writes there (the sizes and hashes already checked: this is damage that
    every checksum agrees with, an edit or a writer's bug), or ``None``. Reads the JSON
    files and the .safetensors headers, not the tensors: 2 ms for a one-rank checkpoint,
    0.5 ms more per rank (its rank<R>.json, mostly RNG state); verifying a 604 MB
    checkpoint took 1.13-1.15 s with these checks and 1.19-1.23 s without (medians of
    5, a loaded CPU host: the sha256 of every byte is the cost)."""
    files = manifest["files"]
    headers: dict[str, dict[str, Any]] = {}
    found = _read_headers(ckpt, files, headers) or _rng_tensor_problem(ckpt, headers)
    if found is not None:
        return found
    checks = _state_checks(files, headers)
    found = _add_optimizer_checks(ckpt, manifest, headers, checks)
    found = found or _add_scheduler_checks(ckpt, manifest, checks)
    if found is not None:
        return found
    if "scaler.json" in files:
        checks.append(("scaler.json", check_scaler_state))
    for name, check in checks:
        f = ckpt / name
        try:
            check(read_json(f))
        except Bad as e:
            return str(f), f"{f} is corrupt: {e}"
        except (OSError, RecursionError) as e:
            return str(f), f"{f} cannot be read: {e}"
    return None


#: A listed JSON file and the check of its parsed content (raises :class:`Bad`).
_Check = tuple[str, Callable[[Any], None]]


def _read_headers(
    ckpt: Path, files: Mapping[str, Any], headers: dict[str, dict[str, Any]]
) -> tuple[str, str] | None:
    """Every listed ``.safetensors`` header, checked, into ``headers``; the first
    problem, or ``None``."""
    for name in files:
        if name.endswith(".safetensors"):
            f = ckpt / name
            try:
                headers[name] = safetensors_header(f, files[name]["bytes"])
            except Bad as e:
                return str(f), f"{f} is not a safetensors file guardrails wrote: {e}"
            except OSError as e:
                return str(f), f"{f} cannot be read: {e}"
    return None


def _rng_tensor_problem(ckpt: Path, headers: Mapping[str, Any]) -> tuple[str, str] | None:
    """An RNG state saved as anything but a 1-D byte tensor, or ``None``."""
    for name, header in headers.items():
        if re.match(r"^(rank\d{5}|rng)\.safetensors$", name):
            for key, entry in header.items():
                rng = key == "torch.cpu" or key.startswith("torch.cuda.")
                if rng and (entry["dtype"] != "U8" or len(entry["shape"]) != 1):
                    f = ckpt / name
                    return str(f), (
                        f"{f} is corrupt: field {key} (an RNG state) is a {entry['dtype']} "
                        f"tensor of shape {entry['shape']}, not a 1-D U8 (byte) tensor"
                    )
    return None


def _state_checks(files: Mapping[str, Any], headers: Mapping[str, Any]) -> list[_Check]:
    """The checks of the extras, each rank's file and the format-1 ``rng.json``."""
    checks: list[_Check] = []
    if "extras.json" in files:
        extras_header = headers.get("extras.safetensors")
        checks.append(("extras.json", lambda d: _check_extras(d, extras_header)))
    for name in files:
        m = re.match(r"^rank(\d{5})\.json$", name)
        if m:
            header = headers.get(f"{name[:-5]}.safetensors")
            checks.append(
                (name, functools.partial(_rank_check, rank=int(m.group(1)), header=header))
            )
    if "rng.json" in files:
        checks.append(("rng.json", lambda d: check_rng(d, "")))
    return checks


def _optimizer_stems(manifest: Mapping[str, Any]) -> list[tuple[str, str, bool]]:
    """``(file stem, optimizer name, per rank)`` of every optimizer state file the
    manifest's contents name: one per rank for an optimizer whose ranks hold parts."""
    stems: list[tuple[str, str, bool]] = []
    for opt_name, opt in _contents(manifest)["optimizers"].items():
        if opt.get("per_rank"):
            stems += [
                (f"{_rank_name(r)}.{opt['file']}", opt_name, True)
                for r in range(int(manifest.get("world_size", 1)))
            ]
        else:
            stems.append((opt["file"], opt_name, False))
    return stems


def _add_optimizer_checks(
    ckpt: Path, manifest: Mapping[str, Any], headers: Mapping[str, Any], checks: list[_Check]
) -> tuple[str, str] | None:
    """Each optimizer's state check, against its tensors' header and its class, into
    ``checks``; an optimizer the contents name whose file is not listed, or ``None``."""
    files = manifest["files"]
    classes = _contents(manifest).get("classes") or {}
    for stem, opt_name, per_rank in _optimizer_stems(manifest):
        if f"{stem}.json" not in files:
            if per_rank or "dcp/.metadata" in files:
                continue  # said above, by problem(); a sharded optimizer's is in dcp/
            return str(ckpt / f"{stem}.json"), (
                f"{ckpt / MANIFEST} names optimizer {opt_name!r}'s state (field contents."
                f"optimizers), but {stem}.json is not among the files it lists"
            )
        header = headers.get(f"{stem}.safetensors")
        cls = classes.get(f"optimizer:{opt_name}")
        checks.append((f"{stem}.json", lambda d, h=header, c=cls: check_optimizer_state(d, h, c)))
    return None


def _add_scheduler_checks(
    ckpt: Path, manifest: Mapping[str, Any], checks: list[_Check]
) -> tuple[str, str] | None:
    """Each scheduler's state check into ``checks`` (a lone scheduler of a lone
    optimizer: one lr per param group); a scheduler the contents name with neither
    file listed, or ``None``."""
    files = manifest["files"]
    stems = _optimizer_stems(manifest)
    groups = None  # the lone optimizer's number of param groups, where it is one
    if len(stems) == 1 and not stems[0][2] and f"{stems[0][0]}.json" in files:
        try:
            groups = len(read_json(ckpt / f"{stems[0][0]}.json")["param_groups"])
        except (OSError, Bad, RecursionError, KeyError, TypeError):
            groups = None  # said below, by its own check
    schedulers = _contents(manifest)["schedulers"]
    for sched_name, stem in schedulers.items():
        if f"{stem}.json" in files:
            lone = groups if len(schedulers) == 1 else None
            checks.append((f"{stem}.json", lambda d, n=lone: check_scheduler_state(d, n)))
        elif f"{stem}.pt" not in files:
            return str(ckpt / f"{stem}.json"), (
                f"{ckpt / MANIFEST} names scheduler {sched_name!r}'s state (field contents."
                f"schedulers), but neither {stem}.json nor {stem}.pt is among its files"
            )
    return None


# ------------------------------------------------------------------------ the listing


def list_checkpoints(root: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """``(step, dir)`` of every ``step_*`` directory under ``root`` (a link to one
    included: :func:`problem` with ``entry`` says why it is not used), oldest first,
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
    saves low steps next to its high ones, and "the highest step" is the other run's.
    Each checkpoint's manifest names its run (``run.id``, carried over by every
    resume); runs are ordered by the sequence number of their newest save (``seq``,
    counted per checkpoint directory: no clock is compared), by its time only between
    checkpoints written before sequence numbers, and within a run by step.
    Checkpoints without a run id (written before it, or by ``save_checkpoint``) and
    those whose manifest cannot be read form one group; a directory holding only those
    is tried by step alone. Reads only the manifests (no hashing)."""
    groups: dict[str | None, list[tuple[int, Path]]] = {}
    newest: dict[str | None, tuple[int, float]] = {}
    unreadable: list[tuple[int, Path]] = []
    for step, ckpt in found:
        run_id, when, readable, seq = _manifest_fields(ckpt)
        if not readable:
            unreadable.append((step, ckpt))
            continue
        groups.setdefault(run_id, []).append((step, ckpt))
        # The save sequence first (hosts' clocks need not agree: a run on a host whose
        # clock was an hour behind saved "before" the one it came after), the time
        # only between checkpoints written before sequence numbers (seq 0).
        newest[run_id] = max(newest.get(run_id, (0, -1.0)), (seq, when))
    runs = [groups[r] for r in sorted(groups, key=lambda r: newest[r], reverse=True)]
    # A checkpoint whose manifest cannot be read belongs to no known run: it is tried
    # by step with the run tried first, so a damaged newest checkpoint is judged (and
    # its skip said) instead of passed over in silence.
    runs = [runs[0] + unreadable, *runs[1:]] if runs else [unreadable]
    out: list[tuple[int, Path]] = []
    for run in runs:
        out += sorted(run, key=lambda sp: sp[0], reverse=True)
    return out


def highest_seq(root: Path) -> int:
    """The highest save sequence number (a manifest's ``seq``) under ``root``, 0 when
    none has one: read from every manifest (no hashing), once per writer."""
    high = 0
    with contextlib.suppress(OSError):
        for _, ckpt in list_checkpoints(root):
            high = max(high, _manifest_fields(ckpt)[3])
    return high


def run_of(ckpt: Path) -> str | None:
    """The id of the run that saved ``ckpt`` (its manifest's ``run.id``), or ``None``."""
    return _manifest_fields(ckpt)[0]


def _manifest_fields(ckpt: Path) -> tuple[str | None, float, bool, int]:
    """``(run id, save time, readable, save sequence number)`` from ``ckpt``'s
    manifest, unverified; ``(None, -1, False, 0)`` when it cannot be read (seq 0: none
    recorded). Only a regular file of sane size is opened: a FIFO named manifest.json
    would block the read forever."""
    f = ckpt / MANIFEST
    try:
        st = os.lstat(f)
        if not stat.S_ISREG(st.st_mode) or st.st_size > _MANIFEST_MAX_BYTES:
            return None, -1.0, False, 0
        manifest = json.loads(f.read_bytes())
        run = manifest.get("run") or {}
        run_id = run.get("id") if isinstance(run, dict) else None
        when = manifest.get("time")
        seq = manifest.get(SEQ)
        return (
            run_id if isinstance(run_id, str) else None,
            float(when) if isinstance(when, (int, float)) else -1.0,
            True,
            seq if isinstance(seq, int) and not isinstance(seq, bool) and seq > 0 else 0,
        )
    except (OSError, ValueError, AttributeError):
        return None, -1.0, False, 0


#: A manifest is a few KB per file it lists; one over this is not one.
_MANIFEST_MAX_BYTES = 64 << 20


def _contents(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """A manifest's ``contents``; for formats 1-2 (one optimizer and scheduler, saved
    by rank 0), and for a key a ``contents`` lacks (``commit(contents=None)`` writes
    ``{}``), what its file names say."""
    given = manifest.get("contents")
    if isinstance(given, dict) and "optimizers" in given and "schedulers" in given:
        return given
    files = manifest["files"]
    derived = {
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
    return {**derived, **given} if isinstance(given, dict) else derived


def _rank_name(rank: int) -> str:
    return f"rank{rank:05d}"


def _self_hash(manifest: Mapping[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != SELF_HASH}
    return hashlib.sha256(_dumps(body)).hexdigest()


def _dumps(obj: Any) -> bytes:
    # allow_nan: a scheduler's best=inf must round-trip exactly; these files are read
    # back by Python's json, which reads Infinity/NaN.
    return json.dumps(obj, indent=1, allow_nan=True).encode()


def rerun_text(root: Path, ours: Path | None) -> str:
    """Which checkpoint of ``root`` a re-run resumes, in words: the newest complete one on
    disk but ``ours`` (a background save may have committed it without this rank hearing
    so yet)."""
    with contextlib.suppress(OSError):
        for step, ckpt in resume_order(list_checkpoints(root)):
            with contextlib.suppress(ManifestError):
                if ckpt != ours and incomplete(ckpt, read_manifest(ckpt)) is None:
                    return f"a re-run resumes the latest complete checkpoint, {ckpt} (step {step})"
    return "no complete checkpoint is left, so a re-run starts from scratch"
