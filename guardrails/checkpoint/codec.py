"""JSON with tensors referenced by key: how a checkpoint stores state that mixes Python
values and tensors (optimizer state, RNG, the data position).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import Tensor

# The manifest and the checks of a checkpoint's files, torch-free (`inspect` uses them).


def encode(
    obj: Any, where: str, tensors: dict[str, Tensor] | None = None, *, devices: bool = False
) -> Any:
    """``obj`` as JSON values, exactly: tuples are tagged (``betas`` stays a tuple),
    tensors go to ``tensors`` under their dotted path and are referenced by key (with
    ``devices``, a tensor off the CPU also records its device), and anything else
    raises a ``TypeError`` naming ``where`` (json.dumps would silently turn int dict
    keys into strings)."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, Tensor) and tensors is not None:
        tensors[where] = obj
        if devices and obj.device.type != "cpu":
            return {"__tensor__": where, "device": str(obj.device)}
        return {"__tensor__": where}
    if isinstance(obj, tuple):
        return {
            "__tuple__": [
                encode(v, f"{where}.{i}", tensors, devices=devices) for i, v in enumerate(obj)
            ]
        }
    if isinstance(obj, list):
        return [encode(v, f"{where}.{i}", tensors, devices=devices) for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        bad = [k for k in obj if not isinstance(k, str)]
        if bad:
            raise TypeError(f"{where} has a non-string key {bad[0]!r}; JSON keys are strings")
        return {k: encode(v, f"{where}.{k}", tensors, devices=devices) for k, v in obj.items()}
    tensor_hint = "" if tensors is not None else "a tensor: .item() or .tolist(); "
    raise TypeError(
        f"{where} is a {type(obj).__name__}, which a checkpoint cannot store: use "
        f"numbers, strings, booleans, None, lists, dicts and tensors ({tensor_hint}a "
        "numpy value: .item(); a set: a sorted list)"
    )


def is_tensor_ref(obj: Any) -> bool:
    """Whether ``obj`` is :func:`encode`'s reference to a tensor."""
    return isinstance(obj, dict) and "__tensor__" in obj and set(obj) <= {"__tensor__", "device"}


def decode(
    obj: Any,
    tensors: Mapping[str, Tensor] | None = None,
    *,
    place: Callable[[Tensor, str | None], Tensor] | None = None,
) -> Any:
    """Inverse of :func:`encode`. ``place(tensor, device)``: the tensor to put where a
    reference is (``device``: the one it was saved from, where recorded), else the
    loaded tensor itself."""
    if isinstance(obj, list):
        return [decode(v, tensors, place=place) for v in obj]
    if isinstance(obj, tuple):  # decoded once already, without the tensors
        return tuple(decode(v, tensors, place=place) for v in obj)
    if isinstance(obj, dict):
        if set(obj) == {"__tuple__"}:
            return tuple(decode(v, tensors, place=place) for v in obj["__tuple__"])
        if tensors is not None and is_tensor_ref(obj):
            t = tensors[obj["__tensor__"]]
            return t if place is None else place(t, obj.get("device"))
        return {k: decode(v, tensors, place=place) for k, v in obj.items()}
    return obj
