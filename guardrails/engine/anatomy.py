"""The step's anatomy: its phases on the host clock (:class:`StepAnatomy`), and on the
device, sampled (:class:`DeviceClock`): what the host clock cannot say on a GPU.

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

import math
import time
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


class StepAnatomy:
    """The step's phases as the engine times them: on the host clock every step, on the
    device (:class:`DeviceClock`, CUDA only) on sampled steps. One per guard.

    The guard's hooks update the public fields inline at the four points of a step
    (the fetch, the first training forward, ``optimizer.step()`` and its end): a
    method call there would be a Python frame each, every step. The guard publishes
    ``data_wait_s``, ``forward_s``, ``backward_s``, ``optimizer_s``, ``step_time_s`` and
    ``device_phases`` (``engine/state.py``) from them."""

    def __init__(self) -> None:
        #: When the current step began (the previous step's end), ``perf_counter``.
        self.step_start = 0.0
        #: The step's time in the loader's ``next()`` so far.
        self.data_wait_s = 0.0
        #: The step's training forwards' time so far.
        self.forward_s = 0.0
        #: When the step's first training forward began, and the loader wait up to then.
        self.compute_t0 = math.nan
        self.data_at_compute = 0.0
        #: When ``optimizer.step()`` began.
        self.optimizer_t0 = math.nan
        #: On a GPU: the device clock, the events the current step records (``None``:
        #: not sampled), and the forward's end mark while the first forward runs.
        self.clock: DeviceClock | None = None
        self.marks: list[Any] | None = None
        self.fwd_mark: Any = None

    def start(self, step: int, *, cuda: bool) -> None:
        """The guard started at ``step``: the first step's clock runs from now."""
        self.step_start = time.perf_counter()
        if cuda:
            self.clock = DeviceClock()
            self.arm(step)

    def arm(self, step: int) -> None:
        """The next step is ``step + 1``: its device events if it is sampled (the guard
        does this inline at each step's end)."""
        if self.clock is not None:
            self.marks = self.clock.arm(step + 1)

    def end_sampled(
        self, step: int, *, forward_seen: bool
    ) -> tuple[int, float, float, float] | None:
        """A sampled step ``step``'s end: its last mark, this one kept for a later read
        (when its forward was seen, all four marks recorded), and the previous sample
        if the device has finished it (no wait: ``None`` before)."""
        clock, marks = self.clock, self.marks
        assert clock is not None and marks is not None
        marks[3].record()
        sample = clock.read()
        if forward_seen and self.fwd_mark is None:  # all four marks recorded
            clock.recorded(step, marks)
        self.fwd_mark = None
        self.marks = None  # armed again at the boundary
        return sample
