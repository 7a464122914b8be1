"""The rewind guard's in-memory snapshot: the training state a checkpoint holds of the
model, optimizers, schedulers and scaler, copied to host memory and put back.

Taken at a step boundary every ``snapshot_every_steps`` steps into one of two slots,
each a :class:`~guardrails.checkpoint.stage.Staging` (the checkpointer's reusable
staging blocks: pinned on a CUDA machine, plain memory on a CPU run), laid out the same
way at every snapshot, so after the first one a snapshot is only the copy:

* device tensors (the weights, the optimizer's moments): ``copy_(non_blocking=True)``
  into the slot's pinned blocks, no wait. The copy is ordered on the stream before any
  later kernel that writes the weights, so nothing waits for it, and nothing on the
  host reads those blocks until a restore, which synchronizes first: a snapshot adds no
  host-device sync to the step it is taken at (a ``GradScaler``'s ``state_dict()``
  reads its scale: with one, that step has one read);
* host tensors (a CPU run's everything; Adam's ``step`` counts on a GPU run): copied
  into the slot's plain blocks (CPU run) or cloned;
* the rest (param groups, a scheduler's counters): ``copy.deepcopy``.

A restore writes the copies back into the live objects (``load_state_dict``), each
optimizer tensor in a fresh allocation of its own (so the snapshot is never aliased by
the state it restored: it may be restored twice, and an optimizer's in-place update
must not write into it).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from guardrails.checkpoint.stage import Staging, per_rank
from guardrails.engine import model

if TYPE_CHECKING:
    from guardrails.engine.guard import Guard


class _Slot:
    """A tensor's place in a snapshot's structure (``copy.deepcopy`` leaves it be)."""

    __slots__ = ("i",)

    def __init__(self, i: int) -> None:
        self.i = i

    def __deepcopy__(self, memo: dict[int, Any]) -> _Slot:
        return self


def _lift(obj: Any, tensors: list[Tensor]) -> Any:
    """``obj`` with each tensor replaced by a :class:`_Slot` naming its index in
    ``tensors`` (one tensor under two keys stays one)."""
    if isinstance(obj, Tensor):
        tensors.append(obj.detach())
        return _Slot(len(tensors) - 1)
    if isinstance(obj, dict):
        return {k: _lift(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_lift(v, tensors) for v in obj)
    return obj


def _drop(obj: Any, copies: list[Tensor], *, fresh: bool) -> Any:
    """The structure :func:`_lift` made, with ``copies`` put back in place of its
    slots (``fresh``: each a fresh allocation, a host tensor cloned)."""
    if isinstance(obj, _Slot):
        t = copies[obj.i]
        return t.clone(memory_format=torch.contiguous_format) if fresh else t
    if isinstance(obj, dict):
        return {k: _drop(v, copies, fresh=fresh) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_drop(v, copies, fresh=fresh) for v in obj)
    return copy.deepcopy(obj)


class Snapshot:
    """One slot: the state after step :attr:`step`, or empty (``step`` -1)."""

    def __init__(self, pinned: bool) -> None:
        self.staging = Staging(pinned=pinned)
        #: The step whose state this holds; -1: none (empty, or dropped by a rewind).
        self.step = -1
        #: The loader's position when it was taken: ``(epoch, batch_in_epoch)``.
        self.position: tuple[int, int] = (0, 0)
        self._layout: dict[str, Any] = {}
        self._copies: list[Tensor] = []
        #: Bytes of tensors this snapshot holds (the last one taken).
        self.nbytes = 0

    def _tensors(self, guard: Guard) -> tuple[dict[str, Any], list[Tensor], int]:
        """``(layout, tensors, n)``: the model's and optimizers' state with each tensor
        lifted out, in staging order; the first ``n`` are theirs (what the slot's blocks
        are laid out for)."""
        tensors: list[Tensor] = []
        layout = {
            "model": _lift(dict(model.unwrap(guard.model).state_dict()), tensors),
            "optimizers": {
                n: _lift(per_rank(o).state_dict(), tensors) for n, o in guard.optimizers.items()
            },
        }
        return layout, tensors, len(tensors)

    def _staged(self, tensors: list[Tensor]) -> list[int]:
        """Which of ``tensors`` go into the slot's blocks: the device ones (pinned
        blocks) or, on a CPU run (plain blocks), the host ones; the others are cloned."""
        pinned = self.staging.pinned
        return [
            i for i, t in enumerate(tensors) if (t.device.type != "cpu") == pinned and t.numel()
        ]

    def prepare(self, guard: Guard) -> None:
        """Allocate this slot's blocks now, in a thread (the checkpointer's
        ``Staging.prepare``), once the optimizer's state exists: pinning them during a
        snapshot would stall that step (~0.5 s/GB)."""
        _, tensors, n = self._tensors(guard)
        sizes = [tensors[i].numel() * tensors[i].element_size() for i in self._staged(tensors[:n])]
        if sizes:
            self.staging.prepare(sizes, guard.device)

    def take(self, guard: Guard, position: tuple[int, int]) -> None:
        """Copy the guard's model, optimizers, schedulers and scaler here (see the
        module docstring: no wait for a device copy); ``position``: the loader's
        ``(epoch, batches fetched)`` the next step trains from."""
        layout, tensors, n_staged = self._tensors(guard)
        # Schedulers and the scaler hold numbers, not the bulk: deep copies.
        layout["schedulers"] = {
            n: copy.deepcopy(s.state_dict()) for n, s in guard.schedulers.items()
        }
        scaler = guard.scaler
        layout["scaler"] = None if scaler is None else copy.deepcopy(scaler.state_dict())
        staging = self.staging
        staged = self._staged(tensors[:n_staged])
        copies: list[Tensor] = list(tensors)
        if staged:
            places = staging.place([tensors[i] for i in staged])
            for i, dst in zip(staged, places, strict=True):
                dst.copy_(tensors[i], non_blocking=staging.pinned)
                copies[i] = dst
        chosen = set(staged)
        for i, t in enumerate(tensors):
            if i not in chosen:
                copies[i] = t.clone(memory_format=torch.contiguous_format)
        self._layout, self._copies = layout, copies
        self.nbytes = sum(t.numel() * t.element_size() for t in copies)
        self.step = guard.step
        self.position = position

    def restore(self, guard: Guard) -> None:
        """Put this snapshot back into the guard's model, optimizers, schedulers and
        scaler. On a GPU, first waits for the snapshot's own copies (once, at the
        rewind only)."""
        if self.staging.pinned and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # the copies into the pinned blocks are done
        layout, copies = self._layout, self._copies
        model.unwrap(guard.model).load_state_dict(_drop(layout["model"], copies, fresh=False))
        for name, opt in guard.optimizers.items():
            per_rank(opt).load_state_dict(_drop(layout["optimizers"][name], copies, fresh=True))
        for name, sched in guard.schedulers.items():
            sched.load_state_dict(copy.deepcopy(layout["schedulers"][name]))
        if guard.scaler is not None and layout["scaler"] is not None:
            guard.scaler.load_state_dict(copy.deepcopy(layout["scaler"]))
