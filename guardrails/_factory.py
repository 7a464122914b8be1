"""``guardrails.guard()``: the engine with every default protection, in one call.

This is where the default components are chosen, so that adding a protection in a
later release means adding it to :data:`SECTIONS`, and a user's loop does not change.
Each default is a *section* of ``guard()``, named here and configured by the
component's own ``Config`` (documented there, once): ``nan=NanGuard.Config(...)``, a
dict of its knobs, ``True`` for its defaults, ``False`` to leave it out. The order of
the components is theirs to declare (``Component.after`` / ``before``, checked by the
engine), not this module's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from os import PathLike
from typing import Any

from torch import nn

from guardrails.distributed.store import distributed
from guardrails.engine.component import Component, check_component_list
from guardrails.engine.config import ALIASES, apply_aliases, built, check_knobs, section
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

Section = bool | Mapping[str, Any] | None


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
    **sections: Section | Any,
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

    Each protection is a section, configured by its component's ``Config`` (its knobs
    are documented there) or a dict of those knobs; ``True`` is its defaults, ``False``
    leaves it out::

        guardrails.guard(
            model, opt, loader,
            checkpoint={"every_n_steps": 1000, "keep_last": 5},
            nan=guardrails.NanGuard.Config(policy="raise"),
            watchdog={"hang_timeout_s": 120},
            gc=False,
        )

    Args:
        model, optimizer, loader, scheduler, run_dir, tokens_per_batch, replay_fn,
            benchmark, graph_grad_norm: see :class:`~guardrails.Guard`.
        scaler: the ``torch.amp.GradScaler``, if any: saved in checkpoints.
        generators: the loop's own ``torch.Generator`` (batches or noise drawn without a
            loader), or a list / dict of them by name: saved in checkpoints and set back
            at resume.
        resume: ``"auto"`` (default): continue from the newest valid checkpoint under
            ``run_dir/checkpoints`` if there is one; a path: that checkpoint; ``None``:
            start fresh (see :class:`SignalCheckpointer.Config`, whose ``resume`` this
            sets).
        config: your run's settings (``vars(args)``, a dict from a YAML file, a
            dataclass), compared across ranks by the preflight, key by key, and saved
            in every checkpoint: resuming one saved with another config raises
            :class:`~guardrails.ResumeError` naming the changed keys (the ``run_config``
            of :class:`Preflight.Config` and :class:`SignalCheckpointer.Config`).
        progress: tqdm bar on rank 0; ``None`` = only on a terminal outside CI
            (telemetry's ``progress``).
        log_to: also send the metrics and events to ``"tensorboard"``, ``"wandb"``,
            ``"mlflow"``, a :class:`~guardrails.Sink` or a function of the rows, or a
            list of those (telemetry's ``sinks``): rank 0 only, at each metrics part.
        components: extra components, run after the defaults. One of the same type as
            a default (e.g. ``NanGuard(spike_factor=10)``) replaces that default.
        **sections: one keyword per default component, configured by its ``Config``
            (each knob documented there, and in docs/configuration.md): {sections}.

    The flat knobs of release 0.1 (``nan_policy``, ``checkpoint_every_n_steps``,
    ``hang_timeout_s``...) still work in this release, with a ``DeprecationWarning``
    naming the section that replaces each (``engine/config.ALIASES``).

    Returns:
        A :class:`~guardrails.Guard`, not yet started: use it in ``with`` (or call
        ``start()`` / ``close()``).
    """
    old_knobs = {k: sections.pop(k) for k in list(sections) if k not in SECTIONS}
    unknown = {k: v for k, v in old_knobs.items() if k not in ALIASES["guard"]}
    if unknown:
        check_knobs(unknown, [*_TOP_LEVEL, *SECTIONS], "guard()")
    configs = {
        # A section is on unless given False; one whose class says so (rewind) is off
        # unless given.
        name: section(name, sections.get(name, getattr(cls, "section_default", True)), cls.Config)
        for name, cls in SECTIONS.items()
    }
    _fold_old_knobs(configs, old_knobs)
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
    chosen += extra
    return Guard(
        model,
        optimizer,
        loader,
        scheduler=scheduler,
        scaler=scaler,
        generators=generators,
        run_dir=run_dir,
        components=chosen,
        tokens_per_batch=tokens_per_batch,
        benchmark=benchmark,
        graph_grad_norm=graph_grad_norm,
        replay_fn=replay_fn,
    )


def _fold_old_knobs(configs: dict[str, Any], old: Mapping[str, Any]) -> None:
    """Release 0.1's flat knobs, each into its section (with a DeprecationWarning)."""
    old = {k: v for k, v in old.items() if k in ALIASES["guard"]}
    if not old:
        return
    if old.get("even_batches") and configs["preflight"] is None:
        # guard(preflight=False, even_batches=True): the cut without the comparison.
        configs["preflight"] = Preflight.Config(check=False)
    for where, fields in apply_aliases(old, configs).items():
        if fields is None:
            configs[where] = None
            continue
        if configs[where] is None:
            raise TypeError(
                f"guard({where}=False) turns that component off, but "
                f"{', '.join(sorted(fields))} configure it: drop one or the other."
            )
        given = ", ".join(f"{k}=..." for k in old if ALIASES["guard"][k][0] == where)
        configs[where] = built(
            f"guard({given})",
            lambda cfg=configs[where], fields=fields: dataclasses.replace(cfg, **fields),
        )


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


#: guard()'s own keywords (the sections are SECTIONS'), for the closest-name hint.
_TOP_LEVEL = [
    name
    for name in guard.__code__.co_varnames[
        : guard.__code__.co_argcount + guard.__code__.co_kwonlyargcount
    ]
    if name not in ("model", "optimizer", "loader")
]
# The sections in guard()'s help, from SECTIONS: adding a section is one line there.
guard.__doc__ = (guard.__doc__ or "").replace(
    "{sections}",
    ", ".join(
        f"``{name}`` (:class:`~guardrails.{cls.__name__}`)" for name, cls in SECTIONS.items()
    ),
)
