"""``python -m guardrails report RUN_DIR``: a run's story from its metrics and events.

Loss, grad-norm, LR and tokens/sec tell which family of failure a run is in before you
dig. After a run (or a crash) the answers are in ``run_dir/metrics.parquet`` and
``run_dir/events.<host>.jsonl``, spread over parquet parts and JSON lines; this command reads
both and prints what happened, in order of what a post-mortem asks first: how far it
got and how it ended, how fast, did it learn, what was skipped and why (the NaN
diagnoses), where time went (GC, data wait) and what was warned about. It also draws
loss, grad norm and LR over steps with skipped steps and spikes marked
(``RUN_DIR/report.png``; matplotlib is the optional ``plot`` extra).

A run_dir can hold several runs (restarts, resumes): runs are told apart by their
``start`` events (one per rank) and the ``started_at`` column. The newest is reported
unless ``--all``. A run killed mid-way has no ``end`` event and maybe no metrics part
yet (parts are written every ``metrics_write_every_s`` and at close): the story says so
and tells what it can from what is there. A run that continued another after a failure
(a restart) ends with the job's restarts and goodput (:mod:`~guardrails.cli.report_restarts`).

The command in parts, each its own module: :mod:`~guardrails.cli.report_runs` (the runs
in a run_dir, the one streaming pass), :mod:`~guardrails.cli.report_summary` (the facts,
what ``--json`` prints), :mod:`~guardrails.cli.report_story` (the text) and
:mod:`~guardrails.cli.report_plot` (the PNG).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from guardrails.cli.report_plot import PLOT_HINT, plot
from guardrails.cli.report_restarts import Restarts
from guardrails.cli.report_runs import _metrics_keys, gather, logger, read_events, split_runs
from guardrails.cli.report_story import story
from guardrails.cli.report_summary import summarize
from guardrails.cli.top import render, snapshot
from guardrails.metrics.events import EVENTS_GLOB, json_safe
from guardrails.metrics.file import METRICS_DIR


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "report",
        help="a run's story from metrics.parquet and the events files, and a PNG",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog="A run that continued another after a failure also shows each restart (its "
        "cause, the time from the fault to training again, the steps redone) and the job's "
        "goodput: useful step time / wall time over its attempts, where useful leaves out "
        "the steps a later attempt redid and each attempt's first step (its start-up). "
        "See docs/cli.md, 'Restarts and goodput'.",
    )
    p.add_argument("run_dir", type=Path, help="the guard's run_dir")
    p.add_argument("--png", type=Path, help="where to write the plot (default RUN_DIR/report.png)")
    p.add_argument("--no-png", action="store_true", help="do not draw the plot")
    p.add_argument("--all", action="store_true", help="every run in RUN_DIR, not just the newest")
    p.add_argument("--json", action="store_true", help="print the facts as JSON")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    run_dir: Path = args.run_dir
    events = read_events(run_dir)
    keys, why = _metrics_keys(run_dir)
    if not events and not keys:
        print(
            f"guardrails report: nothing to report in {run_dir}: no events file "
            f"({EVENTS_GLOB}) and {why}. Pass the run_dir given to guardrails.guard(run_dir=...)."
        )
        return 2
    runs = split_runs(events, keys)
    chosen = runs if args.all else runs[-1:]
    restarts = [Restarts(run, runs) for run in chosen]
    try:
        extra = [r.feeds() for r in restarts]
        gather(run_dir, chosen, runs, plots=not args.no_png, extra=extra)
    except Exception as exc:  # a part damaged after the scan read it: tell the events
        logger.warning(
            "guardrails report: %s unreadable: %s: %s", METRICS_DIR, type(exc).__name__, exc
        )
        for run in chosen:
            run.keys, run.stats, run.curves = {}, None, None
        for r in restarts:
            r.streamed = False
    facts = []
    texts = []
    for i, run in enumerate(chosen):
        s = summarize(run, run_dir, runs, restarts[i])
        s["run"] = runs.index(run) + 1
        s["runs_in_dir"] = len(runs)
        if not args.no_png:
            png = args.png or run_dir / "report.png"
            if len(chosen) > 1:
                png = png.with_name(f"{png.stem}-run{s['run']}{png.suffix}")
            if plot(run, s, png):
                s["png"] = str(png)
            elif not run.keys:
                s["png"] = None
                s["png_note"] = "no metric rows to plot"
            else:
                s["png"] = None
                s["png_note"] = PLOT_HINT
        last = last_snapshot(run_dir, run.run_id)
        if last is not None:
            s["last_snapshot"] = last
        facts.append(s)
        head = f"run {s['run']} of {s['runs_in_dir']}"
        if len(runs) > 1 and not args.all and i == 0:
            head += " (the newest; --all for every run)"
        text = f"{head}\n{story(s)}"
        if s.get("png"):
            # symlog (a loss that can be 0 or negative) is a log axis too, around 0.
            names = ["LR" if c == "lr" else c for c in s.get("plot_scales") or {}]
            note = (
                f" ({' and '.join(names)} on "
                + ("a log axis: it spans" if len(names) == 1 else "log axes: they span")
                + " several orders of magnitude)"
                if names
                else ""
            )
            text += f"\n  plot         {s['png']}{note}"
        elif s.get("png_note"):
            text += f"\n  plot         {s['png_note']}"
        if last is not None:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(last["time"]))
            text += f"\n\nlast snapshot of each rank (as `guardrails top` showed it at {when}):\n"
            text += render(last)
        texts.append(text)
    if args.json:
        out = facts if args.all else facts[0]
        print(json.dumps(json_safe(out), indent=2, default=str))
    else:
        print("\n\n".join(texts))
    return 0


def last_snapshot(run_dir: Path, run_id: str | None) -> dict[str, Any] | None:
    """The last live snapshot of run ``run_id`` (``guardrails top``'s rows, at the time
    its newest rank record was written), or ``None`` when it left none (the watchdog
    off, or a guardrails from before the live view)."""
    snap = snapshot(run_dir, run_id=run_id, as_of_last=True)
    return snap if snap["ranks"] else None
