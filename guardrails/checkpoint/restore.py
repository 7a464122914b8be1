"""Resume: the newest valid checkpoint picked (each newer one that is not valid skipped,
with the reason), checked whole against the live model, optimizer, scheduler and scaler,
and only then applied, so a ``CheckpointError`` or ``ResumeError`` leaves every object
exactly as it was. The format is described in ``checkpoint/__init__.py``.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from guardrails._errors import CheckpointError, ResumeError
from guardrails.checkpoint import sharded as _sharded
from guardrails.checkpoint import tier
from guardrails.checkpoint.codec import decode
from guardrails.checkpoint.common import (
    EXTRAS_TENSORS,
    _listing,
    _read_manifest,
    log,
)

# The manifest and the checks of a checkpoint's files, torch-free (`inspect` uses them).
from guardrails.checkpoint.manifest import (
    MANIFEST,
    STEP_RE,
    _contents,
    _rank_name,
    resume_order,
)
from guardrails.checkpoint.read import (
    _added_groups,
    _check_classes,
    _check_group_keys,
    _check_materialized,
    _check_model,
    _check_optimizer,
    _check_optimizer_state,
    _check_optimizer_values,
    _check_rng,
    _component_state,
    _corrupt,
    _load_optimizer,
    _missing,
    _pair,
    _problem,
    _Reader,
    _restore_rng,
    _saved_trains,
    _torch_own,
    skip_hint,
)
from guardrails.checkpoint.stage import (
    per_rank,
)
from guardrails.distributed import dist
from guardrails.util.checks import check_scaler, flag, named, path_like
from guardrails.util.text import shorten

# ----------------------------------------------------------------------------- save


# --------------------------------------------------------------------------- resume


def resume(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    scheduler: Any = None,
    scaler: Any = None,
    strict: bool = True,
    allow_world_size_change: bool = False,
) -> dict[str, Any]:
    """Restore model, optimizer, scheduler, scaler and every RNG from a checkpoint.

    Args:
        path: a run's checkpoint root (the newest *valid* ``step_*`` under it is used,
            of the run that saved last when several runs saved there; newer invalid
            ones are skipped with a warning saying why) or one exact ``step_*``
            directory.
        model, optimizer, scheduler, scaler: restored in place; each one passed must
            have state in the checkpoint.
        strict: ``True`` (default): the model's keys must match the checkpoint's exactly.
            ``False``: missing and unexpected keys are allowed (loading a backbone into
            a model with a new head); shape mismatches are always an error, and a
            component passed without state in the checkpoint is left as it is.
        allow_world_size_change: a checkpoint written by a different number of ranks
            is a ``ResumeError`` unless this is ``True``; then the replicated state
            (model, optimizer, scheduler, scaler, extras) is restored and the per-rank
            state (RNG streams, data position) is not: each rank's share of the data
            changes with the world size.

    Returns:
        ``{"step": int, "extras": dict, "path": str}``: continue training at
        ``step + 1``.

    Raises:
        ResumeError: no checkpoint there, every one is invalid (each listed with why),
            or the checkpoint is intact but does not fit this model / optimizer / world
            size (the message lists the keys), or the model is on the meta device
            (materialize it first: ``model.to_empty(device=...)``); nothing was
            modified.
        CheckpointError: the exact ``step_*`` directory given is truncated / corrupt
            (the message names the file and the previous valid checkpoint).
    """
    # The arguments first, where they were passed: a path of another type failed in
    # pathlib with no parameter named.
    path_like("resume(path=...)", path)
    flag("resume(strict=...)", strict)
    flag("resume(allow_world_size_change=...)", allow_world_size_change)
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"resume() needs the model to load into (an nn.Module) as `model`, got "
            f"{type(model).__name__}"
        )
    if optimizer is not None:
        named("optimizer", optimizer, torch.optim.Optimizer, where="resume()")
    if scheduler is not None:
        named("scheduler", scheduler, object, where="resume()")
    if scaler is not None:
        check_scaler("resume(scaler=...)", scaler)
    out = load(
        Path(path),
        model,
        optimizer,
        scheduler=scheduler,
        scaler=scaler,
        strict=strict,
        allow_world_size_change=allow_world_size_change,
    )
    log.info("guardrails: resumed from %s (step %d)", out["path"], out["step"])
    if out["recreated_groups"]:
        log.info(
            "guardrails: re-created the optimizer's param groups added during the saved run: %s",
            ", ".join(out["recreated_groups"]),
        )
    return {"step": out["step"], "extras": out["extras"], "path": out["path"]}


def load(
    path: Path,
    model: nn.Module,
    optimizer: Any = None,
    *,
    scheduler: Any = None,
    scaler: Any = None,
    strict: bool = True,
    allow_world_size_change: bool = False,
    ckpt: Path | None = None,
) -> dict[str, Any]:
    """:func:`resume`, also returning this rank's own saved state (``rank_state``: the
    JSON part, ``rank_tensors``). ``ckpt``: the directory already picked (every rank
    must load the same one); else the one :func:`pick` finds under ``path``, falling
    back past every newer checkpoint that is invalid, with a warning each."""

    def prep(c: Path) -> Plan:
        return prepare(
            c,
            model,
            optimizer,
            scheduler=scheduler,
            scaler=scaler,
            strict=strict,
            allow_world_size_change=allow_world_size_change,
        )

    if ckpt is not None:
        try:
            plan = prep(ckpt)
        except CheckpointError as e:
            raise e.rehint(skip_hint(ckpt)) from None
    else:
        found, plan, skipped = pick(path, prep)
        for _, said in said_skipped(skipped, path):
            log.warning("guardrails: %s; using %s", said, found)
    assert plan is not None
    return apply(plan)


@dataclasses.dataclass
class Plan:
    """A checkpoint read, decoded and checked against the live objects, with nothing
    applied yet (:func:`prepare`); :func:`apply` applies it."""

    ckpt: Path
    step: int
    model: nn.Module
    strict: bool
    sharded: bool
    model_sd: dict[str, Tensor] | None
    optimizers: dict[str, Any]
    opt_sds: list[tuple[Any, dict[str, Any]]]
    #: Per optimizer of ``opt_sds``: the param groups to add to it before its state
    #: loads (``read._added_groups``), each with its parameters' ``requires_grad``.
    added_groups: list[list[tuple[dict[str, Any], list[bool]]]]
    #: The parameters of the optimizers' groups whose ``requires_grad`` was otherwise
    #: when saved (``read._saved_trains``: a layer unfrozen or frozen in its group).
    trains: list[tuple[Tensor, bool]]
    sched_sds: list[tuple[Any, Any]]
    scaler: Any
    scaler_sd: Any
    extras: dict[str, Any]
    rank_state: dict[str, Any]
    rank_tensors: dict[str, Tensor]
    rng: Any


def prepare(
    ckpt: Path,
    model: nn.Module,
    optimizer: Any = None,
    *,
    scheduler: Any = None,
    scaler: Any = None,
    strict: bool = True,
    allow_world_size_change: bool = False,
    check: Any = None,
    extras_device: torch.device | None = None,
) -> Plan:
    """Read every part of ``ckpt`` this rank loads and check it against what it loads
    into; nothing is modified. Only files the manifest lists are read (each was
    verified by :func:`pick`: its size, sha256 and schema). A part whose content cannot
    be decoded or does not fit its own class's state is a ``CheckpointError`` naming
    the file and the field (the checkpoint is damaged: a resume from the root falls
    back to an older one); one that does not fit this run (another model, optimizer,
    world size) is a ``ResumeError``. ``check(rank_state, rank_file)``: the caller's
    own checks of this rank's saved state (the guard's: the data position against its
    loader). ``extras_device``: where the extras' tensors saved from an accelerator go
    (``None``: the device each was saved from); those saved from the CPU stay there."""
    manifest = _read_manifest(ckpt)
    step = int(manifest["step"])
    files = manifest["files"]
    _check_world_size(ckpt, manifest, allow_world_size_change)

    # 1. Read everything and check it against the live objects; nothing is modified yet.
    _check_materialized(ckpt, step, model)
    reader = _Reader(ckpt, step, files)
    contents = _contents(manifest)
    optimizers = {} if optimizer is None else named("optimizer", optimizer, torch.optim.Optimizer)
    schedulers = {} if scheduler is None else named("scheduler", scheduler, object)
    sharded = f"{_sharded.DCP_DIR}/.metadata" in files
    model_sd: dict[str, Tensor] | None = None
    if sharded:
        _sharded.check(ckpt, step, model)
    elif "model.safetensors" in files:
        model_sd = reader.tensors("model.safetensors")
        _check_model(ckpt, step, model, model_sd, strict)
    elif strict:  # only listed files are read: a model file the manifest omits is not
        raise _missing(ckpt, step, "model")
    _check_classes(ckpt, step, contents, optimizers, schedulers)
    pairs = [] if sharded else _pair(ckpt, step, "optimizer", optimizers, contents, strict)
    opt_sds, added_groups, trains = _read_optimizers(reader, manifest, model, optimizers, pairs)
    # Another torch version may add or drop a key of its classes' states.
    same_torch = manifest.get("torch") == torch.__version__
    sched_pairs = _pair(ckpt, step, "scheduler", schedulers, contents, strict)
    sched_sds = _read_schedulers(reader, sched_pairs, strict=strict, same_torch=same_torch)
    scaler_sd = _read_scaler(reader, scaler, strict=strict, same_torch=same_torch)
    extras = _read_extras(reader, files, extras_device)
    rank_state, rank_tensors, rng = _read_rank_state(reader, manifest, check)
    return Plan(
        ckpt=ckpt,
        step=step,
        model=model,
        strict=strict,
        sharded=sharded,
        model_sd=model_sd,
        optimizers=optimizers,
        opt_sds=opt_sds,
        added_groups=added_groups,
        trains=trains,
        sched_sds=sched_sds,
        scaler=scaler,
        scaler_sd=scaler_sd,
        extras=extras,
        rank_state=rank_state,
        rank_tensors=rank_tensors,
        rng=rng,
    )


def _check_world_size(ckpt: Path, manifest: dict[str, Any], allow_change: bool) -> None:
    """A checkpoint of another world size resumes only when allowed, and then only
    its replicated state."""
    world = dist.world_size()
    saved_world = int(manifest.get("world_size", 1))
    if saved_world == world or allow_change:
        return
    raise ResumeError(
        f"checkpoint {ckpt} was written by {saved_world} rank(s); this run has {world}. "
        "Restorable: the model, optimizer, scheduler, scaler and extras (every rank "
        "holds the same copy). Not restorable: each rank's RNG streams and data "
        "position, because each rank's share of the data changes with the world size",
        step=int(manifest["step"]),
        rank=dist.rank(),
        path=str(ckpt),
        hint=f"relaunch with {saved_world} rank(s) for an exact resume; or pass "
        "allow_world_size_change=True (resume(...), or guard(..., "
        'checkpoint={"allow_world_size_change": True})) to restore the replicated '
        "state and start the interrupted pass over; or, for a different run, use "
        "another run_dir (or resume=None), which keeps these checkpoints. Nothing "
        "was modified.",
        remedy="world_size",
        saved_world=saved_world,
    )


def _read_optimizers(
    reader: _Reader,
    manifest: dict[str, Any],
    model: nn.Module,
    optimizers: dict[str, Any],
    pairs: list[tuple[str, Any, Any]],
) -> tuple[
    list[tuple[Any, dict[str, Any]]],
    list[list[tuple[dict[str, Any], list[bool]]]],
    list[tuple[Tensor, bool]],
]:
    """Each optimizer's saved state, checked against the live optimizer: its state
    dicts, the param groups added since the save, which saved params it trains."""
    ckpt, step = reader.ckpt, reader.step
    rank, world = dist.rank(), dist.world_size()
    saved_world = int(manifest.get("world_size", 1))
    opt_sds: list[tuple[Any, dict[str, Any]]] = []
    added_groups: list[list[tuple[dict[str, Any], list[bool]]]] = []
    trains: list[tuple[Tensor, bool]] = []
    for name, opt, saved in pairs:
        stem = saved["file"]
        if saved.get("per_rank"):
            if saved_world != world:
                raise ResumeError(
                    f"checkpoint {ckpt} holds optimizer {name!r}'s state in {saved_world} "
                    f"per-rank parts (a sharded optimizer: each rank holds a different "
                    f"part); this run has {world} rank(s), and the parts cannot be "
                    "redistributed",
                    step=step,
                    rank=rank,
                    path=str(ckpt),
                    hint=f"relaunch with {saved_world} rank(s), or start fresh "
                    "(guard(..., resume=None)). Nothing was modified.",
                )
            stem = f"{_rank_name(rank)}.{stem}"
        sd = _load_optimizer(reader, stem)
        who = name if len(optimizers) > 1 else None
        with reader.reading(f"{stem}.json"):
            added = _added_groups(ckpt, step, who, opt, sd, model)
            groups = [g for g, _ in added]
            _check_optimizer(ckpt, step, who, opt, sd, model, groups)
            _check_optimizer_values(reader, f"{stem}.json", opt, sd, groups)
            _check_group_keys(reader, f"{stem}.json", opt, sd, len(per_rank(opt).param_groups))
            _check_optimizer_state(reader, f"{stem}.json", opt, sd)
            trains += _saved_trains(opt, sd)
        opt_sds.append((opt, sd))
        added_groups.append(added)
    return opt_sds, added_groups, trains


def _read_schedulers(
    reader: _Reader, pairs: list[tuple[str, Any, Any]], *, strict: bool, same_torch: bool
) -> list[tuple[Any, Any]]:
    """Each scheduler's saved state; torch's own classes checked key by key."""
    sched_sds = []
    for _, sched, saved in pairs:
        sd = _component_state(reader, saved, strict)
        if sd is not None and _torch_own(sched, "torch.optim.lr_scheduler"):
            what = type(sched).__name__
            reader.same_keys(f"{saved}.json", sd, sched, what, same_torch=same_torch)
            reader.like(f"{saved}.json", sd, sched.state_dict())
        sched_sds.append((sched, sd))
    return sched_sds


def _read_scaler(reader: _Reader, scaler: Any, *, strict: bool, same_torch: bool) -> Any:
    """The GradScaler's saved state: a disabled one's does not resume an enabled one."""
    scaler_sd = None if scaler is None else _component_state(reader, "scaler", strict)
    if scaler_sd is not None and not scaler_sd and scaler.is_enabled():
        raise ResumeError(
            f"checkpoint {reader.ckpt} holds the state of a disabled GradScaler; this run's "
            "is enabled, so there is no scale to continue from",
            step=reader.step,
            path=str(reader.ckpt),
            hint="resume with the scaler as it was saved (enabled=False), or without it: "
            "leave scaler= out and the scaler starts from its initial scale. Nothing was "
            "modified.",
        )
    if scaler_sd and _torch_own(scaler, "torch."):
        what = type(scaler).__name__
        reader.same_keys("scaler.json", scaler_sd, scaler, what, same_torch=same_torch)
        reader.like("scaler.json", scaler_sd, scaler.state_dict())
    return scaler_sd


def _read_extras(
    reader: _Reader, files: dict[str, Any], extras_device: torch.device | None
) -> dict[str, Any]:
    """The user's extras, their tensors placed on ``extras_device``."""
    extras: Any = {}
    if "extras.json" in files:
        raw = reader.json("extras.json")
        held = reader.tensors(EXTRAS_TENSORS) if EXTRAS_TENSORS in files else {}
        placed: dict[int, Tensor] = {}  # one tensor under two keys stays one

        def place(t: Tensor, saved: str | None) -> Tensor:
            if id(t) not in placed:
                placed[id(t)] = _place_extra(extras_device, t, saved)
            return placed[id(t)]

        with reader.reading("extras.json"):
            extras = decode(raw, held, place=place)
    if not isinstance(extras, dict):
        raise reader.bad("extras.json", "", f"holds {type(extras).__name__}, not an object")
    return extras


