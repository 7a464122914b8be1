"""The watchdog's verdicts: from every rank's records, which rank failed, ran out of data
or is stuck, and the error each rank raises, naming it.

Plain functions: each takes the records (and the facts it needs) and returns the
verdict's *spec* (a JSON-able dict: class, message, hint, fields), which the watchdog
claims in the store (first writer wins) and every rank builds into its error
(:func:`build`). Nothing here reads the store or keeps state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from guardrails._errors import GuardrailsError, HangError, RankFailedError, UnevenDataError
from guardrails.distributed.store import agent_holds_store
from guardrails.guards.watchdog.records import (
    _first_line,
    _in_collective,
    _progress_key,
    _where,
    activity,
)

if TYPE_CHECKING:
    from guardrails.engine.guard import Guard

# Stacks in a HangError: stuck ranks' first, then waiting ones, 8 in all (at 1,000
# ranks all stacks would make a ~3 MB verdict, copied into every rank's error file).
STACKS_SHOWN = 8
_CLASSES: dict[str, type[GuardrailsError]] = {
    "HangError": HangError,
    "RankFailedError": RankFailedError,
    "UnevenDataError": UnevenDataError,
}


#: Errors a component raises on every rank at the same step (so a peer's is not news).
RAISED_EVERYWHERE = {"NonFiniteError", "CollectiveMismatchError", "ConfigMismatchError"}


def _group(records: dict[int, dict[str, Any]], ranks: list[int]) -> dict[str, list[int]]:
    """``ranks`` grouped by where they are (one clause per place, not per rank: a
    thousand ranks waiting in the same all-reduce are one line)."""
    out: dict[str, list[int]] = {}
    for r in ranks:
        out.setdefault(_where(records[r]), []).append(r)
    return out


def _ranks(ranks: list[int]) -> str:
    """``rank 3`` / ``ranks 0-2, 5``: consecutive runs collapsed."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    text = ", ".join(
        f"{run[0]}-{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)) for run in runs
    )
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"


def _spec(cls: str, message: str, *, hint: str, **fields: Any) -> dict[str, Any]:
    return {"cls": cls, "message": message, "hint": hint, "fields": fields}


def build(spec: dict[str, Any], guard: Guard) -> GuardrailsError:
    """The verdict as this rank's error: same class, message and fields everywhere,
    ``rank``/``step`` this rank's."""
    fields = dict(spec.get("fields", {}))
    for name in ("lengths", "where", "stacks", "cpu"):  # JSON made the rank keys strings
        if isinstance(fields.get(name), dict):
            fields[name] = {int(k): v for k, v in fields[name].items()}
    fields["verdict_by"] = spec.get("by")
    cls = _CLASSES.get(spec.get("cls", ""), HangError)
    return cls(spec["message"], rank=guard.rank, step=guard.step, hint=spec.get("hint"), **fields)


