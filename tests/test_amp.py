"""Mixed precision loops with a GradScaler: a step the scaler skips (its gradients
overflowed) is a skipped step of its own, recorded as such, and never a false alarm.

Real GradScaler on CPU (``torch.amp.GradScaler("cpu")``), a real non-fused optimizer,
so the scaler really leaves ``optimizer.step()`` out on an overflow. The overflows are
planted by scaling the loss past float32's range on chosen iterations, which is what a
too-high loss scale does to fp16 gradients.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import Regressor, batches

import guardrails

STEPS = 16
OVERFLOW_AT = (3, 7, 8)  # 1-based iterations whose gradients overflow
INIT_SCALE = 2.0**100  # * 2**40 on the planted iterations: past float32's 3.4e38


def _train(loader, model, opt, scaler, *, on_iteration=lambda: None):
    losses = []
    for i, (x, y) in enumerate(loader, 1):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x, y)
        losses.append(loss.item())
        if i in OVERFLOW_AT:
            loss = loss * 2.0**40
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        on_iteration()
    return losses


def _setup():
    torch.manual_seed(0)
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    return model, opt, scaler


def _events(run_dir):
    return [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]


def test_scaler_skipped_steps_are_skipped_rows_and_info_events(tmp_path):
    # The plain loop: what the scaler does without any guard.
    model0, opt0, scaler0 = _setup()
    scales0: list[float] = []
    losses0 = _train(
        batches(STEPS),
        model0,
        opt0,
        scaler0,
        on_iteration=lambda: scales0.append(scaler0.get_scale()),
    )

    model, opt, scaler = _setup()
    scales: list[float] = []
    with guardrails.guard(
        model, opt, batches(STEPS), run_dir=tmp_path, scaler=scaler, progress=False
    ) as g:
        _train(g, model, opt, scaler, on_iteration=lambda: scales.append(scaler.get_scale()))
    # Every iteration is a step: a skipped one is not merged into the next.
    assert g.step == STEPS
    # The guard changed nothing the scaler did: same scales, bitwise the same weights.
    assert scales == scales0 and scales[2] == INIT_SCALE / 2
    for a, b in zip(model.parameters(), model0.parameters(), strict=True):
        assert torch.equal(a, b)
    rows = {r["step"]: r for r in guardrails.read_metrics(tmp_path).to_pylist()}
    assert sorted(rows) == list(range(1, STEPS + 1))
    assert sorted(s for s, r in rows.items() if r["skipped"]) == list(OVERFLOW_AT)
    # Each row's loss is its own iteration's, a skipped one's too (not an average of two).
    assert [rows[s]["loss"] for s in sorted(rows)] == pytest.approx(losses0, rel=1e-6)
    events = _events(tmp_path)
    skips = [e for e in events if e["kind"] == "scaler_skip"]
    assert [e["step"] for e in skips] == list(OVERFLOW_AT)
    assert all(e["level"] == "info" and e["cause"] == "fp16_overflow" for e in skips)
    assert "GradScaler skipped" in skips[0]["message"] and "lowers its scale" in skips[0]["message"]
    # The scaler's normal calibration is not a fault: no warning of any kind, but the
    # host's own: bf16_on_cpu, on a CPU without native bf16 (an AMD EPYC without
    # avx512_bf16), is about the autocast, right there, and silent elsewhere.
    assert [e for e in events if e["level"] != "info" and e["kind"] != "bf16_on_cpu"] == []


def test_a_scaler_that_skips_every_step_is_an_error(tmp_path):
    """Non-finite gradients at every scale (a NaN, not an overflow): the scaler would
    halve its scale forever and train nothing; the guard raises once the scale has
    collapsed, naming the cause."""
    model, opt, scaler = _setup()
    try:
        with guardrails.guard(
            model, opt, batches(200), run_dir=tmp_path, scaler=scaler, progress=False
        ) as g:
            for x, y in g:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = model(x, y) * float("nan")
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
    except guardrails.NonFiniteError as exc:
        assert exc.cause == "fp16_overflow"
        assert "GradScaler skipped" in str(exc) and "in a row" in str(exc)
        assert "scale" in str(exc)
    else:
        raise AssertionError("no NonFiniteError")
    assert g.step < 200


def test_a_scaler_not_given_to_the_guard_is_found_and_named(tmp_path):
    """A scaler the guard was not given still has its skips recorded, and the user is
    told its scale is not in the checkpoints (a resumed run would recalibrate)."""
    model, opt, scaler = _setup()
    with guardrails.guard(model, opt, batches(STEPS), run_dir=tmp_path, progress=False) as g:
        _train(g, model, opt, scaler)
    assert g.step == STEPS
    events = _events(tmp_path)
    assert [e["step"] for e in events if e["kind"] == "scaler_skip"] == list(OVERFLOW_AT)
    warned = [e for e in events if e["kind"] == "scaler_not_saved"]
    assert len(warned) == 1 and "guard(..., scaler=scaler)" in warned[0]["message"]
    # GradScaler.step is torch's own again after the guard closed.
    assert torch.amp.GradScaler.step.__module__ == "torch.amp.grad_scaler"
