"""Training loops of the shapes users bring, for tests/loops/test_loops.py: each runs guarded,
can SIGTERM itself at a step (on one rank), and dumps its final state (every rank's
weights, optimizer state, scheduler state, RNG) so a stopped-and-resumed run can be
compared bitwise with one that was never interrupted.

    python tests/loop_worker.py SHAPE RUN_DIR OUT [--steps N] [--sigterm-at STEP]
        [--sigterm-rank R] [--rank R --world W --port P]

Shapes:
  prefetch   nanochat's loop: a generator loader yielding (x, y, state), the next batch
             fetched before optimizer.step() (gradient accumulation of 2), dropout,
             a hand-written LR schedule, AdamW (not fused).
  gan        a generator and a discriminator, two Adam optimizers, D updated before G,
             a shuffling DataLoader over several epochs (for epoch ...: for batch in g).
  zero       DDP + torch's ZeroRedundancyOptimizer (each rank holds half the AdamW
             state), DistributedSampler; 2 ranks over gloo; --nan-at plants a NaN
             sample on rank 0.
  seeded     a DataLoader shuffling with its own seeded generator, several epochs (the
             shipped example's loader), SGD with momentum.
  distopt    nanochat's optimizer in miniature: no DDP; the optimizer all-reduces the
             gradients inside step() and each rank updates (and keeps the momentum of)
             its own half of the parameters, then broadcasts them; --nan-at too.

--device cuda runs zero and distopt on one GPU per rank over NCCL.
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import guardrails


class Net(nn.Module):
    """A small MLP with dropout (so the RNG streams matter) returning its MSE loss."""

    def __init__(self, d_in: int = 4, d_out: int = 1) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(d_in, 16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, d_out)
        )

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        out = self.net(x).squeeze(-1)
        return out if y is None else nn.functional.mse_loss(out, y)


def data(n: int = 48, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, generator=g))


class DistSGD(torch.optim.Optimizer):
    """SGD with momentum that reduces the gradients itself (inside ``step()``, on the
    training's process group) and shards the update: parameter i is updated, and its
    momentum kept, by rank i % world, then broadcast. So the ranks' gradients differ
    at ``step()`` and so does their optimizer state (like nanochat's MuonAdamW)."""

    def __init__(self, params, lr=1e-2):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        rank, world = dist.get_rank(), dist.get_world_size()
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in enumerate(params):
            dist.all_reduce(p.grad)
            p.grad.div_(world)
            if i % world == rank:
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                buf.mul_(0.9).add_(p.grad)
                p.add_(buf, alpha=-self.param_groups[0]["lr"])
            dist.broadcast(p, src=i % world)


def nan_at(args: argparse.Namespace, g: guardrails.Guard, x: torch.Tensor, rank: int):
    if g.step + 1 == args.nan_at and rank == 0:
        x = x.clone()
        x[2, 1] = float("nan")  # a bad sample on rank 0: every rank skips the step
    return x


def signal_at(args: argparse.Namespace, step: int, rank: int) -> None:
    if step == args.sigterm_at and rank == args.sigterm_rank:
        os.kill(os.getpid(), signal.SIGTERM)


def epochs(g: guardrails.Guard, args: argparse.Namespace, rank: int, sampler=None):
    """The batches of every pass through ``g`` from ``g.epoch`` on, until step
    ``args.steps``; after each step's loop body, the planted SIGTERM."""
    for epoch in range(g.epoch, 100):
        if sampler is not None:
            sampler.set_epoch(epoch)
        for batch in g:
            yield batch
            signal_at(args, g.step, rank)
            if g.step == args.steps:
                return


def prefetch(args: argparse.Namespace, run_dir: str, rank: int) -> dict:
    def loader():  # nanochat-style: an endless generator that yields its own state
        g = torch.Generator().manual_seed(1 + rank)
        i = 0
        while True:
            i += 1
            yield torch.randn(8, 4, generator=g), torch.randn(8, generator=g), {"batch": i}

    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    with guardrails.guard(model, opt, loader(), run_dir=run_dir, progress=False) as g:
        it = iter(g)
        step = g.step  # a resumed run continues the count
        x, y, _ = next(it)  # the first batch, fetched before the loop
        while step < args.steps:
            for _ in range(2):  # gradient accumulation
                (model(x, y) / 2).backward()
                x, y, _ = next(it)  # prefetch the next batch before the step
            for group in opt.param_groups:  # nanochat's hand-written schedule
                group["lr"] = 1e-2 * (1 - step / (2 * args.steps))
            opt.step()
            model.zero_grad(set_to_none=True)
            step += 1
            signal_at(args, step, rank)
    return {"model": model.state_dict(), "opt": opt.state_dict()}


def gan(args: argparse.Namespace, run_dir: str, rank: int) -> dict:
    gen, disc = nn.Sequential(nn.Linear(2, 4)), Net(4, 1)
    opt_g = torch.optim.Adam(gen.parameters(), lr=1e-2)
    opt_d = torch.optim.Adam(disc.parameters(), lr=1e-2)
    sched_d = torch.optim.lr_scheduler.StepLR(opt_d, step_size=5, gamma=0.5)
    loader = DataLoader(data(), batch_size=8, shuffle=True)
    bce = nn.functional.binary_cross_entropy_with_logits
    models, opts = {"G": gen, "D": disc}, {"G": opt_g, "D": opt_d}
    with guardrails.guard(
        models, opts, loader, scheduler={"D": sched_d}, run_dir=run_dir, progress=False
    ) as g:
        for real, _ in epochs(g, args, rank):
            fake = gen(torch.randn(8, 2))
            d_real, d_fake = disc(real), disc(fake.detach())
            d_loss = bce(d_real, torch.ones(8)) + bce(d_fake, torch.zeros(8))
            opt_d.zero_grad()
            d_loss.backward()
            opt_d.step()
            sched_d.step()
            g_loss = bce(disc(fake), torch.ones(8))
            opt_g.zero_grad()
            g_loss.backward()
            opt_g.step()
    return {
        "model": {**gen.state_dict(), **{f"d.{k}": v for k, v in disc.state_dict().items()}},
        "opt": opt_d.state_dict(),
        "opt_g": opt_g.state_dict(),
        "sched": sched_d.state_dict(),
    }


def sharded(args: argparse.Namespace, run_dir: str, rank: int, *, zero: bool) -> dict:
    """``zero``: DDP + ZeroRedundancyOptimizer; else no DDP and DistSGD (the gradients
    reduced inside step()). Both keep a different part of the state on every rank."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data.distributed import DistributedSampler

    dev = torch.device(args.device, rank if args.device == "cuda" else None)
    bare = Net().to(dev)
    if zero:
        model: nn.Module = DDP(bare, device_ids=[dev.index] if dev.type == "cuda" else None)
        opt: torch.optim.Optimizer = ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2, foreach=False
        )
    else:
        model, opt = bare, DistSGD(bare.parameters())
    dataset = data(64)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=8, sampler=sampler)
    # The ranks agree on a signal at every step instead of about once a second (the
    # interval in steps is round(agree_every_s / step time), at least 1): the test's
    # steps are a few ms long and the run must stop at the step after the signal.
    agree = guardrails.SignalCheckpointer(agree_every_s=1e-6)
    with guardrails.guard(
        model, opt, loader, run_dir=run_dir, progress=False, components=[agree]
    ) as g:
        for x, y in epochs(g, args, rank, sampler):
            x, y = nan_at(args, g, x.to(dev), rank), y.to(dev)
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
    local = opt.optim if zero else opt  # ZeroRedundancyOptimizer: this rank's shard
    return {"model": bare.state_dict(), "opt": local.state_dict()}


def seeded(args: argparse.Namespace, run_dir: str, rank: int) -> dict:
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    loader = DataLoader(
        data(40), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(7)
    )
    with guardrails.guard(model, opt, loader, run_dir=run_dir, progress=False) as g:
        for x, y in epochs(g, args, rank):
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
    return {"model": model.state_dict(), "opt": opt.state_dict()}


SHAPES = {
    "prefetch": prefetch,
    "gan": gan,
    "zero": functools.partial(sharded, zero=True),
    "distopt": functools.partial(sharded, zero=False),
    "seeded": seeded,
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("run_dir")
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--sigterm-at", type=int, default=-1)
    p.add_argument("--sigterm-rank", type=int, default=0)
    p.add_argument("--nan-at", type=int, default=-1, help="zero, distopt: a NaN sample")
    p.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL)")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
        if args.device == "cuda":
            torch.cuda.set_device(args.rank)
        backend = "nccl" if args.device == "cuda" else "gloo"
        dist.init_process_group(backend, rank=args.rank, world_size=args.world)
    torch.manual_seed(0)
    state = SHAPES[args.shape](args, args.run_dir, args.rank)
    state["rng"] = torch.get_rng_state()
    torch.save(state, f"{args.out}.rank{args.rank}.pt")
    if args.world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
