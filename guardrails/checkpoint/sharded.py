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

Every save is written by :class:`ShardWriter`, in DCP's own format: a periodic
background save stages the shards in pinned host memory in the main thread (the only
part that blocks training) and writes them from the checkpoint writer's thread; a
signal save (and any save without a background writer) writes the live shards from
the main thread, at the step boundary where every rank saves anyway. Not with
``dcp.async_save``, whose Python in the training process stalled training for
seconds, nor ``dcp.save``, whose files had to be read back to be hashed (1 s of a
signal save) and whose collectives ran over the training's process group. The
state-dict APIs of ``torch.distributed.checkpoint.state_dict`` and DCP's planner,
writer and reader classes are public (since torch 2.2); one private name is used,
``filesystem._StorageInfo``, the record of an item's file, offset and length that
DCP's own ``FileSystemWriter`` writes into ``.metadata`` (the same in 2.8-2.13).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import hashlib
import importlib
import io
import logging
import math
import pathlib
import pickle
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

from guardrails._errors import CheckpointError, ResumeError
from guardrails.checkpoint import digest as _digest
from guardrails.checkpoint import hostmem
from guardrails.checkpoint.files import read_bytes
from guardrails.distributed.dist import imported_class
from guardrails.distributed.store import wait_keys

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


def is_sharded(model: nn.Module) -> bool:
    """Whether any parameter is a DTensor (FSDP2 ``fully_shard``, tensor parallel): the
    parameters have global shapes and global norms, and their state goes through
    ``torch.distributed.checkpoint`` (``checkpoint/sharded.py``), each rank writing its
    shards."""
    dtensor = imported_class("torch.distributed.tensor", "DTensor")
    return dtensor is not None and any(isinstance(p, dtensor) for p in model.parameters())


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
    a FIFO: :func:`guardrails.checkpoint.files.not_regular`)."""
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


def _writer(directory: Path) -> Any:
    """DCP's file writer for ``directory/dcp``: it writes ``.metadata``
    (:meth:`ShardWriter._write_metadata`)."""
    from torch.distributed.checkpoint import FileSystemWriter

    return FileSystemWriter(str(directory / DCP_DIR))


def stager() -> Any:
    """A DCP file writer used as the stager of a run's background saves
    (:class:`ShardWriter`): its ``stage`` copies the shards into pinned host memory
    allocated at its first save and reused by every later one (DCP's
    ``cache_staged_state_dict``): staging each save into freshly allocated, unpinned
    memory stalled training 6.0 s at the first periodic save and 2.1 s at the next
    (FSDP2 on 2 H200, 0.8B parameters, AdamW)."""
    from torch.distributed.checkpoint import FileSystemWriter

    # It never writes: ShardWriter does, into the directory of each save.
    return FileSystemWriter(".", cache_staged_state_dict=True)


def prepare_staging(
    shards: ShardWriter, model: nn.Module, optimizer: Any, stats: dict[str, Any]
) -> threading.Thread:
    """Allocate ``shards``' pinned staging memory for this rank's shards now, in a
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
                # The current device is per thread and starts at 0: without this, rank
                # 1 made a CUDA context on GPU 0 here. (While the staging was wrongly
                # placed on the GPU, it landed on GPU 0 too, and rank 1's copy into it
                # took 0.51-0.92 s against rank 0's 0.04-0.06 s.)
                torch.cuda.set_device(device)
            shards.stager.state_dict_cache = _empty_pinned(state, locked=shards.locked)
            stats["ahead_s"] = round(time.perf_counter() - t0, 3)
        except Exception as e:  # only an optimisation: DCP allocates at the first save
            logger.debug("guardrails: DCP staging not allocated ahead: %r", e)

    thread = threading.Thread(target=allocate, name="guardrails-dcp-staging", daemon=True)
    thread.start()
    return thread


def _empty_pinned(obj: Any, pin: bool = True, locked: list[int] | None = None) -> Any:
    """The structure DCP's ``_create_cpu_state_dict(obj, pin_memory=pin)`` builds
    (torch 2.8-2.13), from shapes alone: it copies each DTensor to the host first.
    Pinned: views of one block locked in place (``hostmem.page_locked``; its address is
    appended to ``locked``, to unlock), not a ``pin_memory=True`` tensor each: torch's
    pinned allocator holds the CUDA driver's lock the training thread's launches wait
    for, once per tensor (~1,000 a rank at 0.8B parameters)."""
    sizes: list[int] = []
    _staged_sizes(obj, sizes)
    views = iter(_carve_block(sizes, locked) if pin and sizes else [])
    return _build_staging(obj, pin, views)


