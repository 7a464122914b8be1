"""Sharded model and optimizer state (FSDP2 / DTensor) through
``torch.distributed.checkpoint`` (DCP).

Gathering a sharded model to rank 0 to write one ``model.safetensors`` would need the
whole model in one process's memory (the reason it was sharded) and a gather over the
training's process group. DCP instead has every rank write its own shards in parallel
(``checkpoint/dcp/__<rank>_<i>.distcp``, plus ``.metadata`` from rank 0) and can load
them back into a different sharding or world size. Around it, the guardrails checkpoint
stays what it is for replicated state: per-rank RNG and data files, JSON for the
scheduler / scaler / extras, one manifest that lists every DCP file with its size and
sha256 (each rank hashes the files it wrote), and one atomic rename.

DCP's save and load are collectives. A signal save (and any save without a background
writer) runs them over the default process group in the main thread, at the step
boundary where every rank saves anyway. A periodic background save stages the shards in
host memory in the main thread (the only part that blocks training) and lets
``dcp.async_save`` write them from its own thread, with its collectives over a gloo
group that only these saves use: a collective from another thread on the training's
group could pair with the training's own and hang or corrupt both. Only the state-dict
APIs of ``torch.distributed.checkpoint.state_dict`` are used (public since torch 2.2).
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import io
import logging
import pathlib
import pickle
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from torch import nn

from guardrails import _digest
from guardrails._errors import CheckpointError, ResumeError
from guardrails._manifest import read_bytes

DCP_DIR = "dcp"

logger = logging.getLogger("guardrails.checkpoint")

# DCP's ``.metadata`` is a pickle, and DCP reads it with ``pickle.load``: a checkpoint
# directory anyone can write to (shared storage, a copied-in checkpoint) could run code
# at every resume, also of a model that is not sharded (the manifest decides the path).
# guardrails reads it with an unpickler that builds only what DCP's metadata is made of
# (read off torch 2.11-2.13's: the dataclasses and enums of these modules, torch.Size,
# dtypes / layouts / memory formats, torch.serialization._get_layout, pathlib paths).
_DCP_MODULES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.filesystem",
    "torch.distributed.checkpoint.planner",
)
_PATHS = ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")


class _Refused(pickle.UnpicklingError):
    """The pickle names something DCP's metadata is never made of."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _allowed(module, name)
        if found is None:
            raise _Refused(f"{module}.{name}")
        return found


def _allowed(module: str, name: str) -> Any:
    if module == "torch":
        obj = getattr(torch, name, None)
        kinds = (torch.dtype, torch.layout, torch.memory_format)
        return obj if name == "Size" or isinstance(obj, kinds) else None
    if (module, name) == ("torch.serialization", "_get_layout"):
        return torch.serialization._get_layout
    if module == "pathlib" and name in _PATHS:
        return getattr(pathlib, name)
    if module in _DCP_MODULES:
        obj = getattr(importlib.import_module(module), name, None)
        if isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)):
            return obj
    return None


def read_metadata(directory: Path) -> Any:
    """DCP's metadata under ``directory``, built by :class:`_MetadataUnpickler`: a
    ``CheckpointError`` naming the object when it holds anything else, or the damage
    when it is not a pickle DCP wrote. The file must be a regular file (not a link, not
    a FIFO: :func:`guardrails._manifest.not_regular`)."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = directory / ".metadata"
    try:
        raw = read_bytes(path)
    except OSError as exc:
        raise CheckpointError(
            f"{path} cannot be read: {exc}. Nothing was loaded or modified.",
            path=str(path),
            hint="resume from an older checkpoint by its step_* path",
        ) from None
    try:
        meta = _MetadataUnpickler(io.BytesIO(raw)).load()
    except _Refused as exc:
        raise CheckpointError(
            f"{path} holds {exc}, which DCP's checkpoint metadata never does: refusing to "
            "unpickle it (unpickling can run code). Nothing was loaded or modified.",
            path=str(path),
            hint="resume only from checkpoints this job or a trusted one wrote; remove this "
            "checkpoint directory, or resume from an older one by its step_* path",
        ) from None
    except Exception as exc:  # no code ran: anything else is damage
        raise CheckpointError(
            f"{path} cannot be read as DCP metadata ({type(exc).__name__}: {exc}). "
            "Nothing was loaded or modified.",
            path=str(path),
            hint="the checkpoint is damaged: resume from an older one by its step_* path",
        ) from None
    if not isinstance(meta, Metadata):
        raise CheckpointError(
            f"{path} holds a {type(meta).__name__}, not DCP metadata. Nothing was loaded.",
            path=str(path),
            hint="the checkpoint is damaged: resume from an older one by its step_* path",
        )
    return meta


def metadata_problem(directory: Path) -> str | None:
    """Why DCP's metadata under ``directory`` cannot be read, or ``None`` (a
    checkpoint's validity check: a resume falls back past such a checkpoint)."""
    try:
        read_metadata(directory)
    except CheckpointError as e:
        return e.message
    return None


