"""How a non-finite step's update is left out, on the device where it can be.

* fused optimizers (``Adam/AdamW/SGD/Adagrad(fused=True)``) take the step's flag as
  ``optimizer.found_inf``, exactly as GradScaler hands them its own; the fused kernel
  leaves weights and state unchanged and undoes its step count. No sync at all.
* any other optimizer cannot be told on the device, so the flag is read on the host
  before the update and, when set, the optimizer's ``step()`` is not called at all
  (:meth:`Guard.skip_update`): weights and state stay bitwise as they were, whatever
  the optimizer would have done with the gradients.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from guardrails.engine.guard import Guard


class SkipUpdate:
    """Leaves a bad step's update out: through ``found_inf`` for a fused optimizer
    (until the step's ``after_step`` puts the attribute back), else by not calling
    ``step()``."""

    def __init__(self, guard: Guard, optimizer: Any) -> None:
        self._guard = guard
        self._opt = optimizer
        #: GradScaler's contract with fused optimizers: they read ``found_inf`` in step().
        self.fused = bool(getattr(optimizer, "_step_supports_amp_scaling", False))
        #: ``optimizer.found_inf`` is ours for this step (:meth:`restore` after it).
        self.set_found = False
        #: A GradScaler's flag was on the optimizer before ours (an fp16 run).
        self.scaler_seen = False
        self._prev_found: Tensor | None = None

    def on_device(self, found: Tensor) -> None:
        """CUDA: a fused optimizer takes the flag; any other costs a host read."""
        if self.fused:
            self._give_found_inf(found)
        elif found.item():  # the one host sync per step of a non-fused optimizer
            self._guard.skip_update()

    def now(self, found: Tensor) -> None:
        """The host knows this step is bad: skip its update."""
        if self.fused:
            self._give_found_inf(found)
        else:
            # The optimizer's step() is not called at all: nothing an optimizer does
            # with non-finite (or missing) gradients can reach weights or state.
            self._guard.skip_update()

    def _give_found_inf(self, found: Tensor) -> None:
        # GradScaler's contract: a fused step() reads optimizer.found_inf and leaves
        # weights and state untouched where it is nonzero (and undoes its step count).
        opt = self._opt
        prev = getattr(opt, "found_inf", None)
        if prev is not None:
            # A GradScaler got here first: skip if either of us says so.
            self.scaler_seen = True
            found = torch.maximum(prev, found.to(prev.device))
        self._prev_found = prev
        opt.found_inf = found
        self.set_found = True
        # The step's buffers (BatchNorm statistics) are put back by the same flag.
        self._guard.skip_update(where=found)

    def restore(self) -> None:
        """After the step: the optimizer's ``found_inf`` as it was before ours."""
        self.set_found = False
        if self._prev_found is None:
            self._opt.__dict__.pop("found_inf", None)
        else:
            self._opt.found_inf = self._prev_found
