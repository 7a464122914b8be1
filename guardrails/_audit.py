"""CollectiveAuditor: every rank's sequence of collectives, compared across ranks off
the hot path, so a desync is an error naming each rank's call instead of a hang.

Seeds 001/002 ("barrier mismatch", "only rank 0 does something that includes a
collective") end today in a 10-minute NCCL timeout, a 30-minute gloo one, or gloo's
"Is there a distributed collective mismatch in your code?" with no rank, op or line;
and an extra *same-shape* all_reduce on one rank raises nothing at all: it silently
pairs with another rank's gradient all-reduce. ``TORCH_DISTRIBUTED_DEBUG=DETAIL``
catches some of it by adding a collective per call, which is why it is a debug-only
tool. Here the per-call work is host bookkeeping and the comparison is elsewhere:

* **Main thread, per call, O(1)** (~3 us on a busy 2-core EPYC, torch 2.13: ~0.9 us
  bookkeeping, ~0.7 us flight recorder, ~0.45 us the ``guard.collective`` dict, the rest
  argument handling; ``benchmarks/audit_bench.py``): the wrapper over ``torch.distributed.X``
  reads the op, the tensor's shape and dtype, the reduce op, the root, the group, the
  caller's ``file:line`` (``sys._getframe(1)``; a bounded walk of at most 8 frames only
  when that frame is torch's own, e.g. ``all_gather_object`` calling ``all_gather``)
  and the step; takes the group's next sequence number; appends one tuple to a deque;
  and writes one fixed-size slot of a local memory-mapped flight recorder. No store
  call, no collective, no formatting beyond a cache hit. ``guard.collective`` holds the
  in-flight call (a dict) for the watchdog while a blocking call runs.
* **Background thread, every ``interval_s``** (0.25 s): hashes the new entries into a
  per-group rolling hash, publishes this rank's fingerprint (count, hash anchors, the
  last entries) to ``guard.side_store("audit")``, and compares its own sequence with
  the group leader's (the group's lowest rank) on their common prefix only: a rank
  that is ahead is not a mismatch, and nothing is compared beyond what both issued.
  A difference is written once as the verdict; every rank's thread sees it and calls
  ``guard.fail_from_thread``: the main thread raises at its next step boundary, or,
  stuck in a collective, the process exits non-zero after the grace period.
* **On close**: a final publish and comparison (every rank waits at most
  ``close_wait_s`` for the others), which also catches a mismatch in the last interval
  and, when the loop died of the backend's own error (gloo's "Connection reset by
  peer", which a size mismatch produces within milliseconds, before any thread can
  look), replaces it with the mismatch it explains (``guard.replace_error``). A rank
  that gloo aborted outright cannot publish; its flight recorder (a 16 KB file in
  ``/dev/shm``, written by the dead process's last calls) tells a surviving rank on
  the same host what it was doing.

What is compared (the *key*): op, shapes, dtypes, reduce op, root (src/dst) and, for
calls from the guard's main thread or DDP's hook, the step. The call site is shown but
not compared: ``if rank == 0: dist.broadcast(t, 0) else: dist.broadcast(t, 0)`` on two
lines is correct code. The step is what exposes a same-shape extra call one entry
later (the pairing crosses a step boundary), and the report then walks back to where
the call sites first differed. Point-to-point calls (send/recv/isend/irecv) are
recorded (and shown while in flight) but not compared: ranks legitimately issue
different ones. Calls on ``guard.side_group`` (guardrails' own agreements) are not
recorded at all.

For code that issues collectives the Python API does not see (GuardedDDP's comm hook,
from the autograd thread)::

    guard.auditor.record(
        op: str,                            # "all_reduce", ...
        tensors: Sequence[Tensor],          # shapes/dtypes are recorded, never values
        *,
        group: ProcessGroup | None = None,  # None: the default group
        reduce_op: Any = None,              # e.g. dist.ReduceOp.SUM / AVG
        site: str = "DDP gradient all-reduce",  # shown instead of file:line
    ) -> int                                # the sequence number on that group

It is thread-safe, O(1), and a no-op (returns -1) once the auditor has stopped. Issue
the collective itself on the ``ProcessGroup`` object (``group.allreduce([t])``), not
through ``torch.distributed.all_reduce``, which is intercepted and would record it a
second time. The step is part of the compared key for these calls (DDP's buckets are
issued during the step's backward on every rank).

Limits: only the ``torch.distributed`` module attributes are patched, so a function
imported by name before the guard started (``from torch.distributed import
all_reduce``), DDP's C++ reducer (unless reported through ``record``) and functional
collectives (``torch.distributed._functional_collectives``) are not seen. FSDP2
(``fully_shard``) issues its all-gathers and reduce-scatters through the module
functions, so they are seen and compared (tests/test_audit.py, gloo, torch 2.13).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import mmap
import os
import struct
import sys
import tempfile
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from guardrails import _dist
from guardrails._checks import non_negative
from guardrails._component import Component
from guardrails._errors import CollectiveMismatchError
from guardrails._store import claim_verdict, read_verdict

if TYPE_CHECKING:
    from guardrails._guard import Guard

log = logging.getLogger("guardrails")

# op -> (tensor arg position, reduce-op position, root (name, position), group position,
# async_op position, kind). Positions read off torch 2.13's signatures; they are the
# long-standing ones (e.g. ``gather(tensor, gather_list=None, dst=0, group=None,
# async_op=False)`` as documented since torch 1.8): newer releases only appended
# parameters (``group_src``/``group_dst``, ``timeout``). "tensor" is the argument whose
# shape must match on every rank (the input of gathers, the output of scatters). Kinds:
# "coll" is compared across ranks, "a2a" compares dtype only (split sizes may differ per
# rank), "p2p" is recorded but not compared.
_Spec = tuple[int | None, int | None, tuple[str, int] | None, int, int | None, str]
OPS: dict[str, _Spec] = {
    "all_reduce": (0, 1, None, 2, 3, "coll"),
    "broadcast": (0, None, ("src", 1), 2, 3, "coll"),
    "reduce": (0, 2, ("dst", 1), 3, 4, "coll"),
    "all_gather": (1, None, None, 2, 3, "coll"),
    "all_gather_into_tensor": (1, None, None, 2, 3, "coll"),
    "reduce_scatter": (0, 2, None, 3, 4, "coll"),
    "reduce_scatter_tensor": (0, 2, None, 3, 4, "coll"),
    # torch >= 2.13's names for the two above (which now call these).
    "all_gather_single": (1, None, None, 2, 3, "coll"),
    "reduce_scatter_single": (0, 2, None, 3, 4, "coll"),
    "gather": (0, None, ("dst", 2), 3, 4, "coll"),
    "scatter": (0, None, ("src", 2), 3, 4, "coll"),
    "barrier": (None, None, None, 0, 1, "coll"),
    "monitored_barrier": (None, None, None, 0, None, "coll"),
    "all_to_all_single": (1, None, None, 4, 5, "a2a"),
    "all_to_all": (1, None, None, 2, 3, "a2a"),
    "send": (0, None, ("dst", 1), 2, None, "p2p"),
    "recv": (0, None, ("src", 1), 2, None, "p2p"),
    "isend": (0, None, ("dst", 1), 2, -1, "p2p"),
    "irecv": (0, None, ("src", 1), 2, -1, "p2p"),
}

_TORCH_DIST_DIR = str(Path(dist.__file__).parent)
_get_ident = threading.get_ident
_FRAME_WALK = 8  # frames climbed out of torch.distributed at most (all_gather_object: 1)
WINDOW = 48  # entries per group published each interval (~6 KB of JSON)
HISTORY = 4096  # entries per group kept locally to compare against a lagging leader
ANCHOR_EVERY = 64  # a rolling-hash anchor every this many entries, the last 64 published
_SLOT = 256  # flight-recorder slot: seq, step, payload length, payload
_SLOTS = 64
_HEADER = struct.Struct("<8sqqq")  # magic, rank, pid, slots
_SLOT_HEAD = struct.Struct("<qqqH")  # write number (1-based), seq, step, payload length
_MAGIC = b"GRAUDIT1"


class _Group:
    """What the auditor knows about one process group (cached per group object)."""

    __slots__ = ("leader", "name", "p2p", "pg", "ranks", "seq")

    def __init__(self, pg: Any, name: str, ranks: list[int]) -> None:
        self.pg = pg  # held so that id(pg) stays unique while cached
        self.name = name
        self.ranks = ranks
        self.leader = min(ranks)
        self.seq = 0  # collectives issued on this group (compared across ranks)
        self.p2p = 0  # point-to-point calls (numbered apart: ranks differ legitimately)


class CollectiveAuditor(Component):
    """Records every rank's collectives and raises
    :class:`~guardrails.CollectiveMismatchError` on every rank as soon as two ranks'
    sequences differ. A no-op in a single-process run.

    Args:
        interval_s: how often the background thread publishes this rank's fingerprint
            and compares (seconds). Default 0.25: a mismatch is seen in about two
            intervals; each costs this rank at most 4 store calls (set its record,
            check for a verdict, check and get the leader's), all off the main thread.
        close_wait_s: on close, how long to wait for the other ranks' final records
            before the last comparison. Default 1 s: ranks that finish the same loop
            close within milliseconds of each other; only a rank that never arrives
            (dead, stuck, or still training after this one ran out of data) makes a
            close wait that long.
        grace_s: once a mismatch is known, how long the main thread may stay inside a
            collective before the process ends non-zero (``Guard.fail_from_thread``).
        flight_recorder: keep the last 64 calls in a memory-mapped file so a rank on
            the same host can explain a peer that the backend aborted. Default True.
    """

    name = "audit"

    def __init__(
        self,
        *,
        interval_s: float = 0.25,
        close_wait_s: float = 1.0,
        grace_s: float = 5.0,
        flight_recorder: bool = True,
    ) -> None:
        non_negative("interval_s", interval_s)
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        non_negative("close_wait_s", close_wait_s)
        non_negative("grace_s", grace_s)
        self.interval_s = float(interval_s)
        self.close_wait_s = float(close_wait_s)
        self.grace_s = float(grace_s)
        self.flight_recorder = bool(flight_recorder)
        #: The most recent calls of this rank (raw tuples, newest last).
        self.recent: deque[tuple[Any, ...]] = deque(maxlen=32)
        #: The mismatch found, once found (the error raised on this rank).
        self.error: CollectiveMismatchError | None = None
        self._active = False
        self._guard: Guard | None = None
        self._patched: list[tuple[Any, str, Any, Any]] = []
        self._inner: set[Any] = set()  # code objects of the functions we intercept
        self._queue: deque[tuple[Any, ...]] = deque()
        self._lock = threading.Lock()
        self._groups: dict[int, _Group] = {}
        self._hist: dict[str, _History] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._store: Any = None
        self._ring: _Ring | None = None
        self._token = ""
        self._payloads: dict[tuple[Any, ...], bytes] = {}
        self._store_ok = True
        self._published_n: dict[str, int] = {}

    # ------------------------------------------------------------------ lifecycle

    def on_start(self, guard: Guard) -> None:
        if guard.world_size <= 1 or not dist.is_initialized():
            return  # a real no-op: nothing patched, no thread
        self._guard = guard
        self._rank = guard.rank
        self._side_group = guard.side_group
        # Fresh state: an instance may guard several loops, one after the other.
        self.error = None
        self._stop = threading.Event()
        self._queue.clear()
        self._groups, self._hist, self._published_n = {}, {}, {}
        self._main_ident = threading.get_ident()
        self._store = guard.side_store("audit")
        # A job-unique token (rank 0's, read by all once here) names the flight
        # recorders so a survivor finds a dead peer's without the store, which may
        # have died with it (rank 0 hosts it outside torchrun).
        if self._rank == 0:
            self._store.set("token", uuid.uuid4().hex[:12])
        _sweep_stale_rings()  # every rank: each host has its own /dev/shm
        try:  # bounded: a rank 0 with the auditor off must not stall the others' start
            self._store.wait(["token"], timedelta(seconds=60))
            self._token = self._store.get("token").decode()
        except Exception:
            log.warning("guardrails: rank 0 published no audit token; no flight recorder")
        if self.flight_recorder and self._token:
            self._ring = _Ring.create(_ring_path(self._token, self._rank), self._rank)
        self._active = True
        self._patch()
        guard.auditor = self
        self._thread = threading.Thread(target=self._run, name="guardrails-audit", daemon=True)
        self._thread.start()

    def on_end(self, guard: Guard, exc: BaseException | None) -> None:
        if self._guard is None:
            return
        self._active = False
        self._unpatch()
        if guard.auditor is self:
            guard.auditor = None
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        try:
            found = self._final_check(exc)
        finally:
            if self._ring is not None:
                # Kept only when the store is gone: then it is what a peer still
                # closing can read of this rank (swept a minute later by any new run).
                self._ring.close(unlink=exc is None or self._store_ok)
            self._guard = None
        if found is None or isinstance(exc, CollectiveMismatchError):
            return
        if exc is None:
            raise found
        guard.replace_error(found)  # the backend's error is the symptom; ours the cause

    # ------------------------------------------------------------------ interception

    def _patch(self) -> None:
        import inspect

        from torch.distributed import distributed_c10d as c10d

        for op, spec in OPS.items():
            original = getattr(c10d, op, None)
            if original is None:
                continue
            # The code of the undecorated function (torch wraps most in a logger).
            inner = getattr(inspect.unwrap(original), "__code__", None)
            if inner is not None:
                self._inner.add(inner)
            wrapper = self._wrap(op, original, spec)
            for module in (dist, c10d):
                # Only where the module attribute is that same function: a name already
                # replaced by someone else is theirs to keep.
                if getattr(module, op, None) is original:
                    self._patched.append((module, op, original, wrapper))
                    setattr(module, op, wrapper)

    def _unpatch(self) -> None:
        for module, op, original, wrapper in reversed(self._patched):
            if getattr(module, op, None) is wrapper:
                setattr(module, op, original)
            else:  # patched over us: leave theirs; ours passes through once inactive
                log.debug("guardrails: torch.distributed.%s was re-patched; left as is", op)
        self._patched = []

    def _wrap(self, op: str, fn: Callable[..., Any], spec: _Spec) -> Callable[..., Any]:
        tpos, opos, root, gpos, apos, kind = spec
        rname, rpos = root if root is not None else ("", 0)
        getframe = sys._getframe
        auditor = self

        def audited(*args: Any, **kwargs: Any) -> Any:
            if not auditor._active:
                return fn(*args, **kwargs)
            n = len(args)
            group = args[gpos] if n > gpos else kwargs.get("group")
            if group is not None and group is auditor._side_group:
                return fn(*args, **kwargs)  # our own agreements are not the user's
            tensor = None
            if tpos is not None:
                tensor = args[tpos] if n > tpos else kwargs.get(_TENSOR_KW[op])
            red = None
            if opos is not None:
                red = args[opos] if n > opos else kwargs.get("op", _SUM)
            r = None
            if root is not None:
                r = args[rpos] if n > rpos else kwargs.get(rname)
            frame = getframe(1)
            code = frame.f_code
            file = code.co_filename
            if file.startswith(_TORCH_DIST_DIR):
                if code in auditor._inner:
                    # Called by another intercepted function (torch 2.13's send is
                    # isend + wait): that call is already recorded.
                    return fn(*args, **kwargs)
                frame = _user_frame(frame)  # e.g. all_gather_object -> all_gather
                file = frame.f_code.co_filename
            entry = auditor._note(op, kind, tensor, group, red, r, file, frame.f_lineno, True)
            if apos is None or (
                apos >= 0 and not (args[apos] if n > apos else kwargs.get("async_op"))
            ):
                guard = auditor._guard
                if guard is not None:  # blocking: the watchdog may look while we wait
                    previous = guard.collective
                    guard.collective = entry_dict(entry)
                    try:
                        return fn(*args, **kwargs)
                    finally:
                        guard.collective = previous
            return fn(*args, **kwargs)

        audited.__wrapped__ = fn  # type: ignore[attr-defined]
        audited.__name__ = getattr(fn, "__name__", op)
        audited.__qualname__ = getattr(fn, "__qualname__", op)
        audited.__doc__ = fn.__doc__
        audited._guardrails_audited = True  # type: ignore[attr-defined]
        return audited

    def record_own(self, what: str, tensor: torch.Tensor, reduce_op: Any = None) -> None:
        """Record one of guardrails' own agreements (on its side group, never the
        training's), made at a point of the loop every rank reaches, in the training
        group's sequence as if it were there: a user's stray collective that one rank
        issues where the others agree is then a mismatch naming both call sites,
        instead of two ranks each waiting in a different group. Main thread only."""
        if not self._active:
            return
        frame = sys._getframe(1)
        for _ in range(_FRAME_WALK * 4):  # out of guardrails and torch: the loop's line
            if not frame.f_code.co_filename.startswith(_OWN_DIRS) or frame.f_back is None:
                break
            frame = frame.f_back
        code = frame.f_code
        op = f"{OWN_PREFIX}{what}"
        how = _MAX if reduce_op is None else reduce_op  # the reduce op it runs with
        self._note(op, "coll", tensor, None, how, None, code.co_filename, frame.f_lineno, True)

    def record(
        self,
        op: str,
        tensors: Sequence[torch.Tensor],
        *,
        group: Any = None,
        reduce_op: Any = None,
        site: str = "DDP gradient all-reduce",
    ) -> int:
        """Record a collective issued outside the Python API (e.g. DDP's bucket
        all-reduce from a comm hook, possibly on the autograd thread). Returns its
        sequence number on ``group``, or -1 when the auditor is not running."""
        if not self._active:
            return -1
        tensor: Any = tensors[0] if len(tensors) == 1 else list(tensors)
        return self._note(op, "coll", tensor, group, reduce_op, None, site, 0, False)[1]

    def _note(
        self,
        op: str,
        kind: str,
        tensor: Any,
        group: Any,
        red: Any,
        root: Any,
        file: str,
        line: int,
        intercepted: bool,
    ) -> tuple[Any, ...]:
        """The per-call bookkeeping, on the calling thread: O(1), no I/O but one
        memory-mapped slot write (~2 us in all, see the module docstring)."""
        g = self._groups.get(id(group))
        if g is None:
            g = self._group(group)
        if isinstance(tensor, torch.Tensor):
            shape: Any = tensor.shape
            dtype: Any = tensor.dtype
        elif tensor is None:
            shape = dtype = None
        else:  # a list of tensors (all_to_all, a multi-tensor record)
            shape = tuple(t.shape for t in tensor[:4])
            dtype = tensor[0].dtype if len(tensor) else None
        guard = self._guard
        step = guard.step if guard is not None else -1
        # The step is part of the key only where it is the loop's (main thread, or a
        # DDP hook reporting while the main thread waits in backward): a background
        # thread's collectives may legitimately fall in different steps per rank.
        keyed = not intercepted or _get_ident() == self._main_ident
        with self._lock:  # seq and queue order must agree across threads
            if kind == "p2p":
                g.p2p += 1
                seq = g.p2p
                entry = (g, seq, op, kind, shape, dtype, red, root, file, line, step, keyed)
            else:
                g.seq += 1
                seq = g.seq
                entry = (g, seq, op, kind, shape, dtype, red, root, file, line, step, keyed)
                self._queue.append(entry)
        self.recent.append(entry)
        if self._ring is not None:
            self._ring.write(self._payload(entry), seq, step)
        return entry

    def _group(self, group: Any) -> _Group:
        from torch.distributed import distributed_c10d as c10d

        pg = group if group is not None else c10d._get_default_group()
        with self._lock:  # first call on a group, possibly from two threads at once
            return self._group_locked(group, pg)

    def _group_locked(self, group: Any, pg: Any) -> _Group:
        from torch.distributed import distributed_c10d as c10d

        cached = self._groups.get(id(pg))
        if cached is None:
            name = c10d._world.pg_names.get(pg, str(id(pg)))
            try:
                ranks = list(dist.get_process_group_ranks(pg))
            except Exception:  # not a member / exotic group: compare nothing
                ranks = [self._rank]
            if pg is c10d._get_default_group():
                name = "default"
            cached = _Group(pg, name, ranks)
            self._groups[id(pg)] = cached
        self._groups[id(group)] = cached
        return cached

    def _payload(self, entry: tuple[Any, ...]) -> bytes:
        """The flight-recorder bytes of an entry without its seq/step, cached: the
        same call site issues the same call every step."""
        g, _, op, kind, shape, dtype, red, root, file, line, _, keyed = entry
        key = (g.name, op, shape, dtype, red, root, file, line, keyed)
        payload = self._payloads.get(key)
        if payload is None:
            if len(self._payloads) > 4096:  # shapes that vary every call: stay bounded
                self._payloads.clear()
            fields = _fields(entry)
            payload = json.dumps(
                [
                    g.name,
                    g.ranks,
                    op,
                    kind,
                    fields["shape_shown"],
                    fields["dtype"],
                    fields["reduce_op"],
                    fields["root"],
                    fields["site"],
                    keyed,
                ]
            ).encode()[: _SLOT - _SLOT_HEAD.size]
            self._payloads[key] = payload
        return payload

    # ------------------------------------------------------------------ background

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._tick()
            except Exception:  # the store went away (a peer died): keep quiet, retry
                log.debug("guardrails: audit tick failed", exc_info=True)

    def _drain(self) -> None:
        q = self._queue
        while True:
            try:
                entry = q.popleft()
            except IndexError:
                return
            g = entry[0]
            hist = self._hist.get(g.name)
            if hist is None:
                hist = self._hist[g.name] = _History(g.name, g.ranks)
            hist.add(entry)

    def _blob(self, *, final: bool = False, error: str | None = None) -> bytes:
        groups = {name: h.published() for name, h in self._hist.items()}
        step = self._guard.step if self._guard is not None else -1
        return json.dumps(
            {"rank": self._rank, "final": final, "error": error, "step": step, "groups": groups}
        ).encode()

    def _publish(self, force: bool = False, **kw: Any) -> None:
        counts = {name: h.n for name, h in self._hist.items()}
        if force or counts != self._published_n:
            self._store.set(f"r{self._rank}", self._blob(**kw))
            self._published_n = counts

    def _tick(self) -> None:
        self._drain()
        self._publish()
        if self.error is not None:
            return
        verdict = self._read_verdict()
        if verdict is None:
            leaders = {h.leader for h in self._hist.values()} - {self._rank}
            views = {r: v for r in sorted(leaders) if (v := self._read_peer(r)) is not None}
            verdict = self._compare(views)
            if verdict is not None:
                self._write_verdict(verdict)
        if verdict is not None:
            self._fail(verdict)

    def _fail(self, verdict: dict[str, Any]) -> None:
        # The verdict is in the store for every peer: the flight recorder has served.
        # Unlinked now (the mapping stays valid for the main thread's writes) because a
        # process that ends stuck in a collective never reaches on_end to remove it.
        if self._ring is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._ring.path)
        self._fail_quietly(verdict)
        if self._guard is not None and self.error is not None:
            self._guard.fail_from_thread(self.error, grace_s=self.grace_s)

    # ------------------------------------------------------------------ store traffic

    def _read_verdict(self) -> dict[str, Any] | None:
        return read_verdict(self._store)

    def _write_verdict(self, verdict: dict[str, Any]) -> None:
        # First writer wins; a rank that lost goes on with the verdict it found.
        claim_verdict(self._store, verdict)

    def _read_peer(self, rank: int) -> dict[str, Any] | None:
        key = f"r{rank}"
        if not self._store.check([key]):
            return None
        return json.loads(self._store.get(key))

    # ------------------------------------------------------------------ comparison

    def _compare(self, views: dict[int, dict[str, Any]]) -> dict[str, Any] | None:
        """The first divergence between this rank's sequences and ``views`` (other
        ranks' published records), as a verdict dict, or ``None``."""
        for view in views.values():
            for name, theirs in view.get("groups", {}).items():
                mine = self._hist.get(name)
                if mine is None or self._rank not in theirs["ranks"]:
                    continue
                found = mine.diverges_from(theirs)
                if found is not None:
                    first, upto = found
                    peers = {
                        r: v["groups"][name]
                        for r, v in views.items()
                        if name in v.get("groups", {})
                    }
                    return self._verdict(name, first, upto, peers)
        return None

    def _verdict(
        self, name: str, first: int, upto: int, peers: dict[int, dict[str, Any]]
    ) -> dict[str, Any]:
        mine = self._hist[name]
        # The whole table: read every member's record once (bounded) at detection.
        tables: dict[int, dict[str, Any]] = {self._rank: mine.published(all_entries=True)}
        for r in mine.ranks[:16]:
            if r in tables:
                continue
            if r in peers:
                tables[r] = peers[r]
                continue
            with contextlib.suppress(Exception):
                view = self._read_peer(r)
                if view is not None and name in view.get("groups", {}):
                    tables[r] = view["groups"][name]
            ring = self._peer_ring(r) if r not in tables else None
            if ring is not None and name in ring:
                tables[r] = ring[name]
        per_rank: dict[str, Any] = {}
        for r, table in sorted(tables.items()):
            by_seq = {e[0]: e for e in table["w"]}
            shown = [_display(by_seq[s]) for s in range(first, upto + 1) if s in by_seq]
            per_rank[str(r)] = {"n": table["n"], "entries": shown}
        return {
            "group": name,
            "ranks": mine.ranks,
            "seq": first,
            "upto": upto,
            "per_rank": per_rank,
        }

    def _peer_ring(self, rank: int) -> dict[str, dict[str, Any]] | None:
        if not self._token:
            return None
        return _Ring.read(_ring_path(self._token, rank))

    # ------------------------------------------------------------------ close

    def _final_check(self, exc: BaseException | None) -> CollectiveMismatchError | None:
        """Publish this rank's complete record, wait (bounded) for the others', compare
        once more. Returns the error to raise/replace with, or ``None``."""
        self._drain()
        if self.error is not None:
            return self.error
        err_text = None if exc is None else f"{type(exc).__name__}: {exc}"[:300]
        store_ok = True
        try:
            self._publish(force=True, final=True, error=err_text)
        except Exception:
            store_ok = False
        self._store_ok = store_ok
        mine_groups = list(self._hist.values())
        if not mine_groups:
            return None
        world = self._guard.world_size  # type: ignore[union-attr]
        peers = [r for r in range(world) if r != self._rank][:64]  # bounded, once
        leader = min(h.leader for h in mine_groups)
        # Wait for the leader's final record (the leader waits for everyone's), then
        # compare with every peer readable: the store's records, completed by the flight
        # recorders of peers that never published a final one (dead, or stuck in a
        # collective), so a non-leader that differs from another non-leader is seen too.
        wait_for = peers if self._rank == leader else [leader]
        views: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + self.close_wait_s
        verdict = None
        while store_ok:
            try:
                verdict = self._read_verdict()
                for r in wait_for:
                    if (view := self._read_peer(r)) is not None:
                        views[r] = view
            except Exception:
                store_ok = False
                break
            if verdict is not None:
                break
            if all(views.get(r, {}).get("final") for r in wait_for):
                break
            if time.monotonic() >= deadline:
                break
            time.sleep(min(0.05, self.interval_s))
        if verdict is None:
            for r in peers:
                if r not in views and store_ok:
                    try:
                        if (view := self._read_peer(r)) is not None:
                            views[r] = view
                    except Exception:
                        store_ok = False
                if not views.get(r, {}).get("final") and (ring := self._peer_ring(r)) is not None:
                    views[r] = _merge(views.get(r), ring)
            verdict = self._compare(views)
            if verdict is not None and store_ok:
                with contextlib.suppress(Exception):
                    self._write_verdict(verdict)
        self._store_ok = store_ok
        if verdict is None:
            return None
        self._fail_quietly(verdict)
        return self.error

    def _fail_quietly(self, verdict: dict[str, Any]) -> None:
        """Make the verdict this rank's error and log it (no raise: at close the caller
        raises or replaces the loop's error itself)."""
        guard = self._guard
        self.error = _error(verdict, self._rank, guard.step if guard is not None else None)
        if guard is not None:
            guard.event(
                "collective_mismatch",
                level="error",
                message=str(self.error),
                seq=verdict["seq"],
                group=verdict["group"],
            )


# ---------------------------------------------------------------------- history


class _History:
    """One group's sequence on this rank, for the background thread: rolling hash,
    the last HISTORY entries, and anchors (the rolling hash every ANCHOR_EVERY)."""

    def __init__(self, name: str, ranks: list[int]) -> None:
        self.name = name
        self.ranks = ranks
        self.leader = min(ranks)
        self.n = 0
        self.cum = 0
        # (seq, key digest, rolling hash, display fields...) newest last
        self.entries: deque[list[Any]] = deque(maxlen=HISTORY)
        self.anchors: deque[tuple[int, int]] = deque(maxlen=64)
        # A call site issues the same call every step: its strings and digest are made
        # once (~1 us per entry then, instead of ~6 us formatting and hashing each).
        self._static: dict[tuple[Any, ...], tuple[dict[str, Any], int]] = {}

    def add(self, entry: tuple[Any, ...]) -> None:
        seq, step, keyed = entry[1], entry[10], entry[11]
        key = (*entry[2:10], keyed)
        cached = self._static.get(key)
        if cached is None:
            if len(self._static) > 4096:
                self._static.clear()
            fields = _fields(entry)
            cached = self._static[key] = (fields, _static_digest(fields))
        fields, static = cached
        step_key = step if keyed else None
        d = _mix(static, step_key)
        self.cum = _chain(self.cum, d)
        self.n = seq
        self.entries.append(_row(seq, d, self.cum, fields, step_key))
        if seq % ANCHOR_EVERY == 0:
            self.anchors.append((seq, self.cum))

    def published(self, *, all_entries: bool = False) -> dict[str, Any]:
        rows = list(self.entries) if all_entries else list(self.entries)[-WINDOW:]
        return {"ranks": self.ranks, "n": self.n, "anchors": list(self.anchors), "w": rows}

    def diverges_from(self, theirs: dict[str, Any]) -> tuple[int, int] | None:
        """``(first, upto)``: the first entry where the two sequences differ (walked
        back over differing call sites) and the one whose key differs, comparing only
        what both ranks have issued; ``None`` when the common prefix agrees."""
        common = min(self.n, theirs["n"])
        if common <= 0:
            return None
        mine = {row[0]: row for row in self.entries}
        their_rows = {row[0]: row for row in theirs["w"] if row[0] <= common}
        for seq in sorted(their_rows):
            a, b = mine.get(seq), their_rows[seq]
            if a is None or a[1] == b[1]:
                continue
            first = seq
            # Walk back over entries whose keys agree but whose call sites differ: a
            # same-shape extra call first shows as a different line, then as a step.
            while (
                (pa := mine.get(first - 1)) is not None
                and (pb := their_rows.get(first - 1)) is not None
                and pa[1] == pb[1]
                and pa[_SITE] != pb[_SITE]
            ):
                first -= 1
            return first, seq
        # No entry-level difference in the window: the rolling hashes say whether
        # everything before it agrees too.
        theirs_cum = {row[0]: row[2] for row in their_rows.values() if row[2] is not None}
        theirs_cum.update({s: c for s, c in theirs["anchors"] if s <= common})
        for seq in sorted(theirs_cum):
            row = mine.get(seq)
            if row is not None and row[2] != theirs_cum[seq]:
                return seq, seq  # earlier than both windows: the closest we can name
        return None


# Row layout (published as JSON lists): seq, digest, rolling hash, op, shape, dtype,
# reduce op, root, step, site, keyed.
_SITE = 9


def _row(seq: int, d: int, cum: int | None, f: dict[str, Any], step: int | None) -> list[Any]:
    return [
        seq,
        d,
        cum,
        f["op"],
        f.get("shape_shown", f["shape"]),
        f["dtype"],
        f["reduce_op"],
        f["root"],
        step,
        f["site"],
        f["keyed"],
    ]


def _display(row: list[Any]) -> dict[str, Any]:
    return {
        "seq": row[0],
        "op": row[3],
        "shape": row[4],
        "dtype": row[5],
        "reduce_op": row[6],
        "root": row[7],
        "step": row[8],
        "site": row[9],
    }


def _fields(entry: tuple[Any, ...]) -> dict[str, Any]:
    """An entry's comparable, printable fields (strings and ints only)."""
    _, _, op, kind, shape, dtype, red, root, file, line, step, keyed = entry
    if shape is None:
        shape_s = ""
    elif isinstance(shape, torch.Size):
        shape_s = str(list(shape))
    else:
        shape_s = ",".join(str(list(s)) for s in shape)
    return {
        "op": op,
        "kind": kind,
        "shape": "" if kind == "a2a" and shape_s else shape_s,  # split sizes may differ
        "shape_shown": shape_s,
        "dtype": "" if dtype is None else str(dtype).replace("torch.", ""),
        "reduce_op": _red_name(red),
        "root": None if root is None else int(root),
        "step": step if keyed else None,
        "site": f"{file}:{line}" if line else str(file),
        "keyed": keyed,
    }


def _red_name(red: Any) -> str:
    if red is None:
        return ""
    name = getattr(red, "name", None)  # RedOpType.SUM
    if name is None:
        name = str(red).rsplit(".", 1)[-1]
    return str(name).upper()


_MASK = (1 << 64) - 1


def _static_digest(f: dict[str, Any]) -> int:
    """The key's digest without the step. Deterministic across processes (Python's
    ``hash()`` of a str is salted per process)."""
    key = f"{f['op']}|{f['shape']}|{f['dtype']}|{f['reduce_op']}|{f['root']}"
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


def _mix(static: int, step: int | None) -> int:
    if step is None:
        return static
    return static ^ (((step + 1) * 0x9E3779B97F4A7C15) & _MASK)  # golden-ratio spread


def _digest(f: dict[str, Any]) -> int:
    return _mix(_static_digest(f), f["step"])


def _chain(cum: int, d: int) -> int:
    # FNV-1a over 64-bit words: order-sensitive, cheap (~0.2 us), and a consistency
    # check between cooperating ranks needs no cryptographic strength.
    return ((cum ^ d) * 0x100000001B3) & _MASK


def _merge(view: dict[str, Any] | None, ring: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A peer's published record extended with its flight recorder's later entries."""
    view = {"groups": {}} if view is None else view
    groups = view.setdefault("groups", {})
    for name, table in ring.items():
        old = groups.get(name)
        if old is None:
            groups[name] = table
            continue
        seen = {row[0] for row in old["w"]}
        old["w"] = old["w"] + [row for row in table["w"] if row[0] not in seen]
        old["n"] = max(old["n"], table["n"])
    return view


def _user_frame(frame: Any) -> Any:
    """The first frame outside torch.distributed (bounded: torch's helpers nest 1-2)."""
    f = frame
    for _ in range(_FRAME_WALK):
        back = f.f_back
        if back is None:
            break
        f = back
        if not f.f_code.co_filename.startswith(_TORCH_DIST_DIR):
            return f
    return frame


def entry_dict(entry: tuple[Any, ...]) -> dict[str, Any]:
    """``guard.collective``: the in-flight call, for the watchdog (``op``, ``seq``,
    ``group``, ``shapes``, ``dtype``, ``site``, ``step``). Built per blocking call, so
    plain values only (~0.4 us); the watchdog formats them when it reports."""
    g, seq, op, _, shape, dtype, _, _, file, line, step, _ = entry
    return {
        "op": op,
        "seq": seq,
        "group": g.name,
        "shapes": None if shape is None else tuple(shape),
        "dtype": None if dtype is None else str(dtype),
        "site": f"{file}:{line}" if line else file,
        "step": step,
    }


_SUM = getattr(dist.ReduceOp, "SUM", None)
_MAX = getattr(dist.ReduceOp, "MAX", None)
#: How guardrails' own agreements are named in the audited sequence (see record_own).
OWN_PREFIX = "guardrails "


def is_own(entry: tuple[Any, ...]) -> bool:
    """Whether an audited entry is one of guardrails' own agreements (record_own)."""
    return str(entry[2]).startswith(OWN_PREFIX)


#: Frames that are not the user's loop: guardrails' own, and torch's (an optimizer's
#: step wrapper, an LR scheduler's).
_OWN_DIRS = (os.path.dirname(__file__), os.path.dirname(torch.__file__))
_TENSOR_KW = {
    "all_reduce": "tensor",
    "broadcast": "tensor",
    "reduce": "tensor",
    "all_gather": "tensor",
    "all_gather_into_tensor": "input_tensor",
    "reduce_scatter": "output",
    "reduce_scatter_tensor": "output",
    "all_gather_single": "input_tensor",
    "reduce_scatter_single": "output",
    "gather": "tensor",
    "scatter": "tensor",
    "barrier": "",
    "monitored_barrier": "",
    "all_to_all_single": "input",
    "all_to_all": "input_tensor_list",
    "send": "tensor",
    "recv": "tensor",
    "isend": "tensor",
    "irecv": "tensor",
}


# ---------------------------------------------------------------------- the error


def _describe(e: dict[str, Any] | None) -> str:
    if e is None:
        return "-"
    red = f"({e['reduce_op']})" if e.get("reduce_op") else ""
    root = f" root={e['root']}" if e.get("root") is not None else ""
    tensor = f" {e['dtype']}{e['shape']}" if e.get("dtype") else ""
    step = f", step {e['step']}" if e.get("step") is not None else ""
    return f"#{e['seq']} {e['op']}{red}{tensor}{root} at {e['site']}{step}"


def _error(verdict: dict[str, Any], rank: int, step: int | None) -> CollectiveMismatchError:
    seq, group = verdict["seq"], verdict["group"]
    per_rank: dict[int, Any] = {}
    lines = []
    for r_s, info in sorted(verdict["per_rank"].items(), key=lambda kv: int(kv[0])):
        r = int(r_s)
        entries = info["entries"]
        at_first = next((e for e in entries if e["seq"] == seq), None)
        per_rank[r] = at_first if at_first is not None else {"seq": None, "issued": info["n"]}
        if not entries:
            lines.append(
                f"  rank {r}: has issued {info['n']} collective(s) on this group, not #{seq} yet"
            )
            continue
        shown = "; then ".join(_describe(e) for e in entries[:3])
        lines.append(f"  rank {r}: {shown}")
    where = "the default group" if group == "default" else f"group {group}"
    ranks = verdict.get("ranks", [])
    message = (
        f"collective mismatch on {where} (ranks {_span(ranks)}): the ranks' sequences of "
        f"collectives differ from collective #{seq} on.\n"
        + "\n".join(lines)
        + "\n  Ranks pair collectives by their order, so from here each rank exchanges data "
        'with a different call: the job hangs (NCCL), dies in the backend (gloo: "Is there '
        'a distributed collective mismatch", "Connection reset by peer"), or, with equal '
        "shapes, silently mixes unrelated tensors.\n"
        "  Likely cause: a collective that only some ranks reach (an `if rank == 0:` branch "
        "around logging, evaluation or checkpointing that calls one, a data-dependent branch, "
        "an early `break`), or ranks issuing the same collectives in a different order."
    )
    hint = (
        "make every rank issue the same collectives in the same order: at the lines above, "
        "move the collective out of the rank- or data-dependent branch (run it on every rank "
        "and use the result only where needed), or guard the whole branch by a decision all "
        "ranks share (e.g. the step number), not by the rank."
    )
    return CollectiveMismatchError(
        message, rank=rank, step=step, hint=hint, per_rank=per_rank, seq=seq, group=group
    )


def _span(ranks: list[int]) -> str:
    if ranks and ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))


# ---------------------------------------------------------------------- flight recorder


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
                if magic == _MAGIC and not _dist.pid_alive(pid):
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
