"""The guard's start and close, past the bookkeeping ``Guard.start`` and ``Guard.close``
keep (its state, the one running guard, the atexit hook, the held signals): joining the
job (generation, run id, the run_dir's lock, the side group), installing the hooks and
starting the components, and closing them with the run's last event. Plain functions of
the guard they start or close; none runs per step.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from guardrails._errors import GuardrailsError
from guardrails.distributed import store
from guardrails.engine import ending, process, rundir, setup
from guardrails.engine.component import HOOKS, overrides

if TYPE_CHECKING:
    from collections.abc import Callable

    from guardrails.engine.guard import Guard

logger = logging.getLogger("guardrails.guard")

#: When this module was imported: the process start where /proc cannot say (not Linux).
#: Later than the real start by the interpreter's and torch's imports (~2-3 s).
_IMPORTED_AT = time.time()
#: The launchers' variables a start event records: which attempt of which job this is.
_LAUNCHER_ENV = {
    "torchelastic_run_id": "TORCHELASTIC_RUN_ID",
    "torchelastic_restart_count": "TORCHELASTIC_RESTART_COUNT",
    "slurm_job_id": "SLURM_JOB_ID",
    "slurm_restart_count": "SLURM_RESTART_COUNT",
}


def join_job(guard: Guard) -> None:
    """This guard's place in the job: its generation, the run id rank 0 drew, the
    run_dir's lock (rank 0 holds it for the job), the news counter and the side
    group. A run_dir another run holds is refused on every rank, before step one."""
    guard.generation = store.next_generation()
    published = store.publish_run_id(guard.generation)  # before the collective
    refusal: rundir.Refusal | None = None
    if guard.rank == 0:  # one holder per job: the other ranks share its run_dir
        refusal = _hold_directories(guard, published or "")
        # Published either way: the others wait for it.
        store.publish_refusal(guard.generation, None if refusal is None else refusal.encode())
    news_store = store.side_store(guard.generation, "news")
    guard.news = None if news_store is None else store.News(news_store, world=guard.world_size)
    guard.side_group = store.open_side_group()
    guard.run_id = store.read_run_id(guard.generation, published)
    if guard.rank != 0:
        text = store.read_refusal(guard.generation)
        refusal = None if text is None else rundir.Refusal.decode(text)
    if refusal is not None:
        # Not a word into the other run's events.jsonl: this run never began.
        events, guard.events = guard.events, None
        events.close()
        if guard.rank == 0:
            store.wait_refusal_read(guard.generation, guard.world_size)
        raise refusal.error(guard.rank)


def _hold_directories(guard: Guard, run_id: str) -> rundir.Refusal | None:
    """Rank 0's locks: run_dir's, then each directory outside it a component writes
    into (``Component.writes_into``: a checkpoint directory of its own); the first
    refusal, with the locks taken before it released."""
    wanted = {"run_dir": guard.run_dir}
    for c in guard.components:
        for knob, directory in c.writes_into().items():
            if not rundir.inside(directory, guard.run_dir):
                wanted.setdefault(knob, directory)
    for knob, directory in wanted.items():
        if not rundir.prepare(directory):
            continue  # it cannot be made: its writer says so at its first write
        lock = rundir.RunLock(directory, knob=knob)
        refusal = lock.acquire(run_id)
        if refusal is not None:
            for held in guard._run_locks:
                held.release()
            guard._run_locks = []
            return refusal
        guard._run_locks.append(lock)
    return None


def install(guard: Guard) -> None:
    """What ``Guard.start`` does once the guard has joined the job: the wrappers and
    hooks installed, the dispatch tables filled, the ``start`` event, each component's
    ``on_start`` (in order), benchmark mode."""
    guard._wrappers.install()
    attach = getattr(guard.model, "_guardrails_attach", None)
    if attach is not None:  # GuardedDDP: reports its all-reduces to the auditor
        handle = attach(guard)
        guard._handles.append(handle)
        # ...and takes each reduced bucket's norm: the step's, see gradnorm.py
        guard._norm.buckets = getattr(handle, "bucket_norms", None)
    for hook in HOOKS:
        guard._dispatch[hook] = [getattr(c, hook) for c in guard.components if overrides(c, hook)]
    # Filled as components start, so a start that fails closes only those that
    # started (like nested `with` blocks): on_end never sees half-made state.
    guard._dispatch["on_end"] = []
    guard._dispatch["on_abort"] = []
    guard._dispatch["on_news"] = []
    guard._live = guard._dispatch
    # Trainable parameters no optimizer updates: told once, by rank 0.
    warning = setup.coverage_warning(guard.model, guard.optimizers) if guard.rank == 0 else None
    if warning is not None:
        guard.event("params_not_in_optimizer", level="warning", **warning)
    guard.event(
        "start",
        run=guard.run_id,  # the same on every rank: tells runs in one run_dir apart
        world_size=guard.world_size,
        device=str(guard.device),
        components=[c.name for c in guard.components],
        launcher=launcher(),
        **process_started(),
    )
    guard._anatomy.start(guard.step, cuda=guard._device_type == "cuda")
    for c in guard.components:
        if overrides(c, "on_start"):
            c.on_start(guard)
        if overrides(c, "on_end"):
            guard._dispatch["on_end"].insert(0, c.on_end)  # reverse order
        if overrides(c, "on_abort"):
            guard._dispatch["on_abort"].insert(0, c.on_abort)
        if overrides(c, "on_news"):
            guard._dispatch["on_news"].insert(0, c.on_news)
    if guard.benchmark:
        from guardrails.engine.benchmark_mode import StepBenchmark

        guard._bench = StepBenchmark(guard, guard._dispatch)


def close(guard: Guard, exc: BaseException | None) -> None:
    """What ``Guard.close`` does once the guard is marked closed: benchmark mode's
    report, the components' ``on_end`` (in reverse order), the hooks removed, the grad
    norm's summary, the ``end`` event; then the error the user sees, raised."""
    errors: list[BaseException] = []
    if guard._bench is not None:
        bench, guard._bench = guard._bench, None
        guard._live = guard._dispatch
        try:
            bench.finish(guard)
        except Exception:  # a failed report must not hide the loop's own outcome
            logger.exception("guardrails: benchmark mode could not report")
    for fn in guard._dispatch["on_end"]:
        try:
            fn(guard, exc)
        except Exception as err:
            errors.append(err)
            if not isinstance(err, GuardrailsError):  # ours are raised on purpose
                logger.exception("guardrails: %r failed while closing", fn)
    # What a thread's news set off during the close (on_news: a failure save run again
    # with another committer) ends before the guard does, within a close's own bound.
    for thread in guard._news_threads:
        thread.join(_close_bound_s(guard))
    guard._wrappers.remove()
    for handle in guard._handles:
        handle.remove()
    guard._handles = []
    # What the grad norm's fast paths did this run, one event each (ending.py).
    for kind, fields in ending.norm_summary(guard._norm, guard.clip_norm_steps, guard.step):
        guard.event(kind, **fields)
    guard._dispatch = guard._live = {h: [] for h in HOOKS}
    store.close_side_group(guard.side_group)
    guard.side_group = None
    final = ending.final_error(exc, guard._replacement, errors)
    clean = final is None or (isinstance(final, SystemExit) and guard.exit_code is not None)
    # The guard's last store call is behind it: rank 0 (it may host the store) leaves last.
    store.leave(guard.generation, rank=guard.rank, world=guard.world_size, wait=clean)
    end_event(guard, final)
    if clean and guard.rank == 0:
        ending.point_to_report(guard.run_dir)
    if final is not None and exc is None:
        raise final
    if exc is not None and guard._replacement is not None:
        replacement, guard._replacement = guard._replacement, None
        raise replacement from exc
    if exc is None and guard.exit_code is not None:  # a signal save at the last step
        raise process.stop_exit(guard.exit_code, guard.stopping or "stopped by a signal")


