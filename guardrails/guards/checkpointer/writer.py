"""The write pipeline of :class:`SignalCheckpointer`: staging, the writer thread, the
multi-rank commit, and what a failed save costs.

:class:`CheckpointWriter` is built at start with what every save needs (the directory,
the ranks, their store, the manifest's run record) and owns what saves share (staging
memory, the writer thread, the last checkpoint). A save: :meth:`~CheckpointWriter.save`
(stage, write here or in the thread), :meth:`~CheckpointWriter._write` (commit, report)."""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import threading
import time
import uuid
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from guardrails._errors import CheckpointError, GuardrailsError
from guardrails.checkpoint import commit, digest, sharded, stage
from guardrails.checkpoint.codec import encode
from guardrails.checkpoint.manifest import highest_seq
from guardrails.checkpoint.tier import LocalTier
from guardrails.distributed import store as _store
from guardrails.engine import ddp_buckets, model
from guardrails.guards.checkpointer.local import Drain
from guardrails.util import files as _perms
from guardrails.util import storage

if TYPE_CHECKING:
    from guardrails.engine.guard import Guard
    from guardrails.guards.checkpointer.savepoint import SavePoint

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


def agree_token(store: Any, rank: int) -> str:
    """One name per guard for this run's temp directories, the same on every rank
    (``store``: the checkpoint's side store, ``None`` in a single process)."""
    if store is None:
        return uuid.uuid4().hex[:8]
    if rank == 0:
        store.set("token", uuid.uuid4().hex[:8])
    return store.get("token").decode()


