"""The side channel: how ranks talk to each other without touching the training's
process group.

Principle 3 and 4 of the design need ranks to exchange small facts (heartbeats,
collective fingerprints, "stop at step N", preflight config) while the training's own
process group is busy, possibly stuck, and without adding collectives to it (an extra
collective on the main group would change the very sequence the auditor checks, and
costs a round trip per call: ``TORCH_DISTRIBUTED_DEBUG=DETAIL``'s price). Two channels,
both opened once per guard:

* :func:`side_store`: a ``PrefixStore`` over the default process group's key-value
  store (the ``TCPStore`` torchrun's agent or ``init_process_group`` already runs).
  For asynchronous traffic: one rank writes, others read when they like; a background
  thread may use it while the main thread is stuck in a collective (``TCPStore``
  serialises its client calls with a lock). Keys are namespaced per launch attempt and
  guard generation (``guardrails/attempt<K>/g<N>/<name>/``): two guards in one
  process, one after the other, never read each other's keys, and neither does the
  attempt a torchrun restart started (its workers share the agent's store with the
  attempt before: a verdict left there was read as news, issue 50). See
  ``distributed/attempt.py`` for when ``attempt<K>/`` is known.
* :func:`open_side_group`: a gloo process group over the same ranks, created by every
  rank at guard start (``new_group`` is collective), for the rare synchronous
  agreement (every rank calls the same collective at the same step): a CPU
  ``all_reduce`` of a few numbers costs ~0.1-0.3 ms on gloo, so it is done every
  second or so, never every step. Its calls are not the user's collectives: the
  auditor must ignore ``group is guard.side_group``.

Both are ``None`` in a single-process run; callers treat ``None`` as "nobody to talk to".

Over a side store, :func:`claim_verdict` and :func:`read_verdict` make one rank's
finding the job's: the first rank to claim it wins, and every rank reports that one.

What keeps the store's load flat in the number of ranks N (one TCPStore server does
~90,000 calls/s; 10,000 ranks each polling five keys a second would take half of it):

* :class:`News`: one counter for the whole job. A rank with something for the others
  (a verdict, the end of its loop, a request for heartbeats, a stop) writes it, then
  bumps the counter; every rank reads the counter once a period and looks at the keys
  behind it only when it moved. A healthy run costs one call per rank per period for
  all of guardrails' watching, whatever the number of components.
* :func:`stretched`: the periods of the polls grow with N so that all ranks together
  stay under :data:`STEADY_CALLS_PER_S` per periodic task: 1 s up to 2,500 ranks, 4 s
  at 10,000. Detection gets slower by seconds at that size; the store stays free for
  the job's own use (rendezvous, torch's barriers, the launcher's health checks).
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import threading
import time
import uuid
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from guardrails.distributed import attempt

log = logging.getLogger("guardrails.guard")

#: Guards started in this process so far. Every rank starts its guards in the same order,
#: so the count is the same on every rank and makes key names unique per guard.
_generation = itertools.count()


_GLOO_LAZY = "TORCH_GLOO_LAZY_INIT"

#: Store calls per second, summed over all ranks, that one periodic task of guardrails
#: (the news poll, the collective comparison, the stop/save agreement) may cost in a
#: healthy run: three tasks take 7,500/s, ~8% of the ~90,000 calls/s one TCPStore
#: server sustains (measured with guardrails' call mix, ``benchmarks/store_server.py``).
STEADY_CALLS_PER_S = 2500.0


def stretched(period_s: float, world: int, *, calls: float = 1.0) -> float:
    """``period_s``, or longer: the period at which ``world`` ranks each making
    ``calls`` store calls per period stay within :data:`STEADY_CALLS_PER_S`."""
    return max(period_s, calls * world / STEADY_CALLS_PER_S)


class News:
    """The job's news counter (see the module docstring): :meth:`post` after writing
    something other ranks must see, :meth:`current` to learn whether anything was
    posted. Reads are shared by every thread of the process: a value younger than the
    caller's ``max_age_s`` is returned without a store call, so the watchdog, the
    auditor and the checkpointer polling at their own periods cost one call a period
    between them."""

    def __init__(self, store: dist.Store, *, world: int) -> None:
        self._store = store
        #: How old a read may be by default: 1 s, stretched with the world size.
        self.period_s = stretched(1.0, world)
        self._lock = threading.Lock()
        self._value = 0
        self._read_at = -math.inf

    def post(self, *, verdict: bool = False) -> None:
        """Tell every rank to look (call it after the write it announces).
        ``verdict``: what was written is a verdict the job will end with; the first
        one's wall-clock time is kept (:meth:`verdict_claimed_at`)."""
        if verdict:
            self._store.compare_set("verdict_at", "", repr(time.time()))
        self._store.add("n", 1)

    def verdict_claimed_at(self) -> float | None:
        """When (``time.time()``) the first verdict of the job was claimed, on any rank,
        or ``None``. For a rank that got a signal: a verdict claimed before it is what
        ended the job, whether or not this rank had read it yet."""
        if not self._store.check(["verdict_at"]):
            return None
        return float(bytes(self._store.get("verdict_at")).decode())

    def current(self, *, max_age_s: float | None = None) -> int:
        """The counter, read from the store unless this process read it less than
        ``max_age_s`` (default :attr:`period_s`) ago. It only grows: a larger value
        than last seen means news."""
        if max_age_s is None:
            max_age_s = self.period_s
        with self._lock:
            now = time.monotonic()
            if now - self._read_at >= max_age_s:
                self._value = int(self._store.add("n", 0))
                self._read_at = now
            return self._value


