"""Model plumbing: what guardrails needs to know about the user's model, in one place.

A training script hands ``guard()`` the model it trains, which is often not the module
that holds the weights: ``DDP(model)`` keeps it under ``.module``, ``torch.compile``
under ``._orig_mod``, in either order (nanoGPT's ``DDP(compile(m))``, or
``compile(DDP(m))``); HF accelerate's ``prepare()`` builds exactly these two. Every
component that saves, loads, replays or describes the model goes through
:func:`unwrap` so they all see the same module, whose ``state_dict()`` keys are the
model's own and whose forward issues no collective and compiles nothing.

Also here: whether the weights are sharded across ranks (:func:`is_sharded`,
:func:`holds_shards`), whether the ranks' gradients agree at ``optimizer.step()``
(:func:`grads_agree`), the scalar loss inside a model's output (:func:`find_loss`, on
the engine's per-forward path), a recorded forward call's arguments by name
(:func:`named_arguments`) and a batch moved to a device (:func:`to_device`).

Nothing here issues a collective or reads a device value on the host.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from guardrails.checkpoint.sharded import is_sharded

#: Wrapper layers followed at most (a real chain is 1-2 deep; the bound only stops a
#: module that wraps itself).
_MAX_DEPTH = 8


def averaged(model: nn.Module) -> set[int]:
    """The ids of the parameters that sit in an ``AveragedModel`` inside ``model`` (an
    EMA or SWA copy, ``torch.optim.swa_utils``): trained by ``update_parameters``, not
    by an optimizer nor by gradients, so never in the optimizer by design."""
    from torch.optim.swa_utils import AveragedModel

    return {id(p) for m in model.modules() if isinstance(m, AveragedModel) for p in m.parameters()}


def wrappers(model: nn.Module) -> list[nn.Module]:
    """``model`` and every module it wraps, outermost first: DDP's ``.module``,
    torch.compile's ``._orig_mod`` and Lightning Fabric's ``._forward_module``, in any
    order. Modules are never tested for truth (a
    module with ``__len__``, like ``nn.Sequential``, can be falsy).

    FSDP1's ``FullyShardedDataParallel`` is not unwrapped: the module inside it holds
    flattened shards, not the model's parameters, so its own ``state_dict()`` is the
    right one (FSDP2's ``fully_shard`` wraps nothing: the model is its own module)."""
    chain = [model]
    for _ in range(_MAX_DEPTH):
        m = chain[-1]
        if isinstance(m, nn.parallel.DistributedDataParallel):
            inner = m.module
        elif type(m).__name__ == "_FabricModule" and "_forward_module" in m._modules:
            # Lightning Fabric's setup(): the module it runs (DDP's, or the model).
            inner = m._modules["_forward_module"]
        else:
            inner = getattr(m, "_orig_mod", None)  # torch.compile's OptimizedModule
        if not isinstance(inner, nn.Module):
            break
        chain.append(inner)
    return chain


def unwrap(model: nn.Module) -> nn.Module:
    """The bare module under DDP / torch.compile wrappers: the one whose weights and
    ``state_dict()`` keys are the model's own (no ``module.`` / ``_orig_mod.`` prefix),
    and whose forward issues no collective and compiles nothing."""
    return wrappers(model)[-1]


# ---------------------------------------------------------------------- sharding


def holds_shards(model: nn.Module) -> bool:
    """Whether each rank holds a different piece of the weights: DTensor parameters
    (:func:`is_sharded`) or FSDP1's flattened ones (a ``FullyShardedDataParallel``
    anywhere in the model, matched by class name so FSDP1 is not imported). Their
    values cannot be compared across ranks. FSDP1 is not :func:`is_sharded`: its
    parameters are plain local tensors, so neither their norms nor DCP's DTensor path
    apply to them."""
    if is_sharded(model):
        return True
    return any(type(m).__name__ == "FullyShardedDataParallel" for m in model.modules())


def grads_agree(model: nn.Module) -> bool:
    """Whether every rank holds the same gradients at ``optimizer.step()``: DDP
    all-reduced them in the backward (wrapped outside or inside ``torch.compile``), or
    they are DTensors whose norm is global (FSDP2). Otherwise (a distributed optimizer
    that reduces inside its step, like nanochat's) they differ per rank."""
    return ddp_wrapped(model) or is_sharded(unwrap(model))


def ddp_wrapped(model: nn.Module) -> bool:
    """Whether DDP wraps ``model`` (outside or inside ``torch.compile``): its backward
    all-reduces the gradients."""
    ddp = nn.parallel.DistributedDataParallel
    return any(isinstance(m, ddp) for m in wrappers(model))


# ---------------------------------------------------------------------- outputs


def is_loss(t: Any) -> bool:
    """A training loss: a floating-point 0-d tensor that carries a graph."""
    return isinstance(t, Tensor) and t.ndim == 0 and t.is_floating_point() and t.requires_grad


def find_loss(output: Any) -> Tensor | None:
    """The scalar training loss inside a model's output, if it returns one: the output
    itself, ``output["loss"]``, the first loss among a tuple's first four items
    (nanoGPT's ``(logits, loss)``), or ``output.loss`` (HF ``ModelOutput``).

    The engine calls it on every training forward: a handful of ``isinstance`` checks,
    no device work (a value on the host would cost a sync per step)."""
    if isinstance(output, Tensor):
        return output if is_loss(output) else None
    if isinstance(output, Mapping):
        loss = output.get("loss")
        return loss if is_loss(loss) else None
    if isinstance(output, (tuple, list)):
        for item in output[:4]:
            if is_loss(item):
                return item
        return None
    loss = getattr(output, "loss", None)
    return loss if is_loss(loss) else None


# ---------------------------------------------------------------------- inputs


def named_arguments(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """A recorded forward call's arguments as one mapping by the names in the bare
    model's ``forward`` signature (``idx``, ``targets``...), or ``arg0``, ``arg1``...
    when the signature cannot bind them (a wrapper's ``*args, **kwargs``)."""
    try:
        bound = inspect.signature(unwrap(module).forward).bind_partial(*args, **kwargs)
    except (TypeError, ValueError):
        return {**{f"arg{i}": a for i, a in enumerate(args)}, **kwargs}
    return dict(bound.arguments)


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor moved to ``device``, through nested mappings, tuples
    and lists (a tuple stays a tuple, a mapping becomes a dict); anything else is
    returned as is. A blocking copy: used off the per-step path only."""
    if isinstance(batch, Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return (
            type(batch)(to_device(v, device) for v in batch)
            if isinstance(batch, tuple)
            else [to_device(v, device) for v in batch]
        )
    return batch
