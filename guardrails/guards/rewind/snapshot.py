"""The rewind guard's in-memory snapshot: the training state a checkpoint holds of the
model, optimizers, schedulers and scaler, copied to host memory and put back.

Taken at a step boundary every ``snapshot_every_steps`` steps into one of two slots,
each a :class:`~guardrails.checkpoint.stage.Staging` (the checkpointer's reusable
staging blocks: pinned on a CUDA machine, plain memory on a CPU run), laid out the same
way at every snapshot, so after the first one a snapshot is only the copy:

* device tensors (the weights, the optimizer's moments): first copied on the device,
  on the training stream, into one buffer laid out like the slot's pinned blocks
  (~5 ms for 10 GB at HBM speed), then copied from that buffer to the pinned blocks,
  one copy per block, on a side stream that waits for nothing the training does: the
  next steps' forward, backward and update run while it crosses the PCIe bus. Copied
  straight to the pinned blocks on the training stream (0.835B parameters, 10 GB, H200:
  the next step ~135 ms longer), that copy held the next step back, and a side stream
  alone could not hide it: the update writes the weights ~45 ms after the boundary.
  Without room on the device for the buffer (the state's size, and headroom), the
  copies go straight to the pinned blocks on the training stream as before. Nothing on
  the host waits for any of it: a restore synchronizes first (:meth:`Snapshot.wait`);
* a ``GradScaler``'s scale and growth tracker: cloned on the device (its
  ``state_dict()`` reads the scale on the host: a sync at every snapshot step);
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
        #: Whether the last snapshot went through a device buffer and the side stream
        #: (see :meth:`_to_pinned`).
        self.through_device = False
        self._stream: torch.cuda.Stream | None = None  # the side stream, once used
        self._done: torch.cuda.Event | None = None  # its copies into the pinned blocks

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
        # Schedulers hold numbers, not the bulk: deep copies.
        layout["schedulers"] = {
            n: copy.deepcopy(s.state_dict()) for n, s in guard.schedulers.items()
        }
        scaler = guard.scaler
        layout["scaler"] = None if scaler is None else _lift(_scaler_state(scaler), tensors)
        staging = self.staging
        staged = self._staged(tensors[:n_staged])
        copies: list[Tensor] = list(tensors)
        if staged:
            sources = [tensors[i] for i in staged]
            places = staging.place(sources)
            if staging.pinned:
                self._to_pinned(sources, places, guard.device)
            else:
                for dst, src in zip(places, sources, strict=True):
                    dst.copy_(src)
            for i, dst in zip(staged, places, strict=True):
                copies[i] = dst
        chosen = set(staged)
        for i, t in enumerate(tensors):
            if i not in chosen:
                copies[i] = t.clone(memory_format=torch.contiguous_format)
        self._layout, self._copies = layout, copies
        self.nbytes = sum(t.numel() * t.element_size() for t in copies)
        self.step = guard.step
        self.position = position

    def _to_pinned(self, sources: list[Tensor], places: list[Tensor], device: torch.device) -> None:
        """Copy device ``sources`` into their pinned ``places`` without making the
        training wait: through a device buffer and a side stream where the device has
        room for the buffer, else straight, on the training stream (see the module
        docstring)."""
        training = torch.cuda.current_stream(device)
        if self._done is not None:  # the previous copy into these blocks (long done)
            training.wait_event(self._done)
        spans = self.staging.where(sources)
        used: dict[int, int] = {}  # bytes of each pinned block the sources fill
        for block, offset, n in spans:
            used[block] = max(used.get(block, 0), _aligned(offset + n))
        total = sum(used.values())
        if any(src.device != device for src in sources) or not _device_has_room(device, total):
            for dst, src in zip(places, sources, strict=True):
                dst.copy_(src, non_blocking=True)
            self._done = None
            self.through_device = False
            return
        base, start = {}, 0
        for block in sorted(used):
            base[block], start = start, start + used[block]
        buffer = torch.empty(total, dtype=torch.uint8, device=device)
        by_dtype: dict[torch.dtype, tuple[list[Tensor], list[Tensor]]] = {}
        for src, (block, offset, n) in zip(sources, spans, strict=True):
            view = buffer[base[block] + offset : base[block] + offset + n]
            dsts, srcs = by_dtype.setdefault(src.dtype, ([], []))
            dsts.append(view.view(src.dtype).view(src.shape))
            srcs.append(src)
        for dsts, srcs in by_dtype.values():  # a few launches for ~1,000 tensors
            torch._foreach_copy_(dsts, srcs)
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        side = self._stream
        side.wait_stream(training)  # the buffer is written
        blocks = self.staging.blocks
        with torch.cuda.stream(side):
            for block, n in used.items():
                chunk = buffer[base[block] : base[block] + n]
                blocks[block][:n].copy_(chunk, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record(side)
        # Freed when this returns; the allocator reuses it only once the side
        # stream's copies are done.
        buffer.record_stream(side)
        self.through_device = True

    def wait(self) -> None:
        """Wait until this snapshot's device copies have reached host memory."""
        if self._done is not None:
            self._done.synchronize()

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
            state = _drop(layout["scaler"], copies, fresh=False)
            guard.scaler.load_state_dict({k: _number(v) for k, v in state.items()})


#: Device memory left free beside a snapshot's device buffer, at least: the buffer is
#: freed right after the snapshot's copies, but the training's own peak must still fit.
_HEADROOM_BYTES = 2 << 30
_ALIGN = 64  # Staging's offsets: a multiple of any dtype's size


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _device_has_room(device: torch.device, nbytes: int) -> bool:
    """Whether ``device`` can hold a buffer of ``nbytes`` beside the training: free
    memory plus what torch's allocator holds unused, minus a headroom of 5% of the
    card (at least 2 GiB). No sync: driver and allocator counters."""
    free, total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return free + cached >= nbytes + max(_HEADROOM_BYTES, total // 20)


def _scaler_state(scaler: Any) -> dict[str, Any]:
    """A ``GradScaler``'s ``state_dict()`` with its scale and growth tracker as the
    device tensors it keeps (``state_dict()`` reads them on the host: a sync); the
    plain ``state_dict()`` where they are not there (disabled, or before its first
    ``scale()``, when it holds numbers only)."""
    scale = getattr(scaler, "_scale", None)
    tracker = getattr(scaler, "_growth_tracker", None)
    if not scaler.is_enabled() or not isinstance(scale, Tensor) or not isinstance(tracker, Tensor):
        return scaler.state_dict()
    return {
        "scale": scale,
        "growth_factor": scaler.get_growth_factor(),
        "backoff_factor": scaler.get_backoff_factor(),
        "growth_interval": scaler.get_growth_interval(),
        "_growth_tracker": tracker,
    }


def _number(value: Any) -> Any:
    """A one-element tensor of a scaler's state as the number ``state_dict()`` has."""
    if isinstance(value, Tensor):
        return value.item() if value.is_floating_point() else int(value.item())
    return value
