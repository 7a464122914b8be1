"""Host time of the guard's per-step grad norm against the number of parameter tensors.

    python benchmarks/norm_host.py --device cuda --tensors 150 1500
    python benchmarks/norm_host.py --device cpu --flat-sweep   # per tensor vs flat copy

For a model of N parameter tensors (the `stack` model of overhead.py: N/2 small Linear
layers, so the device work is tiny and what shows is host work), inside a live guard,
after one backward, times each way the guard can get the step's norm:

- `own`: its own pass (`GradNorm.__call__`), what a loop that neither clips nor uses
  GuardedDDP gets: on CUDA the kernel over the gradients' addresses
  (`_gradnorm_kernel.py`), on CPU one flat copy of a small model's gradients, and `own
  eager` the per-tensor norm they replaced (gather every `p.grad`, `_foreach_norm`,
  stack, norm), each with its relative error against a float64 norm of the same
  gradients;
- `clip check`: the check that a `torch.nn.utils.clip_grad_norm_` call covered exactly
  the guard's parameters (`Guard._took_clip_norm`), in the optimizer's order and in
  another order (the set comparison), what a loop that clips pays on top of its clip;
- `buckets`: `BucketNorms.record` for each of B buckets plus `total()`, what GuardedDDP's
  hook adds per step (B = the model's bytes / 25 MB DDP buckets, at least 1).

Host time: wall time of `--n` calls in a row without a sync inside, per call, median of
`--repeats` blocks (the device is synchronized between blocks).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import Stack

import guardrails
from guardrails.engine.gradnorm import BucketNorms

try:
    from guardrails.engine.gradnorm_kernel import _to_device
except ImportError:  # no Triton: the kernel path is not taken
    _to_device = None


def block(fn, n: int, repeats: int, device: torch.device) -> float:
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - t0) / n * 1e6)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return statistics.median(times)


def measure(tensors: int, device: torch.device, n: int, repeats: int) -> dict:
    torch.manual_seed(0)
    model = Stack(tensors).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(8, 16, device=device), torch.randn(8, device=device)
    params = list(model.parameters())
    shuffled = params[:]
    random.Random(0).shuffle(shuffled)
    nbytes = sum(p.numel() * p.element_size() for p in params)
    n_buckets = max(1, round(nbytes / 25e6))
    out: dict = {"tensors": len(params), "buckets": n_buckets}
    with (
        tempfile.TemporaryDirectory() as d,
        guardrails.guard(model, opt, [(x, y)] * 2, run_dir=d, progress=False, metrics=False) as g,
    ):
        xb, yb = next(iter(g))
        model(xb, yb).backward()
        total = torch.nn.utils.clip_grad_norm_(params, 1e9)
        own = g._norm(g.params, g.step)  # builds the kernel (Triton compiles it once)
        kernel, flat = g._norm.kernel, getattr(g._norm, "flat", False)
        out["own_path"] = "kernel" if g._norm.kernel_steps else "flat" if flat else "eager"
        out["own_us"] = block(lambda: g._norm(g.params, g.step), n, repeats, device)
        if hasattr(kernel, "addresses"):  # the kernel path's host time by part
            addresses = kernel.addresses(g.params)
            table = _to_device(addresses, torch.int64, device)
            out["kernel_parts_us"] = {
                "addresses": block(lambda: kernel.addresses(g.params), n, repeats, device),
                "table_to_device": block(
                    lambda: _to_device(addresses, torch.int64, device), n, repeats, device
                ),
                "launch": block(lambda: kernel.launch(table), n, repeats, device),
            }
        g._norm.kernel, g._norm.flat = None, False  # the per-tensor norm, for comparison
        eager = g._norm(g.params, g.step)
        out["own_eager_us"] = block(lambda: g._norm(g.params, g.step), n, repeats, device)
        g._norm.kernel, g._norm.flat = kernel, flat
        exact = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(p.grad.double()) for p in params])
        )
        out["own_rel_err"] = abs(own.double().item() - exact.item()) / exact.item()
        out["eager_rel_err"] = abs(eager.double().item() - exact.item()) / exact.item()
        out["clip_check_same_order_us"] = block(
            lambda: g._took_clip_norm(params, total), n, repeats, device
        )
        out["clip_check_other_order_us"] = block(
            lambda: g._took_clip_norm(shuffled, total), n, repeats, device
        )
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        pieces = flat.chunk(n_buckets)
        norms = BucketNorms(device)

        def buckets() -> None:
            for i, piece in enumerate(pieces):
                norms.record(i, piece, i == len(pieces) - 1, 0)
            norms.total(0)

        out["buckets_us"] = block(buckets, n, repeats, device)
        opt.step()
    return out


def flat_sweep(n: int, repeats: int) -> list[dict]:
    """CPU: 16 gradients of each size, normed per tensor (``total_norm``) and by one
    flat copy (``flat_norm``): where the copy starts to cost more than the dispatches
    it saves (``_gradnorm.FLAT_NUMEL_PER_TENSOR``)."""
    from guardrails.engine.gradnorm import flat_norm, total_norm

    cpu = torch.device("cpu")
    rows = []
    for size in (256, 1024, 4096, 16384, 65536, 262144):
        grads = [torch.randn(size) for _ in range(16)]
        rows.append(
            {
                "numel_per_tensor": size,
                "per_tensor_us": block(lambda g=grads: total_norm(g, cpu, False), n, repeats, cpu),
                "flat_us": block(lambda g=grads: flat_norm(g), n, repeats, cpu),
            }
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tensors", type=int, nargs="+", default=[150, 1500])
    p.add_argument("--n", type=int, default=50)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--out")
    p.add_argument("--flat-sweep", action="store_true", help="CPU: per tensor vs flat copy")
    a = p.parse_args()
    device = torch.device(a.device)
    if a.flat_sweep:
        for r in flat_sweep(a.n, a.repeats):
            print(
                f"16 tensors of {r['numel_per_tensor']}: per tensor {r['per_tensor_us']:.1f} "
                f"us, flat {r['flat_us']:.1f} us"
            )
            if a.out:
                with open(a.out, "a") as f:
                    f.write(json.dumps({**r, "torch": torch.__version__}) + "\n")
        return
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    for t in a.tensors:
        r = measure(t, device, a.n, a.repeats)
        r.update(device=name, torch=torch.__version__)
        print(
            f"{name} tensors={r['tensors']}: own ({r['own_path']}) {r['own_us']:.1f} us "
            f"(rel err {r['own_rel_err']:.1e}), eager {r['own_eager_us']:.1f} us "
            f"(rel err {r['eager_rel_err']:.1e}), clip check "
            f"{r['clip_check_same_order_us']:.2f} us (other order "
            f"{r['clip_check_other_order_us']:.2f}), {r['buckets']} bucket(s) "
            f"{r['buckets_us']:.1f} us"
        )
        if "kernel_parts_us" in r:
            parts = {k: round(v, 1) for k, v in r["kernel_parts_us"].items()}
            print("  kernel path by part (us):", parts)
        if a.out:
            with open(a.out, "a") as f:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