def rank_failed(
    records: dict[int, dict[str, Any]],
    r: int,
    *,
    dead: bool,
    pid_gone: bool,
    stale_s: float,
    mine: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Rank ``r`` failed: never started (no record), died (``dead``: its pid gone on
    this machine, ``pid_gone``, or no heartbeat for ``stale_s``), raised, or left the
    loop while others wait for it. ``mine``: this rank's own record now, with
    ``waiting`` (where it waits in a collective, or ``None``): what dates a death."""
    rec = records.get(r)
    if rec is None:
        return _never_started(r)
    where = _where(rec)
    logs = f"its events in {rec['events']}" if rec.get("events") else "its log"
    if dead:
        how = (
            f"its process (pid {rec['pid']}) is gone: killed (SIGKILL, the OOM killer) "
            "or crashed without a Python exception"
            if pid_gone
            else f"it stopped sending heartbeats for over {stale_s:.0f} s: the process or "
            "its machine died, or it is frozen holding the GIL"
        )
        what, last_step = _died(r, rec, where, mine)
        what += f": {how}."
        reason = "killed" if pid_gone else "no_heartbeat"
        hint = (
            f"read rank {r}'s log and {logs}; on Linux `dmesg | grep -i -e oom -e killed` "
            "tells an OOM kill (host memory: fewer DataLoader workers, smaller "
            "prefetch). Then restart from the last checkpoint."
        )
        return _spec(
            "RankFailedError",
            what,
            failed_rank=r,
            last_step=last_step,
            last_phase=rec.get("phase") if last_step == rec.get("step") else None,
            heartbeat_step=rec.get("step"),
            heartbeat_age_s=_age(rec, mine),
            reason=reason,
            log=rec.get("events"),
            hint=hint,
        )
    if rec.get("state") == "failed":
        what = (
            f"rank {r} failed at step {rec['step']} ({where}) with "
            f"{rec.get('error', 'an exception')}; this rank would wait for it forever."
        )
        reason = "exception"
        hint = f"the error and its traceback are in rank {r}'s log; fix that error."
    else:
        what = (
            f"rank {r} left the guarded loop at step {rec['step']} (closed normally) "
            "while this rank still waits for it."
        )
        reason = "left_loop"
        hint = (
            "every rank must run the same number of steps: stop all ranks on the "
            "same condition (a step count, not a per-rank data or time budget)."
        )
    return _spec(
        "RankFailedError",
        what,
        failed_rank=r,
        last_step=rec.get("step"),
        last_phase=rec.get("phase"),
        reason=reason,
        log=rec.get("events"),
        hint=hint,
    )


def _never_started(r: int) -> dict[str, Any]:
    return _spec(
        "RankFailedError",
        f"rank {r} never reported to the watchdog: it died or hung before its guard "
        "started (check its log for an error at startup)",
        failed_rank=r,
        last_step=None,
        last_phase=None,
        reason="never_started",
        hint=f"read rank {r}'s log (stderr; torchrun: --log-dir DIR --tee 3 keeps "
        "one file per rank) for the first error.",
    )


def _age(rec: dict[str, Any], mine: dict[str, Any] | None) -> float | None:
    """How old ``rec`` is (s) on this rank's clock, or ``None`` without a time."""
    if mine is None or not isinstance(rec.get("time"), (int, float)):
        return None
    return round(max(0.0, float(mine["time"]) - float(rec["time"])), 1)


def _died(
    r: int, rec: dict[str, Any], where: str, mine: dict[str, Any] | None
) -> tuple[str, int | None]:
    """When rank ``r`` died, in words, and the step it was at (``last_step``).

    Heartbeats are published only while some rank is suspect (watchdog.py: nothing per
    period on a healthy run), so a dead rank's record is often its first, from before
    the first batch: "last heartbeat: step 0" for a rank that ran 150 steps. What dates
    the death is this rank: waiting for ``r`` in a collective at step N, it is in the
    step ``r`` was in (under DDP every step's gradients are all-reduced by every rank),
    and the record is told with its own step and age."""
    age = _age(rec, mine)
    said = f"{age:.0f} s ago, " if age is not None else ""
    if rec.get("phase") == "setup" and mine is not None and int(mine.get("step") or 0) > 0:
        # Its first record: saying "step 0" of a rank that trained with this one misled.
        heard = (
            "it sent no heartbeat after its start (ranks send them only while one seems "
            "stuck), so its own step is not known"
        )
    else:
        heard = f"its last heartbeat, {said}was at step {rec['step']} ({where})"
    if mine is None:
        return f"rank {r} died ({heard})", rec.get("step")
    step = mine.get("step")
    if mine.get("waiting") and isinstance(step, int) and step >= int(rec.get("step") or 0):
        return (
            f"rank {r} died during step {step} (this rank was waiting for it, "
            f"{mine['waiting']}); {heard}",
            step,
        )
    return f"rank {r} died; this rank is at step {step}; {heard}", rec.get("step")


def uneven(records: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The loader ran out on some ranks while others still had data."""
    lengths = {r: int(rec.get("batches", 0)) for r, rec in sorted(records.items())}
    out = sorted(r for r, rec in records.items() if rec.get("exhausted"))
    still = [r for r in lengths if r not in out]
    shown = ", ".join(f"rank {r}: {n}{'' if r in out else '+'}" for r, n in lengths.items())
    waiting = "; ".join(f"rank {r} waits {_where(records[r])}" for r in still)
    what = (
        f"the loader ran out on rank(s) {', '.join(map(str, out))} while other ranks "
        f"still had data (batches fetched: {shown}; + = still fetching). "
        + (f"{waiting}. " if waiting else "")
        + "Ranks that run out leave the loop; the others wait in the next collective "
        "for a partner that never comes."
    )
    return _spec(
        "UnevenDataError",
        what,
        lengths=lengths,
        exhausted_ranks=out,
        hint="give every rank the same number of batches: the same dataset on every "
        "rank (check the data path/shards each rank sees), a DistributedSampler "
        "(drop_last=True) instead of per-rank files, and DataLoader(drop_last=True).",
    )


def _stuck(live: dict[int, dict[str, Any]], waiting: dict[int, bool]) -> list[int]:
    """The ranks not inside a collective; without that information (all or none are),
    the least advanced ones."""
    stuck = [r for r in live if not waiting[r]]
    if not stuck or len(stuck) == len(live):
        keys = {r: _progress_key(rec) for r, rec in live.items()}
        lowest = min(keys.values())
        stuck = [r for r, k in keys.items() if k == lowest]
    return sorted(stuck)


def _hang_head(
    live: dict[int, dict[str, Any]], stuck: list[int], waiting: dict[int, bool], timeout: float
) -> str:
    """The verdict's first line: who is stuck where, and who waits for it."""
    if len(stuck) == len(live) and len(live) > 1:
        return (
            f"no rank made progress for {timeout:.0f} s and none is behind the others: "
            + "; ".join(f"{_ranks(rs)} {w}" for w, rs in _group(live, sorted(live)).items())
            + ". Every rank waits: ranks in different collectives are a collective "
            "mismatch; all in the same one points at the network or a GPU."
        )
    # Outside a collective, whether the rank computes (a crawl: a step slower than
    # the timeout) or is blocked tells the user where to look first.
    busy = {r: "" if waiting[r] else activity(live[r]) for r in stuck}
    lines = [
        f"rank {r} is stuck at step {live[r]['step']}, {_where(live[r])}"
        + ("" if waiting[r] else ", outside any collective")
        + (f", {busy[r]}" if busy[r] else "")
        for r in stuck[:STACKS_SHOWN]
    ]
    if len(stuck) > STACKS_SHOWN:
        lines.append(f"and {len(stuck) - STACKS_SHOWN} more stuck ranks")
    waiters = [r for r in sorted(live) if r not in stuck]
    waits = [
        f"{_ranks(rs)} {'waits' if len(rs) == 1 else 'wait'} for it {where}"
        for where, rs in _group(live, waiters).items()
    ]
    return (
        f"no progress for {timeout:.0f} s: "
        + "; ".join(lines)
        + (". " + "; ".join(waits) if waits else "")
        + "."
    )


def hang(
    records: dict[int, dict[str, Any]], stacks: dict[int, str], timeout: float
) -> dict[str, Any]:
    """No rank moved for ``timeout`` seconds: which ranks are stuck (not in a
    collective, or the least advanced), where, with their stacks (``stacks``: the
    ones published, by rank)."""
    live = {r: rec for r, rec in records.items() if "state" not in rec}
    for r, rec in records.items():
        rec["_stack"] = stacks.get(r, "")
    waiting = {r: _in_collective(rec) for r, rec in live.items()}
    stuck = _stuck(live, waiting)
    head = _hang_head(live, stuck, waiting, timeout)
    # STACKS_SHOWN stacks, stuck ranks first: the verdict travels through the store
    # and into every rank's error file.
    shown = stuck[:STACKS_SHOWN] + [r for r in sorted(records) if r not in stuck]
    shown = sorted(shown[:STACKS_SHOWN])
    stack_text = "\n".join(
        f"--- rank {r} ({'stuck' if r in stuck else 'waiting'}), main thread, innermost "
        f"last ---\n{records[r]['_stack'] or '  (no stack: its watchdog did not publish one)'}"
        for r in shown
    )
    if len(shown) < len(records):
        stack_text += f"\n(the stacks of {len(records) - len(shown)} more ranks: not shown)"
    spot = _where(live[stuck[0]]) if stuck else "the place shown"
    hint = (
        f"look at what rank {stuck[0]} does {spot} (its stack is above): a sleep, a lock, a "
        "read from a pipe/socket/stalled filesystem, a DataLoader worker, or a branch "
        "taken on some ranks only that skips a collective. If the pause is legitimate "
        '(evaluation, a big save) wrap it in `with g.pause_watchdog("eval"):` or '
        'raise the timeout: guard(..., watchdog={"hang_timeout_s": ...}).'
    )
    return _spec(
        "HangError",
        f"{head}\n{stack_text}",
        stuck_ranks=stuck,
        where={r: _where(rec) for r, rec in live.items()},
        cpu={r: live[r].get("cpu") for r in stuck},
        stacks={r: records[r]["_stack"] for r in shown},
        timeout_s=timeout,
        hint=hint,
    )


def store_down(
    exc: Exception, down_s: float, *, rank: int, step: int, host: dict[str, Any] | None = None
) -> RankFailedError:
    """The job's store stopped answering this rank for ``down_s``: its host is gone.
    With torchrun the store lives in the agent (TORCHELASTIC_USE_AGENT_STORE), else on
    rank 0; ``host``: rank 0's last record, when it ran on this node and has exited."""
    agent = agent_holds_store()
    who = "the torchrun agent" if agent else "rank 0 (it hosts the TCPStore)"
    how_long = f" for {down_s:.0f} s" if down_s >= 1 else ""
    ended = "died or lost the network"
    if host is not None:
        how = "closed" if host.get("state") == "closed" else host.get("error") or "killed"
        ended = f"exited at step {host.get('step')} ({how})"
    return RankFailedError(
        f"the job's key-value store stopped answering ({type(exc).__name__}: "
        f"{_first_line(exc)}){how_long}: {who} has {ended}. This rank cannot reach the "
        "others any more.",
        rank=rank,
        step=step,
        failed_rank=None if agent else 0,
        hint="look at the log of "
        + ("the launcher" if agent else "rank 0")
        + " for why it ended (OOM killer, a crash, a node failure), and restart.",
    )
