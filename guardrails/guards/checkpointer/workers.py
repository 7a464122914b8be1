"""The loader's worker processes and the stop signals, for :class:`SignalCheckpointer`.

A launcher signals every process of a rank's process group, not only the rank: torchrun
(``killpg``), SLURM (every process of the job step) and a terminal's Ctrl+C (the whole
foreground group). A ``DataLoader(num_workers=N)``'s workers are in that group, so they
died of the very SIGTERM the rank was about to save on, and the rank failed on
"DataLoader worker (pid N) is killed by signal: Terminated" before its ranks could agree
on a step to stop at: no checkpoint, and the same command trained again from step 0.

* :class:`WorkerShield`: while the guard runs, the loaders it iterates start their
  workers with a ``worker_init_fn`` that makes them ignore the stop signals, then calls
  the loader's own one; the loader's ``worker_init_fn`` is the user's object again at
  the guard's end. A worker still ends when the loader shuts it down or its parent ends
  (torch's workers watch their parent), and nothing about the data changes.
* :class:`LoaderStop`: what the shield cannot cover (a worker killed before its
  ``worker_init_fn`` ran, a ``persistent_workers`` iterator made before the guard, a
  loader the guard does not iterate, a kill from elsewhere): a loader that fails
  because a worker died, after a stop signal, while fetching the first batch after a
  step boundary, failed where the state is complete. That is the stop: the ranks whose
  loaders failed at the same boundary save there and exit ``128 + signum``. A worker's
  death raised inside a step (torch's SIGCHLD handler raises wherever the main thread
  is) leaves no such state: the rank exits without a checkpoint, and says so.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch.multiprocessing
from torch.utils.data import DataLoader

from guardrails.distributed import dist
from guardrails.engine import process

if TYPE_CHECKING:
    from guardrails.engine.guard import Guard

# How long a rank whose loader died after a stop signal waits at its step boundary for
# every rank to stop at the same one (their loaders died of the same signal): the save
# that follows is a commit of every rank. Bounded well inside torchrun's and SLURM's
# 30 s before SIGKILL (a third of grace_s, at most 10 s): a rank that went past that
# boundary (its loader still had batches) never comes, and waiting longer only eats
# the grace period.
_JOIN_MAX_S = 10.0


class IgnoreStopSignals:
    """A DataLoader ``worker_init_fn``: the stop signals ignored in the worker while the
    guard is open, then the loader's own ``worker_init_fn`` (``inner``). A class at
    module level holding ints, a shared flag and the user's function, so it pickles for a
    spawn / forkserver ``multiprocessing_context`` (the flag travels as the worker is
    started, the way such a loader sends its ``worker_init_fn``).

    Not ``SIG_IGN``: a worker that outlives the guard (``persistent_workers``) must still
    end at its loader's SIGTERM (``Process.terminate()`` in the loader's shutdown and at
    the interpreter's exit, whose join waits for it: an ignored one hung the exit)."""

    def __init__(
        self, signums: tuple[int, ...], inner: Callable[[int], Any] | None, open_: Any
    ) -> None:
        self.signums = signums
        self.inner = inner
        self.open = open_  # a shared byte: 1 while the guard runs

    def __call__(self, worker_id: int) -> None:
        for num in self.signums:
            signal.signal(num, self._on_signal)
            signal.siginterrupt(num, False)  # a blocking call in the worker is not cut
        if self.inner is not None:
            self.inner(worker_id)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.open.value:
            return  # the guard stops and saves; the worker lives on to hand it batches
        # The guard has closed: what the signal did to a DataLoader worker before. torch's
        # workers exit quietly at SIGTERM (their loader's shutdown); SIGINT is Python's
        # KeyboardInterrupt, which the worker's loop takes as its end; others kill.
        if signum == signal.SIGTERM:
            os._exit(0)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _dataloaders(loader: Any) -> list[DataLoader]:
    """The DataLoaders whose ``worker_init_fn`` the guard's passes start workers with:
    the loader, and the one under a library's wrapper (accelerate's)."""
    found: list[DataLoader] = []
    for obj in (loader, dist.inner(loader)):
        if isinstance(obj, DataLoader) and all(obj is not f for f in found):
            found.append(obj)
    return found


