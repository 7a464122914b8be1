"""How the ranks of a job agree on the step to stop (and the timed saves) at, for
:class:`SignalCheckpointer`: one store call per rank per agreement, no collective.

Every ~``agree_every_s`` seconds of training, at a step counted the same on every rank,
the first rank to get there writes the decision for that step under the step's key
(``compare_set``: a signal, "a timed save is due", the steps until the next check, so
the interval adapts to the step time identically everywhere) and every other rank reads
the same one; a rank that gets a signal writes "stop" as the decision of the first
check not decided yet (and of the close), so the others stop there with it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from guardrails.distributed import store as _store

if TYPE_CHECKING:
    from guardrails.engine.guard import Guard

# How long a rank whose loader died after a stop signal waits at its step boundary for
# every rank to stop at the same one (their loaders died of the same signal): the save
# that follows is a commit of every rank. Bounded well inside torchrun's and SLURM's
# 30 s before SIGKILL (a third of grace_s, at most 10 s): a rank that went past that
# boundary (its loader still had batches) never comes, and waiting longer only eats
# the grace period.
_JOIN_MAX_S = 10.0


@dataclass(frozen=True)
class Decision:
    """What the ranks decided at a check: the stop signal (0: none), whether a timed
    save is due on any rank."""

    signum: int
    save_due: bool


class Agreement:
    """The decisions of one guard's ranks, through ``store`` (the guard's ``agree`` side
    store). ``world_size``: the job's ranks (the checks' period stretches with it);
    ``step``: the step the guard starts at."""

    def __init__(self, store: Any, *, world_size: int, step: int) -> None:
        self._store = store
        self._world = world_size
        #: The step of the next check.
        self.next_check = step + 1
        self._check_t, self._check_step = time.monotonic(), step
        #: This rank's signal is in the decisions.
        self.posted = False
        self._rewinds = 0  # rewinds this run (the rewind guard): the keys' stretch

    def key(self, at: int | str) -> str:
        """The store key of the decision at check ``at``: after a rewind (the rewind
        guard, at the same step on every rank) step numbers repeat, so the checks of
        each stretch between rewinds have keys of their own."""
        return f"at/{at}" if not self._rewinds or at == "end" else f"at/r{self._rewinds}/{at}"

    def rewound(self, step: int) -> None:
        """The run is back at ``step`` on every rank: the next check is the next step
        (not the one scheduled for a step number it would take more steps to reach
        again: a signal must not wait for it), under keys of their own (step numbers
        repeat), and a signal already posted under the old keys is posted again."""
        self._rewinds += 1
        self.next_check = step + 1
        self._check_t, self._check_step = time.monotonic(), step
        self.posted = False

    def claim_stop(self, guard: Guard, signum: int) -> None:
        """This rank got ``signum``: write "stop" as the decision of the first check no
        rank has decided yet (the next one, unless a faster rank is already past it),
        and of the close, so every rank stops at the same step, or closes as a stop.
        A few store calls, once."""
        store, mine = self._store, f"{signum} 0 1"
        with guard.in_phase("agree"):
            at = self.next_check
            while True:
                decided = bytes(store.compare_set(self.key(at), "", mine)).decode().split()
                if int(decided[0]):  # a stop is decided there (ours, or a peer's)
                    break
                at += int(decided[2])
            store.compare_set("at/end", "", mine)
        self.posted = True

    def decide(
        self,
        guard: Guard,
        *,
        at: str,
        signum: int | None,
        save_due: bool,
        agree_every_s: float,
    ) -> Decision:
        """Decide stop / save and the next check step for every rank at once, at a
        point every rank reaches (``at``: the scheduled step, or ``"end"``): the first
        rank there writes its decision (``signum``: this rank's signal, ``save_due``:
        its timed save is due) under ``at``'s key, every rank uses the one there."""
        if signum is not None and not self.posted:
            self.claim_stop(guard, signum)
        now = time.monotonic()
        per_step = (now - self._check_t) / max(1, guard.step - self._check_step)
        every = _store.stretched(agree_every_s, self._world)
        steps = 1 if per_step <= 0 else min(10_000, max(1, round(every / per_step)))
        mine = f"{signum or 0} {int(save_due)} {steps}"
        with guard.in_phase("agree"):
            decided = self._store.compare_set(self.key(at), "", mine)
        signum_any, due_any, steps = map(int, bytes(decided).decode().split())
        self._check_t, self._check_step = now, guard.step
        self.next_check = guard.step + steps
        return Decision(signum_any, bool(due_any))

    # ------------------------------------------------------------------ a dead loader

    def join_dead_loaders(self, guard: Guard, *, grace_s: float) -> bool:
        """Count this rank in at its step's boundary (its loader died of a stop signal)
        and wait (bounded) until every rank has: whether they all save there. The first
        rank to know (all counted, or its wait over) writes the verdict every rank
        follows: a rank counted in just as another gave up must not wait for a commit
        that rank never makes. A few store calls, once, on this path only."""
        store, key = self._store, self.key(f"dead/{guard.step}")
        wait_s = min(float(grace_s) / 3, _JOIN_MAX_S)
        # A bounded wait of its own: neither the watchdog nor the signal watcher's "no
        # progress after the signal" (5 s) may call it stuck meanwhile.
        with guard.in_phase("agree"), guard.pause_watchdog("stop"):
            joined = store.add(key, 1)
            deadline, pause = time.monotonic() + wait_s, 0.005
            while joined < guard.world_size and time.monotonic() < deadline:
                time.sleep(pause)
                pause = min(0.2, pause * 2)
                joined = store.add(key, 0)
            mine = "save" if joined >= guard.world_size else "none"
            verdict = bytes(store.compare_set(f"{key}/verdict", "", mine)).decode()
        return verdict == "save"

    def dead_loader_posted(self, guard: Guard) -> bool:
        """Whether a peer's loader died at this step's boundary (one store call)."""
        try:
            return bool(self._store.add(self.key(f"dead/{guard.step}"), 0))
        except Exception:  # the store went with the job: the normal path decides
            return False
