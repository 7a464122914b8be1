"""This rank's progress clock, for the watchdog's thread: when the main thread last moved
(step, batch, collective, phase), the longest gap between two steps, the hang timeout
that follows from it, and the main thread's share of a core.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from guardrails.engine.where import progress_key
from guardrails.guards.watchdog.records import main_thread_cpu_s

if TYPE_CHECKING:
    from guardrails.engine.guard import Guard

# Automatic timeout (hang_timeout_s=None): AUTO_FACTOR times the longest gap between two
# optimizer steps seen after the first, kept within [AUTO_FLOOR_S, AUTO_CAP_S].
# - The gap, not the mean step: periodic slow steps (unmarked logging, a dataloader
#   re-spawning its workers at an epoch boundary) are what a timeout must survive.
# - x5: a step 5 times slower than the slowest seen so far is not jitter.
# - Floor 60 s: below that, one-off host stalls a run has not shown yet (an epoch's
#   first batch from cold storage, a slow filesystem on a save someone did not mark)
#   would become false alarms; a minute is still 10x faster than NCCL's default.
# - Cap 300 s: half of NCCL's default collective timeout (10 min), so the report with
#   the rank and the stacks arrives before NCCL's watchdog kills the process anyway.
AUTO_FACTOR = 5.0
AUTO_FLOOR_S = 60.0
AUTO_CAP_S = 300.0


def auto_timeout_s(longest_gap_s: float | None) -> float:
    """The automatic hang timeout for a run whose slowest step gap so far (excluding the
    first step) is ``longest_gap_s`` (``None``: not seen yet, the cap)."""
    if longest_gap_s is None:
        return AUTO_CAP_S
    return min(AUTO_CAP_S, max(AUTO_FLOOR_S, AUTO_FACTOR * longest_gap_s))


class ProgressClock:
    """Sampled by the watchdog's thread each tick, from what the main thread advertises
    on the guard; never touches the main thread."""

    def __init__(
        self, *, hang_timeout_s: float | None, first_step_timeout_s: float, step: int, now: float
    ) -> None:
        self.hang_timeout_s = hang_timeout_s
        self.first_step_timeout_s = first_step_timeout_s
        #: The main thread's share of a core over the last span of >= 0.5 s (``None``
        #: until measured): a crawl is busy, a deadlock idle.
        self.cpu: float | None = None
        self._cpu_at: tuple[float, float] | None = None  # (monotonic, CPU s) last sampled
        self.reset(step, now)

    def reset(self, step: int, now: float) -> None:
        """The progress clock and step-gap statistics, as at the guard's start."""
        self._last_key: tuple[Any, ...] | None = None
        #: When the main thread last advanced (``time.monotonic()``).
        self.last_progress = now
        self._last_step_at: float | None = None
        self._last_step = step
        self._longest_gap: float | None = None
        self._gaps_count = False

    def idle_s(self, now: float) -> float:
        return now - self.last_progress

    def sample(self, guard: Guard, now: float) -> None:
        """Update the clock from what the main thread advertises, and the CPU share."""
        key = progress_key(guard)
        if key != self._last_key or guard.paused:
            self._last_key = key
            self.last_progress = now
        if guard.step != self._last_step:
            # step_time_s stays NaN until the first optimizer step since start (a
            # resume sets guard.step, not that): the first step (compilation) and a
            # resume's jump are not gaps.
            warm = not math.isnan(guard.step_time_s)
            if warm and self._gaps_count and self._last_step_at is not None:
                gap = (now - self._last_step_at) / max(1, guard.step - self._last_step)
                self._longest_gap = max(self._longest_gap or 0.0, gap)
            self._gaps_count = warm
            self._last_step, self._last_step_at = guard.step, now
        elif guard.paused and self._last_step_at is not None:
            self._last_step_at = now  # a marked pause is not a slow step
        share = self._cpu_share(now)
        if share is not None:
            self.cpu = share

    def timeout(self, guard: Guard) -> float:
        """The hang timeout in force now."""
        t = (
            self.hang_timeout_s
            if self.hang_timeout_s is not None
            else auto_timeout_s(self._longest_gap)
        )
        # The first step's allowance (compilation, autotuning, communicator setup) is
        # for a rank inside its step; a rank that has not fetched its first batch is
        # waiting for its loader, which no compiler explains: the ranks that wait for it
        # in a collective should hear within the hang timeout, not in 10 minutes.
        if math.isnan(guard.step_time_s) and guard.phase != "data":
            return max(t, self.first_step_timeout_s)
        return t

    def _cpu_share(self, now: float) -> float | None:
        """The main thread's share of a core since the previous sample, if that was at
        least half a second ago (shorter spans are the kernel's tick noise)."""
        cpu = main_thread_cpu_s()
        if cpu is None:
            return None
        last, self._cpu_at = self._cpu_at, (now, cpu)
        if last is None or now - last[0] < 0.5:
            if last is not None:
                self._cpu_at = last  # keep the older sample: a longer span next time
            return None
        return round(min(1.0, (cpu - last[1]) / (now - last[0])), 2)
