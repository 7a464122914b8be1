"""The ranks agree on a step's non-finite flag, where their gradients differ at
``step()``: any rank's set flag sets everyone's.

Where the ranks' gradients differ at ``optimizer.step()`` (a distributed optimizer
that reduces them inside its step, like nanochat's or ``ZeroRedundancyOptimizer``
without DDP), a flag computed from this rank's gradients alone could skip the update
on one rank and not on another. So the flag is agreed, over a group of the guard's
own, never the training's process group (no collective of the user's can ever pair
with it): one host read and one small all-reduce per step. The same all-reduce
carries each rank's squared grad norm, so spikes are judged on the root mean square of
the ranks' grad norms, the same number on every rank (a rank-local norm made each rank
judge its own noise).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from guardrails.distributed import store

if TYPE_CHECKING:
    from guardrails.engine.guard import Guard


class FlagAgreement:
    """The ranks' agreement on each step's flag, and the steps another rank's flag
    set (this rank's was finite: its diagnosis says "another rank")."""

    def __init__(self, guard: Guard, *, needed: bool) -> None:
        self._guard = guard
        # On CUDA, an NCCL group of guardrails' own over the training's ranks
        # (collective to create: every rank starts its NanGuard here, with the same
        # model); NCCL connects it at its first use. Elsewhere: the gloo side group.
        self._nccl: Any = None
        if needed and guard.device.type == "cuda" and "nccl" in str(dist.get_backend()):
            self._nccl = dist.new_group(backend="nccl")
        #: Steps whose agreed flag was set by another rank (this rank's was finite).
        self.foreign: set[int] = set()

    def __call__(self, bad: bool, norm: float = 0.0) -> tuple[bool, float]:
        """``(bad, norm)``: whether any rank's flag is set, and the grad norm to record
        for the step: on a finite step the root mean square of the ranks' grad norms
        (the same number on every rank, so every rank judges the same spikes), on a bad
        one this rank's own (its diagnosis's evidence). One SUM all-reduce of (flag,
        norm ** 2): a sum of 0/1 flags over 0.5 is exactly their MAX.

        Where: on NCCL, an NCCL group of guardrails' own (a tree all-reduce: O(log N)
        hops, tens of microseconds); elsewhere guardrails' gloo side group, whose ring
        is 2(N-1) hops over TCP (~0.1 ms a hop: a second a step at 10,000 ranks).
        Never the training's group, so no collective of the user's can pair with it;
        the auditor still sees it in the training's sequence (``record_own``)."""
        guard = self._guard
        both = torch.tensor([float(bad), norm * norm], dtype=torch.float64)
        auditor = guard.shared.auditor
        if auditor is not None:  # in the training's sequence: see record_own
            auditor.record_own("NaN-flag agreement", both, dist.ReduceOp.SUM)
        if self._nccl is not None:
            # The group's own method, not torch.distributed.all_reduce: the auditor
            # would take it for a collective of the user's on a group of its own.
            on_device, opts = both.to(guard.device), dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.SUM
            self._nccl.allreduce([on_device], opts).wait()
            both = on_device.cpu()
        else:
            dist.all_reduce(both, op=dist.ReduceOp.SUM, group=guard.side_group)
        flags, squares = both.tolist()
        agreed = flags > 0.5
        if agreed and not bad:
            self.foreign.add(guard.step + 1)
        return agreed, norm if agreed else math.sqrt(squares / guard.world_size)

    def forget_after(self, step: int) -> None:
        """The run went back to ``step`` (a rewind): the steps after it are gone."""
        self.foreign = {s for s in self.foreign if s <= step}

    def close(self) -> None:
        """Destroy the flag's NCCL group after a run that ended well or by a stop (after
        a failure a peer may be inside a collective on it: the process's end or the
        guard's abort releases it)."""
        group, self._nccl = self._nccl, None
        if group is not None:
            store.close_side_group(group)
