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
  loader the guard does not iterate, a kill from elsewhere). A worker that died of the
  stop signal inside a step is not raised there: torch's SIGCHLD handler would raise
  between two bytecodes of the step, even inside ``optimizer.step()`` with the weights
  half updated, and the rank had nothing to save. The signal capture holds SIGCHLD from
  the first stop signal on (``signals.py``) and the next step boundary runs torch's
  handler; a loader that fails there, or while fetching the first batch after a
  boundary, failed where the state is complete. That is the stop: the ranks whose
  loaders failed at the same boundary (``agree.Agreement.join_dead_loaders``) save
  there and exit ``128 + signum``.
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
    from guardrails.guards.checkpointer.agree import Agreement


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


class LoaderStop:
    """A loader whose worker died of the stop signal, as the stop at a step boundary
    (see the module's docstring). It owns where the last boundary was and what the stop
    says of the loader (:attr:`cause`); the checkpointer decides the stop from what its
    methods return. Nothing here runs in a healthy step: only after a stop signal."""

    def __init__(self) -> None:
        #: (step, epoch, batch_in_epoch, training forwards) at the last step boundary.
        self.mark: tuple[int, int, int, int] | None = None
        #: What the stop's message says of the loader (``None``: no loader stop).
        self.cause: str | None = None

    def first_fetch(self, guard: Guard) -> bool:
        """Whether the rank is fetching the first batch after a step boundary (no batch
        fetched, no training forward since): the state is that boundary's (:attr:`mark`,
        which the checkpointer sets at every boundary)."""
        at = (guard.step, guard.epoch, guard.batch_in_epoch, len(guard.step_calls))
        return guard.phase == "data" and at == self.mark

    def fetch_failed(
        self, guard: Guard, error: BaseException, agreement: Agreement | None, *, grace_s: float
    ) -> bool:
        """From the close, the loop failed after a stop signal: whether that was its
        loader failing for a worker gone on the first fetch after a boundary, every rank
        whose loader failed there joined (all of them, or nobody saves: a save is one
        commit of every rank). Then the rank stops at that boundary."""
        if not worker_died(error) or not self.first_fetch(guard):
            return False
        return self._join(guard, error, agreement, grace_s=grace_s)

    def died_in_step(
        self,
        guard: Guard,
        replay: Callable[[], None],
        agreement: Agreement | None,
        *,
        grace_s: float,
    ) -> bool:
        """At a step boundary, children having died in the step after the stop signal:
        ``replay`` runs the SIGCHLD handler they were held from (torch's raises for a
        loader worker killed by a signal). Whether that was the loader, every rank
        joined: then the rank stops here. A loader's error that no peer joined is
        raised, as the fetch would have (the failure save takes this boundary)."""
        try:
            replay()
        except RuntimeError as e:
            if not worker_died(e) or not self._join(guard, e, agreement, grace_s=grace_s):
                raise
            return True
        return False

    def peer_died(self, guard: Guard, agreement: Agreement, *, grace_s: float) -> bool:
        """At a step boundary after a stop signal (one store call per step, only then):
        whether a peer's loader died at this boundary and every rank joined it; then
        this rank stops here with it (its own loader may still hold batches)."""
        if not agreement.dead_loader_posted(guard):
            return False
        if not agreement.join_dead_loaders(guard, grace_s=grace_s):
            return False
        self.cause = "a peer's DataLoader worker died of the signal"
        return True

    def _join(
        self,
        guard: Guard,
        error: BaseException,
        agreement: Agreement | None,
        *,
        grace_s: float,
    ) -> bool:
        if agreement is not None and not agreement.join_dead_loaders(guard, grace_s=grace_s):
            return False
        self.cause = f"{type(error).__name__}: {str(error).splitlines()[0]}"
        return True


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
