"""Each rank's part of a checkpoint, published node-locally at every step boundary, so
that a live rank can write a dead rank's part of a failure save (``failure.py``).

Under DDP every rank holds the whole model and optimizer; what only a rank holds is
small: its RNG streams and its data position (what ``stage.stage_rank`` writes as
``rank<R>.json`` / ``rank<R>.safetensors``). A SIGKILLed rank's boundary capture
(``engine/boundary.py``) died with it, so the survivors' failure save was incomplete and
the restart went back to the last periodic checkpoint (the recovery benchmark's kill -9
redid 189-251 steps). Here each rank keeps a copy of that part in a file mapped into its
memory, :data:`SLOT_BYTES` in ``/dev/shm`` (or the node-local tier's directory when it is
set): a rank on the same host reads it after the rank is gone.

* **Per boundary** (:meth:`PeerSlot.publish`, from the checkpointer's ``on_boundary``):
  a memcpy of the torch generators' states (5 KB for the CPU one, 16 B a CUDA device)
  and a few integers into the mapped pages: no system call (the pages are the page
  cache's; the kernel writes nothing to disk for ``/dev/shm``). Python's and numpy's
  streams (5 KB) only at the boundaries the capture read them at. What changes once a
  pass (the pass's RNG states, the loader's generators, the data position's kind) is
  written when the pass changes. Measured: ``benchmarks/peer_publish.py``.
* **Torn or stale copies are never read as a rank's part**: a write is framed by the
  boundary count at its start and end (a rank killed mid-write leaves them unequal);
  the file is named by the job's token (agreed by the ranks at each start, so a file a
  dead earlier job left is never this job's) and holds it, with its rank; its step must
  be the step the failure save saves.
* **A prefetched batch** (nanoGPT's ``get_batch``, nanochat's generator: the next batch
  fetched inside the step, held at the boundary): a periodic save holds its bytes
  (fetched anew from a fast-forwarded loader, it would be drawn anew); the copy holds
  instead the torch generators' states from just before its fetch, when nothing else
  drew from them between that fetch and the boundary (``boundary.FetchStates``, asked
  for once such a batch is seen): the dead rank's part is written from those states
  with the batch not yet fetched, and the resumed rank fetches the same batch again.
* **What the copy cannot hold**: a loader with its own ``state_dict()`` (per-rank state
  of any size), prefetched batches otherwise (two held, a loop that draws after the
  fetch, the loop's own generators), a sharded model or an optimizer whose state
  differs per rank. A rank's
  part is then unreachable, and a failure save without it is incomplete, as before.
  The components' own state (NanGuard's statistics) in the written part is the
  writing rank's, at the same step.
* **A killed job's copies are swept**: a copy names its writer (pid, the process's start
  time, its pid namespace, the host) in its header. A rank opening its own copy removes
  those of another job none of whose writers on this host is alive (:func:`sweep`): a
  job SIGKILLed whole, or on a lost node, left them in ``/dev/shm``, which is memory.
  A job with one writer alive keeps all its copies (a live rank of it may be writing a
  failure save from them); a copy of another user, pid namespace or host is left alone.
* **Other hosts**: a rank's copy is also sent to a rank on another node, which keeps it
  beside its own as a *mirror* (``partner.py``: a node lost whole, its memory with it):
  :func:`read_peer` reads a rank's own copy, else the mirror this host holds of it.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import socket
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors
from torch import Tensor

from guardrails.checkpoint import stage
from guardrails.checkpoint.common import log
from guardrails.engine import ddp_buckets, model

if TYPE_CHECKING:
    from guardrails.engine.guard import Guard

#: The file: a header, the integers, python's and numpy's streams, torch's generators,
#: then what changes once a pass. 64 KB: the CPU generator's 5 KB, a CUDA device's
#: 16 B, a pass's RNG states (5-10 KB) with room to spare.
SLOT_BYTES = 64 * 1024
#: The file: two of them, the last two boundaries' (by the boundary count's parity): a
#: live rank whose collective finished where the committer's failed is a step ahead,
#: and its part of the committer's step is the one before its last.
FILE_BYTES = 2 * SLOT_BYTES
_MAGIC = b"GRPEER01"
_TOKEN_BYTES = 32
#: After the token: the writer's pid, its start time (clock ticks after boot: a pid
#: reused by another process is not the writer) and its pid namespace's inode.
_WRITER = struct.Struct("<3q")
_WRITER_AT = 8 + _TOKEN_BYTES
_PREFIX = "guardrails-peer-"
INTS_AT, _N_INTS = 64, 19
_FLOATS_AT = INTS_AT + 8 * _N_INTS
_PY_AT, _PY_N = 256, 625  # random.getstate()[1]: 624 words and the index
_NP_AT, _NP_N = _PY_AT + 4 * _PY_N + 12, 624  # np.random.get_state()[1]
_TORCH_AT, _TORCH_BYTES = 8 * 1024, 16 * 1024
_COLD_AT = _TORCH_AT + _TORCH_BYTES
_COLD_BYTES = SLOT_BYTES - _COLD_AT

# The integers, by index. BEGIN and END frame every write with the boundary count.
BEGIN, STEP, COUNT, EPOCH, POS_EPOCH, POS_BATCH, HELD, RNG_AT, PY_VERSION = range(9)
PY_HAS_GAUSS, NP_POS, NP_HAS_GAUSS, COLD_LEN, END, HOST, GONE = range(9, 16)
# AT_UPDATE: published after the update, before its boundary (PeerSlot.publish_update);
# INEXACT: the loop drew from the RNG or moved the data between an update and its
# boundary at least once, so such a copy is not the boundary's.
AT_UPDATE, INEXACT = 16, 17
# REFETCH: the one batch held past the boundary can be fetched again, from the torch
# generators' states before its fetch, kept after the boundary's (engine/boundary.py).
REFETCH = 18
# One call writes the step's integers, STEP to HELD (a numpy item store each was
# ~0.1 us), and python's stream (2x faster than a numpy array's store from its tuple).
_STEP_INTS = struct.Struct("<6q")
_PY_WORDS = struct.Struct(f"<{_PY_N}I")


def slot_path(directory: Path, token: str, rank: int) -> Path:
    """Where ``rank``'s copy lives for the job named ``token``."""
    return directory / f"{_PREFIX}{token}-rank{rank}"