def _read_rank_state(
    reader: _Reader, manifest: dict[str, Any], check: Any
) -> tuple[dict[str, Any], dict[str, Tensor], Any]:
    """This rank's saved state, its tensors and its RNG streams (format 1: the shared
    ``rng.json``); none at another world size or where rank 0 saved alone."""
    ckpt, files = reader.ckpt, manifest["files"]
    rank, world = dist.rank(), dist.world_size()
    saved_world = int(manifest.get("world_size", 1))
    rank_state: dict[str, Any] = {}
    rank_tensors: dict[str, Tensor] = {}
    rng: Any = None
    name = _rank_name(rank)
    if saved_world != world:
        log.warning(
            "guardrails: %s was written by %d rank(s), this run has %d: restoring the "
            "replicated state only (fresh RNG streams, the interrupted pass starts over)",
            ckpt,
            saved_world,
            world,
        )
    elif f"{name}.json" in files:
        rank_state = decode(reader.json(f"{name}.json"))
        if f"{name}.safetensors" in files:
            rank_tensors = reader.tensors(f"{name}.safetensors")
        rng = rank_state.pop("rng", None)
        _check_rng(reader, f"{name}.json", f"{name}.safetensors", rng, rank_tensors)
        if check is not None:
            check(rank_state, ckpt / f"{name}.json")
    elif "rng.json" in files:  # format 1
        rng = reader.json("rng.json")
        if "rng.safetensors" in files:
            rank_tensors = reader.tensors("rng.safetensors")
        _check_rng(reader, "rng.json", "rng.safetensors", rng, rank_tensors)
    elif rank in manifest.get("ranks", ()):
        # The manifest says this rank saved its state, and lists no file of it: a
        # manifest edited or re-sealed without it. Resuming would restore no RNG
        # stream and no data position of this rank, silently.
        raise reader.bad(
            MANIFEST,
            f'files["{name}.json"]',
            f"is missing: the manifest's ranks list rank {rank}, whose RNG streams and "
            f"data position are in {name}.json, but its files do not list it (expected "
            f"{name}.json, and {name}.safetensors for the tensors)",
        )
    else:
        log.warning(
            "guardrails: %s holds no state of rank %d (it was saved by rank 0 alone, with "
            "save_checkpoint()); this rank's RNG streams start fresh",
            ckpt,
            rank,
        )
    return rank_state, rank_tensors, rng


