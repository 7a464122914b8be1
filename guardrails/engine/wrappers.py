"""The wrappers of the user's objects: ``model.forward``, ``optimizer.step``,
``Tensor.backward`` and ``GradScaler.step`` / ``scale``, installed at the guard's start
and every original put back exactly at its close.

:class:`UserWrappers` owns them and the switches they read on each call (a skip asked
for, a quiet block, a replay); it calls back into the guard through the
:class:`StepHooks` the guard hands it (the step boundary stays the guard's). Why
instance attributes and not torch's hooks: see ``engine/guard.py``'s docstring.
"""

from __future__ import annotations

import contextlib
import functools
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from guardrails.distributed import dist
from guardrails.engine.gradnorm import GradNorm, share_clip_norm
from guardrails.engine.losses import LossRecord

if TYPE_CHECKING:
    from guardrails.engine.guard import Guard


@dataclass(frozen=True)
class StepHooks:
    """The guard's side of each wrapper: what runs around the user's calls."""

    #: Before a forward: whether it is a training forward (and its bookkeeping).
    on_forward: Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], bool]
    #: After a training forward: ``(output, t0)``.
    forward_done: Callable[[Any, float], None]
    #: Around the first optimizer's step, the one ``g.step`` counts.
    before_step: Callable[[], None]
    after_step: Callable[[], None]
    #: Around another optimizer's step (a GAN's second), by its name.
    before_extra_step: Callable[[str], None]
    after_extra_step: Callable[[str], None]
    #: A skipped step of the named optimizer: put back the buffers its forwards wrote.
    put_back: Callable[[str], None]
    #: A GradScaler left the named optimizer's step out (overflow): ``(name, scaler)``.
    scaler_skipped: Callable[[str, Any], None]
    #: A clip_grad_norm_ (L2) clipped ``(parameters, total)``: maybe the step's norm.
    took_clip_norm: Callable[[list[Any], Tensor], None]