def mirror_path(directory: Path, token: str, rank: int) -> Path:
    """Where a partner on another node keeps ``rank``'s copy (:class:`Mirror`). Not a
    rank's own copy to :func:`gone_ranks` (its name is no rank's); swept as its job's."""
    return directory / f"{_PREFIX}{token}-rank{rank}-mirror"


def _started(pid: int) -> int | None:
    """When process ``pid`` started (``/proc/<pid>/stat``'s field 22), ``None`` when
    there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    # The fields after the command's ")" begin at field 3.
    return int(stat.rsplit(b")", 1)[1].split()[19])


def _writer_id() -> tuple[int, int, int, int]:
    """This process as a copy's header names it: pid, start time, pid namespace (0
    where ``/proc`` cannot say: its copies are then never swept, nor does it sweep), host."""
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        namespace = 0
    host = zlib.crc32(socket.gethostname().encode())
    return os.getpid(), _started(os.getpid()) or 0, namespace, host


def _header(path: Path) -> tuple[int, int, int, int] | None:
    """A copy's writer as its header names it (pid, start time, pid namespace, host),
    for a copy of this user's; ``None`` when it cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            if os.fstat(fd).st_uid != os.getuid():
                return None
            head = os.pread(fd, INTS_AT + 8 * _N_INTS, 0)
        finally:
            os.close(fd)
    except OSError:
        return None
    if len(head) < INTS_AT + 8 * _N_INTS or head[:8] != _MAGIC:
        return None
    pid, started, namespace = _WRITER.unpack_from(head, _WRITER_AT)
    return pid, started, namespace, struct.unpack_from("<q", head, INTS_AT + 8 * HOST)[0]


def _gone(writer: tuple[int, int, int, int], namespace: int, host: int) -> bool | None:
    """Whether a copy's writer process has ended: ``None`` when this process cannot
    judge (another pid namespace or host, no start time)."""
    pid, started, their_namespace, their_host = writer
    if not namespace or their_namespace != namespace or their_host != host or not started:
        return None
    return _started(pid) != started


