"""The failure save: when a run ends on a failure that leaves the process alive, each rank
writes the newest *consistent* state it holds, and ``resume="auto"`` continues from it.

Without it every failure but a signal ended each rank with an error and saved nothing
(periodic checkpoints are off by default): a hang at hour 20 lost 20 hours.

* **Which failures**: an exception that ends the loop (a NaN streak without rewind, a
  desync, a bad batch, the loop's own error), raised in the main thread (``on_end``), and
  a verdict that ends the process from the watchdog's or auditor's thread while the main
  thread is stuck (a hang on the ranks that are not stuck, a peer's death seen by the
  survivors: ``on_abort``, the thread's last words). Not a signal's stop (it saves
  already; but torchrun's SIGTERM after a peer's death, which the survivors waiting for
  it in a collective never reach a boundary to stop at, is no stop), not
  ``KeyboardInterrupt`` (a Ctrl+C is a stop the user asked for), not a failure before
  the first step (nothing trained), not a step already saved.
* **Which state** (``savepoint.py``): the last finished step's, with the RNG streams and
  data position of its boundary (the failing step may have drawn from them and fetched
  its batch); once the failing step's update is over, the new step's; inside
  ``optimizer.step()`` nothing, said in the ``failure_saved`` event. On a GPU whose host
  ran a step ahead (the watchdog's thread saves while the main thread is stuck) the step
  the device holds, with what the host held before its last update. (The rewind guard's
  in-memory snapshot is not used: it holds no RNG streams nor the full data position,
  so a checkpoint of it would not resume bitwise.)
* **Never long, never a hang**: every rank's part is bounded by ``timeout_s`` (the whole
  save runs in a daemon thread joined with that limit; past it the write is cancelled
  within a piece). With several ranks the save is the usual multi-rank commit under keys
  of its own: each rank writes its files (RNG streams, data position) into the step's
  temp directory and publishes their records; rank 0, which holds the replicated model
  and optimizer, commits with the records it has by the limit (a dead rank, one not
  begun within 10 s, is not waited for). A rank whose files are missing (dead, stuck
  with no thread able to write, or past the step) makes the checkpoint **incomplete**:
  committed with ``failure.missing`` naming those ranks, and never resumed from
  (``manifest.incomplete``: ``resume="auto"`` skips it, saying why), unless the
  committer's host holds the rank's part as published at its last boundary (``peer.py``:
  under DDP, by a rank on that host or sent there from another node, ``partner.py``):
  then it writes it (``failure.from_peers``). If rank 0 is the dead one and the store
  outlives it (torchrun's agent holds it), rank 1 commits, with the replicated state
  from its own copy; when the store died with rank 0 (outside torchrun rank 0 hosts it),
  the ranks meet in files beside the checkpoint instead (``board.py``: under DDP).
* Under torchrun a worker's exit makes the agent SIGTERM the others and SIGKILL them
  30 s later; guardrails holds SIGTERM while a failing rank reports, so the ranks other
  than 0 wait for rank 0's commit (up to the limit) before they exit, and the default
  limit, 20 s, ends inside that window.

On CUDA a thread's save copies on a stream of its own, behind no stuck work (``SideStreams``).
A GPU whose host queued a step's kernels behind a collective that never ends takes no
more work from any thread (every push waits for room in its queues: 2x H200, NCCL, 0.835B
parameters): its committer stands down, and under DDP the lowest other live rank (the
stuck one, its GPU idle) commits, writing the wedged rank's part from its copy.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from guardrails.checkpoint import commit, stage
from guardrails.checkpoint.manifest import rerun_text
from guardrails.distributed.store import wait_keys
from guardrails.engine import model, where
from guardrails.guards.checkpointer import failure_policy, failure_text, from_peers, gather, peer
from guardrails.guards.checkpointer.board import FileBoard
from guardrails.guards.checkpointer.savepoint import SavePoint, choose
from guardrails.guards.checkpointer.signals import SignalCapture
from guardrails.guards.checkpointer.writer import CheckpointWriter
from guardrails.util import files as _perms

if TYPE_CHECKING:
    from guardrails.engine.guard import Guard

log = logging.getLogger("guardrails.checkpoint")


class FailureSave:
    """One guard's failure save (see the module docstring), built at its start.
    ``writer``: the checkpointer's (its directory, the run record); the ranks commit
    through the checkpoint's side store. ``capture``: its signals (a signal's stop is
    not a failure). ``timeout_s``: the most one rank spends on it."""

    def __init__(
        self, guard: Guard, writer: CheckpointWriter, capture: SignalCapture, *, timeout_s: float
    ) -> None:
        self._writer = writer
        self._capture = capture
        self._store = guard.side_store("checkpoint")  # None in a single process
        self._rank, self._world = guard.rank, guard.world_size
        self.timeout_s = timeout_s
        #: This rank's part published at every boundary for a live peer's use (``peer.py``):
        #: under DDP, on a host with ``/dev/shm`` or the node-local tier.
        self.slot: peer.PeerSlot | None = None
        local = writer.tier.local if writer.tier is not None else None
        self._slots = peer.slot_directory(local)
        # CUDA: a thread's save copies on a stream of its own whose queue moves.
        cuda = guard.device is not None and guard.device.type == "cuda"
        self._side = stage.SideStreams(guard.device) if cuda else None
        self._training = None if self._side is None else self._side.training
        if self._side is not None and len(guard.optimizers) == 1 and self._world > 1:
            # Which step's weights the GPU holds, for a save from the watchdog's thread
            # (verdicts across ranks only) while its host is ahead.
            guard.boundary_capture.follow_device()
        if self._store is not None and self._slots is not None and peer.publishable(guard):
            self.slot = peer.PeerSlot(self._slots, writer.token, self._rank)
        #: What the save did: ``None`` until it ran, then the ``failure_saved`` event's fields.
        self.outcome: dict[str, Any] | None = None
        #: This rank (not 0) wrote its part and left before rank 0 began to commit.
        self.part_only = False
        #: :meth:`run` was called (it may be running now).
        self.began = False
        #: The rank that commits: 0, or the lowest live one when rank 0 is the dead one
        #: and the store outlives it (:func:`_committer`). Set when the save runs.
        self._committer = 0
        #: The state the save writes (``savepoint.py``), its step, and whether it is
        #: the one after the failing step's update: set when the save runs.
        self._point: SavePoint | None = None
        self._step = 0
        self._staged_s: float | None = None  # when this rank's part was in host memory
        self._weights = False  # this save's part holds device state
        self._after_update = False
        #: The job's store went with its host (rank 0 outside torchrun): the save meets
        #: in files (``board.py``). Set when the save runs.
        self.store_lost = False
        self._one_at_a_time = threading.Lock()
        self._news: int | None = None  # the dead rank any caller named
        self._dead: int | None = None  # the dead rank the last save knew of
        #: The live ranks whose GPU takes no more work (said by each: :meth:`_stand_down`),
        #: and those the last save knew of: none of them commits.
        self._wedged: set[int] = set()
        self._wedged_run: frozenset[int] = frozenset()
        self._key: str | None = None  # the store's keys of the save running
        self._t0 = 0.0
        #: When each part of the save ended, in seconds from its first try (the event's
        #: ``phases``: where a slow save's time went).
        self._phases: dict[str, float] = {}
        #: The missing ranks whose part the committer could not write from their
        #: published copy, and why (said in the event); the dead ranks whose part their
        #: partner wrote; the rank whose copy this one keeps (``partner.py``: set by the
        #: checkpointer when the job spans nodes).
        self.peer_notes: dict[int, str] = {}
        self.by_partner: list[int] = []
        self.keeps: int | None = None

    def wanted(
        self,
        guard: Guard,
        error: BaseException | None,
        *,
        stop: int | None,
        from_thread: bool = False,
        despite_signal: bool = False,
    ) -> bool:
        """Whether ``error`` ending the run calls for a failure save
        (:func:`failure_policy.wanted`); not when this guard's save ran already."""
        return self.outcome is None and failure_policy.wanted(
            guard,
            error,
            stop=stop,
            from_thread=from_thread,
            despite_signal=despite_signal,
            capture=self._capture,
            committed_step=self._writer.committed_step,
        )

    def run(self, guard: Guard, error: BaseException, *, from_thread: bool) -> None:
        """Save, bounded by ``timeout_s``, then the ``failure_saved`` event. Never raises:
        the run's own error is what the process reports.

        One save at a time in a process, with what any caller knows of the dead rank:
        the loop's own error (gloo's, when a peer died) and the watchdog's verdict on that
        death both come, and two saves at once wrote the same files (the record of one,
        the bytes of the other: the commit refused the step). A caller that names a dead
        rank the running save does not know tells it (and, when that rank was to commit,
        ends its wait for the commit: :meth:`_wake`), and the save runs again with it
        unless it saved the step whole or without that rank (gloo's error, then the
        verdict on the same death: the same step twice): under torchrun with rank 0 dead,
        the loop's error waits for rank 0's commit; the verdict names rank 0, and rank 1
        commits. The thread that holds the save holds the process until it is done."""
        self.take_news(error)
        with self._one_at_a_time:
            self.began = True
            self._t0 = time.perf_counter()  # the event's seconds: from the first try
            self._phases = {}
            while True:
                done, news = self.outcome, self._news
                over = done is not None and (done["complete"] or news in done["missing"])
                if over or (done is not None and not self._news_since_run()):
                    return
                self._dead, self._wedged_run, self.outcome = news, frozenset(self._wedged), None
                self._run(guard, error, dead=news, from_thread=from_thread)

    def take_news(self, error: BaseException) -> None:
        """``error`` names a dead rank (``RankFailedError``): a running save that did not
        know it runs again without it; one waiting for its commit stops waiting."""
        dead = getattr(error, "failed_rank", None)
        if dead is not None:
            self._news = dead
            self._wake(dead)

    def _news_since_run(self) -> bool:
        """Whether a dead rank or a wedged committer was named since the last save
        began: it runs again with another committer."""
        return self._news != self._dead or self._wedged != self._wedged_run

    def _wake(self, dead: int) -> None:
        """A save waiting for the commit of rank ``dead``, which is dead, stops waiting:
        its commit key says so (every rank waiting on it wakes; nobody else writes it)."""
        key = self._key
        if key is None or dead != self._committer or self.store_lost:
            return
        with contextlib.suppress(Exception):  # the store gone too: the wait ends by itself
            said = json.dumps({"error": f"rank {dead}, which was to commit, died", "dead": dead})
            self._store.compare_set(f"{key}/commit", "", said)

    def _run(
        self, guard: Guard, error: BaseException, *, dead: int | None, from_thread: bool
    ) -> None:
        t0 = time.perf_counter()
        cause = failure_text.cause(error)
        # A dead rank (the error's, or a verdict's: RankFailedError) is not waited for.
        self._committer = failure_policy.committer(dead, self._world, self._wedged_run)
        self._weights = self._writer.stages_weights or self._rank == self._committer
        if self._rank in self._wedged_run:  # its copies would wait for good: nothing
            state, why = None, "its GPU takes no more work"
        else:
            state, why = choose(
                guard, from_thread=from_thread, weights=self._weights, training=self._training
            )
        # The step saved: the host's, or the one before when its GPU is a step behind
        # (a wedged rank's: the one it stood down at, which the others save).
        if self._rank not in self._wedged_run:
            self._step = guard.step if state is None else state.step
        if state is not None and self._step == self._writer.committed_step:  # GPU behind
            state, why = None, f"step {self._step}, the step its GPU holds, is saved already"
        self._point, self._staged_s, self.by_partner = state, None, []
        self._after_update = state is not None and state.after_update
        # The store's keys of this save, by its committer: a save run again with another
        # committer never reads the first one's records.
        self._key = f"{self._writer.token}/failure/{self._step}/c{self._committer}"
        # Rank 0 hosted the store (no torchrun agent) and is the dead one: the store is
        # gone too (a call would fail, or wait out its timeout on a lost host).
        self.store_lost = self._store is not None and dead == 0 and self._committer == 0
        path: Path | None = None
        missing: list[int] = []
        # A rank with nothing to save still says so, or rank 0 would wait out the limit.
        if state is not None or self._store is not None:
            result: dict[str, Any] = {"why": why}
            cancel = threading.Event()
            worker = threading.Thread(
                target=self._save_safely,
                args=(guard, state, cause, cancel, result, dead, from_thread),
                name="guardrails-failure-save",
                daemon=True,
            )
            worker.start()
            worker.join(self.timeout_s + 1.0)  # its waits end by the limit; +1 s to commit
            if worker.is_alive():
                cancel.set()
                doing = "writing" if self._staged_s is not None else "copying its state"
                why = (
                    f"the save did not finish within failure_save_timeout_s={self.timeout_s:g}"
                    f" s (it was still {doing}, at {where.thread_site(worker.ident or 0)})"
                )
            else:
                path, missing, why = result.get("path"), result.get("missing", []), result["why"]
                if not why and path is None and not self.part_only:
                    why = f"rank {self._committer} did not commit it"
        if path is not None:  # committed in the local tier (local_directory): copied now
            left = self.timeout_s - (time.perf_counter() - t0)
            self._writer.drain(guard, self._step, path, within_s=left)
            self._mark("drained")
        self._said(guard, cause, path, missing, why, time.perf_counter() - self._t0)
        if self.slot is not None and path is not None:
            self.slot.close()  # this rank's part is in: not needed
        if dead is not None and self._slots is not None and path is not None:
            # The dead rank's copy, used or not (one step old: it died after its step's
            # last collective, before its boundary), once the save is committed.
            with contextlib.suppress(OSError):
                os.unlink(peer.slot_path(self._slots, self._writer.token, dead))

    def _save_safely(
        self,
        guard: Guard,
        state: Any,
        cause: str,
        cancel: threading.Event,
        result: dict,
        dead: int | None,
        from_thread: bool,
    ) -> None:
        try:
            stream = None
            if from_thread and state is not None and self._side is not None and self._weights:
                stream = self._side.pick()
                if stream is None:
                    n = self._side.count
                    result["why"] = (
                        f"its GPU takes no more work (none of its {n} copy streams ran within"
                        " 1 s: its host queued more behind the stuck collective than the"
                        " GPU's queues hold)"
                    )
                    if self._stand_down():
                        return  # run again: another rank commits
                    state = None
            if state is None:  # said where the others wait: nothing comes from this rank
                self._say_none(self._step, result["why"])
                if self._rank in self._wedged_run and self._key is not None:
                    deadline = time.monotonic() + self.timeout_s
                    result["path"], result["missing"] = self._await_commit(
                        self._key, deadline, dead
                    )
                return
            with stage.own_stream(stream):
                result["path"], result["missing"] = self._save(guard, state, cause, cancel, dead)
        except Exception as e:  # said in the event; the run's own error goes on
            log.debug("guardrails: the failure save failed", exc_info=True)
            result["why"] = f"the save failed: {type(e).__name__}: {e}"

    def _stand_down(self) -> bool:
        """The committer, its GPU wedged (every push onto it blocks: its host queued a
        step's kernels behind a collective that never ends, and the driver waits for
        room in their queue): under DDP another live rank holds the same replicated
        state, and its GPU may be idle (the stuck rank's, in its loader or a sleep). The
        ranks waiting for this commit hear so and save again with the lowest rank not
        wedged as committer, which writes this rank's part from its published copy.
        Whether it stood down (not without DDP's replicated state or the store)."""
        if self.slot is None or self._store is None or self.store_lost or self._key is None:
            return False
        if self._rank != self._committer:
            return False
        wedged = sorted(self._wedged_run | {self._rank})
        if all(r == self._dead or r in wedged for r in range(self._world)):
            return False  # no live rank left to take over (a dead peer, the rest wedged)
        said = {"error": f"rank {self._rank}'s GPU takes no more work", "wedged": wedged}
        self._store.compare_set(f"{self._key}/commit", "", json.dumps(said))
        self._wedged.add(self._rank)
        self._mark("stood_down")
        return True

    def _mark(self, phase: str) -> float:
        """``phase`` ended now: its time from the save's first try, kept for the event."""
        self._phases[phase] = at = round(time.perf_counter() - self._t0, 3)
        return at

    def _say_none(self, step: int, why: str) -> None:
        """This rank has no consistent state to save: its record says so (rank 0's
        commit too: nothing is committed without the replicated state)."""
        said = json.dumps({"none": why})
        if self.store_lost:  # the committer counts it and need not wait for it
            board = FileBoard(self._writer.root, self._writer.token, step, self._world)
            board.file(self._rank, {"none": why})
            return
        key = self._key
        self._store.set(f"{key}/files/{self._rank}", said)
        if self._rank == self._committer:
            self._store.set(f"{key}/commit", said)
        else:
            self._store.add(f"{key}/filed", 1)

    def _save(
        self, guard: Guard, state: Any, cause: str, cancel: threading.Event, dead: int | None
    ) -> tuple[Path | None, list[int]]:
        """This rank's files, then (rank 0) the commit with every record in by the
        limit: ``(path or None, the ranks missing)``."""
        deadline = time.monotonic() + self.timeout_s
        writer, step, committer = self._writer, self._step, self._committer
        key = self._key
        if self._store is not None and not self.store_lost:
            # The committer waits for this rank's part from now on. An add, not a set: a
            # set to a dead host is not answered, and succeeded once on its socket.
            try:
                self._store.add(f"{key}/begun/{self._rank}", 1)
            except RuntimeError as e:  # DistNetworkError: its host is gone
                log.debug("guardrails: the store is gone, the failure save meets in files: %s", e)
                self.store_lost = True
        if self.store_lost:
            return self._save_on_board(guard, state, cause, cancel, dead, deadline)
        if self._store is not None:
            if self._rank != committer:
                self._store.add(f"{key}/begun", 1)
            # Late: the committer wrote this rank's part from its published copy already.
            if self.slot is not None and self._rank != committer and not self._claim(key, "self"):
                return self._await_commit(key, deadline, dead)
        part = self._stage_point(guard, state)
        part.cancel = cancel
        if self._rank == committer:
            _perms.make_dirs(writer.root)
        tmp = commit.begin(writer.root, step, f"{writer.token}-failure")
        files: dict[str, Any] = {}
        try:
            part.write(tmp, files)
            if self._rank == committer != 0:  # rank 0 is dead: its replicated state, ours
                self._stage_replicated(guard, state, cancel).write(tmp, files)
            self._mark("written")
            if self._store is None:
                return self._commit(step, tmp, files, cause, missing=[]), []
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # nothing was committed: no trace left
            raise
        said = {**files, _AFTER_UPDATE: True} if self._after_update else files
        self._store.set(f"{key}/files/{self._rank}", json.dumps(said))
        if self._rank != committer:
            self._file_kept(guard, key, tmp, cancel)
            self._store.add(f"{key}/filed", 1)
            return self._await_commit(key, deadline, dead)
        merged, missing, after = self._gather(guard, key, deadline, dead)
        self._mark("gathered")
        merged.update(files)  # the committer's own
        claim = lambda r: self._claim(key, "peer", r)  # noqa: E731
        fetch_late = lambda ranks: gather.late(self._store, key, ranks, deadline, world=self._world)  # noqa: E731
        try:
            final, missing = self._complete(
                guard,
                claim,
                tmp,
                merged,
                cause,
                cancel,
                missing,
                after,
                committer,
                fetch_late=fetch_late,
            )
        except BaseException as e:
            self._store.set(f"{key}/commit", json.dumps({"error": repr(e)}))
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._store.set(f"{key}/commit", json.dumps({"path": str(final), "missing": missing}))
        self._mark("committed")
        return final, missing

    def _save_on_board(
        self,
        guard: Guard,
        state: Any,
        cause: str,
        cancel: threading.Event,
        dead: int | None,
        deadline: float,
    ) -> tuple[Path | None, list[int]]:
        """:meth:`_save` when the job's store went with its host: the ranks meet in files
        (``board.py``); under DDP only (the committer holds the replicated state, the dead
        ranks' parts come from their copies); a step rank 0 committed whole is that save."""
        if self.slot is None:
            raise RuntimeError(
                "the job's store is gone with rank 0; without DDP's replicated state on "
                "every rank no other rank can commit"
            )
        writer, step = self._writer, self._step
        board = FileBoard(writer.root, writer.token, step, self._world)
        if (whole := board.committed_whole()) is not None:
            return whole, []
        if not board.claim(f"writer{self._rank}", "self"):  # written from its copy already
            return board.await_commit(deadline=deadline)
        part = self._stage_point(guard, state)
        part.cancel = cancel
        tmp = commit.begin(writer.root, step, f"{writer.token}-failure")
        files: dict[str, Any] = {}
        part.write(tmp, files)
        if not board.claim("committer", str(self._rank)):
            board.file(self._rank, {**files, _AFTER_UPDATE: True} if self._after_update else files)
            self._committer = board.committer()
            return board.await_commit(deadline=deadline)
        self._committer = self._rank
        if self._rank != 0:  # rank 0's part holds the replicated state; ours, here
            self._stage_replicated(guard, state, cancel).write(tmp, files)
        # The others file within a few seconds (gather.BEGUN_WAIT_S), the dead and the gone
        # (partner.py) aside; 2 s of the limit are left to write their parts and commit.
        gone = peer.gone_ranks(self.slot.path.parent, writer.token) | {dead, self._rank}
        wait_s = max(0.0, min(gather.BEGUN_WAIT_S, deadline - time.monotonic() - 2.0))
        records = board.gather(wait_s=wait_s, ranks=set(range(self._world)) - gone)
        others = [r for r in range(self._world) if r != self._rank]
        merged, missing, after = self._merge(records, others, [])
        merged.update(files)
        claim = lambda r: board.claim(f"writer{r}", "peer")  # noqa: E731
        try:
            return self._complete(
                guard, claim, tmp, merged, cause, cancel, missing, after, self._rank, lost=True
            )
        finally:
            board.remove()  # a rank later than this finds no board: it waits for the commit

    def _complete(
        self,
        guard: Guard,
        claim: Callable[[int], bool],
        tmp: Path,
        files: dict[str, Any],
        cause: str,
        cancel: threading.Event,
        missing: list[int],
        after: list[int],
        committer: int,
        *,
        lost: bool = False,
        fetch_late: Callable[[list[int]], dict[int, dict[str, Any]]] | None = None,
    ) -> tuple[Path, list[int]]:
        """The committer, once the others' records are in: the missing ranks' parts it
        holds copies of (:meth:`_write_peers`), then the commit; the checkpoint and the
        ranks still missing. The committer and the lost store are passed, not read back:
        the main thread's failure and the watchdog's verdict can each run a save here."""
        peers = dict.fromkeys(self.by_partner, "its partner's copy")
        peers.update(self._write_peers(guard, claim, tmp, files, missing, cancel))
        missing = [r for r in missing if r not in peers]
        late = [r for r in missing if self.peer_notes.get(r) == from_peers.LATE]
        if late and fetch_late is not None:  # their records are on their way: taken
            got, still, late_after = self._merge(fetch_late(late), late, [])
            files.update(got)
            missing = [r for r in missing if r not in late or r in still]
            after = sorted(set(after) | set(late_after))
        final = self._commit(
            self._step,
            tmp,
            files,
            cause,
            missing=missing,
            peers=peers,
            after=after,
            committer=committer,
            store_lost=lost,
        )
        return final, missing

    def _claim(self, key: str, by: str, rank: int | None = None) -> bool:
        """Whether ``by`` (``"self"``: the rank itself; ``"peer"``: the committer, from
        its published copy) writes ``rank``'s part: the first to ask, one
        ``compare_set``. A rank that is late (its watchdog's verdict came after the
        committer stopped waiting) and the committer never write the same files."""
        rank = self._rank if rank is None else rank
        won = self._store.compare_set(f"{key}/writer/{rank}", "", by)
        return bytes(won).decode() == by

    def _stage_point(self, guard: Guard, point: SavePoint) -> stage.Part:
        """This rank's part of ``point``, staged and copied (the event's ``staged_s``:
        from the save's start); refused when the GPU moved past the point's step during
        the copy (the copy may mix two steps)."""
        part = self._writer.stage_boundary(guard, point)
        self._staged_s = self._mark("staged")
        if not point.still_held():
            raise RuntimeError(f"the GPU moved past step {point.step} while it was copied")
        return part

    def _stage_replicated(
        self, guard: Guard, point: SavePoint, cancel: threading.Event
    ) -> stage.Part:
        """The committer other than rank 0 (dead): the state every rank holds the same
        copy of under DDP, staged from this rank's, as rank 0 would have."""
        part = stage.stage_replicated(
            model=model.unwrap(guard.model),
            optimizers=guard.optimizers,
            schedulers=guard.schedulers,
            scaler=guard.scaler,
            extras=guard.state,
            extras_name="g.state",
            part=stage.Part(plain=True),  # not pinned: see Part's plain
            optimizer_state=point.optimizer_state,
            scheduler_states=point.scheduler_states,
        )
        part.ready()
        self._mark("staged_replicated")
        if not point.still_held():
            raise RuntimeError(f"the GPU moved past step {point.step} while it was copied")
        part.cancel = cancel
        return part

    def _write_peers(
        self,
        guard: Guard,
        claim: Callable[[int], bool],
        tmp: Path,
        files: dict[str, Any],
        missing: list[int],
        cancel: threading.Event,
    ) -> dict[int, str]:
        """The committer: the ``missing`` ranks' parts whose copies this host holds
        (``from_peers.write_missing``); why each other one was not: ``self.peer_notes``."""
        self.peer_notes = {}
        if self._slots is None or self.slot is None:
            return {}
        assert self._point is not None  # a committer writing peers saved a point of its own
        written, self.peer_notes = from_peers.write_missing(
            guard, self._slots, self._writer.token, self._point, missing, claim, tmp, files, cancel
        )
        return written

    def _file_kept(self, guard: Guard, key: str, tmp: Path, cancel: threading.Event) -> None:
        """A partner whose kept rank is gone files that rank's part (``from_peers.py``),
        before its own is counted: the committer, waiting on the count, waits for it."""
        r, point = self.keeps, self._point
        if r is None or point is None or self._slots is None:
            return
        if not from_peers.kept_gone(self._slots, self._writer.token, r):
            return
        got, _ = from_peers.usable(guard, self._slots, self._writer.token, r, point)
        if (
            got is None
            or self._store.check([f"{key}/files/{r}"])
            or not self._claim(key, "peer", r)
        ):
            return
        self._store.add(f"{key}/begun", 1)  # a record like any rank's: begun, then filed
        files = from_peers.write(guard, got, point, tmp, cancel)
        self._store.set(f"{key}/files/{r}", json.dumps({**files, _BY_PARTNER: self._rank}))
        self._store.add(f"{key}/filed", 1)

    def _gather(
        self, guard: Guard, key: str, deadline: float, dead: int | None
    ) -> tuple[dict[str, Any], list[int], list[int]]:
        """The committer: the other ranks' records (``gather.records``; ``dead`` is not
        waited for), merged, the ranks without one (or with nothing to save), and those
        that saved the state after the update."""
        others = [r for r in range(self._world) if r != self._committer]  # the dead: its partner's

        def held() -> set[int]:
            if self._slots is None or self._point is None:
                return set()
            return from_peers.held(guard, self._slots, self._writer.token, self._point, others)

        gone = lambda: self._gone_unfiled(key, others, dead)  # noqa: E731
        records = gather.records(self._store, key, others, deadline, gone=gone, held=held)
        return self._merge(records, others, [])

    def _gone_unfiled(self, key: str, others: list[int], dead: int | None) -> list[int]:
        """The ``dead`` rank and those whose process ended (this host's, and the ranks
        whose partner's link saw them go) without a part filed (by a partner): not waited
        for (the watchdog that names a dead rank is paused while this save runs, and a
        SIGKILLed peer cost the whole wait for beginners: 10 s of a 22 s recovery)."""
        gone = {dead} & set(others)
        if self._slots is not None and self.slot is not None:
            gone |= peer.gone_ranks(self._slots, self._writer.token) & set(others)
        return [r for r in sorted(gone) if not self._store.check([f"{key}/files/{r}"])]

    def _merge(
        self, records: dict[int, dict[str, Any]], others: list[int], missing: list[int]
    ) -> tuple[dict[str, Any], list[int], list[int]]:
        """The committer: the ``others``' records (each rank's files) merged, the ranks
        without one or with nothing to save added to ``missing``, and the ranks whose
        part is the state after the failing step's update (this rank too, if so)."""
        merged: dict[str, Any] = {}
        after = [self._rank] if self._after_update else []
        for r in others:
            got = records.get(r)
            if got is None or "none" in got:
                missing.append(r)
                continue
            if got.pop(_AFTER_UPDATE, False):
                after.append(r)
            if got.pop(_BY_PARTNER, None) is not None:
                self.by_partner.append(r)
            merged.update(got)
        return merged, sorted(missing), sorted(after)

    def _await_commit(
        self, key: str, deadline: float, dead: int | None
    ) -> tuple[Path | None, list[int]]:
        """A rank other than 0: rank 0's commit, waited for until ``deadline`` once rank
        0 has begun its failure save (this rank's exit would get it SIGTERMed by torchrun
        mid-commit); not when rank 0 is the ``dead`` one, nor when it has not begun
        within :data:`gather.BEGUN_WAIT_S` (it may be waiting in a collective for this rank,
        and will commit this rank's part when this rank's exit fails it). Blocking waits
        on a store client of their own (``wait_keys``): no poll, whatever N."""
        if dead == self._committer:
            return None, []
        store, commit_key = self._store, f"{key}/commit"
        first_s = max(0.0, min(gather.BEGUN_WAIT_S, deadline - time.monotonic()))
        try:
            wait_keys(store, [commit_key], timedelta(seconds=first_s), world=self._world)
        except TimeoutError:
            if not store.check([f"{key}/begun/{self._committer}"]):
                self.part_only = True
                return None, []
            left_s = max(0.0, deadline - time.monotonic())
            try:
                wait_keys(store, [commit_key], timedelta(seconds=left_s), world=self._world)
            except TimeoutError:
                return None, []
        said = json.loads(store.get(commit_key))
        if "dead" in said:  # another rank's verdict: the committer is dead (:meth:`_wake`)
            self._news = said["dead"]
        self._wedged.update(said.get("wedged", ()))  # its GPU is wedged (:meth:`_stand_down`)
        return (Path(said["path"]), said["missing"]) if "path" in said else (None, [])

    def _commit(
        self,
        step: int,
        tmp: Path,
        files: dict[str, Any],
        cause: str,
        *,
        missing: list[int],
        peers: dict[int, str] | None = None,
        after: list[int] | None = None,
        committer: int = 0,
        store_lost: bool = False,
    ) -> Path:
        """The committer's commit of the failure save: never counted by retention (an
        incomplete one must not retire a complete checkpoint), its manifest's ``failure``
        record from :func:`failure_text.record`. The copies written from are removed."""
        ranks = [r for r in range(self._world) if r not in missing]
        failure = failure_text.record(
            cause,
            missing,
            after=after if after is not None else ([self._rank] if self._after_update else []),
            peers=sorted(peers or ()),
            by_partner=sorted(self.by_partner),
            committer=committer,
            store_lost=store_lost,
        )
        final = commit.commit(
            self._writer.root,
            step,
            tmp,
            files,
            world_size=self._world,
            ranks=ranks,
            keep_last=None,
            failure=failure,
            **self._writer.commit_args,
        )
        for r in peers or ():  # their ranks are gone: their copies are done with
            with contextlib.suppress(OSError):
                os.unlink(peer.slot_path(self._slots, self._writer.token, r))  # type: ignore[arg-type]
        return final

    def _said(
        self,
        guard: Guard,
        cause: str,
        path: Path | None,
        missing: list[int],
        why: str,
        took_s: float,
    ) -> None:
        """The ``failure_saved`` event (a warning: the console says it). Its message
        names the error's class only: the error's own report follows, and its headline
        said twice would be noise (the ``cause`` field has its first line)."""
        step, kind, committer = self._step, cause.split(":", 1)[0], self._committer
        when = f"after the update of step {step}" if self._after_update else f"in step {step + 1}"
        if self._point is not None and self._point.before is not None:
            when = f"in step {guard.step + 1}, its GPU a step behind at step {step}"
        rerun = rerun_text(self._writer.root, path)
        if self.part_only:
            why = f"rank {committer} had not begun its failure save"
        message = failure_text.message(
            when,
            kind,
            step,
            path,
            missing,
            took_s,
            why=why,
            notes=self.peer_notes,
            rerun=rerun,
            part_only=self.part_only,
            committer=committer,
        )
        self.outcome = {
            "cause": cause,
            "path": None if path is None else str(path),
            "step": step,
            "seconds": round(took_s, 3),
            "staged_s": self._staged_s,
            "phases": dict(self._phases),
            "copy_streams_blocked": None if self._side is None else self._side.blocked,
            "state": (
                ("after_update" if self._after_update else "live")
                if path is not None or self.part_only
                else "none"
            ),
            "why": why,
            "complete": path is not None and not missing,
            "missing": missing,
        }
        if path is None and self._news_since_run():
            return  # run again at once with another committer (:meth:`run`): that one is said
        with contextlib.suppress(Exception):  # the events file gone: the error goes on
            guard.event("failure_saved", level="warning", message=message, **self.outcome)


#: The key of a rank's record that says it saved the state after the failing step's update;
#: of a dead rank's record that its partner on the next node wrote it (``_file_kept``).
_AFTER_UPDATE, _BY_PARTNER = "_after_update", "_by_partner"
