"""Component configuration: one dataclass per component, and the one alias table.

Each component defines its knobs once, as a ``Config`` dataclass nested in its class
(``NanGuard.Config``, ``SignalCheckpointer.Config``...): the fields are the knobs, the
docstring documents them, ``__post_init__`` validates them. Everything else reads that:

* ``NanGuard(policy="raise")`` and ``NanGuard(NanGuard.Config(policy="raise"))`` build
  the same component (:func:`configure`);
* ``guardrails.guard(nan=NanGuard.Config(policy="raise"))``, ``nan={"policy":
  "raise"}``, ``nan=True`` (the defaults) and ``nan=False`` (not installed) choose and
  configure it as a section of ``guard()`` (:func:`section`);
* the knob names of earlier releases keep working for one release through
  :data:`ALIASES`, with a ``DeprecationWarning`` that names the new spelling.
"""

from __future__ import annotations

import dataclasses
import difflib
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

#: Knob names of release 0.1, by where they were given, and their new place:
#: ``(old name) -> (section, field, how the old value maps)``. ``guard()``'s flat knobs
#: became sections; two knobs called ``grace_s`` meant different things and one was
#: renamed. Removed in the release after next.
ALIASES: dict[str, dict[str, tuple[str, str | None, str]]] = {
    "guard": {
        # old knob: (section, field or None for the section itself, mapping)
        "nan_policy": ("nan", "policy", "none_disables"),
        "max_consecutive_skips": ("nan", "max_consecutive_skips", "value"),
        "metrics_every_n_steps": ("metrics", "every_n_steps", "value"),
        "metrics_write_every_s": ("metrics", "write_every_s", "value"),
        "gc_every_n_steps": ("gc", "every_n_steps", "none_disables"),
        "leak_check_every_n_steps": ("memory", "leak_check_every_n_steps", "value"),
        "data_starvation_window_steps": ("memory", "data_starvation_window_steps", "value"),
        "data_starvation_fraction": ("memory", "data_starvation_fraction", "value"),
        "explain_oom": ("memory", "explain_oom", "value"),
        "hang_timeout_s": ("watchdog", "hang_timeout_s", "value"),
        "first_step_timeout_s": ("watchdog", "first_step_timeout_s", "value"),
        "audit_collectives": ("audit", None, "switch"),
        "save_on_signal": ("checkpoint", "save_on_signal", "value"),
        "exit_on_signal": ("checkpoint", "exit_on_signal", "value"),
        "checkpoint_every_n_steps": ("checkpoint", "every_n_steps", "value"),
        "checkpoint_every_s": ("checkpoint", "every_s", "value"),
        "keep_last_checkpoints": ("checkpoint", "keep_last", "value"),
        "grace_s": ("checkpoint", "grace_s", "value"),
        "resume_allow_world_size_change": ("checkpoint", "allow_world_size_change", "value"),
        "even_batches": ("preflight", "even_batches", "value"),
        "explain_errors": ("explain", None, "switch"),
    },
    # Component knobs renamed (the component's own name is the section).
    "CollectiveAuditor": {"grace_s": ("audit", "abort_after_s", "value")},
    "Watchdog": {"fail_grace_s": ("watchdog", "abort_after_s", "value")},
    # Preflight's own `config` would shadow the component's Config (component.config).
    "Preflight": {"config": ("preflight", "run_config", "value")},
}