#: Each tensor's offset in the pinned block: any dtype's alignment, and a cache line.
_STAGED_ALIGN = 64


def _is_staged(t: torch.Tensor) -> bool:
    return t.dim() > 0 and t.numel() > 0


def _staged_sizes(obj: Any, sizes: list[int]) -> None:
    """The bytes of each tensor :func:`_build` stages, in its order."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, dict):
        for v in obj.values():
            _staged_sizes(v, sizes)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _staged_sizes(v, sizes)
    elif isinstance(obj, DTensor):
        if obj.dim() > 0:
            _staged_sizes(obj._local_tensor, sizes)
    elif isinstance(obj, torch.Tensor) and _is_staged(obj):
        sizes.append(obj.numel() * obj.element_size())


def _carve_block(sizes: list[int], locked: list[int] | None) -> list[torch.Tensor]:
    """One locked block cut into byte views of ``sizes``."""
    offsets, end = [], 0
    for n in sizes:
        offsets.append(end)
        end += -(-n // _STAGED_ALIGN) * _STAGED_ALIGN
    block, is_locked = hostmem.page_locked(end)
    if is_locked and locked is not None:
        locked.append(block.data_ptr())
    return [block[o : o + n] for o, n in zip(offsets, sizes, strict=True)]


def _build_staging(obj: Any, pin: bool, views: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(obj, dict):
        return {k: _build_staging(v, pin, views) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_build_staging(v, pin, views) for v in obj)
    if isinstance(obj, DTensor):
        if obj.dim() == 0:
            return obj  # as DCP does: a 0-d DTensor is kept, not staged
        # The same spec around a host tensor, as DCP's ``obj.to("cpu")`` then a pinned
        # ``_local_tensor`` gives. Not ``DTensor.from_local``: it moves a local tensor to
        # its mesh's device, so the "staging" would be a second copy of every shard on
        # the GPU (5 GB a rank at 0.8B parameters), which the writer threads then copy to
        # the host item by item, each copy holding the CUDA driver's lock against the
        # training thread's kernel launches: 1.0-1.5 s of stall at the step that starts
        # a save (2 H200, py-spy).
        return DTensor(
            _build_staging(obj._local_tensor, pin, views), obj._spec, requires_grad=False
        )
    if isinstance(obj, torch.Tensor):
        if obj.dim() == 0:
            return torch.tensor(0, dtype=obj.dtype)
        if obj.numel() == 0:
            return torch.zeros(obj.shape, dtype=obj.dtype)
        if pin:
            return next(views).view(obj.dtype).view(obj.shape)
        return torch.empty(obj.shape, dtype=obj.dtype)
    return obj


class ShardWriter:
    """A run's saves of sharded state (every rank has one).

    For a background save, :meth:`stage` copies this rank's shards into pinned host
    memory on the training thread (the only part that blocks training, ~0.15 s for 5 GB
    a rank on an H200) and :meth:`write` writes them from the checkpoint writer's
    thread; a save in the main thread (a signal's) writes :meth:`live`'s shards. Either
    way the files are DCP's own format (``__<rank>_<i>.distcp`` files of
    ``torch.save``-d items, ``.metadata`` from rank 0), so :func:`load` and
    ``dcp.load`` read them as any DCP checkpoint.

    Why not ``dcp.async_save``: its save runs DCP's planning, collectives, per-item
    DTensor dispatch and metadata as Python in threads of the training process. On one
    host that stalled FSDP2 training 9.1 s at the step that started a save (0.84B
    parameters, 5 GB a rank, 2 H200, foreach AdamW), where writing the same ~1,000
    items a rank with ``torch.save`` from 8 threads stalled it 0.29 s; on three other
    hosts ``dcp.async_save`` and this writer both stalled it 1.0-2.3 s. Here the save
    plan (which rank writes which item: DCP's own ``DefaultSavePlanner``) depends only
    on the state's layout, so it is made once and exchanged through the job's store; it
    is made again only when the layout changes (an optimizer that gained a param group).
    Each save then costs the store a few round trips, and its writer threads a
    ``torch.save`` per item."""

    def __init__(self) -> None:
        self.stager = stager()
        #: The staging's locked block (:func:`prepare_staging`), unlocked when it is
        #: dropped or this writer goes.
        self.locked: list[int] = []
        weakref.finalize(self, hostmem.unlock, self.locked)
        self._layout: tuple[Any, ...] | None = None
        self._local = b""  # this rank's local plan (pickled) for that layout
        self._mine: tuple[bytes, Any] | None = None  # this rank's final plan (pickled, loaded)
        # Rank 0: a digest of the local plans the global plan was made from, each rank's
        # final plan (pickled) and the checkpoint's metadata (its storage filled per save).
        self._asked = b""
        self._global: list[bytes] = []
        self._metadata: Any = None
        self._results: list[bytes] = []  # every rank's write results of the last save
        self._metadata_bytes = b""  # the .metadata they made

    @staticmethod
    def live(model: nn.Module, optimizer: Any) -> dict[str, Any]:
        """This rank's shards of model and optimizer as they are (no copy: for a save
        written before training goes on). The writer threads copy each device shard to
        the host as they write it."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(model, optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def stage(self, model: nn.Module, optimizer: Any) -> Any:
        """This rank's shards of model and optimizer, copied to host memory now."""
        state = self.live(model, optimizer)
        try:
            staged = self.stager.stage(state)
        except Exception as exc:
            # The cached staging no longer fits the state (an optimizer that gained a
            # param group): stage this save into new memory, and the next ones too.
            logger.debug("guardrails: pinned DCP staging dropped: %r", exc)
            hostmem.unlock(self.locked)
            self.stager.state_dict_cache = None
            self.stager.cache_staged_state_dict = False
            staged = self.stager.stage(state)
        device = next((p.device for p in model.parameters()), None)
        if device is not None and device.type == "cuda":
            # DCP's copies into pinned memory are blocking (torch 2.8-2.13); should one
            # ever be queued instead, the writer thread must not read it half-copied.
            # At a save step only, after those copies: nothing is left to wait for.
            torch.cuda.current_stream(device).synchronize()
        return staged

    def write(
        self,
        directory: Path,
        staged: Any,
        *,
        rank: int,
        world: int,
        store: Any,
        key: str,
        cancel: threading.Event,
        timeout_s: float,
    ) -> dict[str, dict[str, Any]]:
        """Write ``staged`` (from :meth:`stage` or :meth:`live`) under
        ``directory/dcp``; every rank calls it with the save's store ``key`` (``store``
        is ``None`` in a single process). Returns the manifest record (size, sha256) of
        each file this rank wrote, by name: hashed on the way to disk, fsynced. Setting
        ``cancel`` ends the write within about a piece of each file
        (:class:`guardrails.checkpoint.digest.HashingFile`) with
        :class:`guardrails.checkpoint.digest.Cancelled`; a failure on any rank is a
        ``CheckpointError`` on every rank, not a wait (``timeout_s``: how long a rank
        waits for another's part)."""
        from torch.distributed import HashStore
        from torch.distributed.checkpoint import DefaultSavePlanner

        if store is None:  # one process: it plans alone, through a store of its own
            store = HashStore()
        try:
            planner = DefaultSavePlanner()
            planner.set_up_planner(staged, is_coordinator=rank == 0)  # flattens, as DCP does
            layout = _layout(planner.state_dict)
            if layout != self._layout:
                self._local = pickle.dumps(planner.create_local_plan())
                self._layout = layout
            store.set(f"{key}/dcp-plan/{rank}", self._local)
            if rank == 0:
                self._plan_globally(planner, store, key, world, timeout_s)
            got = _take(store, f"{key}/dcp-global/{rank}", "rank 0", timeout_s, world)
            if self._mine is None or self._mine[0] != got:
                self._mine = (got, pickle.loads(got))
            target = directory / DCP_DIR
            results, records = _write_items(target, rank, planner, self._mine[1].items, cancel)
            store.set(f"{key}/dcp-results/{rank}", pickle.dumps(results))
            if rank == 0:
                everyone = [
                    _take(store, f"{key}/dcp-results/{r}", f"rank {r}", timeout_s, world)
                    for r in range(world)
                ]
                records[".metadata"] = self._write_metadata(directory, everyone)
        except BaseException as e:
            _tell_failure(store, key, rank, world, e)
            raise
        return records

    def _write_metadata(self, directory: Path, results: list[bytes]) -> dict[str, Any]:
        """Rank 0: ``.metadata`` (every item's file, offset and length), its manifest
        record. Written by DCP's ``FileSystemWriter.finish`` when the results differ
        from the last save's; else the same bytes again: a ``torch.save`` item's length
        depends only on its shape and dtype, so once the layout is fixed every save's
        results are the same, and DCP's one ``pickle.dump`` of the metadata (70-100 ms
        holding the GIL on a CPU host, 985 items a rank) is not repeated. Only its
        ``storage_meta`` (the path and id of the save that wrote it) is then the
        first's, which nothing reads (the path named a temp directory anyway)."""
        target = directory / DCP_DIR / ".metadata"
        if results == self._results:
            f = _digest.HashingFile(target)
            f.write(self._metadata_bytes)
            return f.close()
        writer = _writer(directory)
        writer.set_up_storage_writer(True)
        writer.finish(self._metadata, [pickle.loads(b) for b in results])
        self._metadata_bytes = read_bytes(target)
        self._results = results
        [record] = _digest.seal([target])
        return record

    def _plan_globally(
        self, planner: Any, store: Any, key: str, world: int, timeout_s: float
    ) -> None:
        """Rank 0: every rank's final plan into the store (DCP's global plan: which
        rank writes each replicated item), made again only when a local plan changed."""
        asked = [
            _take(store, f"{key}/dcp-plan/{r}", f"rank {r}", timeout_s, world) for r in range(world)
        ]
        digest = hashlib.sha256(b"".join(hashlib.sha256(b).digest() for b in asked)).digest()
        if digest != self._asked:
            plans, self._metadata = planner.create_global_plan([pickle.loads(b) for b in asked])
            self._global = [pickle.dumps(p) for p in plans]
            self._asked = digest
            self._results = []  # new metadata: written by DCP again at this save
        for r, plan in enumerate(self._global):
            store.set(f"{key}/dcp-global/{r}", plan)