def apply(plan: Plan) -> dict[str, Any]:
    """Apply what :func:`prepare` read and checked. Every check that can fail on a
    mismatch or a damaged file ran there."""
    if plan.sharded:
        # A collective: every rank loads together (one optimizer with sharded state).
        _sharded.load(plan.ckpt, plan.model, next(iter(plan.optimizers.values()), None))
    elif plan.model_sd is not None:
        plan.model.load_state_dict(plan.model_sd, strict=plan.strict)
    for p, wants in plan.trains:  # unfrozen (or frozen) in its group during the saved run
        p.requires_grad_(wants)
    recreated = []
    for (opt, sd), added in zip(plan.opt_sds, plan.added_groups, strict=True):
        names = {id(p): n for n, p in plan.model.named_parameters()} if added else {}
        for group, trains in added:  # added during the saved run: the same command resumes
            for p, wants in zip(group["params"], trains, strict=True):
                p.requires_grad_(wants)
            per_rank(opt).add_param_group(dict(group))
            recreated.append(
                f"group {len(per_rank(opt).param_groups) - 1} "
                f"({shorten([names.get(id(p), '?') for p in group['params']], 4)})"
            )
        per_rank(opt).load_state_dict(sd)
        _own_allocations(per_rank(opt))
    for sched, sd in plan.sched_sds:
        if sd is not None:
            sched.load_state_dict(sd)
    if plan.scaler_sd is not None:
        plan.scaler.load_state_dict(plan.scaler_sd)
    _restore_rng(plan.rng, plan.rank_tensors)
    # Said by the caller: resume() logs it, the guard announces it with its age.
    return {
        "step": plan.step,
        "extras": plan.extras,
        "path": str(plan.ckpt),
        "rank_state": plan.rank_state,
        "rank_tensors": {k: v for k, v in plan.rank_tensors.items() if not k.startswith("torch.")},
        "recreated_groups": recreated,
    }


