"""Which failures the failure save (``failure.py``) follows, and which rank commits it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from guardrails._errors import CheckpointError, RankFailedError
from guardrails.distributed.store import agent_holds_store

if TYPE_CHECKING:
    from guardrails.engine.guard import Guard
    from guardrails.guards.checkpointer.signals import SignalCapture


def wanted(
    guard: Guard,
    error: BaseException | None,
    *,
    stop: int | None,
    from_thread: bool,
    despite_signal: bool,
    capture: SignalCapture,
    committed_step: int,
) -> bool:
    """Whether ``error`` ending the run calls for a failure save: an ``Exception``
    (not a stop: ``SystemExit``, ``KeyboardInterrupt``; not a save's own
    ``CheckpointError``), after at least one step, not one already saved
    (``committed_step``), and not when a signal ended the run (``stop``: the step a
    signal's stop was decided at; a signal that came after a verdict, torchrun's teardown
    once the stuck rank exited, does not count; nor, ``from_thread``, one before a peer's
    death verdict while the main thread was stuck; ``despite_signal``: the loop failed
    after a signal, before any stop was agreed, so no signal's save will come)."""
    if not isinstance(error, Exception) or stop is not None:
        return False
    if isinstance(error, CheckpointError):  # a save failed: another would fail alike
        return False
    # A failure at start (nothing trained), or a step committed already. A save of
    # this step only begun is no save: a background write the dead rank never
    # finished its part of cannot commit (2 ranks, periodic saves every 4 steps,
    # rank 1 SIGKILLed at the top of step 9: nothing saved, back to step 4).
    if guard.step == 0 or guard.step == committed_step:
        return False
    # A peer's death seen from the watchdog's thread, a signal before its verdict
    # and no stop decided: torchrun's teardown once the peer died (it SIGTERMs the
    # others at once; they wait for the dead one in a collective and never reach
    # the boundary a stop saves at, and the verdict takes the hang timeout), so the
    # failure save is the only save there is. 4 gloo ranks, one SIGKILLed: the
    # SIGTERM came ~4 s before the verdict, and nothing was saved.
    dead_peer = (
        from_thread and isinstance(error, RankFailedError) and error.failed_rank != guard.rank
    )
    return despite_signal or not capture.received or dead_peer or capture.verdict_first(guard)


def committer(dead: int | None, world: int, wedged: frozenset[int] = frozenset()) -> int:
    """The rank that commits a failure save: rank 0 (it holds the replicated state
    every DDP rank holds too), or, when rank 0 is the dead one and the store is
    torchrun's agent's (``TORCHELASTIC_USE_AGENT_STORE``: it outlives rank 0), rank 1,
    the lowest live rank. With the store on rank 0, its death takes the store too:
    the save meets in files, and the first rank done commits (``board.py``). Ranks
    whose GPU is ``wedged`` are alive (the store with them): the lowest other live rank."""
    if wedged:  # none live: rank 0, which has nothing to commit either
        live = [r for r in range(world) if r != dead and r not in wedged]
        return live[0] if live else 0
    return 1 if dead == 0 and agent_holds_store() and world > 1 else 0
