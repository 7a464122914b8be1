"""The write side's second half: a staged checkpoint committed atomically (temp directory,
fsync, manifest last, one rename), the manifest's records, and retention.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from guardrails._errors import CheckpointError
from guardrails._version import __version__
from guardrails.checkpoint import sharded as _sharded
from guardrails.checkpoint.common import (
    _ASIDE_PREFIX,
    _TMP_PREFIX,
    _TRASH_PREFIX,
    _crash_point,
    _read_manifest,
    _write_bytes,
    log,
)

# The manifest and the checks of a checkpoint's files, torch-free (`inspect` uses them).
from guardrails.checkpoint.manifest import (
    ASIDE_RE,
    FAILURE,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    SELF_HASH,
    SEQ,
    _dumps,
    _self_hash,
    highest_seq,
    list_checkpoints,
    resume_order,
    run_of,
)
from guardrails.checkpoint.stage import (
    per_rank,
    stage_rank,
    stage_replicated,
    stems,
)
from guardrails.distributed import dist
from guardrails.util import files as _perms
from guardrails.util import storage
from guardrails.util.checks import check_scaler, named, path_like, positive_int, step_number


def begin(root: Path, step: int, token: str) -> Path:
    """The temporary directory a save of ``step`` writes into (every rank the same
    name, from the save's ``token``), created if missing."""
    tmp = root / f"{_TMP_PREFIX}step_{step}-{token}"
    _perms.make_dirs(tmp)
    return tmp


def commit(
    root: Path,
    step: int,
    tmp: Path,
    files: dict[str, Any],
    *,
    world_size: int,
    ranks: list[int],
    keep_last: int | None,
    delete_old: bool = True,
    contents: Mapping[str, Any] | None = None,
    run: Mapping[str, Any] | None = None,
    adopt_unlabelled: bool = False,
    seq: int | None = None,
    failure: Mapping[str, Any] | None = None,
) -> Path:
    """Seal ``tmp`` as ``root/step_<N>``: manifest last, fsync, one atomic rename.

    ``seq``: the save's sequence number (``manifest.SEQ``), from a writer that counts
    its saves; ``None``: one more than the highest under ``root`` (read now);
    ``failure``: a failure save's record (``manifest.FAILURE``). Called by rank 0 once
    every rank's files are in ``tmp`` (``files`` lists them all).
    ``contents``: which optimizers and schedulers the checkpoint holds, and where (see
    :func:`contents_of`); ``run``: the run's config and settings (:func:`run_record`)
    and its id: retention then counts only that run's checkpoints (and, with
    ``adopt_unlabelled``, those without a run id: the run resumed one of them).
    """
    final = root / f"step_{step:09d}"
    for name, rec in files.items():  # a rank that wrote to a disk rank 0 cannot see
        f = tmp / name
        if not f.is_file() or f.stat().st_size != rec["bytes"]:
            raise CheckpointError(
                f"{f} is missing or has the wrong size on rank 0 after its rank wrote it",
                step=step,
                path=str(f),
                hint="run_dir must be on a file system every rank sees (a shared disk); "
                "with node-local disks, point run_dir at shared storage.",
            )
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "step": step,
        "time": time.time(),
        "guardrails": __version__,
        "torch": torch.__version__,
        "world_size": world_size,
        "ranks": ranks,
        SEQ: highest_seq(root) + 1 if seq is None else seq,
        "contents": dict(contents or {}),
        **({"run": dict(run)} if run else {}),
        **({FAILURE: dict(failure)} if failure is not None else {}),
        "files": files,
    }
    # The manifest is the commit record of the files: written last, so its presence
    # means every file above was fully written and fsynced.
    manifest[SELF_HASH] = _self_hash(manifest)
    # Files safetensors and DCP created with their own mode (0o666 less the umask):
    # never group/other-writable once committed, even under umask 000.
    _perms.restrict_tree(tmp)
    _write_bytes(tmp / MANIFEST, _dumps(manifest), {})
    _perms.fsync_path(tmp)
    if final.exists():  # the same step saved again (a resumed run): replace it
        _replace(root, final, tmp)
    else:
        os.rename(tmp, final)
    _perms.fsync_path(root)
    if keep_last is not None:
        run_id = (run or {}).get("id")
        try:
            _retain(root, keep_last, delete=delete_old, run_id=run_id, adopt=adopt_unlabelled)
        except OSError as e:  # committed all the same: an old checkpoint stays, said once
            log.warning(
                "guardrails: checkpoint %s is committed, but older ones could not be removed "
                "(keep_last=%d): %s; they stay until a later save can. Fix: %s.",
                final,
                keep_last,
                e,
                storage.fix_for(e, root),
            )
    return final


