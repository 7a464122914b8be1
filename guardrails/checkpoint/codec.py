"""JSON with tensors referenced by key: how a checkpoint stores state that mixes Python
values and tensors (optimizer state, RNG, the data position).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

# The manifest and the checks of a checkpoint's files, torch-free (`inspect` uses them).


def encode(obj: Any, where: str, tensors: dict[str, Tensor] | None = None) -> Any:
    """``obj`` as JSON values, exactly: tuples are tagged (``betas`` stays a tuple),
    tensors go to ``tensors`` under their dotted path and are referenced by key, and
    anything else raises a ``TypeError`` naming ``where`` (json.dumps would silently
    turn int dict keys into strings)."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, Tensor) and tensors is not None:
        tensors[where] = obj
        return {"__tensor__": where}
    if isinstance(obj, tuple):
        return {"__tuple__": [encode(v, f"{where}.{i}", tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [encode(v, f"{where}.{i}", tensors) for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        bad = [k for k in obj if not isinstance(k, str)]
        if bad:
            raise TypeError(f"{where} has a non-string key {bad[0]!r}; JSON keys are strings")
        return {k: encode(v, f"{where}.{k}", tensors) for k, v in obj.items()}
    raise TypeError(
        f"{where} is a {type(obj).__name__}, which a checkpoint cannot store as JSON: use "
        "numbers, strings, booleans, None, lists and dicts (a tensor: .item() or "
        ".tolist(); a numpy value: .item())"
    )


def decode(obj: Any, tensors: Mapping[str, Tensor] | None = None) -> Any:
    if isinstance(obj, list):
        return [decode(v, tensors) for v in obj]
    if isinstance(obj, tuple):  # decoded once already, without the tensors
        return tuple(decode(v, tensors) for v in obj)
    if isinstance(obj, dict):
        if set(obj) == {"__tuple__"}:
            return tuple(decode(v, tensors) for v in obj["__tuple__"])
        if set(obj) == {"__tensor__"} and tensors is not None:
            return tensors[obj["__tensor__"]]
        return {k: decode(v, tensors) for k, v in obj.items()}
    return obj
