"""A guarded training loop whose checkpointed state is what users keep beside the
model, for tests/checkpoint/test_state_resume.py: it can SIGTERM itself after a step and dumps its
final state (weights, optimizer state, ``g.state``, RNG) so a stopped-and-resumed run
can be compared bitwise with one that was never interrupted.

    python tests/state_worker.py RUN_DIR OUT [--opt lbfgs|adam|adamw|sgdm] [--steps N]
        [--sigterm-at STEP] [--every N] [--best-tensor] [--unfreeze-at STEP]
        [--retrain-at STEP]
        [--bad-state-at STEP] [--scheduler none|passed|unpassed]

--best-tensor    keeps the best loss (float32) and a step counter (int64) as tensors
                 in ``g.state``, updated without a host sync.
--unfreeze-at    the head starts frozen and outside the optimizer; after that step the
                 loop unfreezes it and adds it as a param group of its own.
--retrain-at     the body starts frozen, in the optimizer's group all the same; after
                 that step the loop unfreezes it (requires_grad_(True)) and freezes the
                 head (requires_grad_(False)), the groups unchanged.
--bad-state-at   after that step, puts a value no checkpoint can store in ``g.state``.
--scheduler      a StepLR, passed as ``scheduler=`` or only created.

Launched with RANK / WORLD_SIZE / MASTER_PORT (tests/_ranks.py) it runs DDP over gloo,
the ranks agreeing on a stop at every step; only rank 0 signals itself.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import guardrails


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(0.1))
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x)).squeeze(-1)


def build_optimizer(name: str, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    if name == "lbfgs":
        return torch.optim.LBFGS(params, lr=0.5, max_iter=4, history_size=5)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-2)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9, nesterov=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("run_dir")
    p.add_argument("out")
    p.add_argument("--opt", default="adamw", choices=["lbfgs", "adam", "adamw", "sgdm"])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--sigterm-at", type=int, default=-1)
    p.add_argument("--every", type=int, default=None)
    p.add_argument("--best-tensor", action="store_true")
    p.add_argument("--unfreeze-at", type=int, default=-1)
    p.add_argument("--retrain-at", type=int, default=-1)
    p.add_argument("--bad-state-at", type=int, default=-1)
    p.add_argument("--scheduler", default="none", choices=["none", "passed", "unpassed"])
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("gloo")

    bare = Net()
    if args.unfreeze_at >= 0:
        bare.head.requires_grad_(False)
    if args.retrain_at >= 0:
        bare.body.requires_grad_(False)
    opt = build_optimizer(
        args.opt,
        list(bare.parameters())
        if args.retrain_at >= 0
        else [q for q in bare.parameters() if q.requires_grad],
    )
    model: nn.Module = bare
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(bare)
    sched = None
    if args.scheduler != "none":
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    g_data = torch.Generator().manual_seed(1)
    dataset = TensorDataset(torch.randn(64, 8, generator=g_data), torch.randn(64, generator=g_data))
    loader = DataLoader(
        dataset, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(2)
    )
    # strict_cadence: every save is written (the tests count them), none skipped.
    checkpoint: dict = {"every_n_steps": args.every, "strict_cadence": True} if args.every else {}
    passed = {"scheduler": sched} if args.scheduler == "passed" else {}
    if world > 1:  # a stop agreed at the step after the signal, not a second later
        ckpt = guardrails.SignalCheckpointer(agree_every_s=1e-6, **checkpoint)
        passed["components"] = [ckpt]
    else:
        passed["checkpoint"] = checkpoint or True
    with guardrails.guard(model, opt, loader, run_dir=args.run_dir, progress=False, **passed) as g:
        if args.best_tensor:
            g.state.setdefault("best", torch.tensor(float("inf")))
            g.state.setdefault("seen", torch.zeros((), dtype=torch.int64))
        done = False
        for _epoch in range(g.epoch, 100):
            for x, y in g:

                def closure(x=x, y=y) -> torch.Tensor:
                    opt.zero_grad()
                    loss = nn.functional.mse_loss(model(x), y)
                    loss.backward()
                    return loss

                if args.opt == "lbfgs":
                    loss = opt.step(closure)
                else:
                    loss = closure()
                    opt.step()
                if sched is not None:
                    sched.step()
                if args.best_tensor:  # kept on the device: no .item() sync per step
                    g.state["best"] = torch.minimum(g.state["best"], loss.detach())
                    g.state["seen"] = g.state["seen"] + 1
                if g.step == args.unfreeze_at:  # unfreeze the head from the next step on
                    bare.head.requires_grad_(True)
                    opt.add_param_group({"params": list(bare.head.parameters()), "lr": 5e-3})
                if g.step == args.retrain_at:  # in their groups: only requires_grad changes
                    bare.body.requires_grad_(True)
                    bare.head.requires_grad_(False)
                if g.step == args.bad_state_at:
                    g.state["tags"] = {"warmup", "decay"}  # a set: not storable
                if g.step == args.sigterm_at and rank == 0:
                    os.kill(os.getpid(), signal.SIGTERM)
                if g.step == args.steps:
                    done = True
                    break
            if done:
                break
    torch.save(
        {
            "model": bare.state_dict(),
            "opt": opt.state_dict(),
            "state": dict(g.state),
            "lr": [group["lr"] for group in opt.param_groups],
            "rng": torch.get_rng_state(),
        },
        args.out if rank == 0 else f"{args.out}.rank{rank}",
    )
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