def _place_extra(device: torch.device | None, t: Tensor, saved: str | None) -> Tensor:
    """A tensor of the caller's extras where it was saved from, in an allocation of its
    own: a CPU tensor stays on the CPU (cloned out of the file reader's buffer, see
    :func:`_own_allocations`); one saved from an accelerator goes to ``device`` (the
    guard's: rank 1 takes rank 0's ``cuda:0`` tensor on its own GPU), else to the
    device it was saved from, or stays on the CPU, said, where there is no such device."""
    if saved is None:
        return t.clone(memory_format=torch.contiguous_format)
    target = device if device is not None else torch.device(saved)
    try:
        return t.to(target)
    except (RuntimeError, AssertionError) as e:  # AssertionError: a CPU-only torch build
        log.warning(
            "guardrails: a tensor of the checkpoint's extras (g.state) was saved from %s, "
            "which this process cannot use (%s); it is restored on the CPU",
            saved,
            e,
        )
        return t.clone(memory_format=torch.contiguous_format)


def _own_allocations(optimizer: Any) -> None:
    """Give each host tensor of ``optimizer``'s state a fresh allocation of its own, as
    the optimizer's own steps would have made it.

    ``load_state_dict`` keeps a loaded tensor as it is when it already has its
    parameter's dtype and device (every state of a CPU run): then each one lies where
    the file reader put it, at any offset (4 or 24 bytes past a 64-byte boundary, not
    the allocator's 64), and vectorised kernels split such a tensor at other element
    boundaries, so their sums round differently: LBFGS's dot products made a resumed
    run's weights differ from the uninterrupted run's (4e-6 after 10 steps, 2.7e-3 in
    a longer run). A tensor moved to an accelerator is a fresh allocation already. Two
    keys holding one tensor keep holding one."""
    memo: dict[int, Tensor] = {}

    def fresh(value: Any) -> Any:
        if isinstance(value, Tensor):
            if value.device.type != "cpu":
                return value
            if id(value) not in memo:
                memo[id(value)] = value.clone(memory_format=torch.contiguous_format)
            return memo[id(value)]
        if isinstance(value, (list, tuple)):
            return type(value)(fresh(v) for v in value)
        if isinstance(value, dict):
            return {k: fresh(v) for k, v in value.items()}
        return value

    for param, state in optimizer.state.items():
        optimizer.state[param] = fresh(state)


