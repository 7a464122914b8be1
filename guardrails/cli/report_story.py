"""The report's text for a human, one fact per line, from the facts of
:func:`~guardrails.cli.report_summary.summarize`: how far the run got, how fast, did it
learn, what was skipped and why, where time went, what was warned about, how it ended.
Torch-free.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from guardrails.cli.report_stats import FIRST_LAST
from guardrails.cli.report_summary import _ADVICE, _FAILURES, _WARNINGS
from guardrails.util.text import shorten, si

_FIRST_LAST = FIRST_LAST  # loss "first" and "last": mean of this many steps
#: A restart's cause in its line: the head of the error, at most this many characters.
_CAUSE_CHARS = 160


def story(s: dict[str, Any]) -> str:
    """The text for a human, one fact per line: the run and how far it got, how fast,
    did it learn, where time went, what went wrong, how it ended."""
    lines = [
        *_run_lines(s),
        *_speed_lines(s),
        *_learning_lines(s),
        *_time_lines(s),
        *_trouble_lines(s),
        *_end_lines(s),
        *_restart_lines(s),
    ]
    return "\n".join(lines)


def _run_lines(s: dict[str, Any]) -> list[str]:
    """Where and when it started, the steps it ran, where a resume continued from."""
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
    return lines


def _speed_lines(s: dict[str, Any]) -> list[str]:
    """Throughput, MFU and the fast-path advice."""
    lines = []
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
            + " (each with its fix in the events files, events.*.jsonl)"
        )
    return lines


def _learning_lines(s: dict[str, Any]) -> list[str]:
    """Loss, grad norm and LR; the skipped steps, spikes, non-finite steps and
    recoveries."""
    lines = []
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
    return lines


def _time_lines(s: dict[str, Any]) -> list[str]:
    """Where time and memory went: GC, data wait, the step's phases, the peak."""
    lines = []
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
    return lines


def _trouble_lines(s: dict[str, Any]) -> list[str]:
    """The warnings, the failures, the checkpoints saved and the other events."""
    w = s["warnings"]
    lines = [f"  warnings     {len(w) or 'none'}"]
    for x in w:
        msg = (x["message"] or "").splitlines()[0] if x["message"] else ""
        label = _WARNINGS.get(x["kind"], x["kind"].replace("_", " "))
        lines.append(f"    {label} (step {x['step']}, rank {x['rank']}): {msg}")
    lines.append(f"  failures     {_failures_line(s)}")
    for x in s["failures"]:
        who = ", ".join(str(r) for r in x["ranks"])
        head = (x["message"] or "").splitlines()[0] if x["message"] else ""
        lines.append(f"    {_FAILURES[x['kind']]} at step {x['step']} (rank(s) {who}): {head}")
    if s["checkpoints"]:
        c = s["checkpoints"]
        lines.append(f"  checkpoints  {len(c)}: steps {shorten([x['step'] for x in c], 12)}")
        for x in c:
            if x.get("refused"):  # listed as saved, yet a resume would pass it over
                lines.append(f"    step {x['step']}: resume would refuse it: {x['refused']}")
    if s["other_events"]:
        lines.append(
            "  other events " + ", ".join(f"{k} x{n}" for k, n in s["other_events"].items())
        )
    return lines


def _end_lines(s: dict[str, Any]) -> list[str]:
    """How it ended: died, stopped by a signal, with an error or cleanly; the ranks
    that logged no end."""
    e = s["ended"]
    if e is None:
        return [
            f"  ended        no end event: the process died (SIGKILL / OOM killer / node "
            f"failure) after step {s['last_step']}; last sign of life {s['last_seen']}"
        ]
    if e.get("preempted"):
        lines = [_preempted_line(e["preempted"])]
    elif e["error"]:
        how = " (ended by guardrails while stuck)" if e.get("aborted") else ""
        lines = [
            f"  ended        with an error at step {e['step']} on rank {e['error_rank']}"
            f"{how}: {e['error'].splitlines()[0]}"
        ]
    else:
        lines = [f"  ended        cleanly at step {e['step']}"]
    if e["missing_ranks"]:
        lines.append(
            f"               rank(s) {e['missing_ranks']} logged no end event: they died "
            "(SIGKILL / OOM killer / node failure)"
        )
    return lines


