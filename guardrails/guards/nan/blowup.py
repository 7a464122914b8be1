"""An optimization blow-up, read from the run's own history before its first non-finite
step: an LR jump, an update far larger than the run's own, a grad-norm climb, a loss
spike. Each is named with its numbers and the step it started; the LR first, since it
is the likeliest cause and the one to fix ("LR too high / no warmup" is the playbooks'
first line for NaNs).

Each signal is judged against the run's own range, never a fixed scale:

* the LR: a step whose LR is over ``LR_JUMP`` times the highest LR of every step before
  it in the window. A warmup never qualifies (its LR grows by at most 2x a step after
  its first nonzero one), nor a decay, a cosine restart (back to a peak seen before) or
  a step schedule's drop.
* the update (``updates.py``'s sampled ``||dw|| / ||w||``): a sample over ``UPDATE_JUMP``
  times the median of the samples before it, or the weights' move since the last sample
  over ``UPDATE_JUMP`` times that median per step (a move cannot be larger than the sum
  of its steps, so this is conservative).
* the grad norm and the loss: a step over the spike rule's bar (``spike_factor`` /
  ``loss_spike_factor`` times the median of the steps before it, raised where the metric
  swings more from step to step; ``spikes.py``).

Only what started within ``RECENT_STEPS`` steps before the first non-finite step counts:
a blow-up runs its course in a few steps (nanoGPT with its LR set to 1e4: 2 steps from
the jump to the NaN), and an older event is no evidence about this one.
"""

from __future__ import annotations

import math
import statistics
from itertools import pairwise
from typing import Any

from guardrails.guards.nan.spikes import SPIKE_SWINGS

#: An LR over this many times the highest LR before it (in the window) is a jump.
LR_JUMP = 10.0
#: An update over this many times the run's median update is far outside its range.
UPDATE_JUMP = 10.0
#: The evidence must start within this many steps before the first non-finite step.
RECENT_STEPS = 20
#: A grad norm or loss is judged against at least this many finite steps before it.
MIN_BASELINE = 5
#: Update samples needed before one is judged (with every=10: 30 steps).
MIN_UPDATE_SAMPLES = 3


def evidence(
    history: list[tuple[int, float, float, float]],
    *,
    step: int,
    loss: float,
    norm: float,
    lr: float,
    updates: list[tuple[int, float]],
    drift: tuple[int, int, float] | None,
    spike_factor: float,
    loss_spike_factor: float,
) -> dict[str, Any] | None:
    """The blow-up before non-finite ``step``, from ``history`` (``(step, loss, grad
    norm, lr)`` of the finite steps before it, oldest first), the step's own values,
    the sampled ``updates`` (``(step, ratio)``) and the weights' ``drift`` since the last
    sample. ``None`` when nothing is outside the run's range; else ``text`` (the
    sentence), ``evidence`` (the numbers) and ``lr_jump`` (whether the LR jumped)."""
    since = step - RECENT_STEPS
    found: dict[str, Any] = {}
    parts: list[str] = []

    def before(s: int) -> str:
        n = step - s
        if n == 0:
            return "at the first non-finite step"
        return f"{n} step{'s' if n > 1 else ''} before the first non-finite step, {step}"

    steps = [h[0] for h in history] + [step]
    lrs = [h[3] for h in history] + [lr]
    jump = _lr_jump(steps, lrs, since)
    if jump is not None:
        at, prev, new = jump
        found["lr_jump"] = {"step": at, "from": prev, "to": new, "now": lr}
        parts.append(
            f"the learning rate jumped from {prev:.3g} to {new:.3g} at step {at}, {before(at)} "
            f"(over {LR_JUMP:g}x the highest LR before it"
            + (f"; {lr:.3g} at step {step}" if lr != new else "")
            + ")"
        )
    update = _update_jump(updates, drift, since)
    if update is not None:
        found["update"] = update
        parts.append(_update_text(update))
    for name, col, value, factor in (
        ("grad norm", 2, norm, spike_factor),
        ("loss", 1, loss, loss_spike_factor),
    ):
        values = [h[col] for h in history] + [value]
        rise = _rise(steps, values, factor, since)
        if rise is None:
            continue
        at, median, peak, peak_step = rise
        key = "grad_norm" if col == 2 else "loss"
        found[key] = {"step": at, "median": median, "peak": peak, "peak_step": peak_step}
        span = f"step {at}" if peak_step == at else f"steps {at}-{peak_step}"
        parts.append(
            f"the {name} rose from a median of {median:.3g} to {peak:.3g} ({span}, "
            f"{peak / median:.3g}x)"
        )
    if not parts:
        return None
    trend = ", ".join(f"{h[2]:.3g}" for h in history[-5:])
    return {
        "text": "; ".join(parts) + f" (grad norms of the last {min(len(history), 5)} finite "
        f"steps: {trend}; LR {lr:.3g} at step {step})",
        "evidence": found,
        "lr_jump": "lr_jump" in found,
    }


