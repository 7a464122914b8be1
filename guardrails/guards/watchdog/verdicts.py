"""The watchdog's verdicts: from every rank's records, which rank failed, ran out of data
or is stuck, and the error each rank raises, naming it.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

from guardrails._errors import GuardrailsError, HangError, RankFailedError, UnevenDataError
from guardrails.distributed import dist as _dist
from guardrails.guards.watchdog.records import (
    STALE_PERIODS,
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
_RAISED_EVERYWHERE = {"NonFiniteError", "CollectiveMismatchError", "ConfigMismatchError"}


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


def _build(spec: dict[str, Any], guard: Guard) -> GuardrailsError:
    """The verdict as this rank's error: same class, message and fields everywhere,
    ``rank``/``step`` this rank's."""
    fields = dict(spec.get("fields", {}))
    for name in ("lengths", "where", "stacks", "cpu"):  # JSON made the rank keys strings
        if isinstance(fields.get(name), dict):
            fields[name] = {int(k): v for k, v in fields[name].items()}
    fields["verdict_by"] = spec.get("by")
    cls = _CLASSES.get(spec.get("cls", ""), HangError)
    return cls(spec["message"], rank=guard.rank, step=guard.step, hint=spec.get("hint"), **fields)


class Verdicts:
    """Part of :class:`Watchdog`: see its docstring."""

    def _rank_failed(
        self, guard: Guard, records: dict[int, dict[str, Any]], r: int, *, dead: bool
    ) -> GuardrailsError:
        rec = records.get(r)
        if rec is None:
            what = (
                f"rank {r} never reported to the watchdog: it died or hung before its guard "
                "started (check its log for an error at startup)"
            )
            spec = _spec(
                "RankFailedError",
                what,
                failed_rank=r,
                last_step=None,
                last_phase=None,
                reason="never_started",
                hint=f"read rank {r}'s log (stderr; torchrun: --log-dir DIR --tee 3 keeps "
                "one file per rank) for the first error.",
            )
            return self._claim(guard, spec)
        where = _where(rec)
        logs = f"its events in {rec['events']}" if rec.get("events") else "its log"
        if dead:
            pid_gone = rec.get("host") == self._host and not _dist.pid_alive(int(rec["pid"]))
            how = (
                f"its process (pid {rec['pid']}) is gone: killed (SIGKILL, the OOM killer) "
                "or crashed without a Python exception"
                if pid_gone
                else f"it stopped sending heartbeats for over "
                f"{STALE_PERIODS * self._period:.0f} s: the process or its "
                "machine died, or it is frozen holding the GIL"
            )
            what = f"rank {r} died (last heartbeat: step {rec['step']}, {where}): {how}."
            reason = "killed" if pid_gone else "no_heartbeat"
            hint = (
                f"read rank {r}'s log and {logs}; on Linux `dmesg | grep -i -e oom -e killed` "
                "tells an OOM kill (host memory: fewer DataLoader workers, smaller "
                "prefetch). Then restart from the last checkpoint."
            )
        else:
            state = rec.get("state")
            if state == "failed":
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
        spec = _spec(
            "RankFailedError",
            what,
            failed_rank=r,
            last_step=rec.get("step"),
            last_phase=rec.get("phase"),
            reason=reason,
            log=rec.get("events"),
            hint=hint,
        )
        return self._claim(guard, spec)

    def _uneven(self, guard: Guard, records: dict[int, dict[str, Any]]) -> GuardrailsError:
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
        spec = _spec(
            "UnevenDataError",
            what,
            lengths=lengths,
            exhausted_ranks=out,
            hint="give every rank the same number of batches: the same dataset on every "
            "rank (check the data path/shards each rank sees), a DistributedSampler "
            "(drop_last=True) instead of per-rank files, and DataLoader(drop_last=True).",
        )
        return self._claim(guard, spec)

    def _diagnose(
        self, guard: Guard, records: dict[int, dict[str, Any]], timeout: float
    ) -> GuardrailsError | None:
        live = {r: rec for r, rec in records.items() if "state" not in rec}
        others = [r for r in live if r != self._rank]
        if not others and len(live) < len(records):
            # Every other rank has left its loop. Only a hang if this rank waits for them
            # (in a collective); rank-0-only work after the loop (a final eval, a save)
            # waits for nobody.
            if not self._waiting(guard):
                return None
            return self._rank_failed(guard, records, min(set(records) - set(live)), dead=False)
        if (
            others
            and not any(
                live[r].get("idle_s", 0) >= timeout / 2 or live[r].get("collective") for r in others
            )
            and not self._waiting(guard)
        ):
            return None  # the others move and this rank waits for none: not a hang
        exhausted = [r for r, rec in records.items() if rec.get("exhausted")]
        if exhausted and len(exhausted) < len(records):
            return self._uneven(guard, records)
        stacks = self._read_stacks(sorted(records))
        if self._awaiting_stacks(live, stacks, timeout):
            return None
        for r, rec in records.items():
            rec["_stack"] = stacks.get(r, "")
        waiting = {r: _in_collective(rec) for r, rec in live.items()}
        stuck = [r for r in live if not waiting[r]]
        if not stuck or len(stuck) == len(live):
            keys = {r: _progress_key(rec) for r, rec in live.items()}
            lowest = min(keys.values())
            stuck = sorted(r for r, k in keys.items() if k == lowest)
        stuck.sort()
        waiters = [r for r in sorted(live) if r not in stuck]
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
        waits = [
            f"{_ranks(rs)} {'waits' if len(rs) == 1 else 'wait'} for it {where}"
            for where, rs in _group(live, waiters).items()
        ]
        if len(stuck) == len(live) and len(live) > 1:
            head = (
                f"no rank made progress for {timeout:.0f} s and none is behind the others: "
                + "; ".join(f"{_ranks(rs)} {w}" for w, rs in _group(live, sorted(live)).items())
                + ". Every rank waits: ranks in different collectives are a collective "
                "mismatch; all in the same one points at the network or a GPU."
            )
        else:
            head = (
                f"no progress for {timeout:.0f} s: "
                + "; ".join(lines)
                + (". " + "; ".join(waits) if waits else "")
                + "."
            )
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
        spec = _spec(
            "HangError",
            f"{head}\n{stack_text}",
            stuck_ranks=stuck,
            where={r: _where(rec) for r, rec in live.items()},
            cpu={r: live[r].get("cpu") for r in stuck},
            stacks={r: records[r]["_stack"] for r in shown},
            timeout_s=timeout,
            hint=hint,
        )
        return self._claim(guard, spec)

    def _explain(self, guard: Guard, *, deadline_s: float) -> GuardrailsError | None:
        """For an exception from a collective: which peer ended (failed, was killed,
        ran out of data, left the loop), read within ``deadline_s``; ``None`` if none.
        The one-key answers first (the job's verdict, the first failure, the first
        rank out of data); every rank's records only if they say nothing."""
        end = time.monotonic() + deadline_s
        while True:
            try:
                adopted = self._adopt_verdict(guard)
                if adopted is not None:
                    return adopted
                failed = self._peer_failed(guard, idle=math.inf)  # no beat: it failed
                if failed is not None:
                    return failed
                uneven = self._past_a_shorter_peer(guard)
                if uneven is not None:
                    return uneven
                finished = self._read("end", exclude_self=True)
                records = self._read("hb", exclude_self=True)
                for r, rec in sorted(records.items()):
                    if r in finished:
                        continue
                    if rec.get("host") == self._host and not _dist.pid_alive(int(rec["pid"])):
                        return self._rank_failed(guard, records, r, dead=True)
                if finished:
                    return self._rank_failed(guard, finished, min(finished), dead=False)
            except Exception as exc:  # the store is gone: its host died
                return self._store_down_now(guard, exc)
            if time.monotonic() >= end:
                return None
            time.sleep(0.1)

    def _check_uneven_at_end(self, guard: Guard) -> GuardrailsError | None:
        """This rank's loop ended because its loader ran out: if a peer has fetched
        more batches, the data is uneven and the peer is now waiting for this rank in
        a collective. The peer finds out from this rank's record under the pass's
        ``len`` key and claims the verdict; this rank waits for it a few periods at
        most, and not at all once every rank has run out of this pass too."""
        try:
            uneven = self._post_exhausted(guard)
        except Exception:
            return None
        if uneven is not None:
            return uneven
        epoch = guard.exhausted_at[0] if guard.exhausted_at is not None else guard.epoch
        deadline = time.monotonic() + 2 * self._period + 1
        while True:
            try:
                adopted = self._adopt_verdict(guard)
                if adopted is not None:
                    return adopted
                if self._store.add(f"out/{epoch}", 0) >= self._world:
                    return None  # every rank ran out of the same pass
            except Exception:
                return None
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.1)
