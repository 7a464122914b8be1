"""The node-local tier: saves commit first to a fast directory on the node (``/dev/shm``,
a local NVMe), then a drain copies each committed checkpoint into the durable one
(``run_dir/checkpoints``, often a network file system: slow, shared).

Why: the durable directory is where a pre-emption save must land within the launcher's
30 s grace period, and at scale it is the slowest disk the job has. A commit to the
node's own memory or disk is done in the time of a local write; the copy to shared
storage then goes on in the background (periodic saves) or, for a signal's save, for as
long as the grace period allows.

The local copy is committed exactly as a durable one is (``commit.commit``: temp
directory, fsync, manifest last, one rename); the drain copies it byte for byte (the
manifest and its digests unchanged) the same way: every file into a temp directory of
the durable root, each fsynced, the manifest last, one rename. A crash mid-drain leaves
only a ``.tmp-`` directory, never listed and removed by the next drain.

Where each tier's copies are read: :func:`candidates` lists both, and a resume tries
them newest first, the local copy first at the same step (it is faster to read); both
are checked the same way (digests, manifest, schema) before anything is loaded.

Several nodes: a node-local directory holds only the files of that node's ranks, so a
local copy is not a whole checkpoint unless every rank runs on one node. The tier is
therefore used only when every rank shares one host (the checkpointer checks it at
start); on several nodes saves go straight to the durable directory, as without the
tier. What several nodes would need: each node commits its own ranks' files locally
under the same step and token, each node's first rank drains them into the durable temp
directory, and rank 0 writes the durable manifest once every node has drained; a
restart on the same nodes may read its local files, and the durable copy is the one
every rank trusts across nodes.

The knobs are ``local_directory`` and ``local_keep_last`` (the checkpointer's); the
tier's room is checked at start against an estimate of one checkpoint
(:func:`estimate_bytes`), so a tier that cannot hold one is said before training, not at
the first save hours later.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from guardrails.checkpoint.files import read_bytes
from guardrails.checkpoint.manifest import MANIFEST, highest_seq, list_checkpoints
from guardrails.util import files as _perms
from guardrails.util.checks import path_like, positive_int

#: A drain copies a file this many bytes at a time (``os.sendfile``: no copy through
#: Python), checking between pieces whether a newer save abandoned it.
_PIECE_BYTES = 64 << 20

#: The temp directory of a drain in the durable root: removed by ``remove_leftovers``
#: (``common._TMP_PREFIX``) when a crash cut the drain.
_DRAIN_PREFIX = ".tmp-drain-"


def check_knobs(local_directory: Any, local_keep_last: Any) -> Path | None:
    """The checkpointer's tier knobs checked: the local directory as a ``Path`` (or
    ``None``: no local tier)."""
    positive_int("local_keep_last", local_keep_last)
    if local_directory is None:
        return None
    path_like("local_directory", local_directory)
    return Path(local_directory)


@dataclass(frozen=True)
class Room:
    """What the local tier can hold: ``free_bytes`` on its file system, ``need_bytes``
    for one checkpoint (an estimate), ``copies`` that fit."""

    free_bytes: int
    need_bytes: int

    @property
    def copies(self) -> int:
        return self.free_bytes // max(1, self.need_bytes)


class LocalTier:
    """Where this guard's saves commit first (``local``), and the durable directory
    they are drained to (``durable``). ``keep_last``: the local copies kept (the
    durable ones are the checkpointer's ``keep_last``: ``durable_keep_last``)."""

    def __init__(
        self, *, local: Path, durable: Path, keep_last: int, durable_keep_last: int | None
    ) -> None:
        self.local = local
        self.durable = durable
        self.keep_last = keep_last
        self.durable_keep_last = durable_keep_last

    def room(self, need_bytes: int) -> Room:
        """How many checkpoints of ``need_bytes`` the local directory has room for now
        (on the file system it will be created on, when missing; the copies already
        there count as room: retention retires them). An ``OSError`` when it cannot be
        read, or what is in its way is not a directory."""
        where = self.local
        while not os.path.lexists(where) and where.parent != where:
            where = where.parent
        if not where.is_dir():
            raise NotADirectoryError(f"{where} is in the way of {self.local}: not a directory")
        free = shutil.disk_usage(where).free
        held = sum(_tree_bytes(p) for _, p in list_checkpoints(self.local))
        return Room(free_bytes=free + held, need_bytes=need_bytes)

    def refuse_if_too_small(self, room: Room) -> None:
        """A ``CheckpointError`` when the local directory cannot hold one checkpoint:
        said at start, not by a save that fails hours later."""
        from guardrails._errors import CheckpointError  # torch: see copy_committed

        if room.copies >= 1:
            return
        raise CheckpointError(
            f"the checkpoint's local directory {self.local} has {size(room.free_bytes)} of "
            f"room, and one checkpoint of this run needs about {size(room.need_bytes)}: "
            "no save could commit there",
            path=str(self.local),
            hint="point local_directory at a larger disk (a local NVMe), free room there "
            "(/dev/shm counts against the host's memory: its size is set by the mount, "
            "often half the RAM), or pass guard(checkpoint={'local_directory': None}) to "
            "save straight to the run's checkpoint directory.",
        )

    def next_seq(self) -> int:
        """The highest save sequence number in either tier (a wiped local directory,
        a new node, must not number its saves below the durable ones)."""
        return max(highest_seq(self.local), highest_seq(self.durable))

    def drain(
        self,
        ckpt: Path,
        *,
        token: str,
        run_id: str | None,
        adopt_unlabelled: bool,
        cancel: threading.Event | None = None,
        delete_old: bool = True,
    ) -> Path:
        """Copy the committed local checkpoint ``ckpt`` into the durable directory
        (:func:`copy_committed`), then apply the durable retention. The durable copy.
        ``digest.Cancelled`` when ``cancel`` is set mid-copy (nothing committed)."""
        from guardrails.checkpoint import commit  # torch: inspect lists tiers without it

        _perms.make_dirs(self.durable)
        commit.remove_leftovers(self.durable, keep=token)
        final = copy_committed(ckpt, self.durable, token=token, cancel=cancel)
        if self.durable_keep_last is not None:
            commit._retain(
                self.durable,
                self.durable_keep_last,
                delete=delete_old,
                run_id=run_id,
                adopt=adopt_unlabelled,
            )
        return final


def copy_committed(
    src: Path, root: Path, *, token: str, cancel: threading.Event | None = None
) -> Path:
    """``src`` (a committed checkpoint) copied byte for byte as ``root/<its name>``:
    every file but the manifest into ``root/.tmp-drain-<name>-<token>``, each fsynced,
    then the manifest, the directories fsynced, and one rename (a step already there is
    replaced so that a kill leaves one loadable copy: ``commit``'s re-save). A kill at
    any point leaves nothing under a ``step_*`` name that is not complete."""
    from guardrails.checkpoint import commit  # torch: inspect lists tiers without it
    from guardrails.checkpoint.common import _crash_point

    tmp = root / f"{_DRAIN_PREFIX}{src.name}-{token}"
    if tmp.exists():
        shutil.rmtree(tmp)
    _perms.make_dirs(tmp)
    try:
        dirs = [tmp]
        for here, subdirs, names in os.walk(src):
            rel = Path(here).relative_to(src)
            for d in sorted(subdirs):
                dirs.append(_perms.make_dirs(tmp / rel / d))
            for name in sorted(names):
                if rel == Path() and name == MANIFEST:
                    continue  # last: its presence says every file is there
                _copy_file(Path(here) / name, tmp / rel / name, cancel)
        _crash_point("drain:files")
        _copy_file(src / MANIFEST, tmp / MANIFEST, cancel)
        for d in reversed(dirs):
            _perms.fsync_path(d)
        final = root / src.name
        if final.exists():
            commit._replace(root, final, tmp)
        else:
            os.rename(tmp, final)
        _perms.fsync_path(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _copy_file(src: Path, dst: Path, cancel: threading.Event | None) -> None:
    """One file copied by the kernel (``sendfile``) a piece at a time, then fsynced."""
    from guardrails.checkpoint.digest import Cancelled

    with open(src, "rb") as fin, os.fdopen(_perms.open_new(dst), "wb") as fout:
        size = os.fstat(fin.fileno()).st_size
        offset = 0
        while offset < size:
            if cancel is not None and cancel.is_set():
                raise Cancelled(f"the drain of {src.parent} was abandoned")
            sent = os.sendfile(fout.fileno(), fin.fileno(), offset, min(_PIECE_BYTES, size))
            if sent == 0:  # the source shrank under us: the copy would not match
                raise OSError(f"{src} ended at {offset} of {size} bytes while being copied")
            offset += sent
        os.fsync(fout.fileno())


def candidates(durable: Path, local: Path | None) -> list[tuple[int, Path]]:
    """Every ``step_*`` of both tiers, as ``manifest.list_checkpoints`` lists one: the
    local ones first, so that a resume's order (``resume_order``, stable by step)
    tries the local copy of a step before the durable one."""
    found = list_checkpoints(local) if local is not None else []
    return found + list_checkpoints(durable)


def in_local(ckpt: Path, local: Path | None) -> bool:
    """Whether ``ckpt`` is a copy in the local tier ``local``."""
    return local is not None and _same_dir(ckpt.parent, local)


def recorded_local(durable: Path) -> Path | None:
    """The local tier the newest checkpoint under ``durable`` was saved with (its
    manifest's ``run.local_directory``), when that directory exists on this host."""
    for _, ckpt in reversed(list_checkpoints(durable)):
        try:
            run = json.loads(read_bytes(ckpt / MANIFEST)).get("run") or {}
        except (OSError, ValueError, AttributeError):
            continue
        where = run.get("local_directory") if isinstance(run, dict) else None
        return Path(where) if isinstance(where, str) and os.path.isdir(where) else None
    return None


def label(ckpt: Path, local: Path | None) -> str:
    """``step_000000100`` or, for a copy in the local tier, ``step_000000100 (node-local
    copy in /dev/shm/run)``: how a listing or a skip names a checkpoint."""
    if in_local(ckpt, local):
        return f"{ckpt.name} (node-local copy in {local})"
    return ckpt.name


def estimate_bytes(state: Mapping[str, Any], optimizers: list[Any]) -> int:
    """One checkpoint's bytes, roughly: the model's ``state`` (name -> tensor) and each
    of ``optimizers``' state or, for one with no state yet (before its first step),
    twice the parameters it trains (Adam's two moments: the common optimizer with the
    most state per parameter)."""
    total = sum(_nbytes(t) for t in state.values())
    for opt in optimizers:
        held = sum(_nbytes(v) for s in opt.state.values() for v in s.values())
        params = sum(_nbytes(p) for group in opt.param_groups for p in group["params"])
        total += held if held else 2 * params
    return total


def size(nbytes: int) -> str:
    """``"840 MB"``, ``"12.3 GB"``: a size in a message."""
    return f"{nbytes / 1e9:.1f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"


def _nbytes(value: Any) -> int:
    return int(value.nelement() * value.element_size()) if hasattr(value, "element_size") else 0


def _tree_bytes(path: Path) -> int:
    total = 0
    for here, _, names in os.walk(path):
        for name in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(here, name)).st_size
    return total


def _same_dir(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return a.resolve() == b.resolve()
