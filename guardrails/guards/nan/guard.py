"""NanGuard: a non-finite step never reaches the weights, and the error says why.

The NaN/Inf playbook, as code. Per optimizer step, on the device and without a sync:

* one ``torch.stack`` writes (loss, grad norm, 0) into the step's row of a
  preallocated ring (the engine's step ring, ``Guard.step_row()``: telemetry records
  the same row, so the two share one write), and one
  ``_amp_foreach_non_finite_check_and_unscale_`` kernel (GradScaler's own check) turns
  the row's last slot into the step's *found* flag: 1.0 when the gradients hold a NaN
  or an Inf, which is also the row's ``skipped`` column. The grad norm is the guard's
  shared one, so a user who clips through ``g.clip_grad_norm_`` pays for one pass over
  the gradients, not two. With ``policy="warn"`` nothing is skipped, so there is no
  flag kernel: the host judges the norm when the row comes back.
* The update is skipped before it touches parameters or optimizer state
  (``skip.py``): a fused optimizer takes that flag as ``optimizer.found_inf``, as from
  a GradScaler (no sync at all); any other is not called for that step
  (:meth:`Guard.skip_update`), which on a CUDA device costs one host read of the flag
  per step (2-7% of a GPT-2-small step): a start event says so and recommends
  ``fused=True``. On a CPU device it is free.
* Ranks agree: under DDP (and FSDP2, whose grad norm is global) every rank computes
  the same flag from the same gradients. Where the ranks' gradients differ at
  ``step()``, the flag (and the grad norm judged) is agreed over a group of the
  guard's own, never the training's (``agree.py``).
* Several optimizers (a GAN): each one's step is checked over its own parameters'
  gradients (on the host: one read per step of the second and later optimizers) and
  skipped the same way; the diagnosis names the optimizer.

The host learns what happened lagged: on a CUDA device the ring is copied to pinned
memory every ``check_every_n_steps`` steps and read one interval later (it has long
finished, so nothing waits), and every rank processes the same rows at the same step,
so a raise happens at the same step everywhere (at most ``2 * check_every_n_steps``
steps after the fault; a streak found only when the guard closes raises from close).
On a CPU device the ring *is* host memory: the row's loss and grad norm are read on the
host as the row is written (``Tensor.tolist()`` of a CPU tensor: no kernel, no
dispatch) and judged at once: the flag is a float comparison there, so no kernel runs
for it and the optimizer (``found_inf``) is touched only on a bad step.

What the host does with the rows (``diagnose.py`` has the details):

* finite steps are judged in blocks of ``check_every_n_steps`` (``judge.py``): a grad
  norm or loss is a ``spike`` event when it jumps far above its recent trend, by both
  ``spike_factor`` / ``loss_spike_factor`` times and several times its usual
  step-to-step swing (``spikes.py``: a steady rise is never a spike).
* the first non-finite step of a streak is diagnosed (bad data / fp16 overflow /
  optimisation blow-up / numerics in a module / not reproducible / another rank), its
  batch saved under ``run_dir/nonfinite/``; the policy then logs, raises, or raises
  after ``max_consecutive_skips`` skipped steps in a row.
* training-health warnings, once each: optimizer params that got no gradient in the
  first steps, all-zero gradients, a loss that did not fall over the first window
  while the weights did not move.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.nn.parameter import is_lazy

from guardrails._errors import NonFiniteError
from guardrails.distributed import dist as _dist
from guardrails.engine import model
from guardrails.engine.component import Component
from guardrails.engine.config import configure
from guardrails.engine.gradnorm import grads_of
from guardrails.engine.guard import current_lr
from guardrails.engine.lagged import SCALER_SKIPPED, SKIPPED, Copy
from guardrails.guards.nan import blowup, diagnose, messages
from guardrails.guards.nan.agree import FlagAgreement
from guardrails.guards.nan.divergence import Divergence
from guardrails.guards.nan.health import _Health, _StaleGrads
from guardrails.guards.nan.judge import SpikeJudge
from guardrails.guards.nan.scaler import ScalerSkips, skip_scale
from guardrails.guards.nan.skip import SkipUpdate
from guardrails.guards.nan.updates import UpdateSampler
from guardrails.util.checks import non_negative, positive_int

if TYPE_CHECKING:
    from collections.abc import Callable

    from guardrails.engine.guard import Guard

logger = logging.getLogger("guardrails.nan")

POLICIES = ("skip", "raise", "warn")
#: The ring row's flag for a step a GradScaler skipped itself (1.0: non-finite).
SCALER_SKIP = SCALER_SKIPPED


class NanGuard(Component):
    """Detects non-finite gradients every step without a host sync, skips the update
    on every rank, and explains the cause. Knobs: :class:`NanGuard.Config`
    (``NanGuard(policy="raise")``, or ``guardrails.guard(nan={"policy": "raise"})``).
    """

    @dataclass(kw_only=True)
    class Config:
        """NanGuard's knobs.

        Attributes:
            policy: ``"skip"`` (default): skip the update, log it, and raise
                :class:`~guardrails.NonFiniteError` once ``max_consecutive_skips`` steps
                in a row were skipped. ``"raise"``: skip and raise at the first one.
                ``"warn"``: log only; the update goes through (weights may go NaN).
            max_consecutive_skips: with ``"skip"``, raise after this many skipped steps
                in a row. Default 10.
            check_every_n_steps: on a CUDA device, the flags reach the host in one copy
                per this many steps, so a raise comes up to twice this many steps after
                the fault (the skip itself is immediate). Default 10.
            spike_factor: a grad norm over this many times its running median (the
                median of the last 20 finite steps) is a spike, if the jump is also more
                than ``SPIKE_SWINGS`` (5) times the norm's usual step-to-step swing: a
                noisy norm needs a bigger jump, a steady rise is never a spike (and
                if it reaches a twentieth of the norm's early level). Default
                5. Where the ranks' gradients differ at ``step()`` the norm judged is
                the root mean square of the ranks' grad norms, the same on every rank.
            loss_spike_factor: the same for the loss (judged while the last
                ``window_steps`` losses are all positive; a loss spike must also reach
                the loss's early level). Default 4 (a language model's
                loss at 4x its median has diverged; small-batch regression losses swing
                2-3x by chance, and the swing rule raises their bar further).
            max_spike_events: log at most this many spike events per metric per run;
                later spikes are still counted in ``NanGuard.spikes``. Default 20.
            window_steps: how many recent steps the health checks, the diagnosis's
                history and the step-to-step swing of the spike rule look at (spikes
                are judged from 20 finite steps on). Default 100.
            capture: keep each step's batch (references, no copies) until its flag is
                known, and save the batch of a non-finite step to
                ``run_dir/nonfinite/``. Default True. A loader that refills one buffer
                in place would save later data.
            replay: diagnose a non-finite step by replaying its batch through the model
                with forward hooks (weights, grads, optimizer state, buffers and RNG
                streams are left as they were). Default True.
            replay_fn: how to run the model on a batch, ``replay_fn(model, batch) ->
                output`` (the bare model, and each batch the step fetched). Default
                (also ``guard(..., replay_fn=...)``): re-run the step's training
                forward calls with the arguments they were given.
            max_diagnoses: diagnose (replay and save) at most this many streaks per
                run. Default 3.
            update_every_n_steps: measure the update size (how far one optimizer step
                moved the weights, relative to them, over a fixed sample of at most
                65,536 of their elements) every this many steps, read lagged: the
                diagnosis of a non-finite step names an update far above the run's own.
                Costs one fused copy and two fused norms of the sample per this many
                steps, no host sync. ``None``: off. Default 10.
            divergence_factor: a ``divergence`` warning when the median of the last
                ``divergence_steps`` losses stays over this many times the median of the
                4 x ``divergence_steps`` steps before them (and over 5x the loss's usual
                spread), while every value is finite: a loss that jumped and stays up.
                ``None``: off. Default 2.
            divergence_steps: how many recent steps must, by their median, be up (so a
                one-step spike is not a divergence). Default 20.
        """

        policy: str = "skip"
        max_consecutive_skips: int = 10
        check_every_n_steps: int = 10
        spike_factor: float = 5.0
        loss_spike_factor: float = 4.0
        max_spike_events: int = 20
        window_steps: int = 100
        capture: bool = True
        replay: bool = True
        replay_fn: Callable[[Any, Any], Any] | None = None
        max_diagnoses: int = 3
        update_every_n_steps: int | None = 10
        divergence_factor: float | None = 2.0
        divergence_steps: int = 20

        def __post_init__(self) -> None:
            if self.policy not in POLICIES:
                raise ValueError(
                    f"policy must be one of {', '.join(POLICIES)}; got {self.policy!r}"
                )
            positive_int("max_consecutive_skips", self.max_consecutive_skips)
            positive_int("check_every_n_steps", self.check_every_n_steps)
            positive_int("window_steps", self.window_steps)
            positive_int("max_diagnoses", self.max_diagnoses)
            positive_int("max_spike_events", self.max_spike_events)
            if self.update_every_n_steps is not None:
                positive_int("update_every_n_steps", self.update_every_n_steps)
            positive_int("divergence_steps", self.divergence_steps)
            if self.divergence_factor is not None:
                non_negative("divergence_factor", self.divergence_factor)
                if self.divergence_factor <= 1:
                    raise ValueError(
                        "divergence_factor must be > 1 (a multiple of the loss's median) or "
                        f"None (off), got {self.divergence_factor!r}"
                    )
                self.divergence_factor = float(self.divergence_factor)
            for knob in ("spike_factor", "loss_spike_factor"):
                value = getattr(self, knob)
                non_negative(knob, value)
                if value <= 1:
                    raise ValueError(
                        f"{knob} must be > 1 (a multiple of the median), got {value!r}"
                    )
                setattr(self, knob, float(value))
            if self.replay_fn is not None and not callable(self.replay_fn):
                raise TypeError(f"replay_fn must be callable(model, batch), got {self.replay_fn!r}")

    name = "nan"
    before = ("telemetry",)  # it publishes the step's skip flag that telemetry records
    _lagged_on_cpu = False  # tests: run the CUDA (lagged) host path on a CPU device

    def __init__(self, config: NanGuard.Config | None = None, /, **knobs: Any) -> None:
        configure(self, config, knobs)
        #: Steps whose update was skipped (or, with "warn", that were non-finite).
        self.nonfinite_steps: list[int] = []
        #: Diagnoses made this run (dicts: step, cause, message, path...).
        self.diagnoses: list[dict[str, Any]] = []
        # Steps a GradScaler skipped itself: its calibration, or a fault (scaler.py).
        self._scaler = ScalerSkips(
            policy=self.policy,
            max_events=self.max_spike_events,
            max_consecutive_skips=self.max_consecutive_skips,
        )
        # The finite steps' grad norms and losses, judged for spikes (judge.py).
        self._spike_judge = SpikeJudge(
            window_steps=self.window_steps,
            spike_factor=self.spike_factor,
            loss_spike_factor=self.loss_spike_factor,
            max_events=self.max_spike_events,
        )

    @property
    def spikes(self) -> deque[tuple[int, str, float, float]]:
        """Spikes seen (the last 1000): (step, "grad_norm" | "loss", value, median)."""
        return self._spike_judge.spikes

    @property
    def scaler_skips(self) -> list[int]:
        """Steps a GradScaler skipped itself (its gradients overflowed at its scale)."""
        return self._scaler.steps

    # ------------------------------------------------------------------ lifecycle

    def on_start(self, guard: Guard) -> None:
        self._guard = guard
        # The torch optimizer under accelerate's prepared one: a fused step() reads
        # found_inf from itself, not from the wrapper (distributed/dist.inner).
        opt = self._opt = _dist.inner(guard.optimizer)
        self._cuda = guard.device.type == "cuda"
        # Lagged: flags reach the host in copies, one interval late (CUDA). Tests set
        # `_lagged_on_cpu` to run that same path on a CPU device.
        self._lagged = self._cuda or self._lagged_on_cpu
        self._skips = self.policy != "warn"
        self._skip = SkipUpdate(guard, opt)
        # Gradients that differ across ranks at step(): agree on the flag (host path).
        self._reduce = guard.world_size > 1 and not all(
            model.grads_agree(m) for m in guard.models.values()
        )
        self._agree = FlagAgreement(guard, needed=self._reduce)
        # Lagged path with self._reduce: step -> the ranks' grad norm, until its row is read.
        self._rank_norms: dict[int, float] = {}
        # Lagged path: step -> the scale a GradScaler skipped it at, until its row is read.
        self._scales: dict[int, float] = {}
        n = self._start_rows(guard)
        self._fp16_params = any(p.dtype == torch.float16 for p in guard.params)
        self._param_ids = {id(p) for g in opt.param_groups for p in g["params"]}
        #: (step, loss, grad norm, lr) of the last ``window_steps`` finite steps.
        self.history: deque[tuple[int, float, float, float]] = deque(maxlen=self.window_steps)
        self._unjudged: list[tuple[int, float, float, float]] = []  # finite, not judged yet
        self._spike_judge.start()
        self._streak: list[int] = []
        self._streak_diag: dict[str, Any] | None = None
        # (forward calls, fetched batches) of steps whose flags the host has not read
        # yet: at most two intervals.
        self._recent: deque[tuple[int, Any, Any]] = deque(maxlen=2 * n + 2)
        self._start_checks(guard, opt, lag_steps=2 * n if self._lagged else 0)
        # The other optimizers' parameters and skip streaks (several optimizers).
        self._extra = {
            name: [p for g in o.param_groups for p in g["params"]]
            for name, o in list(guard.optimizers.items())[1:]
        }
        self._extra_streaks: dict[str, list[int]] = {name: [] for name in self._extra}
        self._streak_diags: dict[str, dict[str, Any]] = {}
        if self._skips and self._cuda and (self._reduce or not self._skip.fused):
            # The guard's own cost, with its fix: advice, as the efficiency advisor's
            # are; torch's default AdamW on CUDA is not fused, so a warning here would
            # come with every healthy default run.
            advice = messages.syncs_advice(type(opt).__name__, agrees=self._reduce)
            guard.event("nan_guard_syncs", level="info", message=advice)

    def _start_rows(self, guard: Guard) -> int:
        """Where the step's values come from: the engine's (loss, grad norm, skipped)
        row, shared with telemetry (``engine/lagged.StepRing``: one write per step for
        both). Lagged path: its rows reach the host in copies read an interval later,
        each kept with its rows' (step, lr, row count). Returns the rows per copy."""
        n = self.check_every_n_steps if self._lagged else 1
        self._ring = guard.step_ring
        self._reader = self._ring.reader(n) if self._lagged else None
        self._lrs: list[tuple[int, float, int]] = []
        # A host ring (CPU) is judged from the row's values as each step happens.
        self._host = not self._lagged and self._ring.host
        self._one = torch.ones((), device=guard.device)
        return n

    def _start_checks(self, guard: Guard, opt: Any, *, lag_steps: int) -> None:
        """The checks beside the skip: training health, a forgotten ``zero_grad()``,
        the update size, the divergence."""
        self._health = _Health(self.window_steps)
        # The update size, sampled every update_every_n_steps over the first
        # optimizer's parameters (updates.py: no sync, nothing between samples).
        every = self.update_every_n_steps
        self._updates: UpdateSampler | None = (
            UpdateSampler(
                [p for g in opt.param_groups for p in g["params"]], every, lag_steps=lag_steps
            )
            if every is not None
            else None
        )
        self._update_every = every or 0
        self._divergence: Divergence | None = (
            Divergence(self.divergence_factor, self.divergence_steps)
            if self.divergence_factor is not None
            else None
        )
        #: Divergences reported this run (the ``divergence`` events' fields).
        self.divergences: list[dict[str, Any]] = []
        # A forgotten zero_grad(), watched on one parameter for the first steps. Not
        # with several optimizers (a GAN's generator loss backpropagates through the
        # discriminator after its step, legitimately) nor sharded parameters.
        # A lazy module's parameters take no hook before its first forward: not those.
        sentinel = next((p for p in guard.params if p.requires_grad and not is_lazy(p)), None)
        self._stale: _StaleGrads | None = (
            _StaleGrads(sentinel)
            if sentinel is not None
            and len(guard.optimizers) == 1
            and not model.holds_shards(guard.model)
            else None
        )

    def before_step(self, guard: Guard) -> None:
        count = guard.step_row()  # (loss, grad norm, 0): one write, shared with telemetry
        ring = self._ring
        i = ring.i
        found = ring.flags[i]  # the row's skipped slot
        step = guard.step + 1
        if guard.skip_cause is not None:
            self._scaler_skipped(guard, step, found)
            return
        if self._host:
            # CPU: the row is host memory and its values are on the host already (no
            # dispatch, no sync), so the flag is decided here and the optimizer is only
            # touched on a bad step.
            norm_v = ring.norm
            if norm_v - norm_v == 0.0 and not self._reduce:  # finite (NaN, Inf: not 0)
                # The common step, kept short: a few us of Python per step are what
                # the CPU host cost is made of (the whole guard: ~56 us a step).
                if self._skips:
                    guard.record_skip(found)  # 0: applied
                if self._streak:
                    self._end_streak(step)
                unjudged = self._unjudged
                unjudged.append((step, ring.loss, norm_v, guard.lr))
                if len(unjudged) >= self.check_every_n_steps:
                    self._judge()
                return
            bad = not math.isfinite(norm_v)
            if self._reduce:
                bad, norm_v = self._agree(bad, norm_v)
            if self._skips:
                if bad:
                    found.fill_(SKIPPED)  # the row's skipped column: telemetry records it
                guard.record_skip(found)
                if bad:
                    self._skip.now(found)
            self._observe(step, ring.loss, norm_v, bad, guard.lr, now=True)
            return
        self._lrs.append((step, guard.lr, count))  # read back with the row
        if not self._skips:
            # "warn": nothing to skip, so no flag on the device: the host judges the
            # norm when the row comes back (a NaN or Inf in any gradient makes it so).
            if self._reduce:
                _, norm_v, _ = ring.rows[i].tolist()
                bad, norm_v = self._agree(not math.isfinite(norm_v), norm_v)
                if not bad:
                    self._rank_norms[step] = norm_v
            return
        # CUDA (lagged), one kernel: found = 1.0 (SKIPPED) if the norm is NaN/Inf (the
        # norm slot is multiplied by 1). A NaN or Inf in any gradient makes the norm so.
        torch._amp_foreach_non_finite_check_and_unscale_(ring.norm_slots[i], found, self._one)
        if self._reduce:
            # The ranks' flags may differ: agree on the host (one read per step: the
            # row, not only the flag, so the agreement can carry the norm too).
            _, norm_v, flag = ring.rows[i].tolist()
            bad, norm_v = self._agree(flag > 0.5, norm_v)
            if not bad:  # judged by the ranks' norm when the row is read back
                self._rank_norms[step] = norm_v
            if bad:
                found.fill_(1.0)
                guard.record_skip(found)
                self._skip.now(found)
            return
        guard.record_skip(found)
        self._skip.on_device(found)

    def _scaler_skipped(self, guard: Guard, step: int, found: Tensor) -> None:
        """A GradScaler leaves this step's update out itself (``guard.skip_cause``): the
        row says so (flag ``SCALER_SKIP``), nothing is judged or diagnosed here; unless
        the step is a fault, not an overflow (``ScalerSkips.is_fault``): then it is a
        non-finite step like any other (flag ``SKIPPED``, diagnosed, buffers put back)."""
        fault = self._scaler.is_fault(guard, loss=True)
        found.fill_(SKIPPED if fault else SCALER_SKIP)
        guard.record_skip(found)
        if self._reduce:  # in step with the other ranks' agreement (their scalers may
            self._agree(fault, 0.0)  # not have skipped); a fault skips them too
        if fault:
            guard.skip_update()  # the scaler leaves the update out; the buffers go back
            if self._host:
                self._observe(step, self._ring.loss, self._ring.norm, True, guard.lr, now=True)
            else:  # judged when the row (flag SKIPPED) is read back
                self._lrs.append((step, guard.lr, guard.step_row()))
            return
        scale = skip_scale(guard)
        if not self._host:
            self._lrs.append((step, guard.lr, guard.step_row()))
            self._scales[step] = scale
            return
        self._scaler.skipped(guard, step, scale)

    def after_step(self, guard: Guard) -> None:
        if self._skip.set_found:
            self._skip.restore()
        if self._stale is not None and not self._stale.after_step(guard):
            self._stale = None  # the first steps only
        if guard.step <= _Health.CHECK_GRADS_STEPS:
            self._health.after_step(guard, self._param_ids)
        every = self._update_every
        if every and (guard.step + 1) % every <= 1:  # the sample's step and the one before
            self._updates.after_step(guard.step)  # type: ignore[union-attr]
        if self._lagged:
            # The inputs of the steps whose rows the host reads later (the CPU path
            # judges a step inside it, from guard.step_calls).
            if self.capture:
                self._recent.append((guard.step, guard.step_calls, guard.step_batches))
            if len(self._lrs) >= self.check_every_n_steps:
                self._flush()

    def before_extra_step(self, guard: Guard, name: str) -> None:
        """Another optimizer's step: its own parameters' gradients, checked on the host
        (one read), skipped like the first optimizer's."""
        scaled = guard.skip_cause is not None  # its GradScaler skipped it
        if scaled and not self._scaler.is_fault(guard, loss=False):  # an overflow
            self._scaler.skipped(guard, guard.step + 1, skip_scale(guard))
            return
        norm = guard.total_norm(grads_of(self._extra[name]))
        norm_v = float(norm)  # the one host read of this optimizer's step
        bad = scaled or not math.isfinite(norm_v)
        if self._reduce:
            bad, _ = self._agree(bad)
        streak = self._extra_streaks[name]
        if not bad:
            if streak:
                self._end_streak(guard.step + 1, streak=streak, optimizer=name)
                streak.clear()
            return
        if self._skips:
            guard.skip_update()
        step = guard.step + 1
        self.nonfinite_steps.append(step)
        streak.append(step)
        if len(streak) == 1:
            lr = current_lr(guard.optimizers[name])
            self._streak_diags[name] = self._diagnose(
                step, math.nan, norm_v, lr, now=True, optimizer=name
            )
        if self.policy == "raise" or (
            self.policy == "skip" and len(streak) >= self.max_consecutive_skips
        ):
            raise self._error(self._streak_diags.get(name) or {}, streak=streak, optimizer=name)

    def state_dict(self) -> dict[str, Any]:
        """The statistics a resumed run needs to judge spikes as the first run would
        (the last ``window_steps`` finite losses and grad norms) and to count a skip
        streak that spans the restart; saved in every checkpoint."""
        return {
            **self._spike_judge.state_dict(),  # norms, losses, scales
            "history": [list(r) for r in self.history],
            # Read but not yet judged (blocks of check_every_n_steps). On CUDA the rows
            # still in the device ring (at most 2 intervals) are not saved.
            "unjudged": [list(r) for r in self._unjudged],
            "nonfinite_steps": self.nonfinite_steps[-1000:],
            "streak": list(self._streak),
            "updates": [] if self._updates is None else self._updates.state_dict(),
            "divergence": None if self._divergence is None else self._divergence.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._spike_judge.load_state_dict(state)
        self.history.extend(tuple(r) for r in state.get("history", []))
        self._unjudged[:0] = [tuple(r) for r in state.get("unjudged", [])]
        self.nonfinite_steps[:0] = state.get("nonfinite_steps", [])
        self._streak = list(state.get("streak", []))
        if self._updates is not None:
            self._updates.load_state_dict(state.get("updates", []))
        if self._divergence is not None:
            self._divergence.load_state_dict(state.get("divergence"))

    def on_end(self, guard: Guard, exc: BaseException | None) -> None:
        if self._skip.set_found:
            self._skip.restore()
        if self._stale is not None:
            self._stale.remove()
            self._stale = None
        if exc is None or guard.stopping is not None:
            # Rows the host has not seen yet (lagged path): read them now, while the
            # batches are still held, also when the loop ends by a signal stop (the
            # skipped steps of its last ~20 steps would otherwise go unreported). A
            # streak past the limit raises here too: the run did not fail, but its last
            # updates never happened, and the user must know.
            try:
                if self._lagged:
                    if self._lrs:
                        self._flush()
                    self._collect(self._reader.take())  # type: ignore[union-attr]
                self._judge()
            finally:
                self._recent.clear()
                self._agree.close()
        self._recent.clear()

    # ------------------------------------------------------------------ lagged read

    def _flush(self) -> None:
        """Copy the rows of the steps not read yet to (pinned) host memory; process the
        previous copy."""
        lrs, self._lrs = self._lrs, []
        self._collect(self._reader.start([c for _, _, c in lrs], lrs))  # type: ignore[union-attr]

    def _collect(self, copy: Copy | None, *, upto: int | None = None) -> None:
        """Judge the rows of ``copy`` (``upto``: only those of steps up to it)."""
        if copy is None:
            return
        # Issued one interval ago: long finished, so read() does not wait in practice.
        rows, lrs = copy.read(), copy.meta
        rank_norms = self._rank_norms
        skips, foreign = self._skips, self._agree.foreign
        for (step, lr, _), (loss_v, norm_v, flag) in zip(lrs, rows.tolist(), strict=True):
            if upto is not None and step > upto:
                continue
            if flag > 1.5:  # SCALER_SKIP
                self._scaler.skipped(self._guard, step, self._scales.pop(step, math.nan))
                continue
            # "warn" sets no flag (nothing is skipped): judged from the norm here.
            bad = flag > 0.5 if skips else not math.isfinite(norm_v) or step in foreign
            if rank_norms:  # the ranks' norm, agreed in before_step (this rank's in the row)
                norm_v = rank_norms.pop(step, norm_v)
            self._observe(step, loss_v, norm_v, bad, lr, now=False)

    # ------------------------------------------------------------------ host side

    def _observe(
        self, step: int, loss: float, norm: float, bad: bool, lr: float, *, now: bool
    ) -> None:
        """One step's values reached the host. ``now``: we are still inside that step
        (before its update), so the weights are exactly the ones that produced it.

        A finite step costs a list append here; finite steps are judged (spikes,
        health) in blocks of ``check_every_n_steps`` by :meth:`_judge`, with one
        numpy median per block instead of per step."""
        if not bad:
            if self._streak:
                self._end_streak(step)
            self._unjudged.append((step, loss, norm, lr))
            if len(self._unjudged) >= self.check_every_n_steps:
                self._judge()
            return
        self._judge()  # the steps before it are the evidence
        self.nonfinite_steps.append(step)
        self._streak.append(step)
        if len(self._streak) == 1:
            self._streak_diag = self._diagnose(step, loss, norm, lr, now=now)
        diag = self._streak_diag or {}
        if self.policy == "raise" or (
            self.policy == "skip" and len(self._streak) >= self.max_consecutive_skips
        ):
            if self.policy == "skip" and self._ask_rewind(
                "nonfinite",
                self._streak[0],
                {
                    "skipped": len(self._streak),
                    "steps": [self._streak[0], self._streak[-1]],
                    "diagnosis": diag.get("cause"),
                    "detail": f"diagnosed as {diag.get('cause')}" if diag.get("cause") else "",
                },
                # Every rank's flag is the same at the same step (see the module
                # docstring): every rank asks here, at this step.
                everywhere=True,
            ):
                return  # the rewind guard sets the run back at the next boundary
            raise self._error(diag)

    def _judge(self) -> None:
        """Spike checks and health checks for the finite steps not judged yet, against
        the statistics of the steps before them; then they join the history."""
        rows, self._unjudged = self._unjudged, []
        if not rows:
            return
        self._spike_judge.judge(self._guard, rows, ranks_rms=self._reduce)
        self.history.extend(rows)
        self._health.observe(self._guard, rows, self._updates)
        if self._divergence is not None:
            self._divergence.add(rows)
            found = self._divergence.check()
            if found is not None:
                self._divergence_event(found)

    def _diagnose(
        self,
        step: int,
        loss: float,
        norm: float,
        lr: float,
        *,
        now: bool,
        optimizer: str | None = None,
    ) -> dict:
        guard = self._guard
        calls, batches = self._inputs_of(step, now=now)
        weights_step = step - 1 if now else guard.step
        updates = self._updates
        diag = diagnose.diagnose(
            guard,
            step=step,
            loss=loss,
            norm=norm,
            lr=lr,
            history=list(self.history),
            updates=[] if updates is None else list(updates.samples),
            # Called inside the diagnosis (it reads the device: the diagnosis lifts
            # torch.cuda.set_sync_debug_mode for its duration).
            drift=None
            if updates is None or optimizer
            else lambda: updates.drift(weights_step, step),
            calls=calls,
            batches=batches,
            other_rank=step in self._agree.foreign,
            optimizer=optimizer,
            fp16=self._fp16_params or guard.fp16_autocast,
            scaler=self._skip.scaler_seen,
            spike_factor=self.spike_factor,
            loss_spike_factor=self.loss_spike_factor,
            replay=self.replay and len(self.diagnoses) < self.max_diagnoses,
            replay_fn=self.replay_fn or guard.replay_fn,
            weights_step=weights_step,
            save=len(self.diagnoses) < self.max_diagnoses,
        )
        self.diagnoses.append(diag)
        put_back = guard.restored_buffers_of(optimizer or next(iter(guard.optimizers)))
        if self.policy != "warn" and put_back:
            diag["restored_buffers"] = list(put_back)
        guard.event(
            "nonfinite",
            level="warning",
            message=messages.nonfinite(step, diag, policy=self.policy),
            **{k: v for k, v in diag.items() if k not in ("message", "rank")},
        )
        return diag

    def _inputs_of(self, step: int, *, now: bool) -> tuple[Any, Any]:
        """``(forward calls, fetched batches)`` of ``step``, or ``(None, None)`` when
        not captured (any longer)."""
        if not self.capture:
            return None, None
        if now:
            return self._guard.step_calls or None, self._guard.step_batches or None
        for s, calls, batches in self._recent:
            if s == step:
                return calls or None, batches or None
        return None, None

    def _end_streak(
        self, step: int, *, streak: list[int] | None = None, optimizer: str | None = None
    ) -> None:
        streak = self._streak if streak is None else streak
        first, n = streak[0], len(streak)
        whose = "" if optimizer is None else f"optimizer {optimizer!r}: "
        broken = self._guard.nonfinite_buffers()
        if broken:
            # Finite gradients again, but a buffer a forward writes holds a NaN or an
            # Inf (an update that went in, policy "warn"): the model is not recovered.
            # Every evaluation from here on is non-finite. Said once per streak.
            kind, level, fields = "nonfinite_buffers", "warning", {"buffers": broken}
            message = messages.buffers_not_recovered(whose, step, first, n, broken)
        else:
            kind, level, fields = "nonfinite_recovered", "info", {"skipped": n}
            message = (
                f"{whose}finite again at step {step} after {n} skipped step(s) from step {first}"
            )
        if optimizer is not None:
            fields["optimizer"] = optimizer
        self._guard.event(kind, level=level, message=message, step=step, first_step=first, **fields)
        if optimizer is None:
            self._streak = []
            self._streak_diag = None

    def _ask_rewind(
        self, cause: str, start: int, numbers: dict[str, Any], *, everywhere: bool
    ) -> bool:
        """Ask the rewind guard (``guard(rewind=...)``, off by default) to set the run
        back to before step ``start``: whether it will (else: today's behaviour)."""
        rewind = self._guard.shared.rewind
        if rewind is None:
            return False
        # A snapshot of step k holds step k's update: an LR jump at a step shortly before
        # the trouble showed is where it may have begun (its update the damage), so the
        # rewind goes back to before that step. The LR is the same on every rank (the
        # ranks still agree without an exchange on a streak).
        jump = blowup.first_lr_jump([*self.history, *self._unjudged], start)
        if jump is not None and jump < start:
            detail = numbers.get("detail") or ""
            numbers = {
                **numbers,
                "lr_jump_step": jump,
                "detail": (detail + "; " if detail else "") + f"after an LR jump at step {jump}",
            }
            start = jump
        return rewind.request(cause, start, numbers, everywhere=everywhere)

    def on_rewind(self, guard: Guard, from_step: int) -> None:
        """The run is back at ``guard.step``: what was seen of the steps after it (the
        streak, the rows not judged or not read yet, the divergence's window, the update
        samples) is of a trajectory left behind. The rows of kept steps still in flight
        (lagged path) are read now (one wait, at the rewind only)."""
        step = guard.step
        self._streak = []
        self._streak_diag = None
        for streak in self._extra_streaks.values():
            streak.clear()
        self._unjudged = [r for r in self._unjudged if r[0] <= step]
        kept = [r for r in self.history if r[0] <= step]
        self.history.clear()
        self.history.extend(kept)
        self._recent.clear()
        self._rank_norms.clear()
        self._scales.clear()
        self._agree.forget_after(step)
        if self._divergence is not None:
            self._divergence.forget_after(step)
        if self._updates is not None:
            self._updates.forget_after(step)
        if self._lagged and self._reader is not None:
            self._lrs = [r for r in self._lrs if r[0] <= step]
            self._collect(self._reader.take(), upto=step)

    def _divergence_event(self, found: dict[str, Any]) -> None:
        """A loss that jumped and stays up, every value finite (``divergence.py``)."""
        self.divergences.append(found)
        self._guard.event(
            "divergence",
            level="warning",
            message=messages.divergence(
                found, factor=self.divergence_factor, clips=bool(self._guard.clip_norm_steps)
            ),
            **found,
        )
        self._ask_rewind(
            "divergence",
            found["step"],
            {
                **found,
                "detail": f"the median of the last {found['steps']} losses "
                f"{found['value']:.4g}, {found['value'] / found['median']:.1f}x the median "
                f"{found['median']:.4g} before",
            },
            # Each rank judges its own loss: one may see it alone (agreed first).
            everywhere=self._guard.world_size == 1,
        )

    def _error(
        self,
        diag: dict[str, Any],
        *,
        streak: list[int] | None = None,
        optimizer: str | None = None,
    ) -> NonFiniteError:
        return messages.streak_error(
            diag,
            self._streak if streak is None else streak,
            policy=self.policy,
            max_consecutive_skips=self.max_consecutive_skips,
            optimizer=optimizer,
            rank=self._guard.rank,
        )