class UserWrappers:
    """The wrappers installed on the user's objects while a guard runs, and the
    switches they read. Install with :meth:`install`, undo with :meth:`remove`."""

    def __init__(self, guard: Guard, hooks: StepHooks, losses: LossRecord, norm: GradNorm) -> None:
        self._guard = guard
        self._hooks = hooks
        self._losses = losses
        self._norm = norm
        #: ``skip_update()``: the step's wrapper does not call the optimizer's ``step()``.
        self.skip = False
        #: ``skip_update(where=flag)``: the optimizer leaves the update out on the device
        #: where the flag is set (a fused one's ``found_inf``); buffers follow it.
        self.skip_where: Tensor | None = None
        #: Inside ``g.quiet()``: optimizer steps there are not training steps.
        self.quiet = False
        #: Inside ``g.replaying()``: forwards re-run a step; not training forwards.
        self.replaying = False
        #: Between install and the guard's close: the class-wide wrappers (backward, the
        #: scaler's) pass every call straight through when it is off.
        self.open = False
        #: ``optimizer.step()`` calls that reached a wrapper (a scaler's skip has none).
        self.opt_steps = 0
        self._undo: list[Callable[[], None]] = []

    def install(self) -> None:
        """Wrap every optimizer's ``step``, every model's ``forward``, the scaler's
        ``step`` / ``scale``, ``Tensor.backward`` (one optimizer) and torch's clipping."""
        guard = self._guard
        self.open = True
        for i, (name, opt) in enumerate(guard.optimizers.items()):
            self._undo.append(self._wrap_step(opt, name, counted=i == 0))
        for model in guard.models.values():
            self._undo.append(self._wrap_forward(model))
        self._undo.append(self._wrap_scaler())
        if len(guard.optimizers) == 1:
            # A GAN's two losses straddle its first optimizer's step: the one
            # backpropagated after it is the other model's, not the next step's.
            self._undo.append(self._wrap_backward())
        self._undo.append(share_clip_norm(self._hooks.took_clip_norm))

    def remove(self) -> None:
        """Put back every original. Idempotent."""
        self.open = False
        undo, self._undo = self._undo, []
        for fn in undo:
            fn()

    def _wrap_forward(self, model: nn.Module) -> Callable[[], None]:
        """Set ``model.forward`` (on the instance) to tell the guard about the call, call
        the current forward, then hand its output to the guard; ``guard.phase`` says
        whether the loop is inside the forward.

        Outside the user's compiled graph, whatever the wrapping order. A compiled module
        (``opt = torch.compile(model)``) runs ``model.__call__`` under dynamo's frame
        callback, which compiles the first frame outside torch's own files: without care,
        this wrapper's, so dynamo traced the guard's bookkeeping, guarded on
        ``guard.batch_in_epoch`` and recompiled (2 graphs for 1, 16 captured calls for 7
        on a small CPU model over 8 steps, torch 2.13; 3 graphs over 300 steps). Now this
        wrapper's frame is skipped (``torch._dynamo.eval_frame.skip_code``, what
        ``torch._dynamo.decorators.skip`` does: "skip frames associated with the function
        code, but still process recursively invoked frames", torch 2.8-2.13), so dynamo
        compiles ``inner``, the user's forward, as it would without the guard; the
        bookkeeping before and after runs under ``torch._dynamo.disable`` (recursive:
        nothing it calls, a checkpoint at the step boundary included, is ever compiled;
        ~0.25 us a call on a CPU). Where dynamo inlines this module's call into a bigger
        traced frame (a compiled training step) the skipped wrapper is a graph break in
        that frame, as any ``torch._dynamo.disable``-d code is (``compile(DDP(model))``
        breaks there already: the same counts). tests/loops/test_compile.py counts each
        wrapping order."""
        inner = model.forward
        guard = self._guard
        on_forward, forward_done = _outside_compile(
            self._hooks.on_forward, self._hooks.forward_done
        )

        @functools.wraps(inner)
        def forward(*args: Any, **kwargs: Any) -> Any:
            training = on_forward(model, args, kwargs)
            guard.phase = "forward"
            t0 = time.perf_counter()
            output = inner(*args, **kwargs)
            guard.phase = "backward"  # until optimizer.step(): loss, backward, clipping
            if training:
                forward_done(output, t0)
            return output

        return _set_on_instance(model, "forward", _skipped_frame(forward))

    def _wrap_step(
        self, opt: torch.optim.Optimizer, name: str, *, counted: bool
    ) -> Callable[[], None]:
        """Set ``opt.step`` (on the instance) to run the guard around the current step,
        and to leave the update out when a component asked for it (``skip_update``).
        ``counted``: this optimizer's steps are the guard's steps.

        A bound method, like the one it replaces: torch's LR schedulers wrap
        ``optimizer.step`` too and read its ``__func__`` (one created inside the guard
        wraps this one).
        """
        inner = opt.step
        before = self._hooks.before_step
        after = self._hooks.after_step
        if not counted:
            before = functools.partial(self._hooks.before_extra_step, name)
            after = functools.partial(self._hooks.after_extra_step, name)
        # Outside the user's compiled graph, like the forward's (_wrap_forward): a
        # compiled step (`torch.compile(lambda: opt.step())`) compiles the optimizer's
        # own step, while the guard's before / after run with dynamo off (measured
        # without: 8 graphs for 2 and 14 graph breaks for 2 over 8 steps on a small CPU
        # model).
        prepare, after = _outside_compile(self._prepare_step(opt, name, before), after)

        @functools.wraps(inner)
        def step(self: Any, *args: Any, **kwargs: Any) -> Any:
            how, args, kwargs, out = prepare(args, kwargs)
            if how == _SKIPPED:
                after()  # skipped: weights and optimizer state untouched
                return out
            out = inner(*args, **kwargs)
            if how == _RUN:
                after()
            return out

        return _set_on_instance(opt, "step", types.MethodType(_skipped_frame(step), opt))

    def _prepare_step(
        self, opt: torch.optim.Optimizer, name: str, before: Callable[[], None]
    ) -> Callable[[tuple[Any, ...], dict[str, Any]], tuple[int, Any, Any, Any]]:
        """The part of ``opt``'s wrapped step before the update (``prepare``): a quiet or
        accumulating call bypasses the guard; else the closure's first run, the
        guard's before-step hooks, and the buffers a skip puts back."""
        guard, switches, put_back = self._guard, self, self._hooks.put_back
        # accelerate's prepared optimizer: inside accelerator.accumulate(), step() returns
        # without stepping until the micro-batch that syncs. Those calls are not steps
        # (counted, g.step would count micro-batches and a checkpoint could fall between
        # them, losing the accumulated gradients).
        idle = dist.accumulating(opt)
        # With fp16 its step() runs a GradScaler: a skipped step still goes in, and the
        # scaler, finding the same non-finite gradients, leaves weights and state alone
        # and lowers its scale. Left out, the scale never drops and every later step
        # overflows (measured: NonFiniteError after 10 steps).
        scaler = dist.own_scaler(opt)

        def prepare(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, Any, Any, Any]:
            """Before the update: whether to run it (``_BYPASS``: inner alone, ``_RUN``:
            inner then ``after``, ``_SKIPPED``: no update, then ``after``), with the
            arguments and what a skipped step returns."""
            # A sharded resume's set_state_dict steps the optimizer to create its state.
            if switches.quiet or (idle is not None and idle()):
                return _BYPASS, args, kwargs, None
            switches.skip = False
            closure = kwargs.get("closure", args[0] if args else None)
            first: Any = None
            if closure is not None:
                # LBFGS's step(closure): the closure computes the gradients, so the guard
                # runs it first (as the optimizer would: grad enabled) and judges what it
                # produced; the optimizer's own first call gets that result (_FirstResult).
                with torch.enable_grad():
                    first = closure()
                replay = _FirstResult(first, closure, switches)
                if args:
                    args = (replay, *args[1:])
                else:
                    kwargs = {**kwargs, "closure": replay}
            switches.opt_steps += 1
            if scaler is not None and dist.overflowed(scaler, dist.inner(opt)):
                # The scaler inside step() will skip this update: its normal
                # calibration, told to components as such (not judged as non-finite
                # gradients), and the gradients they see are unscaled, as the update
                # would have used.
                guard.skip_cause, guard.skip_scaler = "fp16_overflow", scaler
            try:
                before()
            finally:
                guard.skip_cause = guard.skip_scaler = None
            if switches.skip or switches.skip_where is not None:  # inline: no frame per step
                put_back(name)
            skipped = switches.skip and scaler is None
            switches.skip = False
            return (_SKIPPED if skipped else _RUN), args, kwargs, first

        return prepare

    def _wrap_scaler(self) -> Callable[[], None]:
        """Set ``torch.amp.GradScaler.step`` (the class's, restored exactly at close) to
        tell the guard when a scaler skips one of its optimizers' steps.

        A GradScaler with a non-fused optimizer does not call ``optimizer.step()`` when
        the gradients overflowed, so the guard saw no step at all: no skipped row, no
        event, and the next row's loss averaged two iterations. The class, not an
        instance: the scaler is rarely passed to the guard (``torch.cuda.amp.GradScaler``
        subclasses it without overriding ``step``). The check costs a dict lookup per
        ``scaler.step()``; the scaler has already read its overflow flag on the host
        (``.item()``) by then.
        """
        from torch.amp import GradScaler

        inner = GradScaler.__dict__["step"]
        inner_scale = GradScaler.__dict__["scale"]
        names = {id(opt): name for name, opt in self._guard.optimizers.items()}
        switches, losses, norm = self, self._losses, self._norm
        scaler_skipped = self._hooks.scaler_skipped

        @functools.wraps(inner_scale)
        def scale(scaler: Any, outputs: Any) -> Any:
            out = inner_scale(scaler, outputs)
            if isinstance(outputs, Tensor) and switches.open:
                losses.scaled = (out, outputs)  # its backward records the unscaled loss
            return out

        @functools.wraps(inner)
        def step(scaler: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            name = names.get(id(optimizer))
            if name is None or not switches.open or not scaler.is_enabled():
                return inner(scaler, optimizer, *args, **kwargs)
            calls = switches.opt_steps
            norm.scaled = True  # DDP buckets hold scaled gradients: not the norm
            out = inner(scaler, optimizer, *args, **kwargs)
            if switches.opt_steps == calls:  # the scaler left the step out: overflow
                scaler_skipped(name, scaler)
            return out

        GradScaler.step = step  # type: ignore[method-assign]
        GradScaler.scale = scale  # type: ignore[method-assign]

        def undo() -> None:
            GradScaler.step = inner  # type: ignore[method-assign]
            GradScaler.scale = inner_scale  # type: ignore[method-assign]

        return undo

    def _wrap_backward(self) -> Callable[[], None]:
        """Set ``torch.Tensor.backward`` (the class's, restored exactly at close) to hand
        the loss record each loss the loop backpropagates: the loss of a loop that
        computes it outside the model (``criterion(model(x), y)``; accelerate's
        ``backward(loss)`` ends in ``loss.backward()`` too). Only a call without
        ``gradient`` (a scalar's), not during a replay or a closure optimizer's
        re-evaluations, and only while no loss came from the model or ``g.observe``
        (which come first): ~0.5 us per backward (a frame), ~2 us with the loss to keep
        (its detach)."""
        inner = Tensor.__dict__["backward"]
        switches, losses = self, self._losses

        @functools.wraps(inner)
        def backward(self: Tensor, gradient: Any = None, *args: Any, **kwargs: Any) -> Any:
            # Inline: a loss the model returned or observe() was given comes first, so
            # the common loop pays this wrapper's frame and one check, nothing more.
            if (
                gradient is None
                and not (losses.auto_n or losses.explicit_n or switches.replaying)
                and switches.open
                and self.numel() == 1  # else torch's own error, unchanged ("scalar outputs")
            ):
                losses.on_backward(self)
            return inner(self, gradient, *args, **kwargs)

        Tensor.backward = backward  # type: ignore[method-assign]

        def undo() -> None:
            Tensor.backward = inner  # type: ignore[method-assign]

        return undo


#: What a wrapped ``optimizer.step()`` does (``_wrap_step``): the update alone (a
#: resume's or an accumulating micro-batch's call), the update inside the guard's step,
#: or no update (a skipped step).
_BYPASS, _RUN, _SKIPPED = 0, 1, 2


@contextlib.contextmanager
def temporarily(obj: Any, name: str, value: Any) -> Iterator[None]:
    """Set ``obj.<name>`` to ``value`` inside the block, then put back what was there
    (so the guard's services built on it nest)."""
    previous = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, previous)


