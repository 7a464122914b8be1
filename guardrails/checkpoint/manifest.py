"""A checkpoint's files as bytes on disk: the manifest, its schema, the file checks, the
``step_*`` names.

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
without importing torch (``inspect`` starts in 0.15 s median on a loaded 2-core CPU VM,
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
import math
import os
import random
import re
import stat
import struct
from collections.abc import Callable, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from guardrails._version import __version__
from guardrails.checkpoint import digest
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
STEP_RE = re.compile(r"^step_(\d+)$")
#: A checkpoint a same-step re-save renamed aside, before renaming the new one in (see
#: ``commit._replace``): while ``step_<N>`` itself is missing, it is that checkpoint.
ASIDE_RE = re.compile(r"^\.aside-(step_(\d+))$")
#: Header metadata key of a .safetensors file that maps alias key -> stored key.
ALIASES_KEY = "guardrails.aliases"
#: The largest manifest read (a 1,024-rank sharded checkpoint's is ~1 MB): a bigger
#: ``manifest.json`` is not one guardrails wrote, and is not read into memory.
MAX_MANIFEST_BYTES = 256 << 20
#: The largest .safetensors header read (safetensors' own limit is 100 MB).
MAX_HEADER_BYTES = 100_000_000
#: The largest integer a count, size or position may be (int64, what torch and the OS
#: hold): 10**30 in a manifest is damage, and would overflow further down.
MAX_INT = 2**63 - 1
#: Data positions as :mod:`guardrails.engine.data` writes them.
DATA_KINDS = ("state_dict", "replay", "fast_forward")
#: torch.optim classes whose per-parameter state values are tensors, numbers or None,
#: and whose elementwise states (below) have their parameter's shape. (Adafactor's
#: factored and LBFGS's list-valued states are not, nor a user's Muon, which may stack
#: a group's momenta.)
PLAIN_OPTIMIZERS = frozenset(
    {"Adam", "AdamW", "SGD", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam", "RMSprop"}
    | {"Rprop", "ASGD"}
)
ELEMENTWISE_STATE = frozenset(
    {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "sum"}
    | {"acc_delta", "grad_avg", "prev", "ax"}  # not NAdam's mu_product: a scalar
)
#: Bytes per element of each safetensors dtype (its format spec).
_DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U64": 8,
    "U32": 4,
    "U16": 2,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "C64": 8,
}


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


class Bad(Exception):
    """A listed file whose content does not fit its schema: ``field`` names where
    (``data.batch_in_epoch``, ``files["model.safetensors"].bytes``)."""

    def __init__(self, field: str, why: str) -> None:
        super().__init__(f"field {field} {why}" if field else f"the file {why}")
        self.field = field
        self.why = why


# --------------------------------------------------------------------- reading files


def not_regular(f: Path, *, inside: Path | None = None) -> str | None:
    """Why ``f`` cannot be read as one of a checkpoint's own files, or ``None``: it
    must exist and be a regular file, not a link (followed, it could read anything on
    the machine) or a FIFO (opening one blocks until someone writes: ``inspect`` hung
    on a FIFO named manifest.json), a device or a directory. ``inside``: the checkpoint
    directory, whose subdirectories on the way (``dcp/``) must not be links either.
    Judged with ``lstat``, before anything is opened."""
    if inside is not None:
        for parent in reversed(f.relative_to(inside).parents[:-1]):
            p = inside / parent
            try:
                st = os.lstat(p)
            except OSError:
                return f"{p} is missing"
            if stat.S_ISLNK(st.st_mode):
                return f"{p} is a link (to {_target(p)}): a checkpoint holds only its own files"
            if not stat.S_ISDIR(st.st_mode):
                return f"{p} is not a directory"
    try:
        st = os.lstat(f)
    except FileNotFoundError:
        return f"{f} is missing"
    except OSError as e:
        return f"{f} cannot be read: {e.strerror or e}"
    if stat.S_ISLNK(st.st_mode):
        return f"{f} is a link (to {_target(f)}): a checkpoint holds only its own files"
    if not stat.S_ISREG(st.st_mode):
        return f"{f} is not a regular file (it is {_kind(st.st_mode)}): it is never opened"
    return None


def _target(link: Path) -> str:
    try:
        return os.readlink(link)
    except OSError:
        return "?"


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "not a file"


def open_regular(f: Path) -> int:
    """An fd for reading ``f``, a regular file (checked with :func:`not_regular` first,
    and again on the open fd: no link is followed and a FIFO swapped in meanwhile does
    not block, ``O_NONBLOCK``). Raises ``OSError`` naming why not."""
    why = not_regular(f)
    if why is not None:
        raise OSError(why)
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    fd = os.open(f, flags | getattr(os, "O_CLOEXEC", 0))
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"{f} is not a regular file")
    return fd


def read_bytes(f: Path, *, limit: int | None = None) -> bytes:
    """``f``'s bytes, ``f`` a regular file (:func:`open_regular`), at most ``limit``."""
    fd = open_regular(f)
    try:
        size = os.fstat(fd).st_size
        if limit is not None and size > limit:
            raise OSError(f"{f} is {size} bytes, more than the {limit} a checkpoint's holds")
        chunks = []
        while block := os.read(fd, 1 << 24):
            chunks.append(block)
        return b"".join(chunks)
    finally:
        os.close(fd)