class CheckpointWriter:
    """Stages and commits this guard's checkpoints.

    ``root``: the checkpoint directory. ``rank``, ``world_size``: this rank and the
    job's. ``store``: the checkpoint's side store (``None`` in a single process),
    through which the ranks publish their files and rank 0 its commit; ``token``
    names this guard's temp directories and store keys (:func:`agree_token`).
    ``run``: the manifest's run record (config, optimizer settings, the run's id).
    ``contents``: what the checkpoint holds (``commit.contents_of``). ``per_rank``:
    the optimizers whose state differs per rank (every rank saves its own).
    ``model_sharded``: the model is sharded (FSDP2 / DTensor), written in DCP's format.
    ``keep_last``, ``grace_s``: the knobs. ``save_times_s``, ``blocking_times_s``:
    the lists each save appends its seconds to (the component's, public). ``tier``:
    the node-local tier (``local_directory``): saves commit there (``root`` is then its
    directory, ``tier.durable`` the checkpoint directory) and rank 0 drains each commit
    into the durable one.
    """

    def __init__(
        self,
        *,
        root: Path,
        rank: int,
        world_size: int,
        store: Any,
        token: str,
        run: dict[str, Any],
        contents: dict[str, Any],
        per_rank: set[str],
        model_sharded: bool,
        keep_last: int | None,
        grace_s: float,
        save_times_s: list[float],
        blocking_times_s: list[float],
        tier: LocalTier | None = None,
    ) -> None:
        #: Where saves commit: the local tier's directory when there is one.
        self.root = root if tier is None else tier.local
        self.tier = tier
        if tier is not None:  # where `inspect` finds the local copies (manifest's run)
            run["local_directory"] = str(tier.local)
        self._drain = None if tier is None else Drain(tier, token=token, grace_s=grace_s)
        self._rank, self._world = rank, world_size
        self._store = store
        self._token = token
        self.run = run
        self._contents = contents
        self._per_rank = per_rank
        self._keep_last = keep_last if tier is None else tier.keep_last
        self._grace_s = grace_s
        self.save_times_s = save_times_s
        self.blocking_times_s = blocking_times_s
        #: The last committed checkpoint (``None`` until one is).
        self.last_path: Path | None = None
        #: The step of the last save begun, and when (``time.monotonic()``).
        self.last_saved_step = -1
        self.last_save_t = time.monotonic()
        #: The step of the last committed (or resumed) checkpoint: last_saved_step goes
        #: back to it when a save fails, so the next save (or the one at the end) retries.
        self.committed_step = -1
        #: Saves that failed to write (a full disk...) while training went on.
        self.failed_saves = 0
        self._failed_warned_t = -float("inf")
        self._warned_grace = False
        # Retention also counts checkpoints without a run id (this run resumed one).
        self._adopt_unlabelled = False
        self._seq: int | None = None  # the last save's sequence number in root
        self._writer: threading.Thread | None = None
        #: What the background writer raised (said at the next step boundary).
        self.error: BaseException | None = None
        self._writing: tuple[int, stage.Part] | None = None  # (step, its part)
        # The host blocks every save stages into (pinned on a CUDA machine; allocated
        # ahead of the first save, at start and after step 1: see plan_staging).
        self.staging = stage.Staging()
        #: Whether the staging memory is planned for the optimizer's state too.
        self.staging_planned = False
        # The writer of every sharded save (None for a model that is not sharded),
        # kept so its pinned staging and save plan are reused, and the thread
        # allocating that staging ahead of the first background save.
        self._sharded = model_sharded
        self._shard_writer = sharded.ShardWriter() if model_sharded else None  # no memory yet
        self._dcp_prepared: threading.Thread | None = None
        self._dcp_stats: dict[str, Any] = {}  # its timings, told in checkpoint events
        # Deleting retired checkpoints (.trash-*) off the writer's path: what a stop
        # left in the trash (the save it abandoned...), at start.
        self._emptying = commit.empty_trash(self.root) if rank == 0 else None
        if tier is not None and rank == 0:
            commit.empty_trash(tier.durable)  # a stop's drain left its retired copies

    def continue_from(self, path: Path, step: int, run_id: str | None) -> None:
        """A resume restored ``path`` (``step``): it is the latest checkpoint, and this
        run continues the one that saved it (its id; one saved before run ids: a new
        id, and those without one count as this run's too)."""
        self.last_saved_step = self.committed_step = step
        if run_id is not None:
            self.run["id"] = run_id
        else:
            self._adopt_unlabelled = True
        self.last_path = path

    @property
    def busy(self) -> bool:
        """Whether a background save is being written now."""
        return self._writer is not None and self._writer.is_alive()

    def latest_text(self) -> str:
        """Which checkpoint stays the latest, in words."""
        if self.last_path is None:
            return "this run has no checkpoint, so a re-run starts from scratch"
        return (
            f"the latest checkpoint is {self.last_path} (step {self.committed_step}), "
            "which a re-run of the same command resumes"
        )

    def _next_seq(self) -> int:
        """This save's sequence number (``manifest.SEQ``): the directory's highest, read
        at this guard's first save, then one more per save. Rank 0 commits alone, and
        one run holds a run_dir at a time (its lock), so no other writer interleaves."""
        if self._seq is None:
            self._seq = highest_seq(self.root) if self.tier is None else self.tier.next_seq()
        self._seq += 1
        return self._seq

    # ------------------------------------------------------------------ staging

    def plan_staging(self, guard: Guard, *, background_saves: bool) -> None:
        """Allocate the staging memory of the next save now, in a thread, while training
        goes on: at start for the model (and an optimizer state a resume restored), and
        again after the first optimizer step, once its state exists (it grows the same
        layout). Whenever saves can come (a signal's or periodic ones): without it the
        first save paid for pinning its whole state (5.9 s of stall at 10 GB, H200; 4.1 to
        4.6 s of a SIGTERM's 12.4-12.9 s to exit with no periodic saves, H100).
        ``background_saves``: periodic saves written in the thread are on."""
        if guard.step >= 1:  # the optimizer's state appears at its first step; DDP logs its
            # rebuilt buckets in its third (read here, on the loop's thread: ddp_buckets.py)
            self.staging_planned = ddp_buckets.read_ahead(guard.model) or guard.step >= 3
        bare = model.unwrap(guard.model)
        if self._sharded:
            # A signal's sharded save writes from the live shards (no staging); a
            # background one stages into DCP's own memory, prepared once it exists.
            if guard.step >= 1 and background_saves and self._shard_writer is not None:
                self._dcp_prepared = sharded.prepare_staging(
                    self._shard_writer, bare, guard.optimizer, self._dcp_stats
                )
            return
        try:
            part = stage.Part(measure=True, host=not self.staging.pinned)
            self._stage(guard, part, measure=True)
            if part.device_bytes:  # allocates only the blocks its layout still lacks
                self.staging.prepare(part.device_bytes, guard.device)
        except Exception as e:  # only an optimisation: the save itself will say what fails
            log.debug("guardrails: staging memory not allocated ahead: %r", e)

    def save(self, guard: Guard, *, background: bool, final_save: bool = False) -> Path:
        """Save ``guard``'s objects at its step: staged now (training blocks for that),
        then written and committed, in the writer thread when ``background``.
        ``final_save``: the stop's save (a signal's), which supersedes a background
        save still being written. Returns the checkpoint's directory."""
        step = guard.step
        if final_save:
            self._before_final_save(guard, step)
        self.settle(guard, stopping=final_save)  # the next save waits for the previous one
        done = self.last_path
        if final_save and done is not None and done.name == f"step_{step:09d}":
            # The signal came while this very step's periodic save was being written:
            # that save (now committed) is the checkpoint; writing it again would only
            # spend the grace period.
            return done
        t0 = time.perf_counter()
        with guard.pause_watchdog("checkpoint"):
            part = stage.Part(self.staging)
            if self._shard_writer is not None:  # sharded: every rank writes its shards
                part.dcp = self._stage_shards(guard, step, background=background)
            try:
                self._stage(guard, part)
                part.ready()
            except BaseException as e:  # g.state holding a value no checkpoint stores...
                self._tell_ranks(step, e)
                raise
            self.last_saved_step = step
            self.last_save_t = time.monotonic()
            part.stage_s = blocking = time.perf_counter() - t0
            if background:
                self.blocking_times_s.append(blocking)
                self._writing = (step, part)
                self._writer = threading.Thread(
                    target=self._write_safely,
                    args=(guard, step, part, t0),
                    name="guardrails-checkpoint-writer",
                    daemon=True,  # an abandoned one waits for no exit (see close)
                )
                self._writer.start()
                return self.root / f"step_{step:09d}"
            path = self._write(guard, step, part, t0, final_save=final_save)
            self.blocking_times_s.append(time.perf_counter() - t0)
            return path

    def _before_final_save(self, guard: Guard, step: int) -> None:
        """What can make the stop's save fail before it writes a byte, checked before
        the save still being written is given up for it: a value in g.state no
        checkpoint stores would otherwise cost both saves. Then that older write is
        abandoned. The staging memory still being pinned ahead stops growing: the stop's
        save copies what its blocks do not hold yet into plain memory rather than wait
        (the process ends after it)."""
        self.staging.stop_preparing()
        try:
            if self._rank == 0:
                encode(dict(guard.state), "g.state", {}, devices=True)
        except BaseException as e:
            self.settle(guard, stopping=True)  # committed: the latest
            self._tell_ranks(step, e)
            raise
        self._abandon_older_write(guard, step)

    def _stage_shards(self, guard: Guard, step: int, *, background: bool) -> tuple[Any, Any]:
        """A sharded save's shards: staged to host memory now for the writer thread
        (``background``), else the live shards, written before training goes on."""
        writer = self._shard_writer
        assert writer is not None
        bare = model.unwrap(guard.model)
        try:
            if not background:
                return (writer, writer.live(bare, guard.optimizer))
            if self._dcp_prepared is not None:
                # Its memory still being allocated ahead: wait rather than have DCP
                # allocate a second copy.
                t_wait = time.perf_counter()
                self._dcp_prepared.join()
                self._dcp_prepared = None
                self._dcp_stats["waited_s"] = round(time.perf_counter() - t_wait, 3)
            return (writer, writer.stage(bare, guard.optimizer))
        except BaseException as e:
            error = commit.save_error(self.root / f"step_{step:09d}", step, e)
            if error is not e:
                raise error from e
            raise

    def _stage(
        self,
        guard: Guard,
        part: stage.Part,
        *,
        measure: bool = False,
        point: SavePoint | None = None,
    ) -> None:
        """Stage what this rank writes into ``part``: rank 0 the replicated state (model,
        optimizers, schedulers, scaler, ``g.state``), every rank its own (data position,
        RNG, the components' state, optimizer state that differs per rank). With
        ``measure``, only what lives on the device is looked at (its sizes, in the same
        order a save stages it: :meth:`plan_staging`; host tensors too where the
        staging takes them, a CPU run's). ``point``: a failure save's step, RNG streams,
        data position and host state (``savepoint.py``: the loop had moved past it)."""
        bare = model.unwrap(guard.model)
        is_sharded = self._sharded
        stems = stage.stems("optimizer", list(guard.optimizers))
        replicated = {
            n: o for n, o in guard.optimizers.items() if not is_sharded and n not in self._per_rank
        }
        per_rank = {stems[n]: guard.optimizers[n] for n in sorted(self._per_rank)}
        if measure:  # the device tensors below, in the order they are staged
            if self._rank == 0:
                if not is_sharded:  # measuring copies nothing: copy= as a save's
                    part.add_tensors("model.safetensors", bare.state_dict(), copy=True)
                for name, opt in replicated.items():
                    stage.stage_optimizer(part, name, opt, copy=True)
            for stem, opt in per_rank.items():
                stage.stage_optimizer(part, stem, opt, copy=True)
            return
        if self._rank == 0:
            stage.stage_replicated(
                model=None if is_sharded else bare,
                optimizers=replicated,
                schedulers=guard.schedulers,
                scaler=guard.scaler,
                extras=guard.state,
                part=part,
                extras_name="g.state",
                optimizer_state=None if point is None else point.optimizer_state,
                scheduler_states=None if point is None else point.scheduler_states,
            )
        position, tensors = guard.data_position.save() if point is None else point.data(guard)
        held = None if point is None else point.generator_states
        states = guard.generator_states if held is None else held  # the loop's own
        for name, gen in guard.generators.items():  # (generators=), as the step left them
            tensors[f"generator.{name}"] = gen.get_state() if states is None else states[name]
        components = {
            c.name: state for c in guard.components if (state := c.state_dict()) is not None
        }
        step = guard.step if point is None else point.step
        state = {"step": step, "data": position, "components": components}
        if (buckets := ddp_buckets.saved_layout(guard.model)) is not None:
            state["ddp_buckets"] = buckets  # a DDP resume's first step reduces with them
        names = stage.param_names(bare) if per_rank and not is_sharded else None
        stage.stage_rank(
            self._rank,
            state=state,
            tensors=tensors,
            optimizers=per_rank,
            part=part,
            names=names,
            rng=None if point is None else point.rng,
            optimizer_state=None if point is None else point.optimizer_state,
        )

    def stage_boundary(self, guard: Guard, point: SavePoint) -> stage.Part:
        """A failure save's part (``failure.py``): the state of ``point``'s step, with the
        RNG streams and data position its boundary left (the loop had moved past it),
        staged into fresh plain memory (the staging blocks may belong to a background
        save still being written; fresh pinned memory waits for a stuck device)."""
        part = stage.Part(plain=True)
        self._stage(guard, part, point=point)
        part.ready()
        return part

    @property
    def commit_args(self) -> dict[str, Any]:
        """What a commit of this writer's saves passes to ``commit.commit`` besides the
        step and the files (a failure save commits on its own: ``failure.py``)."""
        return {
            "contents": self._contents,
            "run": self.run,
            "adopt_unlabelled": self._adopt_unlabelled,
            "seq": self._next_seq(),
        }

    @property
    def stages_weights(self) -> bool:
        """Whether this rank's part holds device state (else only RNG, data position)."""
        return self._rank == 0 or bool(self._per_rank) or self._sharded

    @property
    def token(self) -> str:
        """This guard's name for its temp directories and store keys (every rank's)."""
        return self._token

    def _tell_ranks(self, step: int, error: BaseException) -> None:
        """This rank's staging of ``step`` failed: say so where the other ranks wait for
        its files (and, from rank 0, for the commit), so that they fail now, not after
        the commit's 10-minute wait."""
        if self._store is None:
            return
        key = f"{self._token}/{step}"
        said = json.dumps({"error": f"{type(error).__name__}: {error}"})
        with contextlib.suppress(Exception):  # the store gone too: the ranks time out
            self._store.set(f"{key}/files/{self._rank}", said)
            if self._rank == 0:
                self._store.set(f"{key}/commit", said)

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
            return  # this very step: its save is the checkpoint (see save)
        part.cancel.set()
        self._writer.join()
        self._writer = None
        error, self.error = self.error, None
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

    # ------------------------------------------------------------------ writing

    def _write_safely(self, guard: Guard, step: int, part: stage.Part, t0: float) -> None:
        try:
            self._write(guard, step, part, t0)
        except BaseException as e:  # raised in the main thread at the next boundary
            self.error = e

    def _write(
        self, guard: Guard, step: int, part: stage.Part, t0: float, *, final_save: bool = False
    ) -> Path:
        """Write this rank's files of ``part``, commit them (with every rank's), and
        report the save."""
        tmp, files = self._write_files(step, part, final_save=final_save)
        t_commit = time.perf_counter()
        final = self.root / f"step_{step:09d}"
        try:
            if self._store is None:
                final = self._commit(step, tmp, files, world=1)
            else:
                key = f"{self._token}/{step}"
                self._store.set(f"{key}/files/{self._rank}", json.dumps(files))
                final = self._commit_together(key, step, tmp, files)
        except BaseException as e:  # the manifest or the rename failed: nothing committed
            if self._store is None:
                shutil.rmtree(tmp, ignore_errors=True)
            error = commit.save_error(final, step, e)
            if error is not e:
                raise error from e
            raise
        took = time.perf_counter() - t0
        if self._rank == 0 and not final_save:  # the stop's save leaves them to the next start
            self._emptying = commit.empty_trash(self.root)
        self.save_times_s.append(took)
        self.last_path = final
        self.committed_step = step
        self._report(guard, step, final, part, took, commit_s=time.perf_counter() - t_commit)
        if self._drain is not None and self._rank == 0:
            # A signal's save drains for what is left of the grace period's share.
            left = _GRACE_SHARE * self._grace_s - (time.perf_counter() - t0)
            self.drain(
                guard, step, final, cancel=part.cancel, within_s=left if final_save else None
            )
        return final

    def drain(self, guard: Guard, step: int, final: Path, **when: Any) -> None:
        """Rank 0: copy ``final``, committed in the local tier, to the durable directory
        (``local.Drain.after_commit``'s ``cancel``, ``within_s``); also for a save
        committed outside :meth:`save` (a failure save). Nothing without a local tier."""
        if self._drain is not None and self._rank == 0:
            when.setdefault("cancel", threading.Event())
            run, adopt = self.run, self._adopt_unlabelled
            self._drain.after_commit(guard, step, final, run=run, adopt_unlabelled=adopt, **when)

    def _write_files(
        self, step: int, part: stage.Part, *, final_save: bool
    ) -> tuple[Path, dict[str, Any]]:
        """This rank's files of ``step`` into the temp directory (hashed as written):
        the temp directory and the files' records. A failure is said where the other
        ranks wait (its files, rank 0's commit), and the temp directory goes."""
        root, rank, store = self.root, self._rank, self._store
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
                    world=self._world,
                    store=store,
                    key=key,
                    cancel=part.cancel,
                    timeout_s=_COMMIT_TIMEOUT_S,
                )  # hashed as written
                part.sealed = [tmp / sharded.DCP_DIR / name for name in records]
                files.update({f"{sharded.DCP_DIR}/{n}": r for n, r in records.items()})
            part.write_s += time.perf_counter() - t_shards
        except BaseException as e:
            error = commit.save_error(root / f"step_{step:09d}", step, e)
            if store is not None:  # so rank 0 does not wait for files that never come
                said = error.message if isinstance(error, CheckpointError) else repr(e)
                store.set(f"{key}/files/{rank}", json.dumps({"error": said}))
                if rank == 0:  # nor the other ranks for a commit that never comes
                    store.set(f"{key}/commit", json.dumps({"error": said}))
            if tmp is not None and rank == 0:
                commit.discard(tmp, trash=part.cancel.is_set())
            if error is not e:
                raise error from e
            raise
        return tmp, files

    def _commit(self, step: int, tmp: Path, files: Mapping[str, Any], *, world: int) -> Path:
        """Rank 0's commit of ``tmp`` as ``step``, with ``world`` ranks' ``files``."""
        return commit.commit(
            self.root,
            step,
            tmp,
            dict(files),
            world_size=world,
            ranks=list(range(world)),
            keep_last=self._keep_last,
            delete_old=False,  # retired to .trash-*; deleted after the commit
            contents=self._contents,
            run=self.run,
            adopt_unlabelled=self._adopt_unlabelled,
            seq=self._next_seq(),
        )

    def _commit_together(self, key: str, step: int, tmp: Path, files: dict[str, Any]) -> Path:
        """Rank 0 commits once every rank's files are in; the others wait for its word."""
        store, world = self._store, self._world
        if self._rank != 0:
            return self._await_commit(key, step)
        try:
            merged = self._gather_files(key, step, tmp)
            final = self._commit(step, tmp, merged, world=world)
        except BaseException as e:
            error = commit.save_error(self.root / f"step_{step:09d}", step, e)
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

    def _await_commit(self, key: str, step: int) -> Path:
        """A rank other than 0: rank 0's word on the commit of ``step``."""
        store = self._store
        timeout = timedelta(seconds=_COMMIT_TIMEOUT_S)
        _store.wait_keys(store, [f"{key}/commit"], timeout, world=self._world)
        result = json.loads(store.get(f"{key}/commit"))
        store.add(f"{key}/ack", 1)  # rank 0 may exit (and take its store) after this
        if "error" in result:
            raise CheckpointError(
                f"checkpoint step {step} was not committed: {result['error']}",
                step=step,
                rank=self._rank,
                path=str(self.root / f"step_{step:09d}"),
                hint="see rank 0's log for the cause and its fix (free space, the "
                "permissions of run_dir, or another run_dir); the previous checkpoints "
                "are intact.",
            )
        return Path(result["path"])

    def _gather_files(self, key: str, step: int, tmp: Path) -> dict[str, Any]:
        """Rank 0: every rank's file records of ``step``, merged, once all are in."""
        store, world = self._store, self._world
        keys = [f"{key}/files/{r}" for r in range(world)]
        try:
            _store.wait_keys(store, keys, timedelta(seconds=_COMMIT_TIMEOUT_S), world=world)
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
                    f"rank {r} could not write its part of checkpoint step {step}: {got['error']}",
                    step=step,
                    path=str(tmp),
                    hint="free space, or check the permissions of run_dir, on that "
                    "rank's node, or point run_dir at another disk; the previous "
                    "checkpoints are intact.",
                )
            merged.update(got)
        return merged

    def _report(
        self,
        guard: Guard,
        step: int,
        final: Path,
        part: stage.Part,
        took: float,
        *,
        commit_s: float,
    ) -> None:
        """The save's event, and a warning once when it took most of the grace period."""
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
            commit_s=round(commit_s, 3),
            background=threading.current_thread() is not threading.main_thread(),
            sharded=bool(part.sealed),
            **({"tier": "local"} if self.tier is not None else {}),
            **({"dcp_staging": dict(self._dcp_stats)} if part.sealed and self._dcp_stats else {}),
        )
        if took > _GRACE_SHARE * self._grace_s and not self._warned_grace:
            self._warned_grace = True
            guard.event(
                "checkpoint_slow",
                level="warning",
                message=f"saving a checkpoint took {took:.1f} s ({part.nbytes / 1e9:.2f} GB "
                f"on rank {self._rank}), more than {_GRACE_SHARE:.0%} of the "
                f"{self._grace_s:.0f} s the launcher waits between SIGTERM and SIGKILL: a "
                "pre-emption would likely lose this save. Save to a faster disk (local "
                "NVMe, then copy), checkpoint more often so less is lost, or ask the "
                "scheduler for an earlier warning (SLURM: --signal=USR1@120) and raise "
                "grace_s to match.",
                seconds=round(took, 3),
                grace_s=self._grace_s,
            )

    # ------------------------------------------------------------------ the writer thread

    def settle(self, guard: Guard, *, stopping: bool = False) -> None:
        """Wait for the background writer; a save it could not write is handled like
        any failed periodic save (:meth:`failed`), anything else raised. When
        ``stopping`` (a signal's stop is about to save), any failure of the older save
        is only said: the stop's own save must still be tried, or a pre-emption would
        lose every step since the last checkpoint to an error of a save it supersedes
        (a writer process killed by the launcher's SIGTERM, say)."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        error = self.error
        if isinstance(error, CheckpointError) or (stopping and error is not None):
            self.error = None
            step = None if self._writing is None else self._writing[0]
            self.failed(guard, _writer_failed(error, self.root, step), stopping=stopping)
        else:
            self._wait_writer(raise_error=True)

    def failed(self, guard: Guard, error: CheckpointError, *, stopping: bool = False) -> None:
        """A periodic save could not be written (a full disk, permissions): a warning,
        and training goes on with the previous checkpoint as the latest; the next save
        retries. Raised when this run has no checkpoint to fall back on (a run_dir that
        takes none at all is a setup mistake, best found now), unless ``stopping``: the
        stop's save is the retry, and it comes next."""
        self.last_saved_step = self.committed_step  # the next save retries
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
            f"The stop's save comes next; until it commits, {self.latest_text()}"
            if stopping
            else f"Training goes on and the next periodic save retries ({self.failed_saves} "
            f"failed so far); {self.latest_text()}, and a pre-emption now loses the steps "
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

    def _wait_writer(self, *, raise_error: bool) -> None:
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        error, self.error = self.error, None
        if error is not None and raise_error:
            if isinstance(error, GuardrailsError):
                raise error
            raise _writer_failed(error, self.root) from error

    def close(self, *, raise_error: bool, stopped: bool, superseded_at: int | None = None) -> None:
        """At the guard's end: the writer thread joined (its error raised when
        ``raise_error``), the staging ahead and the sharded writer's memory let go, and
        the trash emptied unless the run ``stopped`` on a signal (the next start does).
        ``superseded_at``: the step a failure save wrote; a write of it or an older step
        is abandoned, not waited for (a dead rank's files never come: a 10-minute wait),
        its temp directory left for the next start."""
        try:
            writing, self._writing = self._writing, None
            if writing is not None and superseded_at is not None and writing[0] <= superseded_at:
                writing[1].cancel.set()
                if self._writer is not None:
                    self._writer.join(timeout=1.0)  # past a piece it stops; else it waits on
                    self._writer, self.error = None, None
            self._wait_writer(raise_error=raise_error)
        finally:
            if self._dcp_prepared is not None:
                self._dcp_prepared.join()
                self._dcp_prepared = None
            self._shard_writer = None  # its pinned staging memory goes with it
            if stopped:  # the process ends now: its pinned pages are unpinned faster here
                self.staging.release()
            if self._emptying is not None and not stopped:
                self._emptying.join()  # a normal end leaves no trash (a stop: the next start)
                self._emptying = None
