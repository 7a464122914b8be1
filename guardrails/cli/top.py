"""``python -m guardrails top RUN_DIR``: a running job, every rank at once, from any
machine that sees its run directory.

One row per rank (per node at more than ``--per-rank-up-to`` ranks, with the ranks
that stand out shown on their own): the step, the step time and its trend, the phase
shares, the main thread's CPU use (busy computing, or blocked: a collective, a sleep, a
lock), the GPU's utilisation and memory where there is one, the rank's last event and
the time since its last step; and a job line: tokens/s, goodput, the ETA to the end of
the pass. It reads the files the ranks' watchdog threads write into ``RUN_DIR/live/``
(``guards/watchdog/live.py``): reading them costs the job nothing. A single process
is a job of one rank; ``guard(watchdog=False)`` publishes nothing. No torch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from guardrails.cli.report_runs import read_events
from guardrails.metrics import live

#: Up to this many ranks, one row each; above, one row per node and the outliers.
PER_RANK_UP_TO = 16
#: A rank whose step time is this much above the job's median stands out (a straggler).
SLOW_FACTOR = 1.3


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "top",
        help="a running job's ranks live: step, step time, phases, CPU, GPU, last event",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog="See docs/cli.md, 'top and stacks'.",
    )
    p.add_argument("run_dir", type=Path, help="the guard's run_dir")
    p.add_argument("--once", action="store_true", help="print one snapshot and exit")
    p.add_argument("--json", action="store_true", help="print the snapshot as JSON")
    p.add_argument("--every-s", type=float, default=2.0, help="refresh period (default 2 s)")
    p.add_argument(
        "--per-rank-up-to",
        type=int,
        default=PER_RANK_UP_TO,
        help=f"one row per rank up to this many ranks, else per node (default {PER_RANK_UP_TO})",
    )
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    if not live.node_files(args.run_dir):
        print(
            f"guardrails top: no live snapshot in {args.run_dir} (no {live.LIVE_DIR}/node*.json): "
            "the job has not started its guard yet, runs with guard(watchdog=False) (the "
            "live view comes with the watchdog), or this is not its run_dir."
        )
        return 2
    tty = sys.stdout.isatty() and not (args.once or args.json)
    try:
        while True:
            snap = snapshot(args.run_dir)
            if args.json:
                print(json.dumps(snap, default=str))
            else:
                text = render(snap, per_rank_up_to=args.per_rank_up_to)
                # Redrawn in place on a terminal: home, clear, the table.
                print(("\x1b[H\x1b[2J" if tty else "") + text, flush=True)
            if args.once:
                return 0
            time.sleep(args.every_s)
            if not tty and not args.json:
                print()
    except KeyboardInterrupt:
        return 0


# ---------------------------------------------------------------------- the snapshot


def snapshot(
    run_dir: Path, *, run_id: str | None = None, as_of_last: bool = False
) -> dict[str, Any]:
    """Every rank's row and the job's line, as ``--json`` prints them: of run ``run_id``
    only where given; ``as_of_last``: as at the newest record's time (``report``'s view
    of a run that ended), not now."""
    records = {
        r: rec
        for r, rec in live.read_snapshot(run_dir).items()
        if run_id is None or rec.get("run_id") == run_id
    }
    now = time.time()
    if as_of_last and records:
        now = max(float(rec.get("time", 0)) for rec in records.values())
    last = _last_events(run_dir, records)
    rows = [_row(rec, last.get(r), now) for r, rec in sorted(records.items())]
    return {"time": now, "run_dir": str(run_dir), "job": _job(rows, now), "ranks": rows}


def _row(rec: dict[str, Any], event: dict[str, Any] | None, now: float) -> dict[str, Any]:
    running = rec.get("state") == "running"
    since = now - rec["last_step_at"] if running and rec.get("last_step_at") else None
    return {
        "rank": rec["rank"],
        "run_id": rec.get("run_id"),
        "node": rec.get("node"),
        "host": str(rec.get("host", "")).split("|")[0],
        "state": rec.get("state"),
        "error": rec.get("error"),
        "step": rec.get("step"),
        "step_time_s": rec.get("step_time_s"),
        "trend": rec.get("trend"),
        "phases": rec.get("phases"),
        "cpu": rec.get("cpu"),
        "gpu": rec.get("gpu"),
        "where": rec.get("where"),
        "since_step_s": None if since is None else round(since, 1),
        "tokens_per_s": rec.get("tokens_per_s"),
        "goodput": rec.get("goodput"),
        "eta_s": rec.get("eta_s"),
        "last_event": None if event is None else _event_text(event),
        "age_s": round(max(0.0, now - float(rec.get("written") or rec.get("time") or now)), 1),
        "counts": rec.get("counts"),
    }


def _job(rows: list[dict[str, Any]], now: float) -> dict[str, Any]:
    def known(key: str) -> list[float]:
        return [r[key] for r in rows if r.get(key) is not None]

    tokens, goodput, eta = known("tokens_per_s"), known("goodput"), known("eta_s")
    steps = known("step")
    return {
        "ranks": len(rows),
        "nodes": len({r["node"] for r in rows}),
        "running": sum(r["state"] == "running" for r in rows),
        "step": max(steps) if steps else None,
        "tokens_per_s": round(sum(tokens), 1) if tokens else None,
        "goodput": round(min(goodput), 3) if goodput else None,
        # The slowest rank ends the pass; a job that ended has none.
        "eta_s": max(eta) if eta and any(r["state"] == "running" for r in rows) else None,
        "age_s": max((r["age_s"] for r in rows), default=None),
    }


def _last_events(run_dir: Path, records: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Each rank's newest event of this run (at or after its guard's start)."""
    out: dict[int, dict[str, Any]] = {}
    for ev in read_events(run_dir):
        rank = ev.get("rank")
        rec = records.get(rank) if isinstance(rank, int) else None
        if rec is not None and float(ev.get("time", 0)) >= float(rec.get("started", 0)) - 1:
            out[rank] = ev
    return out


