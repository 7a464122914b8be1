"""Run guardrails' grad-norm Triton kernels in Triton's interpreter (on CPU tensors)
and print what tests/engine/test_gradnorm_kernel.py checks, as JSON. Needs TRITON_INTERPRET=1
in the environment before triton is imported (the test sets it)."""

from __future__ import annotations

import json
import types

import torch

from guardrails.engine import gradnorm_kernel as K

_TABLES: dict[int, K.TableNorm] = {}


def table_norm(params: list[torch.Tensor]) -> float:
    """TableNorm's norm (its plan, address table, kernels and in-kernel total) on CPU
    tensors; one TableNorm per parameter list, reused as a guard reuses it each step."""
    norm = _TABLES.get(id(params))
    if norm is None:
        norm = _TABLES[id(params)] = K.TableNorm(params)
        norm.partials.fill_(float("nan"))  # the total reads every slot: each must be written
    got = norm(params)
    assert got is not None
    # The count of finished programs is back at 0 for the next step's launches.
    assert norm.finished.tolist() == [0], norm.finished
    return got.item()


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
    # A gradient assigned by hand as a strided view: the kernel leaves it to the eager norm.
    kept = params[3].grad  # float32, 7 elements
    params[3].grad = torch.zeros(14)[::2]
    out["strided_is_left_to_eager"] = _TABLES[id(params)](params) is None
    params[3].grad = kept
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
    # BucketNorms on the kernel (as on CUDA): bucket 0 by the kernel, bucket 1 (float64)
    # by hand, and bucket 2 when the kernel fails to build (a broken Triton, stood in
    # for here: the interpreter builds anything), by hand in the same slots from then on.
    from guardrails.engine.gradnorm import BucketNorms

    def broken_build(x: torch.Tensor, partials: torch.Tensor) -> None:
        raise RuntimeError("PTX assembly failed")

    norms = BucketNorms(torch.device("cpu"))
    norms._flat, norms._width = K, K.FLAT_PROGRAMS
    buckets = [torch.randn(5_000), torch.randn(7, dtype=torch.float64), torch.randn(3)]
    for i, b in enumerate(buckets):
        if i == 2:
            norms._flat = types.SimpleNamespace(
                flat_supports=K.flat_supports, flat_sum_of_squares=broken_build
            )
        norms.record(i, b, i == len(buckets) - 1, 0)
    out["bucket_fallback"] = [norms.total(0).item(), exact(buckets), norms._flat is None]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