def _reader(directory: Path) -> Any:
    """DCP's file-system reader for ``directory``, reading its metadata with the
    restricted unpickler (:func:`read_metadata`) instead of ``pickle.load``."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            # As FileSystemReader.read_metadata (torch 2.13), with the safe unpickler.
            meta = read_metadata(directory)
            if getattr(meta, "storage_meta", None) is None:
                meta.storage_meta = StorageMeta()
            meta.storage_meta.load_id = self.load_id
            return meta

    return Reader(str(directory))


def save(directory: Path, rank: int, model: nn.Module, optimizer: Any) -> list[Path]:
    """Write this rank's shards of model and optimizer under ``directory/dcp`` (every rank
    calls it); returns the files this rank wrote."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save(
        {"model": model_sd, "optim": optim_sd},
        checkpoint_id=str(directory / DCP_DIR),
        storage_writer=_writer(directory),
    )
    return written(directory, rank)


def _writer(directory: Path) -> Any:
    """DCP's file writer with one file per thread per rank: its default is one thread,
    which writes a rank's shards at one stream's speed (the files are fsynced by it
    and hashed by :func:`guardrails._digest.seal` afterwards, in parallel)."""
    from torch.distributed.checkpoint import FileSystemWriter

    return FileSystemWriter(str(directory / DCP_DIR), thread_count=_digest.THREADS)


def stager() -> Any:
    """A DCP file writer for a run's background saves: pass it to :func:`save_async`.

    It stages into pinned host memory allocated at its first save and reused by every
    later one (DCP's ``cache_staged_state_dict``): a fresh writer per save stages into
    freshly allocated, unpinned memory, which stalled training 6.0 s at the first
    periodic save and 2.1 s at the next (FSDP2 on 2 H200, 0.8B parameters, AdamW).

    It writes from :data:`_digest.THREADS` threads. Fewer was measured and not kept
    (benchmarks/RESULTS.md, "The FSDP2 periodic stall, diagnosed"): DCP's writers run
    beside training in this process, and with 1 thread instead of 8 the step that
    started a save fell from 6.3 s to 0.4-0.7 s over the median, but each step while
    the slower write went on took ~2.3x the median, and a SIGTERM during it took
    21.5-23.7 s to exit, against 11.3-17.3 s: the pre-emption save matters more."""
    from torch.distributed.checkpoint import FileSystemWriter

    # The path is set by each save's checkpoint_id (DCP calls the writer's reset()).
    return FileSystemWriter(".", thread_count=_digest.THREADS, cache_staged_state_dict=True)


def prepare_staging(
    writer: Any, model: nn.Module, optimizer: Any, stats: dict[str, Any]
) -> threading.Thread:
    """Allocate ``writer``'s pinned staging memory for this rank's shards now, in a
    thread, while training goes on (the sizes are known once the optimizer stepped):
    left to DCP, the first background save copies every shard to new pageable memory
    and pins a copy of it on the training thread (7.9 s of stall at 0.8B parameters on
    2 H200). The state dict is taken here, on the calling thread (references only);
    the thread reads shapes, never values, so nothing waits for the device.
    ``stats["ahead_s"]`` gets the seconds the allocation took."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    device = next((p.device for p in model.parameters()), None)

    def allocate() -> None:
        t0 = time.perf_counter()
        try:
            if device is not None and device.type == "cuda":
                # The current device is per thread and starts at 0. Pinned without
                # this, rank 1's staging was made from GPU 0's context (creating one
                # there) and its save's copy into it took 0.51-0.92 s against rank 0's
                # 0.04-0.06 s; with it, 0.06 s on both ranks (2 H200, 5 GB a rank).
                torch.cuda.set_device(device)
            writer.state_dict_cache = _empty_pinned(state)
            stats["ahead_s"] = round(time.perf_counter() - t0, 3)
        except Exception as e:  # only an optimisation: DCP allocates at the first save
            logger.debug("guardrails: DCP staging not allocated ahead: %r", e)

    thread = threading.Thread(target=allocate, name="guardrails-dcp-staging", daemon=True)
    thread.start()
    return thread


def _empty_pinned(obj: Any, pin: bool = True) -> Any:
    """The structure DCP's ``_create_cpu_state_dict(obj, pin_memory=pin)`` builds
    (torch 2.8-2.13), from shapes alone: it copies each DTensor to the host first."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, dict):
        return {k: _empty_pinned(v, pin) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_empty_pinned(v, pin) for v in obj)
    if isinstance(obj, DTensor):
        if obj.dim() == 0:
            return obj  # as DCP does: a 0-d DTensor is kept, not staged
        local = obj._local_tensor
        return DTensor.from_local(
            _empty_pinned(local, pin),
            obj.device_mesh,
            obj.placements,
            run_check=False,
            shape=obj.shape,
            stride=obj.stride(),
        )
    if isinstance(obj, torch.Tensor):
        if obj.dim() == 0:
            return torch.tensor(0, dtype=obj.dtype)
        if obj.numel() == 0:
            return torch.zeros(obj.shape, dtype=obj.dtype)
        return torch.empty(obj.shape, dtype=obj.dtype, pin_memory=pin)
    return obj


