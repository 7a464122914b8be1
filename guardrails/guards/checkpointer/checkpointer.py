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
  (FSDP2) is staged into pinned memory the same way and written in DCP's format by the
  writer thread (``sharded.ShardWriter``). The signal save is synchronous (the
  process is about to exit), and a periodic save still being written when it comes
  is abandoned: its files go to disk a piece at a time, so it stops within a piece.
* **Grace period**: torchrun and SLURM send SIGKILL 30 s after SIGTERM. Every save is
  timed; when one (staging + write + commit) takes more than 80% of ``grace_s`` a
  warning event says so at that save, long before the pre-emption that would lose it.
* **Multi-rank commit**: every rank writes its own files (RNG streams, data position)
  into one temp directory (``run_dir`` must be on a disk every rank sees), publishes
  their sizes and checksums through the side store, and rank 0 writes the manifest and
  renames: one atomic commit for the whole job (see ``checkpoint/commit.py``).
* **A save that cannot be written** (a full disk, a read-only remount, permissions) is
  a :class:`~guardrails.CheckpointError` naming the cause and the fix; what happens
  then depends on what it would cost:

  - a periodic save: a warning (``checkpoint_failed``, repeated at most every 10 min
    while saves keep failing) and training goes on; the previous checkpoint stays the
    latest and the next periodic save retries. Stopping would throw away every step
    since that checkpoint, which continuing keeps, and the cause is most often
    transient (another job filled the disk, a quota, a network file system's hiccup).
    Except when this run has no checkpoint to fall back on: then a run_dir that takes
    no checkpoint at all (read-only, no permission, a file in the way) is a setup
    mistake, raised at the first save rather than found hours later;
  - the save at a normal end (progress since the last save) and ``g.save_checkpoint()``:
    raised (nothing is left to retry it);
  - the signal save, whatever made it fail (a value in ``g.state`` that no checkpoint
    stores too): the process still exits ``128 + signum`` (143 for SIGTERM), with
    one message saying that nothing new was saved and which checkpoint (path, step) is
    the latest, and no traceback: the launcher is about to SIGKILL it anyway.
* **Runs kept apart**: every checkpoint carries this run's id (new for a fresh start,
  the resumed checkpoint's after a resume). Retention counts only this run's
  checkpoints, and ``resume="auto"`` continues the run that saved last.
* **Resume** (``resume="auto"``): at start, the newest valid checkpoint under
  ``run_dir/checkpoints`` (rank 0 picks and verifies it; every rank loads the same one)
  restores model, optimizer, scheduler, scaler, ``g.state``, ``g.step``, every RNG,
  the components' own statistics and the data position.
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

import torch
import torch.distributed as dist

from guardrails._errors import CheckpointError
from guardrails.checkpoint import commit, sharded, stage
from guardrails.distributed import store as _store
from guardrails.engine import model, process
from guardrails.engine.component import Component
from guardrails.engine.config import configure
from guardrails.guards.checkpointer.resume import ResumeAtStart
from guardrails.guards.checkpointer.signals import SignalCapture
from guardrails.guards.checkpointer.unsaved import Unsaved
from guardrails.guards.checkpointer.workers import LoaderStop, WorkerShield, worker_died
from guardrails.guards.checkpointer.writer import CheckpointWriter
from guardrails.util.checks import config_dict, path_like, positive_int

log = logging.getLogger("guardrails.checkpoint")

if TYPE_CHECKING:
    from guardrails.engine.guard import Guard

#: The signals that mean "save and stop" by default (SIGUSR1 where the OS has it).
DEFAULT_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1")


class SignalCheckpointer(ResumeAtStart, CheckpointWriter, SignalCapture, LoaderStop, Component):
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

        def __post_init__(self) -> None:
            if self.every_n_steps is not None:
                positive_int("every_n_steps", self.every_n_steps)
            if self.keep_last is not None:
                positive_int("keep_last", self.keep_last)
            for value, what in ((self.every_s, "every_s"), (self.grace_s, "grace_s")):
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

        @property
        def does_anything(self) -> bool:
            """Whether it has anything to do (``guard()`` leaves it out if not): a
            signal to handle, a periodic save or a resume to look for."""
            return bool(
                self.signals or self.every_n_steps or self.every_s or self.resume is not None
            )

    name = "checkpoint"
    saves_checkpoints = True
    #: Never bypassed by benchmark mode: its saves and stop agreements must happen on
    #: the steps every rank expects them.
    essential = True
    # Last among the defaults: it resumes after the others started (their statistics
    # are restored into them) and it closes first (its final save sees every
    # component open).
    after = ("explain", "gc", "memory", "nan", "watchdog", "audit", "telemetry", "preflight")

    def __init__(self, config: SignalCheckpointer.Config | None = None, /, **knobs: Any) -> None:
        configure(self, config, knobs)

        #: The last committed checkpoint (``None`` until one is).
        self.last_path: Path | None = None
        #: Seconds each save took, staging to commit (the grace-period check).
        self.save_times_s: list[float] = []
        #: Seconds each save blocked training (staging; all of it for a sync save).
        self.blocking_times_s: list[float] = []
        self._signal: int | None = None  # set by the handler: the only thing it does
        # SIGINTs after a first signal of another kind (signals.py: the first decides).
        self._late_sigints = 0
        # The last save's sequence number in the checkpoint directory (writer.py).
        self._seq: int | None = None
        # When the first stop signal came (time.monotonic()), by the handler or the watcher.
        self._signal_at: float | None = None
        self._previous: dict[int, Any] = {}
        self._wakeup: tuple[int, int] | None = None  # (read, write) ends of the wakeup fd
        self._previous_wakeup = -1
        self._watcher: threading.Thread | None = None
        self._watched_signal: int | None = None  # what the watcher thread saw
        # The stop signals ignored by the loader's workers while the guard runs, and what
        # the stop says when a worker died of the signal before the ranks stopped.
        self._shield = WorkerShield()
        self._dead_loader: str | None = None
        # (step, epoch, batch_in_epoch, training forwards) at the last step boundary.
        self._boundary_mark: tuple[int, int, int, int] | None = None
        self._stop_at: int | None = None
        self._stop_signal = 0
        self._save_due = False
        self._last_saved_step = -1
        # The step of the last committed (or resumed) checkpoint: _last_saved_step goes
        # back to it when a save fails, so the next save (or the one at the end) retries.
        self._committed_step = -1
        #: Saves that failed to write (a full disk...) while training went on.
        self.failed_saves = 0
        self._failed_warned_t = -float("inf")
        # Retention also counts checkpoints without a run id (this run resumed one).
        self._adopt_unlabelled = False
        self._last_save_t = 0.0
        self._warned_grace = False
        # What the loop keeps that no checkpoint saves (a scheduler, a generator, an
        # EMA, an epoch loop from 0): told at the first step.
        self._unsaved = Unsaved()
        self._writer: threading.Thread | None = None
        self._writer_error: BaseException | None = None
        self._writing: tuple[int, stage.Part] | None = None  # (step, its part)
        self._next_check = 1
        self._check_t = 0.0
        self._check_step = 0
        self._agree_store: Any = None  # guard.side_store("agree") when multi-rank
        self._signal_posted = False  # this rank's signal is in the decisions
        self._token = ""
        self._rewinds = 0  # rewinds this run (the rewind guard): the agreement's keys
        self._resumed = False
        # What the manifest's "run" records (the config and the optimizer settings as
        # the code built them), taken at start before a resume overwrites them.
        self._run: dict[str, Any] = {}
        self._resumed_step = -1
        self._resumed_finished: float | None = None  # when the resumed run had finished
        self.root = Path()
        # The writer of every sharded save (None for a model that is not sharded),
        # kept so its pinned staging and save plan are reused, and the thread
        # allocating that staging ahead of the first background save.
        self._shard_writer: sharded.ShardWriter | None = None
        #: Deleting retired checkpoints (``.trash-*``) off the writer's path.
        self._emptying: threading.Thread | None = None
        self._dcp_prepared: threading.Thread | None = None
        self._dcp_stats: dict[str, Any] = {}  # its timings, told in checkpoint events
        # Optimizers whose state differs per rank: every rank saves its own part.
        self._per_rank: set[str] = set()
        self._contents: dict[str, Any] = {}
        # The host blocks every save stages into (pinned on a CUDA machine; allocated
        # ahead of the first save, at start and after step 1: see _plan_staging).
        self._staging = stage.Staging()
        self._staging_planned = False
        self._saves = False  # a signal's or periodic saves can come: staging is planned
        #: Periodic saves skipped or delayed because the previous one was still writing.
        self.skipped_saves = 0
        self._delayed = False  # an every_s save is waiting for the writer (told once)

    # ------------------------------------------------------------------ lifecycle

    def on_start(self, guard: Guard) -> None:
        self.root = self.directory or guard.run_dir / "checkpoints"
        if guard.world_size > 1:
            # A sharded optimizer (ZeroRedundancyOptimizer, or one that reduces the
            # gradients inside its step, like nanochat's: then the ranks' gradients, and
            # so their states, differ) holds a different part on every rank.
            agree = all(model.grads_agree(m) for m in guard.models.values())
            self._per_rank = {
                name
                for name, opt in guard.optimizers.items()
                if stage.per_rank(opt) is not opt or not agree
            }
        self._contents = commit.contents_of(guard.optimizers, guard.schedulers, self._per_rank)
        self._unsaved.on_start(guard)
        self._run = commit.run_record(self.run_config, guard.optimizers)
        self._token = self._agree_token(guard)
        # This run's id, in every checkpoint it saves (rank 0's is the one written); a
        # resume replaces it with the resumed checkpoint's: the same run, continued.
        self._run["id"] = uuid.uuid4().hex[:16]
        if guard.rank == 0 and self.resume is not None:
            # A re-save killed between its renames left the step's old copy aside:
            # back under its name before a resume picks (resume reads it either way).
            with contextlib.suppress(OSError):
                commit.settle_asides(self.root)
        if guard.rank == 0:  # what a stop left in the trash (the save it abandoned...)
            self._emptying = commit.empty_trash(self.root)
        if self.resume is not None:
            self._resume(guard)
        else:
            self._warn_beside_checkpoints(guard)
        self._last_save_t = self._check_t = time.monotonic()
        self._check_step = guard.step
        self._next_check = guard.step + 1
        self._agree_store = guard.side_store("agree")
        self._signal_posted = False
        if model.is_sharded(model.unwrap(guard.model)):
            self._shard_writer = sharded.ShardWriter()  # no memory until it stages
        main = threading.current_thread() is threading.main_thread()
        # Saves can come (a signal's, periodic ones): their staging memory is allocated
        # now, in a thread, before the first signal can (then grown after step 1).
        self._saves = bool((self.signals and main) or self.every_n_steps or self.every_s)
        if self._saves:
            self._plan_staging(guard)
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
        for name in self.signals:
            num = getattr(signal, name)
            self._previous[num] = signal.signal(num, self._on_signal)
        if self.signals:
            self._watch_signals(guard)
            if guard.loader is not None:
                self._shield.cover(guard.loader, tuple(self._previous))

    @property
    def run_id(self) -> str:
        """This run's id, in every checkpoint it saves (a resumed run keeps the id of
        the run it continues): which checkpoints under :attr:`root` are this run's."""
        return str(self._run.get("id", ""))

    def _last_checkpoint(self) -> str:
        if self.last_path is not None:
            return f"the last checkpoint is {self.last_path}"
        return "no checkpoint was saved in this run"

    def on_end(self, guard: Guard, exc: BaseException | None) -> None:
        try:
            signum = self._signal or self._watched_signal
            # A verdict this rank had taken before the signal came (a hang another rank
            # diagnosed, then torchrun's SIGTERM once a rank exited) is what happened:
            # the signal only ended it.
            preempted = signum and self._stop_at is None and isinstance(exc, Exception)
            if (
                preempted
                and not self._verdict_first(guard)
                and not self._stop_at_dead_loader(guard, signum, exc)
            ):
                # Pre-empted before a stop could be agreed, then failed: under a
                # launcher's SIGTERM to every rank, a peer that could not save left,
                # and this rank's collective failed for it. The signal is what
                # happened; a "rank 1 died" report would be a false alarm.
                name = signal.Signals(signum).name
                guard.replace_error(
                    process.stop_exit(
                        128 + signum,
                        f"{name} received at step {guard.step}; before the ranks could "
                        f"agree to stop and save, this rank failed with "
                        f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                        f" (another rank ending on the same signal): exited without a "
                        f"checkpoint; {self._last_checkpoint()}.",
                    )
                )
                self._say_nothing_saved(guard, name, exc)
            if exc is None and guard.stopping is None:
                if self._agree_store is not None:
                    # A signal that came after the last agreement must still stop every
                    # rank: one more decision, the same for every rank that closes.
                    self._agree(guard, at="end")
                elif self._signal is not None and self._stop_at is None:
                    self._stop_at, self._stop_signal = guard.step, self._signal
                # With periodic saves, or after a resume, the directory is the run's
                # latest state: a later run of the same command must not go back to an
                # older checkpoint (and a finished run resumes as finished).
                keeps = self.every_n_steps or self.every_s or self._resumed
                # A background save that failed: said like any failed periodic save, and
                # the save below retries it.
                self._settle_writer(guard, stopping=self._stop_at is not None)
                if self._stop_at is not None:
                    self._stop(guard, exit_now=False)
                elif keeps and guard.step != self._last_saved_step:
                    try:
                        self._save(guard, background=False)  # progress since the last save
                    except CheckpointError as e:  # the end: nothing is left to retry it
                        e.rehint(f"{e.hint} Meanwhile {self._latest_text()}.")
                        raise
                if self._stop_at is None:
                    self._finish(guard)
        finally:
            self._restore_handlers()
            self._shield.restore()
            try:
                self._wait_writer(raise_error=exc is None)
            finally:
                if self._dcp_prepared is not None:
                    self._dcp_prepared.join()
                    self._dcp_prepared = None
                self._shard_writer = None  # its pinned staging memory goes with it
                if self._emptying is not None and self._stop_at is None:
                    self._emptying.join()  # a normal end leaves no trash (a stop: the next start)
                    self._emptying = None

    def _say_nothing_saved(self, guard: Guard, name: str, exc: BaseException) -> None:
        """A signal's stop that ended without a checkpoint, said on the console (a
        warning event: stderr), with why and what to do: a re-run must not start over
        from step 0 (or an old checkpoint) without a word."""
        first = str(exc).splitlines()[0] if str(exc) else ""
        if worker_died(exc):
            why = (
                "a DataLoader worker died of the signal before the rank reached a step "
                "boundary. guardrails keeps the workers of the loader it iterates alive "
                "through the stop signals only when they start inside the guard: create the "
                "loader's iterator inside the guard (a persistent_workers iterator made "
                "before it keeps workers that die), or have your other loaders' "
                "worker_init_fn ignore SIGTERM/SIGINT"
            )
        else:
            why = (
                "a peer that could not save left, or this rank failed on its own before a "
                "step boundary; the other ranks' reports say which"
            )
        guard.event(
            "stopped",
            level="warning",
            message=f"{name} received at step {guard.step}, but this rank failed before the "
            f"ranks could stop at a step boundary ({type(exc).__name__}: {first}): NOTHING "
            f"was saved; {self._latest_text()}. Why: {why}. To lose less next time, save "
            "periodically too: guard(checkpoint=dict(every_s=1800)).",
            signal=name,
            path=None,
            saved=False,
        )

    # ------------------------------------------------------------------ per step

    def after_step(self, guard: Guard) -> None:
        if self._agree_store is None:
            if self._signal is not None and self._stop_at is None:
                self._stop_at, self._stop_signal = guard.step, self._signal
            if self.every_s is not None and time.monotonic() - self._last_save_t >= self.every_s:
                self._save_due = True
        else:
            if self._signal is not None and not self._signal_posted:
                self._claim_stop(guard)
            if guard.step >= self._next_check:
                self._agree(guard, at=str(self._next_check))

    def _key(self, at: int | str) -> str:
        """The store key of the decision at check ``at``: after a rewind (the rewind
        guard, at the same step on every rank) step numbers repeat, so the checks of
        each stretch between rewinds have keys of their own."""
        return f"at/{at}" if not self._rewinds or at == "end" else f"at/r{self._rewinds}/{at}"

    def on_rewind(self, guard: Guard, from_step: int) -> None:
        """The run is back at an earlier step on every rank: the next check is the next
        step (not the one scheduled for a step number it would take ``from_step -
        guard.step`` steps more to reach again: a signal must not wait for it), under
        keys of their own (step numbers repeat), and a signal already posted under the
        old keys is posted again."""
        self._rewinds += 1
        self._next_check = guard.step + 1
        self._check_t, self._check_step = time.monotonic(), guard.step
        self._signal_posted = False

    def _claim_stop(self, guard: Guard) -> None:
        """This rank got a signal: write "stop" as the decision of the first check no
        rank has decided yet (the next one, unless a faster rank is already past it),
        and of the close, so every rank stops at the same step, or closes as a stop.
        A few store calls, once."""
        store, mine = self._agree_store, f"{self._signal} 0 1"
        with guard.in_phase("agree"):
            at = self._next_check
            while True:
                decided = bytes(store.compare_set(self._key(at), "", mine)).decode().split()
                if int(decided[0]):  # a stop is decided there (ours, or a peer's)
                    break
                at += int(decided[2])
            store.compare_set("at/end", "", mine)
        self._signal_posted = True

    def _agree(self, guard: Guard, *, at: str) -> None:
        """Decide stop / save and the next check step for every rank at once, at a
        point every rank reaches (``at``: the scheduled step, or ``"end"``): the first
        rank there writes its decision under ``at``'s key, every rank uses the one
        there. One store call per rank, no collective."""
        if self._signal is not None and not self._signal_posted:
            self._claim_stop(guard)
        now = time.monotonic()
        per_step = (now - self._check_t) / max(1, guard.step - self._check_step)
        every = _store.stretched(self.agree_every_s, guard.world_size)
        steps = 1 if per_step <= 0 else min(10_000, max(1, round(every / per_step)))
        due = self.every_s is not None and now - self._last_save_t >= self.every_s
        mine = f"{self._signal or 0} {int(due)} {steps}"
        with guard.in_phase("agree"):
            decided = self._agree_store.compare_set(self._key(at), "", mine)
        signum, due_any, steps = map(int, bytes(decided).decode().split())
        if signum and self._stop_at is None:
            self._stop_at, self._stop_signal = guard.step, signum
        self._save_due = self._save_due or bool(due_any)
        self._check_t, self._check_step = now, guard.step
        self._next_check = guard.step + steps

    def on_boundary(self, guard: Guard) -> None:
        if not self._unsaved.checked:
            self._unsaved.at_step(guard)
        # Where a loader that fails on the next fetch leaves the run (_stop_at_dead_loader).
        self._boundary_mark = (guard.step, guard.epoch, guard.batch_in_epoch, len(guard.step_calls))
        if self._agree_store is None and self._signal is not None and self._stop_at is None:
            self._stop_at, self._stop_signal = guard.step, self._signal  # alone: stop now
        elif self._stop_at is None and (self._signal or self._watched_signal):
            self._dead_loader_at_boundary(guard)  # a peer's loader died here: stop with it
        if self._writer_error is not None:
            self._settle_writer(guard, stopping=self._stop_at is not None)
        if self._stop_at is not None:
            self._stop(guard)
            return
        by_steps = (
            self.every_n_steps is not None
            and guard.step % self.every_n_steps == 0
            and guard.step != self._last_saved_step
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
                    self._save_failed(guard, e)
        elif not self._staging_planned and self._saves:
            self._plan_staging(guard)

    def _still_writing(self, guard: Guard) -> bool:
        """Whether the previous background save is still being written on any rank (the
        ranks must agree: a save is a collective commit). One all-reduce, only at a step
        where a periodic save is due."""
        if self.strict_cadence or not self.background:
            return False
        busy = self._writer is not None and self._writer.is_alive()
        if guard.side_group is None:
            return busy
        flag = torch.tensor([float(busy)])
        with guard.in_phase("agree"):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=guard.side_group)
        return bool(flag[0])

    def _skip(self, guard: Guard, *, delayed: bool) -> None:
        """A periodic save came due while the previous one is still writing: training
        goes on (waiting would stall every rank for the rest of the write)."""
        if delayed and self._delayed:
            return  # an every_s save waiting for the writer: said once
        self._delayed = delayed
        self.skipped_saves += 1
        first = self.skipped_saves == 1
        what = "delayed until it is written" if delayed else "skipped"
        message = (
            f"checkpoint at step {guard.step} {what}: the save of step "
            f"{self._last_saved_step} is still being written "
            f"({time.monotonic() - self._last_save_t:.1f} s so far), and waiting would "
            "stall training."
        )
        if first:
            message += (
                " Saves come due faster than the disk writes them: save less often "
                "(checkpoint_every_n_steps / checkpoint_every_s), write to a faster disk, "
                "or pass guard(checkpoint=dict(strict_cadence=True)) to wait instead."
            )
        guard.event(
            "checkpoint_skipped",
            level="warning" if first else "info",
            message=message,
            step=guard.step,
            writing_step=self._last_saved_step,
            delayed=delayed,
        )

    def _stop(self, guard: Guard, *, exit_now: bool = True) -> None:
        name = signal.Signals(self._stop_signal).name
        mine = self._signal == self._stop_signal
        # The old checkpoints beyond keep_last are only renamed away here: deleting them
        # is left to the next run's first save, not to the grace period.
        where = "this rank" if mine else "another rank"
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
                f"{self._latest_text()}. Fix: {fix}"
            )
        else:
            message = (
                f"{name} received by {where}; all {guard.world_size} rank(s) stopped at step "
                f"{guard.step} and saved {path}. To resume, run the same command: "
                "guard(..., resume='auto') continues from it."
            )
        if self._dead_loader is not None:
            message += (
                f" A DataLoader worker had died of the signal ({self._dead_loader}): the "
                "checkpoint is the step boundary the loader failed at."
            )
        if self._late_sigints:
            message += (
                f" A SIGINT (Ctrl+C) came after the {name} and did not change the exit "
                f"code ({128 + self._stop_signal}); a second one ends the process at once."
            )
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

    # ------------------------------------------------------------------ saving

    def save(self, guard: Guard) -> Path:
        """Save now, synchronously (every rank must call it at the same step boundary);
        returns the committed directory."""
        try:
            return self._save(guard, background=False)
        except CheckpointError as e:
            e.rehint(f"{e.hint} Meanwhile {self._latest_text()}.")
            raise

    # ------------------------------------------------------------------ resume
