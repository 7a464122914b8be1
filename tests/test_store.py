"""The side store's first-writer-wins verdict (guardrails.distributed.store), on a real HashStore:
the store kind torch's own tests use in one process, with TCPStore's add/set/check/get."""

from __future__ import annotations

import threading
import time

import torch.distributed as dist

from guardrails.distributed.store import claim_verdict, read_verdict


def test_the_first_claim_wins_and_every_reader_sees_it():
    store = dist.HashStore()
    assert read_verdict(store) is None
    assert claim_verdict(store, {"kind": "hang", "by": 1})
    assert not claim_verdict(store, {"kind": "hang", "by": 0})  # too late: not written
    assert read_verdict(store) == {"kind": "hang", "by": 1}
    # Keys are separate verdicts.
    assert claim_verdict(store, [1, 2], key="other") and read_verdict(store, "other") == [1, 2]


def test_one_winner_among_racing_claims():
    store = dist.HashStore()
    won: list[int] = []
    barrier = threading.Barrier(8)

    def claim(rank: int) -> None:
        barrier.wait()
        if claim_verdict(store, {"by": rank}):
            won.append(rank)

    threads = [threading.Thread(target=claim, args=(r,)) for r in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and read_verdict(store) == {"by": won[0]}


def test_a_reader_waits_for_a_claim_being_written():
    store = dist.HashStore()
    timer = threading.Timer(0.2, claim_verdict, args=(store, "late"))
    timer.start()
    t0 = time.monotonic()
    assert read_verdict(store, wait_s=5.0) == "late"
    assert time.monotonic() - t0 < 4.0
    timer.join()
    # Nothing to wait for: None after the wait.
    assert read_verdict(dist.HashStore(), wait_s=0.1) is None
