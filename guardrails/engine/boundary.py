"""What the last step boundary left of the RNG streams and the data position: what a
failure save writes when the loop failed inside the next step.

A failure in step N+1 (an exception in its forward, a hang in its backward) finds the
model and optimizer still at step N as long as no ``optimizer.step()`` began
(``StepState.update_began``), but the step's forward may have drawn from the RNG
(dropout) and fetched its batch. A checkpoint of step N must hold the RNG streams and
the data position of step N's boundary, or the resumed run is not the run that was never
interrupted. Capturing every stream at every boundary costs ~42 us on a CPU VM (python's
``random.getstate`` 8.7 us, numpy's ``get_state`` 32.7 us, torch's CPU generator 0.9 us,
each CUDA generator ~1 us host-only): too much for every step. So:

* torch's generators (CPU, and each CUDA device initialized by the first boundary) are
  captured at every boundary (``get_state``, a C call each, no Python frame);
* python's ``random`` and numpy's global generator are captured at the first two
  boundaries and at one in :data:`EVERY_N` after them, and at every boundary while they
  change (the first two differ, or two of those checks do: the main process draws from
  them, and the capture is then always the last boundary's). A loop that never draws
  from them in the main process (nanoGPT, nanochat) pays one counter increment and a
  test a step.
  At failure time such a capture is used only if it is the last boundary's or equals
  the current state (nothing drew since); else the save is not exact, and
  :meth:`BoundaryCapture.rng_at_boundary` says why.

The engine writes the public fields inline at each boundary (``engine/guard.py``); a
failure save reads them, from the main thread or from the watchdog's while the main
thread is stuck.

On a GPU the host runs ahead of the device: a rank whose peer died had its host in step
72's backward (its counters at 71) while its GPU still waited in step 71's all-reduce,
step 71's update queued behind it, so the weights there were step 70's (2 DDP ranks over
NCCL, H200). :class:`UpdateMarks` (CUDA, one optimizer; asked for by the failure save)
records an event on the update's stream before and after each ``optimizer.step()``, so a
thread can tell which step's weights the device holds, and keeps what the host held
before its last update (:class:`Before`: that boundary's capture, the step's batches, the
optimizer's hyperparameters and the schedulers' state), so a save of that step is
exact. Two event records and one small object a step, on CUDA only.

A loop that fetches its next batch inside the step (nanoGPT's ``get_batch``, nanochat's
generator) holds that batch at the boundary; a fast-forwarded loader would draw it anew
on resume. :class:`FetchStates` (asked for by the published copy, ``peer.py``, once it
sees such a batch) keeps the torch generators' states just before and just after the
fetch of the first batch past the trained position: a copy that holds the states from
before that fetch lets a resumed rank fetch the same batch again, when nothing else
drew from them between the fetch and the boundary (the states after it are the
boundary's). Two ``get_state`` calls a generator per such fetch.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

if TYPE_CHECKING:
    from guardrails.engine.guard import Guard

#: Python's and numpy's streams are compared every this many boundaries (a power of
#: two: the engine tests ``count & (EVERY_N - 1)``): 13 us of python's and 33 us of
#: numpy's reads spread over 64 steps is ~0.7 us a step.
EVERY_N = 64


class BoundaryCapture:
    """The RNG streams and data position at the last step boundary (see the module
    docstring). The engine writes ``torch``, ``trained_at``, ``epoch`` and ``count`` at
    every boundary, and calls :meth:`check` when ``count & (EVERY_N - 1) == 1`` or while
    ``drawing``."""

    def __init__(self) -> None:
        #: The generators captured at every boundary: the CPU one, then each CUDA
        #: device's once CUDA is initialized (added by :meth:`check`).
        self.generators: tuple[torch.Generator, ...] = (torch.default_generator,)
        #: Their states at the last boundary (``()`` before the first).
        self.torch: tuple[Tensor, ...] = ()
        #: The data position's ``trained_at`` and the guard's epoch at the last boundary,
        #: and how many batches were held past it (fetched before it: a prefetch's).
        self.trained_at: Any = None
        self.epoch = 0
        self.held = 0
        #: Boundaries seen since start.
        self.count = 0
        #: Whether python's or numpy's stream changed between two checks: then they are
        #: captured at every boundary. True until the second boundary shows whether
        #: the loop draws from them.
        self.drawing = True
        #: Python's and numpy's streams as :meth:`check` last read them, and the
        #: boundary count it read them at (the peer copy, ``checkpointer/peer.py``,
        #: takes them when that is the last boundary).
        self.python: Any = None
        self.numpy: Any = None
        self.captured_at = 0
        self._changed = False  # a change seen since the last periodic check
        #: CUDA: where the device is among the updates (:meth:`follow_device`).
        self.updates: UpdateMarks | None = None
        #: The generators' states around the fetch of a held batch (:meth:`follow_fetches`).
        self.fetches: FetchStates | None = None

    def follow_device(self) -> None:
        """Record :class:`UpdateMarks` from now on: the failure save asks for them at its
        start, on CUDA with one optimizer."""
        self.updates = UpdateMarks()

    def follow_fetches(self) -> None:
        """Record :class:`FetchStates` from now on (the published copy asks for them once
        it sees a held batch)."""
        if self.fetches is None:
            self.fetches = FetchStates(self)

    def check(self) -> None:
        """Capture python's and numpy's streams (and pick up the CUDA generators): at
        the first two boundaries, every EVERY_N-th, and every boundary while they
        change."""
        if len(self.generators) == 1 and torch.cuda.is_available() and torch.cuda.is_initialized():
            self.generators = (torch.default_generator, *torch.cuda.default_generators)
            self.torch = tuple(g.get_state() for g in self.generators)
        python, numpy = random.getstate(), np.random.get_state(legacy=True)
        if self.python is not None:
            self._changed = (
                self._changed or python != self.python or not _same_numpy(numpy, self.numpy)
            )
            if self.count & (EVERY_N - 1) == 1 or self.count == 2:  # drew since the last?
                self.drawing, self._changed = self._changed, False
        self.python, self.numpy, self.captured_at = python, numpy, self.count

    def rng_at_boundary(self) -> tuple[dict[str, Any] | None, str]:
        """The streams at the last boundary, as ``stage.stage_rank``'s ``rng`` takes
        them, or ``(None, why not)``: no boundary yet, or python's / numpy's stream drew
        since a capture that is not the last boundary's."""
        if not self.torch:
            return None, "no step boundary was reached"
        fresh = self.captured_at == self.count
        return _streams(self.torch_names, self.torch, self.python, self.numpy, fresh=fresh)

    @property
    def torch_names(self) -> list[str]:
        """The checkpoint's names of :attr:`generators`' streams, in their order."""
        return _torch_names(len(self.generators))


