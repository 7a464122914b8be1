"""Efficiency: why a run is slower than its hardware, told once at the start.

Three things, each done once, on sampled steps, never per step:

* **The fast-path advisor** (``advisor.py``), after the run's first step: TF32 off on
  an Ampere+ GPU with float32 matmuls, float32 without autocast where bf16 is native,
  an optimizer that updates one parameter at a time, a DataLoader with no workers or no
  pinned memory on a GPU run, bf16 on a CPU that emulates it. Each an event with its
  fix.
* **FLOPs per step** (``flops.py``): torch's ``FlopCounterMode`` over a replay of one
  step (``flops_at_step``, after its ``after_step``: every micro-batch's forward and
  a backward from its output) on fake tensors, never over the step itself; or the
  figure you pass; with the device's dense peak for the
  step's dtype, a ``flops`` event; ``report`` divides by the median step time: MFU.
* **Host syncs in your loop** (``syncs.py``, CUDA only): ``host_syncs_steps`` steps
  from ``host_syncs_at_step`` run under ``torch.cuda.set_sync_debug_mode("warn")``;
  each sync's line in your code is reported once (``host_syncs``), with what to do.

The counted and sampled steps are this run's (a resumed run counts from where it
resumed). Per step, when nothing is sampled: two hook calls that compare the step
counter with the next sampled step, nothing else.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from guardrails.engine.component import Component
from guardrails.engine.config import configure
from guardrails.engine.model import holds_shards
from guardrails.guards.efficiency import advisor, flops
from guardrails.guards.efficiency.syncs import SyncSampler
from guardrails.util.checks import positive, positive_int
from guardrails.util.text import si

if TYPE_CHECKING:
    from guardrails.engine.guard import Guard

logger = logging.getLogger("guardrails.efficiency")

_NEVER = sys.maxsize  # a step no run reaches: the hook's one comparison is then false


class Efficiency(Component):
    """FLOPs per step and the device's peak (MFU), host syncs in the loop, and the
    fast-path advisor. Knobs: :class:`Efficiency.Config`
    (``guardrails.guard(efficiency=...)``)."""

    @dataclass(kw_only=True)
    class Config:
        """Efficiency's knobs.

        Attributes:
            advise: after the run's first step, say once (info events, each with its
                fix) what leaves speed on the table: TF32 off, float32 where bf16 is
                native, a non-fused optimizer, a DataLoader without workers or
                pinned memory on a GPU run, bf16 on a CPU that emulates it (a
                warning). Default True.
            count_flops: count the FLOPs of one training step (forward and backward)
                with torch's ``FlopCounterMode`` (matmuls, convolutions, attention):
                after step ``flops_at_step`` of the run, its forwards are replayed
                with their backward on a copy of the model whose weights are fake
                tensors (shapes only: no kernel runs, no memory, no RNG draw), so
                the step itself, the model's buffers and the RNG streams are exactly
                those of an unguarded run. A forward that cannot run on fake tensors
                (``.item()``, control flow on values, a custom op without a fake
                kernel) is not counted (an info event), nor is a compiled or
                sharded (FSDP) model: pass ``flops_per_step``. With activation checkpointing
                the recomputed forward is counted too (the hardware's FLOPs, not the
                model's): pass ``flops_per_step`` for MFU. Default True.
            flops_at_step: which step of this run to count (from its start, so a
                resumed run counts too), >= 2: the first step builds lazy state.
                Default 2.
            flops_per_step: your own figure of the model FLOPs one optimizer step
                does on this rank (e.g. 6 x parameters x tokens per step for a
                transformer, plus attention); used instead of counting. Default None.
            peak_flops: this device's peak FLOP/s for the run's compute dtype, instead
                of the built-in table (dense bf16 / fp16 / tf32 / fp32 peaks of H100,
                H200, A100, L4, L40S, A10G, A10, V100, RTX 4090 / 3090). Default None.
            host_syncs: on a CUDA run, sample ``host_syncs_steps`` steps under
                ``torch.cuda.set_sync_debug_mode("warn")`` and report the lines of
                your loop that make the host wait for the GPU (``host_syncs``).
                Nothing is sampled on a CPU run, nor when the loop set a sync debug
                mode itself. Default True.
            host_syncs_at_step: the first sampled step of this run (after warmup and
                compilation), >= 2. Default 21 (21-23 with the default 3: not
                multiples of the usual logging intervals).
            host_syncs_steps: how many consecutive steps to sample. A site seen in
                each is reported per step (a warning); one seen in some only (a
                periodic log) is told as information. Default 3.
        """

        advise: bool = True
        count_flops: bool = True
        flops_at_step: int = 2
        flops_per_step: float | None = None
        peak_flops: float | None = None
        host_syncs: bool = True
        host_syncs_at_step: int = 21
        host_syncs_steps: int = 3

        def __post_init__(self) -> None:
            for name in ("advise", "count_flops", "host_syncs"):
                if not isinstance(getattr(self, name), bool):
                    raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
            positive_int("flops_at_step", self.flops_at_step)
            positive_int("host_syncs_at_step", self.host_syncs_at_step)
            positive_int("host_syncs_steps", self.host_syncs_steps)
            for name in ("flops_at_step", "host_syncs_at_step"):
                if getattr(self, name) < 2:
                    raise ValueError(
                        f"{name} must be >= 2 (the first step builds lazy state and has no "
                        f"boundary before it), got {getattr(self, name)!r}"
                    )
            positive("flops_per_step", self.flops_per_step, allow_none=True)
            positive("peak_flops", self.peak_flops, allow_none=True)

        @property
        def does_anything(self) -> bool:
            """Whether any of its three features is on (``guard()`` leaves it out if not)."""
            return (
                self.advise
                or self.count_flops
                or self.flops_per_step is not None
                or self.host_syncs
            )

    name = "efficiency"

    def __init__(self, config: Efficiency.Config | None = None, /, **knobs: Any) -> None:
        configure(self, config, knobs)
        #: FLOPs of one optimizer step on this rank (counted or given), once known.
        self.flops_per_step_found: float | None = None
        #: The host-sync sampler of this run (``None`` until sampling starts).
        self.syncs: SyncSampler | None = None
        # The two steps the hooks compare with (after_step: the first step, then the
        # counted step's end; on_boundary: the sampled steps' starts); _NEVER when
        # nothing is due.
        self._after_due = 0
        self._boundary_due = _NEVER
        self._base = 0  # the step this run started from (a resumed run's checkpoint)
        self._count_at = _NEVER  # the step whose FLOPs are counted
        self._sync_first = _NEVER  # the first step sampled for host syncs
        self._bf16_at_start = False

    # ------------------------------------------------------------------ hooks

    def on_start(self, guard: Guard) -> None:
        # Seen now, before any forward: what the preflight's start check tells.
        self._bf16_at_start = (
            guard.device.type == "cpu"
            and guard.component("preflight") is not None
            and advisor.bf16_visible_at_start(guard)
        )

    def on_boundary(self, guard: Guard) -> None:
        if guard.step != self._boundary_due:  # the one check per step
            return
        self._at_boundary(guard)

    def after_step(self, guard: Guard) -> None:
        if guard.step < self._after_due:  # the one check per step
            return
        self._after(guard)

    def on_end(self, guard: Guard, exc: BaseException | None) -> None:
        syncs = self.syncs
        # A loop that ends right after the last sampled step has no boundary after it.
        done = syncs is not None and syncs.active and exc is None
        done = done and guard.step >= self._sync_first - 1 + self.host_syncs_steps
        self._stop_all()
        if done and syncs is not None:
            self._report_syncs(guard, syncs)

    def on_abort(self, guard: Guard, error: BaseException) -> None:
        # From another thread, the process ends right after: the sync mode and the
        # warnings hook are process-wide and put back; the FLOP counter is the stuck
        # main thread's replay (dispatch modes are per thread) and ends with the process.
        if self.syncs is not None:
            self.syncs.stop()

    # ------------------------------------------------------------------ the schedule

    def _after(self, guard: Guard) -> None:
        step = guard.step
        if self._after_due == 0:  # this run's first step
            self._base = step - 1
            if self.advise:
                self._advise(guard)
            self._schedule(guard)
            return
        self._after_due = _NEVER  # the counted step's end (or a later one, when
        self._count(guard)  # benchmark mode bypassed its hooks: that one is counted)

    def _count(self, guard: Guard) -> None:
        """The counted step is over: its FLOPs, from a replay of its forwards on fake
        tensors (the step itself ran as it would unguarded)."""
        step = guard.step
        if guard.forward_compiled:  # a compiled wrapper calls the guarded model
            self._not_counted_compiled(guard)
            return
        if any(holds_shards(m) for m in guard.models.values()):
            self._not_counted(guard, step, "the model is sharded (FSDP)")
            return
        calls = guard.step_calls
        if not calls:
            logger.debug("guardrails: step %d had no training forward to count", step)
            return
        replay = flops.Replay()
        flop_count = replay.count(calls, guard.device)
        if flop_count is None:
            why = replay.failed
            if replay.unreplayable:
                why = f"its forward could not be replayed on fake tensors: {why}"
            self._not_counted(guard, step, why)
        elif flop_count > 0:
            self._found(guard, float(flop_count), "counted")
        else:
            logger.debug("guardrails: the counted step did no matmul FLOPs")

    def _not_counted(self, guard: Guard, step: int, why: str | None) -> None:
        guard.event(
            "flops",
            message=(
                f"the FLOPs of step {step} could not be counted ({why}): "
                "pass efficiency={'flops_per_step': ...} for MFU in the report"
            ),
            flops_per_step=None,
        )

    def _schedule(self, guard: Guard) -> None:
        """At the run's first step: the steps the hooks wait for."""
        self._after_due = _NEVER
        if self.flops_per_step is not None:
            self._found(guard, float(self.flops_per_step), "given")
        elif self.count_flops and flops.compiled(guard.models.values()):
            self._not_counted_compiled(guard)
        elif self.count_flops:
            self._count_at = self._base + self.flops_at_step
            self._after_due = self._count_at
        if self.host_syncs and self._can_sample(guard):
            self._sync_first = self._base + self.host_syncs_at_step
        self._next_boundary(guard.step)  # this step's boundary is still to come

    def _not_counted_compiled(self, guard: Guard) -> None:
        # Its replay would count the eager model's ops, not the compiled kernels' (and
        # under a dispatch mode dynamo would run the step eagerly): not counted.
        guard.event(
            "flops",
            message=(
                "the model is compiled, so its FLOPs are not counted (its eager "
                "forward's ops are not its compiled kernels'): pass efficiency="
                "{'flops_per_step': ...} for MFU in the report"
            ),
            flops_per_step=None,
        )

    def _next_boundary(self, first: int) -> None:
        """The next boundary, from the one after ``first`` steps on, that anything
        starts or ends at."""
        due = [self._sync_first - 1]
        syncs = self.syncs
        if syncs is not None and syncs.active:
            due.append(first)  # every boundary while sampling
        self._boundary_due = min((d for d in due if first <= d < _NEVER - 1), default=_NEVER)

    def _at_boundary(self, guard: Guard) -> None:
        step = guard.step  # the steps done: the one starting now is step + 1
        first = self._sync_first
        syncs = self.syncs
        if step == first - 1:
            self.syncs = self._new_sampler()
            if self.syncs is None:
                logger.debug("guardrails: the loop set a sync debug mode; syncs not sampled")
                self._sync_first = _NEVER
        elif syncs is not None and syncs.active:
            if step == first - 1 + self.host_syncs_steps:
                syncs.stop()
                self._report_syncs(guard, syncs)
            else:
                syncs.next_step()
        self._next_boundary(step + 1)

    def _can_sample(self, guard: Guard) -> bool:
        """Whether this run's syncs can be sampled: torch's sync debug mode is CUDA's."""
        return guard.device.type == "cuda"

    def _new_sampler(self) -> SyncSampler | None:
        """A sampler in sync debug mode, or ``None`` when the loop set a mode itself
        (it is debugging its syncs, and ``"error"`` must stay an error)."""
        sampler = SyncSampler()
        return sampler if sampler.start() else None

    def _stop_all(self) -> None:
        if self.syncs is not None:
            self.syncs.stop()

    # ------------------------------------------------------------------ the reports

    def _advise(self, guard: Guard) -> None:
        facts = advisor.facts(guard)
        facts.bf16_told_at_start = self._bf16_at_start
        for a in advisor.advice(facts):
            guard.event(a.kind, level=a.level, message=a.message, **a.fields)

    def _found(self, guard: Guard, flop_count: float, source: str) -> None:
        """FLOPs per step known: the ``flops`` event, with the peak it is measured
        against."""
        self.flops_per_step_found = flop_count
        dtype = flops.compute_dtype(guard)
        name = flops.device_name(guard.device)
        if self.peak_flops is not None:
            peak, peak_source = self.peak_flops, "given"
        else:
            peak, known = flops.peak_flops(name, dtype)
            peak_source = "table" if peak is not None else None
            if known is not None and peak is not None:
                peak_source = f"table ({known} {dtype})"
        against = (
            f"against a peak of {si(peak, 'FLOP/s')} ({dtype}, {peak_source})"
            if peak is not None
            else (
                f"no peak FLOP/s is known for {name} in {dtype}: pass "
                "efficiency={'peak_flops': ...} for MFU in the report"
            )
        )
        guard.event(
            "flops",
            message=f"{si(flop_count, 'FLOP')} per optimizer step ({source}); {against}",
            flops_per_step=flop_count,
            source=source,
            peak_flops=peak,
            peak_source=peak_source,
            dtype=dtype,
            device_name=name,
        )

    def _report_syncs(self, guard: Guard, syncs: SyncSampler) -> None:
        first = self._sync_first
        self._sync_first = _NEVER
        if syncs.own:
            logger.debug("guardrails: its own host syncs while sampling: %s", syncs.own)
        if not syncs.sites:
            return
        every = syncs.every_step()
        # A GradScaler's step reads its overflow flag every step with a non-fused
        # optimizer: the standard fp16 recipe, told (with its fix) but not a warning.
        avoidable = [s for s in every if "scaler.step(" not in (syncs.lines.get(s) or "")]
        guard.event(
            "host_syncs",
            level="warning" if avoidable else "info",
            message=syncs.message(first),
            sites={
                s: {"per_step": sum(c) / syncs.steps, "steps": c, "source": syncs.lines.get(s)}
                for s, c in syncs.sites.items()
            },
            sampled_steps=[first, first + syncs.steps - 1],
        )