def wait_keys(store: dist.Store, keys: list[str], timeout: timedelta, *, world: int) -> None:
    """``store.wait(keys, timeout)`` without holding the store meanwhile. ``TCPStore``'s
    client runs one call at a time for the whole process, and a ``wait`` keeps its turn
    until the keys come: a background writer waiting a minute for a checkpoint's
    commit, or a rank at a barrier waiting for one whose loader is stuck, would hold up
    every other thread's call for that minute, the watchdog's heartbeats included.

    So the wait runs on a clone of the store (``Store.clone()``: a connection of its
    own, dropped on return): one blocking call, woken by the server the moment the keys
    are set, whatever N, where polling would cost a call per poll and up to a poll's
    period of delay (seconds at 10,000 ranks). A store that cannot be cloned is polled:
    ``check`` after 1 ms, then twice as long each time up to 50 ms (stretched with the
    world size: every rank may be polling at once). ``TimeoutError`` at the end."""
    waiter = _clone(store)
    if waiter is not None:
        try:
            waiter.wait(keys, timeout)
            return
        except dist.DistStoreError as exc:
            if not store.check(keys):  # the wait's own timeout, or the store is gone
                raise TimeoutError(
                    f"{len(keys)} key(s) ({keys[0]}...) not set within "
                    f"{timeout.total_seconds():.0f} s ({exc})"
                ) from exc
            return
    deadline = time.monotonic() + timeout.total_seconds()
    poll_s, longest_s = 0.001, stretched(0.05, world)
    while not store.check(keys):
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"{len(keys)} key(s) ({keys[0]}...) not set within {timeout.total_seconds():.0f} s"
            )
        time.sleep(poll_s)
        poll_s = min(2 * poll_s, longest_s)


def _clone(store: dist.Store) -> dist.Store | None:
    """A second client of ``store``'s server, or ``None`` where there is none to have:
    ``Store.clone()`` is absent before torch 2.6-ish builds and raises on stores that
    do not implement it."""
    clone = getattr(store, "clone", None)
    if clone is None:
        return None
    try:
        return clone()
    except Exception:  # not implemented for this store type: poll instead
        log.debug("guardrails: could not clone the store; polling", exc_info=True)
        return None


def barrier(store: dist.Store, name: str, *, world: int, timeout_s: float = 600.0) -> None:
    """Every rank waits here until all ``world`` ranks have arrived: one ``add`` each,
    then waits (:func:`wait_keys`, on a store client of its own) for the key the last
    rank sets. No collective, so no ring whose latency grows with N; and the process's
    own store client stays free for the watchdog while a rank never arrives (its loader
    stuck before the first batch, say)."""
    if store.add(f"{name}/arrived", 1) >= world:
        store.set(f"{name}/go", "1")
    else:
        wait_keys(store, [f"{name}/go"], timedelta(seconds=timeout_s), world=world)


