"""The component protocol: how a guard (NanGuard, telemetry, GC, checkpoints...) plugs
into the step lifecycle without the engine knowing its insides.

A component subclasses :class:`Component` and overrides only the hooks it needs. The
engine calls, in this order::

    on_start(guard)              once, when the guard starts (hooks are installed)
    on_boundary(guard)           between steps: the loop body of the last optimizer
                                 step has finished (scheduler stepped, grads zeroed)
                                 and the next step has not started (its batch not
                                 fetched, or, in a loop that prefetches, its first
                                 forward not run); the one point where model,
                                 optimizer, scheduler, RNG and data position agree,
                                 so checkpoints are taken here
    on_batch(guard, batch)       after each batch is fetched from the loader
    before_step(guard)           inside optimizer.step(), before the update; may call
                                 guard.skip_update() to leave the update out
    after_step(guard)            inside optimizer.step(), after the update; guard.step
                                 already counts this step
    before_extra_step(guard, name)
    after_extra_step(guard, name)
                                 the same around a step of another optimizer (a GAN's
                                 second one, by its name in guard.optimizers); these
                                 steps belong to the guard's current step
    on_rewind(guard, from_step)  at a step boundary, right after the model, optimizers,
                                 schedulers and scaler were set back to an earlier
                                 state (the rewind guard: a divergence or a streak of
                                 non-finite steps); guard.step is now that state's
                                 step, from_step the step the run had reached: forget
                                 what was observed of the steps after guard.step
    on_end(guard, exc)           once, when the guard closes; exc is the exception
                                 that ended the loop, or None
    on_abort(guard, error)       instead of on_end, when the process is ended from a
                                 background thread (guard.die: the main thread is stuck
                                 in a collective, a C call or its loader): save what
                                 the host already holds, from this thread, within
                                 seconds, touching neither the device nor a collective
    on_news(guard, error)        while the guard closes (on_end running), a background
                                 thread's verdict: a peer died, a hang; news for a
                                 component still at work (a failure save waiting for
                                 a dead rank's commit), not the run's diagnosis

Hooks a component does not override are never called (the engine dispatches only to
overridden methods), so a component that is not needed costs nothing per step.
Components run in the order given on start / batch / step and in reverse on end,
like nested ``with`` blocks.

Besides its hooks, a component declares (class attributes, checked by the engine when
the guard is built):

* ``name``: unique among a guard's components; it keys the component's state in
  checkpoints, its events and its row in benchmark mode's table.
* ``Config``: the dataclass of its knobs, documented and validated once, where the
  component is defined; ``Component(config)`` or ``Component(**knobs)`` build it, and
  ``guardrails.guard(<section>=Component.Config(...))`` passes it.
* ``after`` / ``before``: names of components that, when present, must run before /
  after this one (e.g. the checkpointer restores every other component's state, so it
  comes after them); a guard built in another order is refused with the reason.
* ``essential``: its per-step hooks keep the ranks in step (a stop agreement), so
  benchmark mode never bypasses them.
* ``saves_checkpoints``: it answers :meth:`Guard.save_checkpoint` through ``save``.
* ``distributed_only``: ``guard()`` leaves it out of a single-process run (it has no
  other rank to wait for or compare with).
* ``state_dict()`` / ``load_state_dict()``: what it keeps across a resume (statistics,
  counters), saved in every checkpoint under its ``name``; ``None``: nothing.
* ``writes_into()``: directories outside ``run_dir`` it writes into, locked like
  ``run_dir`` for the guard's life (two runs sharing a checkpoint directory).

A component never writes the guard's state: it reads ``guard.step``, ``guard.phase``
and the rest (``engine/state.py`` declares them, each with its one writer) and asks the
engine for changes through the guard's services (``request_stop``, ``skip_update``,
``record_skip``, ``step_row``, ``pause_watchdog``, ``in_phase``, ``quiet``,
``replaying``, ``resume_from``, ``fail_from_thread``, ``wrap_batches``,
``replace_error``). Values one component produces for another go in ``guard.shared``,
one writer a field.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from guardrails.engine.guard import Guard

HOOKS = (
    "on_start",
    "on_boundary",
    "on_batch",
    "before_step",
    "after_step",
    "before_extra_step",
    "after_extra_step",
    "on_rewind",
    "on_end",
    "on_abort",
    "on_news",
)


class Component:
    """Base class for everything that plugs into a :class:`~guardrails.Guard`."""

    #: Unique among a guard's components: keys its checkpoint state, events and
    #: benchmark rows. Set it on the class, or on an instance when one class is used
    #: twice (two components named alike are refused).
    name: str = "component"
    #: Its knobs as a dataclass (``None``: it has none). See ``engine/config.py``.
    Config: ClassVar[type[Any] | None] = None
    #: Names of components that, when present, must come before this one.
    after: ClassVar[tuple[str, ...]] = ()
    #: Names of components that, when present, must come after this one.
    before: ClassVar[tuple[str, ...]] = ()
    #: Its per-step hooks keep the ranks in step: benchmark mode never bypasses them.
    essential: ClassVar[bool] = False
    #: It saves checkpoints: :meth:`Guard.save_checkpoint` calls its :meth:`save`.
    saves_checkpoints: ClassVar[bool] = False
    #: Seconds its :meth:`on_abort` may need beyond the metrics' flush (a failure save:
    #: its time limit); :meth:`Guard.die` gives the process's last words that much more.
    abort_s: float = 0.0
    #: Only useful with other ranks: ``guard()`` leaves it out of a single process.
    distributed_only: ClassVar[bool] = False

    def on_start(self, guard: Guard) -> None:
        """The guard started: allocate buffers, open files."""

    def on_boundary(self, guard: Guard) -> None:
        """Between two optimizer steps, before the next batch is fetched (only in loops
        that iterate the guard)."""

    def on_batch(self, guard: Guard, batch: Any) -> None:
        """A batch was fetched from the loader (before the user sees it)."""

    def before_step(self, guard: Guard) -> None:
        """``optimizer.step()`` was called; the parameters are not updated yet."""

    def after_step(self, guard: Guard) -> None:
        """The optimizer step finished; ``guard.step`` counts it."""

    def before_extra_step(self, guard: Guard, name: str) -> None:
        """Another optimizer's ``step()`` (``guard.optimizers[name]``) was called; its
        parameters are not updated yet."""

    def after_extra_step(self, guard: Guard, name: str) -> None:
        """Another optimizer's step finished."""

    def on_rewind(self, guard: Guard, from_step: int) -> None:
        """The run was set back from step ``from_step`` to ``guard.step`` (model,
        optimizers, schedulers, scaler): drop what was observed of the steps after it."""

    def on_end(self, guard: Guard, exc: BaseException | None) -> None:
        """The guard is closing: flush, close files, restore what was changed."""

    def on_abort(self, guard: Guard, error: BaseException) -> None:
        """The process is about to end with ``error`` from a background thread while the
        main thread is stuck: write what the host holds (no device work, no collective,
        no lock the main thread may hold); the process exits right after."""

    def on_news(self, guard: Guard, error: BaseException) -> None:
        """While the guard closes, a background thread's verdict (``error``: a peer died,
        a hang), which does not replace the loop's own error: a component still at work
        in its ``on_end`` may use it. Called from a thread of its own, which the close
        waits for (bounded by the longest ``abort_s`` + 10 s)."""

    def state_dict(self) -> dict[str, Any] | None:
        """What this component keeps across a resume (JSON values), or ``None``."""
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, at resume (after ``on_start``)."""

    def save(self, guard: Guard) -> Path:
        """With ``saves_checkpoints``: save a checkpoint now; returns its directory."""
        raise NotImplementedError(f"{type(self).__name__} does not save checkpoints")

    def writes_into(self) -> dict[str, Path]:
        """Directories outside ``run_dir`` it writes into, by the user's name for each
        (``{"checkpoint directory": ...}``): rank 0 holds each with run_dir's lock
        (``engine/rundir.py``), so two runs sharing one are refused at start. Called
        before ``on_start``."""
        return {}


def overrides(component: Component, hook: str) -> bool:
    """Whether ``component`` defines its own ``hook`` (so the engine should call it)."""
    return getattr(type(component), hook) is not getattr(Component, hook)


def check_component_list(components: Any) -> Sequence[Component]:
    """``guard(components=...)``: a list (or tuple) of :class:`Component` instances, or
    ``None``; a ``TypeError`` naming the argument otherwise."""
    if components is None:
        return ()
    if not isinstance(components, (list, tuple)):
        raise TypeError(
            "guard(components=...) takes a list of guardrails.Component instances, got "
            f"{type(components).__name__} {components!r}"[:200]
        )
    for c in components:
        if not isinstance(c, Component):
            raise TypeError(
                "guard(components=...) takes guardrails.Component instances, got "
                f"{type(c).__name__} {c!r}"[:200]
            )
    return components


def check_components(components: Sequence[Component]) -> None:
    """The protocol's checks, when a guard is built: unique names, and every ``after``
    / ``before`` constraint between the components present."""
    where: dict[str, int] = {}
    for i, c in enumerate(components):
        if c.name in where:
            other = components[where[c.name]]
            raise ValueError(
                f"two components are named {c.name!r} ({type(other).__name__} and "
                f"{type(c).__name__}): the name keys each one's state in checkpoints and "
                "its events, so it must be unique. Give each its own `name` (on the class, or "
                "on the instance when one class is used twice)."
            )
        where[c.name] = i
    for i, c in enumerate(components):
        for name in c.after:
            if where.get(name, -1) > i:
                raise ValueError(_order(c, components[where[name]], "after"))
        for name in c.before:
            if where.get(name, len(components)) < i:
                raise ValueError(_order(c, components[where[name]], "before"))


def _order(c: Component, other: Component, how: str) -> str:
    return (
        f"{type(c).__name__} ({c.name!r}) must run {how} {type(other).__name__} "
        f"({other.name!r}) ({type(c).__name__}.{how}); reorder `components`, or pass "
        "only your extra components to guardrails.guard(), which places the defaults."
    )
