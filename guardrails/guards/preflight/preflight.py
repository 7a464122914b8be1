"""Cross-rank preflight: what must be the same on every rank, checked once at start.

A two-node hang can have causes that a single exchange at start names: the ranks read
different data (201 parquet shards on one node, 4 on the other), or one node picked
bf16 for a CPU run because a GPU happened to be present; batch size, world size and
versions belong on the same list. At guard start every
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
* launch problems found by :mod:`guardrails.distributed.launch` (after ``init_process_group``), and
  two ranks on one GPU (same host, same device).

**The weights checksum** (``facts.py``) is an integer sum of each tensor's
raw bits plus a hash of 64 strided elements: exact, order-independent, compared
bitwise. Sharded models (FSDP, DTensor) hold a different shard per rank: their
weights are not compared, only names, shapes and dtypes.

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

Where the parts live: this module holds the component (the exchanges and the
decision); ``facts.py`` what each rank gathers, ``diff.py`` the comparison and the
error's text, ``even_batches.py`` the chunked cut, ``bf16.py`` the local bf16-on-CPU
warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from itertools import islice
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from guardrails.distributed.store import distributed, same_everywhere
from guardrails.engine import model
from guardrails.engine.component import Component
from guardrails.engine.config import configure
from guardrails.guards.preflight.bf16 import _warn_bf16_on_cpu
from guardrails.guards.preflight.diff import (
    _NO_BATCH,
    _diff_facts,
    _mismatch,
    _raise_launch,
    _same,
    by_rank,
    param_diffs,
)
from guardrails.guards.preflight.even_batches import _agreed_chunks
from guardrails.guards.preflight.facts import (
    _compute,
    _flatten,
    _gpu_identity,
    _len,
    _optimizer_facts,
    _plain,
    _versions,
    batch_fingerprint,
    param_table,
)
from guardrails.util.checks import config_dict, flag

if TYPE_CHECKING:
    from guardrails.engine.guard import Guard

logger = logging.getLogger("guardrails.preflight")


class Preflight(Component):
    """Checks at start that every rank agrees on what must match (see the module doc),
    and optionally stops every rank together at the shortest rank's data.

    A real no-op outside a distributed run (nothing exchanged, nothing wrapped), except
    for the local bf16-on-CPU warning. Knobs: :class:`Preflight.Config`
    (``guardrails.guard(preflight=...)``).
    """

    @dataclass(kw_only=True)
    class Config:
        """Preflight's knobs.

        Attributes:
            check: compare across ranks, once at start over a gloo side group, what
                must match, and raise :class:`~guardrails.ConfigMismatchError` on every
                rank naming each differing field with every rank's value: parameter
                names, shapes, dtypes and initial-weight checksums; optimizer type and
                hyperparameters; loader length, dataset length, batch size and the
                first batch's shapes; world size, backend, device type, compute dtype;
                torch / CUDA / NCCL versions; ``run_config``. ``False`` keeps only
                ``even_batches``. Default True.
            run_config: the run's own settings (``vars(args)``, a dict from a YAML
                file, a dataclass), compared across ranks key by key (nested mappings
                flattened with ``.``); ``guard(config=...)`` sets it.
            even_batches: stop every rank after the shortest rank's number of batches,
                so uneven data ends the loop on every rank together instead of hanging
                the longer ones (loaders with ``len()``: no per-step cost; without: one
                side-group agreement per 16 batches). Differing loader lengths are then
                an ``uneven_data`` event, not an error. Default False.
        """

        check: bool = True
        run_config: Mapping[str, Any] | None = None
        even_batches: bool = False

        def __post_init__(self) -> None:
            self.run_config = config_dict(self.run_config)
            flag("even_batches", self.even_batches)  # "no" is truthy: never taken as True
            flag("check", self.check)  # "no" is truthy: never taken as True

        @property
        def does_anything(self) -> bool:
            """Whether it has anything to do (``guard()`` leaves it out if not): the
            comparison (in one process, the bf16-on-CPU warning), or the even-batches
            cut, which needs other ranks."""
            return self.check or (self.even_batches and distributed())

    name = "preflight"
    # After the watchdog (a rank that never arrives is then reported, not waited for);
    # before the checkpointer: the weights compared are the ones each rank built, not
    # the resumed ones.
    after = ("watchdog",)
    before = ("checkpoint",)

    def __init__(self, config: Preflight.Config | None = None, /, **knobs: Any) -> None:
        configure(self, config, knobs)
        #: Batches per pass every rank stops after (even_batches with len()), or None.
        self.batch_limit: int | None = None
        #: Seconds the start exchange took on this rank (facts + exchange + compare).
        self.seconds: float | None = None
        self._guard: Guard | None = None
        self._batch_pending = False
        self._chunked = False
        self._store: Any = None

    # ------------------------------------------------------------------ hooks

    def on_start(self, guard: Guard) -> None:
        _warn_bf16_on_cpu(guard)
        if guard.side_group is None:
            return
        t0 = time.perf_counter()
        self._guard = guard
        self._store = guard.side_store("preflight")
        mine = self._facts(guard)
        with guard.in_phase("agree"):
            agreed = self._agreed(guard, mine)
        if agreed:
            # Every rank's facts are this rank's: decide from this rank's alone (the
            # launch problems and GPU of the others were checked on the way).
            self._decide(guard, [{**mine, "gpu": None}])
        else:  # something differs: every rank's facts, to say what and where
            gathered: list[Any] = [None] * guard.world_size
            dist.all_gather_object(gathered, mine, group=guard.side_group)
            self._decide(guard, gathered)
        self.seconds = time.perf_counter() - t0
        self._batch_pending = self.check and guard.loader is not None
        if self._batch_pending or self.batch_limit is not None or self._chunked:
            guard.wrap_batches(self._wrap)
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
        from guardrails.distributed import launch

        loader = guard.loader
        out: dict[str, Any] = {"len": _len(loader)}
        if not self.check:
            return out
        facts: dict[str, Any] = {
            "world_size": guard.world_size,
            "backend": str(dist.get_backend()),
            "device_type": guard.device.type,
            "model.type": type(model.unwrap(guard.model)).__name__,
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
        if self.run_config is not None:
            facts.update({f"config.{k}": v for k, v in _flatten(self.run_config).items()})
        out["facts"] = {k: _plain(v) for k, v in facts.items()}
        out["params"] = param_table(guard.model)
        problems = launch.launch_problems(device_type=guard.device.type, device_chosen=True)
        out["launch"] = [p.__dict__ for p in problems]
        out["gpu"] = _gpu_identity(guard.device)
        return out

    # ------------------------------------------------------------------ decision

    def _agreed(self, guard: Guard, mine: dict[str, Any]) -> bool:
        """Whether every rank's facts equal this one's, no rank has a launch error and
        no two ranks share a GPU: a few store calls a rank whatever N (an all-gather
        of every rank's facts is O(N) bytes and comparisons a rank: ~90 MB and seconds
        at 10,000 ranks). ``False`` sends every rank to the all-gather, which says
        what differs."""
        store, world = self._store, guard.world_size
        # The launch warnings too: rank 0 reports every rank's, which are then its own.
        shared = {k: mine.get(k) for k in ("len", "facts", "params", "launch")}
        digest = hashlib.sha256(json.dumps(shared, sort_keys=True, default=str).encode())
        error = any(p["level"] == "error" for p in mine.get("launch", []))
        gpu = mine.get("gpu")
        # The second rank to count itself on a GPU knows at once that two share it; its
        # trouble sends every rank to the all-gather, which names both.
        shared_gpu = bool(gpu) and int(store.add(f"gpu/{gpu}", 1)) > 1
        return same_everywhere(
            store, "facts", digest.hexdigest(), world=world, trouble=error or shared_gpu
        )

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
                            + "; ".join(f"{k}: {by_rank(v)}" for k, v in uneven.items())
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
        key = mine if isinstance(mine, str) else mine["key"]
        digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode())
        with guard.in_phase("agree"):  # waits for every rank: a stuck one is named
            same = same_everywhere(self._store, "batch", digest.hexdigest(), world=guard.world_size)
        if same:
            return  # every rank's first batch has this one's structure
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
