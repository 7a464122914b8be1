"""One rank of a small DDP job with a planted fault, for the watchdog tests.

    RANK=.. WORLD_SIZE=2 MASTER_ADDR=.. MASTER_PORT=.. python tests/hang_worker.py \
        SCENARIO --hang-timeout-s 3 --out DIR
    python -m torch.distributed.run --nproc-per-node 2 tests/hang_worker.py SCENARIO ...

Scenarios (the fault is on rank 1 after FAULT_STEP optimizer steps, before its next
forward): ``clean``, ``sleep`` (stuck in Python), ``pipe`` (blocked in a C read nobody
writes to), ``spin`` (computing in Python, never done: a crawl, not a deadlock),
``kill`` (SIGKILLs itself; ``kill_rank0``: rank 0, the TCPStore's host,
does), ``killquiet`` (rank 1 SIGKILLs itself while rank 0 sleeps in Python, in no
collective that would fail: only its watchdog can tell), ``raise`` (a ValueError),
``uneven`` (rank 1 has 4 batches, rank 0 has 12), ``pause`` (a long sleep inside
``g.pause_watchdog``),
``slowfirst`` (rank 1's first step takes 1.7x the timeout, like a compilation),
``firstbatch`` (rank 1's loader never yields its first batch), ``unevennext`` (as
``uneven``, with a loop that calls ``next()`` by hand),
``closeslow`` (rank 0 raises and its close takes 6 s; rank 1 is SIGKILLed 1 s into
it), ``closestuck`` (rank 0 ends its loop and its close never ends; rank 1 is SIGKILLed),
``extra`` (rank 1 issues an all_reduce of 3 elements that rank 0 never issues: it
pairs with rank 0's next gradient bucket), ``swap`` (both ranks issue two all_reduces
of different sizes, in opposite orders), ``workerstuck`` (rank 1's DataLoader worker
hangs in ``__getitem__``; its pid goes to ``DIR/worker_pid``), ``sigterm`` (rank 1 is
blocked in a C read, as ``pipe``, with a 60 s hang timeout, and each rank sends itself
SIGTERM 1 s after the fault, as a launcher does), ``hangsigterm`` (as ``pipe``; once the
watchdog's verdict is in, rank 0 gets SIGTERM and rank 1 is SIGKILLed, as when the stuck
rank ends first and torchrun tears the job down). ``extra`` and ``swap`` wrap the model in
GuardedDDP, so the gradient buckets are part of the audited sequence.
Just before the fault, rank 1 writes the wall-clock time to ``DIR/fault_time``, so the
caller can measure the time from fault to error. Real processes, real gloo, real
signals; nothing mocked.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from conftest import Regressor, batches

import guardrails

FAULT_STEP = 3


def fault(
    kind: str, out: Path, g: guardrails.Guard, timeout_s: float, device: torch.device
) -> None:
    (out / "fault_time").write_text(repr(time.time()))
    if kind == "extra":
        dist.all_reduce(torch.ones(3, device=device))  # a collective rank 0 never issues
    elif kind == "swap":  # rank 0 issues (4, 7) below; this rank (7, 4)
        dist.all_reduce(torch.ones(7, device=device))
        dist.all_reduce(torch.ones(4, device=device))
    elif kind == "sleep":
        time.sleep(3600)
    elif kind == "spin":  # computing, never done: a step far slower than the timeout
        end = time.monotonic() + 3600
        while time.monotonic() < end:
            pass
    elif kind == "pipe":
        r, _w = os.pipe()
        os.read(r, 1)  # nobody writes: blocked in the kernel, not in Python
    elif kind in ("kill", "killquiet"):
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "raise":
        raise ValueError("boom: a bug on rank 1 only")
    elif kind == "slowfirst":  # a first step slower than the timeout (compilation)
        time.sleep(1.7 * timeout_s)
    elif kind == "pause":
        with g.pause_watchdog("eval"):
            time.sleep(1.7 * timeout_s)


class StuckWorkerData(torch.utils.data.Dataset):
    """Batches from a DataLoader worker process; item ``at`` never comes back (the
    worker is stuck in I/O), so the main thread waits on the worker forever."""

    def __init__(self, out: Path, items: list, at: int) -> None:
        self.out, self.items, self.at = out, items, at

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        if i == self.at:
            (self.out / "worker_pid").write_text(str(os.getpid()))
            (self.out / "fault_time").write_text(repr(time.time()))
            time.sleep(3600)
        return self.items[i]


def sigterm_after_fault(out: Path, delay_s: float) -> None:
    """What a launcher does to every rank: SIGTERM, once the fault has happened."""

    def send() -> None:
        while not (out / "fault_time").exists():
            time.sleep(0.05)
        time.sleep(delay_s)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=send, daemon=True).start()


def stuck_rank_exits_after_verdict(g: guardrails.Guard, out: Path, delay_s: float) -> None:
    """Rank 0, once the watchdog's verdict is in the store: what happens when the stuck
    rank ends first (its save was the smaller): torchrun SIGTERMs every
    other rank, and this rank's collective fails, the peer gone. Here: SIGTERM to
    itself, then rank 1 SIGKILLed (its pid in ``OUT/pid1``)."""
    store = g.side_store("watchdog")

    def send() -> None:
        while not store.check(["verdict"]):
            time.sleep(0.05)
        time.sleep(delay_s)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.3)
        os.kill(int((out / "pid1").read_text()), signal.SIGKILL)

    threading.Thread(target=send, daemon=True).start()


class SlowClose(guardrails.Component):
    """A close that takes seconds (the failure save of a large model: ``close_s``) or
    never ends (a closing collective that waits for a dead peer: ``close_s=None``)."""

    name = "slow_close"

    def __init__(self, out: Path, close_s: float | None) -> None:
        self.out, self.close_s = out, close_s

    def on_end(self, guard: guardrails.Guard, exc: BaseException | None) -> None:
        (self.out / "close_began").write_text(repr(time.time()))
        if self.close_s is None:
            threading.Event().wait()
        time.sleep(self.close_s)
        (self.out / "close_done").write_text(repr(time.time()))


def never_yields(out: Path):
    """A loader whose first batch never comes (a data directory it cannot read, a
    shard server that never answers): stuck before the first step."""
    (out / "fault_time").write_text(repr(time.time()))
    time.sleep(3600)
    yield


@guardrails.record
def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("scenario")
    p.add_argument("--hang-timeout-s", type=float, default=3.0)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--step-sleep-s", type=float, default=0.25)
    p.add_argument("--backend", default="gloo")
    p.add_argument("--out", required=True)
    p.add_argument("--metrics", action="store_true")
    args = p.parse_args()
    if args.scenario == "sigterm":  # the stop must come from the signal, not the watchdog
        args.hang_timeout_s = 60.0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    dist.init_process_group(args.backend)
    rank = dist.get_rank()
    # "kill_rank0": the rank that hosts the TCPStore (init_method env://) dies.
    kind, _, where = args.scenario.partition("_rank")
    fault_rank = int(where) if where else 1
    device = torch.device("cpu")
    if args.backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    wrap = (
        guardrails.GuardedDDP if kind in ("extra", "swap") else nn.parallel.DistributedDataParallel
    )
    model = wrap(
        Regressor().to(device), device_ids=[device.index] if device.type == "cuda" else None
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    n = 4 if (args.scenario in ("uneven", "unevennext") and rank == 1) else 12
    # A generator, like a streaming loader over per-rank shards: no len(), so the
    # uneven case is not caught at start by preflight's dataset-size check.
    data = iter(batches(n, seed=rank))
    if kind == "firstbatch" and rank == fault_rank:
        data = never_yields(out)
    if kind == "workerstuck":
        stuck_at = FAULT_STEP + 1 if rank == fault_rank else -1
        data = torch.utils.data.DataLoader(
            StuckWorkerData(out, batches(n, seed=rank), stuck_at), batch_size=None, num_workers=1
        )
    if kind == "sigterm":
        sigterm_after_fault(out, delay_s=1.0)
    closing = kind in ("closeslow", "closestuck")
    extra = [SlowClose(out, 6.0 if kind == "closeslow" else None)] if closing and rank == 0 else []
    with guardrails.guard(
        model,
        opt,
        data,
        run_dir=out / "run",
        watchdog={"hang_timeout_s": args.hang_timeout_s},
        metrics=args.metrics or kind in ("sigterm", "sleep"),
        checkpoint=not closing,  # no failure save: the close is SlowClose's alone
        components=extra,
        progress=False,
    ) as g:
        if kind == "hangsigterm" and rank == 0:
            stuck_rank_exits_after_verdict(g, out, delay_s=0.5)
        elif kind == "hangsigterm":
            (out / "pid1").write_text(str(os.getpid()))
        if kind == "unevennext":  # the loop fetches by hand: next() raises at the end
            it = iter(g)
            while g.step < args.steps:
                x, y = next(it)
                model(x.to(device), y.to(device)).backward()
                opt.step()
                opt.zero_grad()
                time.sleep(args.step_sleep_s)
                if rank == 1 and g.step == 4:
                    (out / "fault_time").write_text(repr(time.time()))
        for x, y in g if kind != "unevennext" else ():
            if closing and g.step == FAULT_STEP:
                if rank == 1:
                    time.sleep(1.0)  # rank 0 is closing by now
                    os.kill(os.getpid(), signal.SIGKILL)
                (out / "fault_time").write_text(repr(time.time()))
                if kind == "closeslow":
                    raise ValueError("boom: a bug on rank 0, then rank 1 died")
                break
            at = 0 if kind == "slowfirst" else FAULT_STEP
            if rank == fault_rank and g.step == at and kind not in ("workerstuck",):
                stuck = "pipe" if kind in ("sigterm", "hangsigterm") else kind
                fault(stuck, out, g, args.hang_timeout_s, device)
            elif kind == "killquiet" and g.step == at:
                time.sleep(3600)  # rank 0: waits for nobody while rank 1 dies
            elif kind == "swap" and g.step == at:
                dist.all_reduce(torch.ones(4, device=device))
                dist.all_reduce(torch.ones(7, device=device))
            model(x.to(device), y.to(device)).backward()
            opt.step()
            opt.zero_grad()
            time.sleep(args.step_sleep_s)
            if g.step >= args.steps:
                break
        if args.scenario == "uneven" and rank == 1:
            (out / "fault_time").write_text(repr(time.time()))
    alive = [t.name for t in threading.enumerate() if t.name.startswith("guardrails-watchdog")]
    print(f"rank {rank}: clean end at step {g.step}; watchdog threads left: {alive}", flush=True)


if __name__ == "__main__":
    main()
