"""Training-health checks: parameters left out of the optimizer, parameters that never
receive a gradient, a loss that does not fall.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from guardrails.engine.guard import Guard


class _Health:
    """Training-health warnings for the usual "loss not decreasing" causes: optimizer
    params that never get a gradient, all-zero gradients, a loss that does not fall."""

    #: The first steps, each checked once for optimizer params without a gradient.
    CHECK_GRADS_STEPS = 2

    def __init__(self, window_steps: int) -> None:
        self._window = window_steps
        self._losses: list[float] = []
        self._flat_checked = False
        self._zero_warned = False
        self._no_grad: set[str] | None = None

    def after_step(self, guard: Guard, param_ids: set[int]) -> None:
        # The first steps only: optimizer params that received no gradient in any of
        # them. O(n_params) Python work, twice per run; nothing after.
        if guard.step > self.CHECK_GRADS_STEPS or guard.rank != 0:
            return
        now = {
            n
            for n, p in guard.model.named_parameters()
            if id(p) in param_ids and p.requires_grad and p.grad is None
        }
        self._no_grad = now if self._no_grad is None else self._no_grad & now
        if guard.step < self.CHECK_GRADS_STEPS or not self._no_grad:
            return
        names = [n for n, _ in guard.model.named_parameters() if n in self._no_grad]
        shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        guard.event(
            "params_without_grad",
            level="warning",
            message=(
                f"{len(names)} parameter(s) in the optimizer received no gradient in the "
                f"first {guard.step} steps: {shown}. They never train: the forward does not "
                "use them (a skipped branch, a detach(), a frozen sub-module feeding them), "
                "or zero_grad(set_to_none=True) ran between backward and step."
            ),
            params=names,
        )

    def observe(self, guard: Guard, rows: list[tuple[int, float, float, float]]) -> None:
        """Finite steps as (step, loss, norm, lr), in order."""
        zero = next((r[0] for r in rows if r[2] == 0.0), None)
        if zero is not None and not self._zero_warned:
            step = zero
            self._zero_warned = True
            guard.event(
                "zero_grads",
                level="warning",
                message=(
                    f"every gradient is exactly zero at step {step}: nothing trains. Check "
                    "that the loss depends on the parameters (no detach / no_grad in the "
                    "forward), and that zero_grad() runs before backward, not between "
                    "backward and step."
                ),
            )
        # Only the first window: "cannot learn at all" is the bug; a flat loss later
        # is convergence (or noise around it).
        if self._flat_checked:
            return
        self._losses.extend(r[1] for r in rows if not math.isnan(r[1]))
        if len(self._losses) < self._window:
            return
        step = rows[-1][0]
        losses = self._losses[: self._window]
        half = self._window // 2
        first = float(np.median(losses[:half]))
        second = float(np.median(losses[half:]))
        self._losses = []
        self._flat_checked = True
        if second >= first:
            guard.event(
                "loss_not_decreasing",
                level="warning",
                message=(
                    f"the loss did not decrease over steps {step - self._window + 1}-{step} "
                    f"(median {first:.4g} -> {second:.4g}). Try to overfit one batch "
                    "first (a model that cannot is wired wrong); check the LR (too low "
                    "crawls, too high bounces), label/mask wiring, and that the optimizer "
                    "holds the trainable parameters."
                ),
                first_half_median=first,
                second_half_median=second,
            )
