"""Signal capture for :class:`SignalCheckpointer`: handlers that only set a flag, a watcher
thread that wakes on a signal's wakeup byte, and exact restoration of the previous
handlers.

:class:`SignalCapture` owns all of it: which signal came first and when, the SIGINTs
after it, the handlers it replaced, the watcher thread and the children's deaths held
after the first signal. The checkpointer reads :attr:`SignalCapture.signal` at its step
boundaries and turns it into a stop there.
"""

from __future__ import annotations

import contextlib
import math
import os
import select
import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from guardrails.engine import process

if TYPE_CHECKING:
    from guardrails.engine.guard import Guard


# After a stop signal, a rank whose main thread shows no progress (no step, batch, phase
# or collective) for this long cannot reach a step boundary to save: it is stuck (in a
# collective waiting for a stuck peer, in its loader, in a C call where Python signal
# handlers never run) and exits with 128+signum. 8 s: several steps of any model that
# advertises progress per phase, and more than the 5 s a DataLoader waits before it
# checks its workers (``MP_STATUS_CHECK_INTERVAL``: workers the SIGTERM killed reach
# the loop as an error then, at a boundary that is the stop; at 5 s the two raced and
# the rank left without its save); well inside torchrun's and SLURM's 30 s before
# SIGKILL, which is what such a rank got before, with nothing written.
_SIGNAL_STUCK_S = 8.0