def _replace(root: Path, final: Path, tmp: Path) -> None:
    """Replace the committed ``final`` by ``tmp`` (complete, manifest written) so that
    a kill at any point leaves one loadable copy of the step under a name resume reads:
    the old one renamed aside (``.aside-step_<N>``, which resume reads while
    ``step_<N>`` is missing), the new one renamed in, the aside deleted."""
    aside = root / f"{_ASIDE_PREFIX}{final.name}"
    if aside.exists():  # an older copy left by a kill after its re-save's second rename
        shutil.rmtree(aside)
    _crash_point("resave:before")
    os.rename(final, aside)
    _crash_point("resave:aside")
    try:
        os.rename(tmp, final)
    except BaseException:
        os.rename(aside, final)  # the old copy back under its name
        raise
    _crash_point("resave:swapped")
    _perms.fsync_path(root)
    shutil.rmtree(aside, ignore_errors=True)


def contents_of(
    optimizers: Mapping[str, Any], schedulers: Mapping[str, Any], per_rank_names: set[str]
) -> dict[str, Any]:
    """The manifest's ``contents``: each optimizer's file stem and whether every rank
    saved its own part, each scheduler's stem."""
    return {
        "optimizers": {
            name: {"file": stem, "per_rank": name in per_rank_names}
            for name, stem in stems("optimizer", list(optimizers)).items()
        },
        "schedulers": stems("scheduler", list(schedulers)),
        # Checked before anything is applied at resume: another class's state loads
        # half-way (AdamW's into SGD(momentum) was accepted, then the first step died
        # with KeyError 'momentum'; StepLR's into LambdaLR raised after the model and
        # optimizer were overwritten).
        "classes": {
            **{
                f"optimizer:{name}": type(per_rank(opt)).__name__
                for name, opt in optimizers.items()
            },
            **{f"scheduler:{name}": type(s).__name__ for name, s in schedulers.items()},
        },
    }


def run_record(config: Mapping[str, Any] | None, optimizers: Mapping[str, Any]) -> dict[str, Any]:
    """The manifest's ``run``, taken when the guard starts (before a resume overwrites
    anything): ``config``, the run's settings flattened to comparable values
    (:func:`config_values`), and ``optimizer_settings``, each optimizer's param-group
    settings as the code built them (:func:`optimizer_settings`). A resume compares
    both with this run's own: a re-run with another config is refused, and another
    optimizer setting is reported (``load_state_dict`` restores the checkpoint's).
    :func:`mark_finished` adds ``finished_at`` to the checkpoint a run ended with."""
    record: dict[str, Any] = {"optimizer_settings": optimizer_settings(optimizers)}
    if config is not None:
        record["config"] = config_values(config)
    return record


