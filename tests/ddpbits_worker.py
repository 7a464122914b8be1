"""A DDP loop with several gradient buckets, for tests/checkpoint/test_ddp_buckets.py,
run by torchrun (4 gloo ranks): plain, or guarded with a checkpoint every ``--every``
steps; rank 0 can SIGTERM itself after step ``--sigterm-at``, the last rank can sleep
after step ``--hang-at`` (the others then wait in DDP's all-reduce: a hang, each rank's
failure save written from the watchdog's thread). Rank 0 writes the final
weights to OUT (``torch.save`` of the bare model's state dict).

    torchrun --nproc-per-node 4 tests/ddpbits_worker.py RUN_DIR OUT [--plain]
        [--steps N] [--every K] [--sigterm-at S] [--hang-at S] [--hook] [--static-graph]

``--hook`` registers DDP's own ``allreduce_hook`` before the guard (a reducer given back
its buckets at resume must carry the hook over); ``--static-graph`` builds DDP with
``static_graph=True`` (its first iteration reduces every bucket at the end).
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
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import guardrails

WIDTH = 64
#: ~20 KB: three 16 KB weights, so the rebuild makes 3 buckets of the 14 gradients.
BUCKET_CAP_MB = 0.02


def build(
    hook: bool, static_graph: bool = False
) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(6):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    bare = nn.Sequential(*layers, nn.Linear(WIDTH, 1))
    model = nn.parallel.DistributedDataParallel(
        bare, bucket_cap_mb=BUCKET_CAP_MB, static_graph=static_graph
    )
    if hook:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        model.register_comm_hook(None, default_hooks.allreduce_hook)
    return bare, model, torch.optim.AdamW(bare.parameters(), lr=1e-2)


def loader(steps: int) -> DataLoader:
    gen = torch.Generator().manual_seed(1)
    n = 8 * steps * dist.get_world_size()
    x = torch.randn(n, WIDTH, generator=gen)
    data = TensorDataset(x, x[:, :1].sin())
    return DataLoader(data, batch_size=8, sampler=DistributedSampler(data, shuffle=False))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("run_dir")
    p.add_argument("out")
    p.add_argument("--plain", action="store_true")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--sigterm-at", type=int, default=-1)
    p.add_argument("--hang-at", type=int, default=-1)
    p.add_argument("--hook", action="store_true")
    p.add_argument("--static-graph", action="store_true")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    bare, model, opt = build(args.hook, args.static_graph)
    data = loader(args.steps)
    if args.plain:
        for x, y in data:
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    else:
        # The ranks agree on the stop at the step after the signal, not a second later
        # (past the run's end: its steps take milliseconds).
        checkpoint = {"every_n_steps": args.every, "agree_every_s": 1e-6}
        watchdog = {"hang_timeout_s": 5}
        with guardrails.guard(
            model, opt, data, run_dir=args.run_dir, checkpoint=checkpoint, watchdog=watchdog
        ) as g:
            for x, y in g:
                if g.step == args.hang_at and rank == dist.get_world_size() - 1:
                    time.sleep(3600)
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                if g.step == args.sigterm_at and rank == 0:
                    os.kill(os.getpid(), signal.SIGTERM)
    if rank == 0:
        torch.save(bare.state_dict(), args.out)
    # Every rank past its last step before any leaves: a rank that tore gloo down while a
    # peer's comm-hook work was still settling aborted the plain run once.
    dist.barrier()
    # Then out, past torch's teardown: torch 2.13 aborted a plain static_graph run there 3
    # times in 20 on 2 cores ("terminate called without an active exception": a C++
    # thread destroyed at exit) and hung one comm-hook run's destroy_process_group for
    # minutes. Rank 0's process hosts the store: it leaves last.
    store = dist.distributed_c10d._get_default_store()
    if rank != 0:
        store.add("left", 1)
    else:
        while store.add("left", 0) < dist.get_world_size() - 1:
            time.sleep(0.01)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
