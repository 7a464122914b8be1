"""``guardrails.guard()``: the engine with every default protection, in one call.

This is where the default components are chosen, so that adding a protection in a
later release means adding it to :data:`SECTIONS`, and a user's loop does not change.
Each default is a *section* of ``guard()``, named here and configured by the
component's own ``Config`` (documented there, once): ``nan=NanGuard.Config(...)``, a
dict of its knobs, ``True`` for its defaults, ``False`` to leave it out. The order of
the components is theirs to declare (``Component.after`` / ``before``, checked by the
engine), not this module's.

Each section is also a typed keyword of ``guard()`` (its knobs as a ``TypedDict`` at the
end of this module), so an editor completes ``nan=`` and the knobs inside it. A section
added to ``SECTIONS`` alone already works (as ``**more_sections``); its typed keyword
and ``TypedDict`` follow, and ``tests/engine/test_config.py`` fails until they agree with
``SECTIONS`` and the ``Config``.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from os import PathLike
from typing import Any, TypedDict

from torch import nn

from guardrails.distributed.store import distributed
from guardrails.engine.component import Component, check_component_list
from guardrails.engine.config import built, check_knobs, check_removed, section
from guardrails.engine.guard import Guard, Optimizers
from guardrails.guards.audit.auditor import CollectiveAuditor
from guardrails.guards.checkpointer.checkpointer import SignalCheckpointer
from guardrails.guards.efficiency.efficiency import Efficiency
from guardrails.guards.explain import ErrorExplainer
from guardrails.guards.gc import GCScheduler
from guardrails.guards.memory.guard import MemoryGuard
from guardrails.guards.nan.guard import NanGuard
from guardrails.guards.pace.pace import Pace
from guardrails.guards.preflight.preflight import Preflight
from guardrails.guards.rewind.rewind import Rewind
from guardrails.guards.telemetry import Telemetry
from guardrails.guards.watchdog.watchdog import Watchdog
from guardrails.metrics.sinks import Sink, check_sinks

#: The default components, as ``guard()`` sections: section name -> component class,
#: in the order they run (each class's ``after`` / ``before`` says why it is there).
SECTIONS: dict[str, type[Component]] = {
    "explain": ErrorExplainer,
    "gc": GCScheduler,
    "memory": MemoryGuard,
    "nan": NanGuard,
    "watchdog": Watchdog,
    "audit": CollectiveAuditor,
    "metrics": Telemetry,
    "pace": Pace,
    "preflight": Preflight,
    "rewind": Rewind,
    "checkpoint": SignalCheckpointer,
    "efficiency": Efficiency,
}


def guard(
    model: nn.Module | Sequence[nn.Module] | Mapping[str, nn.Module],
    optimizer: Optimizers,
    loader: Iterable[Any] | None = None,
    *,
    scheduler: Any = None,
    scaler: Any = None,
    generators: Any = None,
    run_dir: str | PathLike[str] | None = None,
    resume: str | PathLike[str] | None = "auto",
    config: Mapping[str, Any] | None = None,
    progress: bool | None = None,
    log_to: str | Sink | Callable[[Any], Any] | Sequence[Any] | None = None,
    tokens_per_batch: int | None = None,
    replay_fn: Callable[[Any, Any], Any] | None = None,
    benchmark: bool = False,
    graph_grad_norm: bool = False,
    components: Sequence[Component] | None = None,
    # The sections, as SECTIONS orders them; the default: the class's section_default.
    explain: bool | ErrorExplainer.Config | ExplainKnobs | None = True,
    gc: bool | GCScheduler.Config | GCKnobs | None = True,
    memory: bool | MemoryGuard.Config | MemoryKnobs | None = True,
    nan: bool | NanGuard.Config | NanKnobs | None = True,
    watchdog: bool | Watchdog.Config | WatchdogKnobs | None = True,
    audit: bool | CollectiveAuditor.Config | AuditKnobs | None = True,
    metrics: bool | Telemetry.Config | MetricsKnobs | None = True,
    pace: bool | Pace.Config | PaceKnobs | None = True,
    preflight: bool | Preflight.Config | PreflightKnobs | None = True,
    rewind: bool | Rewind.Config | RewindKnobs | None = False,
    checkpoint: bool | SignalCheckpointer.Config | CheckpointKnobs | None = True,
    efficiency: bool | Efficiency.Config | EfficiencyKnobs | None = True,
    **more_sections: Any,
) -> Guard:
    """Guard a training loop with the default components::

        with guardrails.guard(model, opt, loader) as g:
            for batch in g:
                loss = model(*batch)
                loss.backward()
                opt.step()
                opt.zero_grad()

    Each protection is a section keyword: ``True`` (its defaults), ``False`` (left out),
    its component's ``Config``, or a dict of its knobs, e.g. ``checkpoint={"keep_last":
    5}, nan=guardrails.NanGuard.Config(policy="raise"), gc=False``. docs/sections.md
    says which are on and why, and docs/configuration.md documents every knob.

    Args:
        model, optimizer, loader: a module and its optimizer, or lists / dicts of them
            trained together (a GAN); ``g.step`` counts the first optimizer's steps.
        resume: ``"auto"``: continue from the newest valid checkpoint in ``run_dir``; a
            path: that checkpoint; ``None``: start fresh (the checkpoint's ``resume``).
        config: your run's settings (``vars(args)``), compared across ranks and saved:
            a resume under other settings names the changed keys.
        progress: a tqdm bar on rank 0; ``None``: only on a terminal outside CI.
        log_to: also send metrics and events to ``"tensorboard"``, ``"wandb"``,
            ``"mlflow"``, a :class:`~guardrails.Sink`, a function of the rows, or a list.
        components: extra components, run after the defaults; one of a default's type
            (``NanGuard(spike_factor=10)``) takes that default's place.
        The others: see :class:`~guardrails.Guard`, which this returns, not yet started.
    """
    keywords = locals()  # the section keywords (those of this signature) by name
    given = {name: keywords[name] for name in SECTIONS if name in keywords}
    configs = _section_configs({**given, **more_sections})
    _set_conveniences(configs, resume=resume, config=config, progress=progress, log_to=log_to)
    return Guard(
        model,
        optimizer,
        loader,
        components=_chosen(configs, components),
        scheduler=scheduler,
        scaler=scaler,
        generators=generators,
        run_dir=run_dir,
        tokens_per_batch=tokens_per_batch,
        benchmark=benchmark,
        graph_grad_norm=graph_grad_norm,
        replay_fn=replay_fn,
    )


def _section_configs(given: Mapping[str, Any]) -> dict[str, Any]:
    """Each section's ``Config`` (``None``: left out) from ``guard()``'s keywords; an
    unknown keyword is a ``TypeError`` naming the closest one, or the new spelling of a
    knob of release 0.1."""
    unknown = [name for name in given if name not in SECTIONS]
    check_removed("guard", unknown)
    check_knobs(dict.fromkeys(unknown), {*_KEYWORDS, *SECTIONS}, "guard()")
    return {
        # A section is on unless given False; one whose class says so (rewind) is off
        # unless given.
        name: section(name, given.get(name, getattr(cls, "section_default", True)), cls.Config)
        for name, cls in SECTIONS.items()
    }


def _set_conveniences(
    configs: dict[str, Any], *, resume: Any, config: Any, progress: Any, log_to: Any
) -> None:
    """The top-level knobs that set a section's field, into that section."""
    _set_top_level(configs, "checkpoint", "resume", resume, "auto")
    _set_top_level(configs, "preflight", "run_config", config, None, knob="config")
    _set_top_level(configs, "checkpoint", "run_config", config, None, knob="config")
    _set_top_level(configs, "metrics", "progress", progress, None)
    if log_to is not None:
        if configs["metrics"] is None:
            raise TypeError(
                "guard(log_to=...) sends telemetry's rows, but guard(metrics=False) turns "
                "telemetry off: drop one or the other."
            )
        sinks = check_sinks(log_to, "log_to")
        _set_top_level(configs, "metrics", "sinks", sinks, (), knob="log_to")


def _chosen(configs: Mapping[str, Any], components: Sequence[Component] | None) -> list[Component]:
    """The components to run: each section's that is on and has something to do here,
    then the user's, one of the same type as a default taking that default's place."""
    chosen: list[Component] = []
    for name, cfg in configs.items():
        if cfg is None or (SECTIONS[name].distributed_only and not distributed()):
            continue
        if not getattr(cfg, "does_anything", True):
            continue
        chosen.append(SECTIONS[name](cfg))
    extra = list(check_component_list(components))
    for i, default in enumerate(chosen):  # a given component takes its default's place
        mine = [c for c in extra if type(c) is type(default)]
        if mine:
            chosen[i] = mine[0]
            extra.remove(mine[0])
    return chosen + extra


def _set_top_level(
    configs: dict[str, Any],
    where: str,
    field: str,
    value: Any,
    default: Any,
    *,
    knob: str | None = None,
) -> None:
    """A top-level convenience knob (``resume``, ``config``, ``progress``, ``log_to``)
    into its section's field; given both ways, with different values, it is ambiguous.
    ``knob``: the top-level name, where it is not the field's."""
    cfg = configs[where]
    if cfg is None or value == default:
        return
    if getattr(cfg, field) != default and getattr(cfg, field) != value:
        also = "" if knob is None else f" (as {field})"
        raise TypeError(
            f"guard() was given {knob or field} twice, differently: at the top level and "
            f"in guard({where}=...){also}. Set it in one place."
        )
    configs[where] = built(
        f"guard({knob or field}=...)", lambda: dataclasses.replace(cfg, **{field: value})
    )


#: guard()'s own keywords, for the closest-name hint.
_KEYWORDS = [
    p.name
    for p in inspect.signature(guard).parameters.values()
    if p.kind is inspect.Parameter.KEYWORD_ONLY
]


# ---------------------------------------------------- the sections' knobs, as types
# One TypedDict per section, its keys and types those of the component's Config
# (tests/engine/test_config.py checks them): what an editor completes inside nan={...}.


class ExplainKnobs(TypedDict, total=False):
    """``guard(explain=...)`` has no knobs: ``True`` or ``False``."""


class GCKnobs(TypedDict, total=False):
    """``guard(gc=...)``'s knobs, each documented in ``GCScheduler.Config``."""

    every_n_steps: int
    generation: int
    full_every_n_steps: int | None
    long_pause_s: float


class MemoryKnobs(TypedDict, total=False):
    """``guard(memory=...)``'s knobs, each documented in ``MemoryGuard.Config``."""

    leak_check_every_n_steps: int | None
    leak_window_checks: int
    data_starvation_window_steps: int | None
    data_starvation_fraction: float
    data_starvation_min_wait_s: float
    explain_oom: bool


class NanKnobs(TypedDict, total=False):
    """``guard(nan=...)``'s knobs, each documented in ``NanGuard.Config``."""

    policy: str
    max_consecutive_skips: int
    check_every_n_steps: int
    spike_factor: float
    loss_spike_factor: float
    max_spike_events: int
    window_steps: int
    capture: bool
    replay: bool
    replay_fn: Callable[[Any, Any], Any] | None
    max_diagnoses: int
    update_every_n_steps: int | None
    divergence_factor: float | None
    divergence_steps: int


class WatchdogKnobs(TypedDict, total=False):
    """``guard(watchdog=...)``'s knobs, each documented in ``Watchdog.Config``."""

    hang_timeout_s: float | None
    first_step_timeout_s: float
    heartbeat_every_s: float | None
    abort_after_s: float


class AuditKnobs(TypedDict, total=False):
    """``guard(audit=...)``'s knobs, each documented in ``CollectiveAuditor.Config``."""

    interval_s: float
    close_wait_s: float
    abort_after_s: float
    flight_recorder: bool


class MetricsKnobs(TypedDict, total=False):
    """``guard(metrics=...)``'s knobs, each documented in ``Telemetry.Config``."""

    every_n_steps: int
    write_every_s: float
    progress: bool | None
    sinks: tuple[Any, ...]
    sink_close_timeout_s: float
    compact_every_s: float | None


class PaceKnobs(TypedDict, total=False):
    """``guard(pace=...)``'s knobs, each documented in ``Pace.Config``."""

    window_steps: int
    compare_every_s: float
    straggler_factor: float
    straggler_min_share: float
    slowdown_factor: float
    comm_share: float
    persist_windows: int


class PreflightKnobs(TypedDict, total=False):
    """``guard(preflight=...)``'s knobs, each documented in ``Preflight.Config``."""

    check: bool
    run_config: Mapping[str, Any] | None
    even_batches: bool


class RewindKnobs(TypedDict, total=False):
    """``guard(rewind=...)``'s knobs, each documented in ``Rewind.Config``."""

    snapshot_every_steps: int
    max_rewinds: int
    skip_batches: int
    lr_scale: float
    lr_warmup_steps: int


class CheckpointKnobs(TypedDict, total=False):
    """``guard(checkpoint=...)``'s knobs, each documented in ``SignalCheckpointer.Config``."""

    every_n_steps: int | None
    every_s: float | None
    keep_last: int | None
    save_on_signal: bool
    signals: tuple[str, ...]
    exit_on_signal: bool
    grace_s: float
    background: bool
    resume: str | PathLike[str] | None
    allow_world_size_change: bool
    run_config: Mapping[str, Any] | None
    allow_config_change: bool | Sequence[str]
    directory: str | PathLike[str] | None
    agree_every_s: float
    strict_cadence: bool
    local_directory: str | PathLike[str] | None
    local_keep_last: int
    save_on_failure: bool
    failure_save_timeout_s: float


class EfficiencyKnobs(TypedDict, total=False):
    """``guard(efficiency=...)``'s knobs, each documented in ``Efficiency.Config``."""

    advise: bool
    count_flops: bool
    flops_at_step: int
    flops_per_step: float | None
    peak_flops: float | None
    host_syncs: bool
    host_syncs_at_step: int
    host_syncs_steps: int