def gone_ranks(directory: Path, token: str) -> set[int]:
    """The ranks of job ``token`` whose copy is in ``directory`` (this host's) and
    whose process has ended, or whose partner here saw its connection end without a
    goodbye (:meth:`Mirror.gone`: a rank on another node, killed): a rank the committer
    need not wait for. A few header reads: only this host's ranks and their partners
    have a copy here."""
    _, _, namespace, host = _writer_id()
    gone: set[int] = set()
    with contextlib.suppress(OSError):
        for path in directory.glob(f"{_PREFIX}{token}-rank*"):
            rank = path.name.rpartition("-rank")[2]
            if rank.endswith("-mirror") and rank[: -len("-mirror")].isdigit():
                if _flag(path, GONE) == 1:
                    gone.add(int(rank[: -len("-mirror")]))
                continue
            writer = _header(path)
            if writer is not None and rank.isdigit() and _gone(writer, namespace, host):
                gone.add(int(rank))
    return gone


def ranks_with_copies(directory: Path, token: str) -> set[int]:
    """The ranks of job ``token`` with a copy in ``directory``: their own (this host's
    ranks) or a mirror their partner keeps here. A listing: only a few ranks per host."""
    ranks: set[int] = set()
    with contextlib.suppress(OSError):
        for path in directory.glob(f"{_PREFIX}{token}-rank*"):
            rank = path.name.rpartition("-rank")[2].removesuffix("-mirror")
            if rank.isdigit():
                ranks.add(int(rank))
    return ranks


def mirror_gone(directory: Path, token: str, rank: int) -> bool | None:
    """Whether the mirror of ``rank`` kept here says its rank is gone (:meth:`Mirror.gone`);
    ``None``: no mirror of it here."""
    flag = _flag(mirror_path(directory, token, rank), GONE)
    return None if flag is None else flag == 1


def _flag(path: Path, index: int) -> int | None:
    """One of a copy's integers, or ``None`` when it cannot be read."""
    try:
        raw = path.open("rb").read(INTS_AT + 8 * _N_INTS)
    except OSError:
        return None
    if len(raw) < INTS_AT + 8 * _N_INTS or raw[:8] != _MAGIC:
        return None
    return struct.unpack_from("<q", raw, INTS_AT + 8 * index)[0]


def sweep(directory: Path, token: str) -> list[Path]:
    """Remove the copies in ``directory`` of jobs other than ``token`` none of whose
    writers is alive (see the module docstring): the files removed. A copy this process
    cannot judge (another user's, another pid namespace's or host's, no header) stays."""
    _, _, namespace, host = _writer_id()
    if not namespace:
        return []
    try:
        names = [p for p in directory.iterdir() if p.name.startswith(_PREFIX)]
    except OSError:
        return []
    jobs: dict[str, list[Path]] = {}
    alive: set[str] = set()
    for path in names:
        job = path.name[len(_PREFIX) :].rpartition("-rank")[0]
        if not job or job == token:
            continue
        writer = _header(path)
        if writer is None:
            continue
        pid, started, their_namespace, their_host = writer
        if their_namespace != namespace or their_host != host:
            alive.add(job)  # not ours to judge: treated as a live job's
            continue
        jobs.setdefault(job, []).append(path)
        if started and _started(pid) == started:
            alive.add(job)
    removed = []
    for job, paths in jobs.items():
        if job in alive:
            continue
        for path in paths:
            with contextlib.suppress(OSError):  # another rank of ours removed it first
                path.unlink()
                removed.append(path)
    return removed


def slot_directory(local: Path | None) -> Path | None:
    """The node-local tier's directory when it is set, else ``/dev/shm`` when it is
    there and writable; ``None``: no copy is kept."""
    for place in (local, Path("/dev/shm")):
        if place is not None and place.is_dir() and os.access(place, os.W_OK):
            return place
    return None


def publishable(guard: Guard) -> bool:
    """Whether a rank's part is all the copy holds: several ranks, every rank holding
    the whole model and the same optimizer state (DDP, not sharded, no per-rank
    optimizer). The loader's kind is checked once a pass (:meth:`PeerSlot.publish`)."""
    if guard.world_size < 2 or model.holds_shards(model.unwrap(guard.model)):
        return False
    if not all(model.grads_agree(m) for m in guard.models.values()):
        return False
    return all(stage.per_rank(opt) is opt for opt in guard.optimizers.values())