class FetchStates:
    """The generators' states around the fetch of the first batch past the trained
    position (see the module docstring): the engine calls :meth:`before` and
    :meth:`after` around that fetch, with the boundary count then."""

    def __init__(self, capture: BoundaryCapture) -> None:
        self._capture = capture  # its generators: those a boundary captures
        #: The states just before and just after the fetch, and the boundary count
        #: the fetch came after (``-1``: none yet).
        self.pre: tuple[Tensor, ...] = ()
        self.post: tuple[Tensor, ...] = ()
        self.at = -1

    def before(self, count: int) -> None:
        self.pre, self.at = tuple(g.get_state() for g in self._capture.generators), count

    def after(self) -> None:
        self.post = tuple(g.get_state() for g in self._capture.generators)

    def refetch(self, count: int, states: tuple[Tensor, ...]) -> tuple[Tensor, ...] | None:
        """The states before the fetch of the one batch held at boundary ``count``
        (``states``: that boundary's), or ``None`` when a fresh fetch from them would
        not leave the boundary's: the fetch came before another boundary, or something
        drew from the generators after it."""
        if self.at != count - 1 or len(self.post) != len(states):
            return None
        return self.pre if all(map(torch.equal, self.post, states)) else None


def _torch_names(n: int) -> list[str]:
    """The checkpoint's names of ``n`` captured torch generators: the CPU one, then each
    CUDA device's."""
    return ["torch.cpu", *(f"torch.cuda.{i}" for i in range(n - 1))]


