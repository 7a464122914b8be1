"""Checkpoints that are complete, atomic and verified, and the exact resume that reads them.

Seed 003 ("Can't reproduce / resume") lists what a resumed run silently loses: the
optimizer moments, the LR schedule position, the loss scale, the RNG streams (so dropout
and shuffling differ), and, worst, the checkpoint itself when the job was killed halfway
through ``torch.save``. This module is part 1 of issue 4: the on-disk format, the atomic
commit, checksum verification, retention and :func:`resume`. Signals, periodic and
background saves and the data-loader position are part 2.

The format (``format_version`` 1), one directory per committed step::

    root/
      step_000001200/
        model.safetensors       model.state_dict(); each storage once, tied keys recorded
                                as aliases in the header metadata ("guardrails.aliases")
        optimizer.safetensors   every tensor of optimizer.state_dict()["state"],
                                keyed "<param_idx>.<name>" (e.g. "3.exp_avg")
        optimizer.json          param_groups and the non-tensor state, tensors referenced
                                as {"__tensor__": "3.exp_avg"}
        scheduler.json          scheduler.state_dict() (scheduler.pt when not JSON-able)
        scaler.json             GradScaler.state_dict()
        rng.json                python random and numpy states
        rng.safetensors         torch CPU generator, CUDA generator per device
        extras.json             the caller's extras (JSON values only)
        manifest.json           written LAST: bytes and sha256 of every file above, step,
                                time, versions, world size and rank
      step_000001300/ ...

Why a crash at any instant leaves the previous checkpoint loadable. A save writes into
``root/.tmp-step_<N>-<uuid>/``, a name no reader ever picks (readers only look at
``step_*``). Every file is fsynced, the manifest last, then the directory is fsynced and
renamed to ``step_<N>`` in one ``rename(2)``, which POSIX makes atomic within a file
system, and the parent directory is fsynced so the rename itself survives a power loss.
So at every instant ``step_<N>`` either does not exist or is complete:

* killed while writing files: only the ``.tmp-*`` directory is partial; the next save
  removes it; the previous ``step_*`` directories were never touched;
* killed between the rename and the parent fsync: after a process kill the rename is
  already visible; after a power loss either name may survive, both complete;
* killed during retention: old checkpoints are first renamed to ``.trash-*`` (atomic),
  then deleted, so a half-deleted one never carries a ``step_*`` name; the newest valid
  checkpoint is never deleted.

Readers trust nothing: a checkpoint counts as valid only when ``manifest.json`` parses
and every file it lists has the recorded size and sha256. Resuming from a run directory
takes the newest valid one and logs why each newer one was skipped (a disk that filled
up, a bit flip in transit, a truncated copy). Everything is checked (checksums, then key
names and shapes against the model and optimizer) before anything is loaded, so a
``CheckpointError`` or ``ResumeError`` leaves the model exactly as it was.

Distributed runs: in this part rank 0 writes everything, which is complete for replicated
state (DDP, where every rank holds the same weights and optimizer state); other ranks
return without writing. Per-rank files (per-rank RNG, data position), the cross-rank
agreement on the step and sharded (FSDP/DTensor) state come in part 2.

Only one process may save into a ``root`` at a time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from guardrails import _dist
from guardrails._errors import CheckpointError, ResumeError
from guardrails._text import shorten
from guardrails._version import __version__

log = logging.getLogger("guardrails")

FORMAT = "guardrails-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
STEP_RE = re.compile(r"^step_(\d+)$")
_TMP_PREFIX = ".tmp-"
_TRASH_PREFIX = ".trash-"
#: Header metadata key of a .safetensors file that maps alias key -> stored key.
ALIASES_KEY = "guardrails.aliases"
#: Hashing and fsync read in 8 MiB chunks: large enough to run at disk speed, small
#: enough to keep a multi-GB checkpoint out of memory while verifying it.
_CHUNK = 8 << 20
#: Optimizer states that are elementwise copies of their parameter's shape, so a shape
#: mismatch is a certain sign of a different model. (Factored states such as
#: Adafactor's row/column statistics legitimately differ and are not checked.)
_ELEMENTWISE_STATE = frozenset(
    {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "sum"}
    | {"acc_delta", "grad_avg", "prev", "ax", "mu_product"}
)


# ----------------------------------------------------------------------------- save


def save_checkpoint(
    root: str | os.PathLike[str],
    step: int,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
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
            (``None``: no optimizer state is saved).
        scheduler: an LR scheduler (anything with ``state_dict()``), optional.
        scaler: a ``torch.amp.GradScaler``, optional.
        extras: the caller's own state (``{"best_val": 1.92, "epoch": 3}``); JSON values
            only, a ``TypeError`` says which key is not.
        keep_last: after committing, delete all but the newest ``keep_last`` valid
            checkpoints under ``root`` (``None``: keep everything).

    Returns:
        The committed directory. On ranks other than 0 nothing is written and the path
        rank 0 writes is returned (replicated state; per-rank files are part 2).

    Raises:
        CheckpointError: the write failed (disk full, permissions); the previous
            checkpoints are intact and the partial temp dir is removed.
    """
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    root = Path(root)
    final = root / f"step_{step:09d}"
    rank = _dist.rank()
    if rank != 0:
        return final
    # Serialize the caller's values first: a TypeError for a bad extra must come before
    # any file is touched.
    extras_json = _dumps(_encode(dict(extras or {}), "extras"))

    t0 = time.perf_counter()
    root.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(root)
    tmp = root / f"{_TMP_PREFIX}step_{step}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    files: dict[str, dict[str, Any]] = {}
    try:
        _write_tensors(tmp / "model.safetensors", model.state_dict(), files)
        if optimizer is not None:
            _save_optimizer(tmp, optimizer.state_dict(), files)
        if scheduler is not None:
            _save_scheduler(tmp, scheduler.state_dict(), files)
        if scaler is not None:
            _write_json(tmp / "scaler.json", _encode(scaler.state_dict(), "scaler"), files)
        _save_rng(tmp, files)
        _write_bytes(tmp / "extras.json", extras_json, files)
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "step": step,
            "time": time.time(),
            "guardrails": __version__,
            "torch": torch.__version__,
            "world_size": _dist.world_size(),
            "rank": rank,
            "files": files,
        }
        # The manifest is the commit record of the files: written last, so its presence
        # means every file above was fully written and fsynced.
        _write_bytes(tmp / MANIFEST, _dumps(manifest), {})
        _fsync_dir(tmp)
        if final.exists():  # the same step saved again (a resumed run): replace it
            trash = root / f"{_TRASH_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"
            os.rename(final, trash)
            os.rename(tmp, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.rename(tmp, final)
        _fsync_dir(root)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(e, OSError):
            raise
        raise CheckpointError(
            f"could not write checkpoint {final}: {e}",
            step=step,
            path=str(final),
            hint="check free space and permissions of the checkpoint directory; the "
            "previous checkpoints under it are untouched.",
        ) from e
    total = sum(f["bytes"] for f in files.values())
    log.info(
        "guardrails: checkpoint step %d committed to %s (%.1f MB in %.2f s)",
        step,
        final,
        total / 1e6,
        time.perf_counter() - t0,
    )
    if keep_last is not None:
        _retain(root, keep_last)
    return final


def _save_optimizer(tmp: Path, sd: Mapping[str, Any], files: dict[str, Any]) -> None:
    tensors: dict[str, Tensor] = {}
    state = {str(idx): _encode(s, str(idx), tensors) for idx, s in sd["state"].items()}
    groups = _encode(list(sd["param_groups"]), "param_groups", tensors)
    _write_tensors(tmp / "optimizer.safetensors", tensors, files)
    _write_json(tmp / "optimizer.json", {"state": state, "param_groups": groups}, files)


def _save_scheduler(tmp: Path, sd: Mapping[str, Any], files: dict[str, Any]) -> None:
    try:
        _write_json(tmp / "scheduler.json", _encode(dict(sd), "scheduler"), files)
    except TypeError as e:
        # Schedulers with tensors or non-string keys in their state (rare, e.g. a custom
        # one) are not JSON; torch.save keeps them exact. resume() reads this file with
        # weights_only=True, so it can hold containers and tensors but never code.
        log.debug("guardrails: scheduler state is not JSON (%s); using scheduler.pt", e)
        torch.save(dict(sd), tmp / "scheduler.pt")
        _seal(tmp / "scheduler.pt", files)


def _save_rng(tmp: Path, files: dict[str, Any]) -> None:
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    states = {
        "python": [version, list(internal), gauss],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
    }
    tensors = {"torch.cpu": torch.get_rng_state()}
    # Only when CUDA is already initialized: reading the CUDA generators would otherwise
    # create a context on every device (seconds, and memory on each GPU) just to save a
    # state that nothing has drawn from.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch.cuda.{i}"] = s
    _write_json(tmp / "rng.json", states, files)
    _write_tensors(tmp / "rng.safetensors", tensors, files)


# --------------------------------------------------------------------------- resume


def resume(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    scheduler: Any = None,
    scaler: Any = None,
    strict: bool = True,
) -> dict[str, Any]:
    """Restore model, optimizer, scheduler, scaler and every RNG from a checkpoint.

    Args:
        path: a run's checkpoint root (the newest *valid* ``step_*`` under it is used;
            newer invalid ones are skipped with a warning saying why) or one exact
            ``step_*`` directory.
        model, optimizer, scheduler, scaler: restored in place; each one passed must
            have state in the checkpoint.
        strict: ``True`` (default): the model's keys must match the checkpoint's exactly.
            ``False``: missing and unexpected keys are allowed (loading a backbone into
            a model with a new head); shape mismatches are always an error, and a
            component passed without state in the checkpoint is left as it is.

    Returns:
        ``{"step": int, "extras": dict, "path": str}``: continue training at
        ``step + 1``.

    Raises:
        CheckpointError: no checkpoint there, or it is truncated / corrupt (the message
            names the file and the previous valid checkpoint).
        ResumeError: the checkpoint is intact but does not fit this model / optimizer
            (the message lists the keys); nothing was modified.
    """
    ckpt = _pick(Path(path))
    manifest = _read_manifest(ckpt)
    step = int(manifest["step"])
    files = manifest["files"]

    # 1. Read everything and check it against the live objects; nothing is modified yet.
    model_sd = _read_tensors(ckpt / "model.safetensors")
    _check_model(ckpt, step, model, model_sd, strict)
    opt_sd = None
    if optimizer is not None:
        if "optimizer.json" in files:
            opt_sd = _load_optimizer(ckpt)
            _check_optimizer(ckpt, step, optimizer, opt_sd)
        elif strict:
            raise _missing(ckpt, step, "optimizer")
    sched_sd = (
        None if scheduler is None else _component_state(ckpt, step, files, "scheduler", strict)
    )
    scaler_sd = None if scaler is None else _component_state(ckpt, step, files, "scaler", strict)
    rng = _read_json(ckpt / "rng.json") if "rng.json" in files else None
    rng_tensors = _read_tensors(ckpt / "rng.safetensors") if "rng.safetensors" in files else {}
    extras = _decode(_read_json(ckpt / "extras.json")) if "extras.json" in files else {}

    # 2. Apply. Every check that can fail on a mismatch ran above.
    model.load_state_dict(model_sd, strict=strict)
    if opt_sd is not None:
        optimizer.load_state_dict(opt_sd)  # type: ignore[union-attr]
    if sched_sd is not None:
        scheduler.load_state_dict(sched_sd)
    if scaler_sd is not None:
        scaler.load_state_dict(scaler_sd)
    _restore_rng(rng, rng_tensors)
    log.info("guardrails: resumed from %s (step %d)", ckpt, step)
    return {"step": step, "extras": extras, "path": str(ckpt)}


#: The module-level name for symmetry with :func:`save_checkpoint`.
load_checkpoint = resume


def verify_checkpoint(ckpt: str | os.PathLike[str]) -> str | None:
    """``None`` when ``ckpt`` is a valid checkpoint, else why not (one line, naming the
    file). Reads every byte once (sha256)."""
    problem = _problem(Path(ckpt))
    return None if problem is None else problem[1]


def _problem(ckpt: Path) -> tuple[str, str] | None:
    """``(file, why)`` for the first problem found in ``ckpt``, or ``None``."""
    try:
        manifest = _read_manifest(ckpt)
    except CheckpointError as e:
        return str(e.path), e.message
    for name, rec in manifest["files"].items():
        f = ckpt / name
        if not f.is_file():
            return str(f), f"{f} is missing"
        size = f.stat().st_size
        if size != rec["bytes"]:
            why = f"{f} is truncated or overwritten: {size} bytes, the manifest says {rec['bytes']}"
            return str(f), why
        if _sha256(f) != rec["sha256"]:
            return str(f), f"{f} is corrupt: its sha256 does not match the manifest"
    return None


def list_checkpoints(root: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """``(step, dir)`` of every ``step_*`` directory under ``root``, oldest first,
    valid or not (temp and trash dirs of unfinished saves are never listed)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = STEP_RE.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found)


def _pick(path: Path) -> Path:
    """The checkpoint directory to load: ``path`` itself when it is one, else the newest
    valid ``step_*`` under it."""
    if (path / MANIFEST).exists() or (STEP_RE.match(path.name) and path.is_dir()):
        problem = _problem(path)
        if problem is None:
            return path
        raise _corrupt(path, *problem)
    candidates = list_checkpoints(path)
    if not candidates:
        raise CheckpointError(
            f"no checkpoint under {path}: {_listing(path)}",
            path=str(path),
            hint="pass the run's checkpoint directory (the one holding step_* "
            "directories) or one step_* directory; check run_dir and the spelling.",
        )
    skipped = []
    for _, ckpt in reversed(candidates):
        why = verify_checkpoint(ckpt)
        if why is None:
            for name, reason in skipped:
                log.warning("guardrails: skipped checkpoint %s: %s; using %s", name, reason, ckpt)
            return ckpt
        skipped.append((ckpt.name, why))
    reasons = "; ".join(f"{n}: {w}" for n, w in skipped)
    raise CheckpointError(
        f"every checkpoint under {path} is invalid ({len(skipped)}): {reasons}",
        path=str(path),
        hint="no intact checkpoint is left to resume from: restore the directory from "
        "a backup copy, or start the run from scratch.",
    )


def _corrupt(ckpt: Path, bad_file: str, why: str) -> CheckpointError:
    previous = None
    for _, p in reversed(list_checkpoints(ckpt.parent)):
        if p.name < ckpt.name and verify_checkpoint(p) is None:
            previous = p
            break
    if previous is not None:
        hint = f"resume from the previous valid checkpoint instead: {previous}"
    else:
        hint = "no earlier valid checkpoint exists next to it: restore it from a backup."
    return CheckpointError(
        f"checkpoint {ckpt} is not valid: {why}",
        path=bad_file,
        hint=hint,
    )


def _read_manifest(ckpt: Path) -> dict[str, Any]:
    f = ckpt / MANIFEST
    if not f.is_file():
        raise CheckpointError(
            f"{f} is missing: the save that wrote {ckpt.name} did not finish",
            path=str(f),
        )
    try:
        manifest = json.loads(f.read_text())
        files = manifest["files"]
        fmt, version = manifest["format"], int(manifest["format_version"])
        int(manifest["step"])
        if not isinstance(files, dict):
            raise TypeError("files is not a mapping")
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{f} is corrupt: {e}", path=str(f)) from e
    if fmt != FORMAT:
        raise CheckpointError(f"{f} is not a guardrails checkpoint manifest", path=str(f))
    if version > FORMAT_VERSION:
        raise ResumeError(
            f"{ckpt} has checkpoint format {version}; this guardrails ({__version__}) "
            f"reads up to format {FORMAT_VERSION}",
            path=str(ckpt),
            hint=f"upgrade guardrails to the version that wrote it ({manifest.get('guardrails')}).",
        )
    return manifest


def _check_model(
    ckpt: Path, step: int, model: nn.Module, saved: Mapping[str, Tensor], strict: bool
) -> None:
    live = model.state_dict()
    missing = [k for k in live if k not in saved]
    unexpected = [k for k in saved if k not in live]
    shapes = [
        f"{k}: checkpoint {tuple(saved[k].shape)} vs model {tuple(v.shape)}"
        for k, v in live.items()
        if k in saved and isinstance(v, Tensor) and tuple(saved[k].shape) != tuple(v.shape)
    ]
    problems = []
    if shapes:
        problems.append(f"shape mismatch ({len(shapes)}): {_short(shapes)}")
    if strict and missing:
        problems.append(f"in the model but not the checkpoint ({len(missing)}): {_short(missing)}")
    if strict and unexpected:
        problems.append(
            f"in the checkpoint but not the model ({len(unexpected)}): {_short(unexpected)}"
        )
    if problems:
        raise ResumeError(
            f"checkpoint {ckpt} does not fit this model; " + "; ".join(problems),
            step=step,
            path=str(ckpt),
            hint="build the model with the same architecture and config that was saved "
            "(width, depth, vocab size, wrappers such as DDP or torch.compile add a "
            "'module.' / '_orig_mod.' prefix); to load only the matching part, e.g. a "
            "backbone under a new head, pass strict=False. The model was not modified.",
        )


def _check_optimizer(
    ckpt: Path, step: int, optimizer: torch.optim.Optimizer, saved: Mapping[str, Any]
) -> None:
    groups = optimizer.param_groups
    saved_groups = saved["param_groups"]
    problems = []
    if len(groups) != len(saved_groups):
        problems.append(f"{len(saved_groups)} param groups saved, {len(groups)} now")
    else:
        for i, (g, s) in enumerate(zip(groups, saved_groups, strict=True)):
            if len(g["params"]) != len(s["params"]):
                problems.append(
                    f"group {i}: {len(s['params'])} parameters saved, {len(g['params'])} now"
                )
    if not problems:
        params = [p for g in groups for p in g["params"]]
        ids = [i for s in saved_groups for i in s["params"]]
        for idx, p in zip(ids, params, strict=True):
            for name, v in saved["state"].get(idx, {}).items():
                if name in _ELEMENTWISE_STATE and isinstance(v, Tensor) and v.shape != p.shape:
                    problems.append(
                        f"param {idx} {name}: checkpoint {tuple(v.shape)} vs "
                        f"parameter {tuple(p.shape)}"
                    )
    if problems:
        raise ResumeError(
            f"checkpoint {ckpt} optimizer state does not fit this optimizer; " + _short(problems),
            step=step,
            path=str(ckpt),
            hint="build the optimizer over the same parameters, in the same order and "
            "param groups, as the run that saved it; to restart the optimizer from "
            "scratch, pass optimizer=None. Nothing was modified.",
        )


def _component_state(
    ckpt: Path, step: int, files: Mapping[str, Any], name: str, strict: bool
) -> Any:
    """The saved state_dict of an optional component (``scheduler``, ``scaler``): its
    ``<name>.json``, or ``<name>.pt`` when it was not JSON-able; ``None`` if absent and
    not ``strict``."""
    if f"{name}.json" in files:
        return _decode(_read_json(ckpt / f"{name}.json"))
    if f"{name}.pt" in files:
        return torch.load(ckpt / f"{name}.pt", weights_only=True)
    if strict:
        raise _missing(ckpt, step, name)
    return None


def _missing(ckpt: Path, step: int, what: str) -> ResumeError:
    return ResumeError(
        f"checkpoint {ckpt} holds no {what} state, but a {what} was passed to resume()",
        step=step,
        path=str(ckpt),
        hint=f"pass {what}=None to keep this {what} as it is, or strict=False to skip "
        "what the checkpoint lacks. Nothing was modified.",
    )


def _load_optimizer(ckpt: Path) -> dict[str, Any]:
    tensors = _read_tensors(ckpt / "optimizer.safetensors")
    raw = _read_json(ckpt / "optimizer.json")
    state = {int(k): _decode(v, tensors) for k, v in raw["state"].items()}
    return {"state": state, "param_groups": _decode(raw["param_groups"], tensors)}


def _restore_rng(states: Mapping[str, Any] | None, tensors: Mapping[str, Tensor]) -> None:
    if states is not None:
        version, internal, gauss = states["python"]
        random.setstate((version, tuple(internal), gauss))
        kind, keys, pos, has_gauss, cached = states["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "torch.cpu" in tensors:
        torch.set_rng_state(tensors["torch.cpu"])
    cuda = [tensors[k] for k in sorted(tensors, key=_natural) if k.startswith("torch.cuda.")]
    if cuda:
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n != len(cuda):
            log.warning(
                "guardrails: the checkpoint holds CUDA RNG states for %d devices, this "
                "process sees %d; restoring the first %d (dropout on the others differs)",
                len(cuda),
                n,
                min(n, len(cuda)),
            )
        for i, s in enumerate(cuda[:n]):
            torch.cuda.set_rng_state(s, i)


# ------------------------------------------------------------------ retention, cleanup


def _retain(root: Path, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` valid checkpoints. Invalid ``step_*``
    directories are left for a person to inspect (and are never counted as kept)."""
    valid = [p for _, p in list_checkpoints(root) if verify_checkpoint(p) is None]
    for p in valid[:-keep_last]:
        trash = root / f"{_TRASH_PREFIX}{p.name}-{uuid.uuid4().hex[:8]}"
        os.rename(p, trash)  # atomic: a crash mid-delete never leaves a partial step_*
        shutil.rmtree(trash, ignore_errors=True)
        log.debug("guardrails: retention removed %s (keep_last=%d)", p, keep_last)
    _fsync_dir(root)


def _remove_leftovers(root: Path) -> None:
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith((_TMP_PREFIX, _TRASH_PREFIX)):
            log.info("guardrails: removing %s left by an interrupted save", p)
            shutil.rmtree(p, ignore_errors=True)


# ------------------------------------------------------------------ files and encoding


def _write_tensors(path: Path, tensors: Mapping[str, Any], files: dict[str, Any]) -> None:
    """Save ``tensors`` to safetensors, storing each shared storage once.

    safetensors refuses tensors that share memory (tied embeddings: ``lm_head.weight``
    *is* ``embed.weight``). The same view under two keys is stored once and the other
    key recorded as an alias; different views of one storage are copied apart.
    """
    unique: dict[str, Tensor] = {}
    aliases: dict[str, str] = {}
    by_view: dict[tuple[Any, ...], str] = {}
    storages: set[int] = set()
    for key, value in tensors.items():
        if not isinstance(value, Tensor):
            raise TypeError(
                f"{path.name}: {key!r} is a {type(value).__name__}, not a tensor; "
                "guardrails checkpoints hold tensors here (get_extra_state() objects "
                "are not supported yet)"
            )
        t = value.detach()
        if t.device.type != "cpu":
            t = t.to("cpu")
        ptr = t.untyped_storage().data_ptr() if t.numel() else 0
        view = (ptr, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if ptr and view in by_view:
            aliases[key] = by_view[view]
            continue
        if ptr and ptr in storages:
            t = t.clone()
        elif not t.is_contiguous():
            t = t.contiguous()
        if ptr:
            by_view[view] = key
            storages.add(ptr)
        unique[key] = t
    save_file(unique, str(path), metadata={ALIASES_KEY: json.dumps(aliases)})
    _seal(path, files)


def _read_tensors(path: Path) -> dict[str, Tensor]:
    """Inverse of :func:`_write_tensors`: aliases point at the same tensor again."""
    out: dict[str, Tensor] = {}
    with safe_open(str(path), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            out[key] = f.get_tensor(key)
        aliases = json.loads((f.metadata() or {}).get(ALIASES_KEY, "{}"))
    for alias, key in aliases.items():
        out[alias] = out[key]
    return out


def _write_json(path: Path, obj: Any, files: dict[str, Any]) -> None:
    _write_bytes(path, _dumps(obj), files)


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def _dumps(obj: Any) -> bytes:
    # allow_nan: a scheduler's best=inf must round-trip exactly; these files are read
    # back by Python's json, which reads Infinity/NaN.
    return json.dumps(obj, indent=1, allow_nan=True).encode()


def _write_bytes(path: Path, data: bytes, files: dict[str, Any]) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    files[path.name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _seal(path: Path, files: dict[str, Any]) -> None:
    """fsync a file written by someone else (safetensors, torch.save) and record its
    size and sha256, reading it back once in chunks."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb+") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
        os.fsync(f.fileno())
    files[path.name] = {"bytes": size, "sha256": h.hexdigest()}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _encode(obj: Any, where: str, tensors: dict[str, Tensor] | None = None) -> Any:
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
        return {"__tuple__": [_encode(v, f"{where}.{i}", tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, f"{where}.{i}", tensors) for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        bad = [k for k in obj if not isinstance(k, str)]
        if bad:
            raise TypeError(f"{where} has a non-string key {bad[0]!r}; JSON keys are strings")
        return {k: _encode(v, f"{where}.{k}", tensors) for k, v in obj.items()}
    raise TypeError(
        f"{where} is a {type(obj).__name__}, which a checkpoint cannot store as JSON: use "
        "numbers, strings, booleans, None, lists and dicts (a tensor: .item() or "
        ".tolist(); a numpy value: .item())"
    )


def _decode(obj: Any, tensors: Mapping[str, Tensor] | None = None) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if isinstance(obj, dict):
        if set(obj) == {"__tuple__"}:
            return tuple(_decode(v, tensors) for v in obj["__tuple__"])
        if set(obj) == {"__tensor__"} and tensors is not None:
            return tensors[obj["__tensor__"]]
        return {k: _decode(v, tensors) for k, v in obj.items()}
    return obj


def _natural(key: str) -> tuple[str, int]:
    head, _, tail = key.rpartition(".")
    return (head, int(tail)) if tail.isdigit() else (key, -1)


def _short(items: list[Any], n: int = 5) -> str:
    return f"[{shorten(items, n)}]"


def _listing(path: Path, n: int = 8) -> str:
    if not path.exists():
        return "the path does not exist"
    if not path.is_dir():
        return "it is a file, not a directory"
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
    if not names:
        return "the directory is empty"
    return f"it holds {_short(names, n)}"