#: The module-level name for symmetry with :func:`save_checkpoint`.
load_checkpoint = resume


def saved_run(ckpt: Path) -> dict[str, Any]:
    """What a checkpoint says of the run that saved it: ``step``, ``time`` (when it was
    saved), and from the manifest's ``run`` (absent in checkpoints written before it,
    or by :func:`save_checkpoint`) ``config``, ``optimizer_settings`` and
    ``finished_at`` (the time the run ended normally with this checkpoint)."""
    manifest = _read_manifest(ckpt)
    run = manifest.get("run") or {}
    return {"step": int(manifest["step"]), "time": manifest.get("time"), **run}


def _pick(path: Path) -> Path:
    """The checkpoint directory to load: ``path`` itself when it is one, else the newest
    valid ``step_*`` under it (the skipped ones logged)."""
    found, _, skipped = pick(path)
    for _, said in said_skipped(skipped, path):
        log.warning("guardrails: %s; using %s", said, found)
    return found


#: Skipped checkpoints said one by one up to this many; more are one line with the count
#: and examples (2,000 invalid newer directories were 2,000 warnings at each start).
SAID_ONE_BY_ONE = 3


def said_skipped(skipped: list[tuple[str, str]], root: Path) -> list[tuple[str | None, str]]:
    """What to say of the checkpoints :func:`pick` skipped: ``(name, text)`` for each,
    or, past :data:`SAID_ONE_BY_ONE`, one ``(None, text)`` with the count, the first
    ones as examples and the command that lists them all."""
    if len(skipped) <= SAID_ONE_BY_ONE:
        return [(name, f"skipped checkpoint {name}: {why}") for name, why in skipped]
    examples = "; ".join(f"{name}: {why}" for name, why in skipped[:2])
    return [
        (
            None,
            f"skipped {len(skipped)} invalid checkpoints newer than the one used, e.g. "
            f"{examples}; ... ({len(skipped) - 2} more: guardrails inspect {root} lists "
            "each with why)",
        )
    ]


