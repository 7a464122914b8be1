"""GuardedDDP: ``DistributedDataParallel`` that checks the ranks' models agree, reports
its gradient all-reduces to the CollectiveAuditor, and explains its own errors.

Three additions, public DDP API only:

* **At construction**, before DDP's own checks, the ranks exchange their parameter
  tables (names, shapes, dtypes, weight checksums: ``preflight/facts.py``'s ``param_table``)
  once. A model that differs in structure raises :class:`~guardrails.ConfigMismatchError`
  on every rank naming the parameters, instead of DDP's "DDP expects same model across
  all ranks, but Rank 1 has 6 params, while rank 0 has inconsistent 8 params". Weights
  that differ (different seeds) are only logged: DDP broadcasts rank 0's weights right
  after, so training is still correct (but dropout and per-rank shuffles differ too).
* **A comm hook with DDP's default semantics**, registered at the first forward unless
  the user registered their own (``register_comm_hook`` still works, once, as in DDP).
  Without a hook the C++ reducer multiplies each gradient by ``1/world_size`` while
  copying it into the bucket (``reducer.cpp``, ``mark_variable_ready_dense``); with one,
  it only copies, and the hook averages:
  - on NCCL, by an AVG all-reduce: NCCL multiplies each rank's input by ``1/world_size``
    inside its own kernel (``ncclAvg`` is a pre-multiplied sum for floating point), the
    reducer's arithmetic, with no pass of its own over the bucket. Dividing first costs
    a second elementwise pass: 225 us of kernel time a step for GPT-2 small's 124M
    gradients on an H200;
  - elsewhere (gloo has no AVG), as torch's reference ``allreduce_hook`` does
    (``torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py``:
    ``tensor.div_(group.size())`` then a SUM ``all_reduce``, "DDP results is expected
    to be same as the case where no hook was registered"); for a power-of-two world
    size ``x * (1/w)`` and ``x / w`` are the same float.
  Gradients are bitwise identical to plain DDP's (tested with 2 ranks, on gloo and on
  NCCL); on gloo with another world size they may differ in the last bit.
  The all-reduce is issued on the ``ProcessGroup`` object (``group.allreduce``), not
  through ``torch.distributed.all_reduce``, which the auditor patches: the bucket is
  reported once, through ``guard.shared.auditor.record(...)`` (the auditor's service to the
  other guards: ``engine/services.CollectiveRecorder``), with the bucket index as site.
  After each bucket's all-reduce the hook also takes the reduced bucket's norm, so the
  guard's per-step grad norm comes from the buckets instead of a second pass over
  every gradient (``engine/gradnorm.BucketNorms``).
* **Its errors explained**: "Expected to have finished reduction in the prior
  iteration" (parameters that got no gradient) is re-raised, chained, naming the
  parameters (DDP gives their indices only, or names with TORCH_DISTRIBUTED_DEBUG) and
  the fix.

The guard finds it when it starts with it as the model (``Guard.start`` calls
``model._guardrails_attach(guard)``); without a guard it is plain DDP plus the checks.
"""

from __future__ import annotations

import inspect
import logging
import re
import weakref
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from guardrails._errors import ConfigMismatchError, GuardrailsError
from guardrails.engine.gradnorm import BucketNorms
from guardrails.util.text import shorten

if TYPE_CHECKING:
    from guardrails.engine.guard import Guard

logger = logging.getLogger("guardrails.ddp")

_INDICES = re.compile(r"Parameter indices which did not receive grad for rank (\d+): ([\d ,]+)")
_NAMES = re.compile(r"Parameters which did not receive grad for rank (\d+): ([^\n]+)")
_UNUSED = "Expected to have finished reduction in the prior iteration"


