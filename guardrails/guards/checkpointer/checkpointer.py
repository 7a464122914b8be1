"""SignalCheckpointer: pre-emption, Ctrl+C and periodic saves that lose nothing, and the
resume that reads them back.

It replaces the usual emergency recovery: a job killed by the scheduler with 30 s
notice, a checkpoint from three hours ago, and a resumed run that reshuffles its data.
What it does, and where the cost goes:

* **Signals set a flag, nothing else.** SIGTERM (torchrun, Kubernetes, SLURM at the
  end), SIGINT (Ctrl+C) and SIGUSR1 (SLURM's ``--signal`` warning) only record which
  signal came: a handler runs between two bytecodes of whatever the main thread was
  doing, so I/O or a collective there could deadlock. A second Ctrl+C raises
  ``KeyboardInterrupt`` at once (a save in progress is abandoned; its temp directory
  never becomes a checkpoint). The previous handlers are restored on close.
* **Ranks agree on the stopping step.** A signal may reach one rank only (a node
  drained, a ``kill`` by hand). Every ~``agree_every_s`` seconds of training, at a
  step counted the same on every rank, the first rank to get there writes the
  decision for that step under the step's key (``compare_set``: a signal, "a timed
  save is due", the steps until the next check, so the interval adapts to the step
  time identically everywhere) and every other rank reads the same one; a rank that
  gets a signal writes "stop" as the decision of the first check not decided yet (and
  of the close), so the others stop there with it. One store call per rank, no
  collective: the cost does not grow with the number of ranks (a gloo all-reduce over
  the side group took 6 ms at 2 ranks and 53 ms at 32, on the main thread), and a rank
  that closes while another still trains waits for nobody. The period stretches with
  N (``distributed/store.py``'s ``stretched``). A single-process run reads its flag
  every step instead (an attribute read).
* **Saves happen at a step boundary** (:meth:`~guardrails.Component.on_boundary`: the
  last step's loop body is done, scheduler stepped, next batch not yet fetched), the
  one point where model, optimizer, scheduler, RNG and data position agree, so a
  resumed run is bitwise the run that was never interrupted (tested).
* **Periodic saves block only for staging**: tensors are copied off the live objects
  (device to pinned host memory, one sync), then a writer thread serialises, fsyncs
  and commits while training goes on. The next save waits for the previous one; a
  writer error is raised in the main thread at the next step boundary. Sharded state
  (FSDP2): the same, written in DCP's format (``sharded.ShardWriter``). The signal
  save is synchronous (the process is about to exit); a periodic save still being
  written when it comes is abandoned within a piece (its files go a piece at a time).
* **Grace period**: torchrun and SLURM send SIGKILL 30 s after SIGTERM. A save (staging
  + write + commit) over 80% of ``grace_s`` is a warning at that save, long before it.
* **Multi-rank commit**: every rank writes its own files (RNG streams, data position)
  into one temp directory (``run_dir`` must be on a disk every rank sees), publishes
  their sizes and checksums through the side store, and rank 0 writes the manifest and
  renames: one atomic commit for the whole job (see ``checkpoint/commit.py``).
* **A save that cannot be written** (a full disk, a read-only remount, permissions) is
  a :class:`~guardrails.CheckpointError` naming the cause and the fix; then:

  - a periodic save: a warning (``checkpoint_failed``, at most every 10 min while saves
    keep failing) and training goes on, the previous checkpoint the latest, the next
    save a retry: stopping would throw away every step since that checkpoint, and the
    cause is most often transient (a full disk, a quota, a network file system). But
    with no checkpoint to fall back on, a run_dir that takes none at all (read-only,
    no permission, a file in the way) is a setup mistake, raised at the first save;
  - the save at a normal end and ``g.save_checkpoint()``: raised (nothing retries it);
  - the signal save, whatever made it fail (a value in ``g.state`` no checkpoint
    stores too): the process still exits ``128 + signum`` (143 for SIGTERM), saying
    that nothing new was saved and which checkpoint is the latest, no traceback.
* **Runs kept apart**: every checkpoint carries this run's id (new for a fresh start,
  the resumed one's after a resume): retention counts only this run's checkpoints.
* **Resume** (``resume="auto"``): the newest valid checkpoint of the run that saved
  last, in ``run_dir/checkpoints`` or the node-local tier (``local.py``), picked by
  rank 0, restores model, optimizer, scheduler, scaler, ``g.state``, ``g.step``, every
  RNG, the components' own statistics and the data position.

How it is built: the component keeps the hooks and decides when to save and when to
stop; the work is done by objects it owns, each with its inputs given when it is built
and its own state: :class:`~.signals.SignalCapture` (the handlers and the watcher
thread), :class:`~.writer.CheckpointWriter` (staging, the writer thread, the commit),
:class:`~.resume.ResumeAtStart` (the checkpoint to continue from, checked and applied)
and, with several ranks, :class:`~.agree.Agreement` (the stop and timed-save
decisions). A periodic save: :meth:`SignalCheckpointer.on_boundary` ->
:meth:`CheckpointWriter.save` (stage) -> ``_write`` (files, commit, report), in the
writer thread. A SIGTERM: ``SignalCapture._on_signal`` sets a flag -> ``after_step``
(the ranks agree on the step) -> ``on_boundary`` -> ``_stop`` ->
:meth:`CheckpointWriter.save` with ``final_save`` -> the exit.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import TYPE_CHECKING, Any

from guardrails._errors import CheckpointError
from guardrails.checkpoint import commit, stage, tier
from guardrails.engine import model, process
from guardrails.engine.component import Component
from guardrails.engine.config import configure
from guardrails.guards.checkpointer import cadence, partner, workers
from guardrails.guards.checkpointer.agree import Agreement
from guardrails.guards.checkpointer.failure import FailureSave
from guardrails.guards.checkpointer.local import build_tier
from guardrails.guards.checkpointer.peer import PeerSlot
from guardrails.guards.checkpointer.resume import ResumeAtStart
from guardrails.guards.checkpointer.signals import SignalCapture
from guardrails.guards.checkpointer.unsaved import Unsaved
from guardrails.guards.checkpointer.workers import LoaderStop, WorkerShield
from guardrails.guards.checkpointer.writer import CheckpointWriter, agree_token
from guardrails.util.checks import config_dict, path_like, positive_int

log = logging.getLogger("guardrails.checkpoint")

if TYPE_CHECKING:
    from guardrails.engine.guard import Guard

#: The signals that mean "save and stop" by default (SIGUSR1 where the OS has it).
DEFAULT_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1")


class SignalCheckpointer(Component):
    """Checkpoints on SIGTERM / SIGINT / SIGUSR1 and every N steps or seconds, agreed on
    by every rank, and the resume that continues exactly. Knobs:
    :class:`SignalCheckpointer.Config` (``guardrails.guard(checkpoint=...)``)."""

    @dataclass(kw_only=True)
    class Config:
        """SignalCheckpointer's knobs.

        Attributes:
            every_n_steps: save after every this many optimizer steps (``None``:
                never). Training blocks only to copy the state off the GPU; a thread
                writes it.
            every_s: save when this many seconds have passed since the last save, at a
                step every rank agrees on (``None``: never).
            keep_last: keep the newest this many checkpoints of this run (``None``:
                all); another run's, in the same directory, are never counted or
                deleted. Default 3.
            save_on_signal: on SIGTERM, SIGINT (Ctrl+C) or SIGUSR1 (see ``signals``),
                every rank stops at the same step, saves a complete checkpoint and
                exits (see ``exit_on_signal``). A second Ctrl+C exits at once. The first
                signal decides the exit code and message (a Ctrl+C during a SIGTERM's
                save is noted, the save goes on; a second one ends it, as 143). Default
                True.
            signals: the signal names that trigger save-and-stop with
                ``save_on_signal``. Default SIGTERM, SIGINT, SIGUSR1.
            exit_on_signal: after the signal save, raise ``SystemExit(128 + signum)``
                (the shell's "terminated by signal" code; the checkpoint is complete).
                ``False``: end the loop instead (``for batch in g`` stops;
                ``g.stopping`` says why).
            grace_s: the launcher's time between SIGTERM and SIGKILL (30 s for torchrun
                and SLURM's default); a save slower than 80% of it is reported at once.
            background: periodic saves write in a thread (blocking only for staging).
            resume: ``"auto"`` (default): if the checkpoint directory holds a
                checkpoint, continue from the newest valid one (of the run that saved
                last, when ``resume=None`` started another beside it) before the first batch
                (model, optimizer, scheduler, scaler, ``g.state``, ``g.step``, every RNG,
                the data position: bitwise the run that was never interrupted); a path:
                that checkpoint (or the newest under it), which must exist; ``None``:
                start fresh. A checkpoint that does not fit raises
                :class:`~guardrails.ResumeError`. ``guard(resume=...)`` sets it. The
                resume is said on the console (rank 0): the checkpoint, its step and
                age, and whether the run that saved it had finished (ended normally):
                then the run continues past its end, and one that ends without
                training a step says so with a warning (``nothing_trained``). An
                optimizer setting (``lr``, ``betas``, ``weight_decay``...) that differs
                from the one the checkpoint's run was built with is a warning
                (``optimizer_settings_changed``): the resume restores the checkpoint's.
            allow_world_size_change: resume a checkpoint written by a different number
                of ranks (replicated state only; see :func:`guardrails.resume`).
            run_config: the run's settings (a dict, ``vars(args)``, a dataclass), saved
                in every checkpoint; ``guard(config=...)`` sets it. A resume from a
                checkpoint saved with another ``run_config`` raises
                :class:`~guardrails.ResumeError` naming each changed key (its
                ``changed``: key -> (saved, given)), before anything is restored: the
                same command re-run after a settings change would otherwise continue
                the old run. Checkpoints saved without one are not compared.
            allow_config_change: resume even when ``run_config`` differs from the
                checkpoint's (you changed a setting and mean to continue that run with
                it; the resume line names the changed keys): ``True`` for any key, or
                the keys that may change (``["num_workers", "log_every"]``: settings
                that do not change what is trained; a key covers the keys nested
                under it). Default False.
            directory: where checkpoints go; default ``run_dir/checkpoints``.
            agree_every_s: target seconds between the ranks' agreements (multi-rank
                only). Default 1; longer from 2,500 ranks on (N / 2,500 s), so that
                the agreements' store calls stay within a fixed share of the store.
            strict_cadence: a periodic save that comes due while the previous one is
                still being written (on any rank) waits for it, stalling training.
                Default False: it is skipped (``every_n_steps``) or delayed
                until the writer is done (``every_s``), with an event that
                says so, and training goes on.
            save_on_failure: a run ending on an error (an exception, a NaN streak, a
                desync, a hang, a peer's death) saves the last finished step first, if
                no ``optimizer.step()`` had begun since (``failure.py``; the
                ``failure_saved`` event says what). Default True.
            failure_save_timeout_s: each rank's limit on that save (default 20: torchrun
                SIGKILLs the other workers 30 s after one exits).
            local_directory: a node-local directory (``/dev/shm/<run>``, a local NVMe):
                saves commit there, then are copied to ``directory`` (``tier.py``).
            local_keep_last: the copies the local directory keeps. Default 1.
        """

        every_n_steps: int | None = None
        every_s: float | None = None
        keep_last: int | None = 3
        save_on_signal: bool = True
        signals: tuple[str, ...] = DEFAULT_SIGNALS
        exit_on_signal: bool = True
        grace_s: float = 30.0
        background: bool = True
        resume: str | PathLike[str] | None = "auto"
        allow_world_size_change: bool = False
        run_config: Mapping[str, Any] | None = None
        allow_config_change: bool | Sequence[str] = False
        directory: str | PathLike[str] | None = None
        agree_every_s: float = 1.0
        strict_cadence: bool = False
        save_on_failure: bool = True
        failure_save_timeout_s: float = 20.0
        local_directory: str | PathLike[str] | None = None
        local_keep_last: int = 1

        def __post_init__(self) -> None:
            if self.every_n_steps is not None:
                positive_int("every_n_steps", self.every_n_steps)
            if self.keep_last is not None:
                positive_int("keep_last", self.keep_last)
            for value, what in (
                (self.every_s, "every_s"),
                (self.grace_s, "grace_s"),
                (self.failure_save_timeout_s, "failure_save_timeout_s"),
            ):
                if value is not None and not (isinstance(value, (int, float)) and value > 0):
                    raise ValueError(f"{what} must be a positive number of seconds, got {value!r}")
            agree = self.agree_every_s
            if not (isinstance(agree, (int, float)) and agree > 0):
                raise ValueError(f"agree_every_s must be > 0, got {agree!r}")
            self.agree_every_s = float(agree)
            if isinstance(self.signals, str) or not all(isinstance(s, str) for s in self.signals):
                raise TypeError(
                    "signals takes a list of signal names (['SIGTERM', 'SIGUSR1']), got "
                    f"{type(self.signals).__name__} {self.signals!r}"
                )
            unknown = [
                s for s in self.signals if not isinstance(getattr(signal, s, None), signal.Signals)
            ]
            if unknown and set(unknown) - {"SIGUSR1"}:  # SIGUSR1 does not exist on Windows
                raise ValueError(f"unknown signal name(s) {unknown}; use e.g. 'SIGTERM', 'SIGINT'")
            self.signals = tuple(s for s in self.signals if s not in unknown)
            if not self.save_on_signal:
                self.signals = ()
            if self.resume is not None and (
                isinstance(self.resume, bool) or not isinstance(self.resume, (str, PathLike))
            ):
                raise TypeError(
                    "resume takes 'auto', a path (str or pathlib.Path) or None, got "
                    f"{type(self.resume).__name__} {self.resume!r}"
                )
            if not isinstance(self.allow_world_size_change, bool):
                raise TypeError(
                    "allow_world_size_change takes True or False, got "
                    f"{self.allow_world_size_change!r}"
                )
            allow = self.allow_config_change
            if not isinstance(allow, bool):
                if (
                    not isinstance(allow, Iterable)
                    or isinstance(allow, str)
                    or not all(isinstance(k, str) for k in allow)
                ):
                    raise TypeError(
                        "allow_config_change takes True, False or a list of config keys "
                        f"(['num_workers']), got {allow!r}"
                    )
                self.allow_config_change = tuple(allow)
            self.run_config = config_dict(self.run_config)
            if self.directory is not None:
                path_like("directory", self.directory)
                self.directory = Path(self.directory)
            self.local_directory = tier.check_knobs(self.local_directory, self.local_keep_last)

        @property
        def does_anything(self) -> bool:
            """Whether it has anything to do (``guard()`` leaves it out if not): a
            signal to handle, a periodic save or a resume to look for."""
            return bool(
                self.signals
                or self.every_n_steps
                or self.every_s
                or self.resume is not None
                or self.save_on_failure
            )

    name = "checkpoint"
    saves_checkpoints = True
    #: Never bypassed by benchmark mode: its saves and stop agreements must happen on
    #: the steps every rank expects them.
    essential = True
    # Last among the defaults: it resumes after the others started (their statistics
    # are restored into them) and closes first (its final save sees them all open).
    after = ("explain", "gc", "memory", "nan", "watchdog", "audit", "telemetry", "preflight")

    def __init__(self, config: SignalCheckpointer.Config | None = None, /, **knobs: Any) -> None:
        configure(self, config, knobs)
        #: Seconds each save took, staging to commit (the grace-period check).
        self.save_times_s: list[float] = []
        #: Seconds each save blocked training (staging; all of it for a sync save).
        self.blocking_times_s: list[float] = []
        #: Periodic saves skipped or delayed because the previous one was still writing.
        self.skipped_saves = 0
        self.root = Path()
        # The parts, each with its own state: the signals (installed at start), the
        # writer and the resume (built at start, when the directory and the ranks are
        # known), the ranks' agreement (multi-rank runs).
        self.capture = SignalCapture(
            signals=self.signals,
            grace_s=self.grace_s,
            latest=self._last_checkpoint,
            stop_decided=lambda: self._stop_at is not None,
        )
        self.writer: CheckpointWriter | None = None
        #: The failure save (failure.py), built at start with ``save_on_failure``.
        self.failure: FailureSave | None = None
        self._peer_slot: PeerSlot | None = None
        self._partner: partner.PartnerLink | None = None
        # Its time limit extends the process's last words when a thread ends it.
        self.abort_s = self.failure_save_timeout_s + 2.0 if self.save_on_failure else 0.0
        self.resumer: ResumeAtStart | None = None
        self._agreement: Agreement | None = None
        # The manifest's "run": the config and optimizer settings as built, the run's id.
        self._run: dict[str, Any] = {}
        # The stop: the step it was decided at, and the signal that decided it.
        self._stop_at: int | None = None
        self._stop_signal = 0
        self._save_due = False
        self._delayed = False  # an every_s save is waiting for the writer (told once)
        self._saves = False  # a signal's or periodic saves can come: staging is planned
        self._replan = False  # ...and planned again at a boundary, until after step 1
        # The stop signals ignored by the loader's workers while the guard runs, and the
        # stop at a boundary when a worker died of the signal all the same.
        self._shield = WorkerShield()
        self._loader_stop = LoaderStop()
        # What the loop keeps that no checkpoint saves (a scheduler, a generator, an
        # EMA, an epoch loop from 0): told at the first step.
        self._unsaved = Unsaved()

    @property
    def last_path(self) -> Path | None:
        """The last committed checkpoint (``None`` until one is)."""
        return None if self.writer is None else self.writer.last_path

    @property
    def failed_saves(self) -> int:
        """Saves that failed to write (a full disk...) while training went on."""
        return 0 if self.writer is None else self.writer.failed_saves

    @property
    def run_id(self) -> str:
        """This run's id, in every checkpoint it saves (a resumed run keeps the id of
        the run it continues): which checkpoints under :attr:`root` are this run's."""
        return str(self._run.get("id", ""))

    # ------------------------------------------------------------------ lifecycle

    def writes_into(self) -> dict[str, Path]:
        """A ``directory`` of its own (outside run_dir) is locked like run_dir: two runs
        sharing one broke each other's saves, and a resume continued whichever run saved
        last (issue 52)."""
        return {} if self.directory is None else {"checkpoint directory": self.directory}

    def on_start(self, guard: Guard) -> None:
        self.root = self.directory or guard.run_dir / "checkpoints"
        self._unsaved.on_start(guard)
        self._run = commit.run_record(self.run_config, guard.optimizers)
        # This run's id, in every checkpoint it saves (rank 0's is the one written); a
        # resume replaces it with the resumed checkpoint's: the same run, continued.
        self._run["id"] = uuid.uuid4().hex[:16]
        if guard.rank == 0 and self.resume is not None:
            # A re-save killed between its renames left the step's old copy aside:
            # back under its name before a resume picks (resume reads it either way).
            with contextlib.suppress(OSError):
                commit.settle_asides(self.root)
        self.writer = self._build_writer(guard)
        if self.save_on_failure:
            self.failure = FailureSave(
                guard, self.writer, self.capture, timeout_s=self.failure_save_timeout_s
            )
            self._peer_slot = self.failure.slot  # published at every boundary (peer.py)
            # ... and sent to a rank on another node (partner.py).
            self._partner = partner.link(guard, self._peer_slot, self.writer.token)
            if self._partner is not None:  # its failure save writes the kept rank's part
                self.failure.keeps = self._partner.keeps
        self.resumer = ResumeAtStart(
            resume=self.resume,
            root=self.root,
            local=self.writer.tier and self.writer.tier.local,
            directory=self.directory,
            allow_world_size_change=self.allow_world_size_change,
            allow_config_change=self.allow_config_change,
        )
        if self.resume is not None:
            resumed = self.resumer.at_start(guard, self._run)
            if resumed is not None:
                self.writer.continue_from(resumed.path, resumed.step, resumed.run_id)
        else:
            periodic = bool(self.every_n_steps or self.every_s)
            self.resumer.warn_beside_checkpoints(guard, periodic=periodic, keep_last=self.keep_last)
        self.writer.last_save_t = time.monotonic()
        agree_store = guard.side_store("agree")
        if agree_store is not None:
            self._agreement = Agreement(agree_store, world_size=guard.world_size, step=guard.step)
        main = threading.current_thread() is threading.main_thread()
        # Saves can come (a signal's, periodic ones): their staging memory is allocated
        # now, in a thread, before the first signal can (then grown after step 1).
        self._saves = bool((self.signals and main) or self.every_n_steps or self.every_s)
        if self._saves:
            self.writer.plan_staging(guard, background_saves=self._background_saves)
        self._replan = self._saves and not self.writer.staging_planned
        if not main:
            if self.signals:
                guard.event(
                    "signals_not_installed",
                    level="warning",
                    message="the guard started outside the main thread, where Python "
                    "cannot install signal handlers: SIGTERM/SIGINT will not save a "
                    "checkpoint. Start the guard in the main thread.",
                )
            return
        self.capture.install(guard, first_fetch=lambda: self._loader_stop.first_fetch(guard))
        if self.signals and guard.loader is not None:
            self._shield.cover(guard.loader, self.capture.installed)

    def _build_writer(self, guard: Guard) -> CheckpointWriter:
        """The writer of this guard's saves: the directory, the ranks, the store they
        commit through, what the checkpoints hold."""
        per_rank: set[str] = set()
        if guard.world_size > 1:
            # A sharded optimizer (ZeroRedundancyOptimizer, or one that reduces the
            # gradients inside its step, like nanochat's: then the ranks' gradients, and
            # so their states, differ) holds a different part on every rank.
            agree = all(model.grads_agree(m) for m in guard.models.values())
            per_rank = {
                name
                for name, opt in guard.optimizers.items()
                if stage.per_rank(opt) is not opt or not agree
            }
        store = guard.side_store("checkpoint")
        return CheckpointWriter(
            root=self.root,
            rank=guard.rank,
            world_size=guard.world_size,
            store=store,
            token=agree_token(store, guard.rank),
            run=self._run,
            contents=commit.contents_of(guard.optimizers, guard.schedulers, per_rank),
            per_rank=per_rank,
            model_sharded=model.is_sharded(model.unwrap(guard.model)),
            keep_last=self.keep_last,
            grace_s=self.grace_s,
            save_times_s=self.save_times_s,
            blocking_times_s=self.blocking_times_s,
            tier=build_tier(guard, self.local_directory, self.local_keep_last, self, store),
        )

    @property
    def _background_saves(self) -> bool:
        """Periodic saves are on, written by the writer thread."""
        return bool((self.every_n_steps or self.every_s) and self.background)

    def _last_checkpoint(self) -> str:
        if self.last_path is not None:
            return f"the last checkpoint is {self.last_path}"
        return "no checkpoint was saved in this run"

    def on_end(self, guard: Guard, exc: BaseException | None) -> None:
        assert self.writer is not None
        try:
            signum = self.capture.received
            if signum and self._stop_at is None and isinstance(exc, Exception):
                self._preempted_then_failed(guard, signum, exc)
            if exc is None and guard.stopping is None:
                self._close_normally(guard)
            elif self.failure is not None and self.failure.wanted(guard, exc, stop=self._stop_at):
                with guard.pause_watchdog("checkpoint"):
                    self.failure.run(guard, exc, from_thread=False)  # type: ignore[arg-type]
        finally:
            outcome = self.failure.outcome if self.failure is not None else None
            self._close_copies(keep=outcome is not None and outcome["path"] is None)
            self.capture.restore()
            self._shield.restore()
            wrote = None if outcome is None or outcome["state"] == "none" else outcome["step"]
            stopped = self._stop_at is not None
            self.writer.close(raise_error=exc is None, stopped=stopped, superseded_at=wrote)

    def on_abort(self, guard: Guard, error: BaseException) -> None:
        """A thread ends the process (a hang verdict, a peer's death) while the main
        thread is stuck: the failure save, from here (``failure.py``)."""
        failure = self.failure
        if failure is not None and failure.wanted(
            guard, error, stop=self._stop_at, from_thread=True
        ):
            failure.run(guard, error, from_thread=True)
        outcome = failure.outcome if failure is not None else None
        self._close_copies(keep=outcome is None or outcome["path"] is None)

    def on_news(self, guard: Guard, error: BaseException) -> None:
        """A peer's death named while this rank closes: a failure save that ran without
        it runs again, from here, if the news changes who commits (``FailureSave.run``)."""
        if self.failure is not None:
            self.failure.take_news(error)
            if self.failure.began:
                self.failure.run(guard, error, from_thread=True)

    def _close_copies(self, *, keep: bool) -> None:
        """This rank's published copy and its partner's mirror, unmapped; removed unless
        ``keep`` (a failure save that committed nothing here leaves them for a later
        committer on this host; ``peer.sweep`` removes what is left)."""
        if self._peer_slot is not None:
            self._peer_slot.close(keep=keep)
        if self._partner is not None:
            self._partner.close(keep=keep)

    def _preempted_then_failed(self, guard: Guard, signum: int, exc: Exception) -> None:
        """The loop failed after a stop signal, before a stop was agreed. A verdict this
        rank had taken before the signal came (a hang another rank diagnosed, then
        torchrun's SIGTERM once a rank exited) is what happened: the signal only ended
        it; a loader whose worker died of the signal at a step boundary is the stop
        (``LoaderStop.fetch_failed``). Otherwise the signal is what happened (a peer
        left, and this rank's collective failed for it): not a "rank 1 died" alarm."""
        if self.capture.verdict_first(guard):
            return
        if self._loader_stop.fetch_failed(guard, exc, self._agreement, grace_s=self.grace_s):
            self._stop_at, self._stop_signal = guard.step, signum
            self._stop(guard, exit_now=False)
            if self.exit_on_signal:
                guard.replace_error(process.stop_exit(128 + signum, guard.stopping or ""))
            return
        # No boundary a stop saves at came, but the state may be the last finished step's
        # (the collective failed before the update): the failure save. torchrun SIGTERMs
        # every rank once one dies: 4 gloo ranks, one SIGKILLed, nothing was saved.
        failure, saved = self.failure, None
        if failure is not None and failure.wanted(guard, exc, stop=None, despite_signal=True):
            with guard.pause_watchdog("checkpoint"):
                failure.run(guard, exc, from_thread=False)
            saved = failure.outcome["path"] if failure.outcome["complete"] else None  # type: ignore[index]
        name = signal.Signals(signum).name
        last = self._last_checkpoint()
        guard.replace_error(workers.teardown_exit(guard.step, signum, exc, saved=saved, last=last))
        if saved is None:
            workers.say_nothing_saved(guard, name, exc, latest=self.writer.latest_text())  # type: ignore[union-attr]

    def _close_normally(self, guard: Guard) -> None:
        """The loop ended without an error or a stop: a signal that came after the last
        agreement still stops every rank (one more decision, the same for every rank
        that closes), else the run's end is saved when it made progress and marked
        finished."""
        writer = self.writer
        assert writer is not None
        if self._agreement is not None:
            self._agree(guard, at="end")
        elif self.capture.signal is not None and self._stop_at is None:
            self._stop_at, self._stop_signal = guard.step, self.capture.signal
        # With periodic saves, or after a resume, the directory is the run's latest
        # state: a later run of the same command must not go back to an older
        # checkpoint (and a finished run resumes as finished).
        resumed = self.resumer is not None and self.resumer.resumed is not None
        keeps = self.every_n_steps or self.every_s or resumed
        # A background save that failed: said like any failed periodic save, and the
        # save below retries it.
        writer.settle(guard, stopping=self._stop_at is not None)
        if self._stop_at is not None:
            self._stop(guard, exit_now=False)
        elif keeps and guard.step != writer.last_saved_step:
            try:
                self._save(guard, background=False)  # progress since the last save
            except CheckpointError as e:  # the end: nothing is left to retry it
                e.rehint(f"{e.hint} Meanwhile {writer.latest_text()}.")
                raise
        if self._stop_at is None:
            self._finish(guard)

    def _finish(self, guard: Guard) -> None:
        """The run ended normally: mark the checkpoint it ended with as finished, or,
        when it resumed a finished run and trained nothing, say so."""
        assert self.writer is not None and self.resumer is not None
        if self.resumer.trained_nothing(guard, self.writer.last_path):
            return
        self.writer.settle(guard)
        self.resumer.mark_finished(guard, self.writer.last_path)

    # ------------------------------------------------------------------ per step

    def after_step(self, guard: Guard) -> None:
        # Per step: a few attribute reads (tests/test_structure.py pins the frames).
        if self._peer_slot is not None:  # several ranks: the part after the update
            self._peer_slot.publish_update(guard)
            if self._partner is not None:
                self._partner.sent()
        if self._agreement is None:
            if self.capture.signal is not None and self._stop_at is None:
                self._stop_at, self._stop_signal = guard.step, self.capture.signal
            if (
                self.every_s is not None
                and time.monotonic() - self.writer.last_save_t >= self.every_s  # type: ignore[union-attr]
            ):
                self._save_due = True
        else:
            agreement, signum = self._agreement, self.capture.signal
            if signum is not None and not agreement.posted:
                agreement.claim_stop(guard, signum)
            if guard.step >= agreement.next_check:
                self._agree(guard, at=str(agreement.next_check))

    def on_rewind(self, guard: Guard, from_step: int) -> None:
        """The run is back at an earlier step on every rank: the agreement's next check
        is the next step, under keys of its own (step numbers repeat); the copy after
        the last update is not this boundary's to check."""
        if self._agreement is not None:
            self._agreement.rewound(guard.step)
        if self._peer_slot is not None:
            self._peer_slot.rewound()

    def _agree(self, guard: Guard, *, at: str) -> None:
        """The ranks' decision at ``at`` (a check step, or ``"end"``): a stop there, a
        timed save due on any rank."""
        assert self._agreement is not None
        due = (
            self.every_s is not None and time.monotonic() - self.writer.last_save_t >= self.every_s  # type: ignore[union-attr]
        )
        decision = self._agreement.decide(
            guard,
            at=at,
            signum=self.capture.signal,
            save_due=due,
            agree_every_s=self.agree_every_s,
        )
        if decision.signum and self._stop_at is None:
            self._stop_at, self._stop_signal = guard.step, decision.signum
        self._save_due = self._save_due or decision.save_due

    def on_boundary(self, guard: Guard) -> None:
        if self._peer_slot is not None:
            self._peer_slot.publish(guard)
            if self._partner is not None:
                self._partner.sent()
        if not self._unsaved.checked:
            self._unsaved.at_step(guard)
        # Where a loader failing on the next fetch leaves the run (inline: every step).
        self._loader_stop.mark = (
            guard.step,
            guard.epoch,
            guard.batch_in_epoch,
            len(guard.step_calls),
        )
        capture, agreement, grace_s = self.capture, self._agreement, self.grace_s
        signum = capture.signal or capture.watched
        if signum and self._stop_at is None:
            if capture.children_held and self._loader_stop.died_in_step(
                guard, capture.replay_child_deaths, agreement, grace_s=grace_s
            ):
                self._stop_at, self._stop_signal = guard.step, signum  # its loader died
            elif agreement is None and capture.signal is not None:
                self._stop_at, self._stop_signal = guard.step, capture.signal  # alone: stop now
            elif agreement is not None and self._loader_stop.peer_died(
                guard, agreement, grace_s=grace_s
            ):
                self._stop_at, self._stop_signal = guard.step, signum  # a peer's loader died
        if self.writer.error is not None:  # type: ignore[union-attr]  # built at start
            self.writer.settle(guard, stopping=self._stop_at is not None)  # type: ignore[union-attr]
        if self._stop_at is not None:
            self._stop(guard)
            return
        by_steps = (
            self.every_n_steps is not None
            and guard.step % self.every_n_steps == 0
            and guard.step != self.writer.last_saved_step  # type: ignore[union-attr]
        )
        if self._save_due or by_steps:
            self._save_due = False
            if self._still_writing(guard):
                self._skip(guard, delayed=not by_steps)
            else:
                self._delayed = False
                try:
                    self._save(guard, background=self.background)
                except CheckpointError as e:  # the disk: training goes on (see the docstring)
                    self.writer.failed(guard, e)  # type: ignore[union-attr]
        elif self._replan:  # once the optimizer's state exists (after step 1)
            self.writer.plan_staging(  # type: ignore[union-attr]
                guard, background_saves=self._background_saves
            )
            self._replan = not self.writer.staging_planned  # type: ignore[union-attr]

    def _still_writing(self, guard: Guard) -> bool:
        """Whether the previous background save is still being written on any rank."""
        if self.strict_cadence or not self.background:
            return False
        return cadence.still_writing(guard, busy=self.writer.busy)  # type: ignore[union-attr]

    def _skip(self, guard: Guard, *, delayed: bool) -> None:
        """A periodic save came due while the previous one is still writing: training
        goes on (waiting would stall every rank for the rest of the write)."""
        if delayed and self._delayed:
            return  # an every_s save waiting for the writer: said once
        assert self.writer is not None
        self._delayed = delayed
        self.skipped_saves += 1
        cadence.say_skipped(
            guard,
            writing=self.writer.last_saved_step,
            for_s=time.monotonic() - self.writer.last_save_t,
            delayed=delayed,
            first=self.skipped_saves == 1,
        )

    # ------------------------------------------------------------------ the stop

    def _stop(self, guard: Guard, *, exit_now: bool = True) -> None:
        """Every rank stops at this step: the stop's save, what it says, the exit."""
        name = signal.Signals(self._stop_signal).name
        path, message = self._stop_save(guard, name)
        guard.event(
            "stopped",
            level="warning",
            message=message,
            signal=name,
            path=None if path is None else str(path),
            saved=path is not None,
        )
        # Said again by torchrun (the error file @guardrails.record writes) as why the
        # rank exited non-zero, instead of "To enable traceback see ...".
        reason = f"pre-empted by {name} at step {guard.step}: {message}"
        if not self.exit_on_signal:
            guard.request_stop(reason)
            return
        # Closing already: the engine exits with it once all is closed; else it is the
        # code of the exit raised here (and of a close at the interpreter's exit).
        guard.request_stop(reason, exit_code=128 + self._stop_signal)
        if exit_now:
            raise process.stop_exit(128 + self._stop_signal, reason)

    def _stop_save(self, guard: Guard, name: str) -> tuple[Path | None, str]:
        """The stop's save (synchronous): its directory (``None``: nothing new was
        saved), and what the stop says of it."""
        assert self.writer is not None
        where = "this rank" if self.capture.signal == self._stop_signal else "another rank"
        # The old checkpoints beyond keep_last are only renamed away here: deleting them
        # is left to the next run's first save, not to the grace period.
        try:
            path: Path | None = self._save(guard, background=False, final_save=True)
        except Exception as e:
            # Still a stop by the signal (128 + signum), whatever failed (the disk, or
            # a value in g.state no checkpoint stores), said in one message and no
            # traceback: the launcher SIGKILLs the process soon anyway, and a resume
            # needs to know which checkpoint it gets.
            path = None
            if isinstance(e, CheckpointError):
                cause, fix = e.message, e.hint
            else:
                log.debug("guardrails: the stop's save failed", exc_info=True)
                cause = f"{type(e).__name__}: {e}"
                fix = "change what the error names (it says how), then run the same command."
            message = (
                f"{name} received by {where}; all {guard.world_size} rank(s) stopped at "
                f"step {guard.step}, but nothing new was saved ({cause}); "
                f"{self.writer.latest_text()}. Fix: {fix}"
            )
        else:
            message = (
                f"{name} received by {where}; all {guard.world_size} rank(s) stopped at step "
                f"{guard.step} and saved {path}. To resume, run the same command: "
                "guard(..., resume='auto') continues from it."
            )
        if self._loader_stop.cause is not None:
            message += (
                f" A DataLoader worker had died of the signal ({self._loader_stop.cause}): the "
                "checkpoint is the step boundary the loader failed at."
            )
        if self.capture.late_sigints:
            message += (
                f" A SIGINT (Ctrl+C) came after the {name} and did not change the exit "
                f"code ({128 + self._stop_signal}); a second one ends the process at once."
            )
        return path, message

    # ------------------------------------------------------------------ saving

    def save(self, guard: Guard) -> Path:
        """Save now, synchronously (every rank must call it at the same step boundary);
        returns the committed directory."""
        assert self.writer is not None
        try:
            return self._save(guard, background=False)
        except CheckpointError as e:
            e.rehint(f"{e.hint} Meanwhile {self.writer.latest_text()}.")
            raise

    def _save(self, guard: Guard, *, background: bool, final_save: bool = False) -> Path:
        """One save, by the writer: what the loop keeps that no checkpoint saves is said
        first (at the first step; a save before it: here)."""
        assert self.writer is not None
        self._unsaved.at_step(guard)
        return self.writer.save(guard, background=background, final_save=final_save)
