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
    on_end(guard, exc)           once, when the guard closes; exc is the exception
                                 that ended the loop, or None
    on_abort(guard, error)       instead of on_end, when the process is ended from a
                                 background thread (guard.die: the main thread is stuck
                                 in a collective, a C call or its loader): save what
                                 the host already holds, from this thread, within
                                 seconds, touching neither the device nor a collective

Hooks a component does not override are never called (the engine dispatches only to
overridden methods), so a component that is not needed costs nothing per step.
Components run in the order given on start / batch / step and in reverse on end,
like nested ``with`` blocks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from guardrails._guard import Guard

HOOKS = (
    "on_start",
    "on_boundary",
    "on_batch",
    "before_step",
    "after_step",
    "before_extra_step",
    "after_extra_step",
    "on_end",
    "on_abort",
)


class Component:
    """Base class for everything that plugs into a :class:`~guardrails.Guard`."""

    #: Short name used in events and error messages.
    name: str = "component"

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

    def on_end(self, guard: Guard, exc: BaseException | None) -> None:
        """The guard is closing: flush, close files, restore what was changed."""

    def on_abort(self, guard: Guard, error: BaseException) -> None:
        """The process is about to end with ``error`` from a background thread while the
        main thread is stuck: write what the host holds (no device work, no collective,
        no lock the main thread may hold); the process exits right after."""


def overrides(component: Component, hook: str) -> bool:
    """Whether ``component`` defines its own ``hook`` (so the engine should call it)."""
    return getattr(type(component), hook) is not getattr(Component, hook)