class GuardedDDP(DistributedDataParallel):
    """``DistributedDataParallel`` with a cross-rank model check at construction,
    audited gradient all-reduces and explained errors. Takes DDP's arguments::

        model = guardrails.GuardedDDP(model, device_ids=[local_rank])

    Args:
        check_consistency: exchange the parameter tables at construction (one
            all_gather of a few KB per rank plus a checksum pass over the weights).
            Default True.
        *args, **kwargs: passed to ``DistributedDataParallel``.
    """

    def __init__(
        self, module: nn.Module, *args: Any, check_consistency: bool = True, **kwargs: Any
    ) -> None:
        if check_consistency and dist.is_available() and dist.is_initialized():
            bound = inspect.signature(DistributedDataParallel.__init__).bind(
                self, module, *args, **kwargs
            )
            _check_models(module, bound.arguments.get("process_group"))
        super().__init__(module, *args, **kwargs)
        self._guardrails_hooked = False
        self._guardrails_guard: Guard | None = None
        # Filled by the hook while a guard whose parameters the buckets cover runs.
        self._guardrails_norms: BucketNorms | None = None
        # Whether the hook's all-reduce averages by itself (NCCL); known at its first call.
        self._guardrails_average: bool | None = None

    # ------------------------------------------------------------------ the hook

    def register_comm_hook(self, state: object, hook: Any) -> None:
        """DDP's ``register_comm_hook``; the user's hook replaces guardrails' default
        one (its ``torch.distributed`` calls are audited like any other)."""
        self._guardrails_hooked = True
        super().register_comm_hook(state, hook)

    def _register_builtin_comm_hook(self, comm_hook_type: Any) -> None:
        self._guardrails_hooked = True
        super()._register_builtin_comm_hook(comm_hook_type)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if not self._guardrails_hooked:
            self._guardrails_hooked = True
            super().register_comm_hook(weakref.ref(self), _audited_allreduce)
        try:
            return super().forward(*inputs, **kwargs)
        except RuntimeError as exc:
            error = self._explain(exc)
            if error is None:
                raise
            raise error from exc

    def _guardrails_attach(self, guard: Guard) -> Any:
        """Called by ``Guard.start``: report to its auditor until it closes; the
        handle's ``bucket_norms`` is the buckets' norms when they cover exactly the
        guard's parameters (else ``None``: the guard computes its own norm)."""
        self._guardrails_guard = guard
        ddp = self
        reduced = {id(p) for p in self._guardrails_reduced_params()}
        norms = None
        if (
            reduced == {id(p) for p in guard.params}
            and getattr(self, "mixed_precision", None) is None  # buckets in another dtype
            and len({p.device for p in guard.params}) == 1
        ):
            norms = BucketNorms(guard.params[0].device)
        self._guardrails_norms = norms

        class _Detach:
            bucket_norms = norms

            def remove(self) -> None:
                if ddp._guardrails_guard is guard:
                    ddp._guardrails_guard = None
                    ddp._guardrails_norms = None

        return _Detach()

    def _guardrails_reduced_params(self) -> list[nn.Parameter]:
        """The parameters DDP's buckets hold: trainable, not ignored (as
        :meth:`reducer_parameter_names` walks them)."""
        ignore = getattr(self, "parameters_to_ignore", set())
        return [
            p
            for name, p in self.module.named_parameters()
            if p.requires_grad and name not in ignore and f".{name}" not in ignore
        ]

    # ------------------------------------------------------------------ errors

    def reducer_parameter_names(self) -> list[str]:
        """Names of the parameters in the order DDP's reducer indexes them (what its
        "Parameter indices which did not receive grad" refer to): trainable, not
        ignored, shared ones once; the same walk as DDP's ``_build_params_for_reducer``."""
        ignore = getattr(self, "parameters_to_ignore", set())
        seen: set[int] = set()
        names = []
        for mod_name, mod in self.module.named_modules():
            for p_name, p in mod.named_parameters(recurse=False):
                fqn = f"{mod_name}.{p_name}" if mod_name else p_name
                # DDP compares f"{module_name}.{param_name}", which starts with "." at
                # the root; accept either spelling.
                if not p.requires_grad or fqn in ignore or f"{mod_name}.{p_name}" in ignore:
                    continue
                if id(p) not in seen:
                    seen.add(id(p))
                    names.append(fqn)
        return names

    def _explain(self, exc: RuntimeError) -> GuardrailsError | None:
        text = str(exc)
        if _UNUSED not in text:
            return None
        rank = dist.get_rank() if dist.is_initialized() else None
        names: list[str] = []
        m = _NAMES.search(text)
        if m:
            names = [n.strip() for n in m.group(2).split(",") if n.strip()]
        else:
            m = _INDICES.search(text)
            if m:
                order = self.reducer_parameter_names()
                for i in re.findall(r"\d+", m.group(2)):
                    names.append(order[int(i)] if int(i) < len(order) else f"#{i}")
        static = "static_graph" in text
        what = (
            f"these {len(names)} parameter(s) got no gradient in the last backward: "
            f"{shorten(names, 8)}"
            if names
            else "some parameters got no gradient in the last backward (DDP did not say "
            "which; set TORCH_DISTRIBUTED_DEBUG=INFO to see them)"
        )
        guard = self._guardrails_guard
        message = f"DDP expected a gradient for every trainable parameter, but {what}. " + (
            "With static_graph=True the set of used parameters must not change between iterations."
            if static
            else "A branch of forward skipped them, or their outputs did not reach the loss."
        )
        fix = (
            "if some iterations legitimately skip them (a conditional branch, an unused "
            "head, mixture-of-experts routing), pass find_unused_parameters=True to "
            "GuardedDDP / DistributedDataParallel (it walks the autograd graph every step); "
            "if they never train, set requires_grad=False on them before wrapping; "
            "otherwise make the loss depend on them."
        )
        if static:
            fix = "drop static_graph=True (the graph changes between iterations), or " + fix
        return GuardrailsError(
            message,
            rank=rank,
            step=guard.step if guard is not None else None,
            hint=fix,
            unused_parameters=names,
            signature="ddp_unused_parameters",
        )