# What a close may take beside its failure save: the auditor's and the watchdog's reads
# of the other ranks' last records (1 s and 3 heartbeats + 1 s with the defaults) and
# the joins of their threads, which stop within a tick.
_CLOSE_WAITS_S = 10.0


def _close_bound_s(guard: Guard) -> float:
    """What a close may take on its own: its failure save's limit (the longest
    ``abort_s``) and its waits for the other ranks' last records."""
    return max((c.abort_s for c in guard.components), default=0.0) + _CLOSE_WAITS_S


def during_close(guard: Guard, error: BaseException, *, after_s: float) -> None:
    """``Guard.fail_from_thread`` while the guard closes (a peer died during the
    close): ``error`` is news to the components still closing (``on_news``: a failure
    save waiting for that rank's commit), not the run's diagnosis, and it ends the
    process only if the close does not finish within ``after_s`` plus what a close
    takes on its own (its failure save's limit, the longest ``abort_s``, and its waits
    for the other ranks' last records). A close stuck in a collective with the dead
    peer ends; one still saving, or explaining an error of its own, finishes."""

    def last_resort() -> None:
        if guard._closing:
            guard.die(error)

    timer = threading.Timer(after_s + _close_bound_s(guard), last_resort)
    timer.daemon = True
    timer.start()

    def tell() -> None:
        for fn in list(guard._dispatch["on_news"]):
            try:
                fn(guard, error)
            except Exception as exc:  # news only: the close goes on either way
                logger.debug("guardrails: %r failed on news: %s", fn, exc)

    # In a thread of its own, which the close waits for (:func:`close`): a component
    # may act on the news for seconds (a failure save run again), and the caller, the
    # watchdog's thread, is joined by the close with a bound of its own.
    thread = threading.Thread(target=tell, name="guardrails-news", daemon=True)
    guard._news_threads.append(thread)
    thread.start()


