"""The facts of one run, JSON-able: what ``report --json`` prints and the story is
told from. Each fact comes from the run's events and its streamed metrics
(:class:`~guardrails.cli.report_runs.Run`); which events count as warnings, failures and
advice is decided here, once. Torch-free.
"""

from __future__ import annotations

import datetime
import math
import os
import re
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Any

from guardrails.checkpoint import manifest
from guardrails.cli.report_runs import Run, _same_path, _source

if TYPE_CHECKING:
    from guardrails.cli.report_restarts import Restarts

#: Events shown as warnings in the story (each: kind -> short label).
_WARNINGS = {
    "leak": "leak",
    "oom": "out of memory",
    "data_starvation": "data starvation",
    "loss_not_decreasing": "loss not decreasing",
    "zero_grads": "zero gradients",
    "params_without_grad": "params without grad",
    "params_not_in_optimizer": "params not in optimizer",
    "straggler": "straggler",
    "slowdown": "slowdown",
    "comms_bound": "communication-bound",
}
#: The verdicts that end a run (watchdog, auditor), by event kind.
_FAILURES = {
    "hang": "hang",
    "rank_failed": "rank failed",
    "uneven_data": "uneven data",
    "collective_mismatch": "collective mismatch",
}
#: The efficiency advisor's kinds (info events, each with its fix), told in one line.
_ADVICE = {
    "tf32_off": "TF32 off",
    "bf16_available": "float32 where bf16 is native",
    "optimizer_not_fused": "optimizer not fused",
    "loader_no_workers": "DataLoader without workers",
    "loader_not_pinned": "DataLoader without pinned memory",
    "loader_shared_cores": "DataLoader workers on every core of a CPU run",
    "nan_guard_syncs": "a host sync a step for the NaN skip (optimizer not fused)",
}
#: Warning-level kinds told in lines of their own (NaN/Inf, spikes, the end), not
#: under "warnings".
_OWN_LINE = {"nonfinite", "spike", "stopped"}
#: Kinds the story tells in their own lines (the rest are counted under "other events").
_TOLD = {
    "start",
    "end",
    "stopped",
    "resumed",
    "nonfinite",
    "nonfinite_recovered",
    "spike",
    "gc_pause",
    "gc_frozen",
    "gc_freeze_skipped",
    "flops",
    *_ADVICE,
    *_FAILURES,
    *_WARNINGS,
}


def summarize(
    run: Run, run_dir: Path, runs: list[Run] | None = None, restarts: Restarts | None = None
) -> dict[str, Any]:
    """The facts of one run, JSON-able: what ``--json`` prints and the text is made of.
    ``runs``: every run in ``run_dir``, oldest first, to say which run a resume
    continued and which one continued a stopped run; ``restarts``: the job's restarts
    up to this run, streamed (``report_restarts``). The keys come in the order the
    story tells them (``--json`` prints them so)."""
    runs = runs if runs is not None else [run]
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for e in run.events:
        by_kind.setdefault(e.get("kind", "?"), []).append(e)
    s = _who(run, run_dir, by_kind)
    last_time = _how_far(run, s)
    _loss_story(run, by_kind, s)
    s.update(_incidents(by_kind, run_dir))
    s["warnings"] = _warnings(by_kind)
    s["failures"] = _failures(by_kind)
    s["checkpoints"] = _checkpoints(by_kind, run_dir)
    s["other_events"] = {
        k: n
        for k, es in sorted(by_kind.items())
        if k not in _TOLD
        and "checkpoint" not in k
        and (n := sum(1 for e in es if not _is_warning(e)))
    }
    s["mfu"] = _mfu(by_kind.get("flops", []), s)
    s["advice"] = [k for k in _ADVICE if by_kind.get(k)]
    s["resumed"] = _resumed(run, runs, run_dir)
    s["ended"] = _ended(run, by_kind, runs, run_dir)
    s["last_seen"] = _iso(last_time)
    s["failure_counts"] = _failure_counts(s)
    s["restarts"], s["job"] = restarts.facts() if restarts is not None else ([], None)
    return s