_FAILED = b"!"  # a store value that says the rank failed (a pickle never starts with it)


def _layout(flat: dict[str, Any]) -> tuple[Any, ...]:
    """What a save plan depends on: each flattened key's kind, global shape, dtype and
    placements (not the values)."""
    return tuple(
        (k, type(v).__name__, tuple(v.shape), v.dtype, str(getattr(v, "placements", "")))
        if isinstance(v, torch.Tensor)
        else (k, type(v).__name__)
        for k, v in flat.items()
    )


def _take(store: Any, key: str, who: str, timeout_s: float, world: int) -> bytes:
    """``key``'s value once it is set (then removed from the store), or a
    ``CheckpointError`` when ``who`` said it failed or never set it."""
    try:
        # Polled, not store.wait: a wait would hold the process's store client (and
        # every other thread's calls) until the key comes.
        wait_keys(store, [key], timedelta(seconds=timeout_s), world=world)
    except Exception:
        raise CheckpointError(
            f"{who} did not get to its part of the sharded save within {timeout_s:.0f} s",
            hint="that rank died or hung mid-save; the previous checkpoints are intact.",
        ) from None
    value = bytes(store.get(key))
    with contextlib.suppress(Exception):  # only memory in the store
        store.delete_key(key)
    if value.startswith(_FAILED):
        raise CheckpointError(
            f"{who} could not write its part of the sharded save: {value[1:].decode()}",
            hint="see that rank's log for the cause and its fix; the previous checkpoints "
            "are intact.",
        )
    return value


