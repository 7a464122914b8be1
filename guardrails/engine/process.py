"""Ending a process that cannot end itself, and reporting how it ended.

A background thread (watchdog, auditor) that finds a fatal problem while the main
thread is stuck in a collective or a C call cannot raise into it: Python delivers
exceptions to the main thread only between bytecodes. So it reports and exits the
process itself, non-zero, and the launcher (torchrun) tears the job down and shows the
report instead of waiting out NCCL's 10 minutes or gloo's 30.

Both ways out (:func:`die` from a thread, :func:`guardrails.record` from ``main``) share
what is here: one exit code per error class, the torchelastic error file, the one-block
summary on stderr and the process-group teardown.

Exit codes (``EXIT_CODES``), one per error class so a launcher script or a scheduler can
tell a hang from a NaN without parsing logs. They sit in 80-99, clear of the codes that
already mean something: 1 (an uncaught Python exception), 2 (usage / argparse), 124
(``timeout``), 126/127 (the shell), 128+N (killed by signal N: 130 Ctrl+C, 137 SIGKILL,
143 SIGTERM). R: a restart can fix it (the class's ``restartable``, reasons in
``_errors.py``); the others fail the same way on every restart::

    80    GuardrailsError (any other)   85    UnevenDataError
    81    NonFiniteError                86    ConfigMismatchError
    82    CollectiveMismatchError       87    CheckpointError
    83 R  HangError                     88    ResumeError
    84 R  RankFailedError               89 R  OutOfMemoryError
                                        90    LaunchError
    128+N R  a signal stop (pre-empted: 143 for SIGTERM), after its save

A new error class gets the next free code here (a test checks that every class has its
own). The summary and the error file say which kind a failure is
(:func:`restart_advice`, ``extraInfo.restartable``), and an unfixable one is refused
at once on the restart that follows it (``engine/last_failure.py``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

from guardrails._errors import (
    CheckpointError,
    CollectiveMismatchError,
    ConfigMismatchError,
    GuardrailsError,
    HangError,
    LaunchError,
    NonFiniteError,
    OutOfMemoryError,
    RankFailedError,
    ResumeError,
    UnevenDataError,
)
from guardrails.engine import last_failure

log = logging.getLogger("guardrails.record")

#: Exit code per error class (see the module docstring). Looked up along the MRO, so a
#: subclass gets its parent's code unless it has its own.
EXIT_CODES: dict[type[BaseException], int] = {
    GuardrailsError: 80,
    NonFiniteError: 81,
    CollectiveMismatchError: 82,
    HangError: 83,
    RankFailedError: 84,
    UnevenDataError: 85,
    ConfigMismatchError: 86,
    CheckpointError: 87,
    ResumeError: 88,
    OutOfMemoryError: 89,
    LaunchError: 90,
}

# The metrics and the end event of a process ended from a thread: writing a few parquet
# rows takes milliseconds; 5 s is for a slow filesystem, well inside torchrun's 30 s.
_LAST_WORDS_S = 5.0
# Aborting NCCL communicators can itself block on a wedged GPU or a peer; the process
# is ending either way, so the teardown gets this long before os._exit goes ahead.
_TEARDOWN_S = 3.0

_lock = threading.Lock()  # one report per process: die() from two threads at once

# A process that is ending with a report (a failing guard's close, @record writing the
# error file) holds SIGTERM until the report is out. torchrun SIGTERMs every other rank
# the moment one exits: a survivor explaining the failure (the auditor reading a gloo-
# aborted peer's flight recorder, a watchdog verdict) was killed mid-report (-15, no
# error file) before this.
_HELD_SIGNALS = ("SIGTERM",)
_hold_depth = 0
_held_previous: dict[int, Any] = {}
_held_signal: int | None = None
#: Set while ``@guardrails.record`` runs ``main``: it writes the report and releases
#: the hold, so a failing guard's close leaves the hold to it.
recording = 0

# Daemonic children (DataLoader workers) get this long after SIGTERM before SIGKILL: a
# worker stuck in I/O may not run its SIGTERM handler at once.
_CHILDREN_GRACE_S = 1.0


def stop_exit(code: int, message: str) -> SystemExit:
    """The ``SystemExit`` of a planned stop (a signal save: ``128 + signum``), carrying
    what happened for ``@guardrails.record`` to put in torchrun's error file."""
    exc = SystemExit(code)
    exc.guardrails_message = message  # type: ignore[attr-defined]
    return exc


