"""Preflight's comparison: the ranks' gathered facts and parameter tables turned into
the fields that differ (``{field: {rank: value}}``), and those into the error every rank
raises: each differing field with each rank's value, the odd ranks out, and what to do
about each kind of difference. Deterministic: every rank computes the same result from
the same gathered values, so every rank decides the same way.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from guardrails._errors import ConfigMismatchError, LaunchError
from guardrails.util.text import shorten

if TYPE_CHECKING:
    from guardrails.engine.guard import Guard

#: Fields shown per kind before "... N more".
_SHOWN = 6

_NO_BATCH = "<no batch: the loader was empty on this rank>"

# What to do about each kind of difference. Keyed by the field's first component.
_FIXES = {
    "params.weights": "seed every rank the same before building the model "
    "(torch.manual_seed(seed), not seed + rank), or load the same checkpoint on every "
    "rank. DDP broadcasts rank 0's weights when it wraps the model, so differing weights "
    "under DDP mean they were changed after wrapping.",
    "params": "build the model from the same config on every rank (layer counts, "
    "vocabulary sizes and dtypes must not depend on the rank or on per-rank data), and "
    "convert its dtype on every rank or on none. If ranks legitimately hold different "
    "parameters (pipeline stages, tensor parallelism without DTensor), pass "
    "guard(..., preflight=False).",
    "optimizer": "build the optimizer with the same type and hyperparameters on every rank "
    "(a per-rank config, or a learning rate scaled by something rank-dependent).",
    "loader": "every rank must get the same number of batches of the same size, or the "
    "rank that runs out first leaves the others waiting in a collective forever (one "
    "node reading 201 data shards and the other 4 hangs this way). Give every rank the "
    "same data (one dataset with a DistributedSampler, drop_last=True); if the loop "
    "cannot guarantee equal lengths, "
    'pass guard(..., preflight={"even_batches": True}) to stop every rank at the '
    "shortest.",
    "first_batch": "every rank must get batches of the same size; check the per-rank "
    "batch size and collate.",
    "compute": "pick the compute dtype from the device you train on, explicitly, not from "
    "torch.cuda.is_available() (which picks bf16 for a CPU run on a machine that has "
    "a GPU).",
    "device_type": "train on the same device type on every rank.",
    "versions": "install the same torch / CUDA / NCCL on every node (one container image "
    "or lock file for the whole job).",
    "world_size": "every rank must join the same process group; let torchrun set "
    "WORLD_SIZE and call init_process_group() without world_size.",
    "backend": "call init_process_group with the same backend on every rank.",
    "config": "pass the same config (command-line arguments, environment) to every rank.",
    "model": "build the same model class on every rank.",
}


def param_diffs(tables: list[dict[str, Any]]) -> dict[str, dict[int, Any]]:
    """``{field: {rank: value}}`` for what differs between the ranks' parameter tables
    (names, then shape / dtype per name, then weights). Deterministic: every rank
    computes the same result from the same gathered tables."""
    fields: dict[str, dict[int, Any]] = {}
    name_sets = [set(t["names"]) for t in tables]
    common = set.intersection(*name_sets)
    if any(s != name_sets[0] for s in name_sets):
        fields["params.names"] = {
            r: f"{len(t['names'])} tensors"
            + (
                f", only here: {shorten(sorted(name_sets[r] - common), 4)}"
                if name_sets[r] - common
                else ""
            )
            for r, t in enumerate(tables)
        }
    index = [{n: i for i, n in enumerate(t["names"])} for t in tables]
    same_layout = []
    differing = 0
    for name in tables[0]["names"]:
        if name not in common:
            continue
        vals = [
            f"{tuple(t['shapes'][ix[name]])} {t['dtypes'][ix[name]]}"
            for t, ix in zip(tables, index, strict=True)
        ]
        if len(set(vals)) > 1:
            differing += 1
            if differing <= _SHOWN:
                fields[f"params[{name}]"] = dict(enumerate(vals))
        else:
            same_layout.append(name)
    if differing > _SHOWN:
        fields["params.more"] = dict.fromkeys(
            range(len(tables)), f"{differing - _SHOWN} more tensors differ in shape or dtype"
        )
    if all(t["sums"] is not None for t in tables) and same_layout:
        groups = _weight_groups(tables, index, same_layout)
        if len(set(groups)) > 1:
            first = _first_differing(tables, index, same_layout, groups)
            fields["params.weights"] = {
                r: f"checksum {_digest(t, index[r], same_layout)}"
                + (f" (first differing tensor: {first})" if groups[r] else "")
                for r, t in enumerate(tables)
            }
    return fields


def _equal(a: dict[str, Any], ia: int, b: dict[str, Any], ib: int) -> bool:
    return a["sums"][ia] == b["sums"][ib] and a["hashes"][ia] == b["hashes"][ib]


def _weight_groups(
    tables: list[dict[str, Any]], index: list[dict[str, int]], names: list[str]
) -> list[int]:
    """Each rank's group: the first earlier rank whose weights equal its own."""
    reps: list[int] = []
    groups = []
    for r, t in enumerate(tables):
        for g, rep in enumerate(reps):
            if all(_equal(tables[rep], index[rep][n], t, index[r][n]) for n in names):
                groups.append(g)
                break
        else:
            reps.append(r)
            groups.append(len(reps) - 1)
    return groups


