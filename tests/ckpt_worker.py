"""A small training script for the checkpoint / signal tests, run as a real process.

    python tests/ckpt_worker.py RUN_DIR OUT [--steps N] [--sigterm-at K] [--rank R
        --world W --port P] [--every-n N] [--background] [--crash-at K] [--lr LR]

It trains a dropout MLP on a shuffled DataLoader (RandomSampler on one rank,
DistributedSampler + DDP on several, gloo), with a LambdaLR schedule, under
guardrails.guard(resume="auto"). With --sigterm-at K, the ranks in --kill-ranks send
SIGTERM to themselves after step K (a real signal, delivered by the OS). At the end each
rank writes its model and optimizer state to OUT.rank<R>.pt for bitwise comparison.

Under torchrun (no --world), the ranks come from torchrun's environment. With --mark-at K
rank 0 writes OUT.mark after step K, and every rank then waits in its loop body until a
stop signal has reached its guard (with --slow-data it goes on: the signal should come
while it waits for a batch): the test signals the job from outside (torchrun's pid, or
the process group) at a known step. --workers N gives the loader N worker
processes and a worker_init_fn of the script's own; --early-iter makes them persistent
and starts them by an iterator made before the guard; --slow-data makes each item take
0.1 s, so the signal comes while the rank waits for a batch.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import guardrails


def _user_init(worker_id: int) -> None:
    """The script's own worker_init_fn (the guard chains it, then gives it back)."""
    torch.set_num_threads(1)


class SlowData(TensorDataset):
    """A dataset whose items take 0.1 s: a rank waits for its loader most of the time."""

    def __getitem__(self, i):
        time.sleep(0.1)
        return super().__getitem__(i)