class _Half:
    """One boundary's copy inside the file (see :data:`FILE_BYTES`): views of its
    integers, floats and numpy stream at ``base``, and what its cold part was written
    for."""

    def __init__(self, mapped: mmap.mmap, base: int) -> None:
        self.base = base
        self.ints = np.frombuffer(mapped, np.int64, _N_INTS, base + INTS_AT)
        self.floats = np.frombuffer(mapped, np.float64, 2, base + _FLOATS_AT)
        self.np = np.frombuffer(mapped, np.uint32, _NP_N, base + _NP_AT)
        self.views: list[Tensor] = []  # the generators' states, in the mapped pages
        self.pre_views: list[Tensor] = []  # their states before a held batch's fetch
        self.start: Any = None  # the pass's RNG states the cold part was written for


def _map_file(path: Path, token: str) -> mmap.mmap:
    """A new copy file of :data:`FILE_BYTES`, each half's header naming this process."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, FILE_BYTES)
        mapped = mmap.mmap(fd, FILE_BYTES)
    finally:
        os.close(fd)
    pid, started, namespace, host = _writer_id()
    for base in range(0, FILE_BYTES, SLOT_BYTES):
        mapped[base : base + 8] = _MAGIC
        mapped[base + 8 : base + 8 + _TOKEN_BYTES] = token.encode().ljust(_TOKEN_BYTES, b"\0")
        _WRITER.pack_into(mapped, base + _WRITER_AT, pid, started, namespace)
        ints = np.frombuffer(mapped, np.int64, _N_INTS, base + INTS_AT)
        ints[HOST] = host
        ints[BEGIN] = -1  # nothing published yet: never equal to END's 0
        del ints  # no view may outlive a close
    return mapped


def _loop_generators(guard: Guard) -> tuple[Tensor, ...]:
    """The loop's own generators (``guard(generators=)``) as a save takes them: where the
    last step left them (``guard.generator_states``), else as they are."""
    if not guard.generators:
        return ()
    saved = guard.generator_states
    return tuple(g.get_state() if saved is None else saved[n] for n, g in guard.generators.items())


def _holds(half: _Half, count: int, position: tuple[int, ...], states: tuple[Tensor, ...]) -> bool:
    """Whether ``half`` (written after the update) holds what boundary ``count`` found:
    the same step integers (``position``, as :meth:`PeerSlot._seal` takes it) and
    generator states."""
    ints = tuple(int(v) for v in half.ints[STEP : HELD + 1])
    if ints != (position[0], count, *position[1:]) or len(states) != len(half.views):
        return False
    return all(map(torch.equal, half.views, states))


class PeerSlot:
    """This rank's copy of its part (see the module docstring), mapped from
    ``directory`` for the job ``token``: made at the first :meth:`publish` (a guard
    whose start fails leaves no file), published at every boundary into the half of
    its count's parity (the last two boundaries are kept), removed by :meth:`close`."""

    def __init__(self, directory: Path, token: str, rank: int) -> None:
        self.path = slot_path(directory, token, rank)
        self._token = token
        self._map: mmap.mmap | None = None
        self._halves: list[_Half] = []
        self._last: _Half | None = None  # the half the last boundary was published in
        self._closed = False
        #: The boundary count whose half :meth:`publish_update` wrote, for that boundary
        #: to check; and whether every check so far found the boundary the same.
        self._update: int | None = None
        self.exact = True
        #: Why the copy cannot stand for this rank's part (the loader's kind, a state
        #: too large), or ``""``.
        self.unusable = ""
        self._kind = ""  # the data position's kind (written once a pass)

    def _open(self) -> None:
        self._map = _map_file(self.path, self._token)
        self._halves = [_Half(self._map, base) for base in range(0, FILE_BYTES, SLOT_BYTES)]

    def publish(self, guard: Guard) -> None:
        """At a step boundary, after the engine's capture: this rank's part as that
        boundary left it."""
        if not self._halves:  # the first boundary, or closed (the failure save ran)
            if self._closed:
                return
            try:
                self._open()
                swept = sweep(self.path.parent, self._token)
                if swept:
                    log.info(
                        "guardrails: removed %d published cop%s that killed jobs left in %s",
                        len(swept),
                        "y" if len(swept) == 1 else "ies",
                        self.path.parent,
                    )
            except OSError as e:  # a full /dev/shm: the failure save is as without it
                self._closed = True
                log.debug("guardrails: no published copy of this rank's part: %s", e)
                return
        cap = guard.boundary_capture
        count = cap.count
        half = self._halves[count % 2]
        states = cap.torch + _loop_generators(guard)
        epoch, batch, start = guard.data_position.trained(cap.trained_at)
        held = len(guard.data_position.fetched)  # a prefetch's batches, past the boundary
        position = (guard.step, cap.epoch, epoch, batch, held)
        if self._update == count and self.exact and not _holds(half, count, position, states):
            self._inexact()  # the loop drew or fetched between the update and here
        self._update = None
        half.ints[BEGIN] = count
        if start is not half.start or len(states) != len(half.views):
            self._write_cold(half, guard, states, start)  # once a pass (and when CUDA starts)
        torch._foreach_copy_(half.views, states)
        self._write_refetch(half, guard, count, states)
        if cap.captured_at == count:  # python's and numpy's, read at this boundary
            # Into the other half too while nothing draws from them between checks: the
            # boundary before holds the same streams, and its own may be older still.
            for other in self._halves if not cap.drawing else (half,):
                self._write_streams(other, cap.python, cap.numpy, count)
        self._seal(half, count, position, at_update=False)

    def _seal(self, half: _Half, count: int, position: tuple[int, ...], *, at_update: bool) -> None:
        """The copy's step integers (``position``: the step, the guard's epoch, the data
        position's epoch and batch, the batches held past it), then END: whole."""
        at = half.base + INTS_AT + 8 * STEP
        _STEP_INTS.pack_into(self._map, at, position[0], count, *position[1:])
        half.ints[AT_UPDATE] = at_update
        half.ints[END] = count
        self._last = half

    def publish_update(self, guard: Guard) -> None:
        """After an update (the engine's ``after_step``): the part the next boundary
        will hold when nothing draws from the RNG or moves the data in between, so that a
        rank killed after its update and before that boundary (in the loop's logging, a
        ``loss.item()``, an eval) still leaves its part of the step the others save. That
        boundary checks it: a loop that drew or fetched in between marks such copies
        unusable for the rest of the run (:data:`INEXACT`). Not while python's or numpy's
        stream is drawn from (reading them costs 40 us), nor at a pass's first step."""
        cap = guard.boundary_capture
        if not self._halves or cap.drawing or not self.exact:
            return
        count = cap.count + 1
        half = self._halves[count % 2]
        states = tuple(g.get_state() for g in cap.generators) + _loop_generators(guard)
        epoch, batch, start = guard.data_position.trained()
        if start is not half.start or len(states) != len(half.views):
            return  # the boundary writes the pass's part first
        position = (guard.step, guard.epoch, epoch, batch, len(guard.data_position.fetched))
        half.ints[BEGIN] = count
        torch._foreach_copy_(half.views, states)
        self._write_refetch(half, guard, count, states)
        self._seal(half, count, position, at_update=True)
        self._update = count

    def _write_refetch(
        self, half: _Half, guard: Guard, count: int, states: tuple[Tensor, ...]
    ) -> None:
        """The states before the fetch of the batch held at boundary ``count``, when a
        fresh fetch from them leaves ``states`` (:data:`REFETCH`). The first held batch
        of a fast-forwarded loader asks the engine for them (the next ones have them)."""
        cap, held = guard.boundary_capture, len(guard.data_position.fetched)
        pre = None
        if held and self._kind == "fast_forward" and not guard.generators and half.pre_views:
            cap.follow_fetches()
            if held == 1 and (fetches := cap.fetches) is not None:
                pre = fetches.refetch(count, states)
        if pre is not None and len(pre) == len(half.pre_views):
            torch._foreach_copy_(half.pre_views, pre)
            half.ints[REFETCH] = 1
        else:
            half.ints[REFETCH] = 0

    def rewound(self) -> None:
        """The run went back to an earlier step: the copy after the last update is of a
        step given up, and the boundary to come does not check it. The copy at that
        boundary is published by it."""
        self._update = None

    def _inexact(self) -> None:
        self.exact = False
        for half in self._halves:
            half.ints[INEXACT] = 1

    def _write_streams(self, half: _Half, python: Any, numpy: Any, count: int) -> None:
        version, internal, gauss = python
        _PY_WORDS.pack_into(self._map, half.base + _PY_AT, *internal)
        ints = half.ints
        ints[PY_VERSION], ints[PY_HAS_GAUSS] = version, gauss is not None
        _, keys, pos, has_gauss, cached = numpy
        half.np[:] = keys
        ints[NP_POS], ints[NP_HAS_GAUSS] = pos, has_gauss
        half.floats[:] = (0.0 if gauss is None else gauss, cached)
        ints[RNG_AT] = count

    def _write_cold(
        self, half: _Half, guard: Guard, states: tuple[Tensor, ...], start: Any
    ) -> None:
        """What changes once a pass: the generators' layout, the pass's RNG states and
        the loader's generators (the tensors a save's data position holds), the
        position's kind."""
        half.start = start
        position, tensors = guard.data_position.save(
            boundary=(guard.boundary_capture.trained_at, [])
        )
        names = list(guard.boundary_capture.torch_names)
        names += [f"generator.{n}" for n in guard.generators]
        sizes = [s.numel() for s in states]
        blob = save_tensors({k: v.contiguous() for k, v in tensors.items()}) if tensors else b""
        # Room for the states before a held batch's fetch too (REFETCH), after these.
        pre = 2 * sum(sizes) <= _TORCH_BYTES
        head = json.dumps(
            {"kind": position["kind"], "names": names, "sizes": sizes, "pre": pre}
        ).encode()
        self.unusable, self._kind = "", position["kind"]
        if position["kind"] == "state_dict":
            self.unusable = (
                "its loader is restored by its own state_dict(), which the published copy "
                "does not hold"
            )
        elif sum(sizes) > _TORCH_BYTES or 16 + len(head) + len(blob) > _COLD_BYTES:
            self.unusable = "its RNG states are larger than the published copy's room"
        if self.unusable:
            head = json.dumps({"unusable": self.unusable}).encode()
            blob, sizes = b"", []
        cold = len(head).to_bytes(8, "little") + head + blob
        at = half.base + _COLD_AT
        self._map[at : at + len(cold)] = cold  # type: ignore[index]
        half.ints[COLD_LEN] = len(cold)
        offsets = np.cumsum([0, *sizes])
        half.views = [
            torch.frombuffer(
                self._map, dtype=torch.uint8, count=n, offset=half.base + _TORCH_AT + int(o)
            )
            for n, o in zip(sizes, offsets, strict=False)
        ]
        half.pre_views = [
            torch.frombuffer(
                self._map,
                dtype=torch.uint8,
                count=n,
                offset=half.base + _TORCH_AT + int(offsets[-1]) + int(o),
            )
            for n, o in zip(sizes, offsets, strict=False)
            if pre
        ]
        if not sizes:  # unusable: the generators are not copied
            half.views = [torch.empty(s.numel(), dtype=torch.uint8) for s in states]

    def snapshot(self) -> list[tuple[int, bytes]]:
        """The halves of the copy, oldest first, as ``(boundary count, bytes)``, for a
        partner on another node (``partner.py``, from its thread). A half the next
        boundary is writing is left out (that boundary sends its own). A write is framed
        by the boundary count, BEGIN first and END last: END read before the copy and
        BEGIN after it are equal only when no write overlapped it."""
        halves, mapped, out = list(self._halves), self._map, []
        if mapped is None:
            return out
        with contextlib.suppress(ValueError, TypeError):  # closed meanwhile
            for half in halves:
                ints = half.ints
                end = int(ints[END])
                data = mapped[half.base : half.base + _COLD_AT + int(ints[COLD_LEN])]
                if int(ints[BEGIN]) == end > 0:
                    out.append((end, data))
        return sorted(out, key=lambda got: got[0])

    def close(self, *, keep: bool = False) -> None:
        """Removed and unmapped: a run that ends leaves nothing in ``/dev/shm`` (``keep``:
        unmapped only, for a live rank's later failure save; :func:`sweep` removes it
        once no rank of its job is alive). (A publish running in another thread keeps
        the mapping until it is done.)"""
        self._closed = True
        if self._map is None:
            return
        with contextlib.suppress(OSError):
            if not keep:
                self.path.unlink()
        self._halves, self._last = [], None
        with contextlib.suppress(BufferError, ValueError):
            self._map.close()


