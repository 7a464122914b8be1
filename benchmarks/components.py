"""Host cost of each guardrails component, alone and together, on a tiny model.

    python benchmarks/components.py --device cpu
    python benchmarks/components.py --device cuda

A tiny model makes the step short, so what shows is the guard's host work per step
(kernel launches and Python), the part that matters when a GPU loop is host-bound
(small batches, eager mode). Method as in overhead.py: the variants run interleaved,
`--repeats` times each, `--steps` timed steps per run; reported are median per-step
times and the overhead of each variant over the plain loop.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import Tiny, sync

import guardrails


def variants() -> dict[str, object]:
    g = guardrails
    out = {
        "plain": None,
        "engine only": lambda: [],
        "GCScheduler": lambda: [g.GCScheduler()],
        "NanGuard": lambda: [g.NanGuard()],
        "Telemetry": lambda: [g.Telemetry(progress=False)],
    }
    if hasattr(g, "MemoryGuard"):
        out["MemoryGuard"] = lambda: [g.MemoryGuard()]
    out["guard() defaults"] = "defaults"
    return out


WARMUP = 20  # untimed steps per run: GCScheduler's one full collection + freeze is at step 1


def run(make, model, opt, data, steps: int, device: torch.device) -> float:
    def loop(it):
        t0 = 0.0
        for i, (x, y) in enumerate(it):
            if i == WARMUP:
                sync(device)
                t0 = time.perf_counter()
            model(x, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        sync(device)
        return (time.perf_counter() - t0) / steps

    batches = [data[i % len(data)] for i in range(WARMUP + steps)]
    if make is None:
        return loop(batches)
    with tempfile.TemporaryDirectory() as d:
        if make == "defaults":
            g = guardrails.guard(model, opt, batches, run_dir=d, progress=False)
        else:
            g = guardrails.Guard(model, opt, batches, run_dir=d, components=make())
        with g:
            return loop(g)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", default="cpu")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--repeats", type=int, default=9)
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Tiny().to(device)
    # fused: the optimizer NanGuard can skip on the device without a sync.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    data = [(torch.randn(8, 16, device=device), torch.randn(8, device=device)) for _ in range(8)]
    vs = variants()
    times: dict[str, list[float]] = {k: [] for k in vs}
    for make in vs.values():  # warm-up
        run(make, model, opt, data, args.steps, device)
    for _ in range(args.repeats):
        for k, make in vs.items():
            times[k].append(run(make, model, opt, data, args.steps, device))
    plain = statistics.median(times["plain"])
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"{name} torch {torch.__version__}: tiny model, fused AdamW, "
        f"{args.steps} steps x {args.repeats}"
    )
    for k, ts in times.items():
        med = statistics.median(ts)
        print(f"  {k:18s} {med * 1e6:8.1f} us/step  {(med - plain) * 1e6:+7.1f} us")


if __name__ == "__main__":
    main()