def save_async(
    directory: Path,
    model: nn.Module,
    optimizer: Any,
    group: Any,
    writer: Any = None,
    cancel: threading.Event | None = None,
) -> Future[Any]:
    """Stage this rank's shards of model and optimizer in host memory now, and write
    them under ``directory/dcp`` from DCP's own thread, its collectives over ``group``
    (every rank calls it). ``writer``: a :func:`stager` kept across saves (its pinned
    staging memory is reused); ``None`` stages into new memory. Setting ``cancel``
    ends the write after the item being written, leaving files that must not be
    committed (:func:`_cancellable_planner`). The returned future is done when this
    rank's files are."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    target = str(directory / DCP_DIR)
    planner = _cancellable_planner(cancel) if cancel is not None else None
    if writer is not None:
        try:
            return dcp.async_save(  # type: ignore[return-value]
                state,
                checkpoint_id=target,
                storage_writer=writer,
                planner=planner,
                process_group=group,
            )
        except Exception as exc:
            # The cached staging no longer fits the state (an optimizer that gained a
            # param group): stage this save into new memory, and the next ones too.
            logger.debug("guardrails: pinned DCP staging dropped: %r", exc)
            writer.state_dict_cache = None
            writer.cache_staged_state_dict = False
    return dcp.async_save(  # type: ignore[return-value]
        state,
        checkpoint_id=target,
        storage_writer=_writer(directory),
        planner=planner,
        process_group=group,
    )


def _cancellable_planner(cancel: threading.Event) -> Any:
    """DCP's default save planner, except that once ``cancel`` is set every item not yet
    written is written empty, so the write ends after the item in progress. A stop's
    save must not wait for an older background save still being written (the stop's
    save supersedes it); such a save is never committed (the checkpointer's writer
    checks ``cancel`` after DCP returns). Empty items rather than an exception: DCP's
    extra writer threads would print an exception's traceback, and one thread's
    failure beside another's success could leave an incomplete ``.metadata``."""
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import WriteItemType

    class CancellablePlanner(DefaultSavePlanner):
        def resolve_data(self, write_item: Any) -> Any:
            if cancel.is_set():
                if write_item.type == WriteItemType.BYTE_IO:
                    return io.BytesIO()
                return torch.empty(0)
            return super().resolve_data(write_item)

    return CancellablePlanner()


def written(directory: Path, rank: int) -> list[Path]:
    """The DCP files this rank wrote under ``directory/dcp``."""
    target = directory / DCP_DIR
    # FileSystemWriter names each rank's files __<rank>_<i>.distcp; rank 0 also writes
    # the global .metadata once every rank's plan is in.
    mine = sorted(target.glob(f"__{rank}_*.distcp"))
    if rank == 0:
        mine.append(target / ".metadata")
    return mine


def check(ckpt: Path, step: int, model: nn.Module) -> None:
    """Before loading: the checkpoint's model keys and global shapes against the live
    model's, so a mismatch is a ResumeError naming keys, with nothing modified."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    meta = read_metadata(ckpt / DCP_DIR).state_dict_metadata
    saved = {
        k.removeprefix("model."): tuple(getattr(v, "size", ()))
        for k, v in meta.items()
        if k.startswith("model.")
    }
    live = {k: tuple(v.shape) for k, v in get_model_state_dict(model).items()}
    missing = sorted(set(live) - set(saved))
    unexpected = sorted(set(saved) - set(live))
    shapes = [
        f"{k}: checkpoint {saved[k]} vs model {live[k]}"
        for k in live
        if k in saved and saved[k] != live[k]
    ]
    if missing or unexpected or shapes:
        parts = []
        if shapes:
            parts.append(f"shape mismatch: {shapes[:5]}")
        if missing:
            parts.append(f"in the model but not the checkpoint: {missing[:5]}")
        if unexpected:
            parts.append(f"in the checkpoint but not the model: {unexpected[:5]}")
        raise ResumeError(
            f"sharded checkpoint {ckpt} does not fit this model; " + "; ".join(parts),
            step=step,
            path=str(ckpt),
            hint="build the model with the architecture that was saved (the sharding and "
            "the world size may differ: DCP reshards). Nothing was modified.",
        )


def load(ckpt: Path, model: nn.Module, optimizer: Any) -> None:
    """Load model and optimizer shards in place (every rank calls it); DCP reshards
    when this run's sharding or world size differs from the saving run's."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    if optimizer is None:
        model_sd = {"model": get_model_state_dict(model)}
        dcp.load(model_sd, storage_reader=_reader(ckpt / DCP_DIR))
        set_model_state_dict(model, model_sd["model"])
        return
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, storage_reader=_reader(ckpt / DCP_DIR))
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
