"""guard(..., benchmark=True): the in-loop benchmark table, and training unchanged."""

from __future__ import annotations

import json

import torch
from conftest import Regressor, batches, read_events

import guardrails
from guardrails._benchmark_mode import BLOCK_STEPS, WARMUP_STEPS


def _train(run_dir, n_steps, **knobs):
    torch.manual_seed(0)
    model = Regressor()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with guardrails.guard(
        model, opt, batches(n_steps), run_dir=run_dir, progress=False, **knobs
    ) as g:
        for x, y in g:
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
    return model, g


def test_benchmark_mode_writes_a_table_and_leaves_training_unchanged(tmp_path):
    n = WARMUP_STEPS + 12 * BLOCK_STEPS
    plain, _ = _train(tmp_path / "plain", n)
    measured, _ = _train(tmp_path / "bench", n, benchmark=True)
    # Bypassing skips checks and records, never math: bitwise the same weights.
    for a, b in zip(plain.parameters(), measured.parameters(), strict=True):
        assert torch.equal(a, b)
    table = json.loads((tmp_path / "bench" / "benchmark.json").read_text())
    assert table["timing"] == "perf_counter"
    assert table["samples"] == {"guarded": 12, "bypassed": 12}
    assert table["guarded_ms"] > 0 and table["bypassed_ms"] > 0
    lo, hi = table["overhead_ci_ms"]
    assert lo <= table["overhead_ms"] <= hi and table["resolved"] == (not lo <= 0 <= hi)
    # Every optional component with per-step hooks is costed; the checkpointer never
    # bypassed (its saves and signal agreements must happen on their steps).
    assert {"nan", "telemetry", "gc", "memory"} <= set(table["components"])
    assert "checkpoint" not in table["components"]
    assert sum(c["samples"] for c in table["components"].values()) == 12
    [event] = [e for e in read_events(tmp_path / "bench") if e["kind"] == "benchmark"]
    assert "guard overhead in this loop" in event["message"] and "95% interval" in event["message"]
    # The bypassed steps have no telemetry row (that is what bypassed means): the 12
    # with every hook bypassed and those with only telemetry's.
    rows = guardrails.read_metrics(tmp_path / "bench").to_pydict()["step"]
    assert len(rows) == n - 12 - table["components"]["telemetry"]["samples"]
    assert WARMUP_STEPS + 10 not in rows and WARMUP_STEPS + 5 in rows


def test_benchmark_mode_too_short_says_so(tmp_path):
    _train(tmp_path, 10, benchmark=True)
    [event] = [e for e in read_events(tmp_path) if e["kind"] == "benchmark"]
    assert "needs more steps" in event["message"]
    assert not (tmp_path / "benchmark.json").exists()
