"""What NanGuard says: its events' messages and its errors, in the user's terms.

Plain functions of the numbers they report (no state): the guard decides *when* to
speak (``guard.py``), these decide *what* it says.
"""

from __future__ import annotations

from typing import Any

from guardrails._errors import NonFiniteError
from guardrails.guards.nan.spikes import TREND_STEPS
from guardrails.util.text import shorten


def syncs_advice(optimizer: str, *, agrees: bool) -> str:
    """Why NanGuard reads the step's flag on the host before each update on a CUDA
    device, and the fix: ``agrees``, the ranks' gradients differ at ``step()`` (the
    flag is agreed between them); else ``optimizer`` (its class name) is not fused."""
    if agrees:
        return (
            "the ranks' gradients differ at optimizer.step() (no DDP: the "
            "optimizer reduces them itself), so NanGuard agrees on the non-finite "
            "flag on the host before each update: a host read of the step's flag "
            "and one small all-reduce (read back: it waits for that all-reduce) "
            "per step. Wrapping the model in DDP makes the gradients "
            "agree before the step and skipping free with a fused optimizer."
        )
    return (
        f"{optimizer} is not fused, so it cannot skip a non-finite "
        "update on the device: NanGuard reads the flag on the host before each "
        "update (one host sync per step, 2-7% of a GPT-2-small step). Build the "
        f"optimizer with fused=True (torch.optim.{optimizer}(..., "
        "fused=True) where supported) to make skipping free."
    )


def nonfinite(step: int, diag: dict[str, Any], *, policy: str) -> str:
    """A non-finite step, diagnosed (``diag``): what was done with its update and its
    buffers (``restored_buffers``: those put back), then why it happened."""
    what = {"skip": "skipped", "raise": "skipped", "warn": "NOT skipped (policy warn)"}
    put_back = diag.get("restored_buffers")
    restored = (
        " and the buffers its forward wrote put back as they were before it ("
        + shorten(put_back, 4)
        + ")"
        if put_back
        else ""
    )
    return (
        f"non-finite gradients at step {step}, update {what[policy]}{restored}: " + diag["message"]
    )


def buffers_not_recovered(whose: str, step: int, first: int, n: int, broken: list[str]) -> str:
    """Finite gradients again at ``step`` after ``n`` non-finite steps from ``first``,
    but buffers a forward writes (``broken``) hold a NaN or an Inf."""
    modules = sorted({b.rpartition(".")[0] or b for b in broken})
    return (
        f"{whose}the gradients are finite again at step {step} after {n} "
        f"non-finite step(s) from step {first}, but the model's buffers "
        f"{shorten(broken, 4)} (module(s) {shorten(modules, 4)}) "
        "hold NaN/Inf (written by a training forward of a "
        "non-finite step): the model is not recovered, and evaluations and "
        "saved weights are non-finite from here on. Resume from a checkpoint "
        "before that step, or reset those statistics (e.g. "
        "module.reset_running_stats() for BatchNorm) and re-estimate them."
    )


def divergence(found: dict[str, Any], *, factor: float, clips: bool) -> str:
    """A loss that jumped and stays up (``divergence.py``'s ``found``), with the likely
    cause: an LR jump when there was one, else the usual ones (``clips``: the loop
    clips the grad norm already, so that is not advised)."""
    step, lr, lr_before = found["step"], found["lr"], found["lr_before"]
    if lr == lr and lr_before == lr_before and lr > 2 * lr_before:
        why = (
            f"the LR went from {lr_before:.3g} to {lr:.3g} by step {step}: lower it or "
            "check the LR schedule"
        )
    else:
        why = (
            "the usual causes: an LR too high for this point of the run (lower the peak "
            "LR, lengthen the warmup"
            + ("" if clips else ", clip the grad norm")
            + "), or a run of bad batches from that step (look at the data there)"
        )
    return (
        f"the loss diverged from step {step}: the median of the last {found['steps']} "
        f"losses is {found['value']:.4g}, {found['value'] / found['median']:.1f}x the "
        f"median {found['median']:.4g} of the {found['reference_steps']} steps before "
        f"(over {found['threshold'] / found['median']:.1f}x: divergence_factor="
        f"{factor:g}, higher where the loss is noisier). Every value "
        f"is finite, so no step was skipped; {why}. If the data mix or the task "
        "changed at that step, a higher loss is expected: raise divergence_factor."
    )


