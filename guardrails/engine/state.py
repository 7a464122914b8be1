"""What the engine publishes and what the components share, declared in one place.

A component reads the loop's state from the guard (``guard.step``, ``guard.phase``...)
and never writes it: every field below has exactly one writer, named beside it, and
``tests/test_structure.py`` holds the code to that (it reads every module and fails on
an assignment to a guard field outside its writer). A component that needs the engine
to change something asks for it through a service of :class:`~guardrails.Guard`
(``request_stop``, ``skip_update``, ``record_skip``, ``step_row``, ``pause_watchdog``,
``quiet``, ``replaying``, ``in_phase``, ``resume_from``, ``fail_from_thread``,
``wrap_batches``, ``save_checkpoint``), so the engine stays the one place that knows
how its state moves.

Two kinds of state:

* :class:`StepState`, the engine's: where the loop is and what the current step did.
  :class:`~guardrails.Guard` *is* a ``StepState`` (it inherits these fields), so a read
  is a plain attribute read: the hot path pays nothing for the declaration.
* :class:`Shared`, the components': a value one component produces for others (the
  collective in flight, for the watchdog's hang report; GC time, for telemetry). It
  lives at ``guard.shared``; each field is written by one component. A field that is a
  guard offering a service to the others (the auditor, the rewind guard) is typed with
  the protocol of what it offers (``engine/services.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from guardrails.engine.services import CollectiveRecorder, RewindService

#: Who writes each published field: the module allowed to assign it. The engine's are
#: written by ``engine/guard.py`` (the data position, ``engine/data.py``, returns what
#: the guard publishes); a component that wants one changed calls a service instead.
#: ``engine/wrappers.py`` writes ``phase`` around each forward and ``skip_cause`` /
#: ``skip_scaler`` around a scaler's step inline: a call back into the guard would be
#: a frame per forward.
ENGINE_MODULES = ("engine.guard", "engine.lifecycle", "engine.wrappers")

#: Each :class:`Shared` field and the one module that writes it.
SHARED_WRITERS: dict[str, str] = {
    "collective": "guards.audit.auditor",
    "auditor": "guards.audit.auditor",
    "gc_total_s": "guards.gc",
    "collective_phases": "guards.audit.auditor",
    "rewind": "guards.rewind.rewind",
}


class StepState:
    """The state the engine publishes about the loop, read by components and users as
    ``guard.<field>``. Only the engine writes these (see :data:`ENGINE_MODULES`)."""

    def __init__(self) -> None:
        #: Optimizer steps completed (counted from the checkpoint on a resumed run): the
        #: update count of the weights held. A rewind (the rewind guard) sets it back to
        #: the step of the state it restored, so a step number can repeat in a run.
        self.step = 0
        #: The pass over the loader in progress or next: it counts passes that ran to
        #: the end (or were left mid-way by a ``break``). A resumed run's first pass
        #: continues the interrupted one, so ``sampler.set_epoch(g.epoch)`` before each
        #: ``for batch in g`` gives every pass the number it had in the first run.
        self.epoch = 0
        #: Batches fetched in the current pass.
        self.batch_in_epoch = 0
        #: ``(epoch, batches)`` of the last pass when its loader ran out
        #: (``StopIteration``), ``None`` while a pass is going: the watchdog tells a rank
        #: that ran out of data from one that is stuck. One tuple, stored before the
        #: epoch counters move on, so a reader in another thread never sees it half-set.
        self.exhausted_at: tuple[int, int] | None = None
        #: Whether the training forward runs inside ``torch.compile``'d code (a compiled
        #: wrapper of the guarded module, or a compiled step function), learned at the
        #: run's first training forward (one walk of the caller's frames); ``None``
        #: before it. Under a dispatch mode that code would run eagerly, so the FLOP
        #: count leaves such a step alone.
        self.forward_compiled: bool | None = None
        #: Where the loop is, for errors that must say so (an OOM, a hang):
        #: ``"setup"``, ``"data"`` (in the loader's ``next()``), ``"forward"`` (in the
        #: model's forward), ``"backward"`` (after a forward, before
        #: ``optimizer.step()``), ``"optimizer"`` (in ``optimizer.step()``), ``"loop"``
        #: (elsewhere in the loop body), ``"agree"`` (in a guardrails agreement between
        #: ranks, see :meth:`~guardrails.Guard.in_phase`). One attribute store at each
        #: point (~20 ns), nothing more.
        self.phase = "setup"
        #: Why progress is legitimately paused (``"checkpoint"``, ``"eval"``...), or
        #: ``None``; the watchdog does not call a paused rank stuck. Set through
        #: :meth:`~guardrails.Guard.pause_watchdog`.
        self.paused: str | None = None
        #: Why the loop is ending early (a signal save with ``exit_on_signal=False``), or
        #: ``None``. Once set, ``for batch in g`` ends at once. Set through
        #: :meth:`~guardrails.Guard.request_stop`.
        self.stopping: str | None = None
        #: The code the process must exit with, once a component decided so (a signal
        #: save: 128 + signum), or ``None``. Set through ``request_stop``.
        self.exit_code: int | None = None
        #: When (``time.monotonic()``) this rank took a background thread's error (a
        #: watchdog or auditor verdict, :meth:`~guardrails.Guard.fail_from_thread`), or
        #: ``None``. A verdict taken before a signal is the error the rank reports.
        self.verdict_at: float | None = None
        #: Whether an ``optimizer.step()`` (of any optimizer: a GAN has two) has begun
        #: since the last step boundary: set where a wrapped step is entered, cleared at
        #: the boundary (one attribute store each). While it is ``False`` the live
        #: model, optimizers, scheduler and scaler are exactly those of the last finished
        #: step (``step``), so a failure save may write them (``guards/checkpointer``).
        self.update_began = False

        # What the current step did; reset after every optimizer step.
        #: The forward calls of the current step, as ``(module, args, kwargs)`` (by
        #: reference; no copy), training forwards only: what the step trained on.
        self.step_calls: list[tuple[nn.Module, tuple[Any, ...], dict[str, Any]]] = []
        #: The batches the current step trained on: fetched through the guard before
        #: one of its training forwards (a prefetched batch belongs to the next step).
        self.step_batches: list[Any] = []
        #: This step's skip decision as a 0-d device tensor (non-zero: the update was
        #: left out), so the decision can stay on the device; ``None``: not judged.
        #: Set through :meth:`~guardrails.Guard.record_skip`.
        self.skipped: Tensor | None = None
        #: Why this step is skipped before any component looked, or ``None``:
        #: ``"fp16_overflow"`` when a GradScaler did not call ``optimizer.step()`` (its
        #: gradients overflowed at the current scale). Components record such a step as
        #: skipped and do not judge it (it is the scaler's normal calibration).
        self.skip_cause: str | None = None
        #: With ``skip_cause`` ``"fp16_overflow"``: the GradScaler that skipped.
        self.skip_scaler: Any = None
        #: Seconds from the end of the previous step to the end of this one (host clock).
        self.step_time_s = math.nan
        #: Seconds this step spent waiting in the loader's ``next()``.
        self.data_wait_s = 0.0
        # The step's anatomy, host clock (a GPU's work shows where the host waits for
        # it); with step_time_s and data_wait_s, what remains is the loop's own code
        # (zero_grad, the scheduler, logging, evaluation, checkpoints).
        #: Seconds in the step's training forwards (summed over its micro-batches).
        self.forward_s = math.nan
        #: Seconds from the step's first training forward to ``optimizer.step()``, less
        #: its forwards and loader waits: the loss, the backward, the gradients'
        #: all-reduce (where DDP waits for the slowest rank) and clipping.
        self.backward_s = math.nan
        #: Seconds in ``optimizer.step()`` (with the guard's own checks around it).
        self.optimizer_s = math.nan
        #: On CUDA, the latest sampled step's phases on the device: ``(step, forward_s,
        #: backward_s, optimizer_s)`` from CUDA events, read once they completed (a
        #: step sampled every ``anatomy.EVERY_N_STEPS``, read ~that many steps later);
        #: ``None`` elsewhere or before the first sample is read.
        self.device_phases: tuple[int, float, float, float] | None = None
        #: Tokens fetched for this step, or ``None`` when unknown.
        self.tokens: int | None = None
        #: Learning rate of the first param group at this step (``nan`` if it is a
        #: device tensor, which would cost a host sync to read).
        self.lr = math.nan
        #: Whether a training forward has run under float16 autocast (NanGuard's
        #: fp16-overflow diagnosis; bfloat16 does not overflow).
        self.fp16_autocast = False
        #: Whether a training forward has run under bfloat16 autocast (the compute
        #: dtype the efficiency advisor and the MFU's peak assume).
        self.bf16_autocast = False


@dataclass(slots=True, eq=False)
class Shared:
    """Values one component produces for the others, at ``guard.shared``. Each field
    has one writer (:data:`SHARED_WRITERS`); any component may read it, and a missing
    writer (its component not installed) leaves the default."""

    #: The collective the main thread is inside right now (op, shapes, sequence number,
    #: call site), or ``None``. Writer: the CollectiveAuditor, around each call; read by
    #: the watchdog from its thread and by error explanations.
    collective: dict[str, Any] | None = None
    #: The running CollectiveAuditor, or ``None``. Writer: the auditor (at start and
    #: close); read by GuardedDDP's comm hook, which reports its all-reduces to it, by
    #: the components that run an agreement of their own between ranks, and by error
    #: explanations, through :class:`~guardrails.engine.services.CollectiveRecorder`.
    auditor: CollectiveRecorder | None = None
    #: Seconds spent in Python's garbage collector since start (cumulative). Writer:
    #: the GCScheduler, which times each collection; telemetry turns it into ``gc_s``.
    gc_total_s: float = 0.0
    #: The loop's phases (``guard.phase``) in which the main thread has called a
    #: collective since start: where a rank waits for the others. Writer: the
    #: CollectiveAuditor, one set add per call; read by the pace guard, which judges a
    #: straggler on the phases where no rank waits.
    collective_phases: set[str] = field(default_factory=set)
    #: The running rewind guard (``guards/rewind``), or ``None`` (off: the default).
    #: Writer: the rewind guard, at start and close. NanGuard asks it for a rewind
    #: (``request``) instead of raising on a streak of non-finite steps, and on a
    #: divergence, through :class:`~guardrails.engine.services.RewindService`.
    rewind: RewindService | None = None
