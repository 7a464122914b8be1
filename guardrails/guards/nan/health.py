"""Training-health checks: parameters left out of the optimizer, parameters that never
receive a gradient, a loss that does not fall, gradients never reset between steps.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from torch import Tensor

    from guardrails.engine.guard import Guard
    from guardrails.guards.nan.updates import UpdateSampler


class _Health:
    """Training-health warnings for the usual "loss not decreasing" causes: optimizer
    params that never get a gradient, all-zero gradients, a loss that does not fall."""

    #: The first steps, each checked once for optimizer params without a gradient.
    CHECK_GRADS_STEPS = 2
    #: Update samples needed over the first window to say the weights did not move (a
    #: window of 100 steps holds 10 at update_every_n_steps=10, ~8 read on CUDA, where
    #: they reach the host one sample late).
    MIN_SAMPLES = 3

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

    def observe(
        self,
        guard: Guard,
        rows: list[tuple[int, float, float, float]],
        updates: UpdateSampler | None = None,
    ) -> None:
        """Finite steps as (step, loss, norm, lr), in order; ``updates``: NanGuard's
        update sampler (``None``: it is off)."""
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
        if second < first:
            return
        start = step - self._window + 1
        moved = self._moved(updates, start, step)
        if moved:
            # A loss that does not fall while the weights move is not a fault by itself:
            # a GAN's losses oscillate by design, a fine-tune of a converged model
            # starts at the data's noise floor, with nothing to fall to.
            return
        if moved is None:  # update_every_n_steps=None: no sample to tell them apart
            why = (
                "Try to overfit one batch first (a model that cannot is wired wrong); "
                "check the LR (too low crawls, too high bounces), label/mask wiring, and "
                "that the optimizer holds the trainable parameters. A loss already at its "
                "floor (a fine-tune of a converged model) or a game's (a GAN's) does not "
                "fall by design: ignore this warning there."
            )
        else:
            why = (
                "and the optimizer did not move the weights: every sampled update over "
                "these steps left them as they were. Check the LR (0, a schedule that "
                "starts at 0, or too low to change a float32 weight), that the optimizer "
                "holds the model's parameters (not a copy's), and that the loss is not "
                "detached from the model (overfit one batch: a model that cannot is "
                "wired wrong). A model meant to stay as it is (an evaluation under the "
                "guard) has no fault here."
            )
        guard.event(
            "loss_not_decreasing",
            level="warning",
            message=(
                f"the loss did not decrease over steps {start}-{step} (median "
                f"{first:.4g} -> {second:.4g})" + (". " if moved is None else " ") + why
            ),
            first_half_median=first,
            second_half_median=second,
            weights_moved=moved,
        )

    @staticmethod
    def _moved(updates: UpdateSampler | None, start: int, end: int) -> bool | None:
        """Whether an optimizer step moved the weights over steps ``start..end``, by the
        update sampler's samples; ``None`` without at least :attr:`MIN_SAMPLES` of them
        there (the sampler is off)."""
        if updates is None:
            return None
        if any(start <= s <= end for s, _ in updates.samples):
            return True
        if sum(start <= s <= end for s in updates.still) < _Health.MIN_SAMPLES:
            return None
        return False


class _StaleGrads:
    """Gradients carried from one optimizer step into the next: ``optimizer.zero_grad()``
    forgotten, so each step applies the sum of every gradient so far (the grad norm
    climbs step after step). Watched on one parameter (``sentinel``) over the first
    :attr:`STEPS` steps the guard sees (the loop's shape shows at its second step),
    then the hooks go: nothing per step after that.

    Two hooks on the sentinel: before a gradient is added to its ``.grad`` (``_before``)
    and after (``_after``). The ``.grad`` is *untouched* when it is the tensor, at the
    version, last seen (after the last optimizer step or our last accumulation). The
    first backward after a step that finds it untouched stacks on the applied gradient
    (``stale``); a later backward that finds it reset (``zero_grad()`` after a backward
    that was not the step's, e.g. a metric's) clears that. Micro-batches of gradient
    accumulation are not steps; ``zero_grad(set_to_none=False)`` bumps the version (a
    reset); ``set_to_none=True`` makes a new tensor (a reset)."""

    #: Steps watched (each costs two hook calls per backward, ~3 us): the second is
    #: the first that can stack on another's gradients.
    STEPS = 2

    def __init__(self, sentinel: Tensor) -> None:
        self._p = sentinel
        self._grad: Tensor | None = None  # the .grad last seen, and its version
        self._version = -1
        self._stepped = False  # an optimizer step since the last backward into it
        self._steps = 0  # optimizer steps seen
        self.stale = False
        self._handles = [
            sentinel.register_hook(self._before),
            sentinel.register_post_accumulate_grad_hook(self._after),
        ]

    def _before(self, grad: Tensor) -> None:
        g = self._p.grad
        untouched = g is not None and g is self._grad and g._version == self._version
        if self._stepped:
            self._stepped = False
            self.stale = untouched
        elif not untouched:
            self.stale = False  # reset since: what is applied is this step's only

    def _after(self, p: Tensor) -> None:
        self._seen(p.grad)

    def _seen(self, g: Tensor | None) -> None:
        self._grad = g
        self._version = -1 if g is None else g._version

    def after_step(self, guard: Guard) -> bool:
        """The optimizer step is done: warn if its gradients included the previous
        step's. Returns whether to keep watching."""
        if self.stale:
            step = guard.step
            guard.event(
                "grads_not_reset",
                level="warning",
                message=(
                    f"the gradients applied at step {step} were added onto those of step "
                    f"{step - 1}: nothing reset them after optimizer.step(), so each step "
                    "applies the sum of every gradient so far and the grad norm climbs. "
                    "Call optimizer.zero_grad() after optimizer.step() (or before each "
                    "step's first backward)."
                ),
            )
            self.remove()
            return False
        self._seen(self._p.grad)
        self._stepped = True
        self._steps += 1
        if self._steps >= self.STEPS:
            self.remove()
            return False
        return True

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
