"""A guarded training loop with a run of bad batches planted, for tests/guards/test_rewind.py:
under DDP when launched with WORLD_SIZE 2 (gloo), alone otherwise.

    python tests/rewind_worker.py RUN_DIR OUT [--fault none|div|nan|cut]
        [--fault-rank R] [--fault-at I] [--fault-len N] [--rewind JSON]
        [--steps N] [--ckpt-every N] [--sigterm-at STEP]

The loop: a small MLP returning its MSE loss, AdamW under a warmup + cosine schedule,
an evaluation pass (forwards only, eval mode) every 25 steps, each rank its own list of
32-sample batches. ``--fault div``: the targets of batches I..I+N-1 scaled by 1e4 (a
finite divergence); ``nan``: their inputs NaN (non-finite gradients on every rank under
DDP); ``cut``: those batches left out (the clean run that never saw them). Only on rank
``--fault-rank`` when given. ``--sigterm-at``: rank 0 sends itself SIGTERM at that step
once a rewind has happened (a checkpoint and exit 143). At the end every rank writes
``OUT/rank<R>.pt``: its weights, losses and step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import guardrails


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.net(x).squeeze(-1), y)


def data(rank: int, n: int, fault: str, at: int, length: int) -> list:
    g = torch.Generator().manual_seed(100 + rank)
    w = torch.tensor([1.0, -2.0, 0.5, 3.0])
    out = []
    for _ in range(n):
        x = torch.randn(32, 4, generator=g)
        out.append((x, torch.sin(x @ w) + 0.1 * torch.randn(32, generator=g)))
    bad = range(at, at + length)
    if fault == "div":
        out = [(x, 1e4 * y) if i in bad else (x, y) for i, (x, y) in enumerate(out)]
    elif fault == "nan":
        out = [(x * math.nan, y) if i in bad else (x, y) for i, (x, y) in enumerate(out)]
    elif fault == "cut":
        out = [b for i, b in enumerate(out) if i not in bad]
    return out


@guardrails.record
def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("run_dir")
    p.add_argument("out")
    p.add_argument("--fault", default="none")
    p.add_argument("--fault-rank", type=int, default=-1)
    p.add_argument("--fault-at", type=int, default=100)
    p.add_argument("--fault-len", type=int, default=15)
    p.add_argument("--rewind", default="")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--ckpt-every", type=int, default=0)
    p.add_argument("--sigterm-at", type=int, default=0)
    a = p.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    torch.manual_seed(0)
    net = Net()
    model = nn.parallel.DistributedDataParallel(net) if world > 1 else net
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    warm = a.steps // 10
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: (
            (s + 1) / warm
            if s < warm
            else 0.5 * (1 + math.cos(math.pi * min(1.0, (s - warm) / (a.steps - warm))))
        ),
    )
    fault = a.fault if a.fault_rank in (-1, rank) else "none"
    batches = data(rank, a.steps, fault, a.fault_at, a.fault_len)
    held_out = data(7, 1, "none", 0, 0)[0]
    knobs = {"rewind": json.loads(a.rewind)} if a.rewind else {}
    ckpt: dict | bool = {"every_n_steps": a.ckpt_every} if a.ckpt_every else True
    if a.sigterm_at and isinstance(ckpt, dict):
        # The ranks agree on the stop at the step after the signal, not a second later (past
        # the pass's end at these millisecond steps: when is then the machine's speed).
        ckpt["agree_every_s"] = 1e-6
    losses: list[float] = []
    with guardrails.guard(
        model,
        opt,
        batches,
        scheduler=sched,
        run_dir=a.run_dir,
        progress=False,
        checkpoint=ckpt,
        **knobs,
    ) as g:
        for x, y in g:
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            losses.append(loss.item())
            if g.step % 25 == 0:  # an evaluation pause: forwards only
                model.eval()
                with torch.no_grad():
                    model(*held_out)
                model.train()
            rewind = g.component("rewind")
            if a.sigterm_at and rank == 0 and g.step == a.sigterm_at and rewind and rewind.used:
                os.kill(os.getpid(), signal.SIGTERM)
    torch.save(
        {"model": net.state_dict(), "losses": losses, "step": g.step},
        Path(a.out) / f"rank{rank}.pt",
    )
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