def end_event(guard: Guard, error: BaseException | None, **fields: Any) -> None:
    """The run's last event, once: how it ended (``error``: ``None`` for a clean
    end; a signal stop's ``SystemExit`` is named by ``g.stopping``)."""
    events, guard.events = guard.events, None
    if events is None:
        return
    text = None
    if error is not None:
        text = getattr(error, "guardrails_message", None) or f"{type(error).__name__}: {error}"
        fields["error_type"] = type(error).__name__
        restartable = getattr(error, "restartable", None)  # a launcher's restart can fix it
        if restartable is not None:
            fields["restartable"] = bool(restartable)
    # How long the close or abort took before this event (the components' on_end: a
    # save, the last metrics): the failure's time is this event's less this.
    if guard._ending_at == guard._ending_at:  # not NaN: set by close() and last_words()
        fields["closing_s"] = round(max(0.0, time.time() - guard._ending_at), 6)
    events.emit("end", step=guard.step, error=text, **fields)
    events.close()


def die(guard: Guard, error: BaseException, *, exit_code: int | None) -> None:
    """``Guard.die``: the process ends with ``error`` after the components' failure
    saves (:func:`abort_saves`, given the longest ``abort_s`` a component declares: a
    failure save's limit), the process groups' abort, and the rest of their last words
    with the ``end`` event (:func:`last_words`); see ``process.die`` for the order."""
    extra_s = max((c.abort_s for c in guard.components), default=0.0)
    process.die(
        error,
        exit_code=exit_code,
        saves=lambda e: abort_saves(guard, e),
        last_words=guard._last_words,
        extra_s=extra_s,
    )


def abort_saves(guard: Guard, error: BaseException) -> None:
    """``Guard.die``'s first words, before the process groups are aborted: the
    components' ``on_abort`` (in reverse order) up to the last one that saves (declares
    ``abort_s``), with those before it (the efficiency guard puts the sync debug mode
    back, which the save's copies would trip)."""
    guard._ending_at = time.time()
    _run_on_abort(guard, error, _on_abort_split(guard)[0])


def last_words(guard: Guard, error: BaseException) -> None:
    """``Guard.die``'s, after the process groups are aborted: the other components'
    ``on_abort`` (in reverse order: the metrics the host holds) and the ``end`` event,
    marked aborted."""
    if guard._ending_at != guard._ending_at:  # NaN: no save ran before
        guard._ending_at = time.time()
    _run_on_abort(guard, error, _on_abort_split(guard)[1])
    end_event(guard, error, aborted=True)


def _on_abort_split(guard: Guard) -> tuple[list[Callable[..., Any]], list[Callable[..., Any]]]:
    """The ``on_abort`` hooks (reverse order) through the last that saves, and the rest."""
    hooks = guard._dispatch["on_abort"]
    saves = [i for i, fn in enumerate(hooks) if getattr(fn.__self__, "abort_s", 0.0) > 0]
    cut = saves[-1] + 1 if saves else 0
    return hooks[:cut], hooks[cut:]


def _run_on_abort(guard: Guard, error: BaseException, hooks: list[Callable[..., Any]]) -> None:
    for fn in hooks:
        try:
            fn(guard, error)
        except Exception as exc:  # the process ends either way; the rest still run
            logger.debug("guardrails: %r failed while aborting: %s", fn, exc)


def close_at_exit(guard: Guard) -> None:
    """At the interpreter's exit, a guard still open: close it with the exception
    that ended the script (an uncaught one, or the guard's own signal stop)."""
    if guard._state != "started":
        return
    exc = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if exc is None and guard.exit_code is not None:  # the guard's own signal stop
        exc = SystemExit(guard.exit_code)
    try:
        guard.close(exc)
    except BaseException as err:  # the process is ending; say so, do not raise
        logger.warning("guardrails: closing the guard at exit raised %r", err)


def launcher() -> dict[str, str | int] | None:
    """Which attempt of which job this process is, as its launcher numbers them:
    torchrun's run id and restart count, SLURM's job id and restart count (a requeue);
    only those set, ``None`` under neither. ``report`` tells a restart by them."""
    found: dict[str, str | int] = {}
    for key, name in _LAUNCHER_ENV.items():
        value = os.environ.get(name)
        if value:
            found[key] = int(value) if key.endswith("_count") and value.isdigit() else value
    return found or None


def process_started() -> dict[str, Any]:
    """When this process started (unix time), and from what: ``/proc/self/stat``'s
    start time (10 ms ticks after boot, set against ``/proc/uptime``), or where /proc
    cannot say, the import of this module (later than the real start by the imports)."""
    try:
        stat = Path("/proc/self/stat").read_text()
        # Field 22, starttime; the fields after the command's ")" begin at field 3.
        ticks = int(stat.rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        age = uptime - ticks / os.sysconf("SC_CLK_TCK")
        return {"process_started": time.time() - age, "process_started_from": "/proc/self/stat"}
    except (OSError, ValueError, IndexError):
        return {"process_started": _IMPORTED_AT, "process_started_from": "guardrails import"}
