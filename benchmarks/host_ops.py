"""Host cost of each op on the guard's per-step path, one at a time.

    python benchmarks/host_ops.py --device cuda

On a GPU the host issues kernels asynchronously, so what the guard costs the host is
the time to *launch* its ops, which this measures (median of `--repeats` blocks of
`--n` calls, no sync inside a block). Used to choose between designs for the per-step
path; see benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch


def timeit(fn, n: int, repeats: int, device: torch.device) -> float:
    fn()
    out = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t0) / n)
        if device.type == "cuda":
            torch.cuda.synchronize()
    return statistics.median(out) * 1e6


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--params", type=int, default=4, help="parameter tensors")
    p.add_argument("--n", type=int, default=500)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    dev = torch.device(args.device)
    grads = [torch.randn(64, 64, device=dev) for _ in range(args.params)]
    norms = torch._foreach_norm(grads)
    stacked = torch.stack(norms)
    loss = torch.randn((), device=dev)
    gn = torch.randn((), device=dev)
    ring = torch.zeros(50, 3, device=dev)
    row = ring.unbind(0)[3]
    false = torch.zeros((), dtype=torch.bool, device=dev)
    fzero = torch.zeros((), device=dev)
    nan = torch.full((), math.nan, device=dev)
    ops = {
        "empty python call": lambda: None,
        "_foreach_norm(grads)": lambda: torch._foreach_norm(grads),
        "stack(norms)": lambda: torch.stack(norms),
        "vector_norm(stacked)": lambda: torch.linalg.vector_norm(stacked),
        "total norm (3 ops)": lambda: torch.linalg.vector_norm(
            torch.stack(torch._foreach_norm(grads))
        ),
        "ring stack f32+bool, out=row": lambda: torch.stack((loss, gn, false), out=row),
        "ring stack f32 only, out=row": lambda: torch.stack((loss, gn, fzero), out=row),
        "ring row copy_ via index_put": lambda: row.copy_(stacked[:3]),
        "loss.detach()": lambda: loss.detach(),
        "loss + loss": lambda: loss + loss,
        "isfinite(gn)": lambda: torch.isfinite(gn),
        "where(isfinite, gn, nan)": lambda: torch.where(torch.isfinite(gn), gn, nan),
    }
    if dev.type == "cuda":
        ops["cuda.max_memory_allocated"] = lambda: torch.cuda.max_memory_allocated(dev)
        ops["cuda.Event().record()"] = lambda: torch.cuda.Event().record()
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"{name}, torch {torch.__version__}, {args.params} parameter tensors")
    for label, fn in ops.items():
        print(f"  {label:34s} {timeit(fn, args.n, args.repeats, dev):8.2f} us")


if __name__ == "__main__":
    main()