def _audited_allreduce(state: weakref.ref[GuardedDDP], bucket: Any) -> torch.futures.Future:
    """DDP's default gradient averaging (see the module doc), reported to the auditor."""
    ddp = state()
    group = ddp.process_group if ddp is not None else dist.group.WORLD
    tensor = bucket.buffer()
    guard = ddp._guardrails_guard if ddp is not None else None
    auditor = guard.shared.auditor if guard is not None else None
    average = ddp._guardrails_average if ddp is not None else None
    if average is None:
        average = _averages_itself(group, tensor)
        if ddp is not None:
            ddp._guardrails_average = average
    op = dist.ReduceOp.AVG if average else dist.ReduceOp.SUM
    if auditor is not None:
        auditor.record(
            "all_reduce",
            [tensor],
            group=group,
            reduce_op=op,
            site=f"DDP gradient all-reduce (bucket {bucket.index()})",
        )
    if not average:
        # Division first, like torch's allreduce_hook ("to avoid overflow, especially
        # for FP16"), then a SUM all-reduce.
        tensor.div_(group.size())
    # On the group object itself, not through the audited torch.distributed.all_reduce.
    fut = group.allreduce([tensor], op).get_future()
    norms = ddp._guardrails_norms if ddp is not None else None
    if norms is None or guard is None:
        return fut.then(lambda f: f.value()[0])
    index, last, step = bucket.index(), bucket.is_last(), guard.step

    def reduced(f: torch.futures.Future) -> torch.Tensor:
        out = f.value()[0]
        norms.record(index, out, last, step)  # the averaged gradients' norm
        return out

    return fut.then(reduced)


def _averages_itself(group: Any, tensor: torch.Tensor) -> bool:
    """Whether ``group``'s all-reduce of ``tensor`` runs on NCCL, which averages in its
    own kernel (``ReduceOp.AVG``, NCCL 2.10+; every torch guardrails supports ships a
    newer one). Gloo has no AVG, and no other backend is assumed to: they divide first."""
    if not tensor.is_cuda:
        return False
    try:
        backend = str(dist.get_backend(group))  # "nccl", or "cpu:gloo,cuda:nccl"
    except (RuntimeError, ValueError):
        return False
    return backend == "nccl" or "cuda:nccl" in backend


# DDP's _check_comm_hook compares the annotations themselves with dist.GradBucket and
# Future[Tensor]; this module's postponed (string) annotations would fail that check.
_audited_allreduce.__annotations__ = {
    "state": Any,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


# ---------------------------------------------------------------------- construction


def _check_models(module: nn.Module, group: Any) -> None:
    """Exchange parameter tables over ``group`` (or the default group) and raise
    ConfigMismatchError on every rank if their structure differs."""
    from torch.distributed import distributed_c10d as c10d

    from guardrails.guards.preflight.diff import by_rank, odd_ranks, param_diffs
    from guardrails.guards.preflight.facts import param_table

    pg = group if group is not None else c10d._get_default_group()
    temp = None
    if pg is c10d._get_default_group() and dist.get_backend(pg) != "gloo":
        # all_gather_object over NCCL needs the right current device; a gloo group over
        # the same ranks needs nothing (every rank builds DDP on the default group, so
        # every rank calls new_group, which is collective over the default group).
        temp = dist.new_group(backend="gloo")
        pg = temp
    try:
        mine = param_table(module)
        tables: list[Any] = [None] * dist.get_world_size(pg)
        dist.all_gather_object(tables, mine, group=pg)
    finally:
        if temp is not None:
            dist.destroy_process_group(temp)
    fields = param_diffs(tables)
    weights = fields.pop("params.weights", None)
    rank = dist.get_rank()
    if weights is not None and rank == 0:
        logger.warning(
            "guardrails: the ranks' initial weights differ (%s): DDP now broadcasts rank "
            "0's, so training is correct, but different seeds also mean different dropout "
            "masks and per-rank shuffles. Seed every rank the same before building the "
            "model if that is not intended.",
            by_rank(weights),
        )
    if fields:
        odd = sorted({r for v in fields.values() for r in odd_ranks(v)})
        lines = "\n".join(f"  {k}: {by_rank(v)}" for k, v in fields.items())
        raise ConfigMismatchError(
            f"GuardedDDP: the ranks built different models (differing rank(s): "
            f"{shorten(odd, 8)}):\n{lines}",
            rank=rank,
            hint="build the model from the same config on every rank (vocabulary sizes, "
            "layer counts and dtypes must not depend on the rank or on per-rank data); "
            "convert dtypes before wrapping, on every rank.",
            fields={k: dict(v) for k, v in fields.items()},
            ranks=odd,
        )
