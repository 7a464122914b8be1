"""Divergence: a loss that jumps and stays up while every value is finite.

A spike (``spikes.py``) is one step; a divergence is a new, higher level: the median of
the last ``steps`` finite losses over the median of the ``REFERENCE_MULTIPLE`` x
``steps`` finite steps before them (judged from ``steps`` of them on) by both

* ``factor`` times (the minimum effect: a healthy run's loss only falls over a window,
  save a data-mix change or a curriculum step, which raise it by less), and
* ``SPREAD_MADS`` times the loss's usual spread (the median absolute deviation of
  log(loss) over the reference steps, as a robust standard deviation): a noisy loss
  (small batches: 2-3x swings from one step to the next) needs a bigger move.

In log space, as the spike rule: a loss's noise is multiplicative. The medians make it
robust to single spikes (a spike is not a level: more than half of the last ``steps``
must be up) and the reference spans 80 steps (by default), so warmup's fall and an LR
decay's slow descent only ever lower the recent median under the reference. Judged in
NanGuard's blocks (every ``check_every_n_steps`` steps), on the host values it has
anyway: two sorts of at most 80 floats a block, ~1.5 us a step with the rows kept.

Reported once (a ``divergence`` warning with the step it started and the numbers); it
is armed again once the recent median is back under the bar.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from itertools import islice
from typing import Any

#: The reference is this many times ``steps`` finite steps before the recent ones.
REFERENCE_MULTIPLE = 4
#: ...and over the reference's median by this many robust standard deviations of
#: log(loss) (1.4826 x its median absolute deviation).
SPREAD_MADS = 5.0


def _median(xs: Iterable[float]) -> float:
    """The upper median (an element: the same one in log space, log being monotonic)."""
    s = sorted(xs)
    return s[len(s) // 2]


class Divergence:
    """Judges the loss for a divergence; :meth:`check` returns the event's fields once,
    when it starts. Keeps its own window: the last ``REFERENCE_MULTIPLE + 1`` times
    ``steps`` finite losses (with their steps and LRs)."""

    def __init__(self, factor: float, steps: int) -> None:
        self.factor = factor
        self.steps = steps
        self.log_factor = math.log(factor)
        size = (REFERENCE_MULTIPLE + 1) * steps
        #: The finite losses judged, oldest first, and their ``(step, loss, lr)`` rows.
        self.losses: deque[float] = deque(maxlen=size)
        self.rows: deque[tuple[int, float, float]] = deque(maxlen=size)
        #: The divergence being reported (its event's fields); ``None``: armed.
        self.current: dict[str, Any] | None = None

    def add(self, rows: list[tuple[int, float, float, float]]) -> None:
        """NanGuard's judged rows, ``(step, loss, grad norm, lr)``."""
        for step, loss, _, lr in rows:
            if -math.inf < loss < math.inf:
                self.losses.append(loss)
                self.rows.append((step, loss, lr))

    def check(self) -> dict[str, Any] | None:
        """The divergence that starts here, or ``None``. ~10 us a block (a CPU
        host) when the recent median is under ``factor`` times the reference's (every
        healthy block): two sorts of 20 and 80 floats."""
        n, losses = self.steps, self.losses
        total = len(losses)
        if total < 2 * n:
            return None
        level = _median(islice(losses, total - n, total))
        if not level > self.factor * _median(islice(losses, 0, total - n)):
            self.current = None  # under the bar (which is at least this): armed
            return None
        if self.current is not None or min(losses) <= 0:
            return None  # reported already; or a loss with no "x times" (<= 0)
        rows = list(self.rows)
        logs = [math.log(r[1]) for r in rows]
        ref, recent = logs[:-n], logs[-n:]
        center = _median(ref)
        spread = 1.4826 * _median([abs(x - center) for x in ref])
        bar = center + max(self.log_factor, SPREAD_MADS * spread)
        level = _median(recent)
        if level <= bar:
            return None
        # Where it started: the first of the recent steps over the bar from which on
        # at least half of the values are over it.
        start = next(
            (
                i
                for i in range(n)
                if recent[i] > bar and 2 * sum(x > bar for x in recent[i:]) >= n - i
            ),
            0,
        )
        first = rows[len(rows) - n + start]
        self.current = {
            "step": first[0],
            "value": math.exp(level),
            "median": math.exp(center),
            "threshold": math.exp(bar),
            "steps": n,
            "reference_steps": len(ref),
            "lr": first[2],
            "lr_before": rows[-n - 1][2],
        }
        return self.current

    def forget_after(self, step: int) -> None:
        """A rewind set the run back to ``step``: the losses of later steps are of a
        trajectory left behind, and the divergence they showed is over (armed again)."""
        rows = [r for r in self.rows if r[0] <= step]
        self.rows.clear()
        self.losses.clear()
        self.rows.extend(rows)
        self.losses.extend(r[1] for r in rows)
        self.current = None

    def state_dict(self) -> dict[str, Any]:
        return {"rows": [list(r) for r in self.rows], "current": self.current}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if not state:
            return
        self.add([(int(s), float(v), 0.0, float(lr)) for s, v, lr in state.get("rows", [])])
        self.current = state.get("current")