class WorkerShield:
    """The stop signals ignored by the workers of the loaders the guard iterates, for the
    guard's lifetime (see the module's docstring)."""

    def __init__(self) -> None:
        self._covered: list[tuple[DataLoader, Any, IgnoreStopSignals]] = []

    def cover(self, loader: Any, signums: tuple[int, ...]) -> None:
        """Wrap the ``worker_init_fn`` of ``loader`` (and of the DataLoader under it).

        Workers already running keep what they started with: a ``persistent_workers``
        iterator made before the guard (``LoaderStop`` covers those). The workers of a
        persistent iterator made while the guard runs outlive it: from its close on they
        end at the stop signals again (the shared flag)."""
        if not signums:
            return
        for dl in _dataloaders(loader):
            if not dl.num_workers:
                continue
            own = dl.worker_init_fn
            # The loader's own context (torch.multiprocessing's default one when unset):
            # its shared memory is what its workers can map.
            context = dl.multiprocessing_context or torch.multiprocessing
            wrapper = IgnoreStopSignals(signums, own, context.RawValue("b", 1))
            dl.worker_init_fn = wrapper
            self._covered.append((dl, own, wrapper))

    def restore(self) -> None:
        """Each loader's ``worker_init_fn`` back to the object it had (unless the loop set
        another one meanwhile: that one is kept)."""
        for dl, own, wrapper in reversed(self._covered):
            wrapper.open.value = 0  # workers still running die of the signals again
            if dl.worker_init_fn is wrapper:
                dl.worker_init_fn = own
        self._covered = []


def worker_died(error: BaseException) -> bool:
    """Whether ``error`` is a DataLoader's for one of its workers gone ("DataLoader
    worker (pid N) is killed by signal: ...", "... exited unexpectedly")."""
    return isinstance(error, RuntimeError) and "DataLoader worker" in str(error)


class LoaderStop:
    """Part of :class:`SignalCheckpointer`: a loader whose worker died after a stop
    signal ends the run as that signal's stop (see the module's docstring)."""

    def _stop_at_dead_loader(self, guard: Guard, signum: int, error: BaseException) -> bool:
        """From ``on_end``, the loop failed after ``signum``: whether that was its loader
        failing for a worker gone while fetching the first batch after a step boundary
        (no batch fetched, no training forward since: the state is that boundary's, the
        data position too). Then the rank stops there, with every rank whose loader
        failed at the same boundary (all of them, or nobody saves: a save is one commit
        of every rank), and the loop's error becomes the stop's exit. Checked here, once,
        not around every fetch: nothing is added to a step."""
        at = (guard.step, guard.epoch, guard.batch_in_epoch, len(guard.step_calls))
        if guard.phase != "data" or not worker_died(error) or at != self._boundary_mark:
            return False
        store = self._agree_store  # type: ignore[attr-defined]
        if store is not None and not self._join_dead_loaders(guard, store):
            return False
        self._dead_loader = f"{type(error).__name__}: {str(error).splitlines()[0]}"
        self._stop_at, self._stop_signal = guard.step, signum
        self._stop(guard, exit_now=False)  # type: ignore[attr-defined]
        if self.exit_on_signal:  # type: ignore[attr-defined]
            guard.replace_error(process.stop_exit(128 + signum, guard.stopping or ""))
        return True

    def _join_dead_loaders(self, guard: Guard, store: Any) -> bool:
        """Count this rank in at its step's boundary and wait (bounded) until every rank
        has: whether they all save there. The first rank to know (all counted, or its
        wait over) writes the verdict every rank follows: a rank counted in just as
        another gave up must not wait for a commit that rank never makes. A few store
        calls, once, on this path only."""
        key = self._key(f"dead/{guard.step}")  # type: ignore[attr-defined]
        wait_s = min(float(self.grace_s) / 3, _JOIN_MAX_S)  # type: ignore[attr-defined]
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

    def _dead_loader_at_boundary(self, guard: Guard) -> bool:
        """At a step boundary after a stop signal (one store call per step, only then):
        whether a peer's loader died at this boundary; then this rank stops here with it
        (its own loader may still hold batches). Raises the stop's exit when every rank
        joined."""
        store = self._agree_store  # type: ignore[attr-defined]
        signum = self._signal or self._watched_signal  # type: ignore[attr-defined]
        if store is None or not signum or self._stop_at is not None:  # type: ignore[attr-defined]
            return False
        key = self._key(f"dead/{guard.step}")  # type: ignore[attr-defined]
        try:
            posted = store.add(key, 0)
        except Exception:  # the store went with the job: the normal path decides
            return False
        if not posted:
            return False
        if self._join_dead_loaders(guard, store):
            self._dead_loader = "a peer's DataLoader worker died of the signal"
            self._stop_at, self._stop_signal = guard.step, signum
            self._stop(guard)  # type: ignore[attr-defined]
        return True
