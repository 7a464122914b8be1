"""The committer of a failure save (``failure.py``) waiting for the other ranks' records
in the checkpoint's side store: how long it waits, for whom, and at what cost to the
store.

Each rank adds to two counters, ``begun`` as it begins its part and ``filed`` once its
record is in; the committer polls the two (not a key per rank: 10,000 ranks' records
polled every 50 ms would be 200,000 calls a second, twice what one store serves) and
reads the records once. It stops waiting when every rank has filed, save those gone
(dead, or their node lost), or when every rank that began has filed and the others are
not coming soon: past :data:`BEGUN_WAIT_S`, or past :data:`COPY_WAIT_S` for ranks whose
parts it can write from the copies its host holds (``from_peers.py``).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from guardrails.distributed.store import stretched, wait_keys

#: How often the committer reads the two counters (stretched with N).
_POLL_S = 0.05

#: How long one rank waits for another to begin its failure save. Ranks that fail
#: together on one verdict begin within ~1 s of each other, but a rank stuck in a sleep
#: or a C call learns of a peer's failure only at its watchdog's next poll (1 s), gives a
#: failure raised everywhere a beat (3 s) and its main thread ``abort_after_s`` (2 s)
#: before its thread saves: 6.7 s was seen on a loaded 2-core host with 4 ranks, where 3 s
#: left the hang's save incomplete. Past it rank 0 waits no more for a rank not begun (a
#: dead one; one that failed alone left, and rank 0 commits its part when it fails too).
BEGUN_WAIT_S = 10.0

#: ...except for ranks whose parts the committer's host holds copies of: written from
#: those copies after 2 s, twice the spread of ranks failing on one verdict. A rank stuck
#: in a hang hears of its peers' failure only once their saves end, so every hang's save
#: waited the whole 10 s for it (4 gloo ranks, 2 simulated nodes).
COPY_WAIT_S = 2.0


def records(
    store: Any,
    key: str,
    others: list[int],
    deadline: float,
    *,
    gone: Callable[[], list[int]],
    held: Callable[[], set[int]],
) -> dict[int, dict[str, Any]]:
    """The records of ``others`` under ``key`` in by ``deadline`` (a rank without one is
    dead, stuck, or waiting in a collective for the committer). ``gone()``: the ranks
    not to wait for; ``held()``: those whose parts the committer's host holds copies of,
    asked once, after :data:`COPY_WAIT_S`."""
    t0 = time.monotonic()
    copies: set[int] | None = None
    poll_s = stretched(_POLL_S, len(others) + 1)
    while time.monotonic() < deadline:
        filed = int(store.add(f"{key}/filed", 0))
        lost = gone()
        if filed >= len(others) - len(lost):
            break
        waited_s = time.monotonic() - t0
        if waited_s > COPY_WAIT_S and int(store.add(f"{key}/begun", 0)) <= filed:
            # Everyone who began has filed: past the wait for beginners, that is all;
            # before it, enough when each rank still to file has a copy here.
            if waited_s > BEGUN_WAIT_S:
                break
            if copies is None:
                copies = held()
            unfiled = [r for r in sorted(copies) if r not in lost]
            unfiled = [r for r in unfiled if not store.check([f"{key}/files/{r}"])]  # a host's
            if filed + len(lost) + len(unfiled) >= len(others):
                break
        time.sleep(poll_s)
    return _read(store, key, others)


def late(
    store: Any, key: str, ranks: list[int], deadline: float, *, world: int
) -> dict[int, dict[str, Any]]:
    """The records of ``ranks``, which began their parts after the committer stopped
    waiting for them, waited for until 1 s before ``deadline`` (to commit)."""
    keys = [f"{key}/files/{r}" for r in ranks]
    wait_s = max(0.0, deadline - time.monotonic() - 1.0)
    with contextlib.suppress(TimeoutError):
        wait_keys(store, keys, timedelta(seconds=wait_s), world=world)
    return _read(store, key, ranks)


def _read(store: Any, key: str, ranks: list[int]) -> dict[int, dict[str, Any]]:
    """The records of ``ranks`` that are in, read once (a check and a get each)."""
    keys = {r: f"{key}/files/{r}" for r in ranks}
    return {r: json.loads(store.get(k)) for r, k in keys.items() if store.check([k])}