class Mirror:
    """The copy of a rank on another node, kept on this host by its partner
    (``partner.py``), as :meth:`PeerSlot.snapshot` sent it: a file like the rank's own
    (:func:`read_peer` reads both alike; each boundary into the half of its count's
    parity) whose header names this process, so that :func:`sweep` judges it by this
    host's ranks. A write is framed as the rank's own are: BEGIN is -1 until the copy
    is whole."""

    def __init__(self, directory: Path, token: str, rank: int) -> None:
        self.path = mirror_path(directory, token, rank)
        self._token = token
        self._map: mmap.mmap | None = None
        self._halves: list[_Half] = []

    def write(self, data: bytes) -> None:
        """Keep ``data`` (one boundary's half: at most :data:`SLOT_BYTES`)."""
        if self._map is None:
            self._map = _map_file(self.path, self._token)
            self._halves = [_Half(self._map, b) for b in range(0, FILE_BYTES, SLOT_BYTES)]
        sent = np.frombuffer(data, np.int64, _N_INTS, INTS_AT)
        half = self._halves[int(sent[COUNT]) % 2]
        ints, host, after_begin = half.ints, half.ints[HOST], INTS_AT + 8 * (BEGIN + 1)
        ints[BEGIN] = -1
        self._map[half.base + after_begin : half.base + len(data)] = data[after_begin:]
        ints[HOST], ints[GONE] = host, 0
        ints[BEGIN] = ints[END]

    def gone(self) -> None:
        """The rank's connection ended without its goodbye: its process is gone (a
        SIGKILL, a node's processes killed; a host that lost power says nothing, and
        the committer waits for it as for any rank that has not begun)."""
        if self._halves:
            self._halves[0].ints[GONE] = 1

    def close(self, *, keep: bool = False) -> None:
        """Unmapped, and removed unless ``keep`` (as :meth:`PeerSlot.close`)."""
        if self._map is None:
            return
        if not keep:
            with contextlib.suppress(OSError):
                self.path.unlink()
        self._halves = []
        with contextlib.suppress(BufferError, ValueError):
            self._map.close()
        self._map = None