def _tell_failure(store: Any, key: str, rank: int, world: int, error: BaseException) -> None:
    """Set every key another rank may be waiting on from this rank to a failure."""
    said = _FAILED + f"{type(error).__name__}: {error}".encode()
    keys = [f"{key}/dcp-plan/{rank}", f"{key}/dcp-results/{rank}"]
    if rank == 0:
        keys += [f"{key}/dcp-global/{r}" for r in range(world)]
    for k in keys:
        with contextlib.suppress(Exception):  # the store is gone too: the others time out
            if not store.check([k]):
                store.set(k, said)


def _item_data(planner: Any, item: Any) -> Any:
    """What ``item`` of the plan writes: a shard's staged local tensor itself where it
    is the whole item (FSDP2's one chunk a rank), else DCP's own resolution (its
    DTensor dispatch, run per item by ``dcp.async_save``'s writers)."""
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.tensor import DTensor

    if item.type != WriteItemType.BYTE_IO:
        obj = planner.state_dict.get(item.index.fqn)
        local = obj._local_tensor if isinstance(obj, DTensor) else obj
        if isinstance(local, torch.Tensor) and tuple(local.shape) == tuple(
            item.tensor_data.chunk.sizes
        ):
            return local
    return planner.resolve_data(item)


def _write_items(
    target: Path, rank: int, planner: Any, items: list[Any], cancel: threading.Event
) -> tuple[list[Any], dict[str, dict[str, Any]]]:
    """Write ``items`` into ``__<rank>_<i>.distcp`` files, one file per thread, each
    item as DCP's ``FileSystemWriter`` writes it (``torch.save`` of a tensor, the
    bytes of a ``BYTE_IO`` item), hashed as written; returns DCP's ``WriteResult`` of
    each item and each file's manifest record."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult

    target.mkdir(parents=True, exist_ok=True)
    failed = threading.Event()  # one file's failure stops the others early

    def write_file(name: str, bucket: list[Any]) -> tuple[list[Any], dict[str, Any]]:
        results = []
        f = _digest.HashingFile(target / name, cancel=cancel)
        try:
            for item in bucket:
                if cancel.is_set() or failed.is_set() or f.cancelled:
                    raise _digest.Cancelled("the save was abandoned")
                data = _item_data(planner, item)
                offset = f.tell()
                if item.type == WriteItemType.BYTE_IO:
                    f.write(data.getbuffer())
                else:
                    tensor = data.detach()
                    if tensor.device.type != "cpu":  # a live shard, or a 0-d state
                        tensor = tensor.cpu()  # that DCP's staging leaves on the device
                    if tensor.untyped_storage().nbytes() != tensor.nbytes:
                        tensor = tensor.clone()  # a view: torch.save writes its storage
                    torch.save(tensor, f)
                length = f.tell() - offset
                results.append(
                    WriteResult(
                        index=item.index,
                        size_in_bytes=length,
                        storage_data=_StorageInfo(name, offset, length),
                    )
                )
            if f.cancelled:  # during the last item
                raise _digest.Cancelled("the save was abandoned")
        except BaseException:
            failed.set()
            f.abandon()
            raise
        return results, f.close()

    buckets = _buckets(items, _digest.THREADS)
    if not buckets:  # DCP's plan gave this rank nothing to write (all deduplicated)
        return [], {}
    names = [f"__{rank}_{i}.distcp" for i in range(len(buckets))]
    with ThreadPoolExecutor(len(buckets), thread_name_prefix="guardrails-dcp-write") as pool:
        futures = [pool.submit(write_file, n, b) for n, b in zip(names, buckets, strict=True)]
        errors = [e for f in futures if (e := f.exception()) is not None]
    if errors:  # the failure that stopped the others, not the Cancelled they then raised
        raise min(errors, key=lambda e: isinstance(e, _digest.Cancelled))
    done = [f.result() for f in futures]
    return [r for results, _ in done for r in results], {
        name: record for name, (_, record) in zip(names, done, strict=True)
    }


def _buckets(items: list[Any], n: int) -> list[list[Any]]:
    """``items`` over at most ``n`` files of about equal bytes (largest first, each to
    the lightest file so far); never an empty file."""
    from torch.distributed.checkpoint.planner import WriteItemType

    def size(item: Any) -> int:
        if item.type == WriteItemType.BYTE_IO:
            return 0
        chunk = item.tensor_data.chunk
        return math.prod(chunk.sizes) * item.tensor_data.properties.dtype.itemsize

    buckets: list[list[Any]] = [[] for _ in range(max(1, min(n, len(items))))]
    loads = [0] * len(buckets)
    for item in sorted(items, key=size, reverse=True):
        i = loads.index(min(loads))
        buckets[i].append(item)
        loads[i] += size(item) or 1
    return [b for b in buckets if b]


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