def same_everywhere(
    store: dist.Store, name: str, value: str, *, world: int, trouble: bool = False
) -> bool:
    """Whether every rank called this with the same ``value`` (a digest, never empty)
    and none with ``trouble``: the same answer on every rank, in four store calls a
    rank whatever N. The first rank's value is kept (``compare_set``), a rank whose
    value differs counts itself, and after a :func:`barrier` every rank reads the
    count. Every rank must call it, with the same ``name``. Details on a ``False``
    are the caller's to gather (the failure path)."""
    first = bytes(store.compare_set(f"{name}/first", "", value)).decode()
    if first != value or trouble:
        store.add(f"{name}/trouble", 1)
    barrier(store, name, world=world)
    return int(store.add(f"{name}/trouble", 0)) == 0


def distributed() -> bool:
    """Whether a default process group with more than one rank is up."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def next_generation() -> int:
    return next(_generation)


def side_store(generation: int, name: str) -> dist.Store | None:
    """A store whose keys live under ``guardrails/attempt<K>/g<generation>/<name>/``
    (``attempt<K>/`` under a single-agent torchrun, see :mod:`.attempt`; absent
    elsewhere), or ``None`` when not distributed.

    Uses ``distributed_c10d._get_default_store()``, private but present since torch 1.x
    and what torch's own store-based barrier uses; the public alternative (a TCPStore of
    our own) would need a free port that every rank agrees on before we can talk.
    """
    if not distributed():
        return None
    from torch.distributed import distributed_c10d

    # The attempt here and not only in the rendezvous (attempt.namespaced_rendezvous):
    # a process group made outside @guardrails.record still shares the agent's store
    # with the previous attempt.
    prefix = f"guardrails/{attempt.key_prefix()}g{generation}/{name}/"
    return dist.PrefixStore(prefix, distributed_c10d._get_default_store())


def publish_run_id(generation: int) -> str | None:
    """A new id for this guard's run, the same on every rank: rank 0 draws it and puts
    it in the side store; call it *before* a collective every rank passes (the side
    group's creation), then :func:`read_run_id` after it, so no rank ever waits for the
    key. Returns the id on rank 0 (and in a single process), ``None`` elsewhere.

    ``run_dir/events.jsonl`` is shared by every run that used the directory and every
    rank; the id on each rank's ``start`` event is what tells runs apart (start times
    cannot: a rank's start can come before rank 0's, and a run can add ranks)."""
    store = side_store(generation, "run")
    if store is not None and dist.get_rank() != 0:
        return None
    run_id = uuid.uuid4().hex[:12]
    if store is not None:
        store.set("id", run_id)
    return run_id


def read_run_id(generation: int, published: str | None) -> str:
    """This guard's run id: ``published`` (rank 0's own), else rank 0's from the store."""
    if published is not None:
        return published
    store = side_store(generation, "run")
    assert store is not None  # publish_run_id returned None: distributed
    return bytes(store.get("id")).decode()


def publish_refusal(generation: int, message: str | None) -> None:
    """Rank 0's verdict on its run_dir lock: the reason not to start (the run_dir is
    another job's), or ``None`` to go on. Always published, so the other ranks'
    :func:`read_refusal` can wait for it: the side group's creation is no barrier
    (torch skips its store barrier unless ``TORCH_DIST_INIT_BARRIER=1``), and a rank that
    only checked for a refusal could look before rank 0 had written it, start alone,
    and die later of rank 0's departure instead of the refusal."""
    run = side_store(generation, "run")
    if run is not None:
        run.set("refused", message or "")


def read_refusal(generation: int) -> str | None:
    """Rank 0's published refusal, or ``None``: one blocking ``get`` (rank 0 publishes
    a verdict either way), once per guard. A rank that read one says so
    (:func:`wait_refusal_read`)."""
    run = side_store(generation, "run")
    if run is None:
        return None
    message = bytes(run.get("refused")).decode()
    if not message:
        return None
    run.add("refused_read", 1)
    return message


def wait_refusal_read(generation: int, world: int, timeout_s: float = 30.0) -> None:
    """On rank 0, before it raises its refusal: wait (at most ``timeout_s``) until every
    other rank has read it. Rank 0 hosts the store; a rank 0 that left at once took the
    store with it while another rank was still reading the refusal, which then died
    of a lost connection instead of the refusal. The refusal path only."""
    run = side_store(generation, "run")
    if run is not None:
        _wait_count(run, "refused_read", world - 1, timeout_s)


