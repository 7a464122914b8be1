"""The step engine: ``Guard`` observes a training loop and drives the components.

What it hooks, and why each is enough:

* the loader, by being iterated in its place: every ``next()`` is timed (data
  starvation is a failure family of its own) and shown to the components;
* ``optimizer.step()``, wrapped on the instance (``opt.step``, restored on close), not
  through torch's step pre-hooks: a hook cannot stop the update, and a non-finite step
  must not reach an optimizer that would crash on, or be corrupted by, its gradients
  (:meth:`Guard.skip_update`). The step counter is the first optimizer's step, so
  gradient accumulation (several backwards per step) needs nothing special; with
  several optimizers (a GAN), every one is wrapped and guarded, and the others' steps
  between two of the first one's belong to the same step;
* the model's forward, wrapped on the instance (``model.forward``, restored on close):
  it records the arguments of each training forward of the step (by reference: the
  inputs the step really trained on, which a prefetching loop fetched one step
  earlier), picks up a scalar loss the model returns (``loss``, ``(logits, loss)``,
  ``{"loss": ...}``, ``output.loss``; models that return logits call
  :meth:`Guard.observe`), and tells the engine where the step boundary is. Not a
  forward hook: any hook sends ``Module.__call__`` down its slow path, measured at
  ~15 us per call on CPU, more than everything else the engine does per step; the
  wrapper costs ~1 us.

**The step boundary** (:meth:`~guardrails.Component.on_boundary`, where checkpoints
are taken) is the first point after an optimizer step where model, optimizer,
scheduler, RNG and data position agree: the loop body finished (scheduler stepped,
gradients zeroed) and the next step has not started. The engine arms it after each
step and fires it at the first of: the next batch fetched through the guard, or the
next training forward (in loops that prefetch the next batch before
``optimizer.step()``, or that do not iterate the guard; with several optimizers only
in those loops, since a GAN's second model runs its forward after the first model's
step), or at the latest at the next ``optimizer.step()``.

**The data position** a checkpoint saves is the batches *trained*, not fetched: the
loader position at the step's last training forward. A loop that prefetched the next
batch resumes with that batch, not after it.

Nothing here reads a device value on the host: the loss and the grad norm stay device
tensors, and components move them to the host lagged (see ``guards/telemetry.py``). Host
work per step is a fixed number of Python calls whatever the model size; the one piece
that touches every parameter is the grad norm's single list comprehension over
``p.grad`` (``engine/gradnorm.py``): on one GPU each gradient's address for the guard's
kernel (~0.24 us a tensor on an H200 host); on CPU the gradients for one flat copy (a
small model) or ``_foreach_norm``; elsewhere the gradients for ``_foreach_norm``, which
then makes one output per gradient (~2 us each on that host).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import operator
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from os import PathLike
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from guardrails.distributed import dist, store
from guardrails.engine import lifecycle, process, rundir, setup, where
from guardrails.engine.anatomy import StepAnatomy
from guardrails.engine.boundary import EVERY_N, BoundaryCapture
from guardrails.engine.buffers import BufferShadows
from guardrails.engine.component import (
    HOOKS,
    Component,
    check_component_list,
)
from guardrails.engine.data import DataPosition, tokens_in
from guardrails.engine.gradnorm import GradNorm, total_norm
from guardrails.engine.lagged import OpenRow, StepRing
from guardrails.engine.losses import LossRecord
from guardrails.engine.model import find_loss as _find_loss
from guardrails.engine.model import is_loss as _is_loss
from guardrails.engine.services import CollectiveRecorder
from guardrails.engine.state import Shared, StepState
from guardrails.engine.surface import USER_SURFACE
from guardrails.engine.wrappers import StepHooks, UserWrappers, temporarily
from guardrails.metrics.events import EventLog, logger_of
from guardrails.util.checks import check_scaler, flag, named

logger = logging.getLogger("guardrails.guard")

# The boundary capture's per-step pieces, bound once (engine/boundary.py).
_get_state = torch.Generator.get_state
_CHECK_MASK = EVERY_N - 1

#: What ``optimizer`` may be: one optimizer, or several as a list or a dict by name.
Optimizers = (
    torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | Mapping[str, torch.optim.Optimizer]
)

#: The guard started in this process and not closed yet (one at a time).
_running: Guard | None = None


class Guard(StepState):
    """Guards one training loop. Build it with :func:`guardrails.guard` for the default
    components, or directly with the components you want::

        with Guard(model, opt, loader, components=[Telemetry()]) as g:
            for batch in g:
                ...

    Without ``with``: ``g = Guard(...); g.start(); ...; g.close()``. Closing (normally
    or through an exception) removes every hook and lets each component restore what
    it changed.

    A loop uses the names ``dir(g)`` shows (``engine/surface.USER_SURFACE``: ``g.step``,
    ``g.state``, ``g.save_checkpoint()``...). The other public attributes are for
    components: the published step state and the services they call
    (``engine/surface.SERVICES``: ``request_stop``, ``skip_update``...).

    Args:
        model: the ``nn.Module`` being trained (a DDP / compiled wrapper is fine), or a
            list / dict of modules trained together (a GAN's generator and
            discriminator), checkpointed as one ``nn.ModuleDict``.
        optimizer: the ``torch.optim.Optimizer`` that steps it, or a list / dict of
            them (a GAN's two). Every one must own some of the model's parameters and
            every one's steps are guarded; ``g.step`` counts the first one's steps
            (the others' steps between two of its steps belong to the same step).
        loader: any iterable of batches (``DataLoader``, a generator, a list), or
            ``None`` when the loop fetches its own data.
        scheduler: the LR scheduler, if any, or a list / dict of them (kept for
            checkpoints; the LR itself is read from the optimizer).
        scaler: the ``torch.amp.GradScaler``, if any (kept for checkpoints; accelerate's
            prepared optimizer's own is found).
        generators: the loop's own ``torch.Generator``, or a list / dict of them by name
            (kept for checkpoints, set back at resume).
        run_dir: where metrics, events and checkpoints go. Default ``runs/<script>``,
            the same on every rank and across restarts of the same script.
        components: the components to run, in order.
        tokens_per_batch: tokens in one batch, for tokens/s. Default: inferred from
            the batch when its first tensor is an integer ``(batch, seq)`` tensor.
        benchmark: measure the guard's own cost in this loop by sampling a few steps
            with the components' per-step hooks bypassed (see ``benchmark_mode.py``); the
            table goes to ``run_dir/benchmark.json`` and the log at close.
        graph_grad_norm: experimental, one GPU: replay the eager per-step grad norm as
            a CUDA graph when the gradients are where a captured graph expects them,
            instead of the default kernel over their addresses (``gradnorm.py``).
            Default False.
    """

    def __init__(
        self,
        model: nn.Module | Sequence[nn.Module] | Mapping[str, nn.Module],
        optimizer: Optimizers,
        loader: Iterable[Any] | None = None,
        *,
        scheduler: Any = None,
        scaler: Any = None,
        generators: Any = None,
        run_dir: str | PathLike[str] | None = None,
        components: Sequence[Component] | None = None,
        tokens_per_batch: int | None = None,
        benchmark: bool = False,
        graph_grad_norm: bool = False,
        replay_fn: Callable[[Any, Any], Any] | None = None,
    ) -> None:
        StepState.__init__(self)  # the published fields: step, epoch, phase... (state.py)
        #: What components produce for each other (the collective in flight, GC time),
        #: each field with one writer: see ``state.Shared``.
        self.shared = Shared()
        self._take(model, optimizer, loader, scheduler, scaler, generators)
        self.components: list[Component] = list(check_component_list(components))
        self.tokens_per_batch = tokens_per_batch
        if replay_fn is not None and not callable(replay_fn):
            raise TypeError(f"replay_fn must be callable(model, batch), got {replay_fn!r}")
        #: How to replay a non-finite step's batch: ``replay_fn(model, batch)``, or
        #: ``None`` to re-run the step's recorded forward calls as they were made.
        self.replay_fn = replay_fn
        # The parameters the step's grad norm and NaN flag cover (setup.py).
        self._params = setup.trained_params(
            self.model,
            self.optimizers,
            setup.validate(self.model, self.optimizers, loader, self.components, tokens_per_batch),
        )
        if run_dir is not None:
            rundir.check_arg(run_dir)
        self.run_dir = Path(run_dir) if run_dir is not None else setup.default_run_dir()
        self.device = self._params[0].device
        self._device_type = self.device.type  # a str: device.type costs ~0.4 us a read
        #: Replay the grad norm's kernels as a CUDA graph when the gradients are where a
        #: graph expects them (one launch instead of one output per gradient; opt-in,
        #: see gradnorm.py).
        flag("guard(graph_grad_norm=...)", graph_grad_norm)
        self.graph_grad_norm = graph_grad_norm
        flag("guard(benchmark=...)", benchmark)
        self.benchmark = benchmark
        self._build_step_parts()
        self._build_lifecycle()

    def _take(
        self,
        model: Any,
        optimizer: Optimizers,
        loader: Iterable[Any] | None,
        scheduler: Any,
        scaler: Any,
        generators: Any,
    ) -> None:
        """The user's objects, each by name (a list or a dict of several), checked."""
        #: The modules whose forward is wrapped: the model, or each one given.
        self.models: dict[str, nn.Module] = named("model", model, nn.Module)
        #: The model: the one given, or an ``nn.ModuleDict`` of the ones given.
        self.model: nn.Module = (
            model if isinstance(model, nn.Module) else nn.ModuleDict(self.models)
        )
        #: Every optimizer by name (``"0"``, ``"1"``... for a list; the keys of a dict).
        self.optimizers: dict[str, torch.optim.Optimizer] = named(
            "optimizer", optimizer, torch.optim.Optimizer
        )
        #: The first optimizer: its steps are the guard's steps.
        self.optimizer = next(iter(self.optimizers.values()))
        self.loader = loader
        #: Every scheduler by name, like :attr:`optimizers` (empty without one).
        self.schedulers: dict[str, Any] = (
            {} if scheduler is None else named("scheduler", scheduler, object)
        )
        self.scheduler = next(iter(self.schedulers.values()), None)
        # accelerate's fp16 GradScaler lives in its prepared optimizer: checkpointed
        # like one passed here (a resume without it restarts the loss scale).
        if scaler is not None:
            check_scaler("guard(scaler=...)", scaler)
        self.scaler = scaler if scaler is not None else dist.own_scaler(self.optimizer)
        #: The loop's own ``torch.Generator``s by name (batches or noise drawn without a
        #: loader): their states are saved per rank and set back on these objects at
        #: resume. The loader's and sampler's own generators need not be passed.
        self.generators: dict[str, torch.Generator] = (
            {} if generators is None else named("generator", generators, torch.Generator)
        )
        #: Their states as the last step left them (what checkpoints save); ``None``
        #: before the first step and after a resume (then: as they are).
        self.generator_states: dict[str, Tensor] | None = None
        #: The user's own state, saved in every checkpoint and restored on resume
        #: (JSON values and tensors: ``g.state["best_val"] = 1.23``).
        self.state: dict[str, Any] = {}

    def _build_step_parts(self) -> None:
        """The objects a step reads through, each owning its state, and the step's own
        flags."""
        self._norm = GradNorm(self._params, use_graph=self.graph_grad_norm)
        self._norm.scaled = self.scaler is not None and self.scaler.is_enabled()
        # To recognise a torch.nn.utils.clip_grad_norm_ over exactly these parameters
        # (whose norm then is the step's: _took_clip_norm), in any order.
        self._param_ids = frozenset(map(id, self._params))
        self._clip_order: tuple[int, ...] = ()  # another order of them, seen in a clip
        #: Steps whose norm came from the loop's own clip_grad_norm_ (the end event).
        self.clip_norm_steps = 0
        self._norm_shared = False  # this step's norm is the clip's
        self._grad_norm: Tensor | None = None
        # Each step's (loss, grad norm, skipped) row, written once for every component
        # that judges or records it (step_row()); its count this step, or None.
        self._ring = StepRing(self.device)
        self._row: int | None = None
        #: The data position (``engine/data.py``): the batches fetched and trained,
        #: what a checkpoint saves of the loader and a resume continues.
        self.data_position = DataPosition(self)
        # The buffers a training forward writes in place (BatchNorm's running
        # statistics) and their copies from before the step's first forward: what a
        # skipped step puts back (engine/buffers.py).
        self._shadow = BufferShadows(self.model, self.models, self.optimizers)
        # The step's losses, on the device (engine/losses.py), cleared after each step.
        self._losses = LossRecord()
        # The step's phases on the host clock, and on the device on sampled steps
        # (anatomy.py): what the guard publishes as forward_s, backward_s...
        self._anatomy = StepAnatomy()
        # The wrappers of the user's forward, step, backward and scaler, and the
        # switches they read (skip, quiet, replaying): installed at start (wrappers.py).
        hooks = StepHooks(
            on_forward=self._on_forward,
            forward_done=self._forward_done,
            before_step=self._before_step,
            after_step=self._after_step,
            before_extra_step=self._before_extra_step,
            after_extra_step=self._after_extra_step,
            put_back=self._put_back,
            scaler_skipped=self._scaler_skipped,
            took_clip_norm=self._took_clip_norm,
        )
        self._wrappers = UserWrappers(self, hooks, self._losses, self._norm)
        self._at_boundary = False
        #: The RNG streams and data position the last step boundary left
        #: (``engine/boundary.py``): what a failure save inside the next step writes.
        self.boundary_capture = BoundaryCapture()
        self._forward_seen = False  # a training forward since the last step
        # Fire the boundary at the next training forward too, not only at the next
        # fetch: set at each step from what the loop does (see the module docstring).
        self._fire_on_forward = True
        self._one_optimizer = len(self.optimizers) == 1  # read each step: no len() call
        # (tensor, version) of the step's forward arguments, to notice a loader that
        # refills them in place; then copy them instead (see _check_refill).
        self._arg_versions: list[tuple[Tensor, int]] = []
        self._copy_inputs = False
        self._tokens: int | None = None  # the step's tokens so far
        self._loss_checked = False  # the first step said whether a loss was recorded
        self._scaler_warned = False
        self._warned_not_iterated = False

    def _build_lifecycle(self) -> None:
        """What start() fills in and close() empties: the job, the events, the hooks."""
        self.rank = 0
        self.world_size = 1
        self.events: EventLog | None = None
        self._state = "new"  # new -> started -> closed
        self._closing = False  # close() is running: its components' on_end
        self._news_threads: list[threading.Thread] = []  # on_news calls during the close
        # Held by rank 0 from start to close: one run per run_dir, and per directory
        # outside it a component writes into (rundir.py).
        self._run_locks: list[rundir.RunLock] = []
        self._handles: list[Any] = []
        self._dispatch: dict[str, list[Callable[..., Any]]] = {h: [] for h in HOOKS}
        # The per-step hooks this step runs: the same table as _dispatch, except on the
        # steps benchmark mode samples with some components bypassed (benchmark_mode.py).
        self._live = self._dispatch
        self._bench: Any = None
        # The step whose after_step hooks raised (set on that error path only), and
        # when the guard began to close or abort: what open_row() reports.
        self._after_step_failed = -1
        self._ending_at = math.nan
        #: This guard's number among the guards started in this process (the same on
        #: every rank), which namespaces its side-channel keys.
        self.generation = -1
        #: A gloo group over every rank for rare agreements (see
        #: ``distributed/store.py``), or ``None`` in a single-process run. Never the
        #: training's group.
        self.side_group: Any = None
        #: This guard's run id: 12 hex digits drawn by rank 0, the same on every rank
        #: (and on the ``start`` event), so job-unique names need no exchange of their own.
        self.run_id = ""
        #: The job's news counter (``distributed/store.py``'s :class:`News`): what
        #: components post after writing something for the other ranks and poll
        #: instead of each polling its own keys. ``None`` in a single process.
        self.news: store.News | None = None
        self._replacement: BaseException | None = None
        # An error found by a background thread, raised by the main thread at its next
        # step boundary (see fail_from_thread).
        self._pending: BaseException | None = None
        # Functions iterator -> iterator applied in order to each pass's iter(loader),
        # added by components at start through wrap_batches(): once per pass.
        self._batch_wrappers: list[Callable[[Iterator[Any]], Iterator[Any]]] = []

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> Guard:
        """Install the hooks and start every component. Returns ``self``."""
        if self._state != "new":
            raise ValueError(
                f"this guard is already {self._state}; a Guard runs once. "
                "Build a new one with guardrails.guard(...) for another loop."
            )
        global _running
        if _running is not None:
            raise ValueError(
                f"another guard is already running in this process ({_running!r}); one "
                "guard guards one loop. Two guards would both checkpoint (resuming their "
                "models from different steps) and fight over the garbage collector and "
                "the signal handlers. Pass every model and optimizer to one guard: "
                "guardrails.guard([gen, disc], [opt_g, opt_d], loader) (or dicts by "
                "name); close the first guard before starting another."
            )
        self.rank = dist.rank()
        self.world_size = dist.world_size()
        # A run_dir that is a file, below a file or not writable by this user is a
        # setup mistake: refused here, before step one. A full or read-only disk does
        # not stop the guard: the events log says so and keeps its events in memory
        # (metrics/events.py); only a checkpoint needs the disk.
        rundir.check(self.run_dir, self.rank)  # mkdir -p: never group/other-writable
        self.events = EventLog(self.run_dir, rank=self.rank)
        self._state = "started"
        _running = self
        # A flat script's `g = guard(...).start()` whose loop ends by an exception never
        # reaches its g.close(): close at the interpreter's exit instead.
        atexit.register(self._close_at_exit)
        try:
            lifecycle.join_job(self)
            lifecycle.install(self)
        except BaseException as exc:
            self.close(exc)
            raise
        return self

    def close(self, exc: BaseException | None = None) -> None:
        """Stop every component (in reverse order) and remove every hook. Idempotent.

        A component that fails while closing does not stop the others from closing;
        its error is raised afterwards, unless the loop is already failing with
        ``exc``, which then stays the error the user sees, or becomes the one a
        component explained it with (:meth:`replace_error`), raised ``from exc``.
        """
        global _running
        if self._state != "started":
            self._state = "closed"
            return
        self._state = "closed"
        self._wrappers.open = False  # the class-wide wrappers pass calls through now
        if _running is self:
            _running = None
        atexit.unregister(self._close_at_exit)
        # Ending with an error, or with a signal stop's non-zero exit: the diagnosis (the
        # auditor's, the watchdog's) or the last save is finished while closing, and a
        # launcher's SIGTERM (torchrun sends one to every rank as soon as one exits)
        # must not end the process in the middle of it: it showed as -15 on a rank that
        # had saved, or as no report at all.
        failing = exc is not None and not isinstance(exc, KeyboardInterrupt)
        if isinstance(exc, SystemExit):
            failing = exc.code not in (0, None)
        if failing:
            process.hold_signals()
        self._ending_at = time.time()  # the time of the open step's row (open_row())
        self._closing = True
        try:
            lifecycle.close(self, exc)
        finally:
            self._closing = False
            locks, self._run_locks = self._run_locks, []
            for held in locks:  # after the last save: the run_dir is free
                held.release()
            if failing and not process.recording:  # else @record releases, after its report
                # A SIGTERM that came meanwhile is dropped, not raised again: the error
                # is on its way out to the loop's code (its handler, then the process's
                # exit), which a re-raised SIGTERM would kill before it could run.
                process.release_signals(deliver=False)

    def die(self, error: BaseException, *, exit_code: int | None = None) -> None:
        """From a background thread, when the main thread cannot be reached (stuck in a
        collective, a C call, a loader): end the process now with ``error`` reported,
        after the components' last words (``lifecycle.die``), so a run guardrails ends
        never looks like one the OOM killer took."""
        lifecycle.die(self, error, exit_code=exit_code)

    def _last_words(self, error: BaseException) -> None:
        lifecycle.last_words(self, error)

    def _close_at_exit(self) -> None:
        # A bound method of its own: atexit.unregister() finds it by equality.
        lifecycle.close_at_exit(self)

    def replace_error(self, error: BaseException) -> None:
        """From a component's ``on_end``: when the loop failed, raise ``error`` instead
        of the loop's exception once the guard has closed, chained ``from`` it (the
        original stays its ``__cause__``). For errors that explain another, like an
        out-of-memory error with the memory summary. The first call wins."""
        if self._replacement is None:
            self._replacement = error

    # ------------------------------------------------------------------ services
    # What a component asks of the engine instead of writing its state (state.py).

    @property
    def running(self) -> bool:
        """Whether the guard is started and not closed yet."""
        return self._state == "started"

    def component(self, name: str) -> Component | None:
        """This guard's component named ``name`` (names are unique), or ``None``."""
        return next((c for c in self.components if c.name == name), None)

    def save_checkpoint(self) -> Path:
        """Save a complete checkpoint now, synchronously, into ``run_dir/checkpoints``;
        returns its directory. Call it at the same step on every rank, between steps
        (not between a backward and its ``optimizer.step()``). Asked of the component
        that saves checkpoints (``Component.saves_checkpoints``)."""
        saver = next((c for c in self.components if c.saves_checkpoints), None)
        if self._state != "started" or saver is None:
            raise ValueError(
                "save_checkpoint() needs a started guard that saves checkpoints (the "
                "default, unless guard(..., checkpoint=False))"
            )
        return saver.save(self)

    def side_store(self, name: str) -> Any:
        """A store for this guard's side-channel keys under ``name`` (see
        ``distributed/store.py``), or ``None`` when not distributed."""
        return store.side_store(self.generation, name)

    def pause_watchdog(self, reason: str = "paused") -> contextlib.AbstractContextManager[None]:
        """Mark a long, legitimate pause (evaluation, a big save) so the watchdog does
        not call this rank stuck::

            with g.pause_watchdog("eval"):
                evaluate(model)
        """
        return temporarily(self, "paused", reason)

    def in_phase(self, phase: str) -> contextlib.AbstractContextManager[None]:
        """Components: the main thread is in ``phase`` inside this block (``"agree"``:
        a guardrails agreement between ranks), so a hang or an error there is reported
        as such; the loop's phase is back afterwards."""
        return temporarily(self, "phase", phase)

    def quiet(self) -> contextlib.AbstractContextManager[None]:
        """Components: ``optimizer.step()`` calls inside this block are not training
        steps (a sharded resume's ``set_state_dict`` steps the optimizer with zero
        gradients to create its state): not counted, not seen by components."""
        return temporarily(self._wrappers, "quiet", True)

    def replaying(self) -> contextlib.AbstractContextManager[None]:
        """Components: forwards inside this block re-run a step to diagnose it; they
        are not training forwards (their loss is not the step's, their inputs not
        recorded)."""
        return temporarily(self._wrappers, "replaying", True)

    def request_stop(self, reason: str, *, exit_code: int | None = None) -> None:
        """Components: end ``for batch in g`` at the next step boundary, ``reason`` in
        :attr:`stopping`; with ``exit_code``, the process exits with it once the guard
        has closed (a signal save: 128 + signum)."""
        self.stopping = reason
        if exit_code is not None:
            self.exit_code = exit_code

    def record_skip(self, flag: Tensor) -> None:
        """Components, in ``before_step``: this step's skip decision as a 0-d device
        tensor (non-zero: the update is left out, see :meth:`skip_update`), published
        as :attr:`skipped` for the components that record it; reset after the step."""
        self.skipped = flag

    def wrap_batches(self, wrap: Callable[[Iterator[Any]], Iterator[Any]]) -> None:
        """Components, at start: apply ``wrap`` (iterator -> iterator) to each pass's
        ``iter(loader)``, after the wrappers added before it. Once per pass, nothing
        per batch (the preflight's first-batch check, ``even_batches``' cut)."""
        self._batch_wrappers.append(wrap)

    def resume_from(
        self,
        step: int,
        *,
        state: Mapping[str, Any] | None = None,
        position: dict[str, Any] | None = None,
        tensors: dict[str, Tensor] | None = None,
    ) -> None:
        """The checkpointer, at start: continue from a checkpoint of step ``step``:
        the user's :attr:`state`, the data position the first pass continues from
        (``position`` and its ``tensors``, as ``DataPosition.save`` wrote them) and the
        loop's :attr:`generators` (``generator.<name>`` in ``tensors``)."""
        self.step = step
        if state is not None:
            self.state.clear()
            self.state.update(state)
        for name, gen in self.generators.items():  # guard(generators=), checked already
            if tensors is not None and f"generator.{name}" in tensors:
                gen.set_state(tensors[f"generator.{name}"].clone())
        self.generator_states = None  # as they are now, until the next step
        if position is not None and self.loader is not None:
            self.epoch = self.data_position.load(position, tensors or {})

    def rewind_to(self, step: int) -> None:
        """The rewind guard, at a step boundary, once it has set the model, optimizers,
        schedulers and scaler back to their state after step ``step``: the step count
        goes back to it (the update count of the weights now held, so a scheduler set
        back with them agrees), and every component's ``on_rewind`` forgets what it
        observed of the steps after it. The data is not rewound: the loader goes on
        from where it is (see :meth:`drop_batches`)."""
        if not 0 <= step <= self.step:
            raise ValueError(f"rewind_to({step}) at step {self.step}: a rewind goes back")
        from_step, self.step = self.step, step
        self.generator_states = None  # as they are now (the loop's generators go on)
        self._anatomy.arm(step)  # the next step's device sample, by its new number
        for fn in self._dispatch["on_rewind"]:
            fn(self, from_step)

    def drop_batches(self, n: int) -> None:
        """Components: fetch the loader's next ``n`` batches and drop them (not handed
        to the loop, not trained on); they count in the data position, so a resumed run
        drops them too. A drop still pending is saved in checkpoints."""
        self.data_position.drop += int(n)

    def fail_from_thread(self, error: BaseException, *, abort_after_s: float = 5.0) -> bool:
        """From a background thread (watchdog, auditor): make the main thread raise
        ``error`` at its next step boundary (next batch or next ``optimizer.step()``).
        If it has not within ``abort_after_s`` (it is stuck in a collective or a C call
        that Python cannot interrupt), end the process with the error reported, so the
        launcher tears the job down instead of waiting for NCCL's timeout.

        Returns whether ``error`` was taken: ``False`` when another error is already on
        its way (the first one is the diagnosis) or the guard is not running. While the
        guard closes, ``error`` is news to the closing components, and ends the process
        only if the close does not finish (``lifecycle.during_close``)."""
        if self._closing:
            lifecycle.during_close(self, error, after_s=abort_after_s)
        if self._pending is not None or self._state != "started":
            return False
        self._pending = error
        self.verdict_at = time.monotonic()

        def last_resort() -> None:
            if self._pending is error and self._state == "started":
                self.die(error)

        timer = threading.Timer(abort_after_s, last_resort)
        timer.daemon = True
        timer.start()
        return True

    def _raise_pending(self) -> None:
        error, self._pending = self._pending, None  # None: the timer stands down
        assert error is not None
        raise error

    def __enter__(self) -> Guard:
        return self.start()

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        self.close(exc)

    # ------------------------------------------------------------------ the loop

    def __iter__(self) -> Iterator[Any]:
        if self._state != "started":
            raise ValueError(
                "iterating a guard that is "
                + ("closed" if self._state == "closed" else "not started")
                + ": use `with guardrails.guard(model, opt, loader) as g: for batch in g:`"
                " or call g.start() first, and build a new guard for each run."
            )
        if self.loader is None:
            raise ValueError(
                "this guard has no loader to iterate: pass it, "
                "guardrails.guard(model, opt, loader), or keep iterating your own data "
                "inside the `with` block (steps are still observed through the optimizer)."
            )
        # The loop's frame: its epoch counter.
        self.data_position.note_pass(sys._getframe(1))
        return self._batches(self.loader)

    def _batches(self, loader: Iterable[Any]) -> Iterator[Any]:
        if self.stopping is not None:
            return
        pos = self.data_position
        if not pos.resuming and self.batch_in_epoch:
            self.epoch += 1  # the last pass was left mid-way (a break): a new one
        # A resumed pass continues where it stopped, a new one from its first batch.
        it, resumed_at = pos.begin_pass(loader)
        self.batch_in_epoch = 0 if resumed_at is None else resumed_at
        for wrap in self._batch_wrappers:
            it = wrap(it)
        self.exhausted_at = None
        clock, anatomy = time.perf_counter, self._anatomy
        while True:
            if self._at_boundary:  # _boundary() inline: the common place it fires
                self._at_boundary = False
                self.update_began = False
                cap = self.boundary_capture  # what a failure save inside the next step writes
                cap.torch = tuple(map(_get_state, cap.generators))
                cap.trained_at, cap.epoch, cap.held = pos.trained_at, self.epoch, len(pos.fetched)
                cap.count += 1
                if cap.count & _CHECK_MASK == 1 or cap.drawing:
                    cap.check()
                for fn in self._live["on_boundary"]:
                    fn(self)
                if self.stopping is not None:
                    return
            self.phase = "data"
            fetches = self.boundary_capture.fetches  # None unless the copy asked
            if fetches is not None and not pos.fetched:
                fetches.before(self.boundary_capture.count)
            t0 = clock()
            try:
                batch = next(it)
            except StopIteration:
                self.phase = "loop"
                self.exhausted_at = (self.epoch, self.batch_in_epoch)
                self.epoch += 1  # set_epoch(g.epoch) before the next pass gets its number
                self.batch_in_epoch = 0
                return
            anatomy.data_wait_s += clock() - t0
            self.batch_in_epoch += 1
            pos.n_fetched += 1
            if pos.drop:  # a rewind skips past these (drop_batches)
                pos.drop -= 1
                continue
            pos.fetched.append(batch)
            if fetches is not None and len(pos.fetched) == 1:
                fetches.after()
            versions = self._arg_versions
            if versions and not self._copy_inputs:
                # Inline, not a call: this runs at every fetch (see _check_refill).
                self._arg_versions = []
                for t, v in versions:
                    if t._version != v:
                        self._check_refill(versions)
                        break
            self.phase = "loop"
            if self._pending is not None:
                self._raise_pending()
            if self._state != "started":
                raise ValueError("the guard was closed while its loop was running")
            n = self.tokens_per_batch if self.tokens_per_batch is not None else tokens_in(batch)
            if n is not None:
                self._tokens = n if self._tokens is None else self._tokens + n
            for fn in self._live["on_batch"]:
                fn(self, batch)
            yield batch

    def observe(self, loss: Tensor | float) -> None:
        """Record this micro-batch's loss, for models that do not return it.

        Call once per forward/backward; with gradient accumulation the step's loss is
        the mean of the observed values. Never syncs: the value stays on the device.
        An explicit ``observe`` in a step takes precedence over a loss picked up from
        the model's output.
        """
        self._losses.observe(loss, self.device)

    def _check_loss_recorded(self) -> None:
        """The end of the first step: say once, with the fix, when no loss reached the
        guard (the progress bar, metrics and report would show none)."""
        self._loss_checked = True
        if self._losses.any() or len(self.optimizers) > 1:
            return
        self.event(
            "no_loss",
            level="warning",
            message=(
                f"no loss was recorded at step {self.step}: the model returns none and no "
                "scalar loss.backward() ran in the step (torch.autograd.backward, "
                "autograd.grad, or a backward with an explicit gradient), so the progress "
                "bar, the metrics and the report show no loss and loss spikes are not "
                "judged. Hand it over: g.observe(loss) once per micro-batch."
            ),
        )

    def _check_refill(self, versions: list[tuple[Tensor, int]]) -> None:
        """After a fetch, ``versions`` (a training forward's tensors and their version
        counters then) showed a tensor written in place since: a loader that refills
        one buffer per batch (nanochat's yields views of a reused device buffer). Then
        the step's recorded inputs would show later data, so from now on each training
        forward's tensor arguments are copied (one device copy each; reported once)."""
        changed = [t for t, v in versions if t._version != v]
        self._copy_inputs = True
        nbytes = sum(t.numel() * t.element_size() for t in changed)
        self.event(
            "inputs_refilled",
            message=(
                "the loader wrote a batch the model had already trained on in place (it "
                "reuses one buffer): guardrails now keeps a copy of each training "
                f"forward's tensor arguments ({nbytes / 1e6:.2f} MB a micro-batch, held "
                "for about 20 steps on a GPU) so that a non-finite step's report shows "
                "the data the step saw."
            ),
            bytes=nbytes,
        )

    def _boundary(self) -> None:
        """The last step's loop body is done and the next step has not started: run
        the components' ``on_boundary`` (checkpoints, stop agreement). What the
        boundary leaves of the RNG and the data position is captured first (inline in
        ``_batches`` too): a failure inside the next step saves it (engine/boundary.py)."""
        self._at_boundary = False
        self.update_began = False
        cap = self.boundary_capture
        cap.torch = tuple(map(_get_state, cap.generators))
        pos = self.data_position
        cap.trained_at, cap.epoch, cap.held = pos.trained_at, self.epoch, len(pos.fetched)
        cap.count += 1
        if cap.count & _CHECK_MASK == 1 or cap.drawing:
            cap.check()
        for fn in self._live["on_boundary"]:
            fn(self)

    def _on_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict) -> bool:
        """Before a wrapped forward runs: whether it is a training forward (grad enabled,
        module in train mode, not NanGuard's replay); if so, record its inputs, the data
        position it trains at, and fire a pending step boundary where the loop's shape
        calls for it (before the forward draws from the RNG)."""
        # Evaluation passes (no_grad or eval mode) are not training forwards.
        if self._wrappers.replaying or not module.training or not torch.is_grad_enabled():
            return False
        if self._at_boundary and self._fire_on_forward:
            self._boundary()
        if not self._forward_seen:  # the step's first forward
            self._forward_seen = True
            if self.forward_compiled is None:  # the run's first: once
                self.forward_compiled = where.under_compiled_code()
            anatomy = self._anatomy
            anatomy.compute_t0 = time.perf_counter()
            anatomy.data_at_compute = anatomy.data_wait_s
            if anatomy.marks is not None:  # a sampled step: its forward on the device
                anatomy.marks[0].record()
                anatomy.fwd_mark = anatomy.marks[1]
            self._arg_versions = []
            # The buffers before the step (one fused copy, no sync; none for a model
            # whose forward writes no buffer): what a skipped step puts back.
            if self._shadow.active:  # inline: no frame per step for most models
                self._shadow.snapshot()
        # A norm shared by a clip before this forward (a clip per micro-batch) is not
        # the norm of the gradients this step will apply.
        self._grad_norm = None
        self._norm_shared = False
        if self._copy_inputs:
            # The loader refills its buffers in place: keep what this forward saw.
            args = tuple(a.clone() if isinstance(a, Tensor) else a for a in args)
            kwargs = {k: v.clone() if isinstance(v, Tensor) else v for k, v in kwargs.items()}
        else:
            versions = self._arg_versions  # a loop, not a list comprehension's frame
            for a in args:
                if isinstance(a, Tensor):
                    versions.append((a, a._version))
        self.step_calls.append((module, args, kwargs))
        pos = self.data_position
        if pos.fetched:  # the batches fetched since the last forward are this step's
            self.step_batches += pos.fetched
            pos.fetched = []
        pos.trained_at = (self.epoch, self.batch_in_epoch, pos.epoch_start)
        return True

    def _forward_done(self, output: Any, t0: float) -> None:
        """After a training forward that began at ``t0`` (``perf_counter``): its time,
        a sampled step's device mark, its loss (one frame: it runs every forward)."""
        anatomy = self._anatomy
        anatomy.forward_s += time.perf_counter() - t0
        if anatomy.fwd_mark is not None:  # a sampled step's first forward ended
            anatomy.fwd_mark.record()
            anatomy.fwd_mark = None
        # Two C calls (~0.2 us): fp16 autocast is the one that overflows at 65504;
        # bf16's is the compute dtype the efficiency advisor judges.
        if torch.is_autocast_enabled(self._device_type):
            dtype = torch.get_autocast_dtype(self._device_type)
            if dtype == torch.float16:
                self.fp16_autocast = True
            elif dtype == torch.bfloat16:
                self.bf16_autocast = True
        # A bare loss tensor (the common output) without find_loss's frame.
        if type(output) is Tensor:
            loss = output if _is_loss(output) else None
        else:
            loss = _find_loss(output)
        if loss is None:
            return
        loss = loss.detach()
        losses = self._losses  # the record's sum, inline: one frame fewer per forward
        losses.auto = loss if losses.auto is None else losses.auto + loss
        losses.auto_n += 1

    # ------------------------------------------------------------------ per-step values

    @property
    def collective(self) -> dict[str, Any] | None:
        """The collective the main thread is inside now (``guard.shared.collective``)."""
        return self.shared.collective

    @property
    def auditor(self) -> CollectiveRecorder | None:
        """The running CollectiveAuditor, or ``None`` (``guard.shared.auditor``): what
        it offers the other components is ``engine/services.CollectiveRecorder``."""
        return self.shared.auditor

    @property
    def gc_total_s(self) -> float:
        """Seconds in Python's GC since start, timed by the GCScheduler
        (``guard.shared.gc_total_s``)."""
        return self.shared.gc_total_s

    @property
    def step_loss(self) -> Tensor | None:
        """This step's loss as a 0-d tensor on the guard's device: the mean of what
        :meth:`observe` was given, else the mean of the losses the model returned, else
        the sum of the losses the step backpropagated (``loss.backward()``, with
        ``(loss / accum).backward()`` the mean micro-batch loss); ``None`` when none of
        these happened. Computed once per step (``engine/losses.py``) and shared by the
        components."""
        return self._losses.compute(self.device)

    def grad_norm(self) -> Tensor:
        """The total L2 norm of the gradients at this step, a 0-d float32 device tensor.

        Computed once per step (``engine/gradnorm.py``): on one GPU by one kernel over the
        gradients' addresses, on CPU by one flat copy of a small model's gradients,
        elsewhere by a fused ``_foreach_norm`` (one kernel per device and dtype), or
        taken from the loop's ``clip_grad_norm_`` or GuardedDDP's
        buckets; shared by every component and by :meth:`clip_grad_norm_`. Valid from
        ``before_step`` on.
        """
        if self._grad_norm is None:
            self._grad_norm = self._norm(self._params, self.step)
        return self._grad_norm

    @property
    def step_ring(self) -> StepRing:
        """The ring of each step's (loss, grad norm, skipped) rows that NanGuard and
        Telemetry share (``engine/lagged.StepRing``): a component that reads it on the
        host registers a reader at start (``g.step_ring.reader(every_n_steps)``)."""
        return self._ring

    def open_row(self) -> OpenRow | None:
        """Components, at close (``on_end``) or abort (``on_abort``): the step the run
        ended inside, when its row is in :attr:`step_ring` (its loss and grad norm were
        computed) but the step never got through ``after_step``, so a component that
        records rows there may not have: a ``before_step`` hook raised (NanGuard's
        ``NonFiniteError``), the optimizer's own ``step()`` raised or never returned, or
        an ``after_step`` hook raised (``finished``). ``None`` when the run ended
        between steps. Nothing is computed here: the row is what was written."""
        row = self._row
        if row is None:
            return None
        finished = self._after_step_failed == self.step
        step = self.step if finished else self.step + 1
        ending_at = self._ending_at if self._ending_at == self._ending_at else time.time()
        return OpenRow(step, row, finished, ending_at)

    def step_row(self) -> int:
        """Write this step's row into :attr:`step_ring` if no component did yet:
        ``(step_loss, grad_norm(), 0)``, one ``torch.stack`` on a device, the two values
        read from host memory on a CPU; return its count. Valid from ``before_step`` on;
        the skipped slot is ``step_ring.flags[step_ring.i]``."""
        if self._row is None:
            norm = self._grad_norm  # grad_norm() inline: one frame fewer per step
            if norm is None:
                norm = self._grad_norm = self._norm(self._params, self.step)
            # The record's mean (once a step), without step_loss's property frame.
            self._row = self._ring.write(self._losses.compute(self.device), norm)
        return self._row

    @property
    def params(self) -> list[nn.Parameter]:
        """The parameters whose gradients the step's :meth:`grad_norm` covers (the
        first optimizer's)."""
        return self._params

    def total_norm(self, grads: list[Tensor]) -> Tensor:
        """The total L2 norm of ``grads`` computed as the step's is (fused, on the
        guard's device, across devices for a model-parallel model): for another
        optimizer's gradients. A 0-d float32 device tensor; no sync."""
        return total_norm(grads, self.device, self._norm.multi_device)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the model's parameters, sharing its
        norm with the guard so clipping and monitoring cost one pass, not two.

        Returns the total norm before clipping (a device tensor; no sync).
        """
        total = torch.nn.utils.clip_grad_norm_(self._params, max_norm, norm_type)
        if float(norm_type) == 2.0 and self._grad_norm is None:  # unless shared already
            self._grad_norm = total.float()
        return total

    def _took_clip_norm(self, parameters: list[Any], total: Tensor) -> None:
        """A ``clip_grad_norm_`` (L2) just clipped ``parameters`` with ``total``: make it
        the step's norm when it is provably the one :meth:`grad_norm` would compute.

        Exactly the guard's parameters (an identity check at C speed, ~30 ns a tensor;
        a GAN's other model or a subset is not), after this step's last training
        forward (``_on_forward`` drops it if another follows: a clip per micro-batch),
        on the guard's device (model parallel: torch's total is on the first
        gradient's), and not over gradients a GradScaler still has to unscale (a clip
        before ``scaler.unscale_``: the norm of scaled gradients)."""
        params = self._params
        if (
            self._state != "started"
            or not self._forward_seen
            or len(parameters) != len(params)
            or total.device != self.device
            or hasattr(total, "full_tensor")  # DTensor: the guard's own norm reduces it
        ):
            return
        if not all(map(operator.is_, parameters, params)):
            # Another order (nanoGPT's decay / no-decay groups): the same set, once
            # checked, is then recognised by its order (a tuple compare: 110 us at
            # 1,500 tensors on a CPU host, against 430 us to build a set).
            order = tuple(map(id, parameters))
            if order != self._clip_order:
                if len(set(order)) != len(order) or not self._param_ids.issuperset(order):
                    return
                self._clip_order = order
        scaler = self.scaler
        if scaler is not None and scaler.is_enabled() and not dist.unscaled(scaler, self.optimizer):
            return
        self._grad_norm = total if total.dtype == torch.float32 else total.float()
        self._norm_shared = True

    def event(
        self,
        kind: str,
        *,
        level: str = "info",
        message: str = "",
        step: int | None = None,
        ends_run: bool = False,
        **fields: Any,
    ) -> None:
        """Append an event to this node's ``run_dir/events.<host>.jsonl`` (and the
        logger of the module that calls this: ``guardrails.<part>``). ``step`` defaults to the steps
        completed so far. ``ends_run``: the message is the error about to end the run,
        printed whole by its report: the log gets its head line only, and only where
        logging is configured (:meth:`EventLog.emit`)."""
        if self.events is not None:
            step = self.step if step is None else step
            log = logger_of(sys._getframe(1))
            self.events.emit(
                kind, step=step, level=level, message=message, log=log, ends_run=ends_run, **fields
            )

    # ------------------------------------------------------------------ optimizer hooks

    def skip_update(self, *, where: Tensor | None = None) -> None:
        """From a component's ``before_step`` / ``before_extra_step``: do not call this
        optimizer step at all (the wrapper returns ``None`` without calling it), so
        weights and optimizer state stay bitwise as they were whatever the optimizer
        does with its gradients. The step still counts and ``after_step`` runs.

        The buffers the step's training forwards wrote (BatchNorm's running
        statistics) are put back as they were before its first forward, bitwise: those
        of the models this optimizer trains (:meth:`restored_buffers_of`). So are they
        when a GradScaler leaves the step out and a component calls this from the same
        hooks (a NaN batch, not an overflow).

        ``where``: the optimizer is called and leaves the update out itself, on the
        device, where this 0-d tensor is non-zero (a fused optimizer's ``found_inf``);
        the buffers are put back by the same flag, on the device, without reading it.
        """
        if where is None:
            self._wrappers.skip = True
        else:
            self._wrappers.skip_where = where

    @property
    def restored_buffers(self) -> list[str]:
        """The model's buffers a training forward writes (BatchNorm's running
        statistics, found at the first step), which a skipped step puts back as they
        were before its first forward (several optimizers: the buffers of the models
        that optimizer trains, :meth:`restored_buffers_of`). Empty before the first step
        and for models whose forward writes no buffer."""
        return self._shadow.names

    def restored_buffers_of(self, optimizer: str) -> list[str]:
        """The :attr:`restored_buffers` a skip of ``optimizer`` (its name) puts back."""
        return self._shadow.names_of(optimizer)

    def nonfinite_buffers(self) -> list[str]:
        """The names of the :attr:`restored_buffers` holding a NaN or an Inf now (one
        host read: call it rarely, e.g. before reporting a recovery)."""
        return self._shadow.nonfinite()

    def _put_back(self, optimizer: str) -> None:
        """After ``optimizer``'s before-step hooks: the buffers its skip puts back
        (:meth:`skip_update`), whoever skips it (a component, or its GradScaler)."""
        switches = self._wrappers
        self._shadow.put_back(
            optimizer, skip=switches.skip, where=switches.skip_where, this_step=self._forward_seen
        )
        switches.skip_where = None

    def _before_step(self) -> None:
        self.phase = "optimizer"
        anatomy = self._anatomy
        now = anatomy.optimizer_t0 = time.perf_counter()
        if anatomy.marks is not None:
            anatomy.marks[2].record()
        if self._pending is not None:
            self._raise_pending()
        if self._at_boundary:
            # Neither a fetch nor a training forward since the last step (several
            # steps per batch, or a model called around the guard's wrapper): the
            # boundary is due now at the latest, before this update.
            self._boundary()
        if self._shadow.pending:
            self._shadow.settle()  # the run's first optimizer step, once
        if not self._forward_seen:  # no forward observed: the fetch position it is
            pos = self.data_position
            pos.trained_at = (self.epoch, self.batch_in_epoch, pos.epoch_start)
            self.step_batches += pos.fetched
            pos.fetched = []
        self.data_wait_s = anatomy.data_wait_s
        self.forward_s = anatomy.forward_s
        # From the first training forward to this step: what is neither a forward nor a
        # wait for the loader (a prefetch, or the next micro-batch's fetch) is the
        # backward, with the loss, the gradients' all-reduce and clipping.
        self.backward_s = (
            now
            - anatomy.compute_t0
            - anatomy.forward_s
            - (anatomy.data_wait_s - anatomy.data_at_compute)
            if self._forward_seen
            else math.nan
        )
        self.tokens = self._tokens
        lr = self.optimizer.param_groups[0].get("lr", math.nan)
        self.lr = lr if type(lr) is float else current_lr(self.optimizer)  # a float: no call
        for fn in self._live["before_step"]:
            fn(self)
        # After the components' hooks (the ranks' agreement on a bad step waits in a
        # collective there, the weights untouched): the optimizer's own update is next,
        # and from here the live state leaves the last finished step's.
        self.update_began = True
        if self.boundary_capture.updates is not None:  # CUDA: where the device is
            self.boundary_capture.updates.began(self)

    def _after_step(self) -> None:
        self.step += 1
        if self.boundary_capture.updates is not None:  # CUDA: the update is queued
            self.boundary_capture.updates.ended(self.step)
        if self.generators:
            # What a checkpoint saves of them: where the step left them, not where they
            # are at the boundary, which a loop without a loader reaches at the next
            # forward, after drawing the next batch (one get_state each: 0.6 us on a CPU).
            self.generator_states = {n: g.get_state() for n, g in self.generators.items()}
        now = time.perf_counter()
        anatomy = self._anatomy
        self.step_time_s = now - anatomy.step_start
        self.optimizer_s = now - anatomy.optimizer_t0
        anatomy.step_start = now
        if anatomy.marks is not None:  # a sampled step's end (CUDA)
            sample = anatomy.end_sampled(self.step, forward_seen=self._forward_seen)
            if sample is not None:
                self.device_phases = sample
        try:  # free unless it raises (zero-cost try, Python 3.11+)
            for fn in self._live["after_step"]:
                fn(self)
        except BaseException:
            # The step's update is done but a component ended the run in after_step
            # (NanGuard's lagged raise, a failed agreement): open_row() then reports this
            # step as finished (its step time is known), not as the one to come.
            self._after_step_failed = self.step
            if self._row is None:
                # No component wrote the step's row before the one that raised: its
                # loss and gradients are still the update's (nothing ran since), so
                # write it now, on this error path only, for the components to record.
                try:
                    self.step_row()
                except Exception as err:  # a broken device: the run's own error goes on
                    logger.debug(
                        "guardrails: step %d's row could not be written: %s", self.step, err
                    )
            raise
        if self._bench is not None:  # benchmark mode picks the next step's hooks
            self._live = self._bench.after_step(self)
        if self._norm_shared:
            self.clip_norm_steps += 1
            self._norm_shared = False
        if not self._loss_checked:
            self._check_loss_recorded()
        self._losses.__dict__.clear()  # LossRecord.clear() inline: one C call, no frame
        self._grad_norm = self._row = self.skipped = None
        anatomy.data_wait_s = anatomy.forward_s = 0.0
        self._tokens = None
        # New lists, not cleared ones: NanGuard keeps this step's for its lagged read.
        self.step_calls = []
        self.step_batches = []
        # A batch fetched after this step's last forward was prefetched for the next
        # step: the next step's boundary must come at its forward, which runs before
        # any further fetch. So must it in a loop that does not iterate the guard.
        # With several optimizers (a GAN) a training forward can follow the first
        # optimizer's step inside the same iteration, so there only those loops do.
        pos = self.data_position
        self._fire_on_forward = (
            self._one_optimizer
            or (self._forward_seen and bool(pos.fetched))  # prefetched: the next step's
            or not pos.n_fetched
        )
        self._forward_seen = False
        if self.loader is not None and not pos.n_fetched and not self._warned_not_iterated:
            self._warned_not_iterated = True
            self.event(
                "loader_not_iterated",
                level="warning",
                message=(
                    "the guard was given a loader but no batch came through it by the end "
                    f"of step {self.step}: the loop iterates the loader itself, so the data "
                    "position cannot be saved (a resumed run would start its data over) "
                    "and a non-finite step's batch is unknown. Iterate the guard instead: "
                    "`for batch in g:` or `it = iter(g); batch = next(it)`."
                ),
            )
        if anatomy.clock is not None:  # anatomy.arm() inline: no frame per step
            anatomy.marks = anatomy.clock.arm(self.step + 1)
        self._at_boundary = True
        self.phase = "loop"

    def _scaler_skipped(self, name: str, scaler: Any) -> None:
        """A GradScaler's ``step(optimizer)`` returned without calling
        ``optimizer.step()``: its gradients overflowed. The iteration is still a step,
        skipped (its row, its loss; not merged into the next one), and components see
        ``skip_cause`` instead of judging inf gradients as a fault."""
        if scaler is not self.scaler and not self._scaler_warned:
            self._scaler_warned = True
            if any(c.saves_checkpoints for c in self.components):
                self.event(
                    "scaler_not_saved",
                    level="warning",
                    message=(
                        "a GradScaler steps this optimizer but was not given to the guard, "
                        "so its scale is not in the checkpoints: a resumed run starts from "
                        "the initial scale and skips steps again while it calibrates. "
                        "Pass it: guardrails.guard(..., scaler=scaler)."
                    ),
                )
        self.skip_cause, self.skip_scaler = "fp16_overflow", scaler
        try:
            # A component may find it a fault, not an overflow (a NaN batch): then the
            # buffers its forwards wrote go back as on any skipped step.
            if name == next(iter(self.optimizers)):
                self._before_step()
                self._put_back(name)
                self._wrappers.skip = False
                self._after_step()
            else:
                self._before_extra_step(name)
                self._put_back(name)
                self._wrappers.skip = False
                self._after_extra_step(name)
        finally:
            self.skip_cause = self.skip_scaler = None

    def _before_extra_step(self, name: str) -> None:
        self.phase = "optimizer"
        if self._shadow.pending:
            self._shadow.settle()  # the run's first optimizer step, once
        if self._pending is not None:
            self._raise_pending()
        for fn in self._live["before_extra_step"]:
            fn(self, name)
        self.update_began = True  # as in _before_step: after the hooks, before the update

    def _after_extra_step(self, name: str) -> None:
        for fn in self._live["after_extra_step"]:
            fn(self, name)
        self.phase = "loop"

    # ------------------------------------------------------------------ checks

    def __repr__(self) -> str:
        names = ", ".join(c.name for c in self.components)
        return (
            f"Guard(step={self.step}, state={self._state}, run_dir='{self.run_dir}', "
            f"components=[{names}])"
        )

    def __dir__(self) -> list[str]:
        # dir(g) and tab completion offer the user's surface (engine/surface.py); the
        # services components call stay reachable, only not offered to a loop.
        return sorted({*USER_SURFACE, *(n for n in super().__dir__() if n.startswith("__"))})


# ---------------------------------------------------------------------- helpers


def current_lr(optimizer: torch.optim.Optimizer) -> float:
    """The first param group's LR (``nan`` for a device tensor: reading it would sync)."""
    lr = optimizer.param_groups[0].get("lr", math.nan)
    if isinstance(lr, Tensor):
        return lr.item() if lr.device.type == "cpu" else math.nan
    return float(lr)