def _event_text(ev: dict[str, Any]) -> str:
    return f"{ev.get('kind')} (step {ev.get('step')})"


# ---------------------------------------------------------------------- the text


def render(snap: dict[str, Any], *, per_rank_up_to: int = PER_RANK_UP_TO) -> str:
    """The snapshot as ``top`` shows it: the job line, then the rows."""
    rows, job = snap["ranks"], snap["job"]
    lines = [_job_line(job, snap)]
    if not rows:
        return lines[0]
    header = (
        f"{'rank':>9} {'step':>7} {'step time':>9} {'trend':>6}  "
        f"{'data fwd  bwd  opt  oth':<24} {'cpu':>9} {'gpu':>14} {'last step':>9}  where / event"
    )
    lines.append(header)
    if len(rows) <= per_rank_up_to:
        lines += [_line(str(r["rank"]), r) for r in rows]
        return "\n".join(lines)
    odd = outliers(rows)
    for node in sorted({r["node"] for r in rows}, key=lambda n: (n is None, n)):
        members = [r for r in rows if r["node"] == node]
        lines.append(_line(f"node {node}", _median_row(members), count=len(members)))
    if odd:
        lines.append("stand out:")
        lines += [_line(str(r["rank"]), r) for r in rows if r["rank"] in odd]
    return "\n".join(lines)


def _job_line(job: dict[str, Any], snap: dict[str, Any]) -> str:
    parts = [f"job: {job['ranks']} ranks on {job['nodes']} node(s), {job['running']} running"]
    if job.get("step") is not None:
        parts.append(f"step {job['step']}")
    if job.get("tokens_per_s") is not None:
        parts.append(f"{job['tokens_per_s']:,.0f} tokens/s")
    if job.get("goodput") is not None:
        parts.append(f"goodput {job['goodput']:.0%}")
    if job.get("eta_s") is not None:
        parts.append(f"ETA {_duration(job['eta_s'])} to the end of the pass")
    if job.get("age_s") is not None:
        parts.append(f"snapshot {job['age_s']:.0f} s old")
    when = time.strftime("%H:%M:%S", time.localtime(snap["time"]))
    return f"{when}  " + ", ".join(parts)