def parse_json(raw: bytes) -> Any:
    """Strict JSON as guardrails writes it: UTF-8, no duplicate keys (a reader would
    silently take the last), nesting a parser can follow; ``NaN`` / ``Infinity`` are
    allowed (a scheduler's ``best=inf`` is saved so). Raises :class:`Bad`."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise Bad(
            "", f"is not UTF-8 text (byte {e.start}: {raw[e.start : e.start + 1]!r})"
        ) from None
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates)
    except RecursionError:
        raise Bad(
            "", "is not JSON guardrails wrote: it nests deeper than a parser follows"
        ) from None
    except ValueError as e:  # JSONDecodeError, a number of more than 4,300 digits
        raise Bad("", f"is not valid JSON: {e}") from None


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise ValueError(f"the key {dup!r} appears twice (field {dup})")
    return out


def read_json(f: Path) -> Any:
    """A listed JSON file, strictly (:func:`parse_json`); :class:`Bad` or ``OSError``."""
    return parse_json(read_bytes(f))


# ------------------------------------------------------------------------- the schema


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:30]}... ({len(text)} characters)"


def _int(value: Any, field: str, *, low: int = 0, high: int = MAX_INT) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise Bad(field, f"is {_show(value)}, not an integer")
    if value < low:
        raise Bad(
            field, f"is {_show(value)}, which is " + ("negative" if low == 0 else f"below {low}")
        )
    if value > high:
        raise Bad(field, f"is {_show(value)}, more than {high}")
    return value


def _number(value: Any, field: str, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Bad(field, f"is {_show(value)}, not a number")
    if positive and not (math.isfinite(value) and value > 0):
        raise Bad(field, f"is {_show(value)}, not a positive finite number")
    return value


def _mapping(value: Any, field: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise Bad(field, f"is a {_json_type(value)} ({_show(value)}), not an object")
    return value


def _json_type(value: Any) -> str:
    return {list: "list", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number" if isinstance(value, (int, float)) else type(value).__name__
    )


def _list(value: Any, field: str, *, length: int | None = None) -> list[Any]:
    if not isinstance(value, list):
        raise Bad(field, f"is a {_json_type(value)} ({_show(value)}), not a list")
    if length is not None and len(value) != length:
        raise Bad(field, f"has {len(value)} items, not {length}")
    return value


def _str(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise Bad(field, f"is {_show(value)}, not a string")
    return value


def _key(field: str, key: str) -> str:
    return f'{field}["{key}"]'


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
) -> tuple[str, str] | None:
    """``(file, why)`` for the first problem found in ``ckpt``, or ``None``. Reads every
    listed byte once (sha256, in parallel for large files: :mod:`guardrails.checkpoint.digest`),
    then checks each listed file's content (:func:`content_problem`). ``entry``:
    ``ckpt`` was found under a root (not named by the user), so it must be a directory
    of its own, not a link. ``metadata_check(path)``: why DCP's ``.metadata`` cannot be
    read, or ``None`` (it needs torch; :mod:`guardrails.checkpoint.sharded`). A format newer than
    this guardrails reads is not a problem of the checkpoint: it raises
    :class:`ManifestError` (``too_new``)."""
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


def content_problem(ckpt: Path, manifest: Mapping[str, Any]) -> tuple[str, str] | None:
    """``(file, why)`` for the first listed file whose content does not fit what
    guardrails writes there (the sizes and hashes already checked: this is damage that
    every checksum agrees with, an edit or a writer's bug), or ``None``. Reads the JSON
    files and the .safetensors headers, not the tensors: 2 ms for a one-rank checkpoint,
    0.5 ms more per rank (its rank<R>.json, mostly RNG state); verifying a 604 MB
    checkpoint took 1.13-1.15 s with these checks and 1.19-1.23 s without (medians of
    5, a loaded 2-core CPU VM: the sha256 of every byte is the cost)."""
    files = manifest["files"]
    contents = _contents(manifest)
    classes = contents.get("classes") or {}
    headers: dict[str, dict[str, Any]] = {}
    for name in files:
        if name.endswith(".safetensors"):
            f = ckpt / name
            try:
                headers[name] = safetensors_header(f, files[name]["bytes"])
            except Bad as e:
                return str(f), f"{f} is not a safetensors file guardrails wrote: {e}"
            except OSError as e:
                return str(f), f"{f} cannot be read: {e}"
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
    checks: list[tuple[str, Callable[[Any], None]]] = []
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
    stems: list[tuple[str, str, bool]] = []  # (stem, optimizer name, per rank)
    for opt_name, opt in contents["optimizers"].items():
        if opt.get("per_rank"):
            stems += [
                (f"{_rank_name(r)}.{opt['file']}", opt_name, True)
                for r in range(int(manifest.get("world_size", 1)))
            ]
        else:
            stems.append((opt["file"], opt_name, False))
    for stem, opt_name, per_rank in stems:
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
    groups = None  # the lone optimizer's number of param groups, where it is one
    if len(stems) == 1 and not stems[0][2] and f"{stems[0][0]}.json" in files:
        try:
            groups = len(read_json(ckpt / f"{stems[0][0]}.json")["param_groups"])
        except (OSError, Bad, RecursionError, KeyError, TypeError):
            groups = None  # said below, by its own check
    for sched_name, stem in contents["schedulers"].items():
        if f"{stem}.json" in files:
            lone = groups if len(contents["schedulers"]) == 1 else None
            checks.append((f"{stem}.json", lambda d, n=lone: check_scheduler_state(d, n)))
        elif f"{stem}.pt" not in files:
            return str(ckpt / f"{stem}.json"), (
                f"{ckpt / MANIFEST} names scheduler {sched_name!r}'s state (field contents."
                f"schedulers), but neither {stem}.json nor {stem}.pt is among its files"
            )
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


# ------------------------------------------------------------------ the files' schemas


def safetensors_header(f: Path, size: int) -> dict[str, Any]:
    """``f``'s safetensors header, checked against the format (its spec,
    https://github.com/huggingface/safetensors#format): 8 bytes of little-endian
    length, a UTF-8 JSON object of tensors (dtype, shape, data offsets) and string
    metadata, then the tensors' bytes, which the offsets must tile exactly; a
    ``guardrails.aliases`` entry must map keys to stored tensors. Raises :class:`Bad`."""
    fd = open_regular(f)
    try:
        head = os.pread(fd, 8, 0)
        if len(head) < 8:
            raise Bad("", f"is {len(head)} bytes, shorter than a header length")
        (n,) = struct.unpack("<Q", head)
        if not 2 <= n <= min(size - 8, MAX_HEADER_BYTES):
            raise Bad("header length", f"is {n}, which does not fit a file of {size} bytes")
        raw = os.pread(fd, n, 8)
    finally:
        os.close(fd)
    try:
        header = parse_json(raw)
    except Bad as e:
        raise Bad("header", e.why) from None
    header = _mapping(header, "header")
    data = size - 8 - n
    spans = []
    for key, entry in header.items():
        if key == "__metadata__":
            for k, v in _mapping(entry, "__metadata__").items():
                _str(v, _key("__metadata__", k))
            continue
        field = _key("header", key)
        entry = _mapping(entry, field)
        dtype = _str(entry.get("dtype"), f"{field}.dtype")
        shape = [
            _int(d, f"{field}.shape[{i}]")
            for i, d in enumerate(_list(entry.get("shape"), f"{field}.shape"))
        ]
        begin, end = _list(entry.get("data_offsets"), f"{field}.data_offsets", length=2)
        begin = _int(begin, f"{field}.data_offsets[0]", high=data)
        end = _int(end, f"{field}.data_offsets[1]", low=begin, high=data)
        if dtype in _DTYPE_BYTES and end - begin != math.prod(shape) * _DTYPE_BYTES[dtype]:
            raise Bad(
                f"{field}.data_offsets",
                f"span {end - begin} bytes, but a {dtype} tensor of shape {shape} is "
                f"{math.prod(shape) * _DTYPE_BYTES[dtype]}",
            )
        spans.append((begin, end, key))
    at = 0
    for begin, end, key in sorted(spans):
        if begin != at:
            raise Bad(_key("header", key) + ".data_offsets", f"start at {begin}, not {at}")
        at = end
    if at != data:
        raise Bad("header", f"its tensors cover {at} of the {data} data bytes")
    meta = header.get("__metadata__") or {}
    if ALIASES_KEY in meta:
        try:
            aliases = parse_json(meta[ALIASES_KEY].encode())
        except Bad as e:
            raise Bad(_key("__metadata__", ALIASES_KEY), e.why) from None
        for alias, target in _mapping(aliases, _key("__metadata__", ALIASES_KEY)).items():
            if target not in header or target == "__metadata__":
                raise Bad(
                    _key("__metadata__", ALIASES_KEY),
                    f"maps {alias!r} to {_show(target)}, which the file does not hold",
                )
    return header


def tensor_keys(header: Mapping[str, Any] | None) -> set[str] | None:
    """The keys a .safetensors header holds, aliases included (``None``: no header)."""
    if header is None:
        return None
    keys = {k for k in header if k != "__metadata__"}
    meta = header.get("__metadata__") or {}
    if ALIASES_KEY in meta:
        keys |= set(json.loads(meta[ALIASES_KEY]))
    return keys


def _check_extras(doc: Any, header: Mapping[str, Any] | None) -> None:
    """extras.json: an object, each tensor it references held by extras.safetensors."""
    _mapping(doc, "")
    _refs_held(doc, header, "extras.safetensors")


def _refs_held(doc: Any, header: Mapping[str, Any] | None, holder: str) -> None:
    """Every tensor ``doc`` references is in ``header`` (the ``holder`` file's)."""
    keys = tensor_keys(header)
    for where, ref in _tensor_refs(doc, ""):
        if keys is None or ref not in keys:
            raise Bad(where.lstrip("."), f"references tensor {ref!r}, which {holder} does not hold")


def _tensor_refs(value: Any, field: str) -> list[tuple[str, str]]:
    """``(field, key)`` of every ``{"__tensor__": key}`` (with its ``device``, in the
    extras) under ``value``."""
    found = []
    stack = [(value, field)]
    while stack:
        v, where = stack.pop()
        if isinstance(v, dict):
            if "__tensor__" in v and set(v) <= {"__tensor__", "device"}:
                found.append((where, _str(v["__tensor__"], f"{where}.__tensor__")))
                continue
            stack += [(x, f"{where}.{k}") for k, x in v.items()]
        elif isinstance(v, list):
            stack += [(x, f"{where}[{i}]") for i, x in enumerate(v)]
    return found


def check_optimizer_state(
    doc: Any, header: Mapping[str, Any] | None, cls: str | None = None
) -> None:
    """An optimizer's ``<stem>.json`` (``state``, ``param_groups``, ``param_shapes``),
    against its ``.safetensors`` header: every tensor it references is there, every
    state belongs to a parameter of a group, each parameter once; for the plain
    torch.optim classes, states are tensors or numbers and elementwise ones have their
    parameter's saved shape."""
    doc = _mapping(doc, "")
    for key in ("state", "param_groups"):
        if key not in doc:
            raise Bad(key, "is missing")
    ids: list[int] = []
    for g, group in enumerate(_list(doc["param_groups"], "param_groups")):
        group = _mapping(group, f"param_groups[{g}]")
        params = _list(group.get("params"), f"param_groups[{g}].params")
        ids += [_int(p, f"param_groups[{g}].params[{i}]") for i, p in enumerate(params)]
        if cls in PLAIN_OPTIMIZERS:
            for key in _PLAIN_NUMBERS & group.keys():
                _number_or_tensor(group[key], f"param_groups[{g}].{key}")
            if "betas" in group:
                betas = group["betas"]
                if isinstance(betas, dict) and set(betas) == {"__tuple__"}:
                    betas = betas["__tuple__"]
                for i, b in enumerate(_list(betas, f"param_groups[{g}].betas", length=2)):
                    _number_or_tensor(b, f"param_groups[{g}].betas[{i}]")
    if len(set(ids)) != len(ids):
        raise Bad("param_groups", "lists a parameter twice")
    shapes = None
    if "param_shapes" in doc:
        shapes = _list(doc["param_shapes"], "param_shapes", length=len(ids))
        for i, s in enumerate(shapes):
            for j, d in enumerate(_list(s, f"param_shapes[{i}]")):
                _int(d, f"param_shapes[{i}][{j}]")
    state = _mapping(doc["state"], "state")
    position = {p: i for i, p in enumerate(ids)}
    for key, entry in state.items():
        field = _key("state", key)
        if not key.isdigit() or str(int(key)) != key or int(key) not in position:
            raise Bad(
                field,
                f"is the state of parameter {key!r}, which no param group lists "
                "(param_groups[*].params)",
            )
        entry = _mapping(entry, field)
        if cls in PLAIN_OPTIMIZERS:
            for name, v in entry.items():
                ok = v is None or (not isinstance(v, bool) and isinstance(v, (int, float)))
                if not (ok or (isinstance(v, dict) and set(v) == {"__tensor__"})):
                    raise Bad(f"{field}.{name}", f"is {_show(v)}, not a tensor or a number")
                if (
                    name in ELEMENTWISE_STATE
                    and isinstance(v, dict)
                    and shapes is not None
                    and header is not None
                    and v["__tensor__"] in header
                ):
                    saved = list(header[v["__tensor__"]]["shape"])
                    want = list(shapes[position[int(key)]])
                    if saved != want:
                        raise Bad(
                            f"{field}.{name}",
                            f"has shape {saved}, but its parameter was saved with {want}",
                        )
    _refs_held(doc, header, "the .safetensors file")


#: The number-valued settings of the plain torch.optim classes' param groups.
_PLAIN_NUMBERS = frozenset(
    {"lr", "initial_lr", "eps", "weight_decay", "momentum", "dampening", "alpha", "rho"}
    | {"lr_decay", "initial_accumulator_value", "lambd", "t0", "momentum_decay"}
)


def _number_or_tensor(value: Any, field: str) -> None:
    if not (isinstance(value, dict) and set(value) == {"__tensor__"}):
        _number(value, field)


def check_scheduler_state(doc: Any, groups: int | None = None) -> None:
    """A scheduler's JSON: an object; the fields every torch LR scheduler has, where
    present, of their types, one lr per param group of the optimizer it schedules
    (``groups``, where known); the rest is checked against the live scheduler at
    resume."""
    doc = _mapping(doc, "")
    if "last_epoch" in doc:
        _int(doc["last_epoch"], "last_epoch", low=-1)
    if "_step_count" in doc:
        _int(doc["_step_count"], "_step_count")
    for key in ("base_lrs", "_last_lr"):
        if key in doc:
            lrs = _list(doc[key], key, length=groups)
            for i, v in enumerate(lrs):
                _number(v, f"{key}[{i}]")


def check_scaler_state(doc: Any) -> None:
    """A GradScaler's JSON: ``{}`` (a disabled scaler) or its numbers, of their types."""
    doc = _mapping(doc, "")
    if "scale" in doc:
        _number(doc["scale"], "scale", positive=True)
    for key in ("growth_factor", "backoff_factor"):
        if key in doc:
            _number(doc[key], key, positive=True)
    if "growth_interval" in doc:
        _int(doc["growth_interval"], "growth_interval", low=1)
    if "_growth_tracker" in doc:
        _int(doc["_growth_tracker"], "_growth_tracker")


def _rank_check(doc: Any, *, rank: int, header: Mapping[str, Any] | None) -> None:
    check_rank_state(doc, rank, header)


def check_rank_state(doc: Any, rank: int, header: Mapping[str, Any] | None) -> None:
    """A ``rank<R>.json``: ``rank``, the RNG streams, the guard's ``step``, the data
    position (``data``: kind, epoch, batch_in_epoch, sampler_epoch; the tensors it
    references in ``rank<R>.safetensors``, ``header``) and the components' state (an
    object each)."""
    doc = _mapping(doc, "")
    if "rank" in doc:
        got = _int(doc["rank"], "rank", high=2**31)
        if got != rank:
            raise Bad("rank", f"is {got}, but the file is rank {rank}'s")
    if "rng" not in doc:
        raise Bad("rng", "is missing")
    check_rng(doc["rng"], "rng")
    if "step" in doc:
        _int(doc["step"], "step")
    if doc.get("data") is not None:
        data = _mapping(doc["data"], "data")
        for key in ("kind", "epoch", "batch_in_epoch"):
            if key not in data:
                raise Bad(f"data.{key}", "is missing")
        if data["kind"] not in DATA_KINDS:
            raise Bad("data.kind", f"is {_show(data['kind'])}, not one of {list(DATA_KINDS)}")
        _int(data["epoch"], "data.epoch")
        _int(data["batch_in_epoch"], "data.batch_in_epoch")
        if data.get("sampler_epoch") is not None:
            _int(data["sampler_epoch"], "data.sampler_epoch")
        if "held" in data and data["held"] is not None:
            _list(data["held"], "data.held")
        if data.get("epoch_names") is not None:
            for i, name in enumerate(_list(data["epoch_names"], "data.epoch_names")):
                _str(name, f"data.epoch_names[{i}]")
        if data.get("held_devices") is not None:
            for key, device in _mapping(data["held_devices"], "data.held_devices").items():
                _str(device, _key("data.held_devices", key))
        keys = tensor_keys(header)
        for where, ref in _tensor_refs(data, "data"):
            if keys is None or ref not in keys:
                raise Bad(
                    where,
                    f"references tensor {ref!r}, which rank{rank:05d}.safetensors does not hold",
                )
    if "components" in doc:
        for name, state in _mapping(doc["components"], "components").items():
            if state is not None:
                _mapping(state, _key("components", name))


def check_rng(rng: Any, field: str) -> None:
    """Python's and numpy's RNG states as ``stage_rank`` writes them; Python's is
    checked by loading it into a scratch generator (its own check, exact)."""
    rng = _mapping(rng, field)
    where = f"{field}.python" if field else "python"
    if "python" in rng:
        py = _list(rng["python"], where, length=3)
        version = _int(py[0], f"{where}[0]")
        internal = _list(py[1], f"{where}[1]", length=625)
        gauss = py[2]
        if gauss is not None:
            _number(gauss, f"{where}[2]")
        try:
            random.Random().setstate((version, tuple(internal), gauss))
        except (TypeError, ValueError, OverflowError) as e:
            raise Bad(where, f"is not a Python random state ({e})") from None
    where = f"{field}.numpy" if field else "numpy"
    if "numpy" in rng:
        np_state = _list(rng["numpy"], where, length=5)
        _str(np_state[0], f"{where}[0]")
        keys = _list(np_state[1], f"{where}[1]", length=624)
        for i, k in enumerate(keys):
            _int(k, f"{where}[1][{i}]", high=2**32 - 1)
        _int(np_state[2], f"{where}[2]", high=624)
        _int(np_state[3], f"{where}[3]", high=1)
        _number(np_state[4], f"{where}[4]")


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
