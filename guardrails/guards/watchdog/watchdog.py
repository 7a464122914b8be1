"""Watchdog: a hang, a dead rank or a rank out of data becomes an error naming the rank,
instead of NCCL's 10-minute or gloo's 30-minute timeout with no rank, op or line.

One daemon thread per rank. Every ``heartbeat_every_s`` (1 s) it samples, without touching
the main thread, what the main thread advertises on the guard (``step``, ``phase``,
``collective`` set by the auditor, ``paused``, batches fetched, loader exhausted). The
training loop pays nothing per step: no hook, no store call, no lock; the thread reads plain
attributes. In a single process there is no peer to watch: the thread only samples the main
thread's CPU share and publishes the live view.

The store (``guard.side_store("watchdog")``, see ``distributed/store.py``) sees one call per
rank per period in a healthy run: the job's news counter (``guard.news``), which a rank
bumps after writing something the others must see (a verdict, the end of its loop, running
out of data, a request for heartbeats); what is behind it is read only when it moved. The
period stretches with the number of ranks (1 s up to 2,500 ranks, 4 s at 10,000), so the
job's total stays a fixed share of one store server.

A rank that has not advanced (step, batch, collective, phase) for half the timeout (at most
30 s) is *suspect*: it counts itself in the job's ``wake`` counter, and while that count is
above zero every rank publishes its heartbeat (its record above) each period; the suspect
also publishes its main thread's Python stack (``sys._current_frames``). The first rank to
become suspect (the one whose count made it 1) is the *diagnoser*: it alone reads every
rank's records, each period, so a hang costs the others one write and one read a period and
the store O(N) reads, not O(N²); another suspect takes over only if no verdict came half a
timeout after its own (the diagnoser died, or its thread is starved). At the full timeout
the diagnoser concludes from all ranks' records:

* a rank whose process is gone (on this machine its pid, on another no new heartbeat for 3
  periods and half the timeout) or that ended with an exception -> ``RankFailedError``;
* a rank whose loader ran out (the guard's iterator hit ``StopIteration``) while others
  have fetched more batches -> ``UnevenDataError`` (e.g. 201 data shards on one node, 4 on another);
* otherwise -> ``HangError``: the ranks not inside a collective (or, without that
  information, the least advanced ones) are stuck; the others wait for them.

The first rank to conclude claims the verdict in the store (``add`` returns 1 to exactly one
caller) and posts it as news; every other rank adopts it within a period, so all ranks
report the same diagnosis, each with its own rank in the message. Then
``guard.fail_from_thread``: the main thread raises the error at its next step boundary if it
gets there within ``abort_after_s`` (none for a hang); if not (stuck in a collective or a C
call that Python cannot interrupt) the process reports and exits (``engine/process.die``),
so the launcher tears the job down. A peer on this machine that its live record says runs
while its pid is gone (SIGKILL, the OOM killer) is dead at the next tick, no store call
(``live.py``). Death of a peer and the end of a peer's loop are announced at once (its end
record, the first failure kept under one key, and news), so an exception on one rank ends
the others in about a period, not after the timeout. A rank whose loader runs out puts its
record under the pass's ``len`` key (``compare_set``: the first one stays); a rank still
fetching past that length sees it with the news and claims ``UnevenDataError``; when every
rank ran out of the same pass, nobody waits.

Not a hang: a rank inside ``g.pause_watchdog(...)`` (and everyone waiting for it); the
first step (``torch.compile``, cuDNN autotuning, NCCL's lazy communicator setup take
minutes on big models), which gets ``first_step_timeout_s`` instead; and a rank idle
outside any collective that nobody waits for (rank-0-only work after the other ranks
left the loop).

A gloo collective that fails in the main thread because a peer went away ("Connection
closed by peer") is explained at close: the plain error is replaced by the
``RankFailedError`` / ``UnevenDataError`` naming that peer (``guard.replace_error``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from guardrails._errors import GuardrailsError, HangError, RankFailedError
from guardrails.distributed import store as _store
from guardrails.distributed.store import agent_holds_store, claim_verdict, read_verdict
from guardrails.engine.component import Component
from guardrails.engine.config import configure
from guardrails.engine.where import data_position, thread_stack
from guardrails.guards.watchdog import verdicts
from guardrails.guards.watchdog.clock import ProgressClock
from guardrails.guards.watchdog.live import LivePublisher
from guardrails.guards.watchdog.records import (
    STALE_PERIODS,
    _first_line,
    _from_peer,
    _host_id,
    _in_collective,
    _jsonable,
    _own_failure,
    _past,
    _position,
    _where,
    alive_here,
    ddp_wrapped_models,
    gone_here,
    last_seen,
    read_records,
    read_stacks,
)
from guardrails.util.checks import positive

if TYPE_CHECKING:
    from guardrails.engine.guard import Guard

log = logging.getLogger("guardrails.watchdog")

# Until this rank completes its first optimizer step: compile / autotune / lazy NCCL
# init. 600 s is NCCL's default collective timeout, so no slower than torch alone.
FIRST_STEP_TIMEOUT_S = 600.0
# Idle this long (or half the timeout), a rank publishes its stack and reads every heartbeat
# (pauses; a peer dead on another machine: seen within 30 s even in the 600 s first step).
SUSPECT_AFTER_S = 30.0


class Watchdog(Component):
    """Turns a hang, a dead rank or uneven data into ``HangError``, ``RankFailedError`` or
    ``UnevenDataError`` on every rank, within ``hang_timeout_s``. In a single process
    (no peers to watch) its thread runs only the live view (``guardrails top`` /
    ``stacks``); ``watchdog=False`` turns both off. Knobs: :class:`Watchdog.Config`
    (``guardrails.guard(watchdog=...)``)."""

    @dataclass(kw_only=True)
    class Config:
        """Watchdog's knobs.

        Attributes:
            hang_timeout_s: seconds without progress on any rank (no step, batch or
                collective advancing) before the watchdog reports a ``HangError`` (or
                ``RankFailedError`` / ``UnevenDataError``) naming the rank, where it is
                and every rank's stack, and ends the job. ``None`` (default): 5x the
                longest gap between two steps seen so far, at least 60 s and at most
                300 s (300 s until a gap after the first step is seen); see ``AUTO_*``
                in ``guards/watchdog/watchdog.py`` for why these numbers. Mark long
                legitimate pauses with ``g.pause_watchdog()``.
            first_step_timeout_s: the allowance for a rank inside its first optimizer
                step (compilation, autotuning, NCCL's lazy communicator setup); a rank
                still waiting for its first batch gets ``hang_timeout_s``. Default
                600 s (NCCL's own timeout), or ``hang_timeout_s`` if that is longer.
            heartbeat_every_s: how often the thread samples and publishes. Default 1 s,
                or a quarter of ``hang_timeout_s`` when that is under 4 s.
            abort_after_s: after a verdict other than a hang (a peer that failed or
                died, uneven data), how long the main thread gets to raise it at a step
                boundary before the process reports and exits by itself. Default 2 s.
                After a hang's, none: a rank idle for the whole timeout, and those
                waiting for it, are not about to reach a boundary.
        """

        hang_timeout_s: float | None = None
        first_step_timeout_s: float = FIRST_STEP_TIMEOUT_S
        heartbeat_every_s: float | None = None
        abort_after_s: float = 2.0

        def __post_init__(self) -> None:
            positive("hang_timeout_s", self.hang_timeout_s, allow_none=True)
            positive("first_step_timeout_s", self.first_step_timeout_s)
            positive("heartbeat_every_s", self.heartbeat_every_s, allow_none=True)
            positive("abort_after_s", self.abort_after_s)
            if self.hang_timeout_s is not None:
                self.hang_timeout_s = float(self.hang_timeout_s)
            self.first_step_timeout_s = float(self.first_step_timeout_s)
            if self.heartbeat_every_s is None:
                timeout = self.hang_timeout_s
                self.heartbeat_every_s = 1.0 if timeout is None else min(1.0, timeout / 4)
            self.heartbeat_every_s = float(self.heartbeat_every_s)
            self.abort_after_s = float(self.abort_after_s)

    name = "watchdog"

    def __init__(self, config: Watchdog.Config | None = None, /, **knobs: Any) -> None:
        configure(self, config, knobs)
        #: The error this watchdog concluded (on any rank), or ``None``.
        self.error: GuardrailsError | None = None
        self._guard: Guard | None = None
        self._store: Any = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    # ------------------------------------------------------------------ lifecycle

    def on_start(self, guard: Guard) -> None:
        self._guard = guard
        # None in a single process: no peers to watch, only the live view (issue 51).
        self._store = guard.side_store("watchdog")
        self._main_ident = threading.get_ident()
        self._rank, self._world = guard.rank, guard.world_size
        self._host = _host_id()
        self._seq = 0
        # When the main thread last moved, the step gaps, the timeout, its CPU share
        # (sampled every tick, one /proc read, published in the heartbeat).
        self._clock = ProgressClock(
            hang_timeout_s=self.hang_timeout_s,
            first_step_timeout_s=self.first_step_timeout_s,
            step=guard.step,
            now=time.monotonic(),
        )
        self._stop.clear()
        self._during_close = False  # this rank's verdict came after its loop ended
        # The thread's period: the heartbeat's; alone, the live view's, once a second at
        # most (a short hang timeout shortens the heartbeat; one process has no hang).
        self._tick_s = self.heartbeat_every_s
        if self._store is not None:
            self._start_watching(guard)
        else:
            self._tick_s = max(1.0, self.heartbeat_every_s)
        # `guardrails top` / `stacks` (issue 51): files, from this thread; no store call.
        self._live = LivePublisher(guard, host=self._host, tick_s=self._tick_s)
        self._thread = threading.Thread(
            target=self._run, name=f"guardrails-watchdog-rank{self._rank}", daemon=True
        )
        self._thread.start()

    def _start_watching(self, guard: Guard) -> None:
        """The peers' side: the news, the suspicion, this rank's first heartbeat."""
        self._stacks_awaited_since: float | None = None
        self._ends_seen = 0
        # The counter starts at 0 with this guard's keys: anything a peer posts, even
        # before this rank's first tick, is news.
        self._news_seen = 0
        # The news poll's period, and the heartbeats' while someone asks for them:
        # stretched with the world size so that all ranks stay within the store's
        # budget (1 s up to 2,500 ranks, 4 s at 10,000).
        self._period = _store.stretched(self.heartbeat_every_s, self._world)
        self._published_at = self._stack_at = -math.inf
        self._awake = False  # some rank is suspect: publish heartbeats every period
        self._woke = False  # this rank counted itself in "wake"
        self._diagnoser = False  # ...and was the first to: it reads every rank
        self._exhausted_posted: tuple[int, int] | None = None
        self._exhausted_lock = threading.Lock()
        self._peer_seen: dict[int, tuple[int, float]] = {}  # rank -> (seq, first seen)
        self._store_down_since: float | None = None
        self._publish(self._record(guard, time.monotonic()))  # visible before any read

    def on_end(self, guard: Guard, exc: BaseException | None) -> None:
        if self._guard is None:
            return
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10 * self.heartbeat_every_s + 5)
        self._thread = None
        try:
            if self._store is not None:
                self._finish(guard, exc)
        finally:
            self._live.close(guard, self._clock.cpu, self.error or exc)  # the diagnosis
            self._guard = None
            self._store = None

    def _finish(self, guard: Guard, exc: BaseException | None) -> None:
        """Announce how this rank's loop ended, and explain an error caused by a peer."""
        if self.error is not None and self._during_close and _own_failure(exc):
            # The loop had ended with an error of its own before a peer was found dead
            # (torchrun ends the others once one rank exits): that error is this rank's
            # diagnosis, not the death that followed it.
            self.error = None
        if self.error is not None:
            # Our own verdict: the main thread may have raised something else meanwhile
            # (gloo's "Connection reset by peer" when the failed rank exited), or closed
            # without error while another component's closing collective failed.
            self._announce(guard, "aborted", self.error)
            if exc is None:
                raise self.error
            if not isinstance(exc, GuardrailsError):  # never hide another diagnosis
                guard.replace_error(self.error)
            return
        if exc is not None and not isinstance(exc, GuardrailsError) and _from_peer(exc):
            # A collective failed under us: find out which peer caused it, a few
            # heartbeats at most (the peer announces its end before it exits).
            explained = self._explain(guard, deadline_s=3 * self.heartbeat_every_s + 1)
            if explained is not None:
                self.error = explained
                guard.replace_error(explained)
                self._announce(guard, "aborted", explained)
                return
        # A loop that calls next() by hand ends with the StopIteration of the guard's
        # iterator (or the RuntimeError a generator turns it into) when its data runs
        # out: that is running out of data, not a failure.
        ran_out = (
            exc is not None
            and guard.exhausted_at is not None
            and (isinstance(exc, StopIteration) or isinstance(exc.__cause__, StopIteration))
        )
        planned = isinstance(exc, SystemExit) and guard.stopping is not None
        if exc is not None and not (ran_out or planned):
            self._announce(guard, "failed", exc)
            return
        # Closed normally, ran out of data, or exiting after the signal save every rank
        # agreed on (the other ranks are stopping at the same step: nobody waits).
        self._announce(guard, "closed", None)
        if guard.exhausted_at is not None:
            uneven = self._check_uneven_at_end(guard)
            if uneven is not None:
                self.error = uneven
                guard.event("uneven_data", level="error", message=uneven.message, ends_run=True)
                if exc is not None:  # the StopIteration becomes what it means
                    guard.replace_error(uneven)
                    return
                raise uneven

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
                finished = read_records(self._store, "end", world=self._world, exclude=self._rank)
                records = read_records(self._store, "hb", world=self._world, exclude=self._rank)
                for r, rec in sorted(records.items()):
                    if r in finished:
                        continue
                    if gone_here(rec, self._host):
                        # This rank's collective failed of it: it was waiting for r.
                        return self._rank_failed(guard, records, r, dead=True, waited=True)
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

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        every = self._tick_s
        while not self._stop.wait(every):
            guard = self._guard
            if guard is None or self.error is not None:
                return
            if self._store is None:  # a single process: its CPU share and the live view
                self._clock.sample(guard, time.monotonic())
                self._live.tick(guard, self._clock.cpu)
                continue
            try:
                verdict = self._tick(guard)
                self._live.tick(guard, self._clock.cpu)
                self._store_down_since = None
            except Exception as exc:  # the store host (rank 0 / the agent) is gone?
                verdict = self._store_down(guard, exc)
            if verdict is not None and not self._stop.is_set():
                self._fail(guard, verdict)
                return

    def _tick(self, guard: Guard) -> GuardrailsError | None:
        now = time.monotonic()
        self._clock.sample(guard, now)
        idle = self._clock.idle_s(now)
        timeout = self._timeout(guard)
        suspect = idle >= min(timeout / 2, SUSPECT_AFTER_S)
        self._count_suspect(guard, suspect)
        if suspect and now - self._stack_at >= self._period:
            # Refreshed every period: the report shows where it is now.
            self._store.set(f"stack/{self._rank}", thread_stack(self._main_ident))
            self._stack_at = now

        # A healthy run costs one call here a period: the job's news counter. What is
        # behind it (a verdict, a peer's end, a request for heartbeats) is read only
        # when it moved.
        news = guard.news.current(max_age_s=self._period)
        if news != self._news_seen:
            self._news_seen = news
            adopted = self._adopt_verdict(guard)
            if adopted is not None:
                return adopted
            self._awake = self._store.add("wake", 0) > 0
            ends = self._store.add("ends", 0)
            if ends > self._ends_seen:
                self._ends_seen = ends
                failed = self._peer_failed(guard, idle)
                if failed is not None:
                    return failed
            uneven = self._past_a_shorter_peer(guard)
            if uneven is not None:
                return uneven
        gone = self._live.gone_peers()  # same machine: a SIGKILL seen within a tick
        if gone:
            r, live = min(gone.items())
            return self._rank_failed(guard, {r: last_seen(self._store, r, live)}, r, dead=True)
        if (self._awake or suspect) and now - self._published_at >= self._period:
            self._publish(self._record(guard, now, idle=idle))
        if guard.exhausted_at is not None:
            # Ran out of data but still inside the guard (closing, or in a collective
            # after its loop): a peer already past this rank's last batch will wait
            # for it forever. Said once; the peer (or this rank) claims the verdict.
            uneven = self._post_exhausted(guard)
            if uneven is not None:
                return uneven
        if not suspect:
            return None
        # One rank (the first suspect) reads every rank's records each tick; the others
        # wait for its verdict, and take over only if none comes (it died, or its
        # thread is starved) half a timeout after their own.
        takeover = idle >= timeout + max(timeout / 2, STALE_PERIODS * self._period)
        if not (self._diagnoser or takeover):
            return None
        finished = read_records(self._store, "end", world=self._world, exclude=self._rank)
        early = self._check_ended_peers(guard, finished, idle)
        if early is not None:
            return early
        records = read_records(self._store, "hb", world=self._world)
        records.update(finished)
        dead = self._dead_peers(records, now, finished, timeout)
        if dead:
            return self._rank_failed(guard, records, dead[0], dead=True)
        if any(r.get("paused") for k, r in records.items() if k not in finished):
            self._clock.last_progress = now  # a paused peer legitimately holds everyone
            return None
        if idle < timeout:
            self._stacks_awaited_since = None
            return None
        return self._diagnose(guard, records, timeout)

    def _count_suspect(self, guard: Guard, suspect: bool) -> None:
        """Count this rank in the job's ``wake`` counter while it is suspect: every rank
        publishes heartbeats while the count is above zero (only then are they read),
        and the rank that made it 1 is the one that reads them."""
        if suspect == self._woke:
            return
        n = self._store.add("wake", 1 if suspect else -1)
        self._woke = suspect
        self._diagnoser = suspect and n == 1
        self._awake = self._awake or suspect
        guard.news.post()

    def _peer_failed(self, guard: Guard, idle: float) -> GuardrailsError | None:
        """A peer's loop ended with an exception (the first one, from one key)."""
        rec = read_verdict(self._store, "failed")  # set once, by compare_set
        if rec is None or rec["rank"] == self._rank:
            return None
        # An error raised on every rank at the same step (NaN policy, the auditor's
        # mismatch) is about to be raised here too: give it a beat (look again on
        # the next ticks).
        if (
            rec.get("error_class") in verdicts.RAISED_EVERYWHERE
            and idle < 2 * self.heartbeat_every_s + 1
        ):
            self._news_seen = -1
            return None
        return self._rank_failed(guard, {rec["rank"]: rec}, rec["rank"], dead=False)

    def _post_exhausted(self, guard: Guard) -> GuardrailsError | None:
        """Once per pass that ran out: put this rank's record under the pass's ``len``
        key unless a peer's is there (the first to run out), count it in the pass's
        ``out`` counter, and tell everyone. A first record with another length than
        this rank's means uneven data."""
        with self._exhausted_lock:
            at = guard.exhausted_at
            if at is None or at == self._exhausted_posted:
                return None
            self._exhausted_posted = at
            mine = self._record(guard, time.monotonic())
            mine.update(exhausted=True, epoch=at[0], batches=at[1])
            first = json.loads(
                bytes(
                    self._store.compare_set(f"len/{at[0]}", "", json.dumps(mine, default=str))
                ).decode()
            )
            self._store.add(f"out/{at[0]}", 1)
            guard.news.post()
        if first["rank"] != self._rank and _position(first) != at:
            return self._uneven(guard, {first["rank"]: first, self._rank: mine})
        return None

    def _past_a_shorter_peer(self, guard: Guard) -> GuardrailsError | None:
        """This rank, still fetching, is past where a peer's loader ran out in the same
        pass: the peer will never join this rank's next collective."""
        if guard.exhausted_at is not None:
            return None
        here = data_position(guard)
        first = read_verdict(self._store, f"len/{here[0]}")
        if first is None or not _past(here, _position(first)):
            return None
        mine = self._record(guard, time.monotonic())
        return self._uneven(guard, {first["rank"]: first, self._rank: mine})

    def _awaiting_stacks(
        self, live: dict[int, dict[str, Any]], stacks: dict[int, str], timeout: float
    ) -> bool:
        """Whether to hold the verdict for a live peer's stack. A peer publishes its
        stack on the tick its own idle clock passes the suspect mark, and that clock
        can run behind this rank's: the peer made its last progress later, or its
        watchdog thread was starved on a loaded host (seen once in CI: a verdict
        without the stuck rank's stack). Its heartbeat says how idle it was; one
        below the mark has not published yet, so wait for its next ticks, at most the
        mark itself (a peer whose watchdog never publishes is reported without)."""
        mark = min(timeout / 2, SUSPECT_AFTER_S)
        pending = [
            r
            for r, rec in live.items()
            if r != self._rank and r not in stacks and rec.get("idle_s", 0.0) < mark
        ]
        if not pending:
            return False
        now = time.monotonic()
        if self._stacks_awaited_since is None:
            self._stacks_awaited_since = now
        return now - self._stacks_awaited_since < mark

    def _timeout(self, guard: Guard) -> float:
        return self._clock.timeout(guard)

    @property
    def timeout_s(self) -> float | None:
        """The hang timeout in force now (``None`` before the guard started, and in a
        single process: no hang is timed there)."""
        return None if self._guard is None or self._store is None else self._timeout(self._guard)

    # ------------------------------------------------------------------ records

    def _record(self, guard: Guard, now: float, *, idle: float = 0.0) -> dict[str, Any]:
        self._seq += 1
        coll = guard.shared.collective
        here = data_position(guard)
        return {
            "cpu": self._clock.cpu,
            "device": guard.device.type,
            "rank": self._rank,
            "seq": self._seq,
            "time": time.time(),
            "step": guard.step,
            "phase": guard.phase,
            "ddp": ddp_wrapped_models(guard),
            "collective": _jsonable(coll) if coll is not None else None,
            "paused": guard.paused,
            "epoch": here[0],
            "batches": here[1],
            "exhausted": guard.exhausted_at is not None,
            "idle_s": round(idle, 2),
            "pid": os.getpid(),
            "host": self._host,
            "events": str(guard.events.path) if guard.events is not None else None,
        }

    def _publish(self, record: dict[str, Any]) -> None:
        self._store.set(f"hb/{self._rank}", json.dumps(record, default=str))
        self._published_at = time.monotonic()

    def _announce(self, guard: Guard, state: str, exc: BaseException | None) -> None:
        """The loop on this rank ended (``closed``, ``failed`` with ``exc``, or
        ``aborted`` by a verdict): publish the final record and bump the counter every
        thread polls. Best effort: the store may be gone with the job."""
        try:
            record = self._record(guard, time.monotonic())
            record["state"] = state
            if exc is not None:
                record["error"] = f"{type(exc).__name__}: {_first_line(exc)}"
                record["error_class"] = type(exc).__name__
            text = json.dumps(record, default=str)
            self._store.set(f"end/{self._rank}", text)
            # Which ranks ended, in one key: a reader gets the list, then just their
            # records, instead of asking for every rank's key in turn.
            self._store.append("ended", f"{self._rank} ")
            if state == "failed":  # the first failure, where every rank reads it
                self._store.compare_set("failed", "", text)
            self._store.add("ends", 1)
            # A failure is a verdict for the job: the launcher's SIGTERM that follows
            # this rank's exit must not take its place in the others' reports.
            guard.news.post(verdict=state == "failed")
        except Exception as err:
            log.debug("guardrails: watchdog could not announce the end: %s", err)

    # ------------------------------------------------------------------ verdicts

    def _rank_failed(
        self,
        guard: Guard,
        records: dict[int, dict[str, Any]],
        r: int,
        *,
        dead: bool,
        waited: bool = False,
    ) -> GuardrailsError:
        """Rank ``r`` failed (verdicts.rank_failed); ``waited``: this rank's collective
        failed because of it (it was waiting for ``r``, wherever its thread is now)."""
        rec = records.get(r)
        pid_gone = dead and gone_here(rec, self._host)
        spec = verdicts.rank_failed(
            records,
            r,
            dead=dead,
            pid_gone=pid_gone,
            stale_s=STALE_PERIODS * self._period,
            mine=self._dating(guard, waited=waited),
        )
        return self._claim(guard, spec)

    def _dating(self, guard: Guard, *, waited: bool) -> dict[str, Any]:
        """This rank's record now, with where it waits for the others (``None``: it
        does not): what dates a dead peer's death (verdicts.rank_failed). ``waited``:
        its collective already failed, so its phase says where (its thread is in the
        error's handling now), not its stack."""
        mine = self._record(guard, time.monotonic())
        if not waited:
            mine["_stack"] = thread_stack(self._main_ident)
        mine["waiting"] = _where(mine) if waited or self._waiting(guard) else None
        return mine

    def _uneven(self, guard: Guard, records: dict[int, dict[str, Any]]) -> GuardrailsError:
        return self._claim(guard, verdicts.uneven(records))

    def _diagnose(
        self, guard: Guard, records: dict[int, dict[str, Any]], timeout: float
    ) -> GuardrailsError | None:
        """At the full timeout, from every rank's records: a rank that left while this
        one waits, uneven data, or a hang; ``None`` when it is none of them (yet)."""
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
        stacks = read_stacks(self._store, sorted(records))
        if self._awaiting_stacks(live, stacks, timeout):
            return None
        return self._claim(guard, verdicts.hang(records, stacks, timeout))

    def _adopt_verdict(self, guard: Guard) -> GuardrailsError | None:
        verdict = read_verdict(self._store)
        return None if verdict is None else verdicts.build(verdict, guard)

    def _claim(self, guard: Guard, spec: dict[str, Any]) -> GuardrailsError:
        """Publish ``spec`` as the job's verdict unless another rank did first; return
        the verdict in force, as this rank's error."""
        spec = {**spec, "by": self._rank}
        if claim_verdict(self._store, spec):
            guard.news.post(verdict=True)
            return verdicts.build(spec, guard)
        # Lost: the winner sets its verdict right after its claim.
        won = read_verdict(self._store, wait_s=2.0)
        return verdicts.build(spec if won is None else won, guard)

    def _fail(self, guard: Guard, error: GuardrailsError) -> None:
        self.error = error
        try:
            kind = {HangError: "hang", RankFailedError: "rank_failed"}.get(
                type(error), "uneven_data"
            )
            # The head line only: the summary on stderr carries the whole message, and
            # the event is mirrored to the logger (no duplicate stacks in the log).
            guard.event(kind, level="error", message=error.message.splitlines()[0], ends_run=True)
        except Exception:
            pass
        # Inside close() (the loop has ended), the engine ends the process only if the
        # close does not finish: one stuck in a closing collective with the dead peer.
        self._during_close = not guard.running
        # A hang: no rank moved for the timeout, and the waiting ones wait for the stuck
        # one, so none reaches a boundary: the process ends (its failure save begins)
        # now, not abort_after_s later (2 s of every hang's recovery).
        after_s = 0.0 if isinstance(error, HangError) else self.abort_after_s
        taken = guard.fail_from_thread(error, abort_after_s=after_s)
        if not taken and guard.running:
            # Another component's error is already on its way (the auditor's
            # mismatch): that one is the diagnosis, this watchdog stands aside.
            self.error = None

    def _store_down(
        self, guard: Guard, exc: Exception, *, at_once: bool = False
    ) -> GuardrailsError | None:
        """The verdict on a store call that failed: ``None`` until it has failed for as
        long as a hang would take (``at_once``: now, the connection itself is gone)."""
        now = time.monotonic()
        if self._store_down_since is None:
            self._store_down_since = now
            log.debug("guardrails: watchdog store call failed: %s", exc)
        # Unreachable for as long as a hang would take: its host is gone. Rank 0 gone from
        # this node is that answer now (it may exit before its end record is read).
        down_s = now - self._store_down_since
        host = None if agent_holds_store() else self._live.exited(0)
        if not at_once and host is None and down_s < min(self._timeout(guard), 30.0):
            return None
        return verdicts.store_down(exc, down_s, rank=self._rank, step=guard.step, host=host)

    def _check_ended_peers(
        self, guard: Guard, finished: dict[int, dict[str, Any]], idle: float
    ) -> GuardrailsError | None:
        """A peer's loop ended: with an exception (RankFailedError at once), or out of
        data while this rank has fetched more (UnevenDataError at once: it will never
        join this rank's next collective)."""
        for r, rec in sorted(finished.items()):
            state = rec.get("state")
            if state == "failed":
                # An error raised on every rank at the same step (NaN policy, the
                # auditor's mismatch) is about to be raised here too: give it a beat.
                if (
                    rec.get("error_class") in verdicts.RAISED_EVERYWHERE
                    and idle < 2 * self.heartbeat_every_s + 1
                ):
                    continue
                return self._rank_failed(guard, finished, r, dead=False)
            if state == "aborted" and self.error is None:
                adopted = self._adopt_verdict(guard)
                if adopted is not None:
                    return adopted
        exhausted = {r: rec for r, rec in finished.items() if rec.get("exhausted")}
        if guard.exhausted_at is None and any(
            _past(data_position(guard), _position(e)) for e in exhausted.values()
        ):
            mine = self._record(guard, time.monotonic())
            return self._uneven(guard, {**finished, self._rank: mine})
        if (
            len(finished) == self._world - 1
            and idle >= self._timeout(guard)
            and self._waiting(guard)
        ):  # everyone else left the loop, and this rank waits in a collective for them
            return self._rank_failed(guard, finished, min(finished), dead=False)
        return None

    def _waiting(self, guard: Guard) -> bool:
        """Whether this rank's main thread is waiting on other ranks right now."""
        stack = thread_stack(self._main_ident)
        return _in_collective({"collective": guard.shared.collective, "_stack": stack})

    def _dead_peers(
        self,
        records: dict[int, dict[str, Any]],
        now: float,
        finished: dict[int, dict[str, Any]],
        timeout: float,
    ) -> list[int]:
        """Ranks whose process is gone: same machine, its pid no longer exists (exact);
        elsewhere, no new heartbeat for ``STALE_PERIODS`` periods and half the timeout (a
        main thread holding the GIL in a long C call starves its watchdog: only that long
        is it called dead; alive on this machine, a whole timeout more: a starved rank is
        a hang). Plus ranks that never published during a whole timeout."""
        dead = []
        # + 2 periods: a peer publishes once it sees a rank is suspect (a period, or more).
        stale_after = max(STALE_PERIODS * self._period + 0.5, timeout / 2) + 2 * self._period
        for r, rec in records.items():
            if r == self._rank or r in finished:
                continue
            seen = self._peer_seen.get(r)
            if seen is None or seen[0] != rec["seq"]:
                self._peer_seen[r] = seen = (rec["seq"], now)
            alive = alive_here(rec, self._host)  # None: on another machine
            if alive is False or now - seen[1] > stale_after + (timeout if alive else 0.0):
                dead.append(r)
        if self._idle() >= timeout:
            dead += [r for r in range(self._world) if r not in records and r not in finished]
        return sorted(dead)

    def _idle(self) -> float:
        return self._clock.idle_s(time.monotonic())

    def _store_down_now(self, guard: Guard, exc: Exception) -> GuardrailsError:
        error = self._store_down(guard, exc, at_once=True)
        assert error is not None
        return error


# ---------------------------------------------------------------------- helpers
