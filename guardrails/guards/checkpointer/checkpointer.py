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
  drained, a ``kill`` by hand). Every ~``agree_every_s`` seconds of training, at a step
  counted the same on every rank, the ranks all-reduce (MAX) three numbers over the
  guard's gloo side group: the signal seen, "a timed save is due" and the steps until
  the next check (so the interval adapts to the step time, identically everywhere). A
  gloo all-reduce of 24 bytes costs ~0.1-0.3 ms: at one per second, nothing. A
  single-process run reads its flag every step instead (an attribute read).
* **Saves happen at a step boundary** (:meth:`~guardrails.Component.on_boundary`: the
  last step's loop body is done, scheduler stepped, next batch not yet fetched), the
  one point where model, optimizer, scheduler, RNG and data position agree, so a
  resumed run is bitwise the run that was never interrupted (tested).
* **Periodic saves block only for staging**: tensors are copied off the live objects
  (device to pinned host memory, one sync), then a writer thread serialises, fsyncs
  and commits while training goes on. The next save waits for the previous one; a
  writer error is raised in the main thread at the next step boundary. Sharded state
  (FSDP2) is staged into pinned memory the same way and written in DCP's format by the
  writer thread (``_sharded.ShardWriter``). The signal save is synchronous (the
  process is about to exit), and a periodic save still being written when it comes
  is abandoned: its files go to disk a piece at a time, so it stops within a piece.
* **Grace period**: torchrun and SLURM send SIGKILL 30 s after SIGTERM. Every save is
  timed; when one (staging + write + commit) takes more than 80% of ``grace_s`` a
  warning event says so at that save, long before the pre-emption that would lose it.
* **Multi-rank commit**: every rank writes its own files (RNG streams, data position)
  into one temp directory (``run_dir`` must be on a disk every rank sees), publishes
  their sizes and checksums through the side store, and rank 0 writes the manifest and
  renames: one atomic commit for the whole job (see ``_checkpoint.py``).
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
  - the signal save: the process still exits ``128 + signum`` (143 for SIGTERM), with
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
import json
import logging
import os
import select
import shutil
import signal
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from os import PathLike
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from guardrails import _checkpoint, _data, _digest, _exit, _model, _perms, _sharded, _storage
from guardrails._checks import config_dict, positive_int
from guardrails._component import Component
from guardrails._config import configure
from guardrails._errors import CheckpointError, GuardrailsError, ResumeError
from guardrails._events import to_console

log = logging.getLogger("guardrails.checkpoint")

if TYPE_CHECKING:
    from guardrails._guard import Guard

#: The signals that mean "save and stop" by default (SIGUSR1 where the OS has it).
DEFAULT_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1")
#: How long rank 0 waits for the other ranks' files, and they for its commit: a rank
#: that is this late has died or hung (the watchdog reports which).
_COMMIT_TIMEOUT_S = 600.0
#: How long rank 0 waits for the other ranks to read a commit's outcome.
_ACK_WAIT_S = 10.0
#: Warn when a save takes more than this share of the grace period: the step in flight
#: when the signal comes must finish too.
_GRACE_SHARE = 0.8
# After a stop signal, a rank whose main thread shows no progress (no step, batch, phase
# or collective) for this long cannot reach a step boundary to save: it is stuck (in a
# collective waiting for a stuck peer, in its loader, in a C call where Python signal
# handlers never run) and exits with 128+signum. 5 s: several steps of any model that
# advertises progress per phase; well inside torchrun's and SLURM's 30 s before SIGKILL,
# which is what such a rank got before, with nothing written.
_SIGNAL_STUCK_S = 5.0


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
                exits (see ``exit_on_signal``). A second Ctrl+C exits at once. Default
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
                only). Default 1.
            strict_cadence: a periodic save that comes due while the previous one is
                still being written (on any rank) waits for it, stalling training.
                Default False: it is skipped (``checkpoint_every_n_steps``) or delayed
                until the writer is done (``checkpoint_every_s``), with an event that
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
                positive_int("checkpoint_every_n_steps", self.every_n_steps)
            if self.keep_last is not None:
                positive_int("keep_last_checkpoints", self.keep_last)
            for value, what in ((self.every_s, "checkpoint_every_s"), (self.grace_s, "grace_s")):
                if value is not None and not (isinstance(value, (int, float)) and value > 0):
                    raise ValueError(f"{what} must be a positive number of seconds, got {value!r}")
            agree = self.agree_every_s
            if not (isinstance(agree, (int, float)) and agree > 0):
                raise ValueError(f"agree_every_s must be > 0, got {agree!r}")
            self.agree_every_s = float(agree)
            unknown = [
                s for s in self.signals if not isinstance(getattr(signal, s, None), signal.Signals)
            ]
            if unknown and set(unknown) - {"SIGUSR1"}:  # SIGUSR1 does not exist on Windows
                raise ValueError(f"unknown signal name(s) {unknown}; use e.g. 'SIGTERM', 'SIGINT'")
            self.signals = tuple(s for s in self.signals if s not in unknown)
            if not self.save_on_signal:
                self.signals = ()
            if isinstance(self.resume, bool):
                raise TypeError("resume takes 'auto', a path, or None (not a bool)")
            if not isinstance(self.allow_world_size_change, bool):
                raise TypeError(
                    "allow_world_size_change takes True or False, got "
                    f"{self.allow_world_size_change!r}"
                )
            allow = self.allow_config_change
            if not isinstance(allow, bool):
                if isinstance(allow, str) or not all(isinstance(k, str) for k in allow):
                    raise TypeError(
                        "allow_config_change takes True, False or a list of config keys "
                        f"(['num_workers']), got {allow!r}"
                    )
                self.allow_config_change = tuple(allow)
            self.run_config = config_dict(self.run_config)
            if self.directory is not None:
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
        self._previous: dict[int, Any] = {}
        self._wakeup: tuple[int, int] | None = None  # (read, write) ends of the wakeup fd
        self._previous_wakeup = -1
        self._watcher: threading.Thread | None = None
        self._watched_signal: int | None = None  # what the watcher thread saw
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
        self._writer: threading.Thread | None = None
        self._writer_error: BaseException | None = None
        self._writing: tuple[int, _checkpoint.Part] | None = None  # (step, its part)
        self._next_check = 1
        self._check_t = 0.0
        self._check_step = 0
        self._token = ""
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
        self._shard_writer: _sharded.ShardWriter | None = None
        #: Deleting retired checkpoints (``.trash-*``) off the writer's path.
        self._emptying: threading.Thread | None = None
        self._dcp_prepared: threading.Thread | None = None
        self._dcp_stats: dict[str, Any] = {}  # its timings, told in checkpoint events
        # Optimizers whose state differs per rank: every rank saves its own part.
        self._per_rank: set[str] = set()
        self._contents: dict[str, Any] = {}
        # Pinned host blocks every save stages device tensors into (allocated ahead of
        # the first periodic save, see _plan_staging; nothing is allocated on a CPU run).
        self._staging = _checkpoint.Staging()
        self._staging_planned = False
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
            agree = all(_model.grads_agree(m) for m in guard.models.values())
            self._per_rank = {
                name
                for name, opt in guard.optimizers.items()
                if _checkpoint.per_rank(opt) is not opt or not agree
            }
        self._contents = _checkpoint.contents_of(guard.optimizers, guard.schedulers, self._per_rank)
        self._run = _checkpoint.run_record(self.run_config, guard.optimizers)
        self._token = self._agree_token(guard)
        # This run's id, in every checkpoint it saves (rank 0's is the one written); a
        # resume replaces it with the resumed checkpoint's: the same run, continued.
        self._run["id"] = uuid.uuid4().hex[:16]
        if guard.rank == 0 and self.resume is not None:
            # A re-save killed between its renames left the step's old copy aside:
            # back under its name before a resume picks (resume reads it either way).
            with contextlib.suppress(OSError):
                _checkpoint.settle_asides(self.root)
        if guard.rank == 0:  # what a stop left in the trash (the save it abandoned...)
            self._emptying = _checkpoint.empty_trash(self.root)
        if self.resume is not None:
            self._resume(guard)
        else:
            self._warn_beside_checkpoints(guard)
        self._last_save_t = self._check_t = time.monotonic()
        self._check_step = guard.step
        self._next_check = guard.step + 1
        if _model.is_sharded(_model.unwrap(guard.model)):
            self._shard_writer = _sharded.ShardWriter()  # no memory until it stages
        if threading.current_thread() is not threading.main_thread():
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

    def _watch_signals(self, guard: Guard) -> None:
        """A thread that learns of a stop signal even while the main thread is stuck.

        Python runs a signal handler only when the main thread executes bytecode, so a
        rank blocked in a collective or a C call never runs ours: it ignored its
        launcher's SIGTERM until the SIGKILL 30 s later. The C-level handler also writes
        the signal number to the wakeup fd (``signal.set_wakeup_fd``), which this thread
        reads; bytes for a wakeup fd set before ours (asyncio's) are passed on to it."""
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        try:
            self._previous_wakeup = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        except (ValueError, OSError):  # not the main thread, or an unusable fd
            os.close(read_fd)
            os.close(write_fd)
            return
        self._wakeup = (read_fd, write_fd)
        nums = {int(getattr(signal, name)) for name in self.signals}
        self._watcher = threading.Thread(
            target=self._watch, args=(guard, read_fd, nums), name="guardrails-signals", daemon=True
        )
        self._watcher.start()

    def _watch(self, guard: Guard, read_fd: int, nums: set[int]) -> None:
        from guardrails._watchdog import main_thread_site, progress_key

        signum = 0
        key: Any = None
        since = 0.0
        while True:
            timeout = None if not signum else 0.5
            ready, _, _ = select.select([read_fd], [], [], timeout)
            if ready:
                try:
                    data = os.read(read_fd, 64)
                except OSError:
                    return
                if not data:  # closed at on_end
                    return
                if self._previous_wakeup >= 0:
                    with contextlib.suppress(OSError):
                        os.write(self._previous_wakeup, data)
                if not signum:
                    signum = next((b for b in data if b in nums), 0)
                    self._watched_signal = signum or None
                    key, since = progress_key(guard), time.monotonic()
            if not signum or self._stop_at is not None or guard.stopping is not None:
                continue  # no signal yet, or the stop is under way: its save is bounded
            now = time.monotonic()
            here = progress_key(guard)
            if here != key or guard.paused:
                key, since = here, now
                continue
            step_s = guard.step_time_s if guard.step_time_s == guard.step_time_s else 0.0
            wait_s = min(self.grace_s / 2, max(_SIGNAL_STUCK_S, 3 * step_s))
            if now - since < wait_s:
                continue
            name = signal.Signals(signum).name
            message = (
                f"{name} received at step {guard.step}, but this rank made no progress "
                f"for {now - since:.0f} s after it (its main thread is at "
                f"{main_thread_site()}), so it could not reach a step boundary to save: "
                f"exited without a checkpoint; {self._last_checkpoint()}. If the job "
                "should have saved, see why this rank was stuck (the other ranks' "
                "reports, or the watchdog's)."
            )
            guard.die(_exit.stop_exit(128 + signum, message))
            return

    def _last_checkpoint(self) -> str:
        if self.last_path is not None:
            return f"the last checkpoint is {self.last_path}"
        return "no checkpoint was saved in this run"

    def _unwatch_signals(self) -> None:
        if self._wakeup is None:
            return
        read_fd, write_fd = self._wakeup
        self._wakeup = None
        with contextlib.suppress(ValueError, OSError):  # ValueError: not the main thread
            signal.set_wakeup_fd(self._previous_wakeup)
        os.close(write_fd)  # the thread reads EOF and ends
        if self._watcher is not None:
            self._watcher.join(1.0)
            self._watcher = None
        os.close(read_fd)

    def on_end(self, guard: Guard, exc: BaseException | None) -> None:
        try:
            signum = self._signal or self._watched_signal
            if signum and self._stop_at is None and isinstance(exc, Exception):
                # Pre-empted before a stop could be agreed, then failed: under a
                # launcher's SIGTERM to every rank, a peer that could not save left,
                # and this rank's collective failed for it. The signal is what
                # happened; a "rank 1 died" report would be a false alarm.
                name = signal.Signals(signum).name
                guard.replace_error(
                    _exit.stop_exit(
                        128 + signum,
                        f"{name} received at step {guard.step}; before the ranks could "
                        f"agree to stop and save, this rank failed with "
                        f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                        f" (another rank ending on the same signal): exited without a "
                        f"checkpoint; {self._last_checkpoint()}.",
                    )
                )
            if exc is None and guard.stopping is None:
                if guard.side_group is not None:
                    # A signal that came after the last agreement must still stop every
                    # rank: one more, at the same (last) step everywhere.
                    self._agree(guard)
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

    def _restore_handlers(self) -> None:
        self._unwatch_signals()
        for num, previous in self._previous.items():
            _exit.restore_handler(num, previous)  # after a failing close's hold, if any
        self._previous = {}

    def _on_signal(self, signum: int, frame: Any) -> None:
        # A flag only: this runs between two bytecodes of whatever the main thread was
        # doing (maybe inside the logging module's lock), so no I/O and no collective.
        if self._signal is None:
            self._signal = signum
            return
        if signum == signal.SIGINT:  # the second Ctrl+C: out, now
            self._restore_handlers()
            raise KeyboardInterrupt

    # ------------------------------------------------------------------ per step

    def after_step(self, guard: Guard) -> None:
        if guard.side_group is None:
            if self._signal is not None and self._stop_at is None:
                self._stop_at, self._stop_signal = guard.step, self._signal
            if self.every_s is not None and time.monotonic() - self._last_save_t >= self.every_s:
                self._save_due = True
        elif guard.step >= self._next_check:
            self._agree(guard)

    def _agree(self, guard: Guard) -> None:
        """One all-reduce over the side group, at a step every rank reaches, decides
        stop / save for every rank at once and the next check step."""
        now = time.monotonic()
        per_step = (now - self._check_t) / max(1, guard.step - self._check_step)
        steps = 1 if per_step <= 0 else min(10_000, max(1, round(self.agree_every_s / per_step)))
        due = self.every_s is not None and now - self._last_save_t >= self.every_s
        flags = torch.tensor([float(self._signal or 0), float(due), -float(steps)])
        with guard.in_phase("agree"):
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=guard.side_group)
        signum, due_any, steps = int(flags[0]), bool(flags[1]), int(-flags[2])
        if signum and self._stop_at is None:
            self._stop_at, self._stop_signal = guard.step, signum
        self._save_due = self._save_due or due_any
        self._check_t, self._check_step = now, guard.step
        self._next_check = guard.step + steps

    def on_boundary(self, guard: Guard) -> None:
        if guard.side_group is None and self._signal is not None and self._stop_at is None:
            self._stop_at, self._stop_signal = guard.step, self._signal  # alone: stop now
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
        elif not self._staging_planned and (self.every_n_steps or self.every_s):
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

    def _plan_staging(self, guard: Guard) -> None:
        """Allocate the pinned staging memory of the first periodic save now, in a
        thread, while training goes on: once the optimizer has stepped, its state exists
        and the sizes are known. Without it the first save paid for pinning its whole
        state (5.9 s of stall at 10 GB, H200)."""
        if guard.step < 1:
            return  # the optimizer's state appears at its first step
        self._staging_planned = True
        if not torch.cuda.is_available():
            return  # nothing to pin without a GPU
        bare = _model.unwrap(guard.model)
        if _model.is_sharded(bare):
            if self._shard_writer is not None and self.background:  # it stages them
                self._dcp_prepared = _sharded.prepare_staging(
                    self._shard_writer.stager, bare, guard.optimizer, self._dcp_stats
                )
            return
        try:
            part = _checkpoint.Part(measure=True)
            self._stage(guard, part, measure=True)
            if part.device_bytes:
                self._staging.prepare(part.device_bytes, guard.device)
        except Exception as e:  # only an optimisation: the save itself will say what fails
            log.debug("guardrails: staging memory not allocated ahead: %r", e)

    def _stop(self, guard: Guard, *, exit_now: bool = True) -> None:
        name = signal.Signals(self._stop_signal).name
        mine = self._signal == self._stop_signal
        # The old checkpoints beyond keep_last are only renamed away here: deleting them
        # is left to the next run's first save, not to the grace period.
        where = "this rank" if mine else "another rank"
        try:
            path: Path | None = self._save(guard, background=False, final_save=True)
        except CheckpointError as e:
            # Still a stop by the signal (128 + signum), said in one message and no
            # traceback: the launcher SIGKILLs the process soon anyway, and a resume
            # needs to know which checkpoint it gets.
            path = None
            message = (
                f"{name} received by {where}; all {guard.world_size} rank(s) stopped at "
                f"step {guard.step}, but nothing new was saved ({e.message}); "
                f"{self._latest_text()}. Fix: {e.hint}"
            )
        else:
            message = (
                f"{name} received by {where}; all {guard.world_size} rank(s) stopped at step "
                f"{guard.step} and saved {path}. To resume, run the same command: "
                "guard(..., resume='auto') continues from it."
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
            raise _exit.stop_exit(128 + self._stop_signal, reason)

    # ------------------------------------------------------------------ saving

    def save(self, guard: Guard) -> Path:
        """Save now, synchronously (every rank must call it at the same step boundary);
        returns the committed directory."""
        try:
            return self._save(guard, background=False)
        except CheckpointError as e:
            e.rehint(f"{e.hint} Meanwhile {self._latest_text()}.")
            raise

    def _save(self, guard: Guard, *, background: bool, final_save: bool = False) -> Path:
        step = guard.step
        if final_save:
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
            part = _checkpoint.Part(self._staging)
            bare = _model.unwrap(guard.model)
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
            self._stage(guard, part)
            part.ready()
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

    def _stage(self, guard: Guard, part: _checkpoint.Part, *, measure: bool = False) -> None:
        """Stage what this rank writes into ``part``: rank 0 the replicated state (model,
        optimizers, schedulers, scaler, ``g.state``), every rank its own (data position,
        RNG, the components' state, optimizer state that differs per rank). With
        ``measure``, only what lives on the device is looked at (its sizes, in the same
        order a save stages it: :meth:`_plan_staging`)."""
        bare = _model.unwrap(guard.model)
        is_sharded = _model.is_sharded(bare)
        stems = _checkpoint.stems("optimizer", list(guard.optimizers))
        replicated = {
            n: o for n, o in guard.optimizers.items() if not is_sharded and n not in self._per_rank
        }
        per_rank = {stems[n]: guard.optimizers[n] for n in sorted(self._per_rank)}
        if measure:  # the device tensors below, in the order they are staged
            if guard.rank == 0:
                if not is_sharded:
                    part.add_tensors("model.safetensors", bare.state_dict(), copy=False)
                for name, opt in replicated.items():
                    _checkpoint.stage_optimizer(part, name, opt, copy=False)
            for stem, opt in per_rank.items():
                _checkpoint.stage_optimizer(part, stem, opt, copy=False)
            return
        if guard.rank == 0:
            _checkpoint.stage_replicated(
                model=None if is_sharded else bare,
                optimizers=replicated,
                schedulers=guard.schedulers,
                scaler=guard.scaler,
                extras=guard.state,
                part=part,
            )
        position, tensors = _data.save_position(guard)
        components = {
            c.name: state for c in guard.components if (state := c.state_dict()) is not None
        }
        state = {
            "step": guard.step,
            "data": position,
            "components": components,
        }
        _checkpoint.stage_rank(
            guard.rank, state=state, tensors=tensors, optimizers=per_rank, part=part
        )

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
        if not isinstance(error, _digest.Cancelled):
            log.debug("guardrails: the abandoned save of step %d also failed: %r", old_step, error)

    def _write_safely(self, guard: Guard, step: int, part: _checkpoint.Part, t0: float) -> None:
        try:
            self._write(guard, step, part, t0)
        except BaseException as e:  # raised in the main thread at the next boundary
            self._writer_error = e

    def _write(
        self,
        guard: Guard,
        step: int,
        part: _checkpoint.Part,
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
                    _checkpoint.remove_leftovers(root, keep=self._token)
            tmp = _checkpoint.begin(root, step, self._token)
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
                part.sealed = [tmp / _sharded.DCP_DIR / name for name in records]
                files.update({f"{_sharded.DCP_DIR}/{n}": r for n, r in records.items()})
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
                        _checkpoint.to_trash(tmp)
                        trashed = True
                if not trashed:
                    shutil.rmtree(tmp, ignore_errors=True)
            if error is not e:
                raise error from e
            raise
        t_commit = time.perf_counter()
        try:
            if store is None:
                final = _checkpoint.commit(
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
            self._emptying = _checkpoint.empty_trash(root)
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
            store.wait([f"{key}/commit"], timeout)
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
                store.wait(keys, timeout)
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
            final = _checkpoint.commit(
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
        again = now - self._failed_warned_t < _storage.WARN_EVERY_S
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

    # ------------------------------------------------------------------ resume

    def _prepare(self, guard: Guard, ckpt: Path) -> _checkpoint.Plan:
        """``_checkpoint.prepare`` for the guard (everything read and checked, nothing
        applied), with the data position checked against this run's loader; its
        ``ResumeError`` says how to fix it in ``guard()``'s terms (``guard()`` has no
        ``strict`` and takes every optimizer and scheduler it guards), and names the way
        out when this is another run: a run_dir of its own."""
        try:
            return _checkpoint.prepare(
                ckpt,
                _model.unwrap(guard.model),
                guard.optimizers,
                scheduler=guard.schedulers or None,
                scaler=guard.scaler,
                allow_world_size_change=self.allow_world_size_change,
                check=lambda state, f: _data.check_position(guard.loader, state.get("data"), f),
            )
        except ResumeError as e:
            remedy = getattr(e, "remedy", None)
            fresh = f"or, if this is another run, {self._new_run(guard)}. Nothing was modified."
            if remedy == "strict":
                raise e.rehint(
                    "build the model with the same architecture and config that was saved; "
                    "to load only the matching part (a backbone under a new head), call "
                    f"guardrails.resume('{ckpt}', model, strict=False) before the guard and "
                    "pass guard(..., resume=None); " + fresh
                ) from None
            if remedy == "no_model":
                raise e.rehint(
                    "its manifest lists no model file, so there is no model to resume: "
                    "resume from an older step_* directory (guard(..., resume=...)), or "
                    "start fresh with resume=None; " + fresh
                ) from None
            if remedy == "no_optimizer":
                raise e.rehint(
                    "build the optimizer over the same parameters, in the same order and "
                    "param groups, as the run that saved it; to restart the optimizer from "
                    f"scratch, call guardrails.resume('{ckpt}', model) before the guard and "
                    "pass guard(..., resume=None); " + fresh
                ) from None
            if remedy is not None and remedy.startswith("no_"):
                what = remedy[3:]
                raise e.rehint(
                    f"the checkpoint holds no {what}: resume it without one (leave "
                    f"{what}= out of guard(...)), or call guardrails.resume('{ckpt}', "
                    f"model, optimizer, strict=False) before the guard and pass "
                    "guard(..., resume=None); " + fresh
                ) from None
            if remedy == "world_size":
                raise e.rehint(
                    f"relaunch with {e.saved_world} rank(s) for an exact resume; or pass "
                    "guard(..., checkpoint={'allow_world_size_change': True}) to restore "
                    "the replicated state and start the interrupted pass over; " + fresh
                ) from None
            if e.hint is not None and "run_dir" not in e.hint:
                hint = e.hint.removesuffix(" Nothing was modified.")
                raise e.rehint(f"{hint} {fresh}") from None
            raise

    def _new_run(self, guard: Guard) -> str:
        """The way out when the checkpoints found belong to another run: where this one
        should go instead, in the terms the user set it with."""
        if self.directory is not None:
            return (
                "give this run a checkpoint directory of its own "
                f"(guard(checkpoint={{'directory': ...}})), or move {self.root} away"
            )
        return (
            "give this run a run_dir of its own (guard(run_dir=...); your script's "
            f"--run-dir option, if it has one), or move {self.root} away"
        )

    def _agree_token(self, guard: Guard) -> str:
        """One name per guard for this run's temp directories, the same on every rank."""
        store = guard.side_store("checkpoint")
        if store is None:
            return uuid.uuid4().hex[:8]
        if guard.rank == 0:
            store.set("token", uuid.uuid4().hex[:8])
        return store.get("token").decode()

    def _resume(self, guard: Guard) -> None:
        auto = self.resume == "auto"
        where = self.root if auto else Path(self.resume)  # type: ignore[arg-type]
        store = guard.side_store("checkpoint")
        chosen: str | None = None
        plan: _checkpoint.Plan | None = None
        if guard.rank == 0:
            try:
                if auto and not _checkpoint.list_checkpoints(where):
                    chosen = ""  # nothing saved yet: a fresh run
                else:
                    # Rank 0 reads and checks each candidate, newest first, against this
                    # run (its model, optimizers, loader): a damaged one is skipped, said
                    # in an event, and the previous one is tried.
                    found, plan, skipped = _checkpoint.pick(
                        where, lambda c: self._prepare(guard, c)
                    )
                    chosen = str(found)
                    for name, why in skipped:
                        guard.event(
                            "checkpoint_invalid",
                            level="warning",
                            message=f"skipped checkpoint {name}: {why}; resuming from "
                            f"{found.name} instead (delete or move {name} away to keep "
                            "this from being said at every start)",
                            checkpoint=name,
                            reason=why,
                            using=chosen,
                        )
            except GuardrailsError as e:
                if store is not None:
                    store.set("resume", json.dumps({"error": str(e)}))
                if auto and getattr(e, "remedy", None) == "all_invalid":
                    e.rehint(
                        "every checkpoint under the run's checkpoint directory is invalid; "
                        "restore them from a backup, pass resume=None to start fresh (they "
                        "are kept), or resume= a specific checkpoint; if this is another "
                        f"run, {self._new_run(guard)}."
                    )
                raise
            if store is not None:
                store.set("resume", json.dumps({"path": chosen}))
        else:
            assert store is not None
            got = json.loads(store.get("resume"))
            if "error" in got:
                raise ResumeError(
                    f"rank 0 could not pick a checkpoint to resume from: {got['error']}",
                    rank=guard.rank,
                    path=str(where),
                )
            chosen = got["path"]
        if not chosen:
            return
        ckpt = Path(chosen)
        # Checked before anything is restored, on every rank (the same manifest, and the
        # preflight has compared the ranks' configs): a refusal leaves all as it was.
        saved = _checkpoint.saved_run(ckpt)
        changed = self._check_config(guard, ckpt, saved)
        settings = self._settings_changed(saved)
        if plan is None:  # the other ranks: their own files of the checkpoint rank 0 chose
            try:
                plan = self._prepare(guard, ckpt)
            except CheckpointError as e:
                raise e.rehint(_checkpoint._skip_hint(ckpt)) from None
        # The components' own state first: their load_state_dict is theirs (a custom
        # component's may refuse a well-formed dict), and a refusal must leave the
        # model, optimizers, schedulers, scaler and RNG as they were.
        self._load_components(guard, ckpt, plan.rank_state.get("components", {}))
        with guard.quiet():  # a sharded load may step the optimizer to create its state
            out = _checkpoint.apply(plan)
        rank_state, tensors = out["rank_state"], out["rank_tensors"]
        position = rank_state.get("data")
        if position is not None and "loader" in rank_state:  # format 2 kept it beside
            position = {**position, "loader": rank_state["loader"]}
        self._last_saved_step = self._committed_step = out["step"]
        # The same run, continued: its checkpoints keep the run's id (retention counts
        # them together). One saved before run ids: a new id, and those without one
        # count as this run's too (they are the run this one continues).
        if isinstance(saved.get("id"), str):
            self._run["id"] = saved["id"]
        else:
            self._adopt_unlabelled = True
        guard.resume_from(out["step"], state=out["extras"], position=position, tensors=tensors)
        self.last_path = Path(out["path"])
        self._resumed = True
        self._resumed_step = out["step"]
        self._resumed_finished = saved.get("finished_at")
        self._announce(guard, saved, changed, settings)

    def _load_components(self, guard: Guard, ckpt: Path, saved: Mapping[str, Any]) -> None:
        """Each component's saved state into it, before anything else is restored: a
        ``ResumeError`` naming the component if its ``load_state_dict`` raises."""
        for c in guard.components:
            if c.name not in saved:
                continue
            try:
                c.load_state_dict(saved[c.name])
            except Exception as e:
                raise ResumeError(
                    f"component {c.name!r} ({type(c).__name__}) could not load its state "
                    f"from {ckpt}: {type(e).__name__}: {e}; nothing else was restored "
                    "(model, optimizers, schedulers, scaler and RNG are as they were)",
                    rank=guard.rank,
                    path=str(ckpt),
                    hint=f"fix {type(c).__name__}.load_state_dict for the state its "
                    "state_dict() saved, or resume with a run_dir of its own to start fresh",
                ) from e

    def _check_config(
        self, guard: Guard, ckpt: Path, saved: Mapping[str, Any]
    ) -> dict[str, tuple[Any, Any]]:
        """The config keys that differ from the checkpoint's, ``key -> (saved, given)``;
        a ``ResumeError`` unless ``allow_config_change`` allows them all."""
        old, new = saved.get("config"), self._run.get("config")
        if old is None or new is None:  # saved without one, or none given: nothing to compare
            return {}
        changed = {
            key: (old.get(key, _ABSENT), new.get(key, _ABSENT))
            for key in [*new, *(k for k in old if k not in new)]
            if not (key in old and key in new and _same(old[key], new[key]))
        }
        allow = self.allow_config_change
        refused = {
            key: values
            for key, values in changed.items()
            if not (
                allow is True or (allow and any(key == k or key.startswith(f"{k}.") for k in allow))
            )
        }
        if not refused:
            return changed
        raise ResumeError(
            f"{ckpt} was saved by a run with another config ({len(refused)} setting(s) "
            f"differ: {_changes(refused)}): resuming it would continue that run's weights "
            "and optimizer state under the new settings",
            step=int(saved["step"]),
            path=str(ckpt),
            changed=refused,
            hint=f"if this is a new run, {self._new_run(guard)}; the same command then "
            "starts fresh. To continue that run with the new settings, pass "
            "guard(..., checkpoint={'allow_config_change': True}), or a list of the keys "
            f"that may change ({list(refused)[:3]}). Nothing was modified.",
        )

    def _settings_changed(self, saved: Mapping[str, Any]) -> list[str]:
        """Each optimizer setting the code now builds differently from the run that saved
        the checkpoint (both as built, before any step or resume: a scheduler's moves
        of ``lr`` are not a change), as ``"group 0 lr: checkpoint 0.1, code 0.05"``."""
        old = saved.get("optimizer_settings") or {}
        new = self._run["optimizer_settings"]
        if not old:  # saved before settings were recorded
            return []
        lone = len(new) == 1 and len(old) == 1
        found = []
        for name, groups in new.items():
            was = next(iter(old.values())) if lone else old.get(name)
            if was is None or len(was) != len(groups):  # the load names a real mismatch
                continue
            who = "" if len(new) == 1 else f"optimizer {name!r} "
            for i, (before, now) in enumerate(zip(was, groups, strict=True)):
                for key, value in now.items():
                    # Keys one torch version has and another lacks are not settings
                    # the user changed.
                    if key in before and not _same(before[key], value):
                        found.append(
                            f"{who}group {i} {key}: checkpoint {_show(before[key])}, "
                            f"code {_show(value)}"
                        )
        return found

    def _announce(
        self,
        guard: Guard,
        saved: Mapping[str, Any],
        changed: Mapping[str, tuple[Any, Any]],
        settings: list[str],
    ) -> None:
        """Say the resume on the console (rank 0) and in the events: which checkpoint,
        its step and age, a config continued despite changes, a finished run; and the
        optimizer settings the resume put back over the code's."""
        saved_at = saved.get("time")
        finished = self._resumed_finished
        text = f"resumed from {self.last_path} (step {self._resumed_step}"
        if isinstance(saved_at, (int, float)) and finished is None:
            text += f", saved {_ago(saved_at)}"
        text += ")"
        if finished is not None:
            text += f": the end of a run that finished {_ago(finished)}; this run continues past it"
        if changed:
            text += f", with a changed config (allow_config_change): {_changes(changed)}"
        if finished is not None:
            text += f". If this is a new run, {self._new_run(guard)}"
        guard.event(
            "resumed",
            message=text,
            path=str(self.last_path),
            saved_at=saved_at,
            finished_at=finished,
            config_changed=list(changed) or None,
        )
        if guard.rank == 0:
            to_console(f"guardrails: {text}")
        if settings and guard.rank == 0:
            base = (
                "; for lr, the scheduler's base_lrs[i] too: it sets each group's lr from "
                "them at its next step"
                if guard.schedulers
                else ""
            )
            guard.event(
                "optimizer_settings_changed",
                level="warning",
                message=f"the optimizer settings in your code differ from those of the "
                f"run that saved {self.last_path}, and the resume restored the "
                f"checkpoint's (an optimizer's state_dict holds its settings): "
                f"{'; '.join(settings)}. The checkpoint's values are used now. To train "
                "with the code's, set them after the guard has started "
                f"(optimizer.param_groups[i]['lr'] = ...{base}); if this is a new run, "
                f"{self._new_run(guard)}.",
                settings=settings,
            )

    def _finish(self, guard: Guard) -> None:
        """The run ended normally: mark the checkpoint it ended with as finished (so a
        re-run of the same command says it resumes a finished run), or, when it resumed
        a finished run and trained nothing, say so."""
        if self._resumed_finished is not None and guard.step == self._resumed_step:
            if guard.rank == 0:
                guard.event(
                    "nothing_trained",
                    level="warning",
                    message=f"this run trained no step: it resumed {self.last_path} "
                    f"(step {guard.step}), the end of a run that finished "
                    f"{_ago(self._resumed_finished)}, and its loop ended at once (the "
                    "script's own end, its step or epoch count, was reached already). "
                    f"If this is a new run, {self._new_run(guard)}; to train further, raise "
                    "the script's step or epoch count.",
                )
            return
        self._settle_writer(guard)
        last = self.last_path
        if (
            guard.rank != 0
            or last is None
            or last.name != f"step_{guard.step:09d}"
            or last.resolve().parent != self.root.resolve()  # not a checkpoint of another run
        ):
            return
        try:
            _checkpoint.mark_finished(last, time.time())
        except (OSError, GuardrailsError) as e:  # the run itself is done and saved
            guard.event(
                "checkpoint_unmarked",
                level="warning",
                message=f"could not record in {last} that the run finished ({e}): a re-run "
                "of this command resumes it without saying that the run had finished.",
            )

    def _warn_beside_checkpoints(self, guard: Guard) -> None:
        """``resume=None`` with periodic saves into a directory that holds another run's
        checkpoints: the two runs are kept apart (run ids), but the directory now holds
        both, and ``resume="auto"`` will continue this one, not the other."""
        if guard.rank != 0 or not (self.every_n_steps or self.every_s):
            return
        found = _checkpoint.list_checkpoints(self.root)
        if not found:
            return
        newest = found[-1][1]
        kept = (
            f"keep_last={self.keep_last} counts only this run's checkpoints (the other "
            "run's stay, and keep their disk space); "
            if self.keep_last is not None
            else ""
        )
        guard.event(
            "fresh_run_beside_checkpoints",
            level="warning",
            message=f"resume=None: this run starts fresh, but {self.root} holds another "
            f"run's checkpoints (up to {newest.name}), and this run's saves go beside "
            f"them, kept apart: {kept}a later resume='auto' continues the run that saved "
            f"last (this one, once it has saved), so the other run is continued only by "
            f"naming its checkpoint (resume='{newest}'). To keep the runs in separate "
            f"directories, {self._new_run(guard)} first.",
        )


_ABSENT = "(absent)"


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
    if _storage.is_storage_error(e):
        return _checkpoint.write_error(final, step, e, latest=False)
    return e


def _same(a: Any, b: Any) -> bool:
    """Equal as settings: NaN equals NaN, 1 equals 1.0, but True is not 1."""
    if isinstance(a, bool) != isinstance(b, bool):
        return False
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


def _show(value: Any, n: int = 40) -> str:
    """A value in a message: its repr, cut to ``n`` characters."""
    text = _ABSENT if value is _ABSENT else repr(value)
    return text if len(text) <= n else text[: n - 3] + "..."


def _changes(changed: Mapping[str, tuple[Any, Any]], n: int = 8) -> str:
    """``lr: 0.1 -> 0.05; batch_size: 32 -> 64`` for the first ``n`` changed keys."""
    items = [f"{k}: {_show(old)} -> {_show(new)}" for k, (old, new) in changed.items()]
    return "; ".join(items[:n]) + (f"; ... {len(items) - n} more" if len(items) > n else "")


def _ago(when: float) -> str:
    """``"3 min ago, at 2025-06-01 12:03"``: how long ago, and the local time."""
    seconds = max(0.0, time.time() - when)
    if seconds < 90:
        age = f"{seconds:.0f} s"
    elif seconds < 90 * 60:
        age = f"{seconds / 60:.0f} min"
    elif seconds < 36 * 3600:
        age = f"{seconds / 3600:.0f} h"
    else:
        age = f"{seconds / 86400:.0f} days"
    return f"{age} ago, at {time.strftime('%Y-%m-%d %H:%M', time.localtime(when))}"
