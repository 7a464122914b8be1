"""One rank of a small DDP job (or a single process) that runs slow somewhere, for the
pace tests.

    RANK=.. WORLD_SIZE=N MASTER_ADDR=.. MASTER_PORT=.. python tests/pace_worker.py \
        SCENARIO --out DIR [--steps 200]

Scenarios (the slowness starts at SLOW_FROM and is 40 ms a step unless said):
``forward`` (rank 1's forward sleeps), ``busy`` (rank 1's forward computes: a busy
straggler, not a sleeping one), ``data`` (rank 1's loader sleeps before each batch),
``healthy`` (no fault: LR warm-up and cosine decay, an evaluation pass every 40 steps,
a checkpoint every 50, batches of varying size; with several ranks, the loss
all-reduced every step for logging and the step paced by a sleep), ``comms`` (a model
with 32 MiB of gradients and almost no compute: the all-reduce is the step), ``slower``
(every rank's loop sleeps 100 ms between steps: all slow, no straggler). The run's
events go to ``DIR/events.<host>.jsonl``; each rank writes its Pace component's ``reported``
and its windows to ``DIR/pace<rank>.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import guardrails

SLOW_FROM = 60
SLOW_S = 0.04


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--window-steps", type=int, default=20)
    args = ap.parse_args()
    kind = args.scenario
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    torch.manual_seed(0)
    width = 2048 if kind == "comms" else 64
    depth = 2 if kind == "comms" else 1
    layers = [m for _ in range(depth) for m in (nn.Linear(width, width), nn.Tanh())]
    net = nn.Sequential(*layers, nn.Linear(width, 1))
    slow_here = kind in ("forward", "busy", "data") and rank == 1
    started: list[guardrails.Guard] = []  # the guard, once the loop runs

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if slow_here and torch.is_grad_enabled() and started[0].step >= SLOW_FROM:
                if kind == "forward":
                    time.sleep(SLOW_S)
                elif kind == "busy":  # burn CPU in the forward, as a slow kernel would
                    end = time.perf_counter() + SLOW_S
                    while time.perf_counter() < end:
                        pass
            return self.net(x).pow(2).mean()

    def batches():
        for i in range(args.steps):
            if kind == "data" and rank == 1 and i >= SLOW_FROM:
                time.sleep(SLOW_S)
            rows = 4 if kind == "comms" else 32 + (i % 5) * 8
            yield torch.randn(rows, width)

    model: nn.Module = Model()
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model)
    if kind == "comms":  # no optimizer compute to speak of either
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    warm = 20
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * s / args.steps)),
    )
    checkpoint = {"every_n_steps": 50} if kind == "healthy" else False
    with guardrails.guard(
        model,
        opt,
        batches(),
        scheduler=sched,
        run_dir=args.out,
        checkpoint=checkpoint,
        # comm_share 0.3, not 0.5: on a loaded 2-core machine the all-reduce's exposed
        # part of a comms-bound step measured 32-60% (gloo's threads share the cores).
        pace={"window_steps": args.window_steps, "compare_every_s": 0.0, "comm_share": 0.3},
    ) as g:
        started.append(g)
        for x in g:
            if kind == "healthy" and g.step and g.step % 40 == 0:
                model.eval()
                with torch.no_grad():  # an evaluation pass: ~15 forwards
                    for _ in range(15):
                        model(torch.randn(256, width))
                model.train()
            if kind == "slower" and g.step >= SLOW_FROM:
                time.sleep(0.1)  # well above a loaded machine's noise
            t0 = time.perf_counter()
            loss = model(x)
            loss.backward()
            if kind == "healthy" and world > 1:
                # As scripts log: the loss averaged over ranks every step, and a loop
                # paced to a step time (the ranks that waited less sleep more).
                dist.all_reduce(loss.detach())
                time.sleep(max(0.0, 0.004 - (time.perf_counter() - t0)))
            opt.step()
            sched.step()
            opt.zero_grad()
        pace = next(c for c in g.components if c.name == "pace")
        (args.out / f"pace{rank}.json").write_text(
            json.dumps(
                {
                    "reported": pace.reported,
                    "windows": [w.to_json() for w in pace.windows],
                    "comm_samples": [vars(c) for c in pace.comm_samples],
                }
            )
        )
    if world > 1:
        dist.destroy_process_group()
    sys.exit(0)


if __name__ == "__main__":
    main()
