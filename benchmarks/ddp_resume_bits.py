"""Why a DDP resume at more than 2 ranks is not bitwise, in plain torch (issue 50's note).

An uninterrupted run of N steps against a run stopped at step K, resumed in fresh
processes from a ``torch.save`` of the model and optimizer, continued to N; the final
weights compared bitwise. No guardrails: this is torch's own behaviour.

    python benchmarks/ddp_resume_bits.py                 # every variant at 4 and 2 ranks
    python benchmarks/ddp_resume_bits.py --ranks 4 --variants default

The variants:

- ``default``: ``DistributedDataParallel(model, bucket_cap_mb=0.02)``.
- ``one_bucket``: ``bucket_cap_mb=1000`` (every gradient in one bucket, before and after
  the rebuild).
- ``static_graph``: ``static_graph=True`` with the small buckets.
- ``relayout``: ``default``, but the resumed run gives its reducer the bucket layout the
  stopped run's reducer had (saved beside the weights) before its first step: the cause
  taken away (DDP's own ``_ddp_init_helper`` re-run, the way ``__setstate__`` does).

Each run also prints its reducer's buckets at construction and after its first step,
so the cause is visible: DDP builds ONE bucket at construction (``compute_bucket_size_limits``:
``[sys.maxsize]`` unless ``find_unused_parameters``) and rebuilds it after the first
backward into ``bucket_cap_mb`` pieces in the order the gradients became ready. An
uninterrupted run's step K+1 reduces the rebuilt buckets, a resumed run's first step
reduces the one bucket of construction; gloo's ring all-reduce sums each chunk of a
bucket in an order set by the chunk's place in the bucket, so at more than 2 ranks the
same gradients are summed in another order (at 2 ranks a + b == b + a).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

WIDTH = 64
LAYERS = 6
BATCH = 8
SMALL_BUCKET_MB = 0.02  # ~20 KB: three 16 KB Linear weights -> 6 buckets


def build(variant: str):
    """The seeded model, its DDP wrapper for ``variant`` and an AdamW."""
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    model = nn.Sequential(*layers, nn.Linear(WIDTH, 1))
    cap = 1000 if variant == "one_bucket" else SMALL_BUCKET_MB
    ddp = nn.parallel.DistributedDataParallel(
        model, bucket_cap_mb=cap, static_graph=variant == "static_graph"
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return ddp, opt


def layout(ddp) -> list[list[int]]:
    """The reducer's buckets now, each a list of indices into DDP's parameter list."""
    params, _ = ddp._build_params_for_reducer()
    index = {id(p): i for i, p in enumerate(params)}
    buckets = ddp.reducer._get_zeros_like_grad_buckets()
    return [[index[id(p)] for p in b.parameters()] for b in buckets]


def relayout(ddp, buckets: list[list[int]]) -> None:
    """Give ``ddp`` a fresh reducer whose buckets are ``buckets`` (DDP's own init helper,
    its bucket assignment replaced for the one call)."""
    import torch.distributed as dist

    original = dist._compute_bucket_assignment_by_size
    # _ddp_init_helper reverses the assignment it is given (its buckets are built in
    # parameter order, reduced in the reverse)
    dist._compute_bucket_assignment_by_size = lambda *a, **k: (
        list(reversed(buckets)),
        [1 << 62] * len(buckets),
    )
    try:
        ddp.reducer._remove_autograd_hooks()
        params, sparse = ddp._build_params_for_reducer()
        names = ddp._build_debug_param_to_name_mapping(params)
        ddp._ddp_init_helper(params, sparse, names, ddp.static_graph)
    finally:
        dist._compute_bucket_assignment_by_size = original


def batch(step: int, rank: int):
    import torch

    gen = torch.Generator().manual_seed(1_000_003 * step + rank)
    x = torch.randn(BATCH, WIDTH, generator=gen)
    return x, x[:, :1].sin()


def worker(args: argparse.Namespace) -> None:
    """One rank of one run: steps [start, stop), from a saved state when start > 0."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ddp, opt = build(args.variant)
    out = Path(args.dir)
    start = 0
    if args.resume:
        state = torch.load(out / "state.pt", weights_only=True)
        ddp.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
        if args.variant == "relayout":
            relayout(ddp, json.loads((out / "layout.json").read_text()))
    seen = {"construction": layout(ddp)}
    for step in range(start, args.stop):
        x, y = batch(step, rank)
        opt.zero_grad()
        F.mse_loss(ddp(x), y).backward()
        opt.step()
    seen["end"] = layout(ddp)  # rebuilt by the second step's forward
    if rank == 0:
        if args.save_state:
            torch.save(
                {"model": ddp.module.state_dict(), "opt": opt.state_dict(), "step": args.stop},
                out / "state.pt",
            )
            (out / "layout.json").write_text(json.dumps(layout(ddp)))
        torch.save(ddp.module.state_dict(), out / f"final_{args.tag}.pt")
        (out / f"layouts_{args.tag}.json").write_text(json.dumps(seen))
    dist.barrier()  # no rank leaves while rank 0 still writes (gloo aborts on a lost peer)
    dist.destroy_process_group()


def torchrun(ranks: int, dir_: Path, variant: str, *flags: str) -> None:
    """One run of ``ranks`` fresh processes (the worker below)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={ranks}", __file__, "--worker", "--dir", str(dir_),
           "--variant", variant, *flags]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if run.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")


def compare(a: Path, b: Path) -> tuple[int, int]:
    """(tensors that differ, tensors) between two saved state dicts."""
    import torch

    x, y = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    return sum(not torch.equal(x[k], y[k]) for k in x), len(x)


def drive(args: argparse.Namespace) -> None:
    """Each variant at each world size: uninterrupted, stopped, resumed; compared."""
    for ranks in args.ranks:
        for variant in args.variants:
            saving = "default" if variant == "relayout" else variant  # the runs that save
            with tempfile.TemporaryDirectory() as tmp:
                d = Path(tmp)
                torchrun(ranks, d, saving, "--stop", str(args.steps), "--tag", "full")
                torchrun(ranks, d, saving, "--stop", str(args.stop_at), "--tag", "first",
                         "--save-state")  # fmt: skip
                torchrun(ranks, d, variant, "--stop", str(args.steps), "--tag", "resumed",
                         "--resume")  # fmt: skip
                differ, total = compare(d / "final_full.pt", d / "final_resumed.pt")
                print(f"{ranks} ranks  {variant:13s} resumed at {args.stop_at} vs "
                      f"uninterrupted {args.steps} steps: {differ}/{total} tensors differ",
                      flush=True)  # fmt: skip
                if args.verbose:
                    for tag in ("full", "resumed"):
                        seen = json.loads((d / f"layouts_{tag}.json").read_text())
                        print(f"   {tag} run's buckets: {seen}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[4, 2])
    variants = ["default", "one_bucket", "static_graph", "relayout"]
    p.add_argument("--variants", nargs="+", default=variants, choices=variants)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--stop-at", type=int, default=3)
    p.add_argument("--verbose", action="store_true", help="print each run's buckets")
    # the worker's own flags
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--stop", type=int, help=argparse.SUPPRESS)
    p.add_argument("--tag", help=argparse.SUPPRESS)
    p.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--save-state", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    worker(args) if args.worker else drive(args)


if __name__ == "__main__":
    main()
