"""Kernel time of the guard's grad norm kernel (`_gradnorm_kernel._sum_of_squares`)
over GPT-2 small's gradient sizes, for chunk sizes, block sizes and warp counts, beside
what one read of the same bytes costs in torch's own reduction (`x.sum()` over one
flat tensor as large as all the gradients together): the reference for how close the
kernel comes to the card's attainable read bandwidth.

    PYTHONPATH=$PWD python benchmarks/kernel_tune.py [--out FILE]

Each figure: the median of 7 blocks of 20 back-to-back launches timed with CUDA events
(no host sync inside a block).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics

import torch

from guardrails.engine import gradnorm_kernel as K


def gpt2_small_sizes() -> list[int]:
    """The 148 parameter tensors of GPT-2 small (124M; the LM head tied to wte)."""
    d, v, ctx, layers = 768, 50257, 1024, 12
    block = [d, d, 3 * d * d, 3 * d, d * d, d, d, d, 4 * d * d, 4 * d, 4 * d * d, d]
    return [v * d, ctx * d] + block * layers + [d, d]


def timed(fn, n: int = 20, repeats: int = 7) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / n)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out")
    a = p.parse_args()
    torch.manual_seed(0)
    sizes = gpt2_small_sizes()
    params = [torch.nn.Parameter(torch.empty(n, device="cuda")) for n in sizes]
    for q in params:
        q.grad = torch.randn_like(q)
    nbytes = sum(sizes) * 4
    flat = torch.randn(sum(sizes), device="cuda")
    rows = [{"what": "torch flat x.sum()", "us": timed(lambda: flat.sum())}]
    rows.append(
        {
            "what": "torch _foreach_norm + stack + norm",
            "us": timed(
                lambda: torch.linalg.vector_norm(
                    torch.stack(torch._foreach_norm([q.grad for q in params]))
                )
            ),
        }
    )
    default = (K.CHUNK, K.BLOCK, K._OPTIONS["num_warps"])
    for chunk, block, warps in itertools.product(
        (32 * 1024, 64 * 1024, 128 * 1024, 256 * 1024), (1024, 2048, 4096), (4, 8, 16)
    ):
        K.CHUNK, K.BLOCK, K._OPTIONS["num_warps"] = chunk, block, warps
        norm = K.TableNorm(params)
        table = K._to_device(norm.addresses(params), torch.int64, torch.device("cuda"))
        rows.append(
            {
                "what": "kernel",
                "chunk": chunk,
                "block": block,
                "warps": warps,
                "default": (chunk, block, warps) == default,
                "us": timed(lambda norm=norm, table=table: norm.launch(table)),
            }
        )
    K.CHUNK, K.BLOCK, K._OPTIONS["num_warps"] = default
    for r in rows:
        r["tb_s"] = nbytes / r["us"] / 1e6
    name = torch.cuda.get_device_name()
    for r in sorted(rows, key=lambda r: r["us"]):
        print(
            f"{name}: {r['us']:7.1f} us {r['tb_s']:.2f} TB/s",
            {k: v for k, v in r.items() if k not in ("us", "tb_s")},
        )
    if a.out:
        with open(a.out, "w") as f:
            for r in rows:
                f.write(json.dumps({**r, "device": name, "torch": torch.__version__}) + "\n")


if __name__ == "__main__":
    main()
