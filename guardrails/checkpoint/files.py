"""A checkpoint's files opened safely: regular files only (no link followed, no FIFO
opened: a FIFO named manifest.json hung ``inspect``), reads of bounded size, strict
JSON (UTF-8, no duplicate keys), and a ``.safetensors`` header checked against the
format before any tensor is read. Problems raise :class:`~guardrails.checkpoint.schema.Bad`
or ``OSError`` naming the file. No torch.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from pathlib import Path
from typing import Any

from guardrails.checkpoint.schema import (
    ALIASES_KEY,
    Bad,
    _int,
    _key,
    _list,
    _mapping,
    _show,
    _str,
)

#: The largest .safetensors header read (safetensors' own limit is 100 MB).
MAX_HEADER_BYTES = 100_000_000
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
