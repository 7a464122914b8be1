"""Host and device cost of the guard's per-step grad norm: eager vs replayed CUDA graph.

    python benchmarks/grad_norm.py [--model gpt2] [--n 200] [--repeats 9]

One backward of the reference model fills the gradients (GPT-2 small: 148 tensors,
124M fp32 values), then the norm is computed `--n` times in a row per block, eagerly
(`_gradnorm.total_norm`, release 0.2's path) and through `GradNorm` (address check plus
graph replay plus the clone it returns), blocks interleaved. Host time: wall time of the
block without a sync inside (the launch cost, what a host-bound loop pays). Device time:
CUDA events around 50 calls queued behind a sleep kernel (the kernels back to back).
Medians over `--repeats` blocks. Both results are checked to
be bitwise equal first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from train_gpt import GPT

from guardrails.engine.gradnorm import GradNorm, total_norm


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="gpt2", choices=["gpt2", "gpt2-mini"])
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--out")
    a = p.parse_args()
    dev = torch.device("cuda")
    cfg = {"gpt2": (12, 12, 768), "gpt2-mini": (4, 4, 256)}[a.model]
    model = GPT(50304, 1024, *cfg).to(dev)
    x = torch.randint(0, 50304, (2, 1024), device=dev)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        model(x, x).backward()
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    gn = GradNorm(params, use_graph=True)
    for _ in range(3):  # eager, capture, replay
        graphed = gn(params)
    assert gn.replays >= 1, "the graph was not replayed"
    assert torch.equal(graphed, total_norm(grads, dev, False))

    def eager() -> None:
        total_norm(grads, dev, False)

    def graph() -> None:
        gn(params)

    host: dict[str, list[float]] = {"eager": [], "graph": []}
    device: dict[str, list[float]] = {"eager": [], "graph": []}
    n_dev = 50  # few enough to queue behind the sleep below
    for _ in range(a.repeats):
        for name, fn in (("eager", eager), ("graph", graph)):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(a.n):
                fn()
            host[name].append((time.perf_counter() - t0) / a.n * 1e6)
            torch.cuda.synchronize()
            # Device time alone: the GPU sleeps while the host queues every launch, so
            # the events time the kernels back to back, not the host's pace.
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(100_000_000)
            start.record()
            for _ in range(n_dev):
                fn()
            end.record()
            torch.cuda.synchronize()
            device[name].append(start.elapsed_time(end) / n_dev * 1e3)
    result = {
        "device": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "model": a.model,
        "grads": len(grads),
        "numel": sum(g.numel() for g in grads),
        **{f"{k}_host_us": statistics.median(v) for k, v in host.items()},
        **{f"{k}_device_us": statistics.median(v) for k, v in device.items()},
    }
    print(
        f"{result['device']} torch {result['torch']}, {a.model}: {len(grads)} grads, "
        f"{result['numel'] / 1e6:.1f}M values\n"
        f"  eager: host {result['eager_host_us']:7.1f} us/call, "
        f"device {result['eager_device_us']:7.1f} us/call\n"
        f"  graph: host {result['graph_host_us']:7.1f} us/call, "
        f"device {result['graph_device_us']:7.1f} us/call"
    )
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
