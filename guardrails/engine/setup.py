"""What a :class:`~guardrails.Guard` is given, checked once at its construction: the
arguments, the parameters the step's grad norm covers, the default run directory, and
the trainable parameters no optimizer updates (told at start).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from guardrails.engine.component import Component, check_components
from guardrails.engine.model import averaged
from guardrails.util.checks import positive_int
from guardrails.util.text import shorten


def validate(
    model: nn.Module,
    optimizers: Mapping[str, torch.optim.Optimizer],
    loader: Any,
    components: list[Component],
    tokens_per_batch: Any,
) -> list[nn.Parameter]:
    """Every argument check in one place; returns the model's parameters."""
    params = list(model.parameters())
    if not params:
        raise ValueError(
            f"the model ({type(model).__name__}) has no parameters, so there is nothing to "
            "train or guard. Pass the module that holds the weights."
        )
    meta = [n for n, p in model.named_parameters() if p.is_meta]
    if meta:
        raise ValueError(
            f"guard() got a `model` with {len(meta)} parameter(s) on the meta device "
            f"({shorten(meta, 3)}): they hold no values, so nothing can be trained. It was "
            "built under torch.device('meta') or accelerate's init_empty_weights: "
            "materialize it first (model.to_empty(device=...), then initialize or load "
            "its weights), then build the optimizer and the guard."
        )
    ids = {id(p) for p in params}
    if len({id(o) for o in optimizers.values()}) < len(optimizers):
        raise ValueError("the same optimizer was passed twice; pass each one once.")
    seen: dict[int, str] = {}  # parameter id -> the optimizer that owns it
    for name, optimizer in optimizers.items():
        owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
        which = "the optimizer" if len(optimizers) == 1 else f"optimizer {name!r}"
        if not owned & ids:
            raise ValueError(
                f"{which} owns none of the model's parameters, so its step() would "
                "never change this model. It was probably built from another model "
                "instance (a copy, or one re-created after the optimizer), or the model "
                "it trains was not passed: build it from this model "
                "(torch.optim.AdamW(model.parameters(), ...)), or pass every model: "
                "guard([gen, disc], [opt_g, opt_d], ...)."
            )
        shared = next((seen[i] for i in owned if i in seen), None)
        if shared is not None:
            raise ValueError(
                f"optimizers {shared!r} and {name!r} both own a parameter: each parameter "
                "must be updated by one optimizer. Split the parameters between them."
            )
        seen.update(dict.fromkeys(owned, name))
    if loader is not None and (
        not isinstance(loader, Iterable) or isinstance(loader, (str, bytes))
    ):
        raise TypeError(
            f"`loader` must be an iterable of batches (DataLoader, generator, list), "
            f"got {type(loader).__name__}."
        )
    check_components(components)
    positive_int("tokens_per_batch", tokens_per_batch, allow_none=True)
    return params


def trained_params(
    model: nn.Module, optimizers: Mapping[str, torch.optim.Optimizer], params: list[nn.Parameter]
) -> list[nn.Parameter]:
    """Of the model's ``params``, those the step's grad norm and NaN flag cover."""
    # An EMA passed beside the model (guard([model, ema], ...)) is saved with it;
    # its parameters take no gradient: neither normed nor NaN-checked.
    ema = averaged(model)
    if ema and any(id(p) not in ema for p in params):
        params = [p for p in params if id(p) not in ema]
    if len(optimizers) > 1:
        # The step's grad norm and NaN flag are the first optimizer's: another's
        # gradients (a GAN's generator, left from its last backward) are checked
        # at that optimizer's own step.
        first_opt = next(iter(optimizers.values()))
        first = {id(p) for g in first_opt.param_groups for p in g["params"]}
        params = [p for p in params if id(p) in first]
    return params


def default_run_dir() -> Path:
    """``runs/<script>``: the same on every rank and across restarts of the script."""
    stem = Path(sys.argv[0]).stem if sys.argv and sys.argv[0] else ""
    return Path("runs") / (stem or "guardrails")


def coverage_warning(
    model: nn.Module, optimizers: Mapping[str, torch.optim.Optimizer]
) -> dict[str, Any] | None:
    """The ``params_not_in_optimizer`` event's fields when trainable parameters are in
    no optimizer and will never be updated (the frozen-params / LoRA-wiring failure:
    the loss does not decrease); ``None`` when every one is."""
    owned = {
        id(p) for opt in optimizers.values() for group in opt.param_groups for p in group["params"]
    }
    owned |= averaged(model)  # an EMA's: updated by update_parameters()
    missing = [
        name for name, p in model.named_parameters() if p.requires_grad and id(p) not in owned
    ]
    if not missing:
        return None
    shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
    return {
        "message": (
            f"{len(missing)} trainable parameter(s) are not in the optimizer and will "
            f"never be updated: {shown}. If they should train, build the optimizer "
            "from model.parameters() after wrapping/adapting the model; if not, set "
            "requires_grad=False."
        ),
        "params": missing,
    }