@dataclass
class PeerPart:
    """A rank's part as its copy holds it (:func:`read_peer`)."""

    rank: int
    step: int
    epoch: int
    position: tuple[int, int]
    #: python's and numpy's streams, and whether they are the last boundary's.
    python: tuple[Any, ...]
    numpy: tuple[Any, ...]
    streams_fresh: bool
    torch: dict[str, Tensor]
    tensors: dict[str, Tensor]
    #: Which copy: the rank's own, or the mirror its partner on another node keeps.
    source: str = "published copy"
    #: Why the copy may be a step behind the rank: said with a step that is not the save's.
    note: str = ""


_NOT_HERE = "its published copy is not on this host"


def read_peer(
    directory: Path, token: str, rank: int, *, step: int | None = None
) -> tuple[PeerPart | None, str]:
    """``rank``'s part from its copy (the rank's own, else the mirror its partner on
    another node sent here), or ``(None, why not)``: no copy on this host, a copy of
    another job, torn by a write its rank died in, or one it could not hold. Of the
    copy's two boundaries, the one of ``step`` when it holds it (a live rank a step
    ahead of the save: its collective finished where the committer's failed), else
    the newest."""
    got, why = _read(slot_path(directory, token, rank), token, rank, step)
    if why != _NOT_HERE:
        return got, why
    got, why = _read(mirror_path(directory, token, rank), token, rank, step)
    if got is not None:
        got.source = "its partner's copy"
    return got, (_NOT_HERE if why == _NOT_HERE else f"its partner's copy: {why}")