def agent_holds_store() -> bool:
    """Whether torchrun's agent hosts the job's store (``TORCHELASTIC_USE_AGENT_STORE``,
    the default of its static and c10d rendezvous): it outlives any rank. Else rank 0's
    process hosts it (``MASTER_ADDR``, ``srun``), and the store dies with rank 0."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"


def leave(generation: int, *, rank: int, world: int, wait: bool, timeout_s: float = 10.0) -> None:
    """At a guard's close, after its last store call: every rank but 0 says it is done
    with the store; rank 0 (``wait``: its run ended cleanly), whose process hosts the
    store outside torchrun, waits at most ``timeout_s`` for them. A script may exit as
    soon as its guard closes, and rank 0's took the store with it while a slower rank
    still made its last calls (the close's stop decision, the watchdog's word): that
    rank died of "DistNetworkError: Broken pipe" at the end of a clean 2-rank run.
    One ``add`` per rank; rank 0 reads one counter."""
    run = side_store(generation, "run")
    if run is None or world < 2:
        return
    try:
        if rank != 0:
            run.add("left", 1)
        elif wait and not agent_holds_store():
            _wait_count(run, "left", world - 1, timeout_s)
    except Exception as e:  # the store is gone already: nobody is left to wait for
        log.debug("guardrails: the store was gone at close: %s", e)


def _wait_count(run: dist.Store, key: str, count: int, timeout_s: float) -> None:
    """Wait (at most ``timeout_s``) until the counter ``key`` reaches ``count``."""
    deadline = time.monotonic() + timeout_s
    pause = 0.01
    while run.add(key, 0) < count and time.monotonic() < deadline:
        time.sleep(pause)
        pause = min(pause * 2, 0.5)


def open_side_group(timeout_s: float = 600.0) -> dist.ProcessGroup | None:
    """A gloo group over every rank, or ``None`` when not distributed. Collective: every
    rank must call it, in the same order relative to other group creations."""
    if not distributed():
        return None
    # Lazily connected: gloo otherwise opens a socket to every other rank at creation
    # (N-1 a rank, each pair's address through the store: O(N^2) store reads at 10,000
    # ranks), for a group that on a healthy run carries no collective at all. With
    # TORCH_GLOO_LAZY_INIT a pair connects on its first use (ring algorithms: the
    # neighbours only). Read when the group is built, so set for that call only;
    # torch versions without it ignore it.
    previous = os.environ.get(_GLOO_LAZY)
    os.environ[_GLOO_LAZY] = "1"
    try:
        return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    finally:
        if previous is None:
            del os.environ[_GLOO_LAZY]
        else:
            os.environ[_GLOO_LAZY] = previous


def close_side_group(group: dist.ProcessGroup | None) -> None:
    if group is None or not dist.is_initialized():
        return
    try:
        dist.destroy_process_group(group)
    except Exception:  # the job is already tearing down; nothing left to release
        log.debug("guardrails: could not destroy the side group", exc_info=True)


def claim_verdict(store: dist.Store, value: Any, key: str = "verdict") -> bool:
    """Publish ``value`` (JSON) under ``key`` unless another rank claimed it first;
    return whether this rank won. First writer wins, so every rank reports the same
    finding (one hang, one mismatch), not each its own view of it.

    The claim is an atomic counter: ``store.add`` returns the new count, so exactly one
    rank sees 1 whatever the timing (a check-then-set would let two ranks both find
    the key absent and overwrite each other). The winner sets the value right after
    its add, so a loser may find it absent for a moment: see ``read_verdict``'s
    ``wait_s``."""
    if store.add(f"{key}_claim", 1) == 1:
        store.set(key, json.dumps(value, default=str))
        return True
    return False


def read_verdict(
    store: dist.Store, key: str = "verdict", *, wait_s: float = 0.0, poll_s: float = 0.05
) -> Any:
    """The value published under ``key`` by :func:`claim_verdict` (or any JSON value
    set once under it, by ``compare_set``), or ``None`` if there is none (after waiting
    up to ``wait_s`` for it, polling every ``poll_s``)."""
    deadline = time.monotonic() + wait_s
    while True:
        if store.check([key]):
            return json.loads(bytes(store.get(key)).decode())
        if time.monotonic() >= deadline:
            return None
        time.sleep(poll_s)
