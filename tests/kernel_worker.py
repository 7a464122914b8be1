"""Run guardrails' grad-norm Triton kernels in Triton's interpreter (on CPU tensors)
and print what tests/test_gradnorm_kernel.py checks, as JSON. Needs TRITON_INTERPRET=1
in the environment before triton is imported (the test sets it)."""

from __future__ import annotations

import json

import torch

from guardrails import _gradnorm_kernel as K


def table_norm(params: list[torch.Tensor]) -> float:
    """The norm TableNorm computes, with its plan and kernel, on CPU tensors."""
    addresses = torch.tensor(
        [0 if p.grad is None else p.grad.data_ptr() for p in params], dtype=torch.int64
    )
    numels = torch.tensor([p.numel() for p in params], dtype=torch.int64)
    total = 0.0
    for triton_dtype, which, starts in K.plan(params):
        partials = torch.full((len(which),), float("nan"))  # every slot must be written
        K._sum_of_squares[(len(which),)](
            addresses,
            numels,
            torch.tensor(which, dtype=torch.int32),
            torch.tensor(starts, dtype=torch.int64),
            partials,
            CHUNK=K.CHUNK,
            BLOCK=K.BLOCK,
            DTYPE=triton_dtype,
        )
        total += partials.sum().item()
    return total**0.5


def flat_partials(x: torch.Tensor, partials: torch.Tensor) -> None:
    grid = (K.FLAT_PROGRAMS,)
    K._flat_sum_of_squares[grid](x, x.numel(), K.flat_chunk(x.numel()), partials, BLOCK=K.BLOCK)


def exact(tensors: list[torch.Tensor]) -> float:
    return torch.stack([t.double().norm() for t in tensors]).norm().item()


def main() -> None:
    torch.manual_seed(0)
    out: dict = {}
    sizes = [1, 7, K.CHUNK - 1, K.CHUNK, K.CHUNK + 1, 2 * K.CHUNK + 5]
    dtypes = [torch.float32, torch.bfloat16, torch.float16]
    params = [torch.nn.Parameter(torch.zeros(n, dtype=dtype)) for n in sizes for dtype in dtypes]
    for i, p in enumerate(params):
        p.grad = None if i % 4 == 1 else (torch.randn(p.numel()) * (1 + i % 3)).to(p.dtype)
    grads = [p.grad for p in params if p.grad is not None]
    out["launches"] = [(str(dt), len(w)) for dt, w, _ in K.plan(params)]
    out["table"] = [table_norm(params), exact(grads)]
    nonfinite = []
    # 1-element fp32, fp16 of CHUNK, fp32 and bf16 of 2 chunks + 5 (the last chunk)
    for i in (0, 11, 15, 16):
        grad = params[i].grad
        for bad in (float("nan"), float("inf")):
            kept = grad[-1].clone()
            grad[-1] = bad
            nonfinite.append((i, bad, table_norm(params)))
            grad[-1] = kept
    out["nonfinite"] = nonfinite
    out["table_after"] = [table_norm(params), exact(grads)]

    slots = torch.full((2 * K.FLAT_PROGRAMS,), float("nan"))
    big, small = torch.randn(300_001), torch.randn(10, dtype=torch.bfloat16)
    flat_partials(big, slots[: K.FLAT_PROGRAMS])
    flat_partials(small, slots[K.FLAT_PROGRAMS :])
    out["flat"] = [slots.sum().sqrt().item(), exact([big, small])]
    flat_partials(small.float(), slots[: K.FLAT_PROGRAMS])  # bucket 0 shrank: no stale sum
    out["flat_shrunk"] = [slots.sum().sqrt().item(), exact([small, small])]
    # BucketNorms laid out for the kernel whose launch fails (here: no CUDA device to
    # launch on, as a Triton that cannot build): the same slots by hand from then on.
    from guardrails._gradnorm import BucketNorms

    norms = BucketNorms(torch.device("cpu"))
    norms._flat, norms._width = K, K.FLAT_PROGRAMS
    buckets = [torch.randn(5_000), torch.randn(7, dtype=torch.float64), torch.randn(3)]
    for i, b in enumerate(buckets):
        norms.record(i, b, i == len(buckets) - 1, 0)
    out["bucket_fallback"] = [norms.total(0).item(), exact(buckets), norms._flat is None]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