def _line(label: str, r: dict[str, Any], *, count: int = 0) -> str:
    step_time = r.get("step_time_s")
    trend = r.get("trend")
    phases = r.get("phases") or {}
    shares = " ".join(
        f"{phases[k]:>4.0%}" if k in phases else "   -"
        for k in ("data", "forward", "backward", "optimizer", "other")
    )
    since = r.get("since_step_s")
    state = r.get("state")
    tail = r.get("where") or ""
    if state != "running":
        error = str(r.get("error") or "")
        tail = state + (
            f": {error[:120]}..." if len(error) > 120 else f": {error}" if error else ""
        )
    if r.get("last_event"):
        tail += f"; last event {r['last_event']}"
    if count:
        tail = f"{count} ranks (median)"
    return (
        f"{label:>9} {_num(r.get('step'), '{:d}'):>7} "
        f"{_num(step_time, '{:.3f} s'):>9} {_num(trend, '{:+.0%}'):>6}  {shares:<24} "
        f"{_cpu(r.get('cpu')):>9} {_gpu(r.get('gpu')):>14} {_num(since, '{:.1f} s'):>9}  {tail}"
    )


def _num(value: Any, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def _cpu(cpu: float | None) -> str:
    """The main thread's CPU share in words (records.BUSY_CPU / IDLE_CPU's bounds)."""
    if cpu is None:
        return "-"
    word = "busy" if cpu >= 0.25 else "blocked" if cpu <= 0.05 else ""
    return f"{cpu:.0%} {word}".strip()


def _gpu(gpu: dict[str, Any] | None) -> str:
    if not gpu:
        return "-"
    util = "?" if gpu.get("util") is None else f"{gpu['util']:.0%}"
    return f"{util} {gpu.get('memory_gb', 0):.1f} GB"


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


# ---------------------------------------------------------------------- at large N


def outliers(rows: list[dict[str, Any]]) -> set[int]:
    """The ranks that stand out from the job: not running, behind the furthest step,
    slower than ``SLOW_FACTOR`` times the median step, blocked while most compute, or
    without a step for three median steps and 10 s."""
    steps = [r["step"] for r in rows if r.get("step") is not None]
    times = [r["step_time_s"] for r in rows if r.get("step_time_s")]
    cpus = [r["cpu"] for r in rows if r.get("cpu") is not None]
    top = max(steps, default=0)
    median_time = statistics.median(times) if times else None
    busy_job = bool(cpus) and statistics.median(cpus) >= 0.25
    odd = set()
    for r in rows:
        slow = median_time and (r.get("step_time_s") or 0) > SLOW_FACTOR * median_time
        stalled = (r.get("since_step_s") or 0) > max(10.0, 3 * (median_time or 0))
        blocked = busy_job and r.get("cpu") is not None and r["cpu"] <= 0.05
        behind = r.get("step") is not None and r["step"] < top - 1
        if r.get("state") != "running" or slow or stalled or blocked or behind:
            odd.add(r["rank"])
    return odd


def _median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def med(key: str) -> Any:
        values = [r[key] for r in rows if r.get(key) is not None]
        return statistics.median(values) if values else None

    phases = [r["phases"] for r in rows if r.get("phases")]
    shares = (
        {k: statistics.median(p.get(k, 0.0) for p in phases) for k in phases[0]} if phases else None
    )
    step = med("step")
    return {
        "step": None if step is None else int(step),
        "step_time_s": med("step_time_s"),
        "trend": med("trend"),
        "phases": shares,
        "cpu": med("cpu"),
        "gpu": _median_gpu([r["gpu"] for r in rows if r.get("gpu")]),
        "since_step_s": med("since_step_s"),
        "state": "running",
    }


def _median_gpu(gpus: list[dict[str, Any]]) -> dict[str, Any] | None:
    if not gpus:
        return None
    utils = [g["util"] for g in gpus if g.get("util") is not None]
    return {
        "util": statistics.median(utils) if utils else None,
        "memory_gb": statistics.median(g.get("memory_gb", 0.0) for g in gpus),
    }