class SignalCapture:
    """The stop signals of one guard: installed at its start, restored at its end.

    ``signals``: the signal names to capture; ``grace_s``: the launcher's time between
    SIGTERM and SIGKILL (bounds how long a stuck rank waits before it exits);
    ``latest``: says which checkpoint is the latest, in words (for the messages of an
    exit without a save); ``stop_decided``: whether the checkpointer has already
    decided the stop (then its save is under way, bounded: the watcher leaves it be).
    """

    def __init__(
        self,
        *,
        signals: tuple[str, ...],
        grace_s: float,
        latest: Callable[[], str],
        stop_decided: Callable[[], bool],
    ) -> None:
        self.names = signals
        self.grace_s = grace_s
        self._latest = latest
        self._stop_decided = stop_decided
        #: The first stop signal's number, set by the handler: the only thing it does.
        self.signal: int | None = None
        #: When the first stop signal came (``time.monotonic()``), by the handler or the
        #: watcher.
        self.signal_at: float | None = None
        #: SIGINTs after a first signal of another kind (the first decides the exit).
        self.late_sigints = 0
        #: What the watcher thread saw (the handler may not have run yet: a stuck rank).
        self.watched: int | None = None
        self._previous: dict[int, Any] = {}
        self._wakeup: tuple[int, int] | None = None  # (read, write) ends of the wakeup fd
        self._previous_wakeup = -1
        self._watcher: threading.Thread | None = None
        #: SIGCHLDs held since the first stop signal, not handled yet (see
        #: :meth:`_hold_child_deaths`).
        self.children_held = 0
        self._on_child_installed: Callable[[int, Any], None] | None = None
        self._child_previous: Any = None
        self._first_fetch: Callable[[], bool] = lambda: False

    @property
    def received(self) -> int | None:
        """The stop signal this rank got, by its handler or its watcher (``None``)."""
        return self.signal or self.watched

    @property
    def installed(self) -> tuple[int, ...]:
        """The numbers of the signals whose handlers are installed now."""
        return tuple(self._previous)

    def install(self, guard: Guard, *, first_fetch: Callable[[], bool] | None = None) -> None:
        """The handlers, and the watcher thread (main thread only). ``first_fetch``:
        whether the rank is fetching the first batch after a step boundary (a child's
        death is handled at once there, see :meth:`_hold_child_deaths`)."""
        if first_fetch is not None:
            self._first_fetch = first_fetch
        for name in self.names:
            num = getattr(signal, name)
            self._previous[num] = signal.signal(num, self._on_signal)
        if self.names:
            self._watch_signals(guard)

    def _watch_signals(self, guard: Guard) -> None:
        """A thread that learns of a stop signal even while the main thread is stuck.

        Python runs a signal handler only when the main thread executes bytecode, so a
        rank blocked in a collective or a C call never runs ours: it ignored its
        launcher's SIGTERM until the SIGKILL 30 s later. The C-level handler also writes
        the signal number to the wakeup fd (``signal.set_wakeup_fd``), which this thread
        reads; bytes for a wakeup fd set before ours (asyncio's) are passed on to it."""
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        try:
            self._previous_wakeup = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        except (ValueError, OSError):  # not the main thread, or an unusable fd
            os.close(read_fd)
            os.close(write_fd)
            return
        self._wakeup = (read_fd, write_fd)
        nums = {int(getattr(signal, name)) for name in self.names}
        self._watcher = threading.Thread(
            target=self._watch, args=(guard, read_fd, nums), name="guardrails-signals", daemon=True
        )
        self._watcher.start()

    def _watch(self, guard: Guard, read_fd: int, nums: set[int]) -> None:
        from guardrails.engine.where import main_thread_site, progress_key

        signum = 0
        key: Any = None
        since = 0.0
        while True:
            timeout = None if not signum else 0.5
            ready, _, _ = select.select([read_fd], [], [], timeout)
            if ready:
                try:
                    data = os.read(read_fd, 64)
                except OSError:
                    return
                if not data:  # closed at on_end
                    return
                if self._previous_wakeup >= 0:
                    with contextlib.suppress(OSError):
                        os.write(self._previous_wakeup, data)
                if not signum:
                    signum = next((b for b in data if b in nums), 0)
                    self.watched = signum or None
                    key, since = progress_key(guard), time.monotonic()
                    if signum and self.signal_at is None:
                        self.signal_at = since
            if not signum or self._stop_decided() or guard.stopping is not None:
                continue  # no signal yet, or the stop is under way: its save is bounded
            if self.verdict_first(guard):
                continue  # a verdict came first: the engine ends the rank with it
            now = time.monotonic()
            here = progress_key(guard)
            if here != key or guard.paused:
                key, since = here, now
                continue
            step_s = guard.step_time_s if guard.step_time_s == guard.step_time_s else 0.0
            wait_s = min(self.grace_s / 2, max(_SIGNAL_STUCK_S, 3 * step_s))
            if now - since < wait_s:
                continue
            name = signal.Signals(signum).name
            message = (
                f"{name} received at step {guard.step}, but this rank made no progress "
                f"for {now - since:.0f} s after it (its main thread is at "
                f"{main_thread_site()}), so it could not reach a step boundary to save: "
                f"exited without a checkpoint; {self._latest()}. If the job "
                "should have saved, see why this rank was stuck (the other ranks' "
                "reports, or the watchdog's)."
            )
            guard.die(process.stop_exit(128 + signum, message))
            return

    def _unwatch_signals(self) -> None:
        if self._wakeup is None:
            return
        read_fd, write_fd = self._wakeup
        self._wakeup = None
        with contextlib.suppress(ValueError, OSError):  # ValueError: not the main thread
            signal.set_wakeup_fd(self._previous_wakeup)
        os.close(write_fd)  # the thread reads EOF and ends
        if self._watcher is not None:
            self._watcher.join(1.0)
            self._watcher = None
        os.close(read_fd)

    def restore(self) -> None:
        """The previous handlers back, exactly; the watcher ended. Children's deaths
        still held are not handled: the loop is over and they were the signal's; a
        loader used again finds its dead worker at its next fetch (its own check)."""
        self._unwatch_signals()
        for num, previous in self._previous.items():
            process.restore_handler(num, previous)  # after a failing close's hold, if any
        self._previous = {}
        holder, self._on_child_installed = self._on_child_installed, None
        if holder is not None and signal.getsignal(signal.SIGCHLD) is holder:
            process.restore_handler(signal.SIGCHLD, self._child_previous)  # else: the loop's

    def _hold_child_deaths(self) -> None:
        """From the first stop signal to the guard's close, a child's death (SIGCHLD) is
        held instead of handled wherever the main thread is. The launcher signalled the
        rank's whole process group, so loader workers the shield could not cover die of
        it too (``workers.py``), and torch's SIGCHLD handler raised "DataLoader worker
        (pid N) is killed by signal" between two bytecodes of the step, even inside
        ``optimizer.step()``: weights half updated, nothing to save, the run back to its
        last checkpoint or to step 0. Held, the step finishes and the next boundary
        runs the handler (:meth:`replay_child_deaths`); a death while the rank fetches
        the first batch after a boundary is handled at once (the loader fails where the
        state is complete). No I/O: this runs in the signal's handler."""
        if self._on_child_installed is not None:
            return
        previous = signal.getsignal(signal.SIGCHLD)
        if previous is None:  # a handler set outside Python: it could not be put back
            return
        holder = self._on_child
        try:
            signal.signal(signal.SIGCHLD, holder)
        except (ValueError, OSError):  # not the main thread
            return
        self._child_previous, self._on_child_installed = previous, holder

    def _on_child(self, signum: int, frame: Any) -> None:
        if self._first_fetch():
            self._handle_child(signum, frame)
        else:
            self.children_held += 1

    def replay_child_deaths(self) -> None:
        """At a step boundary: the SIGCHLD handler found at the first signal runs for
        the children that died during the step (torch's raises ``RuntimeError`` for a
        loader worker a signal killed)."""
        if self.children_held:
            self.children_held = 0
            self._handle_child(signal.SIGCHLD, None)

    def _handle_child(self, signum: int, frame: Any) -> None:
        previous = self._child_previous
        if callable(previous):
            previous(signum, frame)

    def verdict_first(self, guard: Guard) -> bool:
        """Whether a verdict came before the signal: one this rank took, or one any
        rank claimed (the job's news keeps the first one's time) that this rank had
        not read yet. Then the verdict is what happened; the signal (torchrun's
        teardown once the stuck rank exited) only ended it."""
        signal_at = self.signal_at if self.signal_at is not None else math.inf
        if guard.verdict_at is not None and guard.verdict_at <= signal_at:
            return True
        if guard.news is None:
            return False
        try:  # one store call, on this failure path only
            claimed = guard.news.verdict_claimed_at()
        except Exception:  # the store went with the job
            return False
        signal_wall = time.time() - (time.monotonic() - signal_at)
        return claimed is not None and claimed <= signal_wall

    def _on_signal(self, signum: int, frame: Any) -> None:
        # A flag only: this runs between two bytecodes of whatever the main thread was
        # doing (maybe inside the logging module's lock), so no I/O and no collective.
        if self.signal is None:
            self.signal = signum
            if self.signal_at is None:  # a float set: no I/O, no lock
                self.signal_at = time.monotonic()
            self._hold_child_deaths()
            return
        if signum != signal.SIGINT:
            return  # a second SIGTERM / SIGUSR1: the stop is under way already
        first = self.signal
        if first == signal.SIGINT:  # the second Ctrl+C: out, now
            self.restore()
            raise KeyboardInterrupt
        # A Ctrl+C after another signal (a launcher's SIGTERM, then a person at the
        # terminal, or a launcher forwarding both): the first signal decides the exit
        # code and the message. The first Ctrl+C is noted and the stop's save goes on
        # (a pre-emption's save is what the job needs next); a second one ends the
        # process now, still as the first signal's stop.
        self.late_sigints += 1
        if self.late_sigints < 2:
            return
        self.restore()
        name = signal.Signals(first).name
        raise process.stop_exit(
            128 + first,
            f"{name} received; a second SIGINT (Ctrl+C) during the stop's save ended the "
            f"process before the save finished: {self._latest()}",
        )
