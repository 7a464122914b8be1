"""The grad norm's Triton kernels (guardrails/_gradnorm_kernel.py), run on CPU in
Triton's interpreter: their chunking, dtypes, missing gradients, NaN/Inf and the
fixed slots of DDP buckets, checked where CI runs. The compiled kernels, the guard's
use of them and their cost are tests/test_gpu.py's (an H100/H200)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="needs triton (the dev extra installs it on Linux x86_64; it ships with CUDA torch)",
)

WORKER = Path(__file__).resolve().parent / "kernel_worker.py"


@pytest.fixture(scope="module")
def out() -> dict:
    # A process of its own: TRITON_INTERPRET must be set before triton decorates the
    # kernels, and no other test should see interpreted kernels.
    got = subprocess.run(
        [sys.executable, str(WORKER)],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert got.returncode == 0, got.stderr[-3000:]
    return json.loads(got.stdout.splitlines()[-1])


def test_the_table_kernel_is_the_float64_norm_of_every_gradient_within_rounding(out):
    # One launch per dtype; 6 parameters each (1, 7, CHUNK - 1, CHUNK, CHUNK + 1 and
    # 2 CHUNK + 5 elements): 1 + 1 + 1 + 1 + 2 + 3 chunks. Parameters without a gradient
    # still get their programs (address 0: nothing read).
    assert out["launches"] == [["fp32", 9], ["bf16", 9], ["fp16", 9]]
    got, exact = out["table"]
    assert got == pytest.approx(exact, rel=1e-6)
    assert out["table_after"] == out["table"]  # planting and restoring changed nothing


def test_one_nan_or_inf_anywhere_makes_the_norm_non_finite(out):
    assert len(out["nonfinite"]) == 8
    for i, bad, norm in out["nonfinite"]:
        assert math.isnan(norm) if math.isnan(bad) else norm == math.inf, (i, bad, norm)


def test_bucket_partials_fill_fixed_slots_and_a_shrunk_bucket_leaves_no_stale_sum(out):
    got, exact = out["flat"]
    assert got == pytest.approx(exact, rel=1e-6)
    got, exact = out["flat_shrunk"]
    assert got == pytest.approx(exact, rel=1e-6)


def test_bucket_norms_whose_kernel_fails_to_launch_fill_the_same_slots_by_hand(out):
    got, exact, given_up = out["bucket_fallback"]
    assert got == pytest.approx(exact, rel=1e-6)
    assert given_up


def test_parameters_the_kernel_cannot_read_are_named():
    """The guard asks at its first step (not at start: a lazy module's parameters have
    no size before its first forward); any reason keeps the eager norm for the run."""
    import torch

    from guardrails._gradnorm_kernel import supports

    lazy = torch.nn.LazyLinear(4)
    assert "lazy module" in supports(list(lazy.parameters()))
    lazy(torch.randn(2, 3))  # initialized: now only the device stands in the way
    assert "one CUDA device" in supports(list(lazy.parameters()))
