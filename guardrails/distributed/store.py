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
  serialises its client calls with a lock). Keys are namespaced per guard generation
  (``guardrails/g<N>/<name>/``) so two guards in one process, one after the other,
  never read each other's keys.
* :func:`open_side_group`: a gloo process group over the same ranks, created by every
  rank at guard start (``new_group`` is collective), for the rare synchronous
  agreement (every rank calls the same collective at the same step): a CPU
  ``all_reduce`` of a few numbers costs ~0.1-0.3 ms on gloo, so it is done every
  second or so, never every step. Its calls are not the user's collectives: the
  auditor must ignore ``group is guard.side_group``.

Both are ``None`` in a single-process run; callers treat ``None`` as "nobody to talk to".

Over a side store, :func:`claim_verdict` and :func:`read_verdict` make one rank's
finding the job's: the first rank to claim it wins, and every rank reports that one.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
import uuid
from datetime import timedelta
from typing import Any

import torch.distributed as dist

log = logging.getLogger("guardrails.guard")

#: Guards started in this process so far. Every rank starts its guards in the same order,
#: so the count is the same on every rank and makes key names unique per guard.
_generation = itertools.count()


def distributed() -> bool:
    """Whether a default process group with more than one rank is up."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def next_generation() -> int:
    return next(_generation)


def side_store(generation: int, name: str) -> dist.Store | None:
    """A store whose keys live under ``guardrails/g<generation>/<name>/``, or ``None``
    when not distributed.

    Uses ``distributed_c10d._get_default_store()``, private but present since torch 1.x
    and what torch's own store-based barrier uses; the public alternative (a TCPStore of
    our own) would need a free port that every rank agrees on before we can talk.
    """
    if not distributed():
        return None
    from torch.distributed import distributed_c10d

    return dist.PrefixStore(
        f"guardrails/g{generation}/{name}/", distributed_c10d._get_default_store()
    )


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


def open_side_group(timeout_s: float = 600.0) -> dist.ProcessGroup | None:
    """A gloo group over every rank, or ``None`` when not distributed. Collective: every
    rank must call it, in the same order relative to other group creations."""
    if not distributed():
        return None
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


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
    """The value published under ``key`` by :func:`claim_verdict`, or ``None`` if there
    is none (after waiting up to ``wait_s`` for it, polling every ``poll_s``)."""
    deadline = time.monotonic() + wait_s
    while True:
        if store.check([key]):
            return json.loads(bytes(store.get(key)).decode())
        if time.monotonic() >= deadline:
            return None
        time.sleep(poll_s)
