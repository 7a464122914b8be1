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
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch import Tensor

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
        #: The data position's ``trained_at`` and the guard's epoch at the last boundary.
        self.trained_at: Any = None
        self.epoch = 0
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
        python, numpy = self.python, self.numpy
        if self.captured_at != self.count:  # a capture older than the last boundary
            now_py, now_np = random.getstate(), np.random.get_state(legacy=True)
            if now_py != python:
                return None, "python's random stream was drawn from since the last step boundary"
            if not _same_numpy(now_np, numpy):
                return None, (
                    "numpy's global random stream was drawn from since the last step boundary"
                )
        states: dict[str, Any] = {"python": python, "numpy": numpy}
        states.update(zip(self.torch_names, self.torch, strict=True))
        return states, ""

    @property
    def torch_names(self) -> list[str]:
        """The checkpoint's names of :attr:`generators`' streams, in their order."""
        return ["torch.cpu", *(f"torch.cuda.{i}" for i in range(len(self.generators) - 1))]


def _same_numpy(a: Any, b: Any) -> bool:
    """Whether two ``np.random.get_state(legacy=True)`` tuples are the same state."""
    return a[0] == b[0] and a[2:] == b[2:] and np.array_equal(a[1], b[1])
