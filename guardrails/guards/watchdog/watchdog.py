"""Watchdog: a hang, a dead rank or a rank out of data becomes an error naming the rank,
instead of NCCL's 10-minute or gloo's 30-minute timeout with no rank, op or line.

One daemon thread per rank. Every ``heartbeat_every_s`` (1 s) it samples, without
touching the main thread, what the main thread advertises on the guard (``step``,
``phase``, ``collective`` set by the auditor, ``paused``, batches fetched, loader
exhausted) and publishes it as this rank's heartbeat in the side store
(``guard.side_store("watchdog")``, see ``_store.py``). The training loop pays nothing
per step: no hook, no store call, no lock; the thread reads plain attributes.

A rank that has not advanced (step, batch, collective, phase) for half the timeout (at
most 30 s) is *suspect*: its thread captures the main thread's Python stack
(``sys._current_frames``) and publishes it, and starts reading every rank's heartbeat.
Reading all heartbeats only while suspect keeps the store traffic at one write and two
small reads (the end counter, the verdict key) per rank per second in a healthy run;
every rank reading every rank would be N² calls a second, a million at 1,000 ranks. At
the full timeout it diagnoses from all ranks' records:

* a rank whose process is gone (same machine: its pid no longer exists, seen at once;
  elsewhere: no new heartbeat for 3 periods and half the timeout) or that ended with an
  exception -> ``RankFailedError``;
* a rank whose loader ran out (the guard's iterator hit ``StopIteration``) while others
  have fetched more batches -> ``UnevenDataError`` (e.g. 201 data shards on one node, 4 on another);
* otherwise -> ``HangError``: the ranks not inside a collective (or, without that
  information, the least advanced ones) are stuck; the others wait for them.

The first rank to conclude claims the verdict in the store (``add`` returns 1 to exactly
one caller) and every other rank adopts it on its next tick, so all ranks report the same
diagnosis, each with its own rank in the message. Then ``guard.fail_from_thread``: the
main thread raises the error at its next step boundary if it gets there within
``abort_after_s``; if not (stuck in a collective or a C call that Python cannot
interrupt) the process reports and exits (``_exit.die``), so the launcher tears the job
down. Death of a peer and the end of a peer's loop are announced at once (a counter in
the store every thread polls), so an exception on one rank ends the others in about a
second, not after the timeout.

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
import socket
import sys
import sysconfig
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from guardrails import _dist
from guardrails._checks import positive
from guardrails._component import Component
from guardrails._config import configure
from guardrails._errors import GuardrailsError, HangError, RankFailedError, UnevenDataError
from guardrails._store import claim_verdict, read_verdict

if TYPE_CHECKING:
    from guardrails._guard import Guard

log = logging.getLogger("guardrails.watchdog")

# Automatic timeout (hang_timeout_s=None): AUTO_FACTOR times the longest gap between two
# optimizer steps seen after the first, kept within [AUTO_FLOOR_S, AUTO_CAP_S].
# - The gap, not the mean step: periodic slow steps (unmarked logging, a dataloader
#   re-spawning its workers at an epoch boundary) are what a timeout must survive.
# - x5: a step 5 times slower than the slowest seen so far is not jitter.
# - Floor 60 s: below that, one-off host stalls a run has not shown yet (an epoch's
#   first batch from cold storage, a slow filesystem on a save someone did not mark)
#   would become false alarms; a minute is still 10x faster than NCCL's default.
# - Cap 300 s: half of NCCL's default collective timeout (10 min), so the report with
#   the rank and the stacks arrives before NCCL's watchdog kills the process anyway.
AUTO_FACTOR = 5.0
AUTO_FLOOR_S = 60.0
AUTO_CAP_S = 300.0
# Until this rank completes its first optimizer step: compile / autotune / lazy NCCL
# init. 600 s is NCCL's default collective timeout, so no slower than torch alone.
FIRST_STEP_TIMEOUT_S = 600.0
# Heartbeats missed before a rank on another machine counts as gone: a thread that
# wakes every period misses 3 only when the process is dead or frozen holding the GIL.
STALE_PERIODS = 3
# Stacks in a HangError: stuck ranks' first, then waiting ones, 8 in all (at 1,000
# ranks all stacks would make a ~3 MB verdict, copied into every rank's error file).
STACKS_SHOWN = 8
# Idle this long (or half the timeout, if shorter), a rank publishes its stack and reads
# every heartbeat (dead peers, pauses): 30 s bounds how late a SIGKILLed peer is seen
# during the 600 s first step, and keeps the all-heartbeat reads to stalls only.
SUSPECT_AFTER_S = 30.0
# A stack is capped (innermost frames kept): 30 frames cover a training step's depth
# with room for the framework around it, and keep one rank's record under ~6 KB.
STACK_FRAMES = 30

_PHASE_ORDER = {"setup": 0, "data": 1, "loop": 2, "forward": 3, "backward": 4, "optimizer": 5}
_TORCH_DIR = str(Path(__import__("torch").__file__).parent) + os.sep
_GUARDRAILS_DIR = str(Path(__file__).parent) + os.sep
_STDLIB_DIRS = tuple(
    {sysconfig.get_paths()["stdlib"] + os.sep, sysconfig.get_paths()["platstdlib"] + os.sep}
)


def auto_timeout_s(longest_gap_s: float | None) -> float:
    """The automatic hang timeout for a run whose slowest step gap so far (excluding the
    first step) is ``longest_gap_s`` (``None``: not seen yet, the cap)."""
    if longest_gap_s is None:
        return AUTO_CAP_S
    return min(AUTO_CAP_S, max(AUTO_FLOOR_S, AUTO_FACTOR * longest_gap_s))


class Watchdog(Component):
    """Turns a hang, a dead rank or uneven data into ``HangError``, ``RankFailedError`` or
    ``UnevenDataError`` on every rank, within ``hang_timeout_s``. Distributed runs only;
    a real no-op in a single process. Knobs: :class:`Watchdog.Config`
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
                in ``_watchdog.py`` for why these numbers. Mark long legitimate pauses
                with ``g.pause_watchdog()``.
            first_step_timeout_s: the allowance for a rank inside its first optimizer
                step (compilation, autotuning, NCCL's lazy communicator setup); a rank
                still waiting for its first batch gets ``hang_timeout_s``. Default
                600 s (NCCL's own timeout), or ``hang_timeout_s`` if that is longer.
            heartbeat_every_s: how often the thread samples and publishes. Default 1 s,
                or a quarter of ``hang_timeout_s`` when that is under 4 s.
            abort_after_s: after a verdict, how long the main thread gets to raise it at
                a step boundary before the process reports and exits by itself. Default
                2 s: a rank idle for the whole timeout is not about to reach a boundary.
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
        store = guard.side_store("watchdog")
        if store is None:  # single process: nothing to watch, no thread
            return
        self._guard = guard
        self._store = store
        self._main_ident = threading.get_ident()
        self._rank, self._world = guard.rank, guard.world_size
        self._host = _host_id()
        self._seq = 0
        self._reset_clock(guard, time.monotonic())
        self._ends_seen = 0
        self._peer_seen: dict[int, tuple[int, float]] = {}  # rank -> (seq, first seen)
        self._store_down_since: float | None = None
        self._stop.clear()
        self._closed = threading.Event()
        self._publish(self._record(guard, time.monotonic()))  # visible before any read
        self._thread = threading.Thread(
            target=self._run, name=f"guardrails-watchdog-rank{self._rank}", daemon=True
        )
        self._thread.start()

    def on_end(self, guard: Guard, exc: BaseException | None) -> None:
        if self._guard is None:
            return
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10 * self.heartbeat_every_s + 5)
        self._thread = None
        try:
            self._finish(guard, exc)
        finally:
            self._closed.set()
            self._guard = None
            self._store = None

    def _finish(self, guard: Guard, exc: BaseException | None) -> None:
        """Announce how this rank's loop ended, and explain an error caused by a peer."""
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
                guard.event("uneven_data", level="error", message=uneven.message)
                if exc is not None:  # the StopIteration becomes what it means
                    guard.replace_error(uneven)
                    return
                raise uneven

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        every = self.heartbeat_every_s
        while not self._stop.wait(every):
            guard = self._guard
            if guard is None or self.error is not None:
                return
            try:
                verdict = self._tick(guard)
                self._store_down_since = None
            except Exception as exc:  # the store host (rank 0 / the agent) is gone?
                verdict = self._store_down(guard, exc)
            if verdict is not None and not self._stop.is_set():
                self._fail(guard, verdict)
                return

    def _tick(self, guard: Guard) -> GuardrailsError | None:
        now = time.monotonic()
        self._sample(guard, now)
        idle = now - self._last_progress
        timeout = self._timeout(guard)
        suspect = idle >= min(timeout / 2, SUSPECT_AFTER_S)
        if suspect:  # refreshed every tick: the report shows where it is now
            self._store.set(f"stack/{self._rank}", _stack(self._main_ident))
        self._publish(self._record(guard, now, idle=idle))

        adopted = self._adopt_verdict(guard)
        if adopted is not None:
            return adopted
        ends = self._store.add("ends", 0)
        finished: dict[int, dict[str, Any]] = {}
        if ends > self._ends_seen or suspect:
            finished = self._read("end", exclude_self=True)
            self._ends_seen = ends
            early = self._check_ended_peers(guard, finished, idle)
            if early is not None:
                return early
        if guard.exhausted_at is not None and self._world > 1:
            # This rank ran out of data but is still inside the guard (closing, or in
            # a collective after its loop): a peer already past this rank's last batch
            # will wait for it forever. Seen here within a heartbeat, not a timeout.
            ahead = self._peers_ahead(_here(guard))
            if ahead:
                mine = self._record(guard, now, idle=idle)
                return self._uneven(guard, {**ahead, self._rank: mine})
        if not suspect:
            return None
        records = self._read("hb", exclude_self=False)
        records.update(finished)
        dead = self._dead_peers(records, now, finished, timeout)
        if dead:
            return self._rank_failed(guard, records, dead[0], dead=True)
        if any(r.get("paused") for k, r in records.items() if k not in finished):
            self._last_progress = now  # a paused peer legitimately holds everyone
            return None
        if idle < timeout:
            self._stacks_awaited_since = None
            return None
        return self._diagnose(guard, records, timeout)

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

    def _reset_clock(self, guard: Guard, now: float) -> None:
        """The progress clock and step-gap statistics, as at the guard's start."""
        self._stacks_awaited_since: float | None = None
        self._last_key: tuple[Any, ...] | None = None
        self._last_progress = now
        self._last_step_at: float | None = None
        self._last_step = guard.step
        self._longest_gap: float | None = None
        self._gaps_count = False

    def _sample(self, guard: Guard, now: float) -> None:
        """Update this rank's progress clock from what the main thread advertises."""
        key = progress_key(guard)
        if key != self._last_key or guard.paused:
            self._last_key = key
            self._last_progress = now
        if guard.step != self._last_step:
            # step_time_s stays NaN until the first optimizer step since start (a
            # resume sets guard.step, not that): the first step (compilation) and a
            # resume's jump are not gaps.
            warm = not math.isnan(guard.step_time_s)
            if warm and self._gaps_count and self._last_step_at is not None:
                gap = (now - self._last_step_at) / max(1, guard.step - self._last_step)
                self._longest_gap = max(self._longest_gap or 0.0, gap)
            self._gaps_count = warm
            self._last_step, self._last_step_at = guard.step, now
        elif guard.paused and self._last_step_at is not None:
            self._last_step_at = now  # a marked pause is not a slow step

    def _timeout(self, guard: Guard) -> float:
        t = (
            self.hang_timeout_s
            if self.hang_timeout_s is not None
            else (auto_timeout_s(self._longest_gap))
        )
        # The first step's allowance (compilation, autotuning, communicator setup) is
        # for a rank inside its step; a rank that has not fetched its first batch is
        # waiting for its loader, which no compiler explains: the ranks that wait for it
        # in a collective should hear within the hang timeout, not in 10 minutes.
        if math.isnan(guard.step_time_s) and guard.phase != "data":
            return max(t, self.first_step_timeout_s)
        return t

    @property
    def timeout_s(self) -> float | None:
        """The hang timeout in force now (``None`` before the guard started)."""
        return None if self._guard is None else self._timeout(self._guard)

    # ------------------------------------------------------------------ records

    def _record(self, guard: Guard, now: float, *, idle: float = 0.0) -> dict[str, Any]:
        self._seq += 1
        coll = guard.shared.collective
        here = _here(guard)
        return {
            "rank": self._rank,
            "seq": self._seq,
            "time": time.time(),
            "step": guard.step,
            "phase": guard.phase,
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
            self._store.set(f"end/{self._rank}", json.dumps(record, default=str))
            self._store.add("ends", 1)
        except Exception as err:
            log.debug("guardrails: watchdog could not announce the end: %s", err)

    def _read(self, kind: str, *, exclude_self: bool) -> dict[int, dict[str, Any]]:
        ranks = [r for r in range(self._world) if not (exclude_self and r == self._rank)]
        keys = [f"{kind}/{r}" for r in ranks]
        present = [k for k in keys if self._store.check([k])]
        if not present:
            return {}
        raw = self._store.multi_get(present)
        out: dict[int, dict[str, Any]] = {}
        for key, value in zip(present, raw, strict=True):
            out[int(key.rsplit("/", 1)[1])] = json.loads(bytes(value).decode())
        return out

    def _read_stacks(self, ranks: list[int]) -> dict[int, str]:
        stacks: dict[int, str] = {}
        for r in ranks:
            key = f"stack/{r}"
            try:
                if self._store.check([key]):
                    stacks[r] = bytes(self._store.get(key)).decode()
            except Exception:
                pass
        return stacks

    # ------------------------------------------------------------------ verdicts

    def _adopt_verdict(self, guard: Guard) -> GuardrailsError | None:
        verdict = read_verdict(self._store)
        return None if verdict is None else _build(verdict, guard)

    def _claim(self, guard: Guard, spec: dict[str, Any]) -> GuardrailsError:
        """Publish ``spec`` as the job's verdict unless another rank did first; return
        the verdict in force, as this rank's error."""
        spec = {**spec, "by": self._rank}
        if claim_verdict(self._store, spec):
            return _build(spec, guard)
        # Lost: the winner sets its verdict right after its claim.
        won = read_verdict(self._store, wait_s=2.0)
        return _build(spec if won is None else won, guard)

    def _fail(self, guard: Guard, error: GuardrailsError) -> None:
        self.error = error
        try:
            kind = {HangError: "hang", RankFailedError: "rank_failed"}.get(
                type(error), "uneven_data"
            )
            # The head line only: the summary on stderr carries the whole message, and
            # the event is mirrored to the logger (no duplicate stacks in the log).
            guard.event(kind, level="error", message=error.message.splitlines()[0])
        except Exception:
            pass
        taken = guard.fail_from_thread(error, abort_after_s=self.abort_after_s)
        if not taken and guard.running:
            # Another component's error is already on its way (the auditor's
            # mismatch): that one is the diagnosis, this watchdog stands aside.
            self.error = None
            return
        if not guard.running:
            # The main thread is inside close() (fail_from_thread's last resort only
            # covers a running loop): maybe blocked in another component's closing
            # collective. End the process ourselves unless close() finishes first.
            def last_resort() -> None:
                if not self._closed.is_set():
                    guard.die(error)

            timer = threading.Timer(self.abort_after_s, last_resort)
            timer.daemon = True
            timer.start()

    def _store_down(self, guard: Guard, exc: Exception) -> GuardrailsError | None:
        now = time.monotonic()
        if self._store_down_since is None:
            self._store_down_since = now
            log.debug("guardrails: watchdog store call failed: %s", exc)
        # Unreachable for as long as a hang would take: its host is gone. With torchrun
        # the store lives in the agent (TORCHELASTIC_USE_AGENT_STORE), else on rank 0.
        if now - self._store_down_since < min(self._timeout(guard), 30.0):
            return None
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        host = "the torchrun agent" if agent else "rank 0 (it hosts the TCPStore)"
        failed = None if agent else 0
        error = RankFailedError(
            f"the job's key-value store stopped answering ({type(exc).__name__}: "
            f"{_first_line(exc)}) for {now - self._store_down_since:.0f} s: {host} has "
            "died or lost the network. This rank cannot reach the others any more.",
            rank=self._rank,
            step=guard.step,
            failed_rank=failed,
            hint="look at the log of "
            + ("the launcher" if agent else "rank 0")
            + " for why it ended (OOM killer, a crash, a node failure), and restart.",
        )
        return error

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
                    rec.get("error_class") in _RAISED_EVERYWHERE
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
            _past(_here(guard), _position(e)) for e in exhausted.values()
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
        stack = _stack(self._main_ident)
        return _in_collective({"collective": guard.shared.collective, "_stack": stack})

    def _dead_peers(
        self,
        records: dict[int, dict[str, Any]],
        now: float,
        finished: dict[int, dict[str, Any]],
        timeout: float,
    ) -> list[int]:
        """Ranks whose process is gone: same machine, its pid no longer exists (exact,
        at once); elsewhere, no new heartbeat for ``STALE_PERIODS`` periods and half the
        timeout (a main thread holding the GIL in a long C call starves its watchdog:
        only that long is it called dead). Plus ranks that never published during a
        whole timeout (they died before their guard started)."""
        dead = []
        stale_after = max(STALE_PERIODS * self.heartbeat_every_s + 0.5, timeout / 2)
        for r, rec in records.items():
            if r == self._rank or r in finished:
                continue
            seen = self._peer_seen.get(r)
            if seen is None or seen[0] != rec["seq"]:
                self._peer_seen[r] = seen = (rec["seq"], now)
            gone = rec.get("host") == self._host and not _dist.pid_alive(int(rec["pid"]))
            if gone or now - seen[1] > stale_after:
                dead.append(r)
        if self._idle() >= timeout:
            dead += [r for r in range(self._world) if r not in records and r not in finished]
        return sorted(dead)

    def _idle(self) -> float:
        return time.monotonic() - self._last_progress

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
                f"{STALE_PERIODS * self.heartbeat_every_s:.0f} s: the process or its "
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
        lines = [
            f"rank {r} is stuck at step {live[r]['step']}, {_where(live[r])}"
            + ("" if waiting[r] else ", outside any collective")
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
            stacks={r: records[r]["_stack"] for r in shown},
            timeout_s=timeout,
            hint=hint,
        )
        return self._claim(guard, spec)

    def _explain(self, guard: Guard, *, deadline_s: float) -> GuardrailsError | None:
        """For an exception from a collective: which peer ended (failed, was killed,
        ran out of data, left the loop), read within ``deadline_s``; ``None`` if none."""
        end = time.monotonic() + deadline_s
        while True:
            try:
                adopted = self._adopt_verdict(guard)
                if adopted is not None:
                    return adopted
                finished = self._read("end", exclude_self=True)
                for r, rec in sorted(finished.items()):
                    if rec.get("state") == "failed":
                        return self._rank_failed(guard, finished, r, dead=False)
                exhausted = {r: rec for r, rec in finished.items() if rec.get("exhausted")}
                if exhausted and guard.exhausted_at is None:
                    mine = self._record(guard, time.monotonic())
                    if any(_past(_here(guard), _position(e)) for e in exhausted.values()):
                        return self._uneven(guard, {**finished, self._rank: mine})
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

    def _store_down_now(self, guard: Guard, exc: Exception) -> GuardrailsError:
        self._store_down_since = time.monotonic() - 1e9
        error = self._store_down(guard, exc)
        assert error is not None
        return error

    def _peers_ahead(self, mine: tuple[int, int]) -> dict[int, dict[str, Any]]:
        """Peers (heartbeats and final records) that fetched past position ``mine``."""
        records = self._read("hb", exclude_self=True)
        records.update(self._read("end", exclude_self=True))
        if any(_past(_position(rec), mine) for rec in records.values()):
            return records
        return {}

    def _check_uneven_at_end(self, guard: Guard) -> GuardrailsError | None:
        """This rank's loop ended because its loader ran out: if a peer has already
        fetched more batches, the data is uneven and the peer is now waiting for this
        rank in a collective. Waits at most a few heartbeats, and only while some peer
        is still on the same batch without having run out itself."""
        deadline = time.monotonic() + 2 * self.heartbeat_every_s + 1
        mine = _here(guard)
        while True:
            try:
                finished = self._read("end", exclude_self=True)
                records = self._read("hb", exclude_self=True)
            except Exception:
                return None
            records.update(finished)
            ahead = [r for r, rec in records.items() if _past(_position(rec), mine)]
            if ahead:
                me = self._record(guard, time.monotonic())
                me["exhausted"] = True
                return self._uneven(guard, {**records, self._rank: me})
            pending = [
                r for r, rec in records.items() if not rec.get("exhausted") and r not in finished
            ]
            if not pending or time.monotonic() >= deadline:
                return None
            time.sleep(0.05)


# ---------------------------------------------------------------------- helpers

#: Errors a component raises on every rank at the same step (so a peer's is not news).
_RAISED_EVERYWHERE = {"NonFiniteError", "CollectiveMismatchError", "ConfigMismatchError"}

_CLASSES: dict[str, type[GuardrailsError]] = {
    "HangError": HangError,
    "RankFailedError": RankFailedError,
    "UnevenDataError": UnevenDataError,
}


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
    for name in ("lengths", "where", "stacks"):  # JSON made the rank keys strings
        if isinstance(fields.get(name), dict):
            fields[name] = {int(k): v for k, v in fields[name].items()}
    fields["verdict_by"] = spec.get("by")
    cls = _CLASSES.get(spec.get("cls", ""), HangError)
    return cls(spec["message"], rank=guard.rank, step=guard.step, hint=spec.get("hint"), **fields)


def _position(rec: dict[str, Any]) -> tuple[int, int]:
    """How far a rank got through its data: (pass over the loader, batches in it)."""
    return int(rec.get("epoch", 0)), int(rec.get("batches", 0))


def _past(a: tuple[int, int], b: tuple[int, int]) -> bool:
    """Whether position ``a`` is past ``b`` in the same pass over the data. A peer in a
    later pass also ran out of this one (it may just be quicker to start the next)."""
    return a[0] == b[0] and a[1] > b[1]


def progress_key(guard: Guard) -> tuple[Any, ...]:
    """What the main thread advertises, as one comparable value: it changes whenever the
    rank makes progress (a step, a batch, a phase, a collective)."""
    coll = guard.shared.collective
    return (
        guard.step,
        _here(guard),
        guard.phase,
        None if coll is None else (coll.get("seq"), coll.get("op")),
    )


def main_thread_site() -> str:
    """Where the main thread is, in the user's code: ``file:line (function)`` of its
    innermost frame outside torch, guardrails and the standard library."""
    frames = _frames(_stack(threading.main_thread().ident or 0))
    for path, line, func in reversed(frames):
        if _is_user(path):
            return f"{os.path.basename(path)}:{line} ({func})"
    if frames:
        path, line, func = frames[-1]
        return f"{os.path.basename(path)}:{line} ({func})"
    return "an unknown place"


def _here(guard: Guard) -> tuple[int, int]:
    """This rank's data position: where its loader ran out, else the current pass and
    batch. ``exhausted_at`` is read first: the engine sets it before it moves the epoch
    counters on, so a non-``None`` value is always consistent."""
    done = guard.exhausted_at
    return done if done is not None else (guard.epoch, guard.batch_in_epoch)


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else ""


def _from_peer(exc: BaseException) -> bool:
    """Whether ``exc`` looks like a collective that failed because of another rank
    (gloo: "Connection reset/closed by peer"; NCCL: a DistBackendError)."""
    import torch.distributed as dist

    text = str(exc).lower()
    if "address already in use" in text or "eaddrinuse" in text:
        return False  # this rank's own launch problem (the translator's LaunchError)
    if isinstance(exc, getattr(dist, "DistError", ())):  # DistBackendError, ... (torch 2.2+)
        return True
    return isinstance(exc, RuntimeError) and any(
        s in text for s in ("gloo", "nccl", "connection", "peer", "timed out", "broken pipe")
    )


def _host_id() -> str:
    """Hostname plus the PID namespace: two ranks may check each other's pids only when
    both match (containers on one host share a hostname but not pids)."""
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        ns = "?"
    return f"{socket.gethostname()}|{ns}"


def _stack(ident: int) -> str:
    """The Python stack of thread ``ident``, innermost frame last, capped."""
    frame = sys._current_frames().get(ident)
    if frame is None:
        return "  (the thread has ended)"
    frames = traceback.extract_stack(frame)[-STACK_FRAMES:]
    return "".join(traceback.format_list(frames)).rstrip()


def _frames(stack: str) -> list[tuple[str, str, str]]:
    """(file, line, function) of each ``File "...", line N, in f`` line of a stack."""
    out = []
    for line in stack.splitlines():
        line = line.strip()
        if line.startswith('File "'):
            try:
                path, rest = line[6:].split('", line ', 1)
                num, func = rest.split(", in ", 1)
                out.append((path, num, func))
            except ValueError:
                continue
    return out


def _is_user(path: str) -> bool:
    return not (
        path.startswith(_TORCH_DIR)
        or path.startswith(_GUARDRAILS_DIR)
        or path.startswith(_STDLIB_DIRS)
    )


def _in_collective(rec: dict[str, Any]) -> bool:
    """Whether the rank is waiting on other ranks: inside a collective the auditor saw,
    or its innermost Python frame is in torch.distributed / DDP, or in autograd's
    backward (where DDP waits for its gradient all-reduce)."""
    if rec.get("collective"):
        return True
    frames = _frames(rec.get("_stack", ""))
    if not frames:
        return False
    path = frames[-1][0]
    return path.startswith(_TORCH_DIR) and any(
        part in path for part in (f"distributed{os.sep}", f"autograd{os.sep}")
    )


def _progress_key(rec: dict[str, Any]) -> tuple[int, int, int]:
    coll = rec.get("collective") or {}
    seq = coll.get("seq") if isinstance(coll, dict) else None
    return (
        int(rec.get("step", 0)),
        _PHASE_ORDER.get(str(rec.get("phase")), 0),
        int(seq) if isinstance(seq, int) else -1,
    )


def _where(rec: dict[str, Any]) -> str:
    """Where a rank is, in words: the collective (op #seq at file:line), else the phase
    and the innermost frame of the user's code."""
    coll = rec.get("collective")
    if isinstance(coll, dict) and coll:
        # The auditor's entry (_audit.entry_dict): op, seq, group, shapes, dtype, site.
        op = coll.get("op", "a collective")
        seq = coll.get("seq")
        site = coll.get("site")
        what = [str(v) for v in (coll.get("shapes"), coll.get("dtype")) if v is not None]
        if coll.get("group") is not None:
            what.append(f"group {coll['group']}")
        text = f"in {op}" + (f" #{seq}" if seq is not None else "")
        if what:
            text += f" ({', '.join(what)})"
        return text + (f" at {site}" if site else "")
    phase = rec.get("phase")
    if rec.get("paused"):
        text = f"paused ({rec['paused']})"
    else:
        text = {
            "data": "in the loader's next()",
            "forward": "in the model's forward",
            "backward": "between forward and optimizer.step() (backward: DDP's gradient "
            "all-reduce)",
            "optimizer": "in optimizer.step()",
            "loop": "in the loop body",
            "setup": "before the first batch",
            "agree": "in the guard's stop/save agreement with the other ranks",
        }.get(str(phase), f"in phase {phase}")
    frames = _frames(rec.get("_stack", ""))
    if frames:
        inner = frames[-1]
        user = [f for f in frames if _is_user(f[0])]
        if inner[0].startswith(_TORCH_DIR) and "distributed" in inner[0]:
            text = f"in torch.distributed {inner[2]}()"
        if user:
            path, num, func = user[-1]
            text += f" at {Path(path).name}:{num} ({func})"
    return text
