"""GCScheduler: Python's cyclic GC at step boundaries only, the same step on every rank.

A GPU at 0% with pauses of seconds at random steps is often the cyclic collector scanning
millions of long-lived objects (model, optimizer state, dataset indices) at arbitrary
moments; under DDP one rank's pause stalls them all. A full ``gc.collect()`` in a
GPT-2-small step on an H200 costs 80-150 ms; after ``gc.freeze()`` the long-lived
objects are never scanned again and a young collection takes milliseconds.

So, from the guard's start there is no automatic collection; after the first optimizer
step (setup is done, the long-lived objects exist) one full collection runs and
``gc.freeze()`` moves the survivors out of every later scan. Then
collect the young generations every ``every_n_steps`` steps, at a step boundary; the
step counter is the same on every rank, so the pauses line up with no collective.

A young collection promotes what it finds alive to the oldest generation, and only a
full collection ever scans that one again: a reference cycle still alive at one scheduled
collection (a batch kept in a prefetch queue, a cache of recent steps) is never freed
unless full collections run too. Without them a loop whose cycles lived ~200 steps grew
to 1,280 MB where the same loop unguarded stayed at 773 MB. So a full collection also
runs every ``full_every_n_steps`` (default 1000: every 10th scheduled collection, the
ratio of CPython's own third threshold), on the same step on every rank. After the
freeze it scans only what was created since the first step and is still alive, plus
the garbage it frees: in ``benchmarks/gc_bench.py`` no longer than the young
collections of the same run (87-254 ms vs 225-390 ms on a loaded CPU host); with
cycles kept 200 steps (``--survive 200``) 579 ms, against 1,395 ms for Python's own full
collections, and memory flat instead of every cycle kept.
Every collection (ours or anyone's) is timed through ``gc.callbacks`` and lands in the
``gc_s`` metrics column; a pause over ``long_pause_s`` is also an event.

On close the previous state comes back exactly: enabled flag, thresholds, and the
frozen set (unfrozen only if it was empty before; an application that froze objects
itself keeps them frozen and guardrails does not freeze on top of it). An application
that manages the GC itself during the run (nanochat freezes and disables it after its
first step) keeps what it set: the frozen set is then larger than guardrails left it,
and close leaves the enabled flag and the frozen set alone.

A resumed run freezes after its own first step, like a fresh one. A long collection
that torch.compile runs while compiling (it calls ``gc.collect()``) is reported as
information, not as a warning: it is not a stall of the training loop's making.
"""

from __future__ import annotations

import gc
import logging
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from guardrails.engine.component import Component
from guardrails.engine.config import configure
from guardrails.util.checks import non_negative, positive_int

if TYPE_CHECKING:
    from guardrails.engine.guard import Guard

logger = logging.getLogger("guardrails.gc")