def _deprecated(where: str, old: str, new: str, *, stacklevel: int = 4) -> None:
    # stacklevel: the user's line (the component's __init__ -> configure -> here: 4;
    # guard() -> _fold_old_knobs -> apply_aliases -> here: 5).
    warnings.warn(
        f"{where}({old}=...) is deprecated and will be removed in guardrails 0.4: "
        f"use {where}({new}).",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def check_knobs(given: Mapping[str, Any], known: Iterable[str], where: str) -> None:
    """Raise a ``TypeError`` naming an unknown knob in ``given`` and the closest known
    one (``where``: how the caller was called, e.g. ``"guard()"``)."""
    known = sorted(known)
    for name in given:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" Did you mean `{close[0]}`?" if close else ""
            raise TypeError(
                f"{where} got an unknown knob `{name}`.{hint} Known knobs: {', '.join(known)}."
            )


def check_fields(cls: type[Any], given: Mapping[str, Any], where: str) -> None:
    """``check_knobs`` against the fields of the dataclass ``cls``."""
    check_knobs(given, (f.name for f in dataclasses.fields(cls)), where)


def built(where: str, build: Callable[[], Any]) -> Any:
    """``build()`` (a ``Config``'s constructor or ``dataclasses.replace``), its
    validation error (``ValueError`` / ``TypeError`` from ``__post_init__``, which
    names the knob by its field) prefixed with the call the user made: ``guard(
    checkpoint=...): keep_last must be a positive int, got 2.5``."""
    try:
        config = build()
        check_flags(config)
    except (ValueError, TypeError) as err:
        if type(err) not in (ValueError, TypeError) or str(err).startswith(where):
            raise
        raise type(err)(f"{where}: {err}") from None
    return config


def check_flags(config: Any) -> None:
    """Every knob declared ``bool`` holds True or False: ``background="no"`` is truthy,
    and was taken silently as True."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.type in ("bool", bool) and not isinstance(value, bool):
            raise TypeError(f"{f.name} takes True or False, got {type(value).__name__} {value!r}")


def configure(component: Any, config: Any, knobs: dict[str, Any]) -> Any:
    """A component's ``__init__(config=None, /, **knobs)``: its ``Config`` (the one
    given, or one built from ``knobs``, with renamed knobs accepted for one release),
    stored as ``component.config`` and mirrored as attributes (``self.policy``: its
    hooks read a knob with one attribute lookup, not two)."""
    cls = type(component).Config
    name = type(component).__name__
    for old, (_, new, _how) in ALIASES.get(name, {}).items():
        if old in knobs:
            _deprecated(name, old, f"{new}=...")
            knobs[new or old] = knobs.pop(old)
    if config is not None:
        if knobs:
            raise TypeError(f"{name}() takes a {name}.Config or knobs, not both")
        if not isinstance(config, cls):
            raise TypeError(f"{name}() takes a {name}.Config, got {type(config).__name__}")
    else:
        check_fields(cls, knobs, f"{name}()")
        config = built(f"{name}()", lambda: cls(**knobs))
    component.config = config
    for field in dataclasses.fields(config):
        setattr(component, field.name, getattr(config, field.name))
    return config


def section(name: str, value: Any, cls: type[Any]) -> Any:
    """``guard(<name>=value)``: the component's ``Config``, or ``None`` (not installed).
    ``True``: the defaults; ``False`` / ``None``: off; a ``Config``; a mapping of its
    knobs."""
    if value is True:
        return cls()
    if value is False or value is None:
        return None
    if isinstance(value, cls):
        return built(f"guard({name}=...)", lambda: value)
    if isinstance(value, Mapping):
        check_fields(cls, value, f"guard({name}=...)")
        return built(f"guard({name}=...)", lambda: cls(**value))
    owner = cls.__qualname__
    raise TypeError(
        f"guard({name}=...) takes True (the defaults), False (off), a {owner} or a dict "
        f"of its knobs; got {type(value).__name__}."
    )


def apply_aliases(old: Mapping[str, Any], sections: dict[str, Any]) -> dict[str, Any]:
    """``guard()``'s knobs of release 0.1 (``old``, by name) folded into ``sections``
    (section name -> the value given for it), with a ``DeprecationWarning`` each;
    returns per-section overrides: section -> {field: value} (``None`` turns the
    section off)."""
    table = ALIASES["guard"]
    overrides: dict[str, dict[str, Any] | None] = {}
    for knob, value in old.items():
        where, field, how = table[knob]
        if how == "switch" or (how == "none_disables" and value is None):
            _deprecated("guard", knob, f"{where}={bool(value)!r}", stacklevel=5)
            if not value:
                overrides[where] = None
            continue
        _deprecated("guard", knob, f"{where}={{'{field}': ...}}", stacklevel=5)
        if overrides.get(where, {}) is not None:
            overrides.setdefault(where, {})[field] = value  # type: ignore[index]
    return overrides
