"""The update size, sampled: how far one optimizer step moved the weights, relative to
the weights (``||w_k - w_{k-1}|| / ||w_{k-1}||``), every ``every`` steps.

An optimization blow-up shows first in the update, not in the gradient: an Adam-style
optimizer sets the update's size by the LR whatever the gradient (a loop that clips is
not protected), and a run whose weights moved 100x more in one step than in any step
before is diverging before anything is non-finite.

Cost, per ``every`` steps and nothing in between (the per-step check is one integer
modulo in ``after_step``): one ``torch.cat`` of a fixed sample of the weights into a
flat buffer after the step before the sampled one, then after the sampled step another
into a scratch buffer, a subtraction and two norms over that sample, and a 2-value
stack. The
sample is a prefix of each parameter, 1/``stride`` of its elements (a view: no copy is
made of the weights themselves), ``stride`` chosen so that it holds at most
``SAMPLE_ELEMENTS`` elements (one element at least of each parameter): 256 KiB of
float32 per snapshot, whatever the model's size. The two norms reach the host lagged:
on a CPU device they are host memory already (read at once, no sync); on CUDA a
``non_blocking`` copy into pinned memory with an event, read at the next sample
(``every`` steps later, long finished: no wait).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import torch
from torch import Tensor
from torch.nn.parameter import is_lazy

#: Elements of the weights in the sample (float32: 256 KiB), whatever the model's size.
#: A norm over 64 Ki elements spread over every parameter in proportion to its size
#: estimates the whole model's ratio closely (a sum of many similar squares).
SAMPLE_ELEMENTS = 1 << 16
#: Samples kept: with ``every=10``, the last 1,000 steps.
KEPT_SAMPLES = 100


class UpdateSampler:
    """Samples the update/weight ratio every ``every`` steps over ``params`` (the
    optimizer's). :attr:`samples` holds ``(step, ratio)`` of the samples read so far."""

    def __init__(self, params: list[Tensor], every: int, lag_steps: int = 0) -> None:
        self.every = every
        self.samples: deque[tuple[int, float]] = deque(maxlen=KEPT_SAMPLES)
        #: The sampled steps that left the sample's weights exactly as they were (a step
        #: skipped, or frozen weights: LR 0, no gradient), which :attr:`samples` omits.
        self.still: deque[int] = deque(maxlen=KEPT_SAMPLES)
        self._params = params
        #: Views of a prefix of each parameter (they follow its updates); built at the
        #: first snapshot (_build).
        self.views: list[Tensor] | None = None
        # Snapshots of the sample, taken in turn: the newest is the weights before the
        # sampled step; the older ones, the weights before the samples before it, so a
        # diagnosis has one from before the first non-finite step (drift()) even when it
        # learns of that step ``lag_steps`` steps late (NanGuard's lagged read: up to two
        # check intervals): 2 + lag_steps / every of them (2 on a CPU device, 4 on CUDA
        # by default: 1 MiB of float32).
        keep = 2 + math.ceil(lag_steps / every)
        self._snaps: list[Tensor] = []
        self._keep = keep
        self._scratch: Tensor | None = None
        #: The step whose weights (after its update) each snapshot holds; -1: none yet.
        self._snap_steps = [-1] * keep
        self._cur = 0
        self._pending: list[tuple[int, Tensor, Any]] = []
        self._cuda = False
        self._dtype = torch.float32

    def _build(self) -> list[Tensor]:
        """The sample's views, at the first snapshot: a lazy module's parameters have
        their shapes by then (a forward has run)."""
        local = [_local(p) for p in self._params if not is_lazy(p)]
        local = [t for t in local if t is not None and t.numel() and t.is_floating_point()]
        # One device (a model split over devices: the first one's parameters).
        local = [t for t in local if t.device == local[0].device]
        total = sum(t.numel() for t in local)
        stride = max(1, math.ceil(total / SAMPLE_ELEMENTS))
        # A contiguous prefix of each parameter (its first rows), its size proportional
        # to the parameter's.
        views = self.views = [t.view(-1)[: max(1, t.numel() // stride)] for t in local]
        if not views:
            return views
        # The sample is gathered into one flat buffer by one torch.cat (a batched copy
        # kernel on CUDA; on a CPU, 148 parameters of GPT-2 small cost one cat, where
        # foreach ops loop over the tensors: 5-7x slower on 2 CPU cores), cast to float32 (a
        # float16 sample's norm would overflow at 65504; float64 weights stay float64).
        wide = any(v.dtype == torch.float64 for v in views)
        self._dtype = torch.float64 if wide else torch.float32
        size, device = sum(v.numel() for v in views), views[0].device
        self._snaps = [
            torch.empty(size, dtype=self._dtype, device=device) for _ in range(self._keep)
        ]
        self._scratch = torch.empty(size, dtype=self._dtype, device=device)
        self._cuda = device.type == "cuda"
        return views

    def after_step(self, step: int) -> None:
        """Called after the optimizer steps (``step``: the one just taken) on the step
        before a sample and on the sample itself (NanGuard filters the others)."""
        phase = step % self.every
        if phase == 0 and self._snap_steps[self._cur] == step - 1:
            self._measure(step)
        if phase == self.every - 1:  # (every=1: after the measure, for the next step)
            views = self._build() if self.views is None else self.views
            if not views:
                return
            self._read_ready()
            self._cur = (self._cur + 1) % len(self._snaps)
            with torch.no_grad():
                torch.cat(views, out=self._snaps[self._cur])
            self._snap_steps[self._cur] = step

    def _measure(self, step: int) -> None:
        both = self._move(self._snaps[self._cur])
        if not self._cuda:
            self._record(step, both.tolist())  # host memory: no sync
            return
        host = torch.empty(2, pin_memory=True)
        host.copy_(both, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending.append((step, host, event))

    def _move(self, snap: Tensor) -> Tensor:
        """``(||w - snap||, ||snap||)`` over the sample, on its device."""
        with torch.no_grad():
            now = torch.cat(self.views, out=self._scratch)  # type: ignore[arg-type]
            return torch.stack(
                (torch.linalg.vector_norm(now.sub_(snap)), torch.linalg.vector_norm(snap))
            )

    def _read_ready(self, *, wait: bool = False) -> None:
        while self._pending and (wait or self._pending[0][2].query()):
            step, host, event = self._pending.pop(0)
            event.synchronize()
            self._record(step, host.tolist())

    def _record(self, step: int, norms: list[float]) -> None:
        diff, weights = norms
        # 0: a skipped step (or frozen weights), no update to compare with.
        if weights > 0 and diff > 0 and math.isfinite(diff):
            self.samples.append((step, diff / weights))
        elif weights > 0 and diff == 0:
            self.still.append(step)

    def drift(self, weights_step: int, before: int) -> tuple[int, int, float] | None:
        """``(from_step, to_step, ratio)``: how far the weights (as of ``weights_step``)
        moved since the newest snapshot older than them and than step ``before`` (the
        first non-finite step: read lagged, the weights may be of a later step, and a
        snapshot taken during the skipped steps after it has seen nothing move),
        relative to their size then (a diagnosis: it may sync); ``None`` when there is
        none."""
        self._read_ready(wait=True)
        limit = min(weights_step, before)
        older = [i for i, s in enumerate(self._snap_steps) if 0 <= s < limit]
        if not self.views or not older:
            return None
        i = max(older, key=self._snap_steps.__getitem__)
        d, w = self._move(self._snaps[i]).tolist()
        if not w > 0:
            return None
        return self._snap_steps[i], weights_step, d / w if math.isfinite(d) else math.inf

    def forget_after(self, step: int) -> None:
        """A rewind set the weights back to those of ``step``: the samples and weight
        snapshots of later steps are of a trajectory left behind."""
        self._read_ready(wait=True)
        kept = [x for x in self.samples if x[0] <= step]
        self.samples.clear()
        self.samples.extend(kept)
        self._snap_steps = [s if s <= step else -1 for s in self._snap_steps]

    def state_dict(self) -> list[list[float]]:
        return [[s, r] for s, r in self.samples]

    def load_state_dict(self, samples: list[list[float]]) -> None:
        self.samples.extend((int(s), float(r)) for s, r in samples)


def _local(p: Tensor) -> Tensor | None:
    """The part of a parameter this rank holds (a DTensor's local shard), flat-viewable,
    or ``None``."""
    t = p.detach()
    to_local = getattr(t, "to_local", None)
    if to_local is not None:
        t = to_local()
    return t if t.is_contiguous() else None
