"""The write pipeline of :class:`SignalCheckpointer`: staging off the live objects, the
background writer thread, the multi-rank commit, and what a failed save costs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from guardrails._errors import CheckpointError, GuardrailsError
from guardrails.checkpoint import commit, digest, sharded, stage
from guardrails.checkpoint.codec import encode
from guardrails.checkpoint.manifest import highest_seq
from guardrails.distributed import store as _store
from guardrails.engine import data as _data
from guardrails.engine import model
from guardrails.util import files as _perms
from guardrails.util import storage

if TYPE_CHECKING:
    from guardrails.engine.guard import Guard

log = logging.getLogger("guardrails.checkpoint")


#: How long rank 0 waits for the other ranks' files, and they for its commit: a rank
#: that is this late has died or hung (the watchdog reports which).
_COMMIT_TIMEOUT_S = 600.0


#: How long rank 0 waits for the other ranks to read a commit's outcome.
_ACK_WAIT_S = 10.0


#: Warn when a save takes more than this share of the grace period: the step in flight
#: when the signal comes must finish too.
_GRACE_SHARE = 0.8


def _writer_failed(error: BaseException, root: Path, step: int | None = None) -> CheckpointError:
    """What the background writer raised, as the CheckpointError that says it."""
    if isinstance(error, CheckpointError):
        return error
    failed = CheckpointError(
        f"the background checkpoint writer failed: {type(error).__name__}: {error}",
        path=str(root),
        step=step,
        hint="the previous checkpoints are intact; fix the cause (disk space, "
        "permissions) and the next save retries.",
    )
    failed.__cause__ = error
    return failed


def _write_error(final: Path, step: int, e: BaseException) -> BaseException:
    """A storage error of a save as a :class:`CheckpointError` with the fix (the
    latest checkpoint is said by the checkpointer, which knows this run's); anything
    else as it is."""
    if storage.is_storage_error(e):
        return commit.write_error(final, step, e, latest=False)
    return e


class CheckpointWriter:
    """Part of :class:`SignalCheckpointer`: see its docstring."""

    def _next_seq(self, root: Path) -> int:
        """This save's sequence number (``manifest.SEQ``): the directory's highest, read
        at this guard's first save, then one more per save. Rank 0 commits alone, and
        one run holds a run_dir at a time (its lock), so no other writer interleaves."""
        if self._seq is None:
            self._seq = highest_seq(root)
        self._seq += 1
        return self._seq

    def _plan_staging(self, guard: Guard) -> None:
        """Allocate the staging memory of the next save now, in a thread, while training
        goes on: at start for the model (and an optimizer state a resume restored), and
        again after the first optimizer step, once its state exists (it grows the same
        layout). Whenever saves can come (a signal's or periodic ones): without it the
        first save paid for pinning its whole state (5.9 s of stall at 10 GB, H200; 4.1 to
        4.6 s of a SIGTERM's 12.4-12.9 s to exit with no periodic saves, H100)."""
        if guard.step >= 1:
            self._staging_planned = True  # the optimizer's state appears at its first step
        bare = model.unwrap(guard.model)
        if model.is_sharded(bare):
            # A signal's sharded save writes from the live shards (no staging); a
            # background one stages into DCP's own memory, prepared once it exists.
            periodic = self.every_n_steps or self.every_s
            if guard.step >= 1 and periodic and self._shard_writer is not None and self.background:
                self._dcp_prepared = sharded.prepare_staging(
                    self._shard_writer.stager, bare, guard.optimizer, self._dcp_stats
                )
            return
        try:
            part = stage.Part(measure=True, host=not self._staging.pinned)
            self._stage(guard, part, measure=True)
            if part.device_bytes:  # allocates only the blocks its layout still lacks
                self._staging.prepare(part.device_bytes, guard.device)
        except Exception as e:  # only an optimisation: the save itself will say what fails
            log.debug("guardrails: staging memory not allocated ahead: %r", e)

    def _save(self, guard: Guard, *, background: bool, final_save: bool = False) -> Path:
        step = guard.step
        self._unsaved.at_step(guard)  # said at the first step; a save before it: here
        if final_save:
            try:
                # What can make the stop's save fail before it writes a byte, checked
                # before the save still being written is given up for it: a value in
                # g.state no checkpoint stores would otherwise cost both saves.
                if guard.rank == 0:
                    encode(dict(guard.state), "g.state", {}, devices=True)
            except BaseException as e:
                self._settle_writer(guard, stopping=True)  # committed: the latest
                self._tell_ranks(guard, step, e)
                raise
            self._abandon_older_write(guard, step)
        self._settle_writer(guard, stopping=final_save)  # the next save waits for the previous one
        done = self.last_path
        if final_save and done is not None and done.name == f"step_{step:09d}":
            # The signal came while this very step's periodic save was being written:
            # that save (now committed) is the checkpoint; writing it again would only
            # spend the grace period.
            return done
        t0 = time.perf_counter()
        with guard.pause_watchdog("checkpoint"):
            part = stage.Part(self._staging)
            bare = model.unwrap(guard.model)
            if self._shard_writer is not None:  # sharded: every rank writes its shards
                writer = self._shard_writer
                try:
                    if background:  # staged to host memory now; the writer thread writes
                        if self._dcp_prepared is not None:
                            # Its memory still being allocated ahead: wait rather than
                            # have DCP allocate a second copy.
                            t_wait = time.perf_counter()
                            self._dcp_prepared.join()
                            self._dcp_prepared = None
                            waited = round(time.perf_counter() - t_wait, 3)
                            self._dcp_stats["waited_s"] = waited
                        part.dcp = (writer, writer.stage(bare, guard.optimizer))
                    else:  # written below, in this thread, before training goes on
                        part.dcp = (writer, writer.live(bare, guard.optimizer))
                except BaseException as e:
                    error = _write_error(self.root / f"step_{step:09d}", step, e)
                    if error is not e:
                        raise error from e
                    raise
            try:
                self._stage(guard, part)
                part.ready()
            except BaseException as e:  # g.state holding a value no checkpoint stores...
                self._tell_ranks(guard, step, e)
                raise
            self._last_saved_step = step
            self._last_save_t = time.monotonic()
            part.stage_s = blocking = time.perf_counter() - t0
            if background:
                self.blocking_times_s.append(blocking)
                self._writing = (step, part)
                self._writer = threading.Thread(
                    target=self._write_safely,
                    args=(guard, step, part, t0),
                    name="guardrails-checkpoint-writer",
                )
                self._writer.start()
                return self.root / f"step_{step:09d}"
            path = self._write(guard, step, part, t0, final_save=final_save)
            self.blocking_times_s.append(time.perf_counter() - t0)
            return path

    def _stage(self, guard: Guard, part: stage.Part, *, measure: bool = False) -> None:
        """Stage what this rank writes into ``part``: rank 0 the replicated state (model,
        optimizers, schedulers, scaler, ``g.state``), every rank its own (data position,
        RNG, the components' state, optimizer state that differs per rank). With
        ``measure``, only what lives on the device is looked at (its sizes, in the same
        order a save stages it: :meth:`_plan_staging`; host tensors too where the
        staging takes them, a CPU run's)."""
        bare = model.unwrap(guard.model)
        is_sharded = model.is_sharded(bare)
        stems = stage.stems("optimizer", list(guard.optimizers))
        replicated = {
            n: o for n, o in guard.optimizers.items() if not is_sharded and n not in self._per_rank
        }
        per_rank = {stems[n]: guard.optimizers[n] for n in sorted(self._per_rank)}
        if measure:  # the device tensors below, in the order they are staged
            if guard.rank == 0:
                if not is_sharded:  # measuring copies nothing: copy= as a save's
                    part.add_tensors("model.safetensors", bare.state_dict(), copy=True)
                for name, opt in replicated.items():
                    stage.stage_optimizer(part, name, opt, copy=True)
            for stem, opt in per_rank.items():
                stage.stage_optimizer(part, stem, opt, copy=True)
            return
        if guard.rank == 0:
            stage.stage_replicated(
                model=None if is_sharded else bare,
                optimizers=replicated,
                schedulers=guard.schedulers,
                scaler=guard.scaler,
                extras=guard.state,
                part=part,
                extras_name="g.state",
            )
        position, tensors = _data.save_position(guard)
        states = guard.generator_states  # the loop's own (guard(generators=)), as the
        for name, gen in guard.generators.items():  # last step left them
            tensors[f"generator.{name}"] = gen.get_state() if states is None else states[name]
        components = {
            c.name: state for c in guard.components if (state := c.state_dict()) is not None
        }
        state = {
            "step": guard.step,
            "data": position,
            "components": components,
        }
        names = stage.param_names(bare) if per_rank and not is_sharded else None
        stage.stage_rank(
            guard.rank, state=state, tensors=tensors, optimizers=per_rank, part=part, names=names
        )

    def _tell_ranks(self, guard: Guard, step: int, error: BaseException) -> None:
        """This rank's staging of ``step`` failed: say so where the other ranks wait for
        its files (and, from rank 0, for the commit), so that they fail now, not after
        the commit's 10-minute wait."""
        store = guard.side_store("checkpoint")
        if store is None:
            return
        key = f"{self._token}/{step}"
        said = json.dumps({"error": f"{type(error).__name__}: {error}"})
        with contextlib.suppress(Exception):  # the store gone too: the ranks time out
            store.set(f"{key}/files/{guard.rank}", said)
            if guard.rank == 0:
                store.set(f"{key}/commit", said)

    def _abandon_older_write(self, guard: Guard, step: int) -> None:
        """A stop's save while a periodic save of an earlier step is still being written:
        that write is abandoned (uncommitted; its temp directory removed), so the stop's
        save, which supersedes it, starts now. Waiting for it cost the H100 benchmark's
        10 GB pre-emption ~5 s of the launcher's 30 s grace period."""
        writing, self._writing = self._writing, None
        if writing is None or self._writer is None or not self._writer.is_alive():
            return
        old_step, part = writing
        if old_step == step:
            return  # this very step: its save is the checkpoint (see _save)
        part.cancel.set()
        self._writer.join()
        self._writer = None
        error, self._writer_error = self._writer_error, None
        if error is None:
            return  # it was past its last piece: committed after all
        guard.event(
            "checkpoint_abandoned",
            step=old_step,
            message=f"the save of step {old_step}, still being written, was abandoned: "
            f"the stop's save of step {step} supersedes it.",
        )
        if not isinstance(error, digest.Cancelled):
            log.debug("guardrails: the abandoned save of step %d also failed: %r", old_step, error)

    def _write_safely(self, guard: Guard, step: int, part: stage.Part, t0: float) -> None:
        try:
            self._write(guard, step, part, t0)
        except BaseException as e:  # raised in the main thread at the next boundary
            self._writer_error = e

    def _write(
        self,
        guard: Guard,
        step: int,
        part: stage.Part,
        t0: float,
        *,
        final_save: bool = False,
    ) -> Path:
        root, rank = self.root, guard.rank
        final = root / f"step_{step:09d}"
        store = guard.side_store("checkpoint")
        key = f"{self._token}/{step}"
        tmp: Path | None = None
        files: dict[str, Any] = {}
        try:
            if rank == 0:
                _perms.make_dirs(root)
                # A stop's save leaves the cleaning to the next start: deleting the
                # checkpoint the last periodic save retired takes seconds at 10 GB.
                if not final_save:
                    if self._emptying is not None:  # it had a whole save interval
                        self._emptying.join()
                        self._emptying = None
                    commit.remove_leftovers(root, keep=self._token)
            tmp = commit.begin(root, step, self._token)
            part.write(tmp, files)
            t_shards = time.perf_counter()
            if part.dcp is not None:  # a sharded save: its shards next
                writer, staged = part.dcp
                records = writer.write(
                    tmp,
                    staged,
                    rank=rank,
                    world=guard.world_size,
                    store=store,
                    key=key,
                    cancel=part.cancel,
                    timeout_s=_COMMIT_TIMEOUT_S,
                )  # hashed as written
                part.sealed = [tmp / sharded.DCP_DIR / name for name in records]
                files.update({f"{sharded.DCP_DIR}/{n}": r for n, r in records.items()})
            part.write_s += time.perf_counter() - t_shards
        except BaseException as e:
            error = _write_error(final, step, e)
            if store is not None:  # so rank 0 does not wait for files that never come
                said = error.message if isinstance(error, CheckpointError) else repr(e)
                store.set(f"{key}/files/{rank}", json.dumps({"error": said}))
                if rank == 0:  # nor the other ranks for a commit that never comes
                    store.set(f"{key}/commit", json.dumps({"error": said}))
            if tmp is not None and rank == 0:
                trashed = False
                if part.cancel.is_set():  # abandoned by a stop: the next start deletes it
                    with contextlib.suppress(OSError):
                        commit.to_trash(tmp)
                        trashed = True
                if not trashed:
                    shutil.rmtree(tmp, ignore_errors=True)
            if error is not e:
                raise error from e
            raise
        t_commit = time.perf_counter()
        try:
            if store is None:
                final = commit.commit(
                    root,
                    step,
                    tmp,
                    files,
                    world_size=1,
                    ranks=[0],
                    keep_last=self.keep_last,
                    delete_old=False,  # retired to .trash-*; deleted below
                    contents=self._contents,
                    run=self._run,
                    adopt_unlabelled=self._adopt_unlabelled,
                    seq=self._next_seq(root),
                )
            else:
                store.set(f"{key}/files/{rank}", json.dumps(files))
                final = self._commit_together(guard, store, key, root, step, tmp, files, final_save)
        except BaseException as e:  # the manifest or the rename failed: nothing committed
            if store is None:
                shutil.rmtree(tmp, ignore_errors=True)
            error = _write_error(final, step, e)
            if error is not e:
                raise error from e
            raise
        took = time.perf_counter() - t0
        if rank == 0 and not final_save:  # the stop's save leaves them to the next start
            self._emptying = commit.empty_trash(root)
        self.save_times_s.append(took)
        self.last_path = final
        self._committed_step = step
        # Where the time went: staging blocks training (device-to-host copy); writing
        # includes hashing (done on the way to disk); the fsyncs wait for the disk;
        # commit is the manifest, the rename and (multi-rank) waiting for every rank.
        guard.event(
            "checkpoint",
            step=step,
            path=str(final),
            bytes=part.nbytes,
            seconds=round(took, 3),
            stage_s=round(part.stage_s, 3),
            stage_fresh_bytes=part.fresh_bytes,
            write_s=round(part.write_s, 3),
            fsync_s=round(part.fsync_s, 3),
            commit_s=round(time.perf_counter() - t_commit, 3),
            background=threading.current_thread() is not threading.main_thread(),
            sharded=bool(part.sealed),
            **({"dcp_staging": dict(self._dcp_stats)} if part.sealed and self._dcp_stats else {}),
        )
        if took > _GRACE_SHARE * self.grace_s and not self._warned_grace:
            self._warned_grace = True
            guard.event(
                "checkpoint_slow",
                level="warning",
                message=f"saving a checkpoint took {took:.1f} s ({part.nbytes / 1e9:.2f} GB "
                f"on rank {rank}), more than {_GRACE_SHARE:.0%} of the {self.grace_s:.0f} s "
                "the launcher waits between SIGTERM and SIGKILL: a pre-emption would "
                "likely lose this save. Save to a faster disk (local NVMe, then copy), "
                "checkpoint more often so less is lost, or ask the scheduler for an "
                "earlier warning (SLURM: --signal=USR1@120) and raise grace_s to match.",
                seconds=round(took, 3),
                grace_s=self.grace_s,
            )
        return final

    def _commit_together(
        self,
        guard: Guard,
        store: Any,
        key: str,
        root: Path,
        step: int,
        tmp: Path,
        files: dict[str, Any],
        final_save: bool,
    ) -> Path:
        """Rank 0 commits once every rank's files are in; the others wait for its word."""
        timeout = timedelta(seconds=_COMMIT_TIMEOUT_S)
        world = guard.world_size
        if guard.rank != 0:
            _store.wait_keys(store, [f"{key}/commit"], timeout, world=world)
            result = json.loads(store.get(f"{key}/commit"))
            store.add(f"{key}/ack", 1)  # rank 0 may exit (and take its store) after this
            if "error" in result:
                raise CheckpointError(
                    f"checkpoint step {step} was not committed: {result['error']}",
                    step=step,
                    rank=guard.rank,
                    path=str(root / f"step_{step:09d}"),
                    hint="see rank 0's log for the cause and its fix (free space, the "
                    "permissions of run_dir, or another run_dir); the previous checkpoints "
                    "are intact.",
                )
            return Path(result["path"])
        try:
            keys = [f"{key}/files/{r}" for r in range(world)]
            try:
                _store.wait_keys(store, keys, timeout, world=world)
            except Exception as e:
                missing = [r for r, k in enumerate(keys) if not store.check([k])]
                raise CheckpointError(
                    f"rank(s) {missing} did not finish writing checkpoint step {step} "
                    f"within {_COMMIT_TIMEOUT_S:.0f} s",
                    step=step,
                    path=str(tmp),
                    hint="those ranks died or hung mid-save; the previous checkpoints are intact.",
                ) from e
            merged: dict[str, Any] = {}
            for r, k in enumerate(keys):
                got = json.loads(store.get(k))
                if "error" in got:
                    raise CheckpointError(
                        f"rank {r} could not write its part of checkpoint step {step}: "
                        f"{got['error']}",
                        step=step,
                        path=str(tmp),
                        hint="free space, or check the permissions of run_dir, on that "
                        "rank's node, or point run_dir at another disk; the previous "
                        "checkpoints are intact.",
                    )
                merged.update(got)
            final = commit.commit(
                root,
                step,
                tmp,
                merged,
                world_size=world,
                ranks=list(range(world)),
                keep_last=self.keep_last,
                delete_old=False,  # retired to .trash-*; deleted below
                contents=self._contents,
                run=self._run,
                adopt_unlabelled=self._adopt_unlabelled,
                seq=self._next_seq(root),
            )
        except BaseException as e:
            error = _write_error(root / f"step_{step:09d}", step, e)
            said = f"{type(e).__name__}: {e}"
            if isinstance(error, CheckpointError):
                said = error.message
            store.set(f"{key}/commit", json.dumps({"error": said}))
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        store.set(f"{key}/commit", json.dumps({"path": str(final)}))
        # Outside torchrun rank 0's process hosts the store: after a signal save it
        # exits at once, so wait (briefly) until every rank has read the outcome.
        deadline = time.monotonic() + _ACK_WAIT_S
        while store.add(f"{key}/ack", 0) < world - 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        return final

    def _settle_writer(self, guard: Guard, *, stopping: bool = False) -> None:
        """Wait for the background writer; a save it could not write is handled like
        any failed periodic save (:meth:`_save_failed`), anything else raised. When
        ``stopping`` (a signal's stop is about to save), any failure of the older save
        is only said: the stop's own save must still be tried, or a pre-emption would
        lose every step since the last checkpoint to an error of a save it supersedes
        (a writer process killed by the launcher's SIGTERM, say)."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        error = self._writer_error
        if isinstance(error, CheckpointError) or (stopping and error is not None):
            self._writer_error = None
            step = None if self._writing is None else self._writing[0]
            self._save_failed(guard, _writer_failed(error, self.root, step), stopping=stopping)
        else:
            self._wait_writer(raise_error=True)

    def _save_failed(self, guard: Guard, error: CheckpointError, *, stopping: bool = False) -> None:
        """A periodic save could not be written (a full disk, permissions): a warning,
        and training goes on with the previous checkpoint as the latest; the next save
        retries. Raised when this run has no checkpoint to fall back on (a run_dir that
        takes none at all is a setup mistake, best found now), unless ``stopping``: the
        stop's save is the retry, and it comes next."""
        self._last_saved_step = self._committed_step  # the next save retries
        if self._writing is not None and self._writing[0] == error.step:
            self._writing = None
        if self.last_path is None and not stopping:
            raise error.rehint(
                f"{error.hint} This run has no checkpoint yet to fall back on, so it stops "
                "at its first save rather than train on unprotected (a pre-emption would "
                "lose every step). Periodic saves that fail later, once one was written, "
                "are warnings and training goes on."
            )
        self.failed_saves += 1
        now = time.monotonic()
        again = now - self._failed_warned_t < storage.WARN_EVERY_S
        if not again:
            self._failed_warned_t = now
        step = error.step if error.step is not None else guard.step
        then = (
            f"The stop's save comes next; until it commits, {self._latest_text()}"
            if stopping
            else f"Training goes on and the next periodic save retries ({self.failed_saves} "
            f"failed so far); {self._latest_text()}, and a pre-emption now loses the steps "
            "since"
        )
        guard.event(
            "checkpoint_failed",
            # Once, then at most every 10 min while saves keep failing (the others are
            # in the events at INFO, each with its cause).
            level="info" if again else "warning",
            step=step,
            message=f"the checkpoint of step {step} could not be saved: {error.message}. "
            f"{then}. Fix: {error.hint}",
            path=error.path,
            failed=self.failed_saves,
        )

    def _latest_text(self) -> str:
        """Which checkpoint stays the latest, in words."""
        if self.last_path is None:
            return "this run has no checkpoint, so a re-run starts from scratch"
        return (
            f"the latest checkpoint is {self.last_path} (step {self._committed_step}), "
            "which a re-run of the same command resumes"
        )

    def _wait_writer(self, *, raise_error: bool) -> None:
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        error, self._writer_error = self._writer_error, None
        if error is not None and raise_error:
            if isinstance(error, GuardrailsError):
                raise error
            raise _writer_failed(error, self.root) from error