def config_values(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` flattened (nested mappings and dataclasses joined with ``.``), each
    value JSON as it will be read back: tuples as lists, paths as strings, and anything
    else as its ``repr`` without memory addresses (a function's ``<function f at
    0x7f...>`` differs in every process, and would read as a changed config)."""
    out: dict[str, Any] = {}

    def walk(value: Any, key: str) -> None:
        if isinstance(value, Mapping) and (value or not key):
            for k, v in value.items():
                walk(v, f"{key}.{k}" if key else str(k))
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            for f in dataclasses.fields(value):
                walk(getattr(value, f.name), f"{key}.{f.name}" if key else f.name)
        else:
            out[key] = _json_value(value)

    walk(config, "")
    return out


def optimizer_settings(optimizers: Mapping[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Each optimizer's param-group settings (``lr``, ``betas``, ``weight_decay``...,
    everything but the parameters), as JSON values, by optimizer name.

    ``lr`` is the group's ``initial_lr`` when a scheduler set one: a scheduler built
    with the optimizer moves ``lr`` at once (a warmup starts at a fraction of it), so
    the base is the setting the code chose."""
    out: dict[str, list[dict[str, Any]]] = {}
    for name, opt in optimizers.items():
        groups = []
        for group in per_rank(opt).param_groups:
            settings = {
                k: _json_value(v)
                for k, v in group.items()
                if k not in ("params", "param_names", "initial_lr")
            }
            if "initial_lr" in group:
                settings["lr"] = _json_value(group["initial_lr"])
            groups.append(settings)
        out[name] = groups
    return out


def _json_value(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Tensor) and value.numel() == 1:
        return value.item()  # a tensor lr (capturable): read once, when the guard starts
    if isinstance(value, np.generic):  # np.float64(0.1) is the 0.1 of a YAML file
        return value.item()
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, torch.dtype):
        return str(value).replace("torch.", "")
    return _ADDRESS.sub("", repr(value))


#: A memory address in a repr (``<function f at 0x7f3a...>``, ``<object object at ...>``).
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def write_error(
    final: Path,
    step: int,
    e: BaseException,
    *,
    latest: tuple[Path, int] | bool | None = True,
    run_dir: bool = True,
) -> CheckpointError:
    """The :class:`CheckpointError` of a save of ``step`` to ``final`` that failed with
    the storage error ``e``: the cause and the fix (free space, the permissions,
    another directory) and ``latest``, the checkpoint that stays the latest (``True``:
    the newest committed one under ``final``'s directory, looked up; ``None``: none;
    ``False``: not said, the caller says it). ``run_dir``: the fix names ``run_dir`` (a
    guard's save), else the directory."""
    root = final.parent
    if latest is True:
        latest = latest_committed(root)
    cause = storage.cause_of(e, root)
    text = f"could not write checkpoint {final}: {f'{cause}: ' if cause else ''}{e}"
    if latest:
        text += f"; the latest checkpoint is still {latest[0]} (step {latest[1]}), untouched"
    elif latest is None:
        text += f"; no earlier checkpoint exists under {root}"
    return CheckpointError(
        text,
        step=step,
        path=str(final),
        hint=storage.fix_for(e, root, run_dir=run_dir) + ".",
    )


def latest_committed(root: Path) -> tuple[Path, int] | None:
    """The newest committed checkpoint under ``root`` (it has a manifest; not
    verified) and its step, or ``None`` (also when ``root`` cannot be listed)."""
    try:
        for step, ckpt in resume_order(list_checkpoints(root)):
            if (ckpt / MANIFEST).is_file():
                return ckpt, step
    except OSError:
        pass
    return None


def mark_finished(ckpt: Path, when: float) -> None:
    """Record in ``ckpt``'s manifest that the run ended normally with it, at ``when``.

    The checkpoint a run ends with is not always written at its end: a periodic save
    at the last step is committed before the loop learns that the data ran out. So the
    mark is added afterwards: a new manifest (its ``manifest_sha256`` recomputed),
    fsynced, then renamed over the old one in one ``rename(2)``; a crash leaves the
    old manifest or the new, both valid, and the files they list are not touched."""
    manifest = _read_manifest(ckpt)
    manifest["run"] = {**(manifest.get("run") or {}), "finished_at": when}
    manifest.pop(SELF_HASH, None)
    manifest[SELF_HASH] = _self_hash(manifest)
    tmp = ckpt / f"{_TMP_PREFIX}{MANIFEST}-{uuid.uuid4().hex[:8]}"
    try:
        _write_bytes(tmp, _dumps(manifest), {})
        os.replace(tmp, ckpt / MANIFEST)
    finally:
        tmp.unlink(missing_ok=True)
    _perms.fsync_path(ckpt)


def _retain(
    root: Path,
    keep_last: int,
    *,
    delete: bool = True,
    run_id: str | None = None,
    adopt: bool = False,
) -> None:
    """Retire all but the newest ``keep_last`` committed checkpoints (those with a
    manifest; directories without one are left for a person to inspect and never count
    as kept). Retiring is a rename to ``.trash-*`` (atomic: a crash never leaves a
    half-deleted ``step_*``); ``delete=False`` leaves the deleting to the next save, so
    a save racing a SIGKILL is not slowed by it (deleting 3 files took ~30 ms here).

    With ``run_id``, only that run's checkpoints count (and are retired), plus, with
    ``adopt``, those that carry no run id; another run's are never touched: a fresh run
    beside them had its own lower steps deleted as they were written.

    Committed, not verified: re-hashing every kept checkpoint at every save would read
    them all again (seconds per GB); a checkpoint corrupted later is found by resume,
    which verifies what it loads and falls back to the previous one.
    """
    committed = [p for _, p in list_checkpoints(root) if (p / MANIFEST).is_file()]
    if run_id is not None:
        committed = [p for p in committed if run_of(p) in ((run_id, None) if adopt else (run_id,))]
    for p in committed[:-keep_last]:
        trash = to_trash(p)
        if delete:
            shutil.rmtree(trash, ignore_errors=True)
        log.debug("guardrails: retention retired %s (keep_last=%d)", p, keep_last)
    _perms.fsync_path(root)


def save_error(final: Path, step: int, e: BaseException) -> BaseException:
    """A storage error of a save as :func:`write_error`'s :class:`CheckpointError`, the
    latest checkpoint not said (the checkpointer, which knows this run's, says it);
    anything else as it is."""
    if storage.is_storage_error(e):
        return write_error(final, step, e, latest=False)
    return e


def discard(tmp: Path, *, trash: bool) -> None:
    """A temp directory of a save that failed: deleted, or, for a save abandoned by a
    stop (``trash``), renamed into the trash for the next start to delete."""
    if trash:
        with contextlib.suppress(OSError):
            to_trash(tmp)
            return
    shutil.rmtree(tmp, ignore_errors=True)


def to_trash(path: Path) -> Path:
    """Rename a directory to ``.trash-*`` beside it (atomic: a crash never leaves it
    half-deleted, and its name tells every later look that it is garbage), for
    :func:`empty_trash` or :func:`remove_leftovers` to delete; the new path. An
    ``OSError`` when it cannot be renamed."""
    trash = path.with_name(f"{_TRASH_PREFIX}{path.name}-{uuid.uuid4().hex[:8]}")
    os.rename(path, trash)
    return trash


def empty_trash(root: Path) -> threading.Thread:
    """Delete every ``.trash-*`` directory under ``root`` (retired checkpoints, saves a
    stop abandoned) in a daemon thread, which it returns. Deleting is not free:
    deleting a retired 10 GB checkpoint took 2-3.5 s on the H200 hosts' disks, spent
    by the checkpoint writer before it was free for the next save or for a stop's (a
    file's deletion waits for the writes in flight to it)."""

    def empty() -> None:
        with contextlib.suppress(OSError):
            for p in root.iterdir():
                if p.name.startswith(_TRASH_PREFIX) and p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)

    thread = threading.Thread(target=empty, name="guardrails-empty-trash", daemon=True)
    thread.start()
    return thread


def settle_asides(root: Path) -> None:
    """A re-save cut between its renames left its old copy aside: put it back under
    its ``step_*`` name (it is that step's checkpoint), or delete it when the new copy
    made it in."""
    for p in root.iterdir():
        aside = ASIDE_RE.match(p.name)
        if aside and p.is_dir():
            final = root / aside.group(1)
            if final.exists():
                shutil.rmtree(p, ignore_errors=True)
            else:
                log.info("guardrails: %s is back as %s (its re-save was interrupted)", p, final)
                os.rename(p, final)


def remove_leftovers(root: Path, keep: str | None = None) -> None:
    """Remove temp and trash dirs of interrupted saves (except one whose name holds
    ``keep``, the token of a save in progress), and settle a re-save cut between its
    renames: its old copy, renamed aside, goes back under its ``step_*`` name (it is
    that step's checkpoint), or is deleted when the new copy made it in."""
    settle_asides(root)
    for p in root.iterdir():
        if keep is not None and keep in p.name:
            continue
        if p.is_dir() and p.name.startswith((_TMP_PREFIX, _TRASH_PREFIX)):
            log.info("guardrails: removing %s left by an interrupted save", p)
            shutil.rmtree(p, ignore_errors=True)


def save_checkpoint(
    root: str | os.PathLike[str],
    step: int,
    *,
    model: nn.Module,
    optimizer: Any,
    scheduler: Any = None,
    scaler: Any = None,
    extras: Mapping[str, Any] | None = None,
    keep_last: int | None = None,
) -> Path:
    """Write a complete checkpoint of ``step`` to ``root/step_<N:09d>/``, atomically.

    Args:
        root: the run's checkpoint directory (created if missing).
        step: the optimizer step this state is *after*; also the directory name.
        model: its ``state_dict()`` goes to ``model.safetensors``.
        optimizer: its ``state_dict()`` goes to ``optimizer.safetensors`` + ``.json``
            (``None``: no optimizer state is saved); several as a list or a dict by
            name go to ``optimizer.<name>.*``.
        scheduler: an LR scheduler (anything with ``state_dict()``), optional; or
            several, like ``optimizer``.
        scaler: a ``torch.amp.GradScaler``, optional.
        extras: the caller's own state (``{"best_val": 1.92, "epoch": 3}``): numbers,
            strings, booleans, ``None``, lists, dicts and tensors (restored bitwise, with
            their dtype, on the device they were saved from); a ``TypeError`` says which
            key holds anything else.
        keep_last: after committing, delete all but the newest ``keep_last`` valid
            checkpoints under ``root`` (``None``: keep everything).

    Returns:
        The committed directory. In a distributed run only rank 0 writes (the
        replicated state and its own RNG streams) and the others return the path rank
        0 writes; a guard's checkpoints (``g.save_checkpoint()``, periodic and signal
        saves) also hold every rank's RNG streams and data position.

    Raises:
        CheckpointError: the write failed (a full disk, a read-only file system,
            permissions): the message names the cause and the latest checkpoint left,
            its ``hint`` the fix; the previous checkpoints are intact and the partial
            temp dir is removed.
        TypeError: ``model`` is not a module (``None``): resume() could not load a
            checkpoint without one.
    """
    step = _checked_arguments(root, step, model, scaler, extras, keep_last)
    root = Path(root)
    final = root / f"step_{step:09d}"
    optimizers, schedulers = _rank0_state(model, optimizer, scheduler)
    rank = dist.rank()
    if rank != 0:
        return final
    t0 = time.perf_counter()
    part = stage_replicated(
        model=model,
        optimizers=optimizers,
        schedulers=schedulers,
        scaler=scaler,
        extras=extras,
        copy=False,
    )
    stage_rank(0, part=part)
    part.ready()
    contents = contents_of(optimizers, schedulers, set())
    final = _write_and_commit(root, step, final, part, contents=contents, keep_last=keep_last)
    log.info(
        "guardrails: checkpoint step %d committed to %s (%.1f MB in %.2f s)",
        step,
        final,
        part.nbytes / 1e6,
        time.perf_counter() - t0,
    )
    return final


def _checked_arguments(
    root: Any, step: Any, model: Any, scaler: Any, extras: Any, keep_last: Any
) -> int:
    """Every argument of :func:`save_checkpoint` checked before anything is written;
    the step as an int."""
    # A str step failed deep in the listing, a float one in the directory name, and
    # step=True wrote step 1.
    path_like("save_checkpoint(root=...)", root)
    step = step_number("save_checkpoint(step=...)", step)
    positive_int("save_checkpoint(keep_last=...)", keep_last, allow_none=True)
    if scaler is not None:
        check_scaler("save_checkpoint(scaler=...)", scaler)
    if extras is not None and not isinstance(extras, Mapping):
        raise TypeError(
            "save_checkpoint(extras=...) takes a dict of your own state ({'best_val': 1.9}), "
            f"got {type(extras).__name__}"
        )
    if not isinstance(model, nn.Module):
        # resume() always loads a model: a checkpoint without one could never be
        # resumed, and that would only be found at the restart that needs it.
        raise TypeError(
            f"save_checkpoint() needs the model (an nn.Module), got {type(model).__name__}: "
            "resume() loads a checkpoint into a model, so a checkpoint without one could "
            "not be resumed. Pass model=your_model."
        )
    return step


def _rank0_state(
    model: nn.Module, optimizer: Any, scheduler: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The optimizers and schedulers by name; refused where rank 0's copy is not the
    whole state (a ZeRO optimizer's shards, a sharded model)."""
    optimizers = (
        {}
        if optimizer is None
        else named("optimizer", optimizer, torch.optim.Optimizer, where="save_checkpoint()")
    )
    schedulers = (
        {}
        if scheduler is None
        else named("scheduler", scheduler, object, where="save_checkpoint()")
    )
    if dist.world_size() > 1 and any(per_rank(o) is not o for o in optimizers.values()):
        raise ValueError(
            "save_checkpoint() writes rank 0's copy of the state, but a "
            "ZeroRedundancyOptimizer holds a different shard on every rank. Save with "
            "the guard instead (g.save_checkpoint(), periodic or signal saves): every "
            "rank writes its own part."
        )
    if _sharded.is_sharded(model):
        # Every rank raises (rank 0 alone used to, deep in staging: "invalid python
        # storage", while the other ranks went on as if it had saved).
        raise ValueError(
            "save_checkpoint() writes rank 0's copy of the state, but this model's "
            "parameters are sharded (FSDP2 fully_shard / DTensor): each rank holds a "
            "different shard. Save with the guard instead (g.save_checkpoint(), periodic "
            "or signal saves): every rank writes its shards through "
            "torch.distributed.checkpoint."
        )
    return optimizers, schedulers


def _write_and_commit(
    root: Path,
    step: int,
    final: Path,
    part: Any,
    *,
    contents: dict[str, Any],
    keep_last: int | None,
) -> Path:
    """The staged part written to a temp dir and committed as ``final``; a storage
    error removes the temp dir and is told in the user's terms."""
    tmp: Path | None = None
    files: dict[str, dict[str, Any]] = {}
    try:
        _perms.make_dirs(root)
        remove_leftovers(root)
        tmp = begin(root, step, uuid.uuid4().hex[:8])
        part.write(tmp, files)
        return commit(
            root,
            step,
            tmp,
            files,
            world_size=dist.world_size(),
            ranks=[0],
            keep_last=keep_last,
            contents=contents,
        )
    except BaseException as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if not storage.is_storage_error(e):
            raise
        raise write_error(final, step, e, run_dir=False) from e