class _FirstResult:
    """The closure handed to a closure optimizer's ``step()`` after the guard ran it
    once: its first call returns that run's result (the gradients it left are the
    ones the guard judged), later calls run the closure again (LBFGS's line search),
    as re-evaluations: not the step's training forwards or loss."""

    def __init__(self, first: Any, closure: Callable[[], Any], switches: UserWrappers) -> None:
        self._first: Any = first
        self._used = False
        self._closure = closure
        self._switches = switches

    def __call__(self) -> Any:
        if not self._used:
            self._used = True
            first, self._first = self._first, None
            return first
        with temporarily(self._switches, "replaying", True):
            return self._closure()


def _set_on_instance(obj: Any, name: str, value: Any) -> Callable[[], None]:
    """Set ``obj.<name>`` on the instance; returns the function that puts back exactly
    what was there: the instance attribute a wrapper (torch.compile's, an LR
    scheduler's, another tool's) had set, or none.

    Into the instance's ``__dict__``, not through ``setattr``: Lightning Fabric's
    module wrapper sets an attribute the wrapped module also has on both, so the
    model's own ``forward`` became the guard's, which called Fabric's, which called the
    model's: a ``RecursionError`` at the first forward."""
    own = vars(obj)
    had_own = name in own
    previous = own.get(name)
    own[name] = value

    def undo() -> None:
        if had_own:
            own[name] = previous
        else:
            own.pop(name, None)

    return undo


def _outside_compile(*fns: Callable[..., Any]) -> list[Callable[..., Any]]:
    """``fns`` run with dynamo off, themselves and everything they call."""
    import torch._dynamo  # imported already: building a torch optimizer imports it

    return [torch._dynamo.disable(fn) for fn in fns]


def _skipped_frame(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` whose own frame dynamo never compiles, while the frames it calls are
    compiled as usual (a compiled module's forward inside it). By its code object, not
    ``torch._dynamo.decorators.skip(fn)``: that follows ``_torchdynamo_orig_callable``,
    which ``functools.wraps`` copies from a compiled module's forward, and would skip
    torch's ``Module.__call__`` instead of ``fn``."""
    from torch._dynamo.eval_frame import skip_code

    skip_code(fn.__code__)
    return fn
