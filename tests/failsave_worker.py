"""One rank (or a single process) of a small training run with a planted failure, for the
failure-save tests (tests/checkpoint/test_failure_save.py).

    python tests/failsave_worker.py --run-dir DIR --steps 12 --fault raise --at 7
    RANK=.. WORLD_SIZE=2 MASTER_ADDR=.. MASTER_PORT=.. python tests/failsave_worker.py ...

The model has dropout (the forward draws from torch's RNG) and the loop draws from
python's ``random`` every step (the input's scale), over a shuffled DataLoader: a
resumed run is bitwise the uninterrupted one only if the RNG streams and the data
position saved are the last finished step's. Under several ranks the model is DDP
(gloo) and the sampler a DistributedSampler. Faults, on rank ``--rank`` (every rank
with ``--rank -1``), after ``--at`` finished steps, once the next batch is fetched (or
inside ``optimizer.step()`` for ``instep``):

``raise`` (a ValueError before the forward), ``forward`` (a ValueError after the forward
and the backward), ``instep`` (``optimizer.step()`` updates the first half of the
parameters, then raises), ``sleep`` (stuck in Python: the watchdog's hang), ``kill``
(SIGKILL), ``kill_unpublished`` (SIGKILL with its published part removed first, as a
rank on another host: ``checkpointer/peer.py``), ``node_lost`` (as ``kill_unpublished``,
0.3 s into the step, the copy it kept of its partner gone too: ``--rank 2,3`` and
``LOCAL_WORLD_SIZE=2``, a node lost whole: ``checkpointer/partner.py``),
``term_then_kill`` (once the others wait for it in the all-reduce: SIGTERM to every
other rank, then SIGKILL, the way a launcher's teardown can reach the survivors before
their collective fails), ``start`` (a ValueError before the first step). After the
update that finished step ``--at`` (the loop's logging, an eval): ``after`` (a
ValueError), ``sleep_after`` (stuck in Python), ``kill_after`` (SIGKILL). ``none``: no
fault. At the end (a run
that finishes) the weights, optimizer state, RNG streams and the batches trained since
the start (their sums, by step) go to ``DIR/final<rank>.pt``.

``--prefetch``: nanoGPT's loop instead: an endless loader that draws each batch's rows
from torch's RNG (``get_batch``: fast-forwarded on resume), and the next batch fetched
after the forward, held past the step boundary.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import guardrails


class GetBatch:
    """nanoGPT's ``get_batch`` as an iterable: each batch's rows drawn from torch's RNG."""

    def __init__(self, data: torch.utils.data.TensorDataset) -> None:
        self.x, self.y = data.tensors

    def __iter__(self):
        while True:
            ix = torch.randint(len(self.x), (8,))
            yield self.x[ix], self.y[ix]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.body(x), y)


