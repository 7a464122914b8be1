"""The restarts of a job, for ``report``: each one's cause, the time from the fault to
training again and the steps redone, and the job's goodput.

A job is a chain of runs in one run_dir (its *attempts*), each attempt continuing the
one before it after a failure. A run continues the run before it when their launcher
says so (the same SLURM job id or torchrun run id with a higher restart count, on the
``start`` events) or when it resumed a checkpoint that run saved or had itself resumed
(its ``resumed`` event), unless that run had ended cleanly (a finished run extended is
not a restart).

A restart from attempt P to attempt N is timed by six instants, each from the events
and the metrics rows (``metrics.parquet``), and told as five phases:

* the **fault**: an exception's time (P's ``end`` less its ``closing_s``: when the
  guard began to close on it); for a hang or a dead rank, P's last progress before the
  verdict (the last finished step on any rank: the watchdog claims a hang ``timeout``
  seconds after it); for a signal, the step boundary it stopped at; for a process
  killed without a word, its last sign of life;
* the **verdict**: the first verdict event (``hang``, ``rank_failed``, ...); for an
  exception without one, the other ranks' first sign of it (a stop, a close), else the
  fault itself (a single process's exception, a signal, are their own verdict);
* **exited**: P's last ``end`` event (a save on the way out is in *exit*);
* **restarted**: N's first process start (``process_started`` on its ``start`` event);
* **ready**: N's last ``resumed`` event (the checkpoint loaded), else its last ``start``;
* **training**: N's first step finished, on its slowest rank (its first metrics row).

detection = fault -> verdict, exit = verdict -> exited, restart -> restarted, load ->
ready, first step -> training. A phase whose end is unknown is ``None`` and the next
one is timed from the last known instant. Torch-free.
"""

from __future__ import annotations

import math
import re
import signal
from typing import Any

import numpy as np

from guardrails.cli.report_runs import Run, _same_path, _source
from guardrails.cli.report_stats import Feed, Key, Rows
from guardrails.cli.report_summary import _SIGNAL_EXIT

#: The events that name a failure; for the first two the fault came before: the last
#: progress (the watchdog claims a hang its timeout after it, a dead rank is seen late).
_VERDICTS = ("hang", "rank_failed", "uneven_data", "collective_mismatch")
_SILENT = ("hang", "rank_failed")
#: The phases of a restart, each ending at its instant (see the module's docstring).
PHASES = ("detection", "exit", "restart", "load", "first_step")
_ERROR_TYPE = re.compile(r"^([A-Za-z_][\w.]*): ")
#: Launcher ids that do not name a job (torchrun's default --rdzv-id).
_NO_JOB = {"", "none", "None"}


class UsefulTime:
    """The step seconds of one attempt's lead rank that no later attempt redid: the
    feed's bound is the lowest step a later attempt resumed from. The attempt's first
    row is left out: its time holds the start-up (and after a restart, the first step
    is timed as the restart's)."""

    def __init__(self, first_step: int) -> None:
        self.first_step = first_step
        self.seconds = 0.0
        self.steps = 0

    def add(self, rows: Rows) -> None:
        t = rows["step_time_s"][rows["step"] > self.first_step].astype(np.float64)
        t = t[np.isfinite(t)]
        self.seconds += float(t.sum())
        self.steps += len(t)