def loader_kw(a) -> dict:
    if not a.workers:
        return {}
    return dict(num_workers=a.workers, worker_init_fn=_user_init, persistent_workers=a.early_iter)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("run_dir")
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--sigterm-at", type=int, default=0)
    p.add_argument("--kill-ranks", default="0")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--every-n", type=int, default=None)
    p.add_argument("--background", action="store_true")
    p.add_argument("--crash-at", type=int, default=0, help="os._exit(3) after this step")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--mark-at", type=int, default=0)
    p.add_argument("--onecycle", action="store_true", help="OneCycleLR instead of LambdaLR")
    p.add_argument("--slow-data", action="store_true", help="items of 0.1 s: ranks wait")
    p.add_argument("--early-iter", action="store_true", help="persistent workers, before")
    p.add_argument("--fsdp", action="store_true", help="FSDP2 (fully_shard) instead of DDP")
    p.add_argument("--ballast-mb", type=int, default=0, help="a buffer every save writes")
    p.add_argument("--lr", type=float, default=1e-2, help="also the guard's config")
    p.add_argument("--local-dir", default=None, help="the checkpoint's local_directory")
    p.add_argument(
        "--slow-dcp-writes",
        action="store_true",
        help="FSDP2 background saves write each item 0.3 s late (a big model's write)",
    )
    a = p.parse_args()
    if a.slow_dcp_writes:
        from guardrails.checkpoint import sharded

        item_data = sharded._item_data

        def slow(planner, item):
            time.sleep(0.3)
            return item_data(planner, item)

        sharded._item_data = slow
    if a.world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port))
        dist.init_process_group("gloo", rank=a.rank, world_size=a.world)
    elif "WORLD_SIZE" in os.environ:  # under torchrun
        dist.init_process_group("gloo")
        a.rank, a.world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)  # same data and init everywhere; dropout draws differ per rank
    x = torch.randn(64, 4)
    y = x.sum(1, keepdim=True) + 0.1 * torch.randn(64, 1)
    data = TensorDataset(x, y) if not a.slow_data else SlowData(x, y)
    model: nn.Module = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))
    if a.ballast_mb:  # saves that take tens of ms, steps that take ~1 ms
        model.register_buffer("ballast", torch.zeros(a.ballast_mb << 18))
    torch.manual_seed(1000 + a.rank)
    if a.world > 1:
        sampler = DistributedSampler(data, shuffle=True, seed=7)
        loader = DataLoader(data, batch_size=4, sampler=sampler, **loader_kw(a))
        if a.fsdp:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (a.world,))
            for layer in (model[0], model[3]):
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        else:
            model = DDP(model, broadcast_buffers=not a.ballast_mb)
    else:
        sampler = None
        loader = DataLoader(data, batch_size=4, shuffle=True, **loader_kw(a))
    if a.early_iter:
        iter(loader)  # the persistent workers start now, outside the guard
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    if a.onecycle:
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=a.lr, total_steps=a.steps)
    else:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
    kill = {int(r) for r in a.kill_ranks.split(",")}
    with guardrails.guard(
        model,
        opt,
        loader,
        scheduler=sched,
        run_dir=a.run_dir,
        config={"lr": a.lr},
        progress=False,
        gc=False,
        checkpoint={"every_n_steps": a.every_n, "local_directory": a.local_dir},
    ) as g:
        for c in g.components:  # background writes only when asked
            if isinstance(c, guardrails.SignalCheckpointer):
                c.background = a.background
                c.agree_every_s = 1e-6  # agree at every step: these steps take ~1 ms
                ckpt = c
        g.state.setdefault("resumes", 0)
        if g.step:
            g.state["resumes"] += 1
        while g.step < a.steps:
            if sampler is not None:
                sampler.set_epoch(g.epoch)
            for xb, yb in g:
                loss = nn.functional.mse_loss(model(xb), yb)
                loss.backward()
                opt.step()
                opt.zero_grad()
                sched.step()
                if g.step == a.sigterm_at and a.rank in kill:
                    os.kill(os.getpid(), signal.SIGTERM)
                if a.mark_at and g.step == a.mark_at:
                    if a.rank == 0:
                        with open(f"{a.out}.mark", "w") as f:
                            f.write(str(g.step))
                    deadline = time.monotonic() + 120
                    while not a.slow_data and not ckpt.capture.received:
                        assert time.monotonic() < deadline, "no signal came"
                        time.sleep(0.01)
                    if a.early_iter and not a.slow_data:
                        time.sleep(1.0)  # unshielded workers' deaths reach it mid-step
                if g.step == a.crash_at:  # a crash: no signal save, writers cut off
                    # After a background save committed (the test resumes one): on a
                    # loaded 2-core machine none had by step 14 (CI).
                    deadline = time.monotonic() + 60
                    found = Path(a.run_dir) / "checkpoints"
                    while not list(found.glob("step_*")) and time.monotonic() < deadline:
                        time.sleep(0.05)
                    if a.rank == 0 and a.world > 1:
                        # Rank 0 hosts the store here (torchrun's agent would): it goes
                        # last, so a peer still finishing this step's store calls (the
                        # stop/save agreement) does not find the store gone first.
                        time.sleep(1.0)
                    os._exit(3)
                if g.step >= a.steps:
                    break

        def full(t):  # a DTensor shard -> the whole tensor (a collective), else a copy
            return t.full_tensor() if hasattr(t, "full_tensor") else t.clone()

        opt_sd = opt.state_dict()
        opt_sd["state"] = {
            i: {k: full(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
            for i, s in opt_sd["state"].items()
        }
        state = {
            "model": {k: full(v) for k, v in model.state_dict().items()},
            "opt": opt_sd,
            "sched": sched.state_dict(),
            "step": g.step,
            "epoch": g.epoch,
            "resumes": g.state["resumes"],
            "rng": torch.get_rng_state(),
            "init_fn_shielded": loader.worker_init_fn is not (_user_init if a.workers else None),
        }
    # Once the guard has closed, the loader's worker_init_fn is the script's own object.
    state["init_fn_restored"] = loader.worker_init_fn is (_user_init if a.workers else None)
    torch.save(state, f"{a.out}.rank{a.rank}.pt")
    if a.world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
