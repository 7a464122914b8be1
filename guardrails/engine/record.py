"""``@guardrails.record``: the end of a failing rank, told once and clearly.

torchrun's ``ChildFailedError`` shows "To enable traceback see:
https://pytorch.org/docs/stable/elastic/errors.html" unless the worker wrote an error
file. torch's own ``@record`` writes one with the traceback; this one writes the
guardrails message (what happened, which rank, step, collective, the fix) where
torchrun reads the root cause, prints it once per failing rank instead of a traceback,
and exits with a code per error class (``exit.EXIT_CODES``), with or without torchrun.

Other exceptions keep torch's behaviour exactly: torch's ``ErrorHandler`` writes the
traceback to the error file, and the exception propagates (traceback, exit code 1).
"""

from __future__ import annotations

import faulthandler
import functools
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar, cast

from guardrails._errors import GuardrailsError
from guardrails.distributed import attempt, launch
from guardrails.engine import last_failure, process

log = logging.getLogger("guardrails.record")

F = TypeVar("F", bound=Callable[..., Any])


def record(fn: F) -> F:
    """Decorate ``main`` so a failure ends the process cleanly and reports itself::

        @guardrails.record
        def main():
            ...

        if __name__ == "__main__":
            main()

    Before ``main`` runs, the launch checks that hold on any device and however the
    ranks were started (the environment's ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` /
    ``LOCAL_WORLD_SIZE`` consistent, ``MASTER_ADDR`` resolvable and reachable; see
    :mod:`guardrails.distributed.launch`): a problem is a :class:`~guardrails.LaunchError`,
    reported as below, and ``main`` does not start.

    While ``main`` runs under a single-node ``torchrun``, ``init_process_group``
    (``env://``, ``tcp://``) connects through a store namespaced by the restart
    (``TORCHELASTIC_RESTART_COUNT``): a restarted attempt never reads the keys the
    attempt before left in the agent's store (see
    :mod:`guardrails.distributed.attempt`). torch's rendezvous handlers are back when
    ``main`` returns.

    While ``main`` runs, ``faulthandler`` is on for all threads (a segfault or a fatal
    error prints every thread's Python stack; the previous state is restored after).
    When ``main`` raises a :class:`~guardrails.GuardrailsError`:

    * ``$TORCHELASTIC_ERROR_FILE`` (set by torchrun for each worker) gets the error in
      the schema torchrun reads, so ``ChildFailedError`` shows our message as the root
      cause;
    * stderr gets one summary block: rank, error class, exit code, the message and fix;
    * the process groups are aborted (a peer may be stuck in a collective; a normal
      destroy could wait for it) and the process exits with the class's code
      (80-99, see ``guardrails.engine.process``) through ``SystemExit``.

    Any other exception: torch's ``@record`` behaviour (traceback in the error file,
    the exception propagates), with the process group destroyed. A normal return also
    destroys the process group if ``main`` left it up.
    """
    if not callable(fn):
        raise TypeError(
            "record decorates your main function (@guardrails.record above def main()), "
            f"got {type(fn).__name__} {fn!r}"[:200]
        )

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        was_enabled = faulthandler.is_enabled()
        if not was_enabled:  # already on: keep the file its owner chose
            _enable_faulthandler()
        process.recording += 1
        try:
            # A launch that cannot work fails here, before main waits at a rendezvous.
            launch.check_before_main()
            # A torchrun restart after a failure no restart can fix ends here, at once.
            last_failure.check_before_main()
            # Under a torchrun restart, main's init_process_group must not meet the
            # keys the attempt before left in the agent's store (distributed/attempt.py).
            with attempt.namespaced_rendezvous():
                result = fn(*args, **kwargs)
        except SystemExit as exc:
            if _ended_by_exit(exc):  # like torch's record: a clean sys.exit returns
                return None
            raise
        except GuardrailsError as exc:
            raise SystemExit(_ended_by_guardrails_error(exc)) from exc
        except Exception as exc:
            _ended_by_exception(exc)
            raise
        finally:
            process.recording -= 1
            last_failure.forget()
            process.release_signals(deliver=False, all_holds=True)
            if not was_enabled:
                faulthandler.disable()
        process.release_process_group(abort=False)
        return result

    return cast(F, wrapper)