def _update_text(update: dict[str, Any]) -> str:
    """The sentence for an update outside the run's range: one sampled step's, or the
    weights' drift between two samples."""
    if update["kind"] == "sample":
        return (
            f"one step moved the weights by {update['ratio']:.3g} of their size at step "
            f"{update['step']}, {update['ratio'] / update['median']:.0f}x the run's median "
            f"update {update['median']:.3g}"
        )
    med = f"against a median of {update['median']:.3g} a step before"
    span = f"between step {update['from_step']} and step {update['to_step']}"
    moved = (
        "overflows float32"
        if math.isinf(update["ratio"])
        else f"is {update['ratio']:.3g}x their size"
    )
    return f"the weights' move {span} {moved}, {med}"


def _lr_jump(
    steps: list[int], lrs: list[float], since: int, *, lasting: bool = True
) -> tuple[int, float, float] | None:
    """``(step, previous LR, LR)`` of the first step from ``since`` on whose LR is over
    ``LR_JUMP`` times the highest finite LR of the steps before it, if the LR is still
    that high at the last step (``lasting``; else a one-step jump counts too)."""
    top = 0.0
    for i, (s, lr) in enumerate(zip(steps, lrs, strict=True)):
        if not math.isfinite(lr):
            continue
        if (
            s >= since
            and top > 0
            and lr > LR_JUMP * top
            and (not lasting or lrs[-1] > LR_JUMP * top)
        ):
            return s, lrs[i - 1] if i else top, lr
        top = max(top, lr)
    return None


def first_lr_jump(rows: list[tuple[int, float, float, float]], start: int) -> int | None:
    """The step of the first LR jump (the rule above, a one-step jump included) within
    ``RECENT_STEPS`` steps before trouble that showed at step ``start``, from the rows
    ``(step, loss, grad norm, lr)`` of the steps before it, oldest first: the update of
    that step may be the damage (a rewind goes back to before it); ``None`` if none."""
    rows = [r for r in rows if r[0] <= start]
    jump = _lr_jump([r[0] for r in rows], [r[3] for r in rows], start - RECENT_STEPS, lasting=False)
    return None if jump is None else jump[0]


def _update_jump(
    updates: list[tuple[int, float]], drift: tuple[int, int, float] | None, since: int
) -> dict[str, Any] | None:
    ratios = [r for _, r in updates]
    for i, (s, r) in enumerate(updates):
        if s < since or i < MIN_UPDATE_SAMPLES:
            continue
        median = statistics.median(ratios[:i])
        if median > 0 and r > UPDATE_JUMP * median:
            return {"kind": "sample", "step": s, "ratio": r, "median": median}
    if drift is None or len(ratios) < MIN_UPDATE_SAMPLES:
        return None
    first, last, ratio = drift
    median = statistics.median(ratios)
    if median > 0 and ratio > UPDATE_JUMP * median * (last - first):
        return {
            "kind": "drift",
            "from_step": first,
            "to_step": last,
            "ratio": ratio,
            "median": median,
        }
    return None


def _rise(
    steps: list[int], values: list[float], factor: float, since: int
) -> tuple[int, float, float, int] | None:
    """``(step, median, peak, peak step)``: the first step from ``since`` on over the
    spike rule's bar against the finite values before it (at least ``MIN_BASELINE``,
    all > 0), and the highest finite value from there on."""
    for i, (s, v) in enumerate(zip(steps, values, strict=True)):
        if s < since or i < MIN_BASELINE:
            continue
        base = [x for x in values[:i] if math.isfinite(x)]
        if len(base) < MIN_BASELINE or min(base) <= 0 or not math.isfinite(v):
            continue
        median = statistics.median(base)
        logs = [math.log(x) for x in base]
        move = statistics.median(abs(b - a) for a, b in pairwise(logs))
        bar = max(factor, math.exp(SPIKE_SWINGS * 1.0483 * move))
        if v > bar * median:
            tail = [(x, t) for x, t in zip(values[i:], steps[i:], strict=True) if math.isfinite(x)]
            peak, peak_step = max(tail)
            return s, median, peak, peak_step
    return None