def _compiling() -> bool:
    """Whether this collection runs inside torch.compile's compiler (Dynamo or
    Inductor on the stack). Walked only for a long pause, which is rare. Dynamo's
    ``eval_frame.py`` does not count: its ``disable`` wrapper runs the guard's own step
    bookkeeping (outside any graph) every step, compiling nothing."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if "torch/_inductor" in name or (
            "torch/_dynamo" in name and not name.endswith("eval_frame.py")
        ):
            return True
        frame = frame.f_back
    return False


class GCScheduler(Component):
    """Runs Python's garbage collector only at aligned step boundaries. Knobs:
    :class:`GCScheduler.Config` (``guardrails.guard(gc=...)``)."""

    @dataclass(kw_only=True)
    class Config:
        """GCScheduler's knobs.

        Attributes:
            every_n_steps: after the first step, freeze the survivors and collect
                generations ``0..generation`` only every this many optimizer steps, at
                the same step on every rank. Default 100.
            generation: the oldest generation collected on schedule (0, 1 or 2).
                Default 1: young objects only, the frozen long-lived ones are never
                scanned.
            full_every_n_steps: also run a full collection every this many steps,
                at the same step on every rank (it replaces that step's young one),
                so reference cycles that lived through a young collection are freed
                too. Default 1000; ``None`` never does (memory then grows by every
                such cycle).
            long_pause_s: a collection longer than this is logged as a ``gc_pause``
                event. Default 0.1 s.
        """

        every_n_steps: int = 100
        generation: int = 1
        full_every_n_steps: int | None = 1000
        long_pause_s: float = 0.1

        def __post_init__(self) -> None:
            positive_int("every_n_steps", self.every_n_steps)
            if self.generation not in (0, 1, 2):
                raise ValueError(f"generation must be 0, 1 or 2, got {self.generation!r}")
            positive_int("full_every_n_steps", self.full_every_n_steps, allow_none=True)
            non_negative("long_pause_s", self.long_pause_s)
            self.long_pause_s = float(self.long_pause_s)

    name = "gc"

    def __init__(self, config: GCScheduler.Config | None = None, /, **knobs: Any) -> None:
        configure(self, config, knobs)
        #: The last 10,000 timed collections: (step, generation, seconds, collected
        #: objects). Bounded: collections we did not schedule could come every step.
        self.pauses: deque[tuple[int, int, float, int]] = deque(maxlen=10_000)
        self._guard: Guard | None = None
        self._t0 = 0.0
        self._why: str | None = None  # set around our own collections

    def on_start(self, guard: Guard) -> None:
        self._guard = guard
        self._saved = (gc.isenabled(), gc.get_threshold())
        self._froze = False
        self._frozen_left: int | None = None  # the frozen count guardrails left
        gc.callbacks.append(self._on_gc)
        gc.disable()

    def after_step(self, guard: Guard) -> None:
        step = guard.step
        if self._frozen_left is None:  # this run's first step (a resumed run's too)
            self._freeze(guard)
            return
        if self.full_every_n_steps and step % self.full_every_n_steps == 0:
            self._collect(2, "scheduled")
        elif step % self.every_n_steps == 0:
            self._collect(self.generation, "scheduled")

    def _collect(self, generation: int, why: str) -> None:
        self._why = why
        try:
            gc.collect(generation)
        finally:
            self._why = None

    def on_end(self, guard: Guard, exc: BaseException | None) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        enabled, threshold = self._saved
        gc.set_threshold(*threshold)
        if self._frozen_left is not None and gc.get_freeze_count() > self._frozen_left:
            # The application froze objects itself during the run (the frozen set only
            # shrinks on its own, as frozen objects die): it manages the GC, and what it
            # set (frozen set, enabled flag) is kept.
            self._guard = None
            return
        if self._froze:
            gc.unfreeze()
        if enabled:
            gc.enable()
        else:
            gc.disable()
        self._guard = None

    def _freeze(self, guard: Guard) -> None:
        # The one expensive collection (~130 ms with torch imported, measured on CPU):
        # once, at a step boundary all ranks reach together.
        self._collect(2, "freeze")
        if gc.get_freeze_count() == 0:
            gc.freeze()
            self._froze = True
        else:
            guard.event(
                "gc_freeze_skipped",
                message=(
                    f"{gc.get_freeze_count()} objects were already frozen by the application; "
                    "guardrails leaves the frozen set as it is"
                ),
            )
        self._frozen_left = gc.get_freeze_count()
        guard.event(
            "gc_frozen",
            frozen=gc.get_freeze_count(),
            every_n_steps=self.every_n_steps,
            full_every_n_steps=self.full_every_n_steps,
        )

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        # Called by the interpreter around every collection, ours or not: keep it tiny.
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        guard = self._guard
        if guard is None:
            return
        pause = time.perf_counter() - self._t0
        guard.shared.gc_total_s += pause
        gen = info.get("generation", -1)
        self.pauses.append((guard.step, gen, pause, info.get("collected", 0)))
        if pause > self.long_pause_s:
            why = self._why
            if why == "freeze":
                level, advice = "info", "the one full collection before freezing; expected"
            elif _compiling():
                level = "info"
                advice = "torch.compile collected while compiling (a one-off, not a stall)"
            elif why == "scheduled" and gen == 2:
                level = "warning"
                advice = (
                    "a scheduled full collection this long means many objects created "
                    "after the first step are alive (each full collection scans them) or "
                    "much cyclic garbage outlives the young collections; build long-lived "
                    "objects before the first step (they are frozen then), or collect "
                    "fully less often: guard(..., gc={'full_every_n_steps': "
                    f"{2 * (self.full_every_n_steps or 1000)}}}). One such pause every "
                    f"{self.full_every_n_steps} steps is a small share of a run whose "
                    "steps are long: then raise gc={'long_pause_s': ...} to quiet this"
                )
            elif why == "scheduled":
                level = "warning"
                advice = (
                    "a scheduled young collection this long means much short-lived cyclic "
                    "garbage per step; collect more often: guard(..., gc={'every_n_steps': "
                    f"{max(1, self.every_n_steps // 4)}}}) (now {self.every_n_steps}), or "
                    "raise gc={'long_pause_s': ...} where a pause this long is a small "
                    "share of the steps between collections"
                )
            else:
                level = "warning"
                advice = (
                    "not scheduled by guardrails: something called gc.collect() or "
                    "re-enabled automatic collection (gc.enable())"
                )
            guard.event(
                "gc_pause",
                level=level,
                message=(
                    f"a generation-{gen} garbage collection paused this rank for "
                    f"{pause * 1e3:.0f} ms: {advice}"
                ),
                scheduled=why,
                generation=gen,
                pause_s=pause,
                collected=info.get("collected"),
                # Cheap counters only: gc.get_objects() here would walk (and allocate a
                # list of) every object of the generation inside the GC callback.
                counts=gc.get_count(),
                frozen=gc.get_freeze_count(),
            )
