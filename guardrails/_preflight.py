"""Cross-rank preflight: what must be the same on every rank, checked once at start.

Seed 004's two-node hang had two causes that a single exchange at start would have
named: the ranks read different data (201 parquet shards on one node, 4 on the other)
and one node auto-picked bf16 for a CPU run because a GPU happened to be present. Seed
002 adds the rest of the list: batch size, world size, versions. At guard start every
rank gathers its facts (below) and they are exchanged once over the guard's gloo side
group (``all_gather_object``: a few KB, one round trip, never on the training's group).
Every rank then sees every rank's values and runs the same comparison, so the decision
(continue, or which error) is the same everywhere: a difference raises
:class:`~guardrails.ConfigMismatchError` (or :class:`~guardrails.LaunchError`) on every
rank, listing the differing fields with each rank's value.

The facts:

* parameters: names, shapes, dtypes, and a checksum of the initial weights per tensor
  (different seeds or inits, a checkpoint loaded on some ranks only);
* optimizer type and each group's hyperparameters and size;
* loader: ``len()`` (batches per pass), dataset length, ``batch_size``, ``drop_last``;
  the first batch's structure (a second tiny exchange, at the first batch: see below);
* world size, backend, device type, parameter dtypes and the autocast dtype when
  autocast is already on at start; torch, CUDA and NCCL versions;
* the user's ``config`` mapping, if given (``guard(..., config=vars(args))``);
* launch problems found by :mod:`guardrails._launch` (after ``init_process_group``), and
  two ranks on one GPU (same host, same device).

**The weights checksum**, per tensor: the sum of the raw bits of every element (the
tensor viewed as int32 for fp32, int16 for bf16/fp16, summed into an int64 on the
parameter's device) plus a hash of 64 evenly strided elements' bits. An integer sum is
exact and its order does not matter (modular arithmetic), so ranks compare it
bitwise whatever their thread counts (a float64 sum's last bits depend on the CPU
reduction order, i.e. on OMP_NUM_THREADS, and would need a tolerance); any single
changed element changes it. The strided sample catches what a sum cannot
(permuted rows) and names a differing tensor cheaply. Measured for GPT-2 small (124M
parameters, 148 tensors) on CPU, 1 thread: the sums ~0.13 s warm (a float64 sum
costs about the same), the samples ~1 ms (``benchmarks/preflight.py``); on an H100 the
sum reads 500 MB at >2 TB/s, well under a millisecond. Sharded models (FSDP, DTensor)
hold a different shard per rank: their weights are not compared, only names, shapes
and dtypes.

**The first batch** cannot be looked at before the loop fetches it without consuming
it twice, so its fingerprint (nesting, dtypes, number of dimensions and the batch
dimension; other dimensions are shown but not compared, since dynamic padding makes
the sequence length differ legitimately) is exchanged when the first batch comes out
of the loader, through an iterator wrapper that costs nothing after it. A rank whose
loader is empty joins that exchange when the guard closes, so the others do not wait.

**even_batches** (opt-in): loaders with ``len()`` on every rank stop every rank after
the shortest rank's number of batches (an ``islice`` per pass: no per-step work, no
sync); loaders without ``len()`` are read in chunks of :data:`EVEN_CHUNK` batches
agreed with one side-group all_reduce per chunk (one ~0.2 ms gloo round trip per 16
batches, never per step), which holds up to 16 batches in memory ahead of the loop.
DDP's ``join()`` keeps working either way (with even batches it has nothing to do).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import socket
import time
from collections.abc import Iterator, Mapping
from itertools import islice
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from guardrails import _model
from guardrails._checks import mapping
from guardrails._component import Component
from guardrails._errors import ConfigMismatchError, LaunchError
from guardrails._text import shorten

if TYPE_CHECKING:
    from guardrails._guard import Guard

logger = logging.getLogger("guardrails")

#: Strided elements hashed per parameter tensor (bitwise).
SAMPLE_PER_TENSOR = 64
#: Batches per agreement for even_batches over loaders without len().
EVEN_CHUNK = 16
#: Fields shown per kind before "... N more".
_SHOWN = 6

_NO_BATCH = "<no batch: the loader was empty on this rank>"

# What to do about each kind of difference, in the seeds' voice. Keyed by the field's
# first component.
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
    "rank that runs out first leaves the others waiting in a collective forever (seed "
    "004: 201 vs 4 data shards). Give every rank the same data (one dataset with a "
    "DistributedSampler, drop_last=True); if the loop cannot guarantee equal lengths, "
    "pass guard(..., even_batches=True) to stop every rank at the shortest.",
    "first_batch": "every rank must get batches of the same size (seed 002: ensure all "
    "GPUs receive the same batch size); check the per-rank batch size and collate.",
    "compute": "pick the compute dtype from the device you train on, explicitly, not from "
    "torch.cuda.is_available() (seed 004: bf16 auto-picked for a CPU run because a GPU "
    "was present).",
    "device_type": "train on the same device type on every rank.",
    "versions": "install the same torch / CUDA / NCCL on every node (one container image "
    "or lock file for the whole job).",
    "world_size": "every rank must join the same process group; let torchrun set "
    "WORLD_SIZE and call init_process_group() without world_size.",
    "backend": "call init_process_group with the same backend on every rank.",
    "config": "pass the same config (command-line arguments, environment) to every rank.",
    "model": "build the same model class on every rank.",
}


class Preflight(Component):
    """Checks at start that every rank agrees on what must match (see the module doc),
    and optionally stops every rank together at the shortest rank's data.

    A real no-op outside a distributed run (nothing exchanged, nothing wrapped), except
    for the local bf16-on-CPU warning.

    Args:
        config: the run's own settings (``vars(args)``, a dict from a YAML file):
            compared across ranks, key by key (nested mappings flattened with ``.``).
        even_batches: stop every rank after the shortest rank's number of batches
            (then differing loader lengths are an event, not an error).
        check: compare the facts across ranks; ``False`` keeps only ``even_batches``.
    """

    name = "preflight"

    def __init__(
        self,
        *,
        config: Mapping[str, Any] | None = None,
        even_batches: bool = False,
        check: bool = True,
    ) -> None:
        mapping("config", config, allow_none=True)
        self.config = dict(config) if config is not None else None
        self.even_batches = bool(even_batches)
        self.check = bool(check)
        #: Batches per pass every rank stops after (even_batches with len()), or None.
        self.batch_limit: int | None = None
        #: Seconds the start exchange took on this rank (facts + exchange + compare).
        self.seconds: float | None = None
        self._guard: Guard | None = None
        self._batch_pending = False
        self._chunked = False

    # ------------------------------------------------------------------ hooks

    def on_start(self, guard: Guard) -> None:
        _warn_bf16_on_cpu(guard)
        if guard.side_group is None:
            return
        t0 = time.perf_counter()
        self._guard = guard
        mine = self._facts(guard)
        gathered: list[Any] = [None] * guard.world_size
        dist.all_gather_object(gathered, mine, group=guard.side_group)
        self._decide(guard, gathered)
        self.seconds = time.perf_counter() - t0
        wrappers = getattr(guard, "batch_wrappers", None)
        self._batch_pending = self.check and guard.loader is not None
        if wrappers is not None and (
            self._batch_pending or self.batch_limit is not None or self._chunked
        ):
            wrappers.append(self._wrap)
        guard.event(
            "preflight",
            message=f"ranks agree ({self.seconds * 1e3:.0f} ms)",
            seconds=round(self.seconds, 4),
            batch_limit=self.batch_limit,
        )

    def on_end(self, guard: Guard, exc: BaseException | None) -> None:
        # A rank whose loader was empty (or that never iterated) joins the first-batch
        # exchange here, so the ranks that did fetch a batch are not left waiting.
        if self._batch_pending and exc is None and guard.side_group is not None:
            self._exchange_batch(guard, None)

    # ------------------------------------------------------------------ facts

    def _facts(self, guard: Guard) -> dict[str, Any]:
        from guardrails import _launch

        loader = guard.loader
        out: dict[str, Any] = {"len": _len(loader)}
        if not self.check:
            return out
        facts: dict[str, Any] = {
            "world_size": guard.world_size,
            "backend": str(dist.get_backend()),
            "device_type": guard.device.type,
            "model.type": type(_model.unwrap(guard.model)).__name__,
        }
        facts.update(_versions())
        facts.update(_compute(guard))
        for name, opt in guard.optimizers.items():
            facts.update(_optimizer_facts(opt, "optimizer" if len(guard.optimizers) == 1 else name))
        if loader is not None:
            facts["loader.len"] = out["len"]
            dataset = getattr(loader, "dataset", None)
            facts["loader.dataset_len"] = _len(dataset) if dataset is not None else None
            facts["loader.batch_size"] = getattr(loader, "batch_size", None)
            facts["loader.drop_last"] = getattr(loader, "drop_last", None)
        if self.config is not None:
            facts.update({f"config.{k}": v for k, v in _flatten(self.config).items()})
        out["facts"] = {k: _plain(v) for k, v in facts.items()}
        out["params"] = param_table(guard.model)
        problems = _launch.launch_problems(device_type=guard.device.type, device_chosen=True)
        out["launch"] = [p.__dict__ for p in problems]
        out["gpu"] = _gpu_identity(guard.device)
        return out

    # ------------------------------------------------------------------ decision

    def _decide(self, guard: Guard, gathered: list[dict[str, Any]]) -> None:
        lengths = {r: g["len"] for r, g in enumerate(gathered)}
        if self.even_batches:
            if all(n is not None for n in lengths.values()):
                self.batch_limit = min(lengths.values())  # type: ignore[type-var]
            elif guard.loader is not None:
                self._chunked = True
        if self.check:
            _raise_launch(guard, gathered)
            fields = _diff_facts([g["facts"] for g in gathered])
            fields.update(param_diffs([g["params"] for g in gathered]))
            if self.even_batches:
                uneven = {k: fields.pop(k, None) for k in ("loader.len", "loader.dataset_len")}
                uneven = {k: v for k, v in uneven.items() if v is not None}
                if uneven:
                    guard.event(
                        "uneven_data",
                        message=(
                            "ranks have different amounts of data ("
                            + "; ".join(f"{k}: {_by_rank(v)}" for k, v in uneven.items())
                            + "): even_batches stops every rank after "
                            + (
                                f"{self.batch_limit} batches per pass"
                                if self.batch_limit is not None
                                else "the shortest rank's last batch"
                            )
                        ),
                        lengths={str(r): n for r, n in lengths.items()},
                    )
            elif _same(fields, "loader.len", gathered):
                fields.pop("loader.dataset_len", None)
            fields = {k: v for k, v in fields.items() if v is not None}
            if fields:
                raise _mismatch(guard, fields)
        for g in gathered:
            for p in g.get("launch", []):
                if p["level"] == "warning" and guard.rank == 0:
                    guard.event("launch_warning", level="warning", message=p["message"])

    # ------------------------------------------------------------------ the first batch

    def _wrap(self, it: Iterator[Any]) -> Iterator[Any]:
        guard = self._guard
        assert guard is not None
        if self._batch_pending:
            it = self._first_batch(guard, it)
        if self.batch_limit is not None:
            done = int(getattr(guard, "batch_in_epoch", 0))  # a resumed pass
            it = islice(it, max(0, self.batch_limit - done))
        elif self._chunked:
            it = _agreed_chunks(it, guard.side_group)
        return it

    def _first_batch(self, guard: Guard, it: Iterator[Any]) -> Iterator[Any]:
        if not self._batch_pending:  # a later pass
            yield from it
            return
        end = object()
        batch = next(it, end)
        self._exchange_batch(guard, None if batch is end else batch)
        if batch is end:
            return
        yield batch
        yield from it

    def _exchange_batch(self, guard: Guard, batch: Any) -> None:
        self._batch_pending = False
        mine = _NO_BATCH if batch is None else batch_fingerprint(batch)
        gathered: list[Any] = [None] * guard.world_size
        dist.all_gather_object(gathered, mine, group=guard.side_group)
        shown = {r: fp if isinstance(fp, str) else fp["shown"] for r, fp in enumerate(gathered)}
        keys = {
            r: fp if isinstance(fp, str) else fp["key"]
            for r, fp in enumerate(gathered)
            if not (self.even_batches and fp == _NO_BATCH)  # an empty rank: stop, not error
        }
        if len({json.dumps(k, default=str) for k in keys.values()}) > 1:
            raise _mismatch(guard, {"first_batch": shown})


# ---------------------------------------------------------------------- parameters


def param_table(model: nn.Module, *, weights: bool = True) -> dict[str, Any]:
    """Names, shapes, dtypes of ``model``'s parameters and, when ``weights``, their
    checksums (see the module doc). One device-to-host copy per device."""
    named = list(model.named_parameters())
    params = [p.detach() for _, p in named]
    table: dict[str, Any] = {
        "names": [n for n, _ in named],
        "shapes": [list(p.shape) for p in params],
        "dtypes": [str(p.dtype).replace("torch.", "") for p in params],
        "sharded": _model.holds_shards(model),
        "sums": None,
        "hashes": None,
    }
    if not weights or table["sharded"] or any(p.is_meta for p in params):
        return table
    sums: list[int] = [0] * len(params)
    hashes: list[str] = [""] * len(params)
    by_device: dict[torch.device, list[int]] = {}
    for i, p in enumerate(params):
        by_device.setdefault(p.device, []).append(i)
    with torch.no_grad():
        for idx in by_device.values():
            parts, counts = [], []
            for i in idx:
                bits = _bits(params[i]).reshape(-1)
                parts.append(bits.sum(dtype=torch.int64).reshape(1))
                n = bits.numel()
                sample = bits if n <= SAMPLE_PER_TENSOR else bits[:: n // SAMPLE_PER_TENSOR]
                parts.append(sample[:SAMPLE_PER_TENSOR].to(torch.int64))
                counts.append(min(n, SAMPLE_PER_TENSOR))
            host = torch.cat(parts).cpu()  # the one sync per device
            pos = 0
            for i, k in zip(idx, counts, strict=True):
                sums[i] = int(host[pos])
                digest = hashlib.blake2b(
                    host[pos + 1 : pos + 1 + k].numpy().tobytes(), digest_size=6
                )
                digest.update(str(params[i].numel()).encode())
                hashes[i] = digest.hexdigest()
                pos += 1 + k
    table.update(sums=sums, hashes=hashes)
    return table


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(p: torch.Tensor) -> torch.Tensor:
    """``p``'s elements as integers of the same width (no copy): what is compared."""
    if p.is_complex():
        p = torch.view_as_real(p)
    if p.dtype == torch.bool:
        return p.to(torch.uint8)
    return p.view(_INT_OF_SIZE.get(p.element_size(), torch.uint8))


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


