"""Steps a GradScaler left out itself: its calibration, told apart from a fault.

A GradScaler skips a step whose fp16 gradients overflowed at its scale and lowers the
scale: a few at the start while the scale calibrates, then about one per
``growth_interval`` steps when it tries a higher one. That is an info event. A skipped
step whose loss or forward-written buffer is non-finite is a fault (NanGuard treats it
as any non-finite step), and a scaler that skips on and on while its scale collapses is
an error: the gradients are not finite at any scale.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from guardrails.guards.nan import messages

if TYPE_CHECKING:
    from guardrails.engine.guard import Guard


def skip_scale(guard: Guard) -> float:
    """The scale a GradScaler's skipped step overflowed at (it halves it in update()):
    one host read, on skipped steps only, after the scaler's own read of its flag."""
    scaler = guard.skip_scaler
    return math.nan if scaler is None else float(scaler.get_scale())


class ScalerSkips:
    """The steps a GradScaler skipped, their events (at most ``max_events``), and the
    error when ``max_consecutive_skips`` in a row come with a collapsed scale."""

    def __init__(self, *, policy: str, max_events: int, max_consecutive_skips: int) -> None:
        self._policy = policy
        self._max_events = max_events
        self._max_streak = max_consecutive_skips
        #: Steps a GradScaler skipped itself (its gradients overflowed at its scale).
        self.steps: list[int] = []
        self._streak: list[int] = []

    def is_fault(self, guard: Guard, *, loss: bool) -> bool:
        """A step its GradScaler skipped is a fault, not the scaler's calibration: its
        loss (``loss``: the guard's step, whose loss it is) or a buffer its forwards
        wrote (BatchNorm's statistics) is NaN/Inf. An fp16 overflow happens in the
        backward, at a finite loss, and leaves the forward's statistics finite; a NaN
        batch makes both non-finite. Host reads on scaler-skipped steps only (a few at
        the start, then about one per ``growth_interval`` steps), after the scaler's own
        read of its flag. Not with ``policy="warn"``: the scaler's skips as before."""
        if self._policy == "warn":
            return False
        value = guard.step_loss if loss else None
        if value is not None and not math.isfinite(value.item()):
            return True
        return bool(guard.nonfinite_buffers())

    def skipped(self, guard: Guard, step: int, scale: float) -> None:
        """A scaler-skipped step reached the host: an info event, and an error when the
        scaler skips on and on while its scale collapses (a NaN, not an overflow)."""
        self.steps.append(step)
        streak = self._streak
        if streak and streak[-1] != step - 1:
            streak.clear()
        streak.append(step)
        n = len(self.steps)
        if n <= self._max_events:
            guard.event(
                "scaler_skip",
                step=step,
                cause="fp16_overflow",
                scale=scale,
                message=messages.scaler_skip(step, scale, last=n == self._max_events),
            )
        if (
            self._policy != "warn"
            and len(streak) >= self._max_streak
            and scale == scale
            and scale < 1.0
        ):
            raise messages.scaler_collapse(streak, scale, rank=guard.rank)
