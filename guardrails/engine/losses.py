"""The loss record: the losses one step produced, kept on the device, and their mean.

A step's loss reaches the guard in one of three ways, in this order of precedence:

1. ``g.observe(loss)``, once per micro-batch (models that return logits);
2. the scalar loss the model returns (``loss``, ``(logits, loss)``, ``{"loss": ...}``,
   ``output.loss``), picked up by the forward's wrapper (``engine/wrappers.py``);
3. the losses the step backpropagated (``loss.backward()``, unscaled when a GradScaler
   scaled them), for loops that compute the loss outside the model.

Nothing here reads a device value on the host: the sums stay device tensors and the
step's loss is one division, read lagged by the components that record it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class LossRecord:
    """One step's loss accumulators. The fields are class defaults, so the record goes
    back to an empty step by clearing its instance dict (:meth:`clear`'s one C call,
    which the engine makes inline at each step's end: no frame per step).

    The forward's wrapper adds to :attr:`auto` inline (one frame fewer per forward);
    everything else goes through the methods below."""

    #: The sum of the losses the model returned this step, and how many.
    auto: Tensor | None = None
    auto_n = 0
    #: The sum of the losses :meth:`observe` was given this step, and how many.
    explicit: Tensor | None = None
    explicit_n = 0
    #: The sum of the losses the step backpropagated (``loss.backward()``), and how many.
    backward: Tensor | None = None
    backward_n = 0
    #: ``(scaled, loss)`` of the last ``GradScaler.scale(loss)``: its backward is the loss's.
    scaled: tuple[Tensor, Tensor] | None = None
    #: The step's loss once computed (``Guard.step_loss``), shared by the components.
    mean: Tensor | None = None

    def observe(self, loss: Tensor | float, device: torch.device) -> None:
        """``g.observe(loss)``: a micro-batch's scalar loss, kept on the device."""
        if not isinstance(loss, Tensor):
            loss = torch.tensor(float(loss), device=device)
        elif loss.numel() != 1:
            raise ValueError(
                f"observe() takes the scalar loss of the micro-batch; got a tensor of "
                f"shape {tuple(loss.shape)}. Reduce it first (e.g. loss.mean())."
            )
        loss = loss.detach().reshape(())
        # Out of place: the first detached loss shares storage with the user's tensor.
        self.explicit = loss if self.explicit is None else self.explicit + loss
        self.explicit_n += 1

    def on_backward(self, loss: Tensor) -> None:
        """``loss.backward()`` of a scalar while the guard is open (not a replay): the
        step backpropagates ``loss`` (the unscaled one when a GradScaler scaled it).
        Kept on the device, summed; read lagged like a loss the model returns."""
        scaled = self.scaled
        if scaled is not None and scaled[0] is loss:
            loss = scaled[1]
            self.scaled = None
        loss = loss.detach()
        if loss.ndim:  # a (1,)-shaped loss
            loss = loss.reshape(())
        self.backward = loss if self.backward is None else self.backward + loss
        self.backward_n += 1

    def compute(self, device: torch.device) -> Tensor | None:
        """The step's loss as a 0-d tensor on ``device``: the mean of the observed
        losses, else of the losses the model returned, else the sum of the losses
        backpropagated (with ``(loss / accum).backward()`` the mean micro-batch loss);
        ``None`` when none came. Computed once a step, then kept in :attr:`mean`."""
        if self.mean is not None:
            return self.mean
        if self.explicit_n:
            total, n = self.explicit, self.explicit_n
        elif self.auto_n:
            total, n = self.auto, self.auto_n
        else:
            total, n = self.backward, 1
        if total is not None:
            if total.device != device:  # model parallel: loss on the last device
                total = total.to(device, non_blocking=True)
            self.mean = total if n == 1 else total / n
        return self.mean

    def any(self) -> bool:
        """Whether a loss reached the guard this step, any of the three ways."""
        return bool(self.explicit_n or self.auto_n or self.backward_n)

    def clear(self) -> None:
        """Back to an empty step (the engine does this inline, see the class)."""
        self.__dict__.clear()

    def __repr__(self) -> str:
        fields: dict[str, Any] = dict(vars(self))
        return f"LossRecord({fields})"
