"""One rank of a small DDP job for the live view's tests (``guardrails top`` / ``stacks``).

    RANK=.. WORLD_SIZE=4 MASTER_ADDR=.. MASTER_PORT=.. python tests/live_worker.py \
        SCENARIO --out DIR [--steps N] [--step-sleep-s S] [--ranks-per-node K]

Without torchrun's variables it is a single process (``python train.py``: no process
group, no DDP), whose ``stuck`` sleeps as rank 1 does (``--alone-in sleep``) or as rank
2 does (``--alone-in ccall``).

Scenarios: ``healthy`` (trains ``--steps`` steps of ``--step-sleep-s`` each), ``stuck``
(after FAULT_STEP steps rank 0, and every rank from 4 on, waits in an ``all_reduce``
ranks 1-3 never join, rank 1
sleeps in ``time.sleep``, rank 2 in libc's ``sleep`` through ctypes (a C call), rank 3
computes in a Python loop: a straggler; each writes ``DIR/stuck<R>`` once there),
``raise`` (rank 1 raises at FAULT_STEP: a crashed run). ``--ranks-per-node K`` makes
simulated nodes of K ranks on this host (LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK as
torchrun sets them with ``--nnodes``). Real processes, real gloo; nothing mocked.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from conftest import Regressor, batches

import guardrails

FAULT_STEP = 3


def stuck(rank: int, out: Path, *, alone_in: str) -> None:
    """Where each rank stays, for the stacks test (the line numbers are what it reads)."""
    (out / f"stuck{rank}").write_text(str(os.getpid()))
    single = not dist.is_initialized()
    if not single and (rank == 0 or rank >= 4):
        dist.all_reduce(torch.ones(3))  # LIVE-ALLREDUCE: ranks 1-3 never join
    elif rank == 1 or (single and alone_in == "sleep"):
        time.sleep(3600)  # LIVE-SLEEP
    elif rank == 2 or single:
        ctypes.CDLL(None).sleep(3600)  # LIVE-CCALL
    else:
        end = time.monotonic() + 3600
        while time.monotonic() < end:  # LIVE-SPIN
            pass


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("scenario", choices=["healthy", "stuck", "raise"])
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--step-sleep-s", type=float, default=0.1)
    p.add_argument("--ranks-per-node", type=int, default=0)
    p.add_argument("--alone-in", choices=["sleep", "ccall"], default="sleep")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("RANK", 0))
    if args.ranks_per_node:  # simulated nodes, as torchrun --nnodes numbers them
        k = args.ranks_per_node
        os.environ.update(
            LOCAL_RANK=str(rank % k), LOCAL_WORLD_SIZE=str(k), GROUP_RANK=str(rank // k)
        )
    torch.manual_seed(0)
    model: nn.Module = Regressor()
    if "WORLD_SIZE" in os.environ:  # launched as a rank; else a single process
        dist.init_process_group("gloo")
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = batches(args.steps, seed=rank)  # a list: the loader has a length (the ETA)
    with guardrails.guard(
        model,
        opt,
        data,
        run_dir=out / "run",
        watchdog={"hang_timeout_s": 300.0},
        tokens_per_batch=32,
        progress=False,
    ) as g:
        times = []
        for x, y in g:
            t0 = time.perf_counter()
            if g.step == FAULT_STEP and args.scenario == "stuck":
                stuck(rank, out, alone_in=args.alone_in)
            if g.step == FAULT_STEP and args.scenario == "raise" and rank == 1:
                raise ValueError("boom: a bug on rank 1 only")
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
            time.sleep(args.step_sleep_s)
            times.append(time.perf_counter() - t0)
    # The loop's own step times (the guard's start-up step left out), for the cost of
    # being watched (benchmarks/live_cost.py).
    (out / f"steps{rank}.json").write_text(json.dumps(times[1:]))
    print(f"rank {rank}: done at step {g.step}", flush=True)


if __name__ == "__main__":
    main()