def problem(ckpt: Path) -> str | None:
    """Why ``ckpt``, found under a checkpoint root, would be skipped by a resume (a
    link, a byte that does not hash, a file's content), or ``None``: the one check
    every reader applies (resume, rewind's fallback, ``inspect``, ``report``)."""
    found = _problem(ckpt, entry=True)
    return None if found is None else found[1]


def pick(
    path: Path, prepare: Any = None, *, local: Path | None = None
) -> tuple[Path, Any, list[tuple[str, str]]]:
    """``(checkpoint, plan, skipped)``: ``path`` itself when it is a checkpoint, else the
    newest valid ``step_*`` under it or, with ``local`` (the node-local tier's
    directory), under either (the local copy first at the same step: ``tier.py``), and
    ``skipped``, each newer one passed over as ``(name, why)``. Valid: :func:`_problem`
    finds nothing and, with ``prepare``, ``prepare(ckpt)`` (its ``plan``) raises no
    ``CheckpointError``: a damaged file is damage wherever it is found, so the resume
    falls back past it. A ``ResumeError`` (intact, but it does not fit this run, or a
    newer format) stops the search: an older checkpoint would load the same mismatch,
    or silently lose the newest."""
    if os.path.lexists(path / MANIFEST) or (STEP_RE.match(path.name) and path.is_dir()):
        problem = _problem(path)
        if problem is not None:
            raise _corrupt(path, *problem)
        try:
            return path, None if prepare is None else prepare(path), []
        except CheckpointError as e:  # the hint is computed once, here: it verifies
            raise e.rehint(skip_hint(path)) from None  # the older checkpoints
    candidates = tier.candidates(path, local)
    if not candidates:
        raise ResumeError(
            f"no checkpoint under {path}: {_listing(path)}",
            path=str(path),
            hint="pass the run's checkpoint directory (the one holding step_* "
            "directories) or one step_* directory; check run_dir and the spelling.",
        )
    skipped: list[tuple[str, str]] = []
    for _, ckpt in resume_order(candidates):
        problem = _problem(ckpt, entry=True)
        if problem is not None:
            skipped.append((tier.label(ckpt, local), problem[1]))
            continue
        try:
            return ckpt, None if prepare is None else prepare(ckpt), skipped
        except CheckpointError as e:
            skipped.append((tier.label(ckpt, local), e.message))
    reasons = "; ".join(f"{n}: {w}" for n, w in skipped[:SAID_ONE_BY_ONE])
    if len(skipped) > SAID_ONE_BY_ONE:
        reasons += f"; ... {len(skipped) - SAID_ONE_BY_ONE} more (guardrails inspect {path})"
    raise ResumeError(
        f"every checkpoint under {path} is invalid ({len(skipped)}): {reasons}",
        path=str(path),
        hint="no intact checkpoint is left to resume from: restore the directory from "
        "a backup copy, or start the run from scratch (resume=None, or move these "
        "step_* directories away).",
        remedy="all_invalid",
    )


# ------------------------------------------------------------------ retention, cleanup


# ------------------------------------------------------------------ files and encoding