def spike(
    what: str,
    kind: str,
    step: int,
    value: float,
    median: float,
    threshold: float,
    *,
    factor: float,
    clips: bool,
    lone: bool,
    last: bool,
) -> str:
    """A grad norm or loss (``kind``; ``what``: how to name it) far over its trend.
    ``lone``: one step that came straight back (harmless); ``last``: the last spike
    of its kind logged."""
    knob = "spike_factor" if kind == "grad_norm" else "loss_spike_factor"
    return (
        f"{what} {value:.4g} at step {step} is {value / median:.1f}x its running "
        f"median {median:.4g} (last {TREND_STEPS} steps; a spike here is over "
        f"{threshold / median:.1f}x: {knob}={factor:g}, higher where it swings more "
        "from step to step or has fallen far below its early level): "
        "often the early warning before a NaN. If they repeat: lower the LR, add "
        + (
            "warmup (the loop clips the grad norm already)."
            if clips
            else "warmup, clip the grad norm (g.clip_grad_norm_(1.0))."
        )
        + (
            " A lone one like this, that comes straight back with no NaN after it, "
            "is harmless (a hard batch)."
            if lone
            else f" Expected ones (a data mix that changes): raise {knob} to hear less of them."
        )
        + (
            f" (This is the last {kind} spike logged; later ones are counted in NanGuard.spikes.)"
            if last
            else ""
        )
    )


def streak_error(
    diag: dict[str, Any],
    streak: list[int],
    *,
    policy: str,
    max_consecutive_skips: int,
    optimizer: str | None,
    rank: int,
) -> NonFiniteError:
    """The error that ends a run: the first non-finite step (``policy="raise"``) or a
    streak of ``max_consecutive_skips`` skipped steps, with the first one's diagnosis."""
    whose = "" if optimizer is None else f" of optimizer {optimizer!r}"
    if policy == "raise":
        head = f"non-finite gradients{whose} at step {streak[0]} (update skipped). "
    else:
        head = (
            f"{len(streak)} optimizer steps{whose} in a row had non-finite gradients "
            f"(steps {streak[0]}-{streak[-1]}, all skipped; max_consecutive_skips="
            f"{max_consecutive_skips}). First one: "
        )
    return NonFiniteError(
        f"{head}[{diag.get('cause')}] {diag.get('message', '')}",
        rank=rank,
        step=streak[0],
        hint=diag.get("hint"),
        cause=diag.get("cause"),
        skipped_steps=list(streak),
        batch_path=diag.get("path"),
        module=diag.get("module"),
        samples=diag.get("samples"),
    )


def scaler_skip(step: int, scale: float, *, last: bool) -> str:
    """A GradScaler skipped ``step`` itself: its normal calibration."""
    return (
        f"GradScaler skipped step {step}: the fp16 gradients overflowed at "
        f"scale {scale:g}, so it left the update out and lowers its scale (its "
        "normal calibration, not a fault)"
        + (" (the last one logged; later ones: NanGuard.scaler_skips)" if last else "")
    )


def scaler_collapse(streak: list[int], scale: float, *, rank: int) -> NonFiniteError:
    """A GradScaler skipped ``streak`` in a row while its scale fell under 1: not an
    overflow, a NaN or an Inf."""
    return NonFiniteError(
        f"GradScaler skipped {len(streak)} steps in a row (steps {streak[0]}-"
        f"{streak[-1]}) and its scale fell to {scale:g}: the gradients are not "
        "finite at any scale, so this is not an fp16 overflow but a NaN or Inf in "
        "the loss or the model (or gradients beyond fp16's range even unscaled).",
        hint=(
            "check the loss and the data of those steps; run a few steps in "
            "float32 (no autocast, no scaler) to see where the first NaN comes "
            "from, or use bfloat16, which needs no scaler"
        ),
        cause="fp16_overflow",
        step=streak[0],
        rank=rank,
    )
