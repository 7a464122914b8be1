"""Where this process sits in a (possibly) distributed job, and the library wrappers
around the user's optimizer and loader (HF accelerate's) that guardrails looks through.

Read once at guard start; nothing here issues a collective. The model's own wrappers
(DDP, torch.compile) are unwrapped in :mod:`guardrails.engine.model`.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch.distributed as dist

from guardrails.util import probes


def rank() -> int:
    """This process's global rank: the process group's if one is up, else torchrun's
    ``RANK`` variable, else 0."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_world_size(world: int) -> int:
    """How many ranks share this rank's node, as the launcher says (``LOCAL_WORLD_SIZE``:
    torchrun and most launchers, whose node's ranks are consecutive); ``world`` when it
    does not say, and 1 for a single process (whatever its shell left in the
    environment)."""
    if world <= 1:
        return 1
    return int(os.environ.get("LOCAL_WORLD_SIZE", world) or world)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` on this host is alive (a zombie, killed but not yet
    reaped by its launcher, counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A killed child not yet reaped by its launcher is a zombie: dead for us.
    fields = probes.stat_fields(f"/proc/{pid}/stat")
    return not fields or fields[0] != "Z"


#: Wrappers that keep the user's object under one attribute and delegate to it, by
#: ``(module, class)`` of the wrapper or a base of it: HF accelerate's
#: ``prepare()``d optimizer and loaders (DataLoaderShard, DataLoaderDispatcher and
#: SkipDataLoader all derive from DataLoaderAdapter). Matched by name, so guardrails
#: does not import accelerate; and by ``type()``, since a prepared loader reports
#: ``DataLoader`` as its ``__class__`` (``isinstance`` cannot tell them apart).
DELEGATES = {
    ("accelerate.optimizer", "AcceleratedOptimizer"): "optimizer",
    ("accelerate.data_loader", "DataLoaderAdapter"): "base_dataloader",
    # Lightning Fabric's setup() / setup_dataloaders() (the `lightning` package, and
    # the standalone `lightning_fabric`).
    ("lightning.fabric.wrappers", "_FabricOptimizer"): "_optimizer",
    ("lightning.fabric.wrappers", "_FabricDataLoader"): "_dataloader",
    ("lightning_fabric.wrappers", "_FabricOptimizer"): "_optimizer",
    ("lightning_fabric.wrappers", "_FabricDataLoader"): "_dataloader",
}


def delegates(obj: Any) -> list[Any]:
    """``obj`` and every object it delegates to, outermost first: an accelerate
    ``AcceleratedOptimizer``'s ``.optimizer``, a prepared loader's ``.base_dataloader``
    (the ``torch.utils.data.DataLoader`` it iterates), Lightning Fabric's optimizer and
    loader wrappers' ``._optimizer`` / ``._dataloader``. Not modules: see
    :func:`guardrails.engine.model.wrappers`."""
    chain = [obj]
    for _ in range(4):
        attr = next(
            (
                DELEGATES[key]
                for c in type(chain[-1]).__mro__
                if (key := (c.__module__, c.__qualname__)) in DELEGATES
            ),
            None,
        )
        wrapped = None if attr is None else vars(chain[-1]).get(attr)
        if wrapped is None:
            break
        chain.append(wrapped)
    return chain


def inner(obj: Any) -> Any:
    """The user's own object under a library's wrapper (:func:`delegates`): the torch
    optimizer whose ``step()`` updates the weights and which reads ``found_inf``, the
    DataLoader whose sampler and generators decide a pass's order."""
    return delegates(obj)[-1]


def accumulating(optimizer: Any) -> Any:
    """For an accelerate ``AcceleratedOptimizer``: a function telling whether its
    ``step()`` is a no-op right now (inside ``accelerator.accumulate()`` before the
    micro-batch that syncs, it returns without stepping). ``None`` for any other
    optimizer: every ``step()`` is a step."""
    state = vars(optimizer).get("gradient_state") if len(delegates(optimizer)) > 1 else None
    return None if state is None else lambda: not state.sync_gradients


def own_scaler(optimizer: Any) -> Any:
    """The enabled GradScaler an accelerate ``AcceleratedOptimizer`` runs inside its
    ``step()`` (``Accelerator(mixed_precision="fp16")``), or ``None``."""
    scaler = vars(optimizer).get("scaler") if len(delegates(optimizer)) > 1 else None
    return scaler if scaler is not None and scaler.is_enabled() else None


def unscaled(scaler: Any, optimizer: Any) -> bool:
    """Whether ``optimizer``'s gradients were unscaled this step (``scaler.unscale_``):
    before that they are multiplied by the loss scale. ``False`` when the scaler's
    bookkeeping cannot be read."""
    from torch.amp.grad_scaler import OptState

    try:
        state = scaler._per_optimizer_states[id(inner(optimizer))]
        return state["stage"] is OptState.UNSCALED
    except (AttributeError, KeyError, TypeError):
        return False


def overflowed(scaler: Any, optimizer: Any) -> bool:
    """Unscale ``optimizer``'s gradients now, as ``scaler.step()`` would before deciding
    (``GradScaler.unscale_``, the documented step before clipping), and return whether
    they overflowed. Its ``step()`` then skips the update without unscaling again. A
    no-op returning the recorded verdict when they were unscaled already this step
    (the user clipped). One host read, the one the scaler's own step makes anyway."""
    from torch.amp.grad_scaler import OptState

    state = scaler._per_optimizer_states[id(optimizer)]
    if state["stage"] is OptState.READY:
        scaler.unscale_(optimizer)
    found = state["found_inf_per_device"]
    return bool(sum(v.item() for v in found.values())) if found else False


def imported_class(module: str, name: str) -> Any:
    """``module.name`` if ``module`` is imported already, else ``None``, for an
    ``isinstance`` check that imports nothing: an object can only be an instance of a
    class whose module was imported, and some are costly to import for a run that does
    not use them (``torch.distributed.optim`` compiles its functional optimizers with
    TorchScript on import: 0.25-0.35 s of every guard's start on a CPU host, 0.8-1.0
    s before ``torch._dynamo`` is imported; ``torch.distributed.tensor`` up to ~0.2 s)."""
    mod = sys.modules.get(module)
    return None if mod is None else getattr(mod, name)
