"""The side store's helpers (guardrails.distributed.store) on a real HashStore, threads
standing in for ranks: the store kind torch's own tests use in one process, with
TCPStore's add/set/check/get/compare_set/wait. The first-writer-wins verdict, the
store barrier and agreement, the job's news counter."""

from __future__ import annotations

import sys
import threading
import time

import torch.distributed as dist

from guardrails.distributed.store import (
    News,
    barrier,
    claim_verdict,
    read_verdict,
    same_everywhere,
)


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


def _as_ranks(world: int, fn) -> list:
    """``fn(rank)`` in ``world`` threads at once (ranks sharing one real store)."""
    out: list = [None] * world
    start = threading.Barrier(world)

    def run(rank: int) -> None:
        start.wait()
        out[rank] = fn(rank)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return out


def test_same_everywhere_gives_every_rank_the_same_answer():
    store = dist.HashStore()
    same = _as_ranks(6, lambda r: same_everywhere(store, "a", "digest", world=6))
    assert same == [True] * 6
    # One rank differs (whichever arrives first): every rank hears it.
    odd = _as_ranks(6, lambda r: same_everywhere(store, "b", f"d{r == 4}", world=6))
    assert odd == [False] * 6
    # A rank with trouble (a launch error) and the same value: the same.
    trouble = _as_ranks(6, lambda r: same_everywhere(store, "c", "d", world=6, trouble=r == 2))
    assert trouble == [False] * 6


def test_nobody_leaves_the_barrier_before_the_last_rank_arrives():
    store = dist.HashStore()
    left: list[float] = []
    late = 0.3

    def rank(r: int) -> None:
        if r == 3:
            time.sleep(late)
        t0 = time.monotonic()
        barrier(store, "x", world=4)
        left.append(time.monotonic() - t0 if r != 3 else late)

    _as_ranks(4, rank)
    assert len(left) == 4 and min(left) >= late * 0.8, left


def test_news_reads_the_store_at_most_once_per_period():
    store = dist.HashStore()
    calls = {"add": 0}

    class Counting:  # the real store, its adds counted
        def add(self, key: str, n: int) -> int:
            calls["add"] += 1
            return store.add(key, n)

    news = News(Counting(), world=8)
    assert news.period_s == 1.0 and News(store, world=10_000).period_s == 4.0
    assert news.current() == 0 and calls["add"] == 1
    for _ in range(100):
        news.current()  # cached: no store call
    assert calls["add"] == 1
    News(store, world=8).post()  # another rank posts
    assert news.current() == 0  # not seen until the period has passed...
    assert news.current(max_age_s=0) == 1  # ...or a caller asks for a fresh read


_SLOW_CLOSE = """
import os, sys, time
sys.path.insert(0, {tests!r})
import torch, torch.distributed as dist
import guardrails
from guardrails.engine.component import Component
from conftest import Regressor, batches

class SlowClose(Component):
    # Run first at close (extra components end first): rank 1 makes its last store
    # calls (the stop decision at the end, the watchdog's word) a second after rank 0.
    name = "slow_close"
    def on_end(self, guard, exc):
        if guard.rank == 1:
            time.sleep(1.0)

dist.init_process_group("gloo")
model = torch.nn.parallel.DistributedDataParallel(Regressor())
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with guardrails.guard(model, opt, batches(5), run_dir={run_dir!r}, progress=False,
                      components=[SlowClose()]) as g:
    for x, y in g:
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
print("closed", g.step, flush=True)
os._exit(0)  # rank 0's process, and the store it hosts, gone at once, as a script ends
"""


def test_rank_0_hosting_the_store_leaves_a_clean_close_last(tmp_path):
    """Outside torchrun rank 0's process hosts the store. A clean 2-rank run whose rank 1
    closes a second later than rank 0: rank 0's close waits for rank 1's last store
    call, so rank 1 does not die of "DistNetworkError: Broken pipe" at the end of a
    healthy run (it did: twice in CI, ~1 run in 8)."""
    from _ranks import TESTS, run_ranks

    script = _SLOW_CLOSE.format(tests=str(TESTS), run_dir=str(tmp_path / "run"))
    ranks = run_ranks([sys.executable, "-c", script], 2, out=tmp_path / "out", timeout_s=120)
    assert [r.code for r in ranks] == [0, 0], [r.text[-2000:] for r in ranks]
    assert all("closed 5" in r.out for r in ranks), [r.text[-2000:] for r in ranks]
    assert not any("DistNetworkError" in r.text for r in ranks)