class Attempt:
    """One run of a job, read for what its restarts need."""

    def __init__(self, run: Run, number: int) -> None:
        self.run = run
        self.number = number  # 1-based, among the run_dir's runs
        self.starts = [e for e in run.events if e.get("kind") == "start"]
        self.ends = [e for e in run.events if e.get("kind") == "end"]
        self.resumes = [e for e in run.events if e.get("kind") == "resumed"]
        self.useful: list[UsefulTime] = []

    @property
    def launcher(self) -> dict[str, Any]:
        return next((e["launcher"] for e in self.starts if e.get("launcher")), None) or {}

    @property
    def resumed_step(self) -> int:
        return max((int(e["step"]) for e in self.resumes), default=0)

    @property
    def last_step(self) -> int:
        """The last step any rank finished: its metrics rows, else its events."""
        rows = (k.done_step for k in self.run.keys.values())
        return max([*rows, *(int(e.get("step", 0)) for e in self.run.events)], default=0)

    def last_progress(self, before: float) -> float | None:
        """When the newest step finished on any rank, not after ``before``."""
        done = [k.done_time for k in self.run.keys.values() if k.done_time <= before + 1e-3]
        return max(done, default=None)

    def last_sign(self, ranks: list[int] | None = None) -> float:
        """Its last sign of life (of ``ranks``, when they left any): the newest event or
        finished step."""
        for among in ([ranks] if ranks else []) + [None]:
            times = [float(e["time"]) for e in self.run.events if _of(e.get("rank", 0), among)]
            keys = [k for (r, _), k in self.run.keys.items() if _of(r, among)]
            times += [t for k in keys for t in (k.done_time, k.first_time) if t == t]
            if times:
                return max(times)
        return self.run.started

    @property
    def process_started(self) -> float:
        """When its first process started; its first ``start`` event in older logs."""
        got = [float(e["process_started"]) for e in self.starts if e.get("process_started")]
        return min(got, default=self.run.started)

    @property
    def ready(self) -> float:
        """When every rank had loaded its checkpoint (or started, with none to load)."""
        if self.resumes or self.starts:
            return max(float(e["time"]) for e in self.resumes or self.starts)
        return self.run.started  # no start event (events off): its first metrics row

    @property
    def training(self) -> float | None:
        """When its first step finished on the slowest rank (``None``: no rows)."""
        firsts = [k.first_time for k in self.run.keys.values() if k.first_time == k.first_time]
        return max(firsts, default=None)

    @property
    def clean(self) -> bool:
        """Ended cleanly on every rank, no signal stop among them."""
        stopped = any(e.get("kind") == "stopped" for e in self.run.events)
        return (
            bool(self.ends)
            and not stopped
            and not any(e.get("error") for e in self.ends)
            and {e.get("rank") for e in self.ends} >= set(self.run.starts)
        )


def job_of(run: Run, runs: list[Run]) -> list[Run]:
    """The runs of ``run``'s job up to it, oldest first: ``run`` and each run it
    continued after a failure (see the module's docstring)."""
    chain = [run]
    while (i := runs.index(chain[0])) > 0 and _continues(runs[i - 1], chain[0], runs):
        chain.insert(0, runs[i - 1])
    return chain


def _continues(prev: Run, run: Run, runs: list[Run]) -> bool:
    """Whether ``run`` is the attempt after ``prev``: relaunched by the launcher, or
    resumed from what ``prev`` saved or resumed, ``prev`` having failed."""
    before, after = Attempt(prev, 0), Attempt(run, 0)
    if _relaunched(before.launcher, after.launcher):
        return True
    if not after.resumes or before.clean:
        return False
    ev = after.resumes[0]
    if _source(run, runs, ev) is prev:
        return True
    return any(_same_path(e.get("path"), ev.get("path")) for e in before.resumes)


def _relaunched(old: dict[str, Any], new: dict[str, Any]) -> bool:
    """Whether the launcher started ``new`` as a later attempt of ``old``'s job: the
    same SLURM job (else torchrun run id), a higher restart count."""
    for key in ("slurm_job_id", "torchelastic_run_id"):
        job = old.get(key)
        if job is not None and str(job) not in _NO_JOB and job == new.get(key):
            return _counts(new) > _counts(old)
    return False


def _counts(launcher: dict[str, Any]) -> tuple[int, int]:
    """The attempt's number: SLURM's requeues, then torchrun's restarts within one."""
    slurm, torchrun = (str(launcher.get(f"{k}_restart_count")) for k in ("slurm", "torchelastic"))
    return (int(slurm) if slurm.isdigit() else 0, int(torchrun) if torchrun.isdigit() else 0)


def _of(rank: int, ranks: list[int] | None) -> bool:
    return ranks is None or rank in ranks


