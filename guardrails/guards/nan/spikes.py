"""The spike rule: a loss or grad norm judged against the median of the steps just before
it and the metric's own usual step-to-step swing.
"""

from __future__ import annotations

import math
from collections import deque
from itertools import islice
from operator import sub
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable


#: A value is judged against the median of this many finite values just before it
#: (its trend). Twenty steps can tell a spike from noise, and follow a trend: a grad
#: norm climbing 3% a step (20x over 100 steps) sits 1.4x over the median of its last
#: 20, where 5x the median of the last 100 (as of its block) would see it at 4.4-5.7x
#: and flag the climb.
TREND_STEPS = 20


#: ...and it must also clear the trend by this many times the metric's usual
#: step-to-step swing (a robust standard deviation of the change of log(value) from
#: one step to the next, over ``window_steps``; a trend barely moves it). On 45 healthy
#: CPU runs (57,700 steps: nanochat, the README example, MLP classifiers, 2-16 sample
#: regressions on pure noise) ``factor`` times the 100-step median flagged 393 steps,
#: the 20-step median alone 449 (small-batch noise), with 4 swings 0 and with 3.5
#: swings 3; 5 keeps a margin and still catches a 10x grad-norm jump in every
#: language-model run tried (nanochat and the README example's GPT, on CPU).
SPIKE_SWINGS = 5.0


#: ...and it must reach this share of the run's own scale (the median of the metric's
#: first ``TREND_STEPS`` finite values): a ratio alone flags noise on a value that has
#: fallen far (a loss at 1e-7 whose 1e-5 bump is 100x its median and nothing against
#: the 1.0 it started from; a small-batch loss down at 0.08 whose one-step excursion to
#: 0.34, 4.4x, stays far under where it started). A loss spike must take the loss back
#: to its early level (the run lost what it learned: a language model at 3, started at
#: 10.8, jumping to 12); a jump from the loss's usual level while it is still there is
#: always one. A grad norm, whose spikes are the early warning of an instability, needs
#: a twentieth of its early level: a norm of 0.3 (8 at the start) jumping to 3 passes,
#: a converged regression's norm of 1e-3 bumping to 1e-2 (against 1) does not.
SCALE_SHARE = {"grad_norm": 0.05, "loss": 1.0}


def _spikes(
    window: deque[float],
    values: list[float],
    factor: float,
    swing: Callable[[], float] | None = None,
    floor: float = 0.0,
) -> list[tuple[int, float, float]]:
    """``(index, median, threshold)`` of each spike among ``values`` (a block of steps,
    in order, just after ``window``): a value over ``threshold``, the median of the
    ``TREND_STEPS`` finite values just before it times ``factor``, or times
    ``SPIKE_SWINGS`` step-to-step swings where the metric (over ``window``) is noisier.
    Nothing is judged before ``TREND_STEPS`` values, nor while a value <= 0 is in the
    window (a loss that can be zero or negative has no "x times its median").

    In log space: a ratio is a distance, and a grad norm's noise is multiplicative.
    A block with no value over ``factor`` times the lowest value around it cannot hold
    a spike and costs ~2 us a metric (a CPU host; every block of the nanochat and
    README-example runs): the swing is measured only for the others (~18 us), and a
    value's own median only where it clears the bar over that lowest value. ``swing``:
    the window's median step-to-step move, from :class:`_Series`, which keeps it up to
    date (the same number, half the cost). ``floor``: the least value a spike has
    (:data:`SCALE_SHARE` of the run's scale, from :meth:`_Series.floor`); the threshold
    is the higher of ``bar`` x the median and ``floor``."""
    n = len(window)
    if n < TREND_STEPS:
        return []
    recent = list(islice(window, n - TREND_STEPS, n))
    # No median of these values and the block's is lower. min() and max() compare as
    # `value < lowest` / `value > cut` would, from a finite first value: NaN never wins.
    lowest = min(min(recent), *values)
    cut = factor * lowest
    if not max(cut, *values) > cut or min(window) <= 0:
        return []
    # The median absolute change of log(value) from one step to the next, as the
    # standard deviation of one step's noise (x 1.4826 / sqrt 2, were it Gaussian and
    # independent): a trend adds only its slope, a 3%/step climb 0.03.
    if swing is None:
        logs = list(map(math.log, window))
        moves = sorted(map(abs, map(sub, logs[1:], logs)))
        move = moves[len(moves) // 2]
    else:
        move = swing()
    bar = max(factor, math.exp(SPIKE_SWINGS * 1.0483 * move))
    if not max(bar * lowest, *values) > bar * lowest:
        return []  # no value clears the bar over the lowest, so none is a spike
    out = []
    for i, value in enumerate(values):
        if value > bar * lowest:
            median = sorted(recent[-TREND_STEPS:])[TREND_STEPS // 2]
            threshold = max(bar * median, floor)
            if value > threshold:
                out.append((i, median, threshold))
        if not -math.inf < value < math.inf:
            continue  # NaN: no loss seen; an Inf loss with finite grads is no level
        if value <= 0:
            break  # in the window of the values after it: those are not judged
        recent.append(value)
    return out


class _Series:
    """A metric's last finite values (:attr:`values`, the spike rule's window) and, for
    :func:`_spikes`, the median absolute change of log(value) from one value to the
    next (:meth:`swing`), kept up to date as values arrive.

    Recomputed from the window (100 logs, 99 moves, a sort), the swing costs ~13 us a
    block (a CPU host, warm; more in the loop), paid in every block of the
    benchmark's tiny regression, whose noisy loss clears the first cut each time; here
    each value's log and move are computed once, when first needed, and a block pays for
    its 10 new ones and the sort (~6 us). The numbers are the same: the same
    ``math.log`` of the same values, the same differences."""

    __slots__ = ("_logs", "_moves", "_new", "scale", "share", "values")

    def __init__(self, window_steps: int, share: float = 0.0) -> None:
        self.values: deque[float] = deque(maxlen=window_steps)
        #: The run's scale: the median of its first ``TREND_STEPS`` finite values (kept
        #: in checkpoints: a resumed run judges by its first run's); ``None`` before.
        self.scale: float | None = None
        self.share = share
        self._logs: deque[float] = deque(maxlen=window_steps)
        self._moves: deque[float] = deque(maxlen=max(window_steps - 1, 0))
        self._new = 0  # values at the end of the window whose log is not taken yet

    def extend(self, values: list[float]) -> None:
        self.values.extend(values)
        self._new = min(self._new + len(values), len(self.values))
        if self.scale is None and len(self.values) >= TREND_STEPS:
            self.scale = sorted(islice(self.values, TREND_STEPS))[TREND_STEPS // 2]

    def floor(self) -> float:
        """The least value a spike has: ``share`` of the run's scale."""
        scale = self.scale
        return 0.0 if scale is None or not scale > 0 else self.share * scale

    def swing(self) -> float:
        """The median (the upper one) of ``abs(log(v[k + 1]) - log(v[k]))`` over the
        window; every value in it must be > 0."""
        new, values, logs, moves = self._new, self.values, self._logs, self._moves
        if new:
            if new == len(values):  # all of it: the logs kept are of values gone
                logs.clear()
                moves.clear()
            previous = logs[-1] if logs else None
            for x in map(math.log, islice(values, len(values) - new, None)):
                if previous is not None:
                    moves.append(abs(x - previous))
                logs.append(x)
                previous = x
            self._new = 0
        ordered = sorted(moves)
        return ordered[len(ordered) // 2]