def _read(path: Path, token: str, rank: int, step: int | None) -> tuple[PeerPart | None, str]:
    try:
        data = path.read_bytes()
    except OSError:
        return None, _NOT_HERE
    if len(data) != FILE_BYTES or data[:8] != _MAGIC:
        return None, "its published copy is not one guardrails wrote"
    if data[8 : 8 + _TOKEN_BYTES].rstrip(b"\0").decode(errors="replace") != token:
        return None, "its published copy belongs to another job"
    halves = [data[b : b + SLOT_BYTES] for b in range(0, FILE_BYTES, SLOT_BYTES)]
    ints = [np.frombuffer(h, np.int64, _N_INTS, INTS_AT) for h in halves]
    whole = [i for i, v in enumerate(ints) if v[BEGIN] == v[END] == v[COUNT] and v[END] > 0]
    torn = any(v[BEGIN] != v[END] and (v[BEGIN], v[END]) != (-1, 0) for v in ints)
    at_step = [i for i in whole if ints[i][STEP] == step]
    if not at_step and (torn or not whole):  # its newest write, never finished
        return None, "its published copy was being written when it died"
    pick = at_step[0] if at_step else max(whole, key=lambda i: int(ints[i][COUNT]))
    return _part(halves[pick], rank)


def _part(data: bytes, rank: int) -> tuple[PeerPart | None, str]:
    """One boundary's half of a copy, read."""
    ints = np.frombuffer(data, np.int64, _N_INTS, INTS_AT)
    if ints[AT_UPDATE] and ints[INEXACT]:  # written before its boundary found it out
        return None, _INEXACT
    size = int.from_bytes(data[_COLD_AT : _COLD_AT + 8], "little")
    head = json.loads(data[_COLD_AT + 8 : _COLD_AT + 8 + size])
    if "unusable" in head:
        return None, head["unusable"]
    # A replayed loader hands held batches out again; a fast-forwarded one would draw
    # them anew, unless the copy holds the states from before the held batch's fetch.
    refetch = head["kind"] == "fast_forward" and ints[HELD]
    if refetch and not (ints[HELD] == 1 and ints[REFETCH] and head.get("pre")):
        return None, (
            "it had fetched a batch past its last step boundary (a prefetch), which the "
            "published copy does not hold (its loop drew from the RNG after that fetch, "
            "or fetched more than one)"
        )
    blob = data[_COLD_AT + 8 + size : _COLD_AT + int(ints[COLD_LEN])]
    streams: dict[str, Tensor] = {}
    # The states before the held batch's fetch: the resumed rank fetches it again.
    at = _TORCH_AT + (sum(head["sizes"]) if refetch else 0)
    for name, n in zip(head["names"], head["sizes"], strict=True):
        streams[name] = torch.frombuffer(bytearray(data[at : at + n]), dtype=torch.uint8)
        at += n
    floats = np.frombuffer(data, np.float64, 2, _FLOATS_AT)
    py = np.frombuffer(data, np.uint32, _PY_N, _PY_AT)
    gauss = float(floats[0]) if ints[PY_HAS_GAUSS] else None
    python = (int(ints[PY_VERSION]), tuple(int(v) for v in py), gauss)
    keys = np.frombuffer(data, np.uint32, _NP_N, _NP_AT).copy()
    numpy = ("MT19937", keys, int(ints[NP_POS]), int(ints[NP_HAS_GAUSS]), float(floats[1]))
    return PeerPart(
        rank=rank,
        step=int(ints[STEP]),
        epoch=int(ints[EPOCH]),
        position=(int(ints[POS_EPOCH]), int(ints[POS_BATCH])),
        python=python,
        numpy=numpy,
        streams_fresh=bool(ints[RNG_AT] == ints[COUNT]),
        torch=streams,
        tensors=load_tensors(blob) if blob else {},
        note=f" ({_INEXACT})" if ints[INEXACT] else "",
    ), ""