class Restarts:
    """The restarts of the job that ``run`` ends (``runs``: every run of the run_dir,
    oldest first): :meth:`feeds` for the one streaming pass over the metrics, then
    :meth:`facts`."""

    def __init__(self, run: Run, runs: list[Run]) -> None:
        self.attempts = [Attempt(r, runs.index(r) + 1) for r in job_of(run, runs)]
        #: False when the metrics could not be streamed: no useful time, no goodput.
        self.streamed = True

    def feeds(self) -> dict[Key, list[Feed]]:
        """The useful step time of each attempt (none for a job of one attempt): its
        lead rank's rows up to the lowest step a later attempt resumed from."""
        feeds: dict[Key, list[Feed]] = {}
        if len(self.attempts) < 2:
            return feeds
        for i, a in enumerate(self.attempts):
            if not a.run.keys:
                continue
            bound = min((b.resumed_step for b in self.attempts[i + 1 :]), default=math.inf)
            lead = min(r for r, _ in a.run.keys)
            for key, info in a.run.keys.items():
                if key[0] == lead:
                    useful = UsefulTime(info.step_min)
                    a.useful.append(useful)
                    feeds.setdefault(key, []).append((useful.add, bound))
        return feeds

    def facts(self) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
        """Each restart's facts, and the job's (``None`` without a restart)."""
        if len(self.attempts) < 2:
            return [], None
        pairs = zip(self.attempts, self.attempts[1:], strict=False)
        restarts = [restart(p, n) for p, n in pairs]
        first, last = self.attempts[0], self.attempts[-1]
        wall = last.last_sign() - first.process_started
        useful = sum(u.seconds for a in self.attempts for u in a.useful)
        known = self.streamed and wall > 0
        job = {
            "attempts": len(self.attempts),
            "runs": [a.number for a in self.attempts],
            "wall_s": wall,
            "useful_step_s": useful if self.streamed else None,
            "useful_steps": sum(u.steps for a in self.attempts for u in a.useful),
            "goodput": useful / wall if known else None,
            "steps_redone": sum(r["steps_redone"] for r in restarts),
            # Their steps count as not useful: no row says how long they took.
            "runs_without_rows": [a.number for a in self.attempts if not a.run.keys],
        }
        return restarts, job


def restart(prev: Attempt, new: Attempt) -> dict[str, Any]:
    """One restart's facts: from ``prev``'s failure to ``new`` training again."""
    first = _first_failure(prev)
    cause = _cause(prev, first)
    fault, verdict, fault_is = _fault(prev, first, cause["missing_ranks"])
    exited = max((float(e["time"]) for e in prev.ends), default=None)
    instants = (verdict, exited, new.process_started, new.ready, new.training)
    phases: dict[str, float | None] = {}
    known = fault
    for name, at in zip(PHASES, instants, strict=True):
        phases[f"{name}_s"] = None if at is None or known is None else max(0.0, at - known)
        known = at if at is not None else known
    load = [float(e["load_s"]) for e in new.resumes if e.get("load_s") is not None]
    saves = [e for e in prev.run.events if e.get("kind") == "failure_saved"]
    # The committer's, whose phases say how long it waited for the others' parts.
    saved = next((e for e in saves if "committed" in (e.get("phases") or {})), None)
    saved = saved or (saves[0] if saves else None)
    return {
        "from_run": prev.number,
        "to_run": new.number,
        "cause": cause,
        "fault_time": fault,
        "fault_is": fault_is,
        "verdict_time": verdict,
        **phases,
        "checkpoint_load_s": max(load, default=None),
        "to_training_s": (
            None if fault is None or new.training is None else max(0.0, new.training - fault)
        ),
        "last_step": prev.last_step,
        "resumed_step": new.resumed_step,
        "steps_redone": max(0, prev.last_step - new.resumed_step),
        "failure_saved": None
        if saved is None
        else {
            k: saved.get(k)
            for k in ("path", "step", "state", "seconds", "rank", "missing", "why", "phases")
        },
        "process_started_from": next(
            (e.get("process_started_from") for e in new.starts if e.get("process_started_from")),
            "start event",
        ),
    }


#: The failure a rank said first: when (its guard began to close on it, or stopped),
#: its event, and the signal's name for a signal stop (``None``: an error).
Failure = tuple[float, dict[str, Any], str | None]


