"""What NanGuard's per-step flag agreement costs (loops whose gradients differ per rank
at ``optimizer.step()``: a distributed optimizer without DDP): one SUM all-reduce of two
float64 values, read back on the host, on guardrails' gloo side group (CPU tensors, a
ring over TCP) vs an NCCL group of its own (a device tensor, NCCL's algorithms).

    torchrun --nproc-per-node 2 benchmarks/flag_agreement.py [--steps 2000]

Prints the median and p90 microseconds per agreement for each transport, rank 0.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist


def timed(fn, steps: int) -> list[float]:
    for _ in range(50):  # warm-up: connections, NCCL's first-use setup
        fn()
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=2000)
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo")
    gloo = dist.new_group(backend="gloo")
    flag = torch.tensor([0.0, 1.5], dtype=torch.float64)

    def on_gloo() -> None:
        both = flag.clone()
        dist.all_reduce(both, group=gloo)
        both.tolist()

    results = {"gloo side group": timed(on_gloo, args.steps)}
    if cuda:
        nccl = dist.new_group(backend="nccl")
        dev = torch.device("cuda", local)

        def on_nccl() -> None:
            on_device, opts = flag.to(dev), dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.SUM
            nccl.allreduce([on_device], opts).wait()
            on_device.cpu().tolist()

        results["nccl group"] = timed(on_nccl, args.steps)
    if dist.get_rank() == 0:
        print(f"world {dist.get_world_size()}, torch {torch.__version__}, steps {args.steps}")
        for name, us in results.items():
            q = statistics.quantiles(us, n=10)
            print(f"{name:16s} median {statistics.median(us):8.1f} us  p90 {q[-1]:8.1f} us")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
