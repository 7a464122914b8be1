"""Where this process sits in a (possibly) distributed job.

Read once at guard start; nothing here issues a collective.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


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


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` on this host is alive (a zombie, killed but not yet
    reaped by its launcher, counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a killed child not yet reaped by its launcher is a zombie: dead for us
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def wrappers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """``model`` and every module it wraps, outermost first: DDP's ``.module`` and
    torch.compile's ``._orig_mod``, in any order (nanoGPT's ``DDP(compile(m))``,
    ``compile(DDP(m))``). Modules are never tested for truth (a module with
    ``__len__``, like ``nn.Sequential``, can be falsy)."""
    chain = [model]
    for _ in range(8):
        m = chain[-1]
        if isinstance(m, torch.nn.parallel.DistributedDataParallel):
            inner = m.module
        else:
            inner = getattr(m, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            break
        chain.append(inner)
    return chain


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The bare module under DDP / torch.compile wrappers: the one whose weights and
    ``state_dict()`` keys are the model's own (no ``module.`` / ``_orig_mod.`` prefix),
    and whose forward issues no collective and compiles nothing."""
    return wrappers(model)[-1]


def grads_agree(model: torch.nn.Module) -> bool:
    """Whether every rank holds the same gradients at ``optimizer.step()``: DDP
    all-reduced them in the backward (wrapped outside or inside ``torch.compile``), or
    they are DTensors whose norm is global (FSDP2). Otherwise (a distributed optimizer
    that reduces inside its step, like nanochat's) they differ per rank."""
    from guardrails._sharded import is_sharded

    chain = wrappers(model)
    ddp = torch.nn.parallel.DistributedDataParallel
    return any(isinstance(m, ddp) for m in chain) or is_sharded(chain[-1])
