"""Finite steps judged for spikes, in blocks: the spike rule (``spikes.py``) applied to
the run's grad norms and losses, and the ``spike`` events.

The statistics live on the host, not the device: the values are there anyway (lagged
on CUDA), so they cost no kernel, and a block of ``check_every_n_steps`` steps costs
one numpy median per metric instead of one per step.
"""

from __future__ import annotations

import math
from collections import deque
from operator import itemgetter
from typing import TYPE_CHECKING, Any

from guardrails.guards.nan import messages
from guardrails.guards.nan.spikes import SCALE_SHARE, _Series, _spikes

if TYPE_CHECKING:
    from guardrails.engine.guard import Guard

#: A judged row: (step, loss, grad norm, lr).
Row = tuple[int, float, float, float]


class SpikeJudge:
    """The grad norms' and losses' running statistics, the spikes seen and their
    events (at most ``max_events`` per metric per run)."""

    def __init__(
        self,
        *,
        window_steps: int,
        spike_factor: float,
        loss_spike_factor: float,
        max_events: int,
    ) -> None:
        self._window = window_steps
        self._factors = {"grad_norm": spike_factor, "loss": loss_spike_factor}
        self._max_events = max_events
        #: Spikes seen (the last 1000): (step, "grad_norm" | "loss", value, median).
        self.spikes: deque[tuple[int, str, float, float]] = deque(maxlen=1000)
        self._events = {"grad_norm": 0, "loss": 0}

    def start(self) -> None:
        """A run starts: the grad norms and (observed) losses of the last
        ``window_steps`` finite steps, for the running medians."""
        self.norms = _Series(self._window, SCALE_SHARE["grad_norm"])
        self.losses = _Series(self._window, SCALE_SHARE["loss"])

    def judge(self, guard: Guard, rows: list[Row], *, ranks_rms: bool) -> None:
        """Spike checks for finite steps not judged yet, against the statistics of the
        steps before them; then their values join the statistics. ``ranks_rms``: the
        grad norm is the root mean square of the ranks' (its events say so)."""
        found_now: list[tuple[int, str, float, float, float]] = []
        for col, kind, series in ((2, "grad_norm", self.norms), (1, "loss", self.losses)):
            values = list(map(itemgetter(col), rows))
            found = _spikes(
                series.values, values, self._factors[kind], series.swing, series.floor()
            )
            found_now += [(rows[i][0], kind, values[i], m, t) for i, m, t in found]
            # NaN: no loss seen; an Inf loss with finite grads is not a level to judge by
            series.extend(list(filter(math.isfinite, values)))
        for step, kind, value, median, threshold in sorted(found_now):
            # A lone one-step spike that comes straight back is a hard batch, not an
            # instability (a converged classifier meeting one misclassified sample: its
            # grad norm 60x its median for one step); it is an info event. It is a
            # warning when it repeats within window_steps, or when the loss and the grad
            # norm jump at the same step.
            both = any(s == step and k != kind for s, k, *_ in found_now)
            again = any(k == kind and step - self._window <= s < step for s, k, *_ in self.spikes)
            self.spikes.append((step, kind, value, median))
            lone = not (both or again)
            self._event(guard, step, kind, value, median, threshold, lone=lone, ranks_rms=ranks_rms)

    def _event(
        self,
        guard: Guard,
        step: int,
        kind: str,
        value: float,
        median: float,
        threshold: float,
        *,
        lone: bool,
        ranks_rms: bool,
    ) -> None:
        n = self._events[kind] = self._events[kind] + 1
        if n > self._max_events:
            return
        what = kind
        if kind == "grad_norm" and ranks_rms:
            what = f"grad_norm (root mean square of the {guard.world_size} ranks')"
        guard.event(
            "spike",
            level="info" if lone else "warning",
            message=messages.spike(
                what,
                kind,
                step,
                value,
                median,
                threshold,
                factor=self._factors[kind],
                clips=bool(guard.clip_norm_steps),
                lone=lone,
                last=n == self._max_events,
            ),
            step=step,
            metric=kind,
            value=value,
            median=median,
            threshold=threshold,
        )

    def state_dict(self) -> dict[str, Any]:
        """The statistics a resumed run needs to judge spikes as the first run would."""
        return {
            "norms": list(self.norms.values),
            "losses": list(self.losses.values),
            "scales": [self.norms.scale, self.losses.scale],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.norms.extend(state.get("norms", []))
        self.losses.extend(state.get("losses", []))
        scales = state.get("scales")
        if scales:  # else: a checkpoint from before it, the first saved values'
            self.norms.scale, self.losses.scale = scales
