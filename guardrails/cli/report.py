"""``python -m guardrails report RUN_DIR``: a run's story from its metrics and events.

Loss, grad-norm, LR and tokens/sec tell which family of failure a run is in before you
dig. After a run (or a crash) the answers are in ``run_dir/metrics.parquet`` and
``run_dir/events.jsonl``, spread over parquet parts and JSON lines; this command reads
both and prints what happened, in order of what a post-mortem asks first: how far it
got and how it ended, how fast, did it learn, what was skipped and why (the NaN
diagnoses), where time went (GC, data wait) and what was warned about. It also draws
loss, grad norm and LR over steps with skipped steps and spikes marked
(``RUN_DIR/report.png``; matplotlib is the optional ``plot`` extra).

A run_dir can hold several runs (restarts, resumes): runs are told apart by their
``start`` events (one per rank) and the ``started_at`` column. The newest is reported
unless ``--all``. A run killed mid-way has no ``end`` event and maybe no metrics part
yet (parts are written every ``metrics_write_every_s`` and at close): the story says so
and tells what it can from what is there.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import re
import signal
from pathlib import Path
from typing import Any

from guardrails.cli.report_stats import (
    FIRST_LAST,
    Counter,
    Curves,
    Key,
    KeyInfo,
    RunStats,
    scan_keys,
    stream,
)
from guardrails.metrics.events import EVENTS_FILE, json_safe
from guardrails.metrics.file import METRICS_DIR
from guardrails.util.files import make_dirs, restrict
from guardrails.util.text import shorten, si

logger = logging.getLogger("guardrails.report")

PLOT_HINT = 'PNG not written: matplotlib is missing; pip install "torch-guardrails[plot]"'
_FIRST_LAST = FIRST_LAST  # loss "first" and "last": mean of this many steps
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


# ---------------------------------------------------------------------------- loading


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    """Every event in ``run_dir/events.jsonl``; a torn last line (a crash mid-write on a
    filesystem without atomic appends) is skipped, with a log line."""
    path = run_dir / EVENTS_FILE
    if not path.exists():
        return []
    events = []
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            logger.warning("guardrails report: %s line %d is not JSON; skipped", path, n)
    return events


def _metrics_keys(run_dir: Path) -> tuple[dict[Key, KeyInfo], str | None]:
    """Each (rank, started_at) of the metrics with its rows and steps (empty when nothing
    was written), and why if unreadable. Reads three columns a batch at a time."""
    try:
        return scan_keys(run_dir), None
    except FileNotFoundError:
        return {}, f"no {METRICS_DIR} in {run_dir}"
    except Exception as exc:  # a torn part from an old writer, a schema change
        return {}, f"{METRICS_DIR} unreadable: {type(exc).__name__}: {exc}"


class Run:
    """One run: its start time per rank, its events, which metrics rows are its own
    (by (rank, started_at)) and, once streamed, what they say (``stats``)."""

    def __init__(self, starts: dict[int, float], run_id: str | None = None) -> None:
        self.starts = starts  # rank -> start time (start event, else started_at)
        self.run_id = run_id  # the start events' shared id (None in logs from before it)
        self.world_size: int | None = None  # from the start events
        self.events: list[dict[str, Any]] = []
        self.keys: dict[Key, KeyInfo] = {}  # its metrics rows, per rank and guard start
        self.stats: RunStats | None = None  # filled by the streaming pass
        self.earlier: Counter | None = None  # earlier runs' rows that start its plot
        self.curves: Curves | None = None  # its plot's lines

    @property
    def started(self) -> float:
        return min(self.starts.values())

    @property
    def n_rows(self) -> int:
        return sum(k.rows for k in self.keys.values())

    @property
    def step_min(self) -> int | None:
        return min((k.step_min for k in self.keys.values()), default=None)

    def lead(self) -> tuple[int | None, tuple[float, int] | None, int]:
        """The rank that tells the loss story (the lowest with rows), its first row
        (started_at, step) and its row count."""
        if not self.keys:
            return None, None, 0
        lead = min(r for r, _ in self.keys)
        mine = sorted((t, k.step_min, k.rows) for (r, t), k in self.keys.items() if r == lead)
        return lead, (mine[0][0], mine[0][1]), sum(n for _, _, n in mine)

    def takes(self, rank: int, world_size: int | None) -> bool:
        """Whether a ``start`` of ``rank`` without a run id joins this run (logs
        written before start events carried one): every rank starts once per run, a run
        has ``world_size`` ranks and the next run may have another world size."""
        if self.run_id is not None or rank in self.starts:
            return False
        if world_size is None or self.world_size is None:
            return True
        full = len(self.starts) >= self.world_size
        return world_size == self.world_size and rank < world_size and not full


def split_runs(events: list[dict[str, Any]], keys: dict[Key, KeyInfo]) -> list[Run]:
    """Group events and metrics rows into runs, oldest first.

    The ``start`` events say which run a rank's start belongs to: the id on each
    (``run``, shared by the ranks of one run). Logs from before the id fall back to a
    rule: a run takes one start per rank, up to its ``world_size`` ranks. Each rank's
    later events and rows then belong to that rank's latest run started before them.
    """
    starts = sorted(
        (float(e["time"]), int(e.get("rank", 0)), e) for e in events if e.get("kind") == "start"
    )
    have = {r for _, r, _ in starts}
    if keys:  # ranks with metrics but no start event (events turned off)
        starts += sorted((t, r, {}) for r, t in keys if r not in have)
        starts.sort(key=lambda x: (x[0], x[1]))
    runs: list[Run] = []
    by_id: dict[str, Run] = {}
    for t, r, e in starts:
        run_id = e.get("run")
        world = e.get("world_size")
        if run_id is not None:
            run = by_id.get(run_id)
            if run is None:
                run = by_id[run_id] = Run({}, run_id)
                runs.append(run)
        else:
            # The newest run without an id that can still take this rank, else a new one.
            old = [x for x in runs if x.run_id is None]
            run = old[-1] if old and old[-1].takes(r, world) else None
            if run is None:
                run = Run({})
                runs.append(run)
        run.starts[r] = t
        if world is not None:
            run.world_size = int(world)
    if not runs and events:  # events but no start (a truncated log): one run
        runs.append(Run({int(events[0].get("rank", 0)): float(events[0]["time"])}))
    runs.sort(key=lambda x: x.started)

    def owner(rank: int, t: float) -> Run | None:
        best = None
        for run in runs:
            s = run.starts.get(rank)
            if s is not None and s <= t + 1e-6 and (best is None or s >= best.starts[rank]):
                best = run
        if best is None:  # before any start of this rank (a torn log): its first run
            best = next((x for x in runs if rank in x.starts), runs[0] if runs else None)
        return best

    for e in events:
        run = owner(int(e.get("rank", 0)), float(e.get("time", 0.0)))
        if run is not None:
            run.events.append(e)
    for key, info in keys.items():
        run = owner(int(key[0]), float(key[1]))
        if run is not None:
            run.keys[key] = info
    return runs


def gather(run_dir: Path, chosen: list[Run], runs: list[Run], plots: bool) -> int:
    """Stream the metrics once into what ``chosen`` runs need: each one's
    :class:`RunStats`, the count of earlier runs' rows its plot starts with and, with
    ``plots``, its :class:`Curves`. Returns the most rows held at once (one batch).

    Each key takes rows up to the last step the first pass saw: a live run's parts
    written since add nothing, so the facts and the plot are of one moment."""
    feeds: dict[Key, list[tuple[Any, float]]] = {}

    def feed(run: Run, fn: Any, bound: float) -> None:
        for key, info in run.keys.items():
            feeds.setdefault(key, []).append((fn, min(bound, info.step_max)))

    for run in chosen:
        run.stats = RunStats(*run.lead())
        feed(run, run.stats.add, math.inf)
        chain = _chain(run, runs)
        run.earlier = Counter()
        for other, bound in chain[:-1]:
            feed(other, run.earlier.add, bound)
        if plots and run.keys:
            lo = min(o.step_min or 0 for o, _ in chain if o.keys)
            hi = max(
                min(max(k.step_max for k in o.keys.values()), bound) for o, bound in chain if o.keys
            )
            run.curves = Curves(int(lo), int(max(hi, lo)), lead=run.lead()[0])
            for other, bound in chain:
                feed(other, run.curves.add, bound)
    return stream(run_dir, feeds) if any(r.keys for r in runs) else 0


# ---------------------------------------------------------------------------- the story


def summarize(run: Run, run_dir: Path, runs: list[Run] | None = None) -> dict[str, Any]:
    """The facts of one run, JSON-able: what ``--json`` prints and the text is made of.
    ``runs``: every run in ``run_dir``, oldest first, to say which run a resume
    continued and which one continued a stopped run."""
    runs = runs if runs is not None else [run]
    ev = run.events
    stats = run.stats
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for e in ev:
        by_kind.setdefault(e.get("kind", "?"), []).append(e)
    start = next(iter(by_kind.get("start", [])), {})
    ranks = sorted(run.starts)
    s: dict[str, Any] = {
        "run_dir": str(run_dir),
        "started": _iso(run.started),
        "ranks": ranks,
        "world_size": start.get("world_size", len(ranks)),
        "device": start.get("device"),
        "components": start.get("components"),
    }
    n_rows = stats.rows if stats is not None else 0
    event_steps = [int(e.get("step", 0)) for e in ev]
    s["metrics_rows"] = n_rows
    per_rank_steps = dict(sorted(stats.step_max.items())) if stats is not None else {}
    s["last_step"] = int(max([*per_rank_steps.values(), *event_steps, 0]))
    s["steps_per_rank"] = per_rank_steps
    ends = by_kind.get("end", [])
    times = [e["time"] for e in ev]
    if stats is not None and stats.time_max > -math.inf:
        times.append(stats.time_max)
    last_time = max(times) if times else run.started
    s["wall_s"] = last_time - run.started

    # Rank 0 (or the lowest rank with rows) tells the loss story: under DDP the grad
    # norm is the same on every rank; losses differ by shard.
    if n_rows and stats is not None:
        s.update(stats.facts())
    else:
        s["skipped_steps"] = []
    # Skips the metrics have not caught (a crash before the part was written).
    for e in by_kind.get("nonfinite", []):
        if "skipped" in e.get("message", "") and int(e["step"]) not in s["skipped_steps"]:
            s["skipped_steps"] = sorted({*s["skipped_steps"], int(e["step"])})

    s["spikes"] = [
        {"step": e["step"], "rank": e.get("rank"), "message": e.get("message", "")}
        for e in by_kind.get("spike", [])
    ]
    s["nonfinite"] = [
        {
            "step": e["step"],
            "rank": e.get("rank"),
            "cause": e.get("cause"),
            "message": e.get("message", ""),
            "path": _rel(e.get("path"), run_dir),
        }
        for e in by_kind.get("nonfinite", [])
    ]
    s["recovered"] = [
        {"step": e["step"], "first_step": e.get("first_step"), "skipped": e.get("skipped")}
        for e in by_kind.get("nonfinite_recovered", [])
    ]
    pauses = by_kind.get("gc_pause", [])
    longest = max(pauses, key=lambda e: float(e.get("pause_s") or 0), default=None)
    s["gc_longest_pause"] = (
        None
        if longest is None
        else {
            "step": longest["step"],
            "rank": longest.get("rank"),
            "pause_s": longest.get("pause_s"),
            "scheduled": longest.get("scheduled"),
        }
    )
    # Every warning the run logged that no other line tells (NaN/Inf, spikes and a
    # signal stop have theirs): the known kinds first, then any other warning-level
    # event, so "warnings none" never sits beside a warning.
    s["warnings"] = [
        {"kind": e["kind"], "step": e["step"], "rank": e.get("rank"), "message": e.get("message")}
        for kind in [*_WARNINGS, *sorted(k for k in by_kind if k not in _WARNINGS)]
        for e in by_kind.get(kind, [])
        if _is_warning(e)
    ]
    # What ended the run, told once: every rank reports the same verdict (the
    # watchdog's and the auditor's are agreed across ranks), so identical ones merge.
    failures: dict[tuple[str, int, str], list[int]] = {}
    for kind in _FAILURES:
        for e in by_kind.get(kind, []):
            key = (kind, int(e["step"]), e.get("message", ""))
            failures.setdefault(key, []).append(e.get("rank"))
    s["failures"] = [
        {
            "kind": kind,
            "step": step,
            "ranks": sorted(r for r in ranks if r is not None),
            "message": message,
        }
        for (kind, step, message), ranks in failures.items()
    ]
    # One checkpoint per step, however many ranks logged writing their part of it.
    saved: dict[tuple[int, str], dict[str, Any]] = {}
    for k, es in by_kind.items():
        if "checkpoint" in k or k == "save":
            for e in es:
                if not _is_warning(e):  # an invalid or skipped one is a warning, not a save
                    saved.setdefault((int(e["step"]), k), e)
    s["checkpoints"] = [
        {"step": e["step"], "kind": e["kind"], "path": _rel(e.get("path"), run_dir)}
        for _, e in sorted(saved.items(), key=lambda kv: kv[0])
    ]
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
    if ends:
        errors = [e for e in ends if e.get("error")]
        s["ended"] = {
            "clean": not errors,
            "ranks": sorted({e.get("rank") for e in ends}),
            "step": max(int(e["step"]) for e in ends),
            "error": errors[0]["error"] if errors else None,
            "error_rank": errors[0].get("rank") if errors else None,
            "aborted": bool(errors[0].get("aborted")) if errors else False,
        }
        missing = sorted(set(ranks) - {e.get("rank") for e in ends})
        s["ended"]["missing_ranks"] = missing
        s["ended"]["preempted"] = _preempted(run, by_kind, errors, runs, run_dir)
    else:
        s["ended"] = None
    s["last_seen"] = _iso(last_time)
    s["failure_counts"] = _failure_counts(s)
    return s


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


def _mfu_line(m: dict[str, Any], step_s: float | None) -> str:
    flops, peak = m["flops_per_step"], m["peak_flops"]
    if not flops:  # not counted: the event says why
        return f"  MFU          unknown: {m.get('message') or 'no FLOPs per step'}"
    per_step = f"{si(float(flops), 'FLOP')} a step"
    if not peak:
        return (
            f"  MFU          unknown: {per_step}, but no peak FLOP/s is known for "
            f"{m['device_name']} (pass efficiency={{'peak_flops': ...}})"
        )
    against = f"{si(float(peak), 'FLOP/s')} {m['dtype']} peak"
    if m["mfu"] is None or step_s is None:
        return f"  MFU          unknown: no step times; {per_step} against {against}"
    return (
        f"  MFU          {m['mfu'] * 100:.3g}% ({per_step} in a median step of {_dur(step_s)}, "
        f"against {against}" + (f", rank {m['rank']}" if m.get("rank") else "") + ")"
    )


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


def _failures_line(s: dict[str, Any]) -> str:
    """``none``, or each kind of failure with its count: ``1 hang, an error end (step
    61), 10 skipped step(s)``."""
    c = s["failure_counts"]
    parts: list[str] = []
    kinds: dict[str, int] = {}
    for x in s["failures"]:
        kinds[x["kind"]] = kinds.get(x["kind"], 0) + 1
    parts += [f"{n} {_FAILURES[k]}" for k, n in kinds.items()]
    if c["error_end"]:
        parts.append(f"an error end (step {s['ended']['step']})")
    if c["skipped_steps"]:
        more = "more than " if s.get("skipped_steps_listed") else ""
        parts.append(f"{more}{c['skipped_steps']} skipped step(s)")
    if c["nonfinite_not_skipped"]:
        parts.append(f"{c['nonfinite_not_skipped']} non-finite step(s) not skipped")
    return ", ".join(parts) or "none"


def story(s: dict[str, Any]) -> str:
    """The text for a human, one fact per line."""
    n_ranks = len(s["ranks"])
    lines = [
        f"run started {s['started']} in {s['run_dir']}: {n_ranks} rank(s)"
        + (f" on {s['device']}" if s.get("device") else "")
        + (f", components {', '.join(s['components'])}" if s.get("components") else ""),
    ]
    r = s.get("resumed")
    # A resumed run did not run the steps before its checkpoint: say which it did.
    reached = (
        f"{r['step'] + 1}-{s['last_step']} ({s['last_step'] - r['step']} this run; resumed "
        f"at {r['step']})"
        if r and s["last_step"] > r["step"]
        else f"{s['last_step']} reached"
    )
    if s["metrics_rows"]:
        per = s["steps_per_rank"]
        uneven = len(set(per.values())) > 1
        lines.append(
            f"  steps        {reached}; {s['metrics_rows']} metric rows"
            + (f" (per rank: {per})" if uneven else "")
            + f"; wall time {_dur(s['wall_s'])}"
            + (
                f", step time median {_dur(s['step_time_median_s'])}"
                if s.get("step_time_median_s") is not None
                else ""
            )
        )
    else:
        lines.append(
            f"  steps        {reached} (from events); no metric rows were "
            f"written: the run ended before its first part (parts are written every "
            f"metrics_write_every_s, default 60 s, and at close); wall time {_dur(s['wall_s'])}"
        )
    if r:
        src = f" (saved by run {r['from_run']})" if r.get("from_run") else ""
        lines.append(
            f"  resumed      at step {r['step']} from {r['checkpoint'] or 'a checkpoint'}{src}"
            + (
                f"; the plot starts with run {r['from_run']}'s steps up to {r['step']}"
                if r.get("earlier_rows")
                else ""
            )
        )
    tps = s.get("tokens_per_s_median")
    if tps:
        total = sum(tps.values())
        lines.append(
            f"  throughput   {total:,.0f} tokens/s median"
            + (f" over {len(tps)} ranks ({total / len(tps):,.0f} per rank)" if len(tps) > 1 else "")
        )
    elif s["metrics_rows"]:
        lines.append("  throughput   unknown (no token counts: pass tokens_per_batch=)")
    if s.get("mfu"):
        lines.append(_mfu_line(s["mfu"], s.get("step_time_median_s")))
    if s.get("advice"):
        lines.append(
            "  fast path    "
            + "; ".join(_ADVICE[k] for k in s["advice"])
            + " (each with its fix in events.jsonl)"
        )
    if s.get("loss_first") is not None:
        lines.append(
            f"  loss         {s['loss_first']:.4g} (first {_FIRST_LAST} steps) -> "
            f"{s['loss_last']:.4g} (last {_FIRST_LAST}), rank {s['lead_rank']}"
        )
    if s.get("grad_norm"):
        g = s["grad_norm"]
        lines.append(f"  grad norm    {g['min']:.3g} - {g['max']:.3g} (median {g['median']:.3g})")
    if s.get("lr"):
        lo, hi = s["lr"]["min"], s["lr"]["max"]
        lines.append(f"  lr           {lo:.3g}" + (f" - {hi:.3g}" if hi != lo else " (constant)"))
    sk = s["skipped_steps"]
    more = "more than " if s.get("skipped_steps_listed") else ""
    lines.append(f"  skipped      {more}{len(sk)} step(s)" + (f": {shorten(sk, 12)}" if sk else ""))
    sp = s["spikes"]
    lines.append(
        f"  spikes       {len(sp)}"
        + (f": steps {shorten([x['step'] for x in sp], 12)}" if sp else "")
    )
    for x in sp[:5]:
        lines.append(f"    step {x['step']} rank {x['rank']}: {x['message']}")
    for d in s["nonfinite"]:
        lines.append(f"  NaN/Inf      step {d['step']} rank {d['rank']}: cause {d['cause']}")
        lines.append(f"    {d['message']}")
        if d.get("path"):
            lines.append(f"    batch and diagnosis saved in {d['path']}")
    for r in s["recovered"]:
        lines.append(
            f"  recovered    at step {r['step']} after {r['skipped']} skipped step(s) "
            f"from step {r['first_step']}"
        )
    gc_total = s.get("gc_total_s")
    if gc_total is not None:
        worst = max(gc_total.values()) if gc_total else 0.0
        text = f"  GC           {_dur(worst)} total" + (
            f" ({worst / s['wall_s']:.1%} of wall time)" if s["wall_s"] > 0 else ""
        )
        p = s.get("gc_longest_pause")
        if p:
            text += (
                f"; longest pause {_dur(float(p['pause_s']))} at step {p['step']}"
                f" ({p['scheduled']})"
            )
        lines.append(text)
    if s.get("data_wait_share") is not None:
        share = s["data_wait_share"]
        lines.append(
            f"  data wait    {share:.1%} of step time"
            + (" (data-starved: the accelerator idles)" if share >= 0.3 else "")
        )
    parts = (s.get("step_anatomy") or {}).get("all")
    if parts:
        lines.append(
            "  step time    "
            + " · ".join(f"{name} {share:.0%}" for name, share in parts.items())
            + (" (all ranks)" if len(s["step_anatomy"]["by_rank"]) > 1 else "")
        )
    if s.get("mem_peak_bytes") is not None:
        lines.append(f"  memory       peak {s['mem_peak_bytes'] / 2**20:,.0f} MiB")
    w = s["warnings"]
    lines.append(f"  warnings     {len(w) or 'none'}")
    for x in w:
        msg = (x["message"] or "").splitlines()[0] if x["message"] else ""
        label = _WARNINGS.get(x["kind"], x["kind"].replace("_", " "))
        lines.append(f"    {label} (step {x['step']}, rank {x['rank']}): {msg}")
    f = s["failures"]
    lines.append(f"  failures     {_failures_line(s)}")
    for x in f:
        who = ", ".join(str(r) for r in x["ranks"])
        head = (x["message"] or "").splitlines()[0] if x["message"] else ""
        lines.append(f"    {_FAILURES[x['kind']]} at step {x['step']} (rank(s) {who}): {head}")
    if s["checkpoints"]:
        c = s["checkpoints"]
        lines.append(f"  checkpoints  {len(c)}: steps {shorten([x['step'] for x in c], 12)}")
    if s["other_events"]:
        lines.append(
            "  other events " + ", ".join(f"{k} x{n}" for k, n in s["other_events"].items())
        )
    e = s["ended"]
    if e is None:
        lines.append(
            f"  ended        no end event: the process died (SIGKILL / OOM killer / node "
            f"failure) after step {s['last_step']}; last sign of life {s['last_seen']}"
        )
    elif e.get("preempted"):
        p = e["preempted"]
        saved = (
            f"checkpoint {Path(p['checkpoint']).name} saved"
            if p.get("checkpoint")
            else "no checkpoint was saved"
        )
        then = (
            f"resumed by run {p['resumed_by']}"
            if p.get("resumed_by")
            else "resume with: the same command (guard(..., resume='auto') continues "
            f"from step {p['step']})"
            if p.get("checkpoint")
            else "the run restarts from its last checkpoint, if any"
        )
        lines.append(
            f"  ended        stopped by {p['signal']} at step {p['step']} (a pre-emption); "
            f"{saved}; {then}"
        )
    elif e["error"]:
        how = " (ended by guardrails while stuck)" if e.get("aborted") else ""
        lines.append(
            f"  ended        with an error at step {e['step']} on rank {e['error_rank']}"
            f"{how}: {e['error'].splitlines()[0]}"
        )
    else:
        lines.append(f"  ended        cleanly at step {e['step']}")
    if e is not None and e["missing_ranks"]:
        lines.append(
            f"               rank(s) {e['missing_ranks']} logged no end event: they died "
            "(SIGKILL / OOM killer / node failure)"
        )
    return "\n".join(lines)


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


def _source(run: Run, runs: list[Run], ev: dict[str, Any]) -> Run | None:
    """The earlier run that saved the checkpoint ``run`` resumed from (its ``resumed``
    event ``ev``): the one that logged saving that path, else the newest earlier run
    with rows up to the resume step."""
    before = runs[: runs.index(run)] if run in runs else []
    path, step = ev.get("path"), int(ev["step"])
    for other in reversed(before):
        for e in other.events:
            if e.get("kind") in ("checkpoint", "stopped") and _same_path(e.get("path"), path):
                return other
    for other in reversed(before):
        lo = other.step_min
        if lo is not None and lo <= step:
            return other
    return None


def _chain(run: Run, runs: list[Run]) -> list[tuple[Run, float]]:
    """The runs whose rows make ``run``'s curve, oldest first, each with the last step
    it contributes: the run it resumed from up to the resume step (and so on back, each
    bounded by every later resume), then ``run`` itself (all of it). The curve of the
    training, not of the process."""
    chain: list[tuple[Run, float]] = [(run, math.inf)]
    bound = math.inf
    cur = run
    for _ in range(64):
        ev = next((e for e in cur.events if e.get("kind") == "resumed"), None)
        src = None if ev is None or not cur.keys else _source(cur, runs, ev)
        if src is None or src is cur or any(src is r for r, _ in chain):
            break
        bound = min(bound, int(ev["step"]))  # type: ignore[index]
        chain.insert(0, (src, bound))
        cur = src
    return chain


def _same_path(a: str | None, b: str | None) -> bool:
    if not a or not b:
        return False
    try:
        return Path(a).resolve() == Path(b).resolve()
    except OSError:
        return a == b


# ---------------------------------------------------------------------------- the plot


def plot(run: Run, s: dict[str, Any], path: Path) -> bool:
    """Loss, grad norm (log) and LR over steps, skipped steps and spikes marked; a
    resumed run's curve starts with the rows of the run it resumed from, up to the
    resume step (marked). Drawn from ``run.curves`` (:func:`gather`): every row up to
    4000 steps, bins of steps (mean line, min-max band) beyond. False when matplotlib is
    missing or there are no rows."""
    try:
        import matplotlib
        import numpy as np

        matplotlib.use("Agg")  # no display needed; safe before pyplot is imported
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return False
    curves = run.curves
    if curves is None or not curves.ranks:
        return False
    resumed = s.get("resumed")
    phases = curves.phases()
    rows = 3 if phases is None else 4
    fig, axes = plt.subplots(rows, 1, sharex=True, figsize=(9, 2.5 * rows), constrained_layout=True)
    panels = (("loss", "loss", "linear"), ("grad_norm", "grad norm", "log"), ("lr", "LR", "linear"))
    ranks = curves.ranks
    s["plot_scales"] = {}
    if phases is not None:  # where the lead rank's step time goes, stacked
        x, lines = phases
        ax = axes[3]
        ax.stackplot(x, *(v * 1e3 for v in lines.values()), labels=list(lines), alpha=0.8)
        ax.set_ylabel(f"rank {curves.lead} step (ms)")
        ax.legend(loc="upper right", fontsize="small", ncol=5)
        ax.grid(alpha=0.3)
    for ax, (col, label, scale) in zip(axes[:3], panels, strict=True):
        kw: dict[str, float] = {}
        if scale == "linear":  # a blow-up's 4e8 on a linear axis flattens every other step
            values = [v for r in ranks for v in curves.line(r, col)[1:]]
            scale, kw = axis_scale(np.concatenate(values) if values else np.empty(0))
            if scale != "linear":
                s["plot_scales"][col] = scale
        for r in ranks:
            # NaN, not dropped: a skipped step shows as a gap in the line.
            x, y, lo, hi = curves.line(r, col)
            (line,) = ax.plot(x, y, lw=1, label=f"rank {r}" if len(ranks) > 1 else None)
            if curves.binned:  # each point a bin's mean: its range as a band
                ax.fill_between(x, lo, hi, color=line.get_color(), alpha=0.2, lw=0)
            if col == "lr" and len(ranks) > 1:
                break  # the same LR everywhere
        ax.set_ylabel(label + (f" ({scale})" if col in s["plot_scales"] else ""))
        ax.set_yscale(scale, **kw)
        ax.grid(alpha=0.3)
        # One collection per kind, not a line each: a long run's thousands of skipped
        # steps as axvlines took 300 MB and most of the report's time. Past 50 they are
        # ticks along the bottom, or they would hide the curves.
        marks = (
            (s["skipped_steps"], "red", "-", "skipped"),
            ([sp["step"] for sp in s["spikes"]], "orange", "--", "spike"),
        )
        for steps, color, style, what in marks:
            if steps:
                ax.vlines(
                    steps,
                    0,
                    1 if len(steps) <= 50 else 0.04,
                    transform=ax.get_xaxis_transform(),
                    colors=color,
                    linestyles=style,
                    lw=1,
                    alpha=0.5 if what == "skipped" else 1,
                    label=what,
                )
        if resumed and resumed.get("earlier_rows"):
            where = f"resumed here (run {resumed['from_run']}'s steps before)"
            ax.axvline(resumed["step"], color="green", ls=":", lw=1.5, label=where)
    axes[-1].set_xlabel("optimizer step")
    axes[-1].xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    handles = axes[0].get_legend_handles_labels()
    if handles[0]:
        axes[0].legend(loc="upper right", fontsize="small")
    end = s["ended"]
    if end is None:
        how = "no end event (died)"
    elif end.get("preempted"):
        how = f"stopped by {end['preempted']['signal']}"
    else:
        how = "error" if end["error"] else "clean"
    axes[0].set_title(f"{s['run_dir']}: run started {s['started']}, ended {how}", fontsize=10)
    make_dirs(path.parent)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    restrict(path)  # matplotlib creates it 0o666 less the umask
    return True


#: Largest over typical (median) magnitude a linear axis is kept for: beyond it the
#: typical steps would be drawn within 0.1% of the axis' height, a flat line at 0.
SPAN_LINEAR = 1e3


def axis_scale(values: Any) -> tuple[str, dict[str, float]]:
    """The y scale for ``values`` (a numpy array; NaN ignored) and its keywords:
    ``linear``, unless its largest magnitude is :data:`SPAN_LINEAR` or more times its
    median one (a loss of 4.4e8 at one step among losses of 2): then ``log`` where every
    value is positive, else ``symlog`` (a loss that can be 0 or negative), linear up to
    the median magnitude."""
    import numpy as np

    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    mags = np.abs(v[v != 0])
    if not mags.size:
        return "linear", {}
    typical = float(np.median(mags))
    if float(mags.max()) < SPAN_LINEAR * typical:
        return "linear", {}
    if (v > 0).all():
        return "log", {}
    return "symlog", {"linthresh": typical}


# ---------------------------------------------------------------------------- helpers


def _iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime(
        "%Y-%m-%d %H:%M:%S UTC"
    )


def _dur(s: float) -> str:
    """A duration as a person writes it: ``0.379 ms``, ``309 ms``, ``8.39 s``, ``42.1 s``,
    ``1.2 min``, ``3.5 h``, ``2.1 days`` (never ``8.39e+03 ms``)."""
    if not math.isfinite(s):
        return "unknown"
    if s <= 0:
        return "0 s"
    if s < 1e-4:
        return f"{s * 1e6:.3g} us"
    if s * 1e3 < 999.5:  # 999.5 ms and up would round to "1e+03 ms"
        return f"{s * 1e3:.3g} ms"
    if s < 99.95:  # likewise "1e+02 s"
        return f"{s:.3g} s"
    if s < 120:
        return f"{s:.0f} s"
    if s < 3600:
        return f"{s / 60:.1f} min"
    if s < 172_800:
        return f"{s / 3600:.1f} h"
    return f"{s / 86_400:.1f} days"


def _rel(path: str | None, run_dir: Path) -> str | None:
    if not path:
        return None
    try:
        return str(Path(path).resolve().relative_to(run_dir.resolve()))
    except ValueError:
        return path


# ---------------------------------------------------------------------------- CLI


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "report",
        help="a run's story from metrics.parquet and events.jsonl, and a PNG",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
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
            f"guardrails report: nothing to report in {run_dir}: no {EVENTS_FILE} and "
            f"{why}. Pass the run_dir given to guardrails.guard(run_dir=...)."
        )
        return 2
    runs = split_runs(events, keys)
    chosen = runs if args.all else runs[-1:]
    try:
        gather(run_dir, chosen, runs, plots=not args.no_png)
    except Exception as exc:  # a part damaged after the scan read it: tell the events
        logger.warning(
            "guardrails report: %s unreadable: %s: %s", METRICS_DIR, type(exc).__name__, exc
        )
        for run in chosen:
            run.keys, run.stats, run.curves = {}, None, None
    facts = []
    texts = []
    for i, run in enumerate(chosen):
        s = summarize(run, run_dir, runs)
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
        texts.append(text)
    if args.json:
        out = facts if args.all else facts[0]
        print(json.dumps(json_safe(out), indent=2, default=str))
    else:
        print("\n\n".join(texts))
    return 0
