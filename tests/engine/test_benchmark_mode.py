"""guard(..., benchmark=True): the in-loop benchmark table, and training unchanged."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import Regressor, batches, read_events, train_loop

import guardrails
from guardrails.engine.benchmark_mode import BLOCK_STEPS, WARMUP_STEPS


def _train(run_dir, n_steps, **knobs):
    torch.manual_seed(0)
    model = Regressor()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with guardrails.guard(
        model, opt, batches(n_steps), run_dir=run_dir, progress=False, **knobs
    ) as g:
        train_loop(g, model, opt)
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


@pytest.mark.parametrize("lagged", [False, True], ids=["cpu_path", "lagged_path"])
def test_bypassed_hooks_leave_the_other_components_rows_exact(tmp_path, monkeypatch, lagged):
    """NanGuard and telemetry share one row per step (the engine's step ring); on a step
    where benchmark mode bypasses one of them, the other still writes the row. Each
    reads back exactly its own steps' values: the metrics of a benchmark-mode run are
    those of the plain guarded run, bitwise, on every step it recorded."""
    monkeypatch.setattr(guardrails.NanGuard, "_lagged_on_cpu", lagged)
    n = WARMUP_STEPS + 12 * BLOCK_STEPS
    _train(tmp_path / "plain", n, metrics={"every_n_steps": 7})
    _, g = _train(tmp_path / "bench", n, benchmark=True, metrics={"every_n_steps": 7})
    plain = guardrails.read_metrics(tmp_path / "plain").to_pydict()
    bench = guardrails.read_metrics(tmp_path / "bench").to_pydict()
    by_step = {s: i for i, s in enumerate(plain["step"])}
    assert len(bench["step"]) < n  # some rows bypassed
    for col in ("loss", "grad_norm", "skipped"):
        assert bench[col] == [plain[col][by_step[s]] for s in bench["step"]], col
    # NanGuard judged each step it saw with that step's values (its finite history).
    nan = g.component("nan")
    assert [r[0] for r in nan.history] == sorted(r[0] for r in nan.history)
    for step, loss, norm, _ in nan.history:
        assert (loss, norm) == (
            pytest.approx(plain["loss"][by_step[step]], rel=1e-7),
            pytest.approx(plain["grad_norm"][by_step[step]], rel=1e-7),
        )


def test_benchmark_mode_too_short_says_so(tmp_path):
    _train(tmp_path, 10, benchmark=True)
    [event] = [e for e in read_events(tmp_path) if e["kind"] == "benchmark"]
    assert "needs more steps" in event["message"]
    assert not (tmp_path / "benchmark.json").exists()
