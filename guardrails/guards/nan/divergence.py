"""Divergence: a loss that jumps and stays up while every value is finite.

A spike (``spikes.py``) is one step; a divergence is a new, higher level: the median of
the last ``steps`` finite losses over the median of the steps before them (the rest of
the window, at least ``steps`` of them) by both

* ``factor`` times (the minimum effect: a healthy run's loss only falls over a window,
  save a data-mix change or a curriculum step, which raise it by less), and
* ``SPREAD_MADS`` times the loss's usual spread (the median absolute deviation of
  log(loss) over the reference steps, as a robust standard deviation): a noisy loss
  (small batches: 2-3x swings from one step to the next) needs a bigger move.

In log space, as the spike rule: a loss's noise is multiplicative. The medians make it
robust to single spikes (a spike is not a level: more than half of the last ``steps``
must be up) and the reference spans the window, so warmup's fall and an LR decay's
slow descent only ever lower the recent median under the reference. Judged in the
NanGuard's blocks (every ``check_every_n_steps`` steps), on the host values it has
anyway: two sorts of at most ``window_steps`` floats a block, ~1 us a step.

Reported once (a ``divergence`` warning with the step it started and the numbers); it
is armed again once the recent median is back under the bar.
"""

from __future__ import annotations

import math
from typing import Any

#: ...and over the reference's median by this many robust standard deviations of
#: log(loss) (1.4826 x its median absolute deviation).
SPREAD_MADS = 5.0


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


class Divergence:
    """Judges the loss of ``history`` (``(step, loss, grad norm, lr)``) for a
    divergence; :meth:`check` returns the event's fields once, when it starts."""

    def __init__(self, factor: float, steps: int) -> None:
        self.factor = factor
        self.steps = steps
        self.log_factor = math.log(factor)
        #: The divergence being reported (its event's fields); ``None``: armed.
        self.current: dict[str, Any] | None = None

    def check(self, history: Any) -> dict[str, Any] | None:
        rows = [(h[0], h[1], h[3]) for h in history if math.isfinite(h[1])]
        n = self.steps
        if len(rows) < 2 * n:
            return None
        losses = [r[1] for r in rows]
        if min(losses) <= 0:
            return None  # a loss that can be zero or negative has no "x times"
        logs = list(map(math.log, losses))
        ref, recent = logs[:-n], logs[-n:]
        center = _median(ref)
        spread = 1.4826 * _median([abs(x - center) for x in ref])
        bar = center + max(self.log_factor, SPREAD_MADS * spread)
        level = _median(recent)
        if level <= bar:
            self.current = None  # (back) under the bar: armed
            return None
        if self.current is not None:
            return None
        # Where it started: the first of the recent steps over the bar from which on
        # at least half of the values are over it.
        tail = rows[-n:]
        start = next(
            i
            for i in range(n)
            if logs[-n + i] > bar and 2 * sum(x > bar for x in recent[i:]) >= n - i
        )
        first = tail[start]
        lr_before = rows[-n - 1][2] if len(rows) > n else math.nan
        self.current = {
            "step": first[0],
            "value": math.exp(level),
            "median": math.exp(center),
            "threshold": math.exp(bar),
            "steps": n,
            "reference_steps": len(ref),
            "lr": first[2],
            "lr_before": lr_before,
        }
        return self.current