class Before:
    """What the host held just before an update began (:meth:`UpdateMarks.began`): the
    last boundary's capture (the step the update starts from), the step's batches, the
    optimizer's hyperparameters (its ``param_groups`` but ``params``: a scheduler sets
    ``lr`` after the update) and each scheduler's ``state_dict()``. References, no copies:
    the engine and torch replace these objects rather than change them."""

    __slots__ = (
        "batches",
        "epoch",
        "fresh",
        "generator_states",
        "groups",
        "held",
        "numpy",
        "python",
        "schedulers",
        "step",
        "torch",
        "trained_at",
    )  # fmt: skip

    def __init__(self, guard: Guard) -> None:
        cap = guard.boundary_capture
        self.step = guard.step
        self.torch = cap.torch
        self.python, self.numpy = cap.python, cap.numpy
        self.fresh = cap.captured_at == cap.count
        self.trained_at, self.epoch, self.held = cap.trained_at, cap.epoch, cap.held
        self.batches: list[Any] = guard.step_batches
        self.generator_states = guard.generator_states
        self.groups = [
            {k: v for k, v in group.items() if k != "params"}
            for opt in guard.optimizers.values()
            for group in opt.param_groups
        ]
        self.schedulers = {name: s.state_dict() for name, s in guard.schedulers.items()}

    def rng(self) -> tuple[dict[str, Any] | None, str]:
        """The streams at this boundary, or ``(None, why not)`` (as
        :meth:`BoundaryCapture.rng_at_boundary`)."""
        if not self.torch:
            return None, "no step boundary was reached"
        names = _torch_names(len(self.torch))
        return _streams(names, self.torch, self.python, self.numpy, fresh=self.fresh)


class UpdateMarks:
    """CUDA events on the update's stream before and after each ``optimizer.step()``
    (the last three updates'), and what the host held before the last one began
    (:attr:`before`): see the module docstring. The engine calls :meth:`began` and
    :meth:`ended` around each update; a failure save asks :meth:`device_step`."""

    def __init__(self) -> None:
        # Each recorded on the stream current when the update is queued (the one its
        # kernels go to: a loop may train on a stream of its own), not one fixed ahead.
        self._began = [torch.cuda.Event() for _ in range(3)]  # update j's at j % 3
        self._ended = [torch.cuda.Event() for _ in range(3)]
        # The update each slot was last recorded for (an event never recorded reads
        # as done, so a slot's update must be known before its event is asked).
        self._began_for = [-1, -1, -1]
        self._ended_for = [-1, -1, -1]
        #: What the host held before the last update began (``None`` before the first).
        self.before: Before | None = None

    def began(self, guard: Guard) -> None:
        """Update ``guard.step + 1`` is about to be queued."""
        j = guard.step + 1
        self.before = Before(guard)
        self._began[j % 3].record()
        self._began_for[j % 3] = j

    def ended(self, step: int) -> None:
        """Update ``step`` was queued (the host's step count is ``step`` now)."""
        self._ended[step % 3].record()
        self._ended_for[step % 3] = step

    def device_step(self) -> int | None:
        """The step whose weights the device holds now: its update is done there and
        the next one has not begun. ``None``: the device is inside an update, or
        further behind than the marks kept."""
        for j in sorted(self._ended_for, reverse=True):
            if j >= 0 and self.holds(j):
                return j
        return None

    def holds(self, step: int) -> bool:
        """Whether the device holds ``step``'s weights now (asked again after a copy:
        still true, the copy is of that step)."""
        i, n = step % 3, (step + 1) % 3
        if self._ended_for[i] != step or not self._ended[i].query():
            return False
        if self._began_for[n] < step + 1:  # the next update was never queued
            return True
        # Queued: not begun while its mark is not reached (a slot recorded for a later
        # update again means this one is long done).
        return self._began_for[n] == step + 1 and not self._began[n].query()


def _streams(
    names: list[str], states: tuple[Tensor, ...], python: Any, numpy: Any, *, fresh: bool
) -> tuple[dict[str, Any] | None, str]:
    """A boundary's RNG streams as ``stage.stage_rank``'s ``rng`` takes them; python's
    and numpy's from a capture that is not that boundary's (``fresh`` false) only if
    nothing drew from them since (they equal the current state)."""
    if not fresh:
        now_py, now_np = random.getstate(), np.random.get_state(legacy=True)
        if now_py != python:
            return None, "python's random stream was drawn from since the last step boundary"
        if not _same_numpy(now_np, numpy):
            return None, "numpy's global random stream was drawn from since the last step boundary"
    out: dict[str, Any] = {"python": python, "numpy": numpy}
    out.update(zip(names, states, strict=True))
    return out, ""


def _same_numpy(a: Any, b: Any) -> bool:
    """Whether two ``np.random.get_state(legacy=True)`` tuples are the same state."""
    return a[0] == b[0] and a[2:] == b[2:] and np.array_equal(a[1], b[1])
