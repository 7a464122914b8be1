"""CollectiveAuditor: every rank's sequence of collectives, compared across ranks off
the hot path, so a desync is an error naming each rank's call instead of a hang.

Collective mismatches ("barrier mismatch", "only rank 0 does something that includes a
collective") end today in a 10-minute NCCL timeout, a 30-minute gloo one, or gloo's
"Is there a distributed collective mismatch in your code?" with no rank, op or line;
and an extra *same-shape* all_reduce on one rank raises nothing at all: it silently
pairs with another rank's gradient all-reduce. ``TORCH_DISTRIBUTED_DEBUG=DETAIL``
catches some of it by adding a collective per call, which is why it is a debug-only
tool. Here the per-call work is host bookkeeping and the comparison is elsewhere:

* **Main thread, per call, O(1)** (~3 us on a busy EPYC host, torch 2.13: ~0.9 us
  bookkeeping, ~0.7 us flight recorder, ~0.45 us the ``guard.collective`` dict, the rest
  argument handling; ``benchmarks/audit_bench.py``): the wrapper over ``torch.distributed.X``
  reads the op, the tensor's shape and dtype, the reduce op, the root, the group, the
  caller's ``file:line`` (``sys._getframe(1)``; a bounded walk of at most 8 frames only
  when that frame is torch's own, e.g. ``all_gather_object`` calling ``all_gather``)
  and the step; takes the group's next sequence number; appends one tuple to a deque;
  and writes one fixed-size slot of a local memory-mapped flight recorder. No store
  call, no collective, no formatting beyond a cache hit. ``guard.collective`` holds the
  in-flight call (a dict) for the watchdog while a blocking call runs.
* **Background thread, every ``interval_s``** (0.25 s, stretched from 313 ranks on
  so that the job's total stays within the store's budget, ``distributed/store.py``):
  hashes the new entries into a per-group rolling hash, publishes this rank's
  fingerprint (count, hash anchors, the last entries; the group's size, not its rank
  list) to ``guard.side_store("audit")``, and compares its own sequence with its
  neighbour's (the member just before it in the group) on their common prefix only: a
  rank that is ahead is not a mismatch, and nothing is compared beyond what both
  issued. Neighbours chain through the group, so any two ranks that differ are seen
  to, while each record has one reader (two store calls a rank a tick, no key read by
  N ranks). A difference is written once as the verdict and posted as the job's
  news; every rank's thread sees it and calls ``guard.fail_from_thread``: the main
  thread raises at its next step boundary, or, stuck in a collective, the process
  exits non-zero after the grace period.
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
from the autograd thread), the auditor's service to the other guards (its protocol:
``engine/services.CollectiveRecorder``, which also names ``record_own`` and ``recent``)::

    guard.shared.auditor.record(
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
functions, so they are seen and compared (tests/guards/test_audit.py, gloo, torch 2.13).

Where the parts live: this module holds the component (patching, the per-call
bookkeeping, the background comparison, close); ``calls.py`` what a call is (the op
table, groups, call sites); ``seq.py`` a group's sequence as ranks publish and compare
it; ``flight.py`` the flight recorder; ``report.py`` the error's text.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from guardrails._errors import CollectiveMismatchError
from guardrails.distributed import store as _store
from guardrails.distributed.store import claim_verdict, read_verdict
from guardrails.engine.component import Component
from guardrails.engine.config import configure
from guardrails.guards.audit.calls import (
    _FRAME_WALK,
    _MAX,
    _OWN_DIRS,
    _SUM,
    _TENSOR_KW,
    _TORCH_DIST_DIR,
    OPS,
    OWN_PREFIX,
    _Group,
    _Spec,
    _user_frame,
    entry_dict,
)
from guardrails.guards.audit.flight import _SLOT, _SLOT_HEAD, _Ring, _ring_path, _sweep_stale_rings
from guardrails.guards.audit.report import _error
from guardrails.guards.audit.seq import _display, _fields, _History, _merge
from guardrails.util.checks import flag, non_negative

if TYPE_CHECKING:
    from guardrails.engine.guard import Guard

log = logging.getLogger("guardrails.audit")
# At close, how many members before a neighbour that never published its final record
# stand in for it (read from the store, or their flight recorders).
CLOSE_FALLBACK = 4
_get_ident = threading.get_ident  # bound once: read on every collective call


class CollectiveAuditor(Component):
    """Records every rank's collectives and raises
    :class:`~guardrails.CollectiveMismatchError` on every rank as soon as two ranks'
    sequences differ. A no-op in a single-process run. Knobs:
    :class:`CollectiveAuditor.Config` (``guardrails.guard(audit=...)``)."""

    @dataclass(kw_only=True)
    class Config:
        """CollectiveAuditor's knobs.

        Attributes:
            interval_s: how often the background thread publishes this rank's
                fingerprint and compares (seconds). Default 0.25: a mismatch is seen in
                about two intervals; each costs this rank 2 store calls (set its
                record, get its neighbour's), all off the main thread. It stretches
                with the world size (to 2 N / 2,500 s from 313 ranks on: 8 s at
                10,000 ranks) so the job's total stays within the store's budget.
            close_wait_s: on close, how long to wait for the other ranks' final records
                before the last comparison. Default 1 s: ranks that finish the same
                loop close within milliseconds of each other; only a rank that never
                arrives (dead, stuck, or still training after this one ran out of data)
                makes a close wait that long.
            abort_after_s: once a mismatch is known, how long the main thread may stay
                inside a collective before the process ends non-zero
                (``Guard.fail_from_thread``). Default 5 s.
            flight_recorder: keep the last 64 calls in a memory-mapped file so a rank on
                the same host can explain a peer that the backend aborted. Default True.
        """

        interval_s: float = 0.25
        close_wait_s: float = 1.0
        abort_after_s: float = 5.0
        flight_recorder: bool = True

        def __post_init__(self) -> None:
            non_negative("interval_s", self.interval_s)
            if not self.interval_s > 0:
                raise ValueError(f"interval_s must be > 0, got {self.interval_s!r}")
            non_negative("close_wait_s", self.close_wait_s)
            non_negative("abort_after_s", self.abort_after_s)
            self.interval_s = float(self.interval_s)
            self.close_wait_s = float(self.close_wait_s)
            self.abort_after_s = float(self.abort_after_s)
            flag("flight_recorder", self.flight_recorder)  # "no" is truthy: never taken as True

    name = "audit"
    distributed_only = True
    # Closing runs in reverse: a mismatch that explains a peer's crash replaces the
    # loop's error before the watchdog's "rank failed" would.
    after = ("watchdog",)

    def __init__(self, config: CollectiveAuditor.Config | None = None, /, **knobs: Any) -> None:
        configure(self, config, knobs)
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
        self._published_peers: set[int] = set()
        # neighbour -> {group: this rank's count when a read of it covered them all}
        self._covered: dict[int, dict[str, int]] = {}
        self._news_seen = 0
        self._period_s = self.interval_s

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
        self._published_peers, self._news_seen = set(), 0  # 0: this guard's keys are new
        self._covered = {}
        # Two store calls a tick (this rank's record, its neighbour's): the interval
        # stretches with the world size to keep the job's total within budget.
        self._period_s = _store.stretched(self.interval_s, guard.world_size, calls=2)
        self._main_ident = threading.get_ident()
        self._store = guard.side_store("audit")
        # The run's id names the flight recorders, so a survivor finds a dead peer's
        # without the store, which may have died with it (rank 0 hosts it outside
        # torchrun).
        self._token = guard.run_id
        _sweep_stale_rings()  # every rank: each host has its own /dev/shm
        if self.flight_recorder and self._token:
            self._ring = _Ring.create(_ring_path(self._token, self._rank), self._rank)
        self._active = True
        self._patch()
        guard.shared.auditor = self
        self._thread = threading.Thread(target=self._run, name="guardrails-audit", daemon=True)
        self._thread.start()

    def on_end(self, guard: Guard, exc: BaseException | None) -> None:
        if self._guard is None:
            return
        self._active = False
        self._unpatch()
        if guard.shared.auditor is self:
            guard.shared.auditor = None
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
            guard = auditor._guard
            if guard is not None:  # where ranks wait for each other: the pace's judge
                guard.shared.collective_phases.add(guard.phase)
            if guard is not None and (
                apos is None
                or (apos >= 0 and not (args[apos] if n > apos else kwargs.get("async_op")))
            ):  # blocking: the watchdog may look while we wait
                shared = guard.shared
                previous = shared.collective
                shared.collective = entry_dict(entry)
                try:
                    return fn(*args, **kwargs)
                finally:
                    shared.collective = previous
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
        while not self._stop.wait(self._period_s):
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
                hist = self._hist[g.name] = _History(g.name, g.ranks, self._rank)
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
        if kw.get("final"):  # a flag a closing neighbour polls, instead of the record
            self._store.set(f"final/{self._rank}", "1")

    def _tick(self) -> None:
        self._drain()
        self._publish()
        if self.error is not None or self._guard is None:
            return
        # A verdict is looked for only when the job's news moved (a claim posts it).
        news = self._guard.news.current()
        verdict = None
        if news != self._news_seen:
            self._news_seen = news
            verdict = self._read_verdict()
        if verdict is None:
            before = {h.before for h in self._hist.values()} - {None, self._rank}
            views = {
                r: v
                for r in sorted(before)
                if self._unchecked(r) and (v := self._read_peer(r)) is not None
            }
            verdict = self._compare(views)
            if verdict is None:
                self._note_checked(views)
            if verdict is not None:
                self._write_verdict(verdict)
        if verdict is not None:
            self._fail(verdict)

    def _unchecked(self, rank: int) -> bool:
        """Whether this rank issued calls on a group shared with neighbour ``rank``
        since its last comparison covered them all. If not (a rank waiting in a
        collective, or idle), reading the neighbour again could show nothing new: only
        calls both ranks issued are compared, and the neighbour already had all of
        this rank's."""
        covered = self._covered.get(rank, {})
        return any(h.n != covered.get(h.name) for h in self._hist.values() if h.before == rank)

    def _note_checked(self, views: dict[int, dict[str, Any]]) -> None:
        for r, view in views.items():
            covered = self._covered.setdefault(r, {})
            for h in self._hist.values():
                theirs = view.get("groups", {}).get(h.name)
                if h.before == r and theirs is not None and theirs["n"] >= h.n:
                    covered[h.name] = h.n
                else:
                    covered.pop(h.name, None)

    def _fail(self, verdict: dict[str, Any]) -> None:
        # The verdict is in the store for every peer: the flight recorder has served.
        # Unlinked now (the mapping stays valid for the main thread's writes) because a
        # process that ends stuck in a collective never reaches on_end to remove it.
        if self._ring is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._ring.path)
        self._fail_quietly(verdict)
        if self._guard is not None and self.error is not None:
            self._guard.fail_from_thread(self.error, abort_after_s=self.abort_after_s)

    # ------------------------------------------------------------------ store traffic

    def _read_verdict(self) -> dict[str, Any] | None:
        return read_verdict(self._store)

    def _write_verdict(self, verdict: dict[str, Any]) -> None:
        # First writer wins; a rank that lost goes on with the verdict it found.
        if claim_verdict(self._store, verdict) and self._guard is not None:
            self._guard.news.post(verdict=True)

    def _read_peer(self, rank: int) -> dict[str, Any] | None:
        key = f"r{rank}"
        # A record, once published, stays: after the first sight one call, not two.
        if rank not in self._published_peers:
            if not self._store.check([key]):
                return None
            self._published_peers.add(rank)
        return json.loads(self._store.get(key))

    # ------------------------------------------------------------------ comparison

    def _compare(self, views: dict[int, dict[str, Any]]) -> dict[str, Any] | None:
        """The first divergence between this rank's sequences and ``views`` (other
        ranks' published records), as a verdict dict, or ``None``."""
        for view in views.values():
            for name, theirs in view.get("groups", {}).items():
                mine = self._hist.get(name)
                if mine is None:  # a group this rank is not in (or never used)
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
        # Wait for each group's neighbours (the members just before and after this rank)
        # to publish their final records, then compare with them. A neighbour that
        # never does (dead, or stuck in a collective) is completed by its flight
        # recorder (same host), and the members before it stand in (at most
        # CLOSE_FALLBACK). Every rank does the same, so each pair of neighbours is
        # compared from both sides: a few records a rank, whatever N.
        wait_for = sorted(
            {r for h in mine_groups for r in (h.before, h.after)} - {None, self._rank}
        )
        peers = list(wait_for)
        for h in mine_groups:
            members = sorted(h.ranks)
            if h.before is not None:
                at = members.index(h.before)
                peers += members[max(0, at - CLOSE_FALLBACK) : at][::-1]
        views: dict[int, dict[str, Any]] = {}
        # A verdict already taken (a hang the watchdog named): the neighbours stuck with
        # this rank will not publish a final record; compare with what is there.
        taken = self._guard is not None and self._guard.verdict_at is not None
        deadline = time.monotonic() + (0.0 if taken else self.close_wait_s)
        verdict = None
        flags = [f"final/{r}" for r in wait_for]
        while store_ok:
            try:
                verdict = self._read_verdict()
                if verdict is None and (not flags or self._store.check(flags)):
                    views.update((r, v) for r in wait_for if (v := self._read_peer(r)))
                    break
            except Exception:
                store_ok = False
                break
            if verdict is not None or time.monotonic() >= deadline:
                break
            time.sleep(min(0.05, self.interval_s))
        if verdict is None:
            for r in dict.fromkeys(peers):
                if r not in wait_for and all(w in views for w in wait_for):
                    break  # every neighbour is accounted for: no stand-ins needed
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
                ends_run=True,  # the error's report prints it: not twice per rank
                seq=verdict["seq"],
                group=verdict["group"],
            )
