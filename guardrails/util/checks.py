"""Knob checks shared by the engine and every component, so the same mistake gets the
same message wherever it is made."""

from __future__ import annotations

import operator
import os
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


#: What each collection argument needs, in the user's words (``named``'s messages).
_NEEDS = {
    "model": "the nn.Module being trained (a DDP or torch.compile wrapper is fine), or a "
    "list / dict of them",
    "optimizer": "a torch.optim.Optimizer (the one whose step() updates the model), or a "
    "list / dict of them",
    "scheduler": "an LR scheduler (an object with state_dict() and load_state_dict(), "
    "e.g. torch.optim.lr_scheduler.LambdaLR), or a list / dict of them",
    "generator": "a torch.Generator, or a list / dict of them by name",
}
#: The methods a value must have where any class will do (a scheduler of your own).
_METHODS = {"scheduler": ("state_dict", "load_state_dict")}
#: The argument's name where it is not ``what`` (``guard(generators=...)``).
_ARG = {"generator": "generators"}


def named(what: str, value: Any, kind: type, *, where: str = "guard()") -> dict[str, Any]:
    """One object, or several as a list / tuple / dict, as an ordered dict by name: a
    single one is named ``what``, a list's by position (``"0"``, ``"1"``...). ``where``:
    the call the value was passed to, for the message."""
    arg = _ARG.get(what, what)
    if isinstance(value, kind) and not isinstance(value, (list, tuple, Mapping, str)):
        named = {what: value}
    elif isinstance(value, Mapping):
        named = {str(k): v for k, v in value.items()}
    elif isinstance(value, (list, tuple)):
        named = {str(i): v for i, v in enumerate(value)}
    else:
        named = {what: value}
    if not named:
        raise ValueError(f"{where} got an empty collection as `{arg}`; pass at least one.")
    methods = _METHODS.get(what, ())
    for name, v in named.items():
        missing = [m for m in methods if not callable(getattr(v, m, None))]
        if not isinstance(v, kind) or missing:
            shown = arg if len(named) == 1 and name == what else f"{arg} {name!r}"
            needs = _NEEDS.get(what, kind.__name__)
            lacks = f" without {' or '.join(f'{m}()' for m in missing)}" if missing else ""
            raise TypeError(
                f"{where} needs {needs} as `{arg}`; {shown} is a {type(v).__name__}"
                f"{lacks} ({_short(v)})."
            )
    return named


def step_number(arg: str, value: Any) -> int:
    """An optimizer step given by the user: an int >= 0 (a numpy / 0-d tensor int is
    fine); a bool, float or str is a ``TypeError`` naming ``arg``, a negative one a
    ``ValueError``. Returns it as an int."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(
            f"{arg} takes an int >= 0 (the optimizer step the state is after), got "
            f"{type(value).__name__} {value!r}"
        )
    step = operator.index(value)
    if step < 0:
        raise ValueError(f"{arg} takes an int >= 0 (the optimizer step), got {step}")
    return step


def path_like(arg: str, value: Any, *, allow_none: bool = False) -> None:
    """A ``TypeError`` naming ``arg`` unless ``value`` is a path (str or ``os.PathLike``)."""
    if allow_none and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (str, os.PathLike)):
        either = " or None" if allow_none else ""
        raise TypeError(
            f"{arg} takes a path (str or pathlib.Path){either}, got {type(value).__name__} "
            f"{_short(value)}"
        )


def flag(arg: str, value: Any) -> None:
    """A ``TypeError`` naming ``arg`` unless ``value`` is True or False."""
    if not isinstance(value, bool):
        raise TypeError(f"{arg} takes True or False, got {type(value).__name__} {_short(value)}")


def check_scaler(arg: str, value: Any) -> None:
    """A ``TypeError`` naming ``arg`` unless ``value`` acts as a ``torch.amp.GradScaler``
    (``is_enabled()``, ``state_dict()``, ``load_state_dict()``)."""
    missing = [
        m
        for m in ("is_enabled", "state_dict", "load_state_dict")
        if not callable(getattr(value, m, None))
    ]
    if missing:
        raise TypeError(
            f"{arg} takes a torch.amp.GradScaler (or None), got {type(value).__name__} "
            f"{_short(value)} without {', '.join(f'{m}()' for m in missing)}"
        )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
