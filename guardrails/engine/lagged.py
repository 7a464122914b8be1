"""A device ring's rows copied to host memory every interval and read one interval
later, so the host never waits on the device; and the step ring, the one such ring of
each step's (loss, grad norm, skipped) that NanGuard and Telemetry share.

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

:class:`StepRing` is the ring both components read: the engine writes each step's row
once (``Guard.step_row()``, whichever component asks first), NanGuard sets its flag
and judges it, Telemetry records it; each reads it lagged at its own interval
(:class:`RingReader`). On CUDA the row is one ``torch.stack`` kernel (two before, one
per component). On a CPU device the ring *is* host memory: the row is stored through a
memoryview of it from the two values read on the host (``Tensor.tolist()`` of a CPU
tensor reads its memory: no kernel, no dispatch), and NanGuard judges those values.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

#: The step ring's columns, in order (``metrics.parquet``'s device columns).
COLUMNS = ("loss", "grad_norm", "skipped")
#: The skipped column's values: the update went in / NanGuard left it out (non-finite
#: gradients) / a GradScaler left it out (its fp16 gradients overflowed).
APPLIED, SKIPPED, SCALER_SKIPPED = 0.0, 1.0, 2.0


class OpenRow(NamedTuple):
    """The row of the step a run ended inside (``Guard.open_row()``): written into the
    :class:`StepRing` (its loss and grad norm were computed) but the step never got
    through ``after_step``, so no component may have recorded it."""

    #: The step's number (1-based, as ``metrics.parquet``'s ``step``).
    step: int
    #: The row's count in the step ring.
    row: int
    #: The optimizer step had returned (an ``after_step`` hook raised): the engine's
    #: ``step_time_s`` is this step's. ``False``: ``before_step`` or the optimizer's own
    #: ``step()`` raised (or never returned), so the step has no step time.
    finished: bool
    #: Unix time the guard learned the run was ending (its close or abort began).
    time: float


class Copy:
    """One copy in flight: ``rows`` (host memory, valid once the copy finished), the
    CUDA event recorded after it (``None`` off CUDA), and what the caller keeps with
    those rows (``meta``: host values of the same steps)."""

    __slots__ = ("event", "meta", "rows", "select")

    def __init__(
        self, rows: Tensor, event: Any, meta: Any, select: list[int] | None = None
    ) -> None:
        self.rows = rows
        self.event = event
        self.meta = meta
        #: The caller's rows among those copied, where the copy spans more (a step ring
        #: row another reader wrote while this one's hook was bypassed); ``None``: all.
        self.select = select

    def ready(self) -> bool:
        """Whether the copy has finished, without waiting (a thread may ask while the
        main thread is stuck in a kernel or collective)."""
        return self.event is None or bool(self.event.query())

    def read(self) -> Tensor:
        """The copied rows, waiting for the copy if it has not finished (started an
        interval ago, it has)."""
        if self.event is not None:
            self.event.synchronize()
        if self.select is None:
            return self.rows
        # Rows no longer in the ring (see StepRing.window) read as NaN.
        nan_row = torch.full_like(self.rows[:1], math.nan)
        return torch.cat((self.rows, nan_row))[self.select]


class LaggedCopy:
    """Copies of ``ring``'s rows into alternating host slots (pinned on CUDA).

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

    def start(
        self, n: int, meta: Any = None, *, first: int = 0, select: list[int] | None = None
    ) -> Copy | None:
        """Start copying the ``n`` rows from ``ring[first]`` on (wrapping past the end),
        kept with ``meta``; return the copy started before this one (``None`` if none),
        to be read now. ``select``: the rows among them that the caller reads."""
        slot = self._slots[self._slot]
        self._slot ^= 1
        ring = self.ring
        end = first + n
        wrap = max(0, end - len(ring))
        event = None
        if self.cuda:
            slot[: n - wrap].copy_(ring[first : end - wrap], non_blocking=True)
            if wrap:
                slot[n - wrap : n].copy_(ring[:wrap], non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            slot[: n - wrap].copy_(ring[first : end - wrap])
            if wrap:
                slot[n - wrap : n].copy_(ring[:wrap])
        previous, self.pending = self.pending, Copy(slot[:n], event, meta, select)
        return previous

    def take(self) -> Copy | None:
        """The newest copy started (``None`` if none or taken already), now the
        caller's to read."""
        copy, self.pending = self.pending, None
        return copy


class StepRing:
    """Each optimizer step's (loss, grad norm, skipped) row, written once per step and
    read by every component that judges or records it (``Guard.step_row()`` writes it;
    NanGuard sets its flag; Telemetry records it).

    On CUDA (``host=False``) the row is one ``torch.stack`` into the ring: no sync; the
    host sees it through a :class:`RingReader`'s lagged copies. On a CPU device
    (``host=True``) the ring is host memory: :meth:`write` reads the loss and the grad
    norm with ``Tensor.tolist()`` (no kernel, no dispatch: ~2 us for both in the loop,
    against ~7.5 us for the stack and a numpy read of its row, a CPU host), stores
    them into the ring through a memoryview and keeps them in :attr:`loss` /
    :attr:`norm`, exactly the float32 values the row holds.
    """

    def __init__(self, device: torch.device, *, host: bool | None = None) -> None:
        self.device = device
        #: Rows stored from host values, no kernel (a CPU ring is host memory).
        self.host = device.type == "cpu" if host is None else host
        #: Rows in the ring: twice the longest reader's interval (see :meth:`reader`).
        self.length = 1
        #: Rows written since the guard started; a row's count names it for readers.
        self.count = 0
        #: The ring index of the newest row.
        self.i = 0
        #: The newest row's loss and grad norm as host floats (host rows only).
        self.loss = self.norm = math.nan
        #: The ring, allocated at the first row (after every reader registered).
        self.ring: Tensor | None = None
        #: Each ring row's skipped slot and grad-norm slot (as a one-tensor list, the
        #: form GradScaler's finiteness kernel takes), made once: indexing is a C call.
        self.flags: list[Tensor] = []
        self.norm_slots: list[list[Tensor]] = []
        #: Each ring row (a view).
        self.rows: tuple[Tensor, ...] = ()
        self._np: np.ndarray | None = None
        self._mv: memoryview | None = None

    def reader(self, every_n_steps: int) -> RingReader:
        """A component that reads the rows on the host every ``every_n_steps`` of its
        steps (lagged copies); registered at start, before the first row."""
        if self.ring is not None:
            raise RuntimeError("a step ring reader registers before the first row is written")
        # Twice the longest interval: a reader's rows span at most that many ring rows
        # even where another component wrote rows in between (benchmark mode bypasses
        # one component's hooks on some steps).
        self.length = max(self.length, 2 * every_n_steps)
        return RingReader(self)

    def _allocate(self) -> None:
        ring = self.ring = torch.zeros((self.length, len(COLUMNS)), device=self.device)
        self.rows = ring.unbind(0)
        self.flags = [r[2] for r in self.rows]
        self.norm_slots = [[r[1:2]] for r in self.rows]
        self._np = ring.numpy() if self.host else None
        # The host ring's floats, flat (row i's columns at 3i, 3i+1, 3i+2).
        self._mv = None if self._np is None else memoryview(self._np).cast("B").cast("f")
        self._nan = torch.full((), math.nan, device=self.device)
        # float, not bool: a bool in the stack sends it down a dtype-promoting path
        # that costs ~2.7 us more per step on CPU (measured, benchmarks/host_ops.py).
        self._zero = torch.zeros((), device=self.device)

    def write(self, loss: Tensor | None, norm: Tensor) -> int:
        """Write the next row, ``(loss, norm, APPLIED)`` (a NaN loss where there is
        none); return its count. The first call allocates the ring (every reader has
        registered by then) and puts this ring's own path in place of this method."""
        self._allocate()
        self.write = self._write_host if self._mv is not None else self._write_device  # type: ignore[method-assign]
        return self.write(loss, norm)

    def _write_device(self, loss: Tensor | None, norm: Tensor) -> int:
        count = self.count
        self.count = count + 1
        i = self.i = count % self.length
        # One kernel: the stack writes straight into the ring row (dtypes promote).
        # Copied, not referenced: a CUDA-graph output would be overwritten next step.
        torch.stack((self._nan if loss is None else loss, norm, self._zero), out=self.rows[i])
        return count

    def _write_host(self, loss: Tensor | None, norm: Tensor) -> int:
        count = self.count
        self.count = count + 1
        i = self.i = count % self.length
        # Three float stores through a memoryview of the ring (~0.15 us; numpy item
        # stores ~0.4 us, a tuple into a numpy row ~0.9 us): each rounds a double to
        # float32 as the stack's cast does, so the values read back are the row's.
        mv: Any = self._mv
        j = 3 * i
        mv[j] = math.nan if loss is None else loss.tolist()
        mv[j + 1] = norm.tolist()
        mv[j + 2] = APPLIED
        self.loss = mv[j]
        self.norm = mv[j + 1]
        return count

    def window(self, counts: list[int]) -> tuple[int, int, list[int] | None]:
        """Where the rows ``counts`` (one reader's, ascending) lie in the ring: ``(ring
        index of the first row spanned, rows spanned, the offsets of ``counts`` among
        them)``, the offsets ``None`` when the span is exactly those rows. A row
        overwritten since (only where another component wrote a whole ring of rows
        while this reader's hooks were bypassed) gets the offset ``span``: NaN."""
        first, last = counts[0], counts[-1]
        span = last - first + 1
        if span == len(counts):
            return first % self.length, span, None
        oldest = max(first, last - self.length + 1)
        span = last - oldest + 1
        return oldest % self.length, span, [c - oldest if c >= oldest else span for c in counts]

    def host_rows(self, counts: list[int]) -> np.ndarray:
        """The rows ``counts`` read straight from a host ring (CPU), float64."""
        assert self._np is not None
        return self._np[[c % self.length for c in counts]].astype(np.float64)


class RingReader:
    """One component's lagged reads of the :class:`StepRing`: :meth:`start` copies the
    rows of the given counts to host memory and hands back the copy started before
    (:class:`LaggedCopy`'s contract), :meth:`take` the newest."""

    def __init__(self, ring: StepRing) -> None:
        self._ring = ring
        self._copies: LaggedCopy | None = None  # made at the first copy: the ring exists

    @property
    def pending(self) -> Copy | None:
        """The newest copy started and not yet taken."""
        return None if self._copies is None else self._copies.pending

    def start(self, counts: list[int], meta: Any = None) -> Copy | None:
        """Start copying the rows ``counts`` (ascending), kept with ``meta``; return the
        copy started before this one (``None`` if none), to be read now."""
        ring = self._ring
        if self._copies is None:
            assert ring.ring is not None
            self._copies = LaggedCopy(ring.ring)
        first, n, select = ring.window(counts)
        return self._copies.start(n, meta, first=first, select=select)

    def take(self) -> Copy | None:
        """The newest copy started (``None`` if none or taken already)."""
        return None if self._copies is None else self._copies.take()
