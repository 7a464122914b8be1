"""The auditor's flight recorder: this rank's last ``_SLOTS`` collective calls in a
small memory-mapped file (``/dev/shm``), so a rank on the same host can still explain a
peer that the backend aborted, or that is stuck in a collective, after its side-store
records stopped. Writing a call is a few memory stores; the kernel keeps the pages when
the process dies.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import struct
import tempfile
import time
from pathlib import Path
from typing import Any

from guardrails.distributed import dist
from guardrails.guards.audit.seq import _digest, _row

log = logging.getLogger("guardrails.audit")

_SLOT = 256  # flight-recorder slot: seq, step, payload length, payload
_SLOTS = 64
_HEADER = struct.Struct("<8sqqq")  # magic, rank, pid, slots
_SLOT_HEAD = struct.Struct("<qqqH")  # write number (1-based), seq, step, payload length
_MAGIC = b"GRAUDIT1"


def _ring_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _ring_path(token: str, rank: int) -> str:
    return os.path.join(_ring_dir(), f"guardrails-audit-{token}-r{rank}")


def _sweep_stale_rings(older_than_s: float = 60.0) -> None:
    """Remove flight recorders left by processes that died (an aborted, killed or
    stuck-then-ended rank cannot remove its own; one whose store died keeps it for its
    peers' close, which takes at most ``close_wait_s``). Only files of ours, a minute
    old, whose writer is gone."""
    base = _ring_dir()
    now = time.time()
    with contextlib.suppress(OSError):
        for name in os.listdir(base):
            if not name.startswith("guardrails-audit-"):
                continue
            path = os.path.join(base, name)
            with contextlib.suppress(OSError, struct.error):
                if now - os.path.getmtime(path) < older_than_s:
                    continue
                with open(path, "rb") as f:
                    magic, _, pid, _ = _HEADER.unpack(f.read(_HEADER.size))
                if magic == _MAGIC and not dist.pid_alive(pid):
                    os.unlink(path)


class _Ring:
    """The last ``_SLOTS`` calls of this rank in a memory-mapped file: a write is a few
    memory stores (the kernel keeps the pages if the process is then aborted)."""

    def __init__(self, path: str, fd: int, mm: mmap.mmap) -> None:
        self.path = path
        self._fd = fd
        self._mm = mm
        self._count = 0
        self._pack_slot = _SLOT_HEAD.pack_into

    @classmethod
    def create(cls, path: str, rank: int) -> _Ring | None:
        size = _HEADER.size + _SLOTS * _SLOT
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size)
        except OSError:
            log.debug("guardrails: no flight recorder at %s", path, exc_info=True)
            return None
        _HEADER.pack_into(mm, 0, _MAGIC, rank, os.getpid(), _SLOTS)
        return cls(path, fd, mm)

    def write(self, payload: bytes, seq: int, step: int) -> None:
        # Two stores: the slot's head (numbered, so a reader orders slots without a
        # shared counter) and the payload.
        off = _HEADER.size + (self._count % _SLOTS) * _SLOT
        self._count += 1
        self._pack_slot(self._mm, off, self._count, seq, step, len(payload))
        start = off + _SLOT_HEAD.size
        self._mm[start : start + len(payload)] = payload

    def close(self, *, unlink: bool) -> None:
        with contextlib.suppress(Exception):
            self._mm.close()
            os.close(self._fd)
        if unlink:
            with contextlib.suppress(OSError):
                os.unlink(self.path)

    @staticmethod
    def read(path: str) -> dict[str, dict[str, Any]] | None:
        """A peer's recent calls per group, in the published-record shape."""
        try:
            data = Path(path).read_bytes()
            magic, _, _, slots = _HEADER.unpack_from(data, 0)
            heads = [
                (_SLOT_HEAD.unpack_from(data, _HEADER.size + i * _SLOT), i) for i in range(slots)
            ]
        except (OSError, struct.error):
            return None
        if magic != _MAGIC:
            return None
        groups: dict[str, dict[str, Any]] = {}
        for (number, seq, step, length), i in sorted(heads):
            if number == 0:
                continue  # never written
            start = _HEADER.size + i * _SLOT + _SLOT_HEAD.size
            try:
                name, ranks, op, kind, shape, dtype, red, root, site, keyed = json.loads(
                    data[start : start + length]
                )
            except ValueError:
                continue  # torn or truncated slot
            f = {
                "op": op,
                "kind": kind,
                "shape": "" if kind == "a2a" else shape,
                "dtype": dtype,
                "reduce_op": red,
                "root": root,
                "step": step if keyed else None,
                "site": site,
                "keyed": keyed,
            }
            table = groups.setdefault(name, {"ranks": ranks, "n": 0, "anchors": [], "w": []})
            if kind == "p2p":
                continue
            table["w"].append(_row(seq, _digest(f), None, f, f["step"]))
            table["n"] = max(table["n"], seq)
        return groups
