"""Knob checks shared by the engine and every component, so the same mistake gets the
same message wherever it is made."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def positive_int(name: str, value: Any, *, allow_none: bool = False) -> None:
    """Raise ``ValueError`` unless ``value`` is an int >= 1 (or ``None`` if allowed)."""
    if allow_none and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        either = " or None" if allow_none else ""
        raise ValueError(f"{name} must be a positive int{either}, got {value!r}")


def non_negative(name: str, value: Any) -> None:
    """Raise ``ValueError`` unless ``value`` is a number >= 0 (NaN is refused too)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")


def fraction(name: str, value: Any) -> None:
    """Raise ``ValueError`` unless ``value`` is a number with 0 < value <= 1."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= 1:
        raise ValueError(f"{name} must be a fraction in (0, 1], got {value!r}")


def positive(name: str, value: Any, *, allow_none: bool = False) -> None:
    """Raise ``ValueError`` unless ``value`` is a number > 0 (or ``None`` if allowed)."""
    if allow_none and value is None:
        return
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        either = " or None" if allow_none else ""
        raise ValueError(f"{name} must be a number > 0{either}, got {value!r}")


def config_dict(value: Any) -> dict[str, Any] | None:
    """``guard(config=...)``: the run's settings as a dict (``None`` stays ``None``): a
    mapping, a dataclass instance (its fields, not copied) or an ``argparse.Namespace``;
    anything else is a ``TypeError``."""
    import argparse
    import dataclasses

    if value is None:
        return None
    if isinstance(value, Mapping):
        return dict(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, argparse.Namespace):
        return dict(vars(value))
    raise TypeError(
        "config must be a mapping (a dict, vars(args)), a dataclass instance or an "
        f"argparse.Namespace, or None; got {type(value).__name__}"
    )


def named(what: str, value: Any, kind: type) -> dict[str, Any]:
    """One object, or several as a list / tuple / dict, as an ordered dict by name: a
    single one is named ``what``, a list's by position (``"0"``, ``"1"``...)."""
    if isinstance(value, kind) and not isinstance(value, (list, tuple, Mapping)):
        named = {what: value}
    elif isinstance(value, Mapping):
        named = {str(k): v for k, v in value.items()}
    elif isinstance(value, (list, tuple)):
        named = {str(i): v for i, v in enumerate(value)}
    else:
        named = {what: value}
    if not named:
        raise ValueError(f"guard() got an empty collection as `{what}`; pass at least one.")
    for name, v in named.items():
        if not isinstance(v, kind):
            shown = what if len(named) == 1 and name == what else f"{what} {name!r}"
            needs = {
                "model": "the nn.Module being trained (a DDP or torch.compile wrapper is "
                "fine), or a list / dict of them",
                "optimizer": "a torch.optim.Optimizer (the one whose step() updates the "
                "model), or a list / dict of them",
            }.get(what, kind.__name__)
            raise TypeError(f"guard() needs {needs} as `{what}`; {shown} is a {type(v).__name__}.")
    return named