def _first_failure(prev: Attempt) -> Failure | None:
    """The failure that came first in ``prev``: an ``end`` with an error, or a signal
    stop (its ``stopped`` event, or the ``SystemExit: 143`` end of a stop that saved
    nothing); ``None`` when no rank said a word of one. Under torchrun a rank's error
    makes the launcher SIGTERM the others: their stop comes after, and is not the cause."""
    found: list[Failure] = [
        (float(e["time"]), e, str(e.get("signal") or "a signal"))
        for e in prev.run.events
        if e.get("kind") == "stopped"
    ]
    found += [(_began(e), e, _signal_exit(str(e["error"]))) for e in prev.ends if e.get("error")]
    return min(found, key=lambda f: f[0], default=None)


def _cause(prev: Attempt, first: Failure | None) -> dict[str, Any]:
    """Why ``prev`` ended: its first error, a signal stop, or no word at all."""
    missing = sorted(set(prev.run.starts) - {e.get("rank") for e in prev.ends})
    cause: dict[str, Any] = {"kind": "killed", "message": "", "error_type": None, "rank": None}
    cause.update(step=prev.last_step, restartable=None, missing_ranks=missing)
    if first is None and prev.ends and not missing:  # relaunched all the same
        cause.update(
            kind="after_close",
            message="every rank's guard closed cleanly; the "
            "process failed after it (the launcher restarted the job)",
        )
        return cause
    if first is None:
        who = "" if not prev.ends else f"rank(s) {', '.join(map(str, missing))} "
        cause["message"] = f"{who}killed without a word"
        return cause
    _, e, name = first
    cause.update(rank=e.get("rank"), step=int(e["step"]))
    if name is not None:
        cause.update(kind="signal", message=f"stopped by {name}, a pre-emption")
        return cause
    message = str(e["error"]).strip().splitlines()[0]
    m = _ERROR_TYPE.match(message)
    cause.update(kind="error", message=message, restartable=e.get("restartable"))
    cause["error_type"] = e.get("error_type") or (m.group(1) if m else None)
    return cause


def _fault(
    prev: Attempt, first: Failure | None, missing: list[int]
) -> tuple[float | None, float | None, str]:
    """The fault's time, the verdict's, and what the fault's time is. An error raised
    before any verdict is the fault, seen by the verdict, else by the other ranks'
    first sign of it (a stop, or their guards beginning to close), else by itself. A
    hang's or a dead rank's fault is the last progress before its verdict; a signal
    stop's, the step boundary it stopped at."""
    verdicts = [e for e in prev.run.events if e.get("kind") in _VERDICTS]
    verdict = min(verdicts, key=lambda e: float(e["time"])) if verdicts else None
    at = None if verdict is None else float(verdict["time"])
    if first is not None and first[2] is None and (at is None or first[0] <= at):
        rank = first[1].get("rank")
        peers = [
            _began(e)
            for e in prev.run.events
            if e.get("rank") != rank
            and (e.get("kind") == "stopped" or (e.get("kind") == "end" and e.get("error")))
        ]
        seen = at if at is not None else min(peers, default=first[0])
        return first[0], seen, "error"
    if verdict is not None and at is not None:
        if verdict["kind"] in _SILENT:
            return prev.last_progress(at), at, "last progress"
        return at, at, "verdict"
    if first is not None:
        boundary = prev.last_progress(first[0]) or first[0]
        return boundary, boundary, "signal stop"
    return prev.last_sign(missing), None, "last sign of life"


def _began(e: dict[str, Any]) -> float:
    """When the guard began to close or abort: an ``end`` event's time less the close's
    own seconds (its saves); any other event's time."""
    return float(e["time"]) - float(e.get("closing_s") or 0.0)


def _signal_exit(error: str) -> str | None:
    """The signal's name of a signal stop's ``SystemExit: 143`` (128 + the signal);
    ``None`` for any other error."""
    m = _SIGNAL_EXIT.match(error.strip())
    if not m or not 128 < int(m.group(1)) < 128 + 65:
        return None
    try:
        return signal.Signals(int(m.group(1)) - 128).name
    except ValueError:
        return f"signal {int(m.group(1)) - 128}"