def _first_differing(
    tables: list[dict[str, Any]], index: list[dict[str, int]], names: list[str], groups: list[int]
) -> str:
    other = groups.index(1)
    for n in names:
        if not _equal(tables[0], index[0][n], tables[other], index[other][n]):
            count = sum(
                not _equal(tables[0], index[0][m], tables[other], index[other][m]) for m in names
            )
            return f"{n}; {count}/{len(names)} tensors differ"
    return "?"


def _digest(table: dict[str, Any], ix: dict[str, int], names: list[str]) -> str:
    h = hashlib.blake2b(digest_size=4)
    for n in names:
        h.update(table["hashes"][ix[n]].encode())
    return h.hexdigest()


def _diff_facts(facts: list[dict[str, Any]]) -> dict[str, dict[int, Any]]:
    keys = sorted(set().union(*facts))
    out: dict[str, dict[int, Any]] = {}
    for key in keys:
        values = {r: f.get(key, "<unset>") for r, f in enumerate(facts)}
        if len({json.dumps(v, sort_keys=True, default=str) for v in values.values()}) > 1:
            out[key] = values
    return out


def _same(fields: dict[str, Any], key: str, gathered: list[dict[str, Any]]) -> bool:
    """Whether ``key`` is known on every rank and equal (then a dataset-length
    difference alone is harmless: e.g. per-rank shards of 1000 and 1003 samples that
    drop_last turns into the same number of batches)."""
    return key not in fields and all(g.get("facts", {}).get(key) is not None for g in gathered)


def by_rank(values: Mapping[int, Any]) -> str:
    groups: dict[str, list[int]] = {}
    for r, v in values.items():
        groups.setdefault(json.dumps(v, default=str), []).append(r)
    parts = []
    for v, ranks in groups.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {shorten(ranks, 8)}"
        parts.append(f"{who}: {json.loads(v) if v.startswith(chr(34)) else v}")
    return "; ".join(parts)


def odd_ranks(values: Mapping[int, Any]) -> list[int]:
    """The ranks outside the largest group of equal values (ties: rank 0's group is
    the reference)."""
    groups: dict[str, list[int]] = {}
    for r, v in values.items():
        groups.setdefault(json.dumps(v, default=str), []).append(r)
    ref = max(groups.values(), key=lambda rs: (len(rs), -rs[0]))
    return [r for r in values if r not in ref]


def _mismatch(guard: Guard, fields: dict[str, dict[int, Any]]) -> ConfigMismatchError:
    lines = [f"  {k}: {by_rank(v)}" for k, v in fields.items()]
    odd = sorted({r for v in fields.values() for r in odd_ranks(v)})
    kinds = []
    for k in fields:
        kind = k if k in _FIXES else k.split(".")[0].split("[")[0]
        if kind == "first_batch" and _NO_BATCH in fields[k].values():
            kind = "loader"  # an empty loader is a data-amount problem, not a shape one
        kinds.append(kind)
    fixes = [_FIXES[k] for k in dict.fromkeys(kinds) if k in _FIXES]
    when = "at the first batch" if "first_batch" in fields else "at guard start"
    message = (
        f"ranks disagree on {len(fields)} setting(s) that must be the same on every rank "
        f"(checked {when}; differing rank(s): {shorten(odd, 8)}):\n" + "\n".join(lines)
    )
    return ConfigMismatchError(
        message,
        rank=guard.rank,
        step=guard.step if guard.step else None,
        hint=" ".join(f[0].upper() + f[1:] for f in fixes) or None,
        fields={k: dict(v) for k, v in fields.items()},
        ranks=odd,
    )


def _raise_launch(guard: Guard, gathered: list[dict[str, Any]]) -> None:
    errors = [
        (r, p) for r, g in enumerate(gathered) for p in g.get("launch", []) if p["level"] == "error"
    ]
    if errors:
        r, first = errors[0]
        where = sorted({r for r, _ in errors})
        others = list(
            dict.fromkeys(p["message"] for _, p in errors[1:] if p["message"] != first["message"])
        )[:3]
        raise LaunchError(
            f"launch problem on rank(s) {shorten(where, 8)}: {first['message']}"
            + ("\n  also: " + "\n  also: ".join(others) if others else ""),
            check=first["check"],
            hint=first["fix"],
            rank=guard.rank,
            ranks=where,
        )
    gpus: dict[str, list[int]] = {}
    for r, g in enumerate(gathered):
        if g.get("gpu"):
            gpus.setdefault(g["gpu"], []).append(r)
    shared = {gpu: rs for gpu, rs in gpus.items() if len(rs) > 1}
    if shared:
        gpu, rs = next(iter(shared.items()))
        raise LaunchError(
            f"ranks {shorten(rs, 8)} train on the same GPU ({gpu}): they compete for its "
            "memory and NCCL refuses it ('Duplicate GPU detected').",
            check="duplicate_device",
            hint="call torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) before "
            "init_process_group and move the model to torch.device('cuda', LOCAL_RANK).",
            rank=guard.rank,
            ranks=rs,
        )