def half_then_raise(opt: torch.optim.Optimizer) -> None:
    """Inside ``opt.step()``: the first half of the parameters updated, then an error
    (a step that fails midway)."""
    params = [p for group in opt.param_groups for p in group["params"]]
    with torch.no_grad():
        for p in params[: len(params) // 2]:
            p -= 0.05 * p.grad
    raise RuntimeError("boom inside optimizer.step()")


@guardrails.record
def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--fault", default="none")
    p.add_argument("--at", type=int, default=7)
    p.add_argument("--rank", default="-1", help="the faulty rank(s): 2, or 2,3; -1: every rank")
    p.add_argument("--every", type=int, default=None)
    p.add_argument("--background", action="store_true", help="periodic saves written behind")
    p.add_argument("--hang-timeout-s", type=float, default=60.0)
    p.add_argument("--save-timeout-s", type=float, default=20.0)
    p.add_argument(
        "--pg-timeout-s", type=float, default=None, help="gloo's, shorter than the hang's"
    )
    p.add_argument("--rewind", action="store_true")
    p.add_argument(
        "--draws",
        choices=["python", "torch", "torch_after"],
        default="python",
        help="the input's scale, drawn every step before the forward from python's stream "
        "or torch's; torch_after: from torch's, after the update (between it and the "
        "next step)",
    )
    p.add_argument("--prefetch", action="store_true", help="nanoGPT's loop (see above)")
    args = p.parse_args()
    run_dir = Path(args.run_dir)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        timeout = None if args.pg_timeout_s is None else timedelta(seconds=args.pg_timeout_s)
        dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank() if world > 1 else 0
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(rank)  # unseeded, a process's stream is the OS's entropy: never equal
    model: nn.Module = Net()
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    data = torch.utils.data.TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
    sampler = torch.utils.data.DistributedSampler(data, shuffle=True, seed=1) if world > 1 else None
    loader = torch.utils.data.DataLoader(
        data, batch_size=8, shuffle=sampler is None, sampler=sampler
    )
    chosen = {int(r) for r in args.rank.split(",")}
    faulty = -1 in chosen or rank in chosen
    if args.fault == "term_then_kill":  # the faulty rank signals the others by pid
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / f"pid{rank}").write_text(str(os.getpid()))
    seen: dict[int, float] = {}  # the batch each step trained on, by the step it made
    checkpoint = {"failure_save_timeout_s": args.save_timeout_s}
    if args.every:  # written before training goes on: committed before any fault
        checkpoint.update(every_n_steps=args.every, background=args.background)
    if args.prefetch:
        loader = GetBatch(data)
    with guardrails.guard(
        model,
        opt,
        loader,
        run_dir=run_dir,
        checkpoint=checkpoint,
        watchdog={"hang_timeout_s": args.hang_timeout_s},
        progress=False,
        **({"rewind": True} if args.rewind else {}),
    ) as g:
        slot = g.component("checkpoint").failure.slot
        if slot is not None:  # the tests check that it is gone at the end
            print(f"rank {rank}: published part at {slot.path}", flush=True)
        if faulty and args.fault == "start":
            raise ValueError("boom before the first step")
        scale = 1.0
        if args.prefetch:
            prefetching(g, model, opt, args, faulty, seen)
        while g.step < args.steps and not args.prefetch:
            if sampler is not None:
                sampler.set_epoch(g.epoch)
            for x, y in g:
                if faulty and g.step == args.at:
                    fault(args.fault, opt, g)
                if args.draws == "python":
                    scale = 1.0 + 0.1 * random.random()  # python's stream, drawn every step
                elif args.draws == "torch":
                    scale = 1.0 + 0.1 * float(torch.rand(()))
                model(x * scale, y).backward()
                if faulty and g.step == args.at and args.fault == "forward":
                    raise ValueError("boom after the backward")
                opt.step()
                seen[g.step] = float(x.sum() + y.sum())
                if args.draws == "torch_after":
                    scale = 1.0 + 0.1 * float(torch.rand(()))  # the next step's
                if faulty and g.step == args.at and args.fault == "kill_after":
                    os.kill(os.getpid(), signal.SIGKILL)
                if faulty and g.step == args.at and args.fault == "after":
                    raise ValueError("boom after the update")
                if faulty and g.step == args.at and args.fault == "sleep_after":
                    time.sleep(3600)
                opt.zero_grad()
                if g.step >= args.steps:
                    break
    bare = model.module if world > 1 else model
    torch.save(
        {
            "model": bare.state_dict(),
            "opt": opt.state_dict(),
            "step": g.step,
            "rng": (torch.get_rng_state(), random.getstate(), np.random.get_state()[1]),
            "seen": seen,
        },
        run_dir / f"final{rank}.pt",
    )
    if world > 1:
        dist.destroy_process_group()


def prefetching(
    g: guardrails.Guard,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    args: argparse.Namespace,
    faulty: bool,
    seen: dict[int, float],
) -> None:
    """nanoGPT's loop: the next batch fetched after the forward (its ``get_batch``
    during the forward), so each step boundary holds it."""
    it = iter(g)
    x, y = next(it)
    while g.step < args.steps:
        if faulty and g.step == args.at:
            fault(args.fault, opt, g)
        loss = model(x, y)
        x_next, y_next = next(it)
        loss.backward()
        if faulty and g.step == args.at and args.fault == "forward":
            raise ValueError("boom after the prefetch and the backward")
        opt.step()
        seen[g.step] = float(x.sum() + y.sum())
        opt.zero_grad()
        x, y = x_next, y_next


def fault(kind: str, opt: torch.optim.Optimizer, g: guardrails.Guard) -> None:
    """The planted fault, before the step's forward (``instep``: armed for its
    ``optimizer.step()``)."""
    if kind == "node_lost":
        # The node dies mid-step, its memory with it: its copy, and the copy it kept
        # of its partner (0.3 s: the forward that the node died in).
        time.sleep(0.3)
        link = g.component("checkpoint")._partner
        if link is not None:
            print(f"rank {g.rank}: {link.frames_sent} copies sent to rank {link.to}", flush=True)
            link.mirror.path.unlink(missing_ok=True)
        kind = "kill_unpublished"
    if kind == "kill_unpublished":
        g.component("checkpoint").failure.slot.path.unlink()
        kind = "kill"
    if kind == "raise":
        raise ValueError("boom: a bad batch")
    if kind == "sleep":
        time.sleep(3600)
    if kind == "term_then_kill":
        time.sleep(1.0)  # the others are in the step's all-reduce, waiting for this rank
        for r in range(g.world_size):
            if r != g.rank:
                os.kill(int((g.run_dir / f"pid{r}").read_text()), signal.SIGTERM)
        time.sleep(0.5)  # delivered: each runs its handler when its collective fails
        kind = "kill"
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "instep":  # torch's pre-hook runs inside step(), inside the guard's wrapper
        opt.register_step_pre_hook(lambda o, args, kwargs: half_then_raise(o))


if __name__ == "__main__":
    sys.exit(main())