_INEXACT = (
    "its loop draws from the RNG or fetches data between an update and the next step, so "
    "no copy is published after its update: it died there"
)


def stage_peer(guard: Guard, peer: PeerPart, *, step: int, trained_at: Any) -> stage.Part:
    """The part ``peer``'s rank would have written at ``step``, staged by this rank: its
    RNG streams, its data position (this rank's at the boundary it saves, ``trained_at``,
    the job's, with the peer's place in the pass and its pass's RNG states), this rank's
    components' state."""
    position, _ = guard.data_position.save(boundary=(trained_at, []))
    position["epoch"], position["batch_in_epoch"] = peer.position
    tensors = dict(peer.tensors)
    tensors.update({k: v for k, v in peer.torch.items() if k.startswith("generator.")})
    rng: dict[str, Any] = {"python": peer.python, "numpy": peer.numpy}
    rng.update({k: v for k, v in peer.torch.items() if k.startswith("torch.")})
    components = {c.name: s for c in guard.components if (s := c.state_dict()) is not None}
    state = {"step": step, "data": position, "components": components}
    if (buckets := ddp_buckets.saved_layout(guard.model)) is not None:
        state["ddp_buckets"] = buckets  # the same on every rank (DDP broadcasts rank 0's)
    part = stage.stage_rank(peer.rank, state=state, tensors=tensors, rng=rng)
    part.ready()
    return part
