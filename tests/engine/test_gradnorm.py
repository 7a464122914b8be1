"""The guard's own grad norm off CUDA: on CPU by one flat copy of a small model's
gradients, per tensor past that size; sparse gradients (``nn.Embedding(sparse=True)``)
by their coalesced values, recorded and judged like any other. (The CUDA kernel's tests
are test_gradnorm_kernel.py's and test_gpu.py's.)"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import read_events

import guardrails
from guardrails.engine.gradnorm import FLAT_NUMEL_PER_TENSOR, GradNorm, total_norm


def exact(params: list[torch.Tensor]) -> float:
    """The float64 norm of every gradient (a sparse one's coalesced values)."""
    grads = [p.grad.coalesce().values() if p.grad.is_sparse else p.grad for p in params]
    return torch.stack([g.double().norm() for g in grads if g is not None]).norm().item()


def with_grads(shapes, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.zeros(s, dtype=dtype)) for s in shapes]
    for i, p in enumerate(params):
        p.grad = torch.randn(p.shape).to(dtype) * (i + 1)
    return params


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_a_small_models_cpu_norm_is_one_flat_copy_and_the_float64_norm_within_rounding(
    dtype,
):
    params = with_grads([(16, 4), (16,), (4, 16), (1,), (3, 3, 3)], dtype)
    params[1].grad = None  # a parameter without a gradient this step
    norm = GradNorm(params, use_graph=False)
    assert norm.flat
    got = norm(params)
    assert got.dtype == torch.float32 and got.shape == ()
    # Summed in float32 from the gradients' own values (a bf16 model's too: no
    # per-tensor rounding to bf16 on the way).
    assert got.item() == pytest.approx(exact([p for p in params if p.grad is not None]), rel=1e-6)
    for bad in (float("nan"), float("inf")):
        params[4].grad[2, 1, 0] = bad
        got = norm(params).item()
        assert math.isnan(got) if math.isnan(bad) else got == math.inf


def test_a_step_where_no_parameter_has_a_gradient_has_norm_zero():
    """As the per-tensor norm says (0, finite): a frozen model's first steps, or a loop
    that steps without a backward."""
    params = with_grads([(4,), (2, 2)])
    for p in params:
        p.grad = None
    norm = GradNorm(params, use_graph=False)
    assert norm.flat
    assert norm(params).item() == 0.0


def test_a_model_large_for_its_tensor_count_keeps_the_per_tensor_norm():
    """Past FLAT_NUMEL_PER_TENSOR elements a tensor on average, the copy would cost
    more than the dispatches it saves: the norm stays ``_foreach_norm``'s, bitwise."""
    params = with_grads([(FLAT_NUMEL_PER_TENSOR + 1,), (FLAT_NUMEL_PER_TENSOR,)])
    norm = GradNorm(params, use_graph=False)
    assert not norm.flat
    expected = total_norm([p.grad for p in params], torch.device("cpu"), False)
    assert torch.equal(norm(params), expected)


class Tagger(torch.nn.Module):
    """A sparse embedding, as in recommendation and word2vec-style loops."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50, 8, sparse=True)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids)).squeeze(-1)


def test_sparse_embedding_gradients_are_recorded_and_a_nan_in_one_is_skipped(tmp_path):
    """Was: NotImplementedError from ``linalg_vector_norm`` at the first step. Now each
    step's recorded norm is that of the gradients with the sparse one coalesced (a
    batch repeats ids: rows summed), and a NaN planted in the sparse gradient at step
    3 skips that step's update and names it."""
    torch.manual_seed(0)
    model = Tagger()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g0 = torch.Generator().manual_seed(0)
    data = [(torch.randint(0, 10, (32,), generator=g0), torch.randn(32, generator=g0))] * 5
    expected, before, after = [], {}, {}
    with guardrails.guard(model, opt, data, run_dir=tmp_path, progress=False) as g:
        for step, (ids, y) in enumerate(g, 1):
            torch.nn.functional.mse_loss(model(ids), y).backward()
            grad = model.emb.weight.grad
            assert grad.is_sparse and not grad.is_coalesced()
            if step == 3:
                grad._values()[0, 0] = float("nan")
            else:
                expected.append(exact(list(model.parameters())))
            before[step] = model.emb.weight.detach().clone()
            opt.step()
            after[step] = model.emb.weight.detach().clone()
            opt.zero_grad()
    rows = guardrails.read_metrics(tmp_path).to_pydict()
    assert rows["step"] == [1, 2, 3, 4, 5]
    assert rows["skipped"] == [False, False, True, False, False]
    finite = [v for s, v in zip(rows["step"], rows["grad_norm"], strict=True) if s != 3]
    assert finite == pytest.approx(expected, rel=1e-6)
    assert torch.equal(before[3], after[3])  # the bad step left the weights as they were
    assert not torch.equal(before[4], after[4])
    events = [e for e in read_events(tmp_path) if e["kind"] == "nonfinite"]
    assert [e["step"] for e in events] == [3]
