"""Host time per step of the engine itself (a Guard with no components) and of the
default guard, on a tiny CPU loop, against the plain loop: what the step wrapper, the
forward recording and the boundary bookkeeping cost per step.

    python benchmarks/engine_cost.py [--steps 2000] [--repeats 15]

Plain, engine-only and defaults runs alternate `--repeats` times (drift hits all alike);
reported: the median us/step of each and the paired-median differences. To compare two
versions of guardrails, run this once with each on PYTHONPATH, on the same quiet machine.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import statistics
import tempfile
import time

import torch
from torch import nn

import guardrails


def loop(steps: int, mode: str, run_dir: str) -> float:
    torch.manual_seed(0)
    # As small as a step gets (~40 us on CPU), so the engine's own host work shows.
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, foreach=False)
    data = [(torch.randn(2, 4), torch.randn(2, 1)) for _ in range(steps)]
    if mode == "plain":
        guard: contextlib.AbstractContextManager = contextlib.nullcontext(data)
    elif mode == "engine":
        guard = guardrails.Guard(model, opt, data, run_dir=run_dir, components=[])
    else:
        guard = guardrails.guard(model, opt, data, run_dir=run_dir, progress=False)
    with guard as it:
        t0 = time.perf_counter()
        for x, y in it:
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        return (time.perf_counter() - t0) / steps * 1e6


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args()
    logging.getLogger("guardrails").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    modes = ("plain", "engine", "defaults")
    times: dict[str, list[float]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for m in modes:
                times[m].append(loop(args.steps, m, f"{tmp}/{m}{r}"))
    med = {m: statistics.median(v) for m, v in times.items()}
    print(f"guardrails {guardrails.__file__}, torch {torch.__version__}")
    for m in modes:
        print(f"  {m:9s} {med[m]:8.1f} us/step")
    for m in ("engine", "defaults"):
        diffs = [a - b for a, b in zip(times[m], times["plain"], strict=True)]
        print(f"  {m} - plain: paired median {statistics.median(diffs):+.1f} us/step")


if __name__ == "__main__":
    main()