# ---------------------------------------------------------------------- other facts


def _versions() -> dict[str, Any]:
    nccl = None
    if torch.version.cuda is not None:
        try:
            v = torch.cuda.nccl.version()
            nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception:  # no NCCL in this build
            nccl = None
    return {
        "versions.torch": torch.__version__,
        "versions.cuda": torch.version.cuda,
        "versions.nccl": nccl,
    }


def _compute(guard: Guard) -> dict[str, Any]:
    dtypes = sorted({str(p.dtype).replace("torch.", "") for p in guard.model.parameters()})
    out: dict[str, Any] = {"compute.param_dtypes": dtypes}
    dev = guard.device.type
    try:
        if torch.is_autocast_enabled(dev):
            out["compute.autocast_dtype"] = str(torch.get_autocast_dtype(dev)).replace("torch.", "")
    except (TypeError, RuntimeError):  # a device type autocast does not know
        pass
    return out


def _optimizer_facts(opt: torch.optim.Optimizer, name: str = "optimizer") -> dict[str, Any]:
    """Type and hyperparameters of one optimizer (``name``: ``optimizer``, or its name
    among several: ``optimizer.D.lr``)."""
    top = "optimizer" if name == "optimizer" else f"optimizer.{name}"
    out: dict[str, Any] = {
        f"{top}.type": type(opt).__name__,
        f"{top}.groups": len(opt.param_groups),
    }
    for i, group in enumerate(opt.param_groups):
        prefix = f"{top}." if len(opt.param_groups) == 1 else f"{top}.group{i}."
        out[prefix + "params"] = len(group["params"])
        for k, v in sorted(group.items()):
            if k != "params":
                out[prefix + k] = v
    return out