def code_for(error: BaseException) -> int:
    """The process exit code for ``error``: its class's in ``EXIT_CODES``, a
    ``SystemExit``'s own code, else 1."""
    if isinstance(error, SystemExit) and isinstance(error.code, int):
        return error.code
    for cls in type(error).__mro__:
        if cls in EXIT_CODES:
            return EXIT_CODES[cls]
    return 1


def restartable(error: BaseException) -> bool:
    """Whether a restart of the same job can get past ``error``: its class's
    ``restartable``; a signal stop (pre-empted, saved) can; anything else (an uncaught
    exception guardrails did not classify) is not known to recur, so it can too."""
    if isinstance(error, GuardrailsError):
        return type(error).restartable
    return True


def restart_advice(error: BaseException) -> str:
    """One line for the report: can a restart fix it, or what comes first."""
    if restartable(error):
        return "a restart can fix this: torchrun --max-restarts or a requeue resumes it"
    return (
        "a restart will fail the same way: fix the cause above first (a torchrun "
        "restart after it is refused at once)"
    )


def summary(error: BaseException) -> str:
    """The one block printed on stderr for a failing rank: rank, error class, exit code
    and the whole actionable message."""
    rank = getattr(error, "rank", None)
    if rank is None:
        rank = os.environ.get("RANK")
    who = f"rank {rank}" if rank is not None else "this process"
    bar = "=" * 72
    planned = getattr(error, "guardrails_message", None)  # a signal stop (stop_exit)
    if planned:
        return f"{bar}\nguardrails: {who} exited with code {code_for(error)}: {planned}\n{bar}\n"
    return (
        f"{bar}\nguardrails: {who} failed with {type(error).__name__} "
        f"(exit code {code_for(error)})\n{error}\n  restart: {restart_advice(error)}\n{bar}\n"
    )