def _ended_by_exit(exc: SystemExit) -> bool:
    """``main`` called ``sys.exit`` (or a signal stop raised ``SystemExit``): the guard
    closed, the process group released; whether the exit is clean (code 0 or None)."""
    process.hold_signals()  # the report first; see process.hold_signals
    _close_running_guard(exc)
    if getattr(exc, "guardrails_message", None):  # a signal stop: say so
        process.write_error_file(exc, with_traceback=False)
    if exc.code in (0, None):
        process.release_process_group(abort=False)
        return True
    # A non-zero exit (a signal save's 128+signum, the user's sys.exit(1)): the
    # process group goes too, bounded, in case a peer is still in a collective.
    process.release_process_group(abort=True)
    _reported(process.code_for(exc))
    return False


def _ended_by_guardrails_error(exc: GuardrailsError) -> int:
    """A guardrails error: the error file, one summary block on stderr, the process
    group aborted; the class's exit code."""
    process.hold_signals()
    _close_running_guard(exc)
    # A restart after a failure no restart can fix is refused at once: recorded here.
    last_failure.write(exc, exit_code=process.code_for(exc))
    process.write_error_file(exc)
    sys.stderr.write(process.summary(exc))
    sys.stderr.flush()
    process.release_process_group(abort=True)
    _reported(process.code_for(exc))
    return process.code_for(exc)


def _ended_by_exception(exc: Exception) -> None:
    """Any other exception: torch's handling (the traceback in the error file), the
    process group aborted. Called inside the ``except`` block (``sys.exc_info``)."""
    process.hold_signals()
    _close_running_guard(exc)
    _torch_record_exception(exc)
    process.release_process_group(abort=True)
    _reported(1)


def _reported(code: int) -> None:
    """The report is out and the process is on its way out with ``code``: a launcher's
    SIGTERM from here on (torchrun sends one to every rank as soon as one exits) is
    ignored, so the process ends with that code rather than as "killed by SIGTERM"
    (-15), which hid the rank's own outcome in torchrun's summary. Only under torchrun
    (its workers have ``TORCHELASTIC_RUN_ID``): a ``main`` called in-process (a test, a
    notebook) keeps its handlers."""
    process.release_signals(deliver=False, all_holds=True)
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    if under_torchrun and threading.current_thread() is threading.main_thread():
        # Ignored, not handled: the interpreter's shutdown puts a Python handler back
        # to the default before the last destructors run (the process group's take
        # hundreds of ms), and a SIGTERM then showed as -15; an ignored one stays
        # ignored to the end, and the process exits with its own code. (A hung
        # shutdown still ends by the launcher's SIGKILL.)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _close_running_guard(exc: BaseException) -> None:
    """Close a guard ``main`` started and left open (a flat script's
    ``g = guard(...).start()`` with no ``with``), before the process groups go: its
    metrics are flushed, its ``end`` event written, its threads and its gloo group
    released (a gloo group left to the interpreter's exit can abort the process)."""
    from guardrails.engine import guard

    running = guard._running
    if running is None:
        return
    try:
        running.close(exc)
    except BaseException as err:  # the error that ends the process is already chosen
        log.debug("guardrails: closing the guard after %r raised %r", exc, err)


def _enable_faulthandler() -> None:
    """``faulthandler`` on for all threads, to stderr; to the real stderr when
    ``sys.stderr`` was replaced by an object without a file descriptor (a test's capture,
    a notebook), and not at all if neither has one (as torch's record: warn, go on)."""
    for stream in (sys.stderr, sys.__stderr__):
        try:
            faulthandler.enable(file=stream, all_threads=True)
            return
        except (AttributeError, ValueError, OSError):  # io.UnsupportedOperation is both
            continue
    log.warning("guardrails: could not enable faulthandler: stderr has no file descriptor")


def _torch_record_exception(exc: BaseException) -> None:
    """torch's own handling of a non-guardrails exception (the traceback in the error
    file, or a ``ChildFailedError``'s root cause copied up), so those stay as torch
    users know them. Called inside the ``except`` block: the handler reads the
    traceback from ``sys.exc_info``."""
    try:
        from torch.distributed.elastic.multiprocessing.errors import (
            ChildFailedError,
            get_error_handler,
        )
    except ImportError:
        return
    handler = get_error_handler()
    try:
        if isinstance(exc, ChildFailedError):
            _, failure = exc.get_first_failure()
            if failure.error_file != "<N/A>":
                handler.dump_error_file(failure.error_file, failure.exitcode)
        else:
            handler.record_exception(exc)
    except Exception as err:  # reporting must never replace the user's error
        log.warning("guardrails: could not write the error file: %s", err)
