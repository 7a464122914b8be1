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
from guardrails._memory import MemoryGuard
from guardrails._nan import NanGuard
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
    leak_check_every_n_steps: int | None = 100,
    data_starvation_window_steps: int | None = 100,
    data_starvation_fraction: float = 0.3,
    explain_oom: bool = True,
    nan_policy: str | None = "skip",
    max_consecutive_skips: int = 10,
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
        leak_check_every_n_steps: read live Python objects and device memory every this
            many steps (host counters, no sync) and report steady growth once as a
            ``leak`` event naming what grows and what holds it (see
            :class:`~guardrails.MemoryGuard`); ``None`` turns leak checks off. Default 100.
        data_starvation_window_steps: report once (a ``data_starvation`` event) when,
            over a window of this many steps, waiting for the loader takes at least
            ``data_starvation_fraction`` of the step time; ``None`` turns it off.
            Default 100.
        data_starvation_fraction: see ``data_starvation_window_steps``. Default 0.3.
        explain_oom: re-raise an out-of-memory error that ends the loop as
            :class:`~guardrails.OutOfMemoryError` (still a ``torch.OutOfMemoryError``)
            with where it happened, the memory summary, the largest tensors and ranked
            remedies. Default True.
        nan_policy: what a step with NaN/Inf gradients does (see
            :class:`~guardrails.NanGuard`): ``"skip"`` (default) skips the update on
            every rank and raises :class:`~guardrails.NonFiniteError` after
            ``max_consecutive_skips`` in a row; ``"raise"`` skips and raises at once;
            ``"warn"`` only logs; ``None`` turns NanGuard off.
        max_consecutive_skips: see ``nan_policy``. Default 10.
        components: extra components, run after the defaults. One of the same type as
            a default (e.g. ``NanGuard(spike_factor=10)``) replaces that default.

    Returns:
        A :class:`~guardrails.Guard`, not yet started: use it in ``with`` (or call
        ``start()`` / ``close()``).
    """
    if unknown:
        check_knobs(unknown, _KNOBS, "guard")
    chosen: list[Component] = []
    if gc_every_n_steps is not None:
        chosen.append(GCScheduler(every_n_steps=gc_every_n_steps))
    if (
        leak_check_every_n_steps is not None
        or data_starvation_window_steps is not None
        or explain_oom
    ):
        # After the GCScheduler: a leak check at a collection step sees the heap
        # without that step's cyclic garbage.
        chosen.append(
            MemoryGuard(
                leak_check_every_n_steps=leak_check_every_n_steps,
                data_starvation_window_steps=data_starvation_window_steps,
                data_starvation_fraction=data_starvation_fraction,
                explain_oom=explain_oom,
            )
        )
    if nan_policy is not None:
        # Before Telemetry: it sets the step's `skipped` flag that telemetry records.
        chosen.append(NanGuard(policy=nan_policy, max_consecutive_skips=max_consecutive_skips))
    if metrics:
        chosen.append(
            Telemetry(
                every_n_steps=metrics_every_n_steps,
                write_every_s=metrics_write_every_s,
                progress=progress,
            )
        )
    given = list(components or ())
    for i, default in enumerate(chosen):  # a given component takes its default's place
        mine = [c for c in given if type(c) is type(default)]
        if mine:
            chosen[i] = mine[0]
            given.remove(mine[0])
    chosen += given
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
