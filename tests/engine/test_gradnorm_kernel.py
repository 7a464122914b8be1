"""The grad norm's Triton kernels (guardrails/_gradnorm_kernel.py), run on CPU in
Triton's interpreter: their chunking, dtypes, missing gradients, NaN/Inf and the
fixed slots of DDP buckets, checked where CI runs. The compiled kernels, the guard's
use of them and their cost are tests/loops/test_gpu.py's (an H100/H200)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _ranks import patience

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="needs triton (the dev extra installs it on Linux x86_64; it ships with CUDA torch)",
)

WORKER = Path(__file__).resolve().parents[1] / "kernel_worker.py"
#: The tests that read the shared run of the kernels under the Triton interpreter.
interpreted = pytest.mark.slow(reason="reads the shared Triton-interpreter run (a process)")


@pytest.fixture(scope="module")
def out() -> dict:
    # A process of its own: TRITON_INTERPRET must be set before triton decorates the
    # kernels, and no other test should see interpreted kernels.
    got = subprocess.run(
        [sys.executable, str(WORKER)],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=patience(300),
    )
    assert got.returncode == 0, got.stderr[-3000:]
    return json.loads(got.stdout.splitlines()[-1])


@interpreted
def test_the_table_kernel_is_the_float64_norm_of_every_gradient_within_rounding(out):
    # One launch per dtype; 6 parameters each (1, 7, CHUNK - 1, CHUNK, CHUNK + 1 and
    # 2 CHUNK + 5 elements): 1 + 1 + 1 + 1 + 2 + 3 chunks. Parameters without a gradient
    # still get their programs (address 0: nothing read).
    assert out["launches"] == [["fp32", 9], ["bf16", 9], ["fp16", 9]]
    got, exact = out["table"]
    assert got == pytest.approx(exact, rel=1e-6)
    assert out["table_after"] == out["table"]  # planting and restoring changed nothing
    assert out["strided_is_left_to_eager"]


@interpreted
def test_one_nan_or_inf_anywhere_makes_the_norm_non_finite(out):
    assert len(out["nonfinite"]) == 8
    for i, bad, norm in out["nonfinite"]:
        assert math.isnan(norm) if math.isnan(bad) else norm == math.inf, (i, bad, norm)


@interpreted
def test_bucket_partials_fill_fixed_slots_and_a_shrunk_bucket_leaves_no_stale_sum(out):
    got, exact = out["flat"]
    assert got == pytest.approx(exact, rel=1e-6)
    got, exact = out["flat_shrunk"]
    assert got == pytest.approx(exact, rel=1e-6)


@interpreted
def test_bucket_norms_whose_kernel_fails_to_launch_fill_the_same_slots_by_hand(out):
    got, exact, given_up = out["bucket_fallback"]
    assert got == pytest.approx(exact, rel=1e-6)
    assert given_up


def test_parameters_the_kernel_cannot_read_are_named():
    """The guard asks at its first step (not at start: a lazy module's parameters have
    no size before its first forward); any reason keeps the eager norm for the run."""
    import torch

    from guardrails.engine.gradnorm_kernel import supports

    lazy = torch.nn.LazyLinear(4)
    assert "lazy module" in supports(list(lazy.parameters()))
    lazy(torch.randn(2, 3))  # initialized: now only the device stands in the way
    assert "one CUDA device" in supports(list(lazy.parameters()))


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_the_kernels_compile_for_an_h100(dtype):
    """Triton's whole pipeline for sm_90, down to the cubin (its wheel carries ptxas; no
    GPU needed). The interpreter above runs the kernels' Python and never compiles it,
    so it does not see, for one, a name given two types in one function, which only
    the compiler refuses; on a GPU that refusal sends the run to the eager norm, slower
    and silent but for a debug log line."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from guardrails.engine import gradnorm_kernel as K

    h100 = GPUTarget("cuda", 90, 32)
    table = {
        "addresses": "*i64",
        "numels": "*i64",
        "item_param": "*i32",
        "item_start": "*i64",
        "partials": "*fp32",
        "first": "i32",
        "finished": "*i32",
        "n_total": "i32",
        "norm": "*fp32",
        "CHUNK": "constexpr",
        "BLOCK": "constexpr",
        "DTYPE": "constexpr",
    }
    constexprs = {
        "CHUNK": K.CHUNK,
        "BLOCK": K.BLOCK,
        "DTYPE": getattr(
            triton.language, {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype]
        ),
    }
    flat = {"x": f"*{dtype}", "numel": "i64", "chunk": "i64", "partials": "*fp32"}
    flat["BLOCK"] = "constexpr"
    for fn, signature, consts in (
        (K._sum_of_squares, table, constexprs),
        (K._flat_sum_of_squares, flat, {"BLOCK": K.BLOCK}),
    ):
        compiled = triton.compile(
            ASTSource(fn=fn, signature=signature, constexprs=consts),
            target=h100,
            options=K._OPTIONS,
        )
        assert compiled.asm["cubin"], fn
