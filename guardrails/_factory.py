"""``guardrails.guard()``: the engine with every default protection, in one call.

This is where the default components are chosen and their knobs are named, so that
adding a protection in a later release means adding it here, and a user's loop does
not change.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from os import PathLike
from typing import Any

import torch
from torch import nn

from guardrails._component import Component
from guardrails._gc import GCScheduler
from guardrails._guard import Guard, check_knobs
from guardrails._telemetry import Telemetry


def guard(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: Iterable[Any] | None = None,
    *,
    scheduler: Any = None,
    run_dir: str | PathLike[str] | None = None,
    progress: bool | None = None,
    metrics: bool = True,
    metrics_every_n_steps: int = 50,
    metrics_write_every_s: float = 60.0,
    tokens_per_batch: int | None = None,
    gc_every_n_steps: int | None = 100,
    components: Sequence[Component] | None = None,
    **unknown: Any,
) -> Guard:
    """Guard a training loop with the default components::

        with guardrails.guard(model, opt, loader) as g:
            for batch in g:
                loss = model(*batch)
                loss.backward()
                opt.step()
                opt.zero_grad()

    Args:
        model, optimizer, loader, scheduler, run_dir, tokens_per_batch: see
            :class:`~guardrails.Guard`.
        progress: tqdm bar on rank 0; ``None`` = only on a terminal outside CI.
        metrics: record per-step telemetry to ``run_dir/metrics.parquet``.
        metrics_every_n_steps: one device-to-host copy of the metrics per this many
            steps (the only transfer telemetry makes). Default 50.
        metrics_write_every_s: at most one parquet part per this many seconds.
        gc_every_n_steps: after the first step, freeze the survivors and run Python's
            GC only every this many steps, at the same step on every rank (see
            :class:`~guardrails.GCScheduler`); ``None`` leaves the GC alone.
        components: extra components, run after the defaults.

    Returns:
        A :class:`~guardrails.Guard`, not yet started: use it in ``with`` (or call
        ``start()`` / ``close()``).
    """
    if unknown:
        check_knobs(unknown, _KNOBS, "guard")
    chosen: list[Component] = []
    if gc_every_n_steps is not None:
        chosen.append(GCScheduler(every_n_steps=gc_every_n_steps))
    if metrics:
        chosen.append(
            Telemetry(
                every_n_steps=metrics_every_n_steps,
                write_every_s=metrics_write_every_s,
                progress=progress,
            )
        )
    chosen.extend(components or ())
    return Guard(
        model,
        optimizer,
        loader,
        scheduler=scheduler,
        run_dir=run_dir,
        components=chosen,
        tokens_per_batch=tokens_per_batch,
    )


_KNOBS = [
    name
    for name in guard.__code__.co_varnames[
        : guard.__code__.co_argcount + guard.__code__.co_kwonlyargcount
    ]
    if name not in ("model", "optimizer", "loader")
]
