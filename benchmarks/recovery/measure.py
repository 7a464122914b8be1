"""The recovery benchmark's arithmetic: the fault schedule, and what the ranks' clock logs say.

No processes here: ``driver.py`` runs the job and calls these on what it recorded, and
``tests/test_recovery_bench.py`` calls them on a synthetic log.

An event is one line of a rank's ``log/rankR.jsonl`` (see ``train.py``) with ``rank`` added:
``{"ev": "step", "t": wall clock, "rank": 0, "pid": ..., "step": 12, "dt": 0.2, "nan": false}``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

FAULT_KINDS = ("kill9", "hang", "nan", "sigterm", "node")


def schedule(*, minutes: float, fault_every_s: float, kinds: list[str]) -> list[tuple[float, str]]:
    """(seconds after the start, kind) of each fault: every ``fault_every_s``, the kinds in turn.

    The last fault comes at least half an interval before the end, so that its recovery is
    inside the run."""
    out = []
    k = 1
    while k * fault_every_s <= minutes * 60 - fault_every_s / 2:
        out.append((k * fault_every_s, kinds[(k - 1) % len(kinds)]))
        k += 1
    return out


def read_events(log_dir: Path) -> list[dict]:
    """Every rank's events, in clock order (a line cut short by a SIGKILL is dropped)."""
    events = []
    for path in sorted(log_dir.glob("rank*.jsonl")):
        rank = int(path.stem.removeprefix("rank"))
        for line in path.read_text().splitlines():
            try:
                events.append({**json.loads(line), "rank": rank})
            except json.JSONDecodeError:
                continue
    return sorted(events, key=lambda e: e["t"])


@dataclass
class Recovery:
    """One fault, from its injection to the first step trained after it (clock seconds)."""

    kind: str
    fault_t: float
    last_step_before: int  # the newest step finished (on any rank) before the fault
    detect_s: float | None  # fault -> first error line or exit of any rank, or of the job
    exit_s: float | None  # fault -> the job's (or, under torchrun restarts, the ranks') exit
    restart_s: float | None  # fault -> the first restarted process's start
    resumed_s: float | None  # fault -> every restarted rank has loaded its state
    training_s: float | None  # fault -> rank 0's first step finished after it
    resumed_step: int | None  # the step the restarted job resumed from
    steps_redone: int | None  # last_step_before - resumed_step
    restarted: bool  # whether the job restarted (a fault absorbed in-process did not)

    def row(self) -> dict:
        return asdict(self)


def _first(events: list[dict], after: float, ev: str, before: float = float("inf")) -> list[dict]:
    return [e for e in events if e["ev"] == ev and after < e["t"] < before]


def recovery(
    kind: str,
    fault_t: float,
    events: list[dict],
    *,
    until_t: float,
    exits: list[float],
    error_lines: list[float],
) -> Recovery:
    """What the logs say about the fault at ``fault_t``; ``until_t`` is the next fault's time.

    ``exits`` are the clock times the driver saw the job (every agent) end, ``error_lines``
    those of the agents' output lines that name an error (torchrun's, the ranks' stderr)."""
    before = [e["step"] for e in events if e["ev"] == "step" and e["t"] < fault_t]
    last = (
        before[-1] if before else 0
    )  # the newest in time: an earlier attempt may have gone further
    ends = [e["t"] for e in _first(events, fault_t, "error", until_t)]
    ends += [t for t in error_lines + exits if fault_t < t < until_t]
    detect = min(ends, default=None)
    job_exit = min((t for t in exits if fault_t < t < until_t), default=None)
    starts = _first(events, fault_t, "start", until_t)
    restart = min((e["t"] for e in starts), default=None)
    exit_t = job_exit
    if exit_t is None and restart is not None:  # torchrun restarted the ranks itself
        exit_t = max((e["t"] for e in _first(events, fault_t, "error", restart)), default=None)
    rec = Recovery(kind, fault_t, last, None, None, None, None, None, None, None, False)
    rec.detect_s = None if detect is None else detect - fault_t
    rec.exit_s = None if exit_t is None else exit_t - fault_t
    if restart is None:  # absorbed in-process: training again at the first clean step
        clean = [e for e in _first(events, fault_t, "step", until_t) if not e.get("nan")]
        clean = [e for e in clean if e["rank"] == 0]
        if clean:
            rec.training_s = clean[0]["t"] - fault_t
            rec.steps_redone = 0
        return rec
    rec.restarted = True
    rec.restart_s = restart - fault_t
    resumed: dict[int, dict] = {}
    for e in _first(events, restart, "resumed", until_t):
        resumed.setdefault(e["rank"], e)
    if resumed:
        rec.resumed_s = max(e["t"] for e in resumed.values()) - fault_t
        rec.resumed_step = min(e["step"] for e in resumed.values())
        rec.steps_redone = last - rec.resumed_step
        first = [e for e in _first(events, restart, "step", until_t) if e["rank"] == 0]
        if first:
            rec.training_s = first[0]["t"] - fault_t
    return rec


def final_history(events: list[dict], rank: int = 0) -> dict[int, dict]:
    """Each step's last run on ``rank``: the steps the final weights are made of (a step whose
    update was skipped, its loss NaN, made nothing)."""
    history: dict[int, dict] = {}
    for e in events:
        if e["ev"] == "step" and e["rank"] == rank and not e.get("nan"):
            history[e["step"]] = e
    return history


def goodput(
    events: list[dict], *, start_t: float, end_t: float, final_step: int | None = None
) -> dict:
    """Useful step time (each unique step's own seconds, once) over the wall time.

    Only the steps up to ``final_step`` count: those past it, trained by an attempt that died
    before any save, made none of the final weights."""
    history = final_history(events)
    if final_step is not None:
        history = {s: e for s, e in history.items() if s <= final_step}
    useful = sum(e["dt"] for e in history.values())
    all_steps = [e for e in events if e["ev"] == "step" and e["rank"] == 0]
    wall = end_t - start_t
    return {
        "wall_s": wall,
        "useful_s": useful,
        "goodput": useful / wall if wall > 0 else 0.0,
        "unique_steps": len(history),
        "steps_run": len(all_steps),
        "steps_redone": len(all_steps) - len(history),
        "nan_steps": sum(1 for e in all_steps if e.get("nan")),
    }
