"""Mixed precision loops with a GradScaler: a step the scaler skips (its gradients
overflowed) is a skipped step of its own, recorded as such, and never a false alarm.

Real GradScaler on CPU (``torch.amp.GradScaler("cpu")``), a real non-fused optimizer,
so the scaler really leaves ``optimizer.step()`` out on an overflow. The overflows are
planted by scaling the loss past float32's range on chosen iterations, which is what a
too-high loss scale does to fp16 gradients.
"""

from __future__ import annotations

import pytest
import torch
from conftest import Regressor, assert_state_equal, batches, read_events

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
    return read_events(run_dir)


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


# ---------------------------------------------------------------------- fp16 + BatchNorm


def _bn_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 1)
    )


def _bn_data(n, nan_at=None):
    g = torch.Generator().manual_seed(0)
    data = [
        (torch.rand(16, 4, generator=g) + 0.1, torch.randn(16, 1, generator=g)) for _ in range(n)
    ]
    if nan_at is not None:
        data[nan_at - 1][0][2, 1] = float("nan")  # sample row 2 of step nan_at's batch
    return data


def _fp16_bn_loop(loader, model, opt, scaler, *, overflow_at=(), seen=None, g=None, watch=None):
    """fp16 autocast (on the CPU too), the loss outside the model, a GradScaler;
    ``overflow_at``: steps whose scaled loss overflows (a finite loss: the scaler's
    calibration); ``seen``: the buffers before step ``watch``'s forward and after it."""
    for i, (x, y) in enumerate(loader, 1):
        if i == watch:
            seen["before"] = {k: v.clone() for k, v in model.named_buffers()}
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        loss = torch.nn.functional.mse_loss(out.float(), y)
        scaler.scale(loss * 2.0**40 if i in overflow_at else loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if i == watch:
            seen["after"] = {k: v.clone() for k, v in model.named_buffers()}


def test_fp16_scaler_overflow_is_silent_calibration_bitwise_plain(tmp_path):
    """A healthy fp16 + GradScaler + BatchNorm run whose scaler overflows (a finite loss)
    three times: the guarded run computes what the plain loop does, bitwise (the
    BatchNorm statistics of an overflowed step are kept, as the plain loop keeps them),
    and says nothing but the scaler's info events."""
    states = []
    for guarded in (False, True):
        model = _bn_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        # A scale fp16 gradients fit at, but not at 2**40 times the loss.
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        data = _bn_data(12)
        if guarded:
            with guardrails.guard(
                model, opt, data, run_dir=tmp_path, scaler=scaler, progress=False
            ) as g:
                _fp16_bn_loop(g, model, opt, scaler, overflow_at=OVERFLOW_AT)
            assert g.step == 12
        else:
            _fp16_bn_loop(data, model, opt, scaler, overflow_at=OVERFLOW_AT)
        states.append(({k: v.clone() for k, v in model.state_dict().items()}, scaler.get_scale()))
    assert_state_equal(states[0][0], states[1][0])  # BatchNorm statistics included
    assert states[0][1] == states[1][1]
    events = _events(tmp_path)
    assert [e["step"] for e in events if e["kind"] == "scaler_skip"] == list(OVERFLOW_AT)
    assert [e for e in events if e["level"] != "info"] == []


@pytest.mark.parametrize("lagged", [False, True], ids=["cpu_path", "lagged_path"])
def test_fp16_scaler_nan_batch_is_bad_data_and_batchnorm_is_put_back(tmp_path, monkeypatch, lagged):
    """A NaN in one batch's input under fp16 + GradScaler: the scaler skips the update
    (its gradients are NaN), but this is bad data, not an overflow: the nonfinite event
    names the sample, and the BatchNorm statistics the NaN forward wrote are put back."""
    monkeypatch.setattr(guardrails.NanGuard, "_lagged_on_cpu", lagged)
    model = _bn_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu")
    seen: dict = {}
    with guardrails.guard(
        model, opt, _bn_data(10, nan_at=4), run_dir=tmp_path, scaler=scaler, progress=False
    ) as g:
        _fp16_bn_loop(g, model, opt, scaler, seen=seen, watch=4)
    assert g.step == 10
    assert seen["before"].keys() == seen["after"].keys()
    for name, before in seen["before"].items():  # num_batches_tracked too
        assert torch.equal(seen["after"][name], before), name
    for name, b in model.named_buffers():
        assert torch.isfinite(b).all(), name
    model.eval()
    with torch.no_grad():
        assert torch.isfinite(model(torch.rand(4, 4))).all()
    events = _events(tmp_path)
    (ev,) = [e for e in events if e["kind"] == "nonfinite"]
    assert (ev["step"], ev["cause"], ev["samples"]) == (4, "bad_data", [2]), ev
    assert "1.running_mean" in ev["message"] and "put back" in ev["message"]
    assert 4 not in [e["step"] for e in events if e["kind"] == "scaler_skip"]
    assert [e["step"] for e in events if e["kind"] == "nonfinite_recovered"] == [5]
    assert not [e for e in events if e["kind"] == "nonfinite_buffers"]