def write_error_file(error: BaseException, *, with_traceback: bool = True) -> str | None:
    """Write ``error`` to ``$TORCHELASTIC_ERROR_FILE`` in the schema torchrun reads, and
    return the path (``None`` when the variable is unset: not under torchrun).

    The schema is torch's ``ErrorHandler.record_exception``
    (torch/distributed/elastic/multiprocessing/errors/error_handler.py; the same keys
    since torchelastic's first ``_write_error``, read by ``ProcessFailure`` in 2.13):
    ``{"message": {"message": ..., "extraInfo": {"py_callstack": ..., "timestamp":
    "<int seconds>"}}}``; torch ignores extra keys in ``extraInfo``.
    ``ChildFailedError`` shows ``py_callstack`` for every failed rank (falling back to
    ``message``) and picks the failure with the smallest timestamp as root.

    Each rank has already printed its whole report (:func:`summary`) on its own stderr,
    which torchrun passes through, so ``py_callstack`` gets one line (what happened, on
    which rank, at which step, and where the whole report is): before, torchrun's
    summary repeated every rank's report and its traceback, the same diagnosis up to 6
    times for 2 ranks. The whole report and the traceback stay in the file, under
    ``extraInfo.report`` and ``extraInfo.traceback``, for tools that read it.
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return None
    planned = getattr(error, "guardrails_message", None)  # a signal stop (stop_exit)
    report = summary(error).strip("=\n") if isinstance(error, GuardrailsError) else None
    tb = ""
    if with_traceback and error.__traceback__ is not None:
        tb = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    if planned:
        line = planned
    elif isinstance(error, GuardrailsError):
        head = str(error).splitlines()[0] if str(error) else type(error).__name__
        rank = getattr(error, "rank", None)
        where = "this rank's" if rank is None else f"rank {rank}'s"
        line = (
            f"{type(error).__name__} (exit code {code_for(error)}): {head} "
            f"(the whole report is on {where} stderr above)"
        )
    else:
        line = f"{type(error).__name__}: {error}" + (f"\n\n{tb}" if tb else "")
    data = {
        "message": {
            "message": planned or f"{type(error).__name__}: {error}",
            "extraInfo": {
                "py_callstack": line,
                "report": report or planned or str(error),
                "traceback": tb,
                "timestamp": str(int(time.time())),  # torch's: whole seconds
                "time": time.time(),  # ours, to time fault-to-error precisely
                "error_class": type(error).__name__,
                "exit_code": code_for(error),
                "restartable": restartable(error),
                "rank": getattr(error, "rank", None),
                "step": getattr(error, "step", None),
                # The structured fields (stuck_ranks, failed_rank, lengths...), for
                # tools that read the file: never parse the message.
                "fields": getattr(error, "_fields", {}),
                # What a restart reads to refuse a failure no restart can fix
                # (engine/last_failure.py): the class, its words, the job and attempt.
                "failure": (
                    last_failure.describe(error, exit_code=code_for(error))
                    if isinstance(error, GuardrailsError)
                    else None
                ),
            },
        }
    }
    try:
        with open(path, "w") as f:
            json.dump(data, f, default=str)
    except OSError as exc:  # a report that cannot be written must not mask the error
        log.warning("guardrails: could not write the error file %s: %s", path, exc)
        return None
    return path


def release_process_group(*, abort: bool, timeout_s: float | None = None) -> None:
    """Tear down every process group, giving up after ``timeout_s``.

    ``abort=True`` (a failure): ``distributed_c10d._abort_process_group()``
    (pytorch#132291: ``ncclCommAbort`` on every communicator in one NCCL group call, so
    several communicators cannot deadlock each other, pytorch#119797; a no-op for gloo,
    whose ``ProcessGroup.abort`` is the default no-op since pytorch#148798).
    ``abort=False`` (a normal end): ``destroy_process_group()``. Either runs in a
    daemon thread: on a wedged communicator even the abort can block, and the process
    must end regardless.
    """
    try:
        import torch.distributed as dist
    except ImportError:
        return
    if not (dist.is_available() and dist.is_initialized()):
        return

    def teardown() -> None:
        try:
            from torch.distributed import distributed_c10d as c10d

            if not abort:
                dist.destroy_process_group()
            else:
                c10d._abort_process_group()
        except Exception as exc:
            log.debug("guardrails: process group teardown failed: %s", exc)

    if timeout_s is None:  # a normal destroy is no emergency: it gets longer
        timeout_s = _TEARDOWN_S if abort else 10.0
    worker = threading.Thread(target=teardown, name="guardrails-teardown", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        log.warning("guardrails: the process group did not tear down in %.0f s", timeout_s)


def hold_signals() -> None:
    """Hold SIGTERM (note it, do not die of it) until :func:`release_signals`; nests.
    Main thread only (a no-op elsewhere: Python installs handlers there only)."""
    global _hold_depth
    if threading.current_thread() is not threading.main_thread():
        return
    if _hold_depth == 0:
        for name in _HELD_SIGNALS:
            num = getattr(signal, name)
            _held_previous[num] = signal.signal(num, _note_signal)
    _hold_depth += 1


def release_signals(*, deliver: bool, all_holds: bool = False) -> None:
    """End one hold (``all_holds``: every hold). At the last one the handlers found are
    back and, with ``deliver``, a signal that came meanwhile is raised again now, so a
    launcher's SIGTERM is obeyed, just after the report instead of during it."""
    global _hold_depth, _held_signal
    if _hold_depth == 0 or threading.current_thread() is not threading.main_thread():
        return
    _hold_depth = 0 if all_holds else _hold_depth - 1
    if _hold_depth:
        return
    for num, previous in _held_previous.items():
        signal.signal(num, previous)
    _held_previous.clear()
    held, _held_signal = _held_signal, None
    if held is not None and deliver:
        signal.raise_signal(held)


def restore_handler(num: int, handler: Any) -> None:
    """``signal.signal(num, handler)`` for a component putting back the handler it found;
    during a hold, the handler is put back when the hold ends instead."""
    if _hold_depth and num in _held_previous:
        _held_previous[num] = handler
        return
    signal.signal(num, handler)


def _note_signal(signum: int, frame: Any) -> None:
    global _held_signal
    _held_signal = signum


def end_children() -> None:
    """Terminate this process's daemonic ``multiprocessing`` children (DataLoader
    workers): ``os._exit`` skips the interpreter's exit, which would have, so a worker
    stuck in I/O outlived the job. SIGTERM, then SIGKILL after a second. Non-daemonic
    children are left alone, as a normal exit would wait for them rather than end them."""
    try:
        children = [p for p in multiprocessing.active_children() if p.daemon]
    except Exception:
        return
    for child in children:
        with contextlib.suppress(Exception):
            child.terminate()
    deadline = time.monotonic() + _CHILDREN_GRACE_S
    for child in children:
        with contextlib.suppress(Exception):
            child.join(max(0.0, deadline - time.monotonic()))
            if child.is_alive():
                child.kill()


def die(
    error: BaseException,
    *,
    exit_code: int | None = None,
    saves: Callable[[BaseException], None] | None = None,
    last_words: Callable[[BaseException], None] | None = None,
    extra_s: float = 0.0,
) -> NoReturn:
    """Report ``error`` and end this process at once, whatever the main thread is doing.

    Runs ``saves(error)`` (the guard's failure save), bounded by ``extra_s`` (its own
    limit: ``Component.abort_s``); aborts the process groups (bounded, see
    :func:`release_process_group`); runs ``last_words(error)`` (the guard's: flush the
    metrics the host holds, write the ``end`` event), bounded by :data:`_LAST_WORDS_S`;
    writes the torchelastic error file, prints the summary on stderr, ends the daemonic
    children (:func:`end_children`) and ``os._exit``\\ s with the error's code.
    ``os._exit`` and not ``sys.exit``: the main thread may be inside a C++ collective,
    and interpreter shutdown would wait for it.

    The abort comes after the save, which copies the weights the stuck collective
    guards (an abort frees the main thread, whose next kernels may change them), and
    before the last words: on a GPU whose host queued a step behind the stuck
    collective, every CUDA call waits until the abort ends that collective (2 H200,
    0.835B: a last word's event query held a rank 14 s past its save, until its bound).
    """
    code = code_for(error) if exit_code is None else exit_code
    if not _lock.acquire(timeout=_TEARDOWN_S + _LAST_WORDS_S + extra_s + 5):
        os._exit(code)  # another thread is already reporting and stuck doing it
    try:
        if saves is not None and extra_s > 0:  # no component saves: none to wait for
            _bounded(lambda: saves(error), extra_s, "saving its state")
        release_process_group(abort=True)
        if last_words is not None:
            _bounded(lambda: last_words(error), _LAST_WORDS_S, "saying its last words")
        last_failure.write(error, exit_code=code)
        write_error_file(error, with_traceback=False)
        text = summary(error)
        log.debug("guardrails: ending the process: %s", type(error).__name__)
        sys.stderr.write(text)
        sys.stderr.flush()
        sys.stdout.flush()
        end_children()
    finally:
        os._exit(code)


def _bounded(fn: Callable[[], None], timeout_s: float, what: str) -> None:
    """Run ``fn`` in a daemon thread for at most ``timeout_s``: the main thread that is
    stuck may hold what ``fn`` needs (a stalled filesystem, a lock)."""

    def run() -> None:
        try:
            fn()
        except Exception as exc:
            log.debug("guardrails: %s failed: %s", what, exc)

    worker = threading.Thread(target=run, name="guardrails-last-words", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        log.warning("guardrails: gave up %s after %.0f s", what, timeout_s)
