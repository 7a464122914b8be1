"""The step's phases on the device, sampled: what the host clock cannot say on a GPU.

On a GPU the host launches a step's kernels and runs ahead; it waits only where
something syncs, so ``guard.forward_s`` (host time) is the launch time of the forward,
not its work. Every ``every_n_steps``-th step, :class:`DeviceClock` records four CUDA
events on the current stream (the step's first training forward starts, that forward
ends, ``optimizer.step()`` starts, it ends) and reads them back one sample later, once
``Event.query()`` says they completed: no host sync, ever (``elapsed_time`` of two
completed events is a host-side subtraction; torch refuses it before they complete).

A sampled step costs four ``cudaEventRecord`` calls (~2 us each on the host); every
other step, one attribute check at each of the four points.
"""

from __future__ import annotations

from typing import Any

import torch

#: Sample one step in this many: ten samples in a pace window of 100 steps.
EVERY_N_STEPS = 10


class DeviceClock:
    """Two sets of four timing events, alternating: one recorded on a sampled step,
    the other (the previous sample) read once it completed."""

    def __init__(self, every_n_steps: int = EVERY_N_STEPS) -> None:
        self.every_n_steps = every_n_steps
        self._sets = [[torch.cuda.Event(enable_timing=True) for _ in range(4)] for _ in range(2)]
        self._next = 0  # the set the next sample records into
        self._pending: tuple[int, list[Any]] | None = None  # (step, events) to read

    def arm(self, step: int) -> list[Any] | None:
        """The events to record during step ``step`` (1-based), or ``None`` when the
        step is not sampled."""
        if step % self.every_n_steps:
            return None
        return self._sets[self._next]

    def recorded(self, step: int, marks: list[Any]) -> None:
        """Step ``step`` recorded ``marks`` (all four): read them at a later sample."""
        self._pending = (step, marks)
        self._next ^= 1

    def read(self) -> tuple[int, float, float, float] | None:
        """``(step, forward_s, backward_s, optimizer_s)`` of the pending sample once its
        last event completed (``None`` before: never waits)."""
        pending = self._pending
        if pending is None or not pending[1][3].query():
            return None
        self._pending = None
        step, (e0, e1, e2, e3) = pending
        return (
            step,
            e0.elapsed_time(e1) / 1e3,
            e1.elapsed_time(e2) / 1e3,
            e2.elapsed_time(e3) / 1e3,
        )
