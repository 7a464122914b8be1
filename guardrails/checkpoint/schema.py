"""What each JSON file of a checkpoint holds, checked field by field: the optimizers',
the schedulers', the scaler's, each rank's (RNG streams, the data position, the
components' state) and the tensors they reference in their ``.safetensors``.

Every check raises :class:`Bad` naming the field (``data.batch_in_epoch``,
``param_groups[0].lr``) and what is wrong with it; :mod:`guardrails.checkpoint.manifest`
names the file. No file is read here and no torch imported (``inspect`` runs these).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Mapping
from typing import Any

#: Header metadata key of a .safetensors file that maps alias key -> stored key.
ALIASES_KEY = "guardrails.aliases"
#: The largest integer a count, size or position may be (int64, what torch and the OS
#: hold): 10**30 in a manifest is damage, and would overflow further down.
MAX_INT = 2**63 - 1
#: Data positions as :mod:`guardrails.engine.data` writes them.
DATA_KINDS = ("state_dict", "replay", "fast_forward")
#: torch.optim classes whose per-parameter state values are tensors, numbers or None,
#: and whose elementwise states (below) have their parameter's shape. (Adafactor's
#: factored and LBFGS's list-valued states are not, nor a user's Muon, which may stack
#: a group's momenta.)
PLAIN_OPTIMIZERS = frozenset(
    {"Adam", "AdamW", "SGD", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam", "RMSprop"}
    | {"Rprop", "ASGD"}
)
ELEMENTWISE_STATE = frozenset(
    {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "sum"}
    | {"acc_delta", "grad_avg", "prev", "ax"}  # not NAdam's mu_product: a scalar
)


class Bad(Exception):
    """A listed file whose content does not fit its schema: ``field`` names where
    (``data.batch_in_epoch``, ``files["model.safetensors"].bytes``)."""

    def __init__(self, field: str, why: str) -> None:
        super().__init__(f"field {field} {why}" if field else f"the file {why}")
        self.field = field
        self.why = why


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:30]}... ({len(text)} characters)"


def _int(value: Any, field: str, *, low: int = 0, high: int = MAX_INT) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise Bad(field, f"is {_show(value)}, not an integer")
    if value < low:
        raise Bad(
            field, f"is {_show(value)}, which is " + ("negative" if low == 0 else f"below {low}")
        )
    if value > high:
        raise Bad(field, f"is {_show(value)}, more than {high}")
    return value


def _number(value: Any, field: str, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Bad(field, f"is {_show(value)}, not a number")
    if positive and not (math.isfinite(value) and value > 0):
        raise Bad(field, f"is {_show(value)}, not a positive finite number")
    return value


def _mapping(value: Any, field: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise Bad(field, f"is a {_json_type(value)} ({_show(value)}), not an object")
    return value


def _json_type(value: Any) -> str:
    return {list: "list", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number" if isinstance(value, (int, float)) else type(value).__name__
    )


def _list(value: Any, field: str, *, length: int | None = None) -> list[Any]:
    if not isinstance(value, list):
        raise Bad(field, f"is a {_json_type(value)} ({_show(value)}), not a list")
    if length is not None and len(value) != length:
        raise Bad(field, f"has {len(value)} items, not {length}")
    return value


def _str(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise Bad(field, f"is {_show(value)}, not a string")
    return value


def _key(field: str, key: str) -> str:
    return f'{field}["{key}"]'


def tensor_keys(header: Mapping[str, Any] | None) -> set[str] | None:
    """The keys a .safetensors header holds, aliases included (``None``: no header)."""
    if header is None:
        return None
    keys = {k for k in header if k != "__metadata__"}
    meta = header.get("__metadata__") or {}
    if ALIASES_KEY in meta:
        keys |= set(json.loads(meta[ALIASES_KEY]))
    return keys


def _check_extras(doc: Any, header: Mapping[str, Any] | None) -> None:
    """extras.json: an object, each tensor it references held by extras.safetensors."""
    _mapping(doc, "")
    _refs_held(doc, header, "extras.safetensors")


def _refs_held(doc: Any, header: Mapping[str, Any] | None, holder: str) -> None:
    """Every tensor ``doc`` references is in ``header`` (the ``holder`` file's)."""
    keys = tensor_keys(header)
    for where, ref in _tensor_refs(doc, ""):
        if keys is None or ref not in keys:
            raise Bad(where.lstrip("."), f"references tensor {ref!r}, which {holder} does not hold")


def _tensor_refs(value: Any, field: str) -> list[tuple[str, str]]:
    """``(field, key)`` of every ``{"__tensor__": key}`` (with its ``device``, in the
    extras) under ``value``."""
    found = []
    stack = [(value, field)]
    while stack:
        v, where = stack.pop()
        if isinstance(v, dict):
            if "__tensor__" in v and set(v) <= {"__tensor__", "device"}:
                found.append((where, _str(v["__tensor__"], f"{where}.__tensor__")))
                continue
            stack += [(x, f"{where}.{k}") for k, x in v.items()]
        elif isinstance(v, list):
            stack += [(x, f"{where}[{i}]") for i, x in enumerate(v)]
    return found


def check_optimizer_state(
    doc: Any, header: Mapping[str, Any] | None, cls: str | None = None
) -> None:
    """An optimizer's ``<stem>.json`` (``state``, ``param_groups``, ``param_shapes``),
    against its ``.safetensors`` header: every tensor it references is there, every
    state belongs to a parameter of a group, each parameter once; for the plain
    torch.optim classes, states are tensors or numbers and elementwise ones have their
    parameter's saved shape."""
    doc = _mapping(doc, "")
    for key in ("state", "param_groups"):
        if key not in doc:
            raise Bad(key, "is missing")
    ids: list[int] = []
    for g, group in enumerate(_list(doc["param_groups"], "param_groups")):
        group = _mapping(group, f"param_groups[{g}]")
        params = _list(group.get("params"), f"param_groups[{g}].params")
        ids += [_int(p, f"param_groups[{g}].params[{i}]") for i, p in enumerate(params)]
        if cls in PLAIN_OPTIMIZERS:
            for key in _PLAIN_NUMBERS & group.keys():
                _number_or_tensor(group[key], f"param_groups[{g}].{key}")
            if "betas" in group:
                betas = group["betas"]
                if isinstance(betas, dict) and set(betas) == {"__tuple__"}:
                    betas = betas["__tuple__"]
                for i, b in enumerate(_list(betas, f"param_groups[{g}].betas", length=2)):
                    _number_or_tensor(b, f"param_groups[{g}].betas[{i}]")
    if len(set(ids)) != len(ids):
        raise Bad("param_groups", "lists a parameter twice")
    shapes = None
    if "param_shapes" in doc:
        shapes = _list(doc["param_shapes"], "param_shapes", length=len(ids))
        for i, s in enumerate(shapes):
            for j, d in enumerate(_list(s, f"param_shapes[{i}]")):
                _int(d, f"param_shapes[{i}][{j}]")
    state = _mapping(doc["state"], "state")
    position = {p: i for i, p in enumerate(ids)}
    for key, entry in state.items():
        field = _key("state", key)
        if not key.isdigit() or str(int(key)) != key or int(key) not in position:
            raise Bad(
                field,
                f"is the state of parameter {key!r}, which no param group lists "
                "(param_groups[*].params)",
            )
        entry = _mapping(entry, field)
        if cls in PLAIN_OPTIMIZERS:
            for name, v in entry.items():
                ok = v is None or (not isinstance(v, bool) and isinstance(v, (int, float)))
                if not (ok or (isinstance(v, dict) and set(v) == {"__tensor__"})):
                    raise Bad(f"{field}.{name}", f"is {_show(v)}, not a tensor or a number")
                if name in ELEMENTWISE_STATE and isinstance(v, dict) and header is not None:
                    want = None if shapes is None else list(shapes[position[int(key)]])
                    _check_elementwise(f"{field}.{name}", v["__tensor__"], header, want)
    _refs_held(doc, header, "the .safetensors file")


def _check_elementwise(
    field: str, ref: Any, header: Mapping[str, Any], want: list[Any] | None
) -> None:
    """An elementwise state tensor (``exp_avg``...) in the header: a float, of its
    parameter's saved shape ``want`` (where saved)."""
    entry = header.get(ref) if isinstance(ref, str) else None
    if not isinstance(entry, Mapping):
        return  # said by _refs_held
    dtype = str(entry.get("dtype"))
    # Issue 52: an F32 state rewritten as I32 (same bytes, manifest re-hashed) loaded;
    # a moment of a float parameter is never an integer.
    if not dtype.startswith(_FLOAT_DTYPES):
        raise Bad(
            field,
            f"is a tensor of {dtype}, where the optimizer keeps a float per element of its "
            "parameter",
        )
    if want is not None and list(entry.get("shape", [])) != want:
        raise Bad(
            field, f"has shape {list(entry['shape'])}, but its parameter was saved with {want}"
        )


#: safetensors' float and complex dtypes (F16, BF16, F32, F64, F8_*, C64).
_FLOAT_DTYPES = ("F", "BF", "C")

#: The number-valued settings of the plain torch.optim classes' param groups.
_PLAIN_NUMBERS = frozenset(
    {"lr", "initial_lr", "eps", "weight_decay", "momentum", "dampening", "alpha", "rho"}
    | {"lr_decay", "initial_accumulator_value", "lambd", "t0", "momentum_decay"}
)


def _number_or_tensor(value: Any, field: str) -> None:
    if not (isinstance(value, dict) and set(value) == {"__tensor__"}):
        _number(value, field)


def check_scheduler_state(doc: Any, groups: int | None = None) -> None:
    """A scheduler's JSON: an object; the fields every torch LR scheduler has, where
    present, of their types, one lr per param group of the optimizer it schedules
    (``groups``, where known); the rest is checked against the live scheduler at
    resume."""
    doc = _mapping(doc, "")
    if "last_epoch" in doc:
        _int(doc["last_epoch"], "last_epoch", low=-1)
    if "_step_count" in doc:
        _int(doc["_step_count"], "_step_count")
    for key in ("base_lrs", "_last_lr"):
        if key in doc:
            lrs = _list(doc[key], key, length=groups)
            for i, v in enumerate(lrs):
                _number(v, f"{key}[{i}]")


def check_scaler_state(doc: Any) -> None:
    """A GradScaler's JSON: ``{}`` (a disabled scaler) or its numbers, of their types."""
    doc = _mapping(doc, "")
    if "scale" in doc:
        _number(doc["scale"], "scale", positive=True)
    for key in ("growth_factor", "backoff_factor"):
        if key in doc:
            _number(doc[key], key, positive=True)
    if "growth_interval" in doc:
        _int(doc["growth_interval"], "growth_interval", low=1)
    if "_growth_tracker" in doc:
        _int(doc["_growth_tracker"], "_growth_tracker")


def _rank_check(doc: Any, *, rank: int, header: Mapping[str, Any] | None) -> None:
    check_rank_state(doc, rank, header)


def check_rank_state(doc: Any, rank: int, header: Mapping[str, Any] | None) -> None:
    """A ``rank<R>.json``: ``rank``, the RNG streams, the guard's ``step``, the data
    position (``data``: kind, epoch, batch_in_epoch, sampler_epoch; the tensors it
    references in ``rank<R>.safetensors``, ``header``), the components' state (an
    object each) and DDP's buckets (``ddp_buckets``: lists of parameter indices)."""
    doc = _mapping(doc, "")
    if "rank" in doc:
        got = _int(doc["rank"], "rank", high=2**31)
        if got != rank:
            raise Bad("rank", f"is {got}, but the file is rank {rank}'s")
    if "rng" not in doc:
        raise Bad("rng", "is missing")
    check_rng(doc["rng"], "rng")
    if "step" in doc:
        _int(doc["step"], "step")
    if doc.get("data") is not None:
        data = _mapping(doc["data"], "data")
        for key in ("kind", "epoch", "batch_in_epoch"):
            if key not in data:
                raise Bad(f"data.{key}", "is missing")
        if data["kind"] not in DATA_KINDS:
            raise Bad("data.kind", f"is {_show(data['kind'])}, not one of {list(DATA_KINDS)}")
        _int(data["epoch"], "data.epoch")
        _int(data["batch_in_epoch"], "data.batch_in_epoch")
        if data.get("sampler_epoch") is not None:
            _int(data["sampler_epoch"], "data.sampler_epoch")
        if "held" in data and data["held"] is not None:
            _list(data["held"], "data.held")
        if data.get("epoch_names") is not None:
            for i, name in enumerate(_list(data["epoch_names"], "data.epoch_names")):
                _str(name, f"data.epoch_names[{i}]")
        if data.get("held_devices") is not None:
            for key, device in _mapping(data["held_devices"], "data.held_devices").items():
                _str(device, _key("data.held_devices", key))
        keys = tensor_keys(header)
        for where, ref in _tensor_refs(data, "data"):
            if keys is None or ref not in keys:
                raise Bad(
                    where,
                    f"references tensor {ref!r}, which rank{rank:05d}.safetensors does not hold",
                )
    if "components" in doc:
        for name, state in _mapping(doc["components"], "components").items():
            if state is not None:
                _mapping(state, _key("components", name))
    if doc.get("ddp_buckets") is not None:  # DDP's buckets: parameter indices, each once
        seen: set[int] = set()
        for b, bucket in enumerate(_list(doc["ddp_buckets"], "ddp_buckets")):
            for i, index in enumerate(_list(bucket, f"ddp_buckets[{b}]")):
                if _int(index, f"ddp_buckets[{b}][{i}]", high=2**31) in seen:
                    raise Bad(f"ddp_buckets[{b}][{i}]", f"is {index}, in an earlier bucket too")
                seen.add(index)


def check_rng(rng: Any, field: str) -> None:
    """Python's and numpy's RNG states as ``stage_rank`` writes them; Python's is
    checked by loading it into a scratch generator (its own check, exact)."""
    rng = _mapping(rng, field)
    where = f"{field}.python" if field else "python"
    if "python" in rng:
        py = _list(rng["python"], where, length=3)
        version = _int(py[0], f"{where}[0]")
        internal = _list(py[1], f"{where}[1]", length=625)
        gauss = py[2]
        if gauss is not None:
            _number(gauss, f"{where}[2]")
        try:
            random.Random().setstate((version, tuple(internal), gauss))
        except (TypeError, ValueError, OverflowError) as e:
            raise Bad(where, f"is not a Python random state ({e})") from None
    where = f"{field}.numpy" if field else "numpy"
    if "numpy" in rng:
        np_state = _list(rng["numpy"], where, length=5)
        _str(np_state[0], f"{where}[0]")
        keys = _list(np_state[1], f"{where}[1]", length=624)
        for i, k in enumerate(keys):
            _int(k, f"{where}[1][{i}]", high=2**32 - 1)
        _int(np_state[2], f"{where}[2]", high=624)
        _int(np_state[3], f"{where}[3]", high=1)
        _number(np_state[4], f"{where}[4]")
