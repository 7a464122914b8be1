"""MemoryGuard: leaks named, data starvation measured, out-of-memory errors explained.

Three ways a run ends in memory trouble or an idle accelerator, each easy to name once
the right numbers sit in one place. This module is the component that schedules them;
each feature's machinery is its own module:

* **Leaks** (:mod:`guardrails.guards.memory.leaks`): memory that grows every step, most often a
  loss kept with its autograd graph (``losses.append(loss)``), which ends in an OOM
  hours later, far from its cause. Every ``leak_check_every_n_steps`` steps, two host
  counters (no device sync); a census of live objects only when they grew through a
  whole window; one ``leak`` event naming the types, the variable holding them and
  the fix.
* **Data starvation** (:mod:`guardrails.guards.memory.starvation`): the share of step time spent
  waiting for the loader, judged per window of ``data_starvation_window_steps``; one
  ``data_starvation`` event with the remedies that fit this loader.
* **Out of memory** (:mod:`guardrails.guards.memory.oom`): an OOM that ends the guarded loop comes
  out as :class:`guardrails.OutOfMemoryError` with the phase, the allocator's numbers,
  the largest live tensors, the other ranks' memory (read from ``run_dir/memory/``,
  which each rank writes at its leak checks: no collective) and ranked remedies.

Per step MemoryGuard costs two float adds and a compare; everything else runs at
window ends, at checks, or at the error. The counters are :mod:`guardrails.guards.memory.stats`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from guardrails.engine.component import Component
from guardrails.engine.config import configure
from guardrails.guards.memory import oom
from guardrails.guards.memory.leaks import LeakDetector
from guardrails.guards.memory.oom import is_oom
from guardrails.guards.memory.starvation import StarvationMeter
from guardrails.util.checks import flag, fraction, non_negative, positive_int

if TYPE_CHECKING:
    from guardrails.engine.guard import Guard


class MemoryGuard(Component):
    """Reports growing memory (leaks) and data starvation, and explains out-of-memory
    errors. Knobs: :class:`MemoryGuard.Config` (``guardrails.guard(memory=...)``)."""

    @dataclass(kw_only=True)
    class Config:
        """MemoryGuard's knobs.

        Attributes:
            leak_check_every_n_steps: read live Python objects and device memory every
                this many optimizer steps (host counters only, no device sync) and
                report steady growth once as a ``leak`` event naming what grows and
                what holds it. ``None`` turns leak detection off. Default 100.
            leak_window_checks: suspect a leak after growth at this many consecutive
                checks, then confirm it with a census of live objects. Default 4.
            data_starvation_window_steps: report once (a ``data_starvation`` event)
                when, over a window of this many steps, waiting for the loader takes at
                least ``data_starvation_fraction`` of the step time. ``None`` turns the
                report off. Default 100.
            data_starvation_fraction: see ``data_starvation_window_steps``. Default 0.3.
            data_starvation_min_wait_s: and only when the mean wait per step is at least
                this long. Default 0.001 (1 ms): below it the wait is the loader's own
                ``next()`` on a tiny step (0.1-0.2 ms of a 0.5 ms CPU step is a third of
                the step and nothing a loader setting would change).
            explain_oom: re-raise an out-of-memory error that ends the loop as
                :class:`~guardrails.OutOfMemoryError` (still a
                ``torch.OutOfMemoryError``) with where it happened, the memory summary,
                the largest tensors and ranked remedies. Default True.
        """

        leak_check_every_n_steps: int | None = 100
        leak_window_checks: int = 4
        data_starvation_window_steps: int | None = 100
        data_starvation_fraction: float = 0.3
        data_starvation_min_wait_s: float = 0.001
        explain_oom: bool = True

        def __post_init__(self) -> None:
            positive_int("leak_check_every_n_steps", self.leak_check_every_n_steps, allow_none=True)
            positive_int("leak_window_checks", self.leak_window_checks)
            positive_int(
                "data_starvation_window_steps", self.data_starvation_window_steps, allow_none=True
            )
            fraction("data_starvation_fraction", self.data_starvation_fraction)
            non_negative("data_starvation_min_wait_s", self.data_starvation_min_wait_s)
            self.data_starvation_fraction = float(self.data_starvation_fraction)
            flag("explain_oom", self.explain_oom)  # "no" is truthy: never taken as True

        @property
        def does_anything(self) -> bool:
            """Whether any of its three features is on (``guard()`` leaves it out if not)."""
            return (
                self.leak_check_every_n_steps is not None
                or self.data_starvation_window_steps is not None
                or self.explain_oom
            )

    name = "memory"
    # A leak check at a collection step must see the heap without that step's cyclic
    # garbage: the GC scheduler's after_step collects first.
    after = ("gc",)

    def __init__(self, config: MemoryGuard.Config | None = None, /, **knobs: Any) -> None:
        configure(self, config, knobs)
        #: The fields of the ``leak`` event once reported, else ``None``.
        self.leak: dict[str, Any] | None = None
        #: The fields of the ``data_starvation`` event once reported, else ``None``.
        self.starvation: dict[str, Any] | None = None
        #: Censuses taken (each a ``gc.get_objects()`` scan): ``(step, seconds)``.
        self.censuses: list[tuple[int, float]] = []

    # ------------------------------------------------------------------ lifecycle

    def on_start(self, guard: Guard) -> None:
        self._device = guard.device
        self._leaks = LeakDetector(guard.device, self.leak_window_checks, self.censuses)
        self._next_leak = self.leak_check_every_n_steps or math.inf
        self._meter = StarvationMeter(
            self.data_starvation_window_steps,
            self.data_starvation_fraction,
            self.data_starvation_min_wait_s,
        )
        self._next = min(self._next_leak, self._meter.next_window)
        self._rank_file: Path | None = None
        if guard.world_size > 1:
            self._rank_file = oom.rank_file(guard.run_dir, guard.rank)
            # A file left by an earlier run in this run_dir would pass for this one's.
            self._rank_file.unlink(missing_ok=True)

    def after_step(self, guard: Guard) -> None:
        # Per step: two float adds and a compare; everything else at window ends.
        meter = self._meter
        meter.wait_s += guard.data_wait_s
        meter.step_s += guard.step_time_s
        if guard.step >= self._next:
            step = guard.step
            if step >= meter.next_window:
                found = meter.end_window(guard, step)
                if found is not None:
                    self.starvation = found
            if step >= self._next_leak:
                self._next_leak = step + self.leak_check_every_n_steps  # type: ignore[operator]
                self._check_leak(guard, step)
            self._next = min(self._next_leak, meter.next_window)

    def on_end(self, guard: Guard, exc: BaseException | None) -> None:
        self._leaks.close()
        if exc is not None and self.explain_oom and is_oom(exc):
            guard.replace_error(oom.explain(guard, exc, self.leak))

    def _check_leak(self, guard: Guard, step: int) -> None:
        # The other ranks read this file at their OOM: written at every check.
        if self._rank_file is not None:
            oom.write_rank_file(self._rank_file, guard, self._device)
        if self.leak is not None:  # reported once
            return
        found = self._leaks.check(guard, step)
        if found is not None:
            self.leak = found