def _who(run: Run, run_dir: Path, by_kind: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Where and when the run started, its ranks, device and components."""
    start = next(iter(by_kind.get("start", [])), {})
    ranks = sorted(run.starts)
    return {
        "run_dir": str(run_dir),
        "started": _iso(run.started),
        "ranks": ranks,
        "world_size": start.get("world_size", len(ranks)),
        "device": start.get("device"),
        "components": start.get("components"),
    }


def _how_far(run: Run, s: dict[str, Any]) -> float:
    """The metric rows, the last step (of the rows or the events), each rank's last
    step and the wall time, into ``s``; returns the run's last sign of life."""
    stats = run.stats
    event_steps = [int(e.get("step", 0)) for e in run.events]
    s["metrics_rows"] = stats.rows if stats is not None else 0
    per_rank_steps = dict(sorted(stats.step_max.items())) if stats is not None else {}
    s["last_step"] = int(max([*per_rank_steps.values(), *event_steps, 0]))
    s["steps_per_rank"] = per_rank_steps
    times = [e["time"] for e in run.events]
    if stats is not None and stats.time_max > -math.inf:
        times.append(stats.time_max)
    last_time = max(times) if times else run.started
    s["wall_s"] = last_time - run.started
    return last_time


def _loss_story(run: Run, by_kind: dict[str, list[dict[str, Any]]], s: dict[str, Any]) -> None:
    """The metrics' numbers and the skipped steps, into ``s``."""
    # Rank 0 (or the lowest rank with rows) tells the loss story: under DDP the grad
    # norm is the same on every rank; losses differ by shard.
    if s["metrics_rows"] and run.stats is not None:
        s.update(run.stats.facts())
    else:
        s["skipped_steps"] = []
    # Skips the metrics have not caught (a crash before the part was written).
    for e in by_kind.get("nonfinite", []):
        if "skipped" in e.get("message", "") and int(e["step"]) not in s["skipped_steps"]:
            s["skipped_steps"] = sorted({*s["skipped_steps"], int(e["step"])})


def _incidents(by_kind: dict[str, list[dict[str, Any]]], run_dir: Path) -> dict[str, Any]:
    """The spikes, the non-finite steps, the recoveries and the longest GC pause."""
    pauses = by_kind.get("gc_pause", [])
    longest = max(pauses, key=lambda e: float(e.get("pause_s") or 0), default=None)
    return {
        "spikes": [
            {"step": e["step"], "rank": e.get("rank"), "message": e.get("message", "")}
            for e in by_kind.get("spike", [])
        ],
        "nonfinite": [
            {
                "step": e["step"],
                "rank": e.get("rank"),
                "cause": e.get("cause"),
                "message": e.get("message", ""),
                "path": _rel(e.get("path"), run_dir),
            }
            for e in by_kind.get("nonfinite", [])
        ],
        "recovered": [
            {"step": e["step"], "first_step": e.get("first_step"), "skipped": e.get("skipped")}
            for e in by_kind.get("nonfinite_recovered", [])
        ],
        "gc_longest_pause": (
            None
            if longest is None
            else {
                "step": longest["step"],
                "rank": longest.get("rank"),
                "pause_s": longest.get("pause_s"),
                "scheduled": longest.get("scheduled"),
            }
        ),
    }


def _warnings(by_kind: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Every warning the run logged that no other line tells (NaN/Inf, spikes and a
    signal stop have theirs): the known kinds first, then any other warning-level
    event, so "warnings none" never sits beside a warning."""
    return [
        {"kind": e["kind"], "step": e["step"], "rank": e.get("rank"), "message": e.get("message")}
        for kind in [*_WARNINGS, *sorted(k for k in by_kind if k not in _WARNINGS)]
        for e in by_kind.get(kind, [])
        if _is_warning(e)
    ]


def _failures(by_kind: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """What ended the run, told once: every rank reports the same verdict (the
    watchdog's and the auditor's are agreed across ranks), so identical ones merge."""
    failures: dict[tuple[str, int, str], list[int]] = {}
    for kind in _FAILURES:
        for e in by_kind.get(kind, []):
            key = (kind, int(e["step"]), e.get("message", ""))
            failures.setdefault(key, []).append(e.get("rank"))
    return [
        {
            "kind": kind,
            "step": step,
            "ranks": sorted(r for r in ranks if r is not None),
            "message": message,
        }
        for (kind, step, message), ranks in failures.items()
    ]


def _checkpoints(by_kind: dict[str, list[dict[str, Any]]], run_dir: Path) -> list[dict[str, Any]]:
    """One checkpoint per step, however many ranks logged writing their part of it."""
    saved: dict[tuple[int, str], dict[str, Any]] = {}
    for k, es in by_kind.items():
        if "checkpoint" in k or k == "save":
            for e in es:
                if not _is_warning(e):  # an invalid or skipped one is a warning, not a save
                    saved.setdefault((int(e["step"]), k), e)
    return [
        {
            "step": e["step"],
            "kind": e["kind"],
            "path": _rel(e.get("path"), run_dir),
            "refused": _refused(e.get("path")),
        }
        for _, e in sorted(saved.items(), key=lambda kv: kv[0])
    ]


def _refused(path: str | None) -> str | None:
    """Why a resume would refuse the checkpoint at ``path`` (a link, a file missing or
    of another size, a field it cannot load: the checks resume applies, all but the
    bytes' sha256, which ``inspect`` hashes), or ``None``: it would be taken, or it is
    gone (retention deletes the older ones)."""
    if not path or not os.path.lexists(path):
        return None
    ckpt = Path(path)
    try:
        found = manifest.problem(ckpt, entry=True, hash_bytes=False)
    except manifest.ManifestError as e:  # a newer format: resume stops there
        return f"{e.message}: {e.hint}"
    except OSError as e:
        return f"{ckpt} cannot be read: {e}"
    return None if found is None else found[1]


def _ended(
    run: Run, by_kind: dict[str, list[dict[str, Any]]], runs: list[Run], run_dir: Path
) -> dict[str, Any] | None:
    """How the run ended, from its ``end`` events: cleanly, with an error, stopped by a
    signal; which ranks logged no end; ``None`` when none did (the process died)."""
    ends = by_kind.get("end", [])
    if not ends:
        return None
    errors = [e for e in ends if e.get("error")]
    return {
        "clean": not errors,
        "ranks": sorted({e.get("rank") for e in ends}),
        "step": max(int(e["step"]) for e in ends),
        "error": errors[0]["error"] if errors else None,
        "error_rank": errors[0].get("rank") if errors else None,
        "aborted": bool(errors[0].get("aborted")) if errors else False,
        "missing_ranks": sorted(set(run.starts) - {e.get("rank") for e in ends}),
        "preempted": _preempted(run, by_kind, errors, runs, run_dir),
    }


def _mfu(events: list[dict[str, Any]], s: dict[str, Any]) -> dict[str, Any] | None:
    """Model FLOPs utilisation: the FLOPs of one step (the ``flops`` event of the rank
    whose metrics tell the story) over the median step time and the device's peak."""
    if not events:
        return None
    lead = s.get("lead_rank")
    e = next((e for e in events if e.get("rank") == lead), events[0])
    flops, peak = e.get("flops_per_step"), e.get("peak_flops")
    step_s = s.get("step_time_median_s")
    out = {
        "flops_per_step": flops,
        "peak_flops": peak,
        "dtype": e.get("dtype"),
        "device_name": e.get("device_name"),
        "rank": e.get("rank"),
        "message": e.get("message"),
        "mfu": None,
    }
    if flops and peak and step_s:
        out["mfu"] = float(flops) / (float(step_s) * float(peak))
    return out


def _is_warning(e: dict[str, Any]) -> bool:
    """A warning the warnings line lists: an event logged at WARNING that no line of
    its own tells. A known warning kind logged as information is not one (a slowdown
    while other processes held the CPU: the machine's, not the loop's)."""
    return e.get("level", "warning") == "warning" and e.get("kind") not in _OWN_LINE


def _failure_counts(s: dict[str, Any]) -> dict[str, int]:
    """What went wrong, counted from the events the story tells: the verdicts that
    ended the run (merged across ranks), an end with an error (a signal stop is not
    one), the skipped steps, and non-finite steps whose update went in anyway (policy
    "warn"; a skipped one is counted once, as skipped)."""
    e = s["ended"]
    skipped = set(s["skipped_steps"])
    return {
        "verdicts": len(s["failures"]),
        "error_end": int(bool(e and e["error"] and not e.get("preempted"))),
        "skipped_steps": len(skipped),
        "nonfinite_not_skipped": len(
            {int(d["step"]) for d in s["nonfinite"] if int(d["step"]) not in skipped}
        ),
    }


_SIGNAL_EXIT = re.compile(r"^SystemExit: (\d+)$")


def _preempted(
    run: Run,
    by_kind: dict[str, list[dict[str, Any]]],
    errors: list[dict[str, Any]],
    runs: list[Run],
    run_dir: Path,
) -> dict[str, Any] | None:
    """How a run stopped by a signal ended: the signal, the step, the checkpoint saved
    (the ``stopped`` event) and the run that resumed from it; ``None`` otherwise. A
    signal stop ends with a non-zero exit (128 + the signal: 143 for SIGTERM), which
    the ``end`` event records like an error; it is not one."""
    stopped = by_kind.get("stopped", [])
    if stopped:
        first = min(stopped, key=lambda e: (int(e["step"]), e.get("rank", 0)))
        path = first.get("path")
        out = {
            "signal": first.get("signal") or "a signal",
            "step": int(first["step"]),
            "checkpoint": _rel(path, run_dir),
            "resumed_by": None,
        }
        later = runs[runs.index(run) + 1 :] if run in runs else []
        for i, other in enumerate(later, runs.index(run) + 2):
            for e in other.events:
                if e.get("kind") == "resumed" and _same_path(e.get("path"), path):
                    out["resumed_by"] = i
                    return out
        return out
    # A signal stop that saved nothing (no SignalCheckpointer): "SystemExit: 143".
    for e in errors:
        m = _SIGNAL_EXIT.match((e.get("error") or "").strip())
        if m and 128 < int(m.group(1)) < 128 + 65:
            num = int(m.group(1)) - 128
            try:
                name = signal.Signals(num).name
            except ValueError:
                name = f"signal {num}"
            return {"signal": name, "step": int(e["step"]), "checkpoint": None, "resumed_by": None}
    return None


def _resumed(run: Run, runs: list[Run], run_dir: Path) -> dict[str, Any] | None:
    """Where a resumed run continued from: the step, the checkpoint and the earlier run
    that saved it (whose rows up to that step start this run's plot)."""
    ev = next((e for e in run.events if e.get("kind") == "resumed"), None)
    if ev is None:
        return None
    src = _source(run, runs, ev)
    return {
        "step": int(ev["step"]),
        "checkpoint": _rel(ev.get("path"), run_dir),
        "from_run": runs.index(src) + 1 if src is not None else None,
        "earlier_rows": run.earlier.rows if run.earlier is not None else 0,
    }


def _iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime(
        "%Y-%m-%d %H:%M:%S UTC"
    )


def _rel(path: str | None, run_dir: Path) -> str | None:
    if not path:
        return None
    try:
        return str(Path(path).resolve().relative_to(run_dir.resolve()))
    except ValueError:
        return path
