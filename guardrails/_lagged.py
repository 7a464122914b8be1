"""A device ring's rows copied to host memory every interval and read one interval
later, so the host never waits on the device.

Reading a device value on the host (``.item()``, ``float(t)``) waits for every kernel
queued before it: one such read per step costs 2-7% of a GPT-2-small step on an H200.
Telemetry and NanGuard instead write each step's values into a preallocated ring on the device
(one kernel, no read) and, once per interval, start one ``non_blocking`` copy of the
filled rows into pinned host memory and record a CUDA event after it. They read that
copy at the next interval: by then it has long finished, so the event's
``synchronize()`` returns at once (it only blocks if the device is a whole interval
behind the host).

Two pinned slots alternate: the copy started now goes into one while the previous
one, in the other, is read. On a device that is not CUDA the copy is a plain
(blocking) memcpy and there is no event: the rows are readable as soon as
:meth:`LaggedCopy.start` returns.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class Copy:
    """One copy in flight: ``rows`` (host memory, valid once the copy finished), the
    CUDA event recorded after it (``None`` off CUDA), and what the caller keeps with
    those rows (``meta``: host values of the same steps)."""

    __slots__ = ("event", "meta", "rows")

    def __init__(self, rows: Tensor, event: Any, meta: Any) -> None:
        self.rows = rows
        self.event = event
        self.meta = meta

    def ready(self) -> bool:
        """Whether the copy has finished, without waiting (a thread may ask while the
        main thread is stuck in a kernel or collective)."""
        return self.event is None or bool(self.event.query())

    def read(self) -> Tensor:
        """The copied rows, waiting for the copy if it has not finished (started an
        interval ago, it has)."""
        if self.event is not None:
            self.event.synchronize()
        return self.rows


class LaggedCopy:
    """Copies of ``ring``'s first rows into alternating host slots (pinned on CUDA).

    :meth:`start` starts the copy of the filled rows and hands back the copy started
    before it, the one to read now; :meth:`take` hands back the newest copy (to read it
    at the end, or at once on CPU)."""

    def __init__(self, ring: Tensor) -> None:
        self.ring = ring
        self.cuda = ring.device.type == "cuda"
        self._slots = [torch.empty_like(ring, device="cpu", pin_memory=self.cuda) for _ in range(2)]
        self._slot = 0
        #: The newest copy started and not yet taken.
        self.pending: Copy | None = None

    def start(self, n: int, meta: Any = None) -> Copy | None:
        """Start copying ``ring[:n]`` to the host, kept with ``meta``; return the copy
        started before this one (``None`` if none), to be read now."""
        slot = self._slots[self._slot]
        self._slot ^= 1
        event = None
        if self.cuda:
            slot[:n].copy_(self.ring[:n], non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            slot[:n].copy_(self.ring[:n])
        previous, self.pending = self.pending, Copy(slot[:n], event, meta)
        return previous

    def take(self) -> Copy | None:
        """The newest copy started (``None`` if none or taken already), now the
        caller's to read."""
        copy, self.pending = self.pending, None
        return copy