def _restart_lines(s: dict[str, Any]) -> list[str]:
    """The job's restarts up to this run, one line each, after the job's goodput;
    nothing for a run that is no restart."""
    job = s.get("job")
    if not job:
        return []
    runs = job["runs"]  # consecutive: each attempt is the run after the one it continued
    useful = job["useful_step_s"]
    head = f"  restarts     {len(s['restarts'])} in {job['attempts']} attempts "
    head += f"(runs {runs[0]}-{runs[-1]}); "
    if job["goodput"] is not None:
        head += (
            f"goodput {job['goodput']:.1%} (useful step time {_dur(useful)} of "
            f"{_dur(job['wall_s'])} wall time; {job['steps_redone']} step(s) redone)"
        )
    else:
        head += f"goodput unknown (no metric rows); {job['steps_redone']} step(s) redone"
    lines = [head]
    if job.get("runs_without_rows"):
        lines.append(
            f"               run(s) {', '.join(map(str, job['runs_without_rows']))} wrote no "
            "metric rows: their steps count as not useful"
        )
    lines += [_restart_line(r) for r in s["restarts"]]
    return lines


def _restart_line(r: dict[str, Any]) -> str:
    """One restart: its cause, the time from the fault to training again, by phase,
    and the steps redone."""
    c = r["cause"]
    where = [f"rank {c['rank']}"] if c.get("rank") is not None else []
    where += [f"step {c['step']}"] if c.get("step") is not None else []
    # A verdict's head line can run to several hundred characters (a hang's names both
    # ranks' places): cut in the line, whole in --json and in the run's own report.
    message = c["message"]
    if len(message) > _CAUSE_CHARS:
        message = message[: _CAUSE_CHARS - 3].rstrip() + "..."
    text = f"    run {r['from_run']} -> {r['to_run']}: {message}"
    text += f" ({', '.join(where)})" if where else ""
    if c.get("restartable") is not None:
        text += "; a restart can fix this" if c["restartable"] else "; a restart cannot fix this"
    text += _failure_save_text(r.get("failure_saved"))
    back = r.get("to_training_s")
    text += (
        f"; training again {_dur(back)} after the fault ({r['fault_is']})"
        if back is not None
        else "; time to training again unknown"
    )
    phases = []
    for name in ("detection", "exit", "restart", "load", "first_step"):
        v = r.get(f"{name}_s")
        label = name.replace("_", " ")
        part = f"{label} {_dur(v)}" if v is not None else f"{label} unknown"
        if name == "load" and r.get("checkpoint_load_s") is not None:
            part += f" (checkpoint {_dur(r['checkpoint_load_s'])})"
        phases.append(part)
    text += ": " + ", ".join(phases)
    return text + (
        f"; {r['steps_redone']} step(s) redone (step {r['last_step']} reached, resumed at "
        f"{r['resumed_step']})"
    )


def _preempted_line(p: dict[str, Any]) -> str:
    """A signal stop: the signal, the step, the checkpoint, and who resumes it."""
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
    return (
        f"  ended        stopped by {p['signal']} at step {p['step']} (a pre-emption); "
        f"{saved}; {then}"
    )


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


#: A committer's wait for the other ranks' parts said in the restart line from this long:
#: ranks that fail together file theirs within about a second.
_SAID_WAIT_S = 2.0


def _failure_save_text(f: dict[str, Any] | None) -> str:
    """The restart line's clause on the failed attempt's failure save: written whole,
    written without some ranks (never resumed from), or not written (and why)."""
    if not f:
        return ""
    took = f" in {_dur(float(f['seconds']))}" if f.get("seconds") is not None else ""
    if f.get("path") is None:
        why = f.get("why")
        return "; no failure save" + (f" ({why})" if why else "")
    # The committer's wait for the other ranks' parts, when it is most of the save: a
    # rank that had not heard of the failure (stuck, or waiting in a collective).
    phases = f.get("phases") or {}
    if {"gathered", "written"} <= phases.keys():
        waited = phases["gathered"] - phases["written"]
        if waited >= _SAID_WAIT_S:
            took += f", {_dur(waited)} of it waiting for the other ranks' parts"
    if f.get("missing"):
        missing = f"rank(s) {f['missing']} missing"
        return f"; incomplete failure save at step {f.get('step')}{took} ({missing})"
    return f"; failure save at step {f.get('step')}{took}"
