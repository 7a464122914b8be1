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
* A loader stop (the checkpointer's ``_stop_at_dead_loader``, the ranks joined by
  ``agree.Agreement.join_dead_loaders``): what the shield cannot cover (a worker killed before its
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
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch.multiprocessing
from torch.utils.data import DataLoader

from guardrails.distributed import dist
from guardrails.engine import process

if TYPE_CHECKING:
    from guardrails.engine.guard import Guard


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
        iterator made before the guard (the loader stop covers those). The workers of a
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


#: Why a stop saved nothing when a loader's worker died of the signal before the rank
#: reached a step boundary, and what to do.
NOT_A_BOUNDARY = (
    "a DataLoader worker died of the signal before the rank reached a step "
    "boundary. guardrails keeps the workers of the loader it iterates alive "
    "through the stop signals only when they start inside the guard: create the "
    "loader's iterator inside the guard (a persistent_workers iterator made "
    "before it keeps workers that die), or have your other loaders' "
    "worker_init_fn ignore SIGTERM/SIGINT"
)


def worker_died(error: BaseException) -> bool:
    """Whether ``error`` is a DataLoader's for one of its workers gone ("DataLoader
    worker (pid N) is killed by signal: ...", "... exited unexpectedly")."""
    return isinstance(error, RuntimeError) and "DataLoader worker" in str(error)


def teardown_exit(
    step: int, signum: int, exc: BaseException, *, saved: str | None, last: str
) -> SystemExit:
    """The exit of a rank that failed after a stop signal, before the ranks agreed to
    stop: the signal's code, what failed, and where its failure save went (``saved``)
    or which checkpoint stays the latest (``last``)."""
    first = (str(exc).splitlines() or [""])[0]
    ended = (
        f"saved step {step} to {saved} first." if saved else f"exited without a checkpoint; {last}."
    )
    return process.stop_exit(
        128 + signum,
        f"{signal.Signals(signum).name} received at step {step}; before the ranks could agree "
        f"to stop and save, this rank failed with {type(exc).__name__}: {first} (another "
        f"rank ending on the same signal, or a peer's death the launcher answered with it): "
        f"{ended}",
    )


def say_nothing_saved(guard: Guard, name: str, exc: BaseException, *, latest: str) -> None:
    """A signal's stop that ended without a checkpoint, said on the console (a warning
    event: stderr), with why and what to do: a re-run must not start over from step 0
    (or an old checkpoint) without a word. ``latest``: which checkpoint stays the
    latest, in words."""
    first = str(exc).splitlines()[0] if str(exc) else ""
    why = (
        NOT_A_BOUNDARY
        if worker_died(exc)
        else (
            "a peer that could not save left, or this rank failed on its own before a "
            "step boundary; the other ranks' reports say which"
        )
    )
    guard.event(
        "stopped",
        level="warning",
        message=f"{name} received at step {guard.step}, but this rank failed before the "
        f"ranks could stop at a step boundary ({type(exc).__name__}: {first}): NOTHING "
        f"was saved; {latest}. Why: {why}. To lose less next time, "
        "save periodically too: guard(checkpoint=dict(every_s=1800)).",
        signal=name,
        path=None,
        saved=False,
    )
