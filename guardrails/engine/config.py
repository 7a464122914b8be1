"""Component configuration: one dataclass per component, and the table of 0.1's knobs.

Each component defines its knobs once, as a ``Config`` dataclass nested in its class
(``NanGuard.Config``, ``SignalCheckpointer.Config``...): the fields are the knobs, the
docstring documents them, ``__post_init__`` validates them. Everything else reads that:

* ``NanGuard(policy="raise")`` and ``NanGuard(NanGuard.Config(policy="raise"))`` build
  the same component (:func:`configure`);
* ``guardrails.guard(nan=NanGuard.Config(policy="raise"))``, ``nan={"policy":
  "raise"}``, ``nan=True`` (the defaults) and ``nan=False`` (not installed) choose and
  configure it as a section of ``guard()`` (:func:`section`);
* the knob names of release 0.1 are refused with a ``TypeError`` that says the new
  spelling, from the one table :data:`REMOVED`.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

#: Knob names of release 0.1, by where they were given, and where each went:
#: ``(old name) -> (section, field)``, field ``None`` for the section itself (``True`` /
#: ``False``). ``guard()``'s flat knobs became sections; two knobs called ``grace_s``
#: meant different things and one was renamed. Deprecated while 0.2 was developed,
#: removed before its release (nothing we could find still used them): an old name is
#: a ``TypeError`` that says the new spelling (docs/configuration.md, "Migrating from
#: 0.1").
REMOVED: dict[str, dict[str, tuple[str, str | None]]] = {
    "guard": {
        "nan_policy": ("nan", "policy"),
        "max_consecutive_skips": ("nan", "max_consecutive_skips"),
        "metrics_every_n_steps": ("metrics", "every_n_steps"),
        "metrics_write_every_s": ("metrics", "write_every_s"),
        "gc_every_n_steps": ("gc", "every_n_steps"),
        "leak_check_every_n_steps": ("memory", "leak_check_every_n_steps"),
        "data_starvation_window_steps": ("memory", "data_starvation_window_steps"),
        "data_starvation_fraction": ("memory", "data_starvation_fraction"),
        "explain_oom": ("memory", "explain_oom"),
        "hang_timeout_s": ("watchdog", "hang_timeout_s"),
        "first_step_timeout_s": ("watchdog", "first_step_timeout_s"),
        "audit_collectives": ("audit", None),
        "save_on_signal": ("checkpoint", "save_on_signal"),
        "exit_on_signal": ("checkpoint", "exit_on_signal"),
        "checkpoint_every_n_steps": ("checkpoint", "every_n_steps"),
        "checkpoint_every_s": ("checkpoint", "every_s"),
        "keep_last_checkpoints": ("checkpoint", "keep_last"),
        "grace_s": ("checkpoint", "grace_s"),
        "resume_allow_world_size_change": ("checkpoint", "allow_world_size_change"),
        "even_batches": ("preflight", "even_batches"),
        "explain_errors": ("explain", None),
    },
    # Component knobs renamed (the component's own name is the section).
    "CollectiveAuditor": {"grace_s": ("audit", "abort_after_s")},
    "Watchdog": {"fail_grace_s": ("watchdog", "abort_after_s")},
    # Preflight's own `config` would shadow the component's Config (component.config).
    "Preflight": {"config": ("preflight", "run_config")},
}


def check_removed(where: str, given: Iterable[str]) -> None:
    """Raise a ``TypeError`` for a knob of release 0.1 among ``given`` (``where``:
    ``"guard"`` or a component's class name), saying how to write it now."""
    table = REMOVED.get(where, {})
    for old in given:
        if old not in table:
            continue
        section, field = table[old]
        if field is None:
            new = f"guard({section}=True) or guard({section}=False)"
        elif where == "guard":
            new = f'guard({section}={{"{field}": ...}}) (guard({section}=False) turns it off)'
        else:
            new = f'{where}({field}=...), or guard({section}={{"{field}": ...}})'
        raise TypeError(
            f"{where}({old}=...) is release 0.1's spelling, since removed: write {new}. "
            'docs/configuration.md, "Migrating from 0.1", lists every old knob.'
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
    given, or one built from ``knobs``; a knob renamed since 0.1 says its new name),
    stored as ``component.config`` and mirrored as attributes (``self.policy``: its
    hooks read a knob with one attribute lookup, not two)."""
    cls = type(component).Config
    name = type(component).__name__
    check_removed(name, knobs)
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
