"""``guardrails.guard()``: the engine with every default protection, in one call.

This is where the default components are chosen and their knobs are named, so that
adding a protection in a later release means adding it here, and a user's loop does
not change.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from os import PathLike
from typing import Any

from torch import nn

from guardrails._audit import CollectiveAuditor
from guardrails._checkpointer import DEFAULT_SIGNALS, SignalCheckpointer
from guardrails._checks import mapping, positive
from guardrails._component import Component
from guardrails._explain import ErrorExplainer
from guardrails._gc import GCScheduler
from guardrails._guard import Guard, Optimizers, check_knobs
from guardrails._memory import MemoryGuard
from guardrails._nan import NanGuard
from guardrails._preflight import Preflight
from guardrails._store import distributed
from guardrails._telemetry import Telemetry
from guardrails._watchdog import Watchdog


def guard(
    model: nn.Module | Sequence[nn.Module] | Mapping[str, nn.Module],
    optimizer: Optimizers,
    loader: Iterable[Any] | None = None,
    *,
    scheduler: Any = None,
    scaler: Any = None,
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
    replay_fn: Callable[[Any, Any], Any] | None = None,
    hang_timeout_s: float | None = None,
    first_step_timeout_s: float = 600.0,
    audit_collectives: bool = True,
    resume: str | PathLike[str] | None = "auto",
    save_on_signal: bool = True,
    exit_on_signal: bool = True,
    checkpoint_every_n_steps: int | None = None,
    checkpoint_every_s: float | None = None,
    keep_last_checkpoints: int | None = 3,
    grace_s: float = 30.0,
    resume_allow_world_size_change: bool = False,
    preflight: bool = True,
    config: Mapping[str, Any] | None = None,
    even_batches: bool = False,
    explain_errors: bool = True,
    benchmark: bool = False,
    graph_grad_norm: bool = False,
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

    Several optimizers (a GAN, actor-critic) are one guard: pass every model and every
    optimizer, as lists or dicts by name::

        with guardrails.guard([gen, disc], [opt_g, opt_d], loader) as g:

    Every optimizer's steps are guarded (a NaN in the discriminator's step never
    reaches its weights), ``g.step`` counts the first optimizer's steps, and one
    checkpoint holds every model, optimizer and scheduler.

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
        replay_fn: how NanGuard replays a non-finite step's batch to find its cause,
            ``replay_fn(model, batch) -> output or loss``. Default ``None``: re-run the
            step's training forward calls with the arguments they were given (the
            guard records them), which needs no help for ``model(x, y)``,
            ``model(**batch)`` or ``criterion(model(x), y)`` loops; give it to replay a
            loss computed outside the model too.
        hang_timeout_s: distributed runs: seconds without progress on any rank before
            the :class:`~guardrails.Watchdog` reports a ``HangError`` (or
            ``RankFailedError`` / ``UnevenDataError``) naming the rank, where it is
            and every rank's stack, and ends the job. ``None`` (default): 5x the
            slowest step seen, within 60-300 s; the first step gets 600 s
            (compilation). Mark long legitimate pauses with ``g.pause_watchdog()``.
            Not installed in a single-process run.
        first_step_timeout_s: distributed runs: the watchdog's allowance for the first
            optimizer step (compilation, autotuning, NCCL's lazy communicator setup), for
            a rank inside its step; a rank still waiting for its first batch from its
            loader gets ``hang_timeout_s``. Default 600 s (NCCL's own timeout).
        audit_collectives: distributed runs: record every rank's collectives (op,
            shapes, dtype, call site) and raise
            :class:`~guardrails.CollectiveMismatchError` on every rank as soon as two
            ranks' sequences differ (see :class:`~guardrails.CollectiveAuditor`): a few
            microseconds of host work per collective, no extra collective. Default
            True. Not installed in a single-process run.
        scaler: the ``torch.amp.GradScaler``, if any: saved in checkpoints.
        resume: ``"auto"`` (default): if ``run_dir/checkpoints`` holds a checkpoint,
            continue from the newest valid one before the first batch (model,
            optimizer, scheduler, scaler, ``g.state``, ``g.step``, every RNG, the data
            position: bitwise the run that was never interrupted); a path: that
            checkpoint (or the newest under it), which must exist; ``None``: start
            fresh. A checkpoint that does not fit raises :class:`~guardrails.ResumeError`.
        save_on_signal: on SIGTERM, SIGINT (Ctrl+C) or SIGUSR1, every rank stops at the
            same step, saves a complete checkpoint and exits (see ``exit_on_signal``).
            A second Ctrl+C exits at once. Default True.
        exit_on_signal: after the signal save raise ``SystemExit(128 + signum)``;
            ``False``: end ``for batch in g`` instead (``g.stopping`` says why).
        checkpoint_every_n_steps: also save every this many steps (``None``: never).
            Training blocks only to copy the state off the GPU; a thread writes it.
        checkpoint_every_s: also save every this many seconds, at a step every rank
            agrees on (``None``: never).
        keep_last_checkpoints: keep the newest this many checkpoints (``None``: all).
            Default 3.
        grace_s: seconds the launcher allows between SIGTERM and SIGKILL (torchrun and
            SLURM: 30); a save slower than 80% of it is reported at once.
        resume_allow_world_size_change: resume a checkpoint written by a different
            number of ranks (replicated state only; see :func:`guardrails.resume`).
        preflight: distributed runs: at start, every rank exchanges once (over a gloo
            side group) what must match and raises
            :class:`~guardrails.ConfigMismatchError` on every rank, naming each
            differing field with every rank's value: parameter names, shapes, dtypes
            and initial-weight checksums; optimizer type and hyperparameters; loader
            length, dataset length, batch size and the first batch's shapes; world
            size, backend, device type, compute dtype; torch / CUDA / NCCL versions;
            ``config``. Launch problems (``WORLD_SIZE`` vs the process group,
            ``LOCAL_RANK`` vs visible GPUs, two ranks on one GPU) raise
            :class:`~guardrails.LaunchError`. Also warns (``bf16_on_cpu`` event) about
            bf16 compute on a CPU without native bf16. Costs one exchange at start
            (~0.5 s for GPT-2 small on 2 CPU cores, dominated by the weight checksum)
            and nothing per step. Default True; a no-op in a single-process run (except
            the bf16 warning).
        config: your run's settings (``vars(args)``, a dict from a YAML file), compared
            across ranks by the preflight, key by key.
        even_batches: distributed runs: stop every rank after the shortest rank's
            number of batches, so uneven data ends the loop on every rank together
            instead of hanging the longer ones (loaders with ``len()``: no per-step
            cost; without: one side-group agreement per 16 batches). Differing loader
            lengths are then an ``uneven_data`` event, not an error. Default False.
        explain_errors: re-raise a known torch / NCCL / gloo / CUDA error that ends the
            loop ("NCCL timeout", "Address already in use", "invalid device ordinal",
            "Connection reset by peer"...) as the guardrails error of its family with
            the cause and fix (see :func:`guardrails.explain`); the original is its
            ``__cause__``. Default True.
        benchmark: measure what the guard costs in this loop: a few sampled steps run
            with the components' per-step hooks bypassed (training unchanged; those
            steps are not NaN-checked or recorded); at close a table of step time
            guarded vs bypassed, overhead with a 95% interval and per-component cost goes
            to ``run_dir/benchmark.json`` and the log. Default False.
        graph_grad_norm: experimental, one CUDA device: compute the per-step grad norm
            (shared by NanGuard, Telemetry and ``g.clip_grad_norm_``) by replaying a
            CUDA graph of its kernels whenever the gradients are at addresses a graph
            was captured with: one launch instead of one output tensor per gradient
            (GPT-2 small: ~63 instead of ~535 us of host time per step, H100). Exact:
            a step whose gradients are elsewhere is computed eagerly; a loop whose
            gradients never settle goes back to eager by itself. A
            ``grad_norm_graph`` event at the end counts replays. Default False until
            its in-loop gain is measured (see benchmarks/RESULTS.md); no effect on
            CPU, model-parallel or sharded (DTensor) models.
        components: extra components, run after the defaults. One of the same type as
            a default (e.g. ``NanGuard(spike_factor=10)``) replaces that default.

    Returns:
        A :class:`~guardrails.Guard`, not yet started: use it in ``with`` (or call
        ``start()`` / ``close()``).
    """
    if unknown:
        check_knobs(unknown, _KNOBS, "guard")
    mapping("config", config, allow_none=True)
    # First: its on_end runs last, so a component's own explanation (an OOM, a
    # collective mismatch) wins over the generic one (replace_error: first call wins).
    chosen: list[Component] = [ErrorExplainer()] if explain_errors else []
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
    positive("hang_timeout_s", hang_timeout_s, allow_none=True)  # checked even when unused
    positive("first_step_timeout_s", first_step_timeout_s)
    if distributed():  # a single process has nobody to wait for: not installed at all
        chosen.append(
            Watchdog(hang_timeout_s=hang_timeout_s, first_step_timeout_s=first_step_timeout_s)
        )
        if audit_collectives:
            # After the watchdog: closing runs in reverse, so a mismatch that explains
            # a peer's crash replaces the loop's error before "rank failed" would.
            chosen.append(CollectiveAuditor())
    if metrics:
        chosen.append(
            Telemetry(
                every_n_steps=metrics_every_n_steps,
                write_every_s=metrics_write_every_s,
                progress=progress,
            )
        )
    if preflight or (even_batches and distributed()):
        # After the watchdog (a rank that never arrives is then reported, not waited
        # for) and the components whose on_end assumes their on_start ran (a mismatch
        # ends start() here); before the checkpointer: the weights compared are the
        # ones each rank built, not the resumed ones.
        chosen.append(Preflight(config=config, even_batches=even_batches, check=preflight))
    if save_on_signal or checkpoint_every_n_steps or checkpoint_every_s or resume is not None:
        # Last: it resumes after the others started (their statistics are restored
        # into them) and it closes first (its final save sees every component open).
        chosen.append(
            SignalCheckpointer(
                every_n_steps=checkpoint_every_n_steps,
                every_s=checkpoint_every_s,
                keep_last=keep_last_checkpoints,
                signals=DEFAULT_SIGNALS if save_on_signal else (),
                exit_on_signal=exit_on_signal,
                grace_s=grace_s,
                resume=resume,
                allow_world_size_change=resume_allow_world_size_change,
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
        scaler=scaler,
        run_dir=run_dir,
        components=chosen,
        tokens_per_batch=tokens_per_batch,
        benchmark=benchmark,
        graph_grad_norm=graph_grad_norm,
        replay_fn=replay_fn,
    )


_KNOBS = [
    name
    for name in guard.__code__.co_varnames[
        : guard.__code__.co_argcount + guard.__code__.co_kwonlyargcount
    ]
    if name not in ("model", "optimizer", "loader")
]