def _len(obj: Any) -> int | None:
    try:
        return len(obj)
    except Exception:  # no __len__, or an IterableDataset's TypeError
        return None


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _plain(v: Any) -> Any:
    """A comparable, picklable, printable form of a fact's value."""
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else f"Tensor{tuple(v.shape)}"
    if isinstance(v, (tuple, list)):
        return [_plain(x) for x in v]
    if isinstance(v, Mapping):
        return {str(k): _plain(x) for k, x in v.items()}
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, torch.dtype):
        return str(v).replace("torch.", "")
    return repr(v)


def _gpu_identity(device: torch.device) -> str | None:
    """The physical GPU this rank trains on (host + UUID), to catch two ranks on one."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        uuid = str(torch.cuda.get_device_properties(index).uuid)
    except Exception:
        uuid = f"{os.environ.get('CUDA_VISIBLE_DEVICES', '*')}/{index}"
    return f"{socket.gethostname()}:{uuid}"


def batch_fingerprint(batch: Any) -> dict[str, Any]:
    """``{"key": compared, "shown": str}`` for a batch: the nesting, each tensor's dtype,
    number of dimensions and batch dimension (compared), and full shapes (shown)."""

    def walk(x: Any, depth: int) -> tuple[Any, str]:
        if isinstance(x, torch.Tensor):
            shape = list(x.shape)
            dtype = str(x.dtype).replace("torch.", "")
            return (dtype, x.ndim, shape[:1]), f"{dtype}{shape}"
        if depth >= 3:
            return type(x).__name__, type(x).__name__
        if isinstance(x, Mapping):
            items = [(str(k), walk(v, depth + 1)) for k, v in list(x.items())[:16]]
            return (
                ["dict", [(k, kv[0]) for k, kv in items]],
                "{" + ", ".join(f"{k}: {kv[1]}" for k, kv in items) + "}",
            )
        if isinstance(x, (tuple, list)):
            if x and not any(isinstance(e, (torch.Tensor, Mapping, tuple, list)) for e in x):
                name = f"{type(x).__name__}[{type(x[0]).__name__}]"
                return [name, len(x)], f"{name} of {len(x)}"
            parts = [walk(e, depth + 1) for e in x[:16]]
            return (
                [type(x).__name__, [p[0] for p in parts]],
                "(" + ", ".join(p[1] for p in parts) + ")",
            )
        return type(x).__name__, type(x).__name__

    key, shown = walk(batch, 0)
    return {"key": json.loads(json.dumps(key, default=str)), "shown": shown}


# ---------------------------------------------------------------------- comparison


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


def _by_rank(values: Mapping[int, Any]) -> str:
    groups: dict[str, list[int]] = {}
    for r, v in values.items():
        groups.setdefault(json.dumps(v, default=str), []).append(r)
    parts = []
    for v, ranks in groups.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {shorten(ranks, 8)}"
        parts.append(f"{who}: {json.loads(v) if v.startswith(chr(34)) else v}")
    return "; ".join(parts)


def _odd_ranks(values: Mapping[int, Any]) -> list[int]:
    """The ranks outside the largest group of equal values (ties: rank 0's group is
    the reference)."""
    groups: dict[str, list[int]] = {}
    for r, v in values.items():
        groups.setdefault(json.dumps(v, default=str), []).append(r)
    ref = max(groups.values(), key=lambda rs: (len(rs), -rs[0]))
    return [r for r in values if r not in ref]


def _mismatch(guard: Guard, fields: dict[str, dict[int, Any]]) -> ConfigMismatchError:
    lines = [f"  {k}: {_by_rank(v)}" for k, v in fields.items()]
    odd = sorted({r for v in fields.values() for r in _odd_ranks(v)})
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


# ---------------------------------------------------------------------- even batches


def _agreed_chunks(it: Iterator[Any], group: Any) -> Iterator[Any]:
    """Yield batches in chunks of EVEN_CHUNK, each chunk cut to the smallest count any
    rank could fetch: one MIN all_reduce over the side group per chunk."""
    count = torch.zeros(1, dtype=torch.int64)
    while True:
        chunk = list(islice(it, EVEN_CHUNK))
        count.fill_(len(chunk))
        dist.all_reduce(count, op=dist.ReduceOp.MIN, group=group)
        n = int(count.item())  # a CPU tensor on the gloo group: no device sync
        yield from chunk[:n]
        if n < EVEN_CHUNK:
            return


# ---------------------------------------------------------------------- bf16 on CPU


def _warn_bf16_on_cpu(guard: Guard) -> None:
    """Seed 004: a CPU run in bf16 on a CPU without native bf16 is many times slower."""
    if guard.device.type != "cpu":
        return
    bf16 = any(p.dtype == torch.bfloat16 for p in guard.model.parameters())
    with contextlib.suppress(TypeError, RuntimeError):  # torch without per-device autocast
        bf16 = bf16 or (
            torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        )
    if not bf16:
        return
    from guardrails._doctor import _cpu

    try:
        native = _cpu().get("bf16_native")
    except Exception:
        return
    if native is False:
        guard.event(
            "bf16_on_cpu",
            level="warning",
            message=(
                "the compute dtype is bfloat16 on a CPU without native bf16 (no avx512_bf16 "
                "/ amx_bf16): bf16 math is emulated through float32 and can be many times "
                "slower (seed 004: bf16 was auto-picked for a CPU run because a GPU was "
                "present). Train CPU runs in float32, and pick the dtype from the device "
                "you train on, not from torch.cuda.is_available()."
            ),
        )
