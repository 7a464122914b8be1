"""The write side's first half: a checkpoint's tensors copied into one reusable staging
buffer (pinned on CUDA), then written as safetensors and JSON files by :class:`Part`.
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import os
import random
import re
import struct
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from guardrails._errors import CheckpointError
from guardrails.checkpoint import digest, hostmem
from guardrails.checkpoint.codec import encode
from guardrails.checkpoint.common import (
    ALIASES_KEY,
    EXTRAS_TENSORS,
    _seal,
    log,
)

# The manifest and the checks of a checkpoint's files, torch-free (`inspect` uses them).
from guardrails.checkpoint.manifest import (
    _dumps,
    _rank_name,
)
from guardrails.distributed import dist

#: Optimizer states that are elementwise copies of their parameter's shape, so a shape
#: mismatch is a certain sign of a different model. (Factored states such as
#: Adafactor's row/column statistics legitimately differ and are not checked.)
_ELEMENTWISE_STATE = frozenset(
    {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "sum"}
    | {"acc_delta", "grad_avg", "prev", "ax"}  # not NAdam's mu_product: a scalar
)


class Staging:
    """Host memory for a save's tensors, allocated once and reused by every save: pinned
    for device tensors on a CUDA machine, plain memory for a CPU run's own tensors.

    A fresh pinned allocation per save cost the first periodic save of a 10 GB state
    5.9 s on an H200 (pinning the pages is the slow part, not the copy), and a SIGTERM
    save with no periodic save before it 4.1-4.6 s of its 12.4-12.9 s (H100, 0.835B
    model). Here the memory is a few blocks, laid out the same way at every save (the
    state's tensors keep their sizes), so staging is only the copy (~0.5 s for 10 GB at
    PCIe speed). :meth:`prepare` allocates the blocks ahead of the first save, in a
    thread: pinned blocks are plain memory locked in place (``hostmem.page_locked``),
    which the training thread's kernel launches do not wait for, sized in powers of two
    (as torch's pinned allocator, its fallback, rounds them); a CPU run's staging is one
    block of the size asked, its pages touched in that thread (the first write of fresh
    pages is what a save would otherwise pay, ~0.25 s/GB).

    One save uses it at a time: a save waits for the previous save's writer, which
    reads from these blocks, before it stages.
    """

    #: At least this many bytes per pinned block: few blocks (a handful of
    #: cudaHostAlloc calls) and at most one block's tail unused.
    BLOCK_BYTES = 1 << 30
    _ALIGN = 64  # each tensor's offset: any dtype's alignment, and a cache line

    def __init__(self, *, pinned: bool | None = None) -> None:
        #: Pinned (a CUDA machine: the blocks take device tensors) or plain host memory
        #: (a CPU run: the blocks take the host tensors a save copies).
        self.pinned = torch.cuda.is_available() if pinned is None else pinned
        self._blocks: list[Tensor] = []
        # The pinned blocks' addresses, unlocked at release() (or when this staging
        # goes: a block still referenced then is plain memory from there on).
        self._locked: list[int] = []
        weakref.finalize(self, hostmem.unlock, self._locked)
        # prepare()'s thread vs a save's place(): held to read or append the block
        # list, never while a block is being allocated (pinning 1 GB takes ~0.1-0.6 s).
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        # stop_preparing(): the thread allocates no block after the one in hand.
        self._stopped = threading.Event()
        #: Bytes :meth:`place` had to allocate itself, during a save (0 when
        #: :meth:`prepare` had allocated everything ahead).
        self.allocated_in_save = 0

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.blocks)

    @property
    def blocks(self) -> list[Tensor]:
        """The blocks allocated so far (a copy of the list)."""
        with self._lock:
            return list(self._blocks)

    @property
    def stopped(self) -> bool:
        """Whether :meth:`stop_preparing` was called: saves place what the blocks
        allocated so far hold, and wait for nothing (:meth:`place_ready`)."""
        return self._stopped.is_set()

    def prepare(self, sizes: list[int], device: torch.device | None = None) -> None:
        """Allocate, in a background thread, the blocks a save of tensors of ``sizes``
        bytes needs (the layout :meth:`place` will use), pinned from ``device``'s CUDA
        context: a new thread's current device is GPU 0, whatever the rank's. A second
        call with more sizes (the optimizer's state, once it exists) grows the same
        layout: its first sizes are the first call's. One block at a time, each usable
        by a save as soon as it is there (:meth:`place_ready`)."""
        previous = self._thread

        def grow() -> None:
            if previous is not None:
                previous.join()
            if device is not None and device.type == "cuda":
                torch.cuda.set_device(device)
            while not self._stopped.is_set():
                if not self._grow(sizes, at_most=1):
                    return

        self._thread = threading.Thread(target=grow, name="guardrails-checkpoint-pin", daemon=True)
        self._thread.start()

    def stop_preparing(self) -> None:
        """Allocate nothing more ahead: the block being allocated is the last. For a
        stop's save (the process ends after it): waiting for the rest of a 10 GB state
        to be pinned cost a SIGTERM at step 10 seconds of its grace period, and the
        memory would only be freed again at exit."""
        self._stopped.set()

    def release(self) -> None:
        """Let the blocks go and hand pinned pages back to the driver now (torch keeps
        freed pinned memory cached): a run that goes on after a stop's save
        (``exit_on_signal=False``) gets 10 GB of host memory back, and one that exits
        spends less of its exit unpinning (exiting with 10 GB pinned: 1.9-2.1 s;
        freeing it first 0.8 s, then exiting 0.5 s; H200 host, benchmarks/exit_cost.py).
        """
        self.stop_preparing()
        self.wait()
        with self._lock:
            self._blocks = []
        if self.pinned and torch.cuda.is_available() and torch.cuda.is_initialized():
            # A save the stop abandoned can still hold views of the blocks through a
            # reference cycle (its Cancelled error's traceback): collected first, or
            # the blocks stayed pinned until the exit (H200, SIGTERM at step 45).
            gc.collect()
            hostmem.unlock(self._locked)
            empty = getattr(torch._C, "_host_emptyCache", None)  # torch's pinned blocks
            if empty is not None:  # (page_locked's fallback), torch >= 2.3
                empty()

    def wait(self) -> None:
        """Wait for the ahead-of-time allocation, if one is running."""
        if self._thread is not None:
            self._thread.join()

    def place(self, tensors: list[Tensor]) -> list[Tensor]:
        """A host tensor for each of ``tensors`` (same dtype and shape), in this
        staging's blocks, allocating what is missing now."""
        self.wait()  # the ahead-of-time allocation
        sizes = [t.numel() * t.element_size() for t in tensors]
        self.allocated_in_save += sum(b.numel() for b in self._grow(sizes))
        places = self._views(tensors, sizes)
        assert all(p is not None for p in places)
        return places  # type: ignore[return-value]

    def place_ready(self, tensors: list[Tensor]) -> list[Tensor | None]:
        """Like :meth:`place`, without waiting or allocating: a host tensor for each of
        ``tensors`` whose place lies in a block allocated already, ``None`` for the
        others (the caller copies those elsewhere)."""
        sizes = [t.numel() * t.element_size() for t in tensors]
        return self._views(tensors, sizes)

    def where(self, tensors: list[Tensor]) -> list[tuple[int, int, int]]:
        """``(block, offset, bytes)`` of each of ``tensors`` in this staging's blocks:
        where :meth:`place` puts them (a caller copying whole blocks at once lays out
        its own buffer the same way)."""
        with self._lock:
            where, _ = self._plan([t.numel() * t.element_size() for t in tensors])
        return where

    def _views(self, tensors: list[Tensor], sizes: list[int]) -> list[Tensor | None]:
        with self._lock:
            where, _ = self._plan(sizes)
            blocks = list(self._blocks)
        out: list[Tensor | None] = []
        for t, (block, offset, n) in zip(tensors, where, strict=True):
            if block < len(blocks):
                out.append(blocks[block][offset : offset + n].view(t.dtype).view(t.shape))
            else:
                out.append(None)
        return out

    def _grow(self, sizes: list[int], *, at_most: int | None = None) -> list[Tensor]:
        """Allocate the blocks ``sizes`` needs that are missing (``at_most`` of them);
        the new blocks. The lock is not held while a block is allocated: a save's
        :meth:`place_ready` reads the blocks already there meanwhile."""
        with self._lock:
            _, missing = self._plan(sizes)
        new = []
        for size in missing[:at_most]:
            if self.pinned:
                block, locked = hostmem.page_locked(size)
                if locked:
                    self._locked.append(block.data_ptr())
            else:  # its pages faulted in now, not by the save's copies
                block = hostmem.fresh_memory(size)
            with self._lock:
                self._blocks.append(block)
            new.append(block)
        return new

    def _aligned(self, n: int) -> int:
        return -(-n // self._ALIGN) * self._ALIGN

    def _plan(self, sizes: list[int]) -> tuple[list[tuple[int, int, int]], list[int]]:
        """``(block, offset, bytes)`` per tensor, first fit in order, over the blocks
        allocated so far and then the blocks still missing, and the missing blocks'
        sizes (a block index past the allocated ones is a missing block's)."""
        capacity = [b.numel() for b in self._blocks]
        have = len(capacity)
        where = []
        block, offset = 0, 0
        for i, n in enumerate(sizes):
            while True:
                if block == len(capacity):
                    if self.pinned:
                        capacity.append(max(self.BLOCK_BYTES, 1 << max(0, (n - 1).bit_length())))
                    else:  # one block for the rest, exactly
                        capacity.append(max(1, sum(self._aligned(m) for m in sizes[i:])))
                if offset + n <= capacity[block]:
                    break
                block, offset = block + 1, 0
            where.append((block, offset, n))
            offset += self._aligned(n)
        return where, capacity[have:]


class Part:
    """What one rank writes into one checkpoint, already copied off the live objects, so
    a writer thread can serialise it while training mutates the originals.

    Staging is the only part of a save that must block training: device tensors are
    copied to pinned host memory (``staging``'s reused blocks, or fresh pinned memory
    without one) with ``non_blocking`` copies and one wait at the end (:meth:`ready`),
    host tensors are cloned (on a CPU run, whose ``staging`` is plain memory, the model's
    and optimizers' go into its blocks instead), and everything that is not a tensor is
    serialised to bytes at once.
    """

    def __init__(
        self,
        staging: Staging | None = None,
        *,
        measure: bool = False,
        host: bool | None = None,
        plain: bool = False,
    ) -> None:
        #: file name -> (tensors stored once each, alias key -> stored key)
        self.tensors: dict[str, tuple[dict[str, Tensor], dict[str, str]]] = {}
        #: file name -> the file's bytes (JSON, or torch.save for odd schedulers)
        self.blobs: dict[str, bytes] = {}
        #: The sharded state's files, once written (hashed as written).
        self.sealed: list[Path] = []
        #: A sharded save's (ShardWriter, shards: staged, or live for a save written
        #: before training goes on): written after the files above.
        self.dcp: Any = None
        #: Seconds the save blocked training (set by the caller), spent writing and
        #: hashing, and in the final fsyncs (set by :meth:`write`).
        self.stage_s = 0.0
        #: Bytes of host memory staging had to allocate during the save (0 when the
        #: staging memory allocated ahead held everything).
        self.fresh_bytes = 0
        self.write_s = 0.0
        self.fsync_s = 0.0
        #: Set to abandon the write (the pieces not yet written are not): a stop's save
        #: supersedes a periodic save still being written.
        self.cancel = threading.Event()
        self._staging = staging
        #: With ``measure``, nothing is copied: only the device tensors' byte sizes are
        #: collected (what :meth:`Staging.prepare` needs), in staging order.
        self._measure = measure
        #: Host tensors to copy go into the staging too (plain memory: a CPU run's);
        #: ``host`` says so for a measuring part, which has no staging.
        self._host = (staging is not None and not staging.pinned) if host is None else host
        #: Without staging, copy into plain host memory rather than fresh pinned memory
        #: (a failure save): CUDA orders a page-locked allocation after all the work
        #: queued on the device (its "implicit synchronization"), which a save from a
        #: stuck rank must not wait for; and fresh pinning costs 0.2-0.6 s a GB.
        self._plain = plain
        self.device_bytes: list[int] = []
        # Tensors waiting for ready()'s copy into staging: (file name, key, tensor)
        self._on_device: list[tuple[str, str, Tensor]] = []

    @property
    def nbytes(self) -> int:
        n = sum(len(b) for b in self.blobs.values())
        for unique, _ in self.tensors.values():
            n += sum(t.numel() * t.element_size() for t in unique.values())
        return n

    def add_tensors(
        self, name: str, tensors: Mapping[str, Any], *, copy: bool, sized: bool = True
    ) -> None:
        """Stage ``tensors`` for ``name`` (a .safetensors file), each storage once.

        safetensors refuses tensors that share memory (tied embeddings: ``lm_head.weight``
        *is* ``embed.weight``). The same view under two keys is stored once and the other
        key recorded as an alias; different views of one storage are copied apart.
        ``copy``: clone host tensors too (the caller goes on mutating them). ``sized``:
        the staging was sized for these (the model's and optimizers' tensors); host
        tensors of other files (the RNG, ``g.state``) are cloned, not staged.
        """
        unique: dict[str, Tensor] = {}
        aliases: dict[str, str] = {}
        by_view: dict[tuple[Any, ...], str] = {}
        storages: set[int] = set()
        for key, value in tensors.items():
            if not isinstance(value, Tensor):
                raise TypeError(
                    f"{name}: {key!r} is a {type(value).__name__}, not a tensor; "
                    "guardrails checkpoints hold tensors here (get_extra_state() objects "
                    "are not supported yet)"
                )
            t = value.detach()
            ptr = t.untyped_storage().data_ptr() if t.numel() else 0
            view = (t.device, ptr, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
            if ptr and view in by_view:
                aliases[key] = by_view[view]
                continue
            shared = ptr and (t.device, ptr) in storages
            if ptr:
                by_view[view] = key
                storages.add((t.device, ptr))
            if t.device.type != "cpu" or (
                self._host and sized and (shared or copy or not t.is_contiguous())
            ):
                # Copied into the staging memory by ready(), all at once, with one wait.
                self._on_device.append((name, key, t))
                self.device_bytes.append(t.numel() * t.element_size())
            elif self._measure:
                pass
            elif shared or copy:  # a copy apart from the storage it shares / the caller
                t = t.clone(memory_format=torch.contiguous_format)
            elif not t.is_contiguous():  # safetensors stores contiguous tensors only
                t = t.contiguous()
            unique[key] = t
        self.tensors[name] = (unique, aliases)

    def add_json(self, name: str, obj: Any) -> None:
        self.blobs[name] = _dumps(obj)

    def ready(self) -> None:
        """Copy the device tensors to host memory without waiting, then wait once for
        all of them (one sync per save, not per tensor)."""
        if not self._on_device or self._measure:
            return
        sources = [t for _, _, t in self._on_device]
        if self._staging is not None and self._staging.stopped:
            targets = self._into_ready_blocks(sources)
        elif self._staging is not None:
            allocated = self._staging.allocated_in_save
            targets = self._staging.place(sources)
            self.fresh_bytes = self._staging.allocated_in_save - allocated
            for dst, src in zip(targets, sources, strict=True):
                dst.copy_(src, non_blocking=True)
        elif self._plain:
            targets = self._into_plain(sources)
        else:  # into fresh pinned memory
            targets = [t.to("cpu", non_blocking=True) for t in sources]
            self.fresh_bytes = sum(t.numel() * t.element_size() for t in sources)
        for (name, key, _), dst in zip(self._on_device, targets, strict=True):
            self.tensors[name][0][key] = dst
        self._on_device = []
        # The copies' streams only (the current one of each device: a failure save from
        # the watchdog's thread copies on a stream of its own; the device's other
        # streams may be stuck in a collective whose peer is gone).
        for device in {t.device for t in sources if t.device.type == "cuda"}:
            torch.cuda.current_stream(device).synchronize()

    def _into_ready_blocks(self, sources: list[Tensor]) -> list[Tensor]:
        """A stop's save (its staging stopped preparing): each tensor into the staging
        block allocated for it if that block is there already, non-blocking; the
        others into plain host memory allocated now (:attr:`fresh_bytes`), rather
        than wait for their blocks to be pinned (~0.2-0.6 s a GB)."""
        assert self._staging is not None
        targets = self._staging.place_ready(sources)
        for dst, src in zip(targets, sources, strict=True):
            if dst is not None:  # queued first: the device copies these meanwhile
                dst.copy_(src, non_blocking=True)
        missing = [src for dst, src in zip(targets, sources, strict=True) if dst is None]
        plain = iter(self._into_plain(missing))
        return [next(plain) if dst is None else dst for dst in targets]

    def _into_plain(self, sources: list[Tensor]) -> list[Tensor]:
        """``sources`` copied into plain host memory allocated now (:attr:`fresh_bytes`),
        each copy waited for on the current stream."""
        sizes = [-(-t.numel() * t.element_size() // 64) * 64 for t in sources]
        plain = hostmem.fresh_memory(sum(sizes)) if sources else None
        self.fresh_bytes += sum(t.numel() * t.element_size() for t in sources)
        placed: list[Tensor] = []
        offset = 0
        for src, size in zip(sources, sizes, strict=True):
            assert plain is not None
            n = src.numel() * src.element_size()
            dst = plain[offset : offset + n].view(src.dtype).view(src.shape)
            offset += size
            dst.copy_(src)  # plain memory: the host waits for this copy
            placed.append(dst)
        return placed

    def write(self, directory: Path, files: dict[str, Any]) -> None:
        """Write every file into ``directory``, hashed as written and fsynced, recording
        size and sha256. The small files (JSON: data position, RNG, optimizer settings)
        go first, then the tensors, largest last."""
        t0 = time.perf_counter()
        jobs: list[tuple[Path, Sequence[Any]]] = [
            (directory / name, [data]) for name, data in self.blobs.items()
        ]
        odd: list[str] = []
        for name, (unique, aliases) in sorted(
            self.tensors.items(), key=lambda kv: sum(t.nbytes for t in kv[1][0].values())
        ):
            buffers = _safetensors_buffers(unique, {ALIASES_KEY: json.dumps(aliases)})
            if buffers is None:  # a dtype the header writer does not know
                odd.append(name)
            else:
                jobs.append((directory / name, buffers))
        timings: dict[str, float] = {}
        files.update(digest.write_files(jobs, timings=timings, cancel=self.cancel))
        for name in odd:  # safetensors' own writer, then read back to hash
            unique, aliases = self.tensors[name]
            save_file(unique, str(directory / name), metadata={ALIASES_KEY: json.dumps(aliases)})
        _seal([directory / name for name in odd], files)
        self.fsync_s = timings.get("fsync_s", 0.0)
        self.write_s = time.perf_counter() - t0 - self.fsync_s


#: safetensors' dtype names (its format spec,
#: https://github.com/huggingface/safetensors#format). The header is written here so
#: that the bytes are hashed on their way to disk; safetensors' reader checks it.
_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    **{
        getattr(torch, name): code
        for name, code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"))
        if hasattr(torch, name)
    },
}


def _safetensors_buffers(
    tensors: Mapping[str, Tensor], metadata: Mapping[str, str]
) -> list[Any] | None:
    """A .safetensors file as buffers (header, then each tensor's bytes), without
    copying a tensor; ``None`` for a dtype this writer does not know.

    The format: 8 bytes of little-endian header length, the JSON header (dtype, shape
    and byte range of each tensor, ``__metadata__``) padded with spaces to a multiple
    of 8, then the tensors' bytes back to back. Tensors go widest dtype first, like
    safetensors' own writer, so each one's offset is a multiple of its element size.
    """
    order = sorted(tensors.items(), key=lambda kv: (-kv[1].element_size(), kv[0]))
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    buffers: list[Any] = []
    offset = 0
    for key, t in order:
        code = _SAFETENSORS_DTYPES.get(t.dtype)
        if code is None or not t.is_contiguous():
            return None
        n = t.numel() * t.element_size()
        header[key] = {"dtype": code, "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        if n:
            buffers.append(t.reshape(-1).view(torch.uint8).numpy())
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return [struct.pack("<Q", len(raw)) + raw, *buffers]


def stems(kind: str, names: list[str]) -> dict[str, str]:
    """The file stem of each optimizer / scheduler: ``optimizer`` for a lone one named
    so (formats 1-2), else ``optimizer.<name>``."""
    if names == [kind]:
        return {kind: kind}
    return {n: f"{kind}.{re.sub(r'[^A-Za-z0-9_-]', '_', n)}" for n in names}


def per_rank(optimizer: Any) -> Any:
    """The optimizer whose ``state_dict()`` this rank saves: ZeroRedundancyOptimizer's
    own needs a consolidation collective and holds every rank's shard; its local
    optimizer holds this rank's, which is what this rank saves and loads."""
    zero = dist.imported_class(
        "torch.distributed.optim.zero_redundancy_optimizer", "ZeroRedundancyOptimizer"
    )
    if zero is not None and isinstance(optimizer, zero):
        return optimizer.optim
    return optimizer


def param_names(model: nn.Module | None) -> dict[int, str]:
    """Each parameter's name in ``model``, by the parameter's ``id``."""
    return {} if model is None else {id(p): n for n, p in model.named_parameters()}


def stage_optimizer(
    part: Part,
    stem: str,
    optimizer: Any,
    *,
    copy: bool = True,
    names: Mapping[int, str] | None = None,
    state_dict: Mapping[str, Any] | None = None,
) -> None:
    """Stage ``optimizer``'s state as ``<stem>.safetensors`` + ``<stem>.json``, with the
    shapes of the parameters it was saved for (the resume's check: a state tensor need
    not have its parameter's shape, like Muon's stacked momentum) and, by group, each
    parameter's name in the model (``names``: by ``id``) and whether it trains: a group
    added during the run (``add_param_group``: a layer unfrozen at step N) is
    re-created from them by a resume whose optimizer was built without it.
    ``state_dict``: the one to stage instead of the optimizer's own."""
    opt = per_rank(optimizer)
    sd = opt.state_dict() if state_dict is None else state_dict
    tensors: dict[str, Tensor] = {}
    state = {str(idx): encode(s, str(idx), tensors) for idx, s in sd["state"].items()}
    groups = encode(list(sd["param_groups"]), "param_groups", tensors)
    shapes = [list(p.shape) for g in opt.param_groups for p in g["params"]]
    doc = {"state": state, "param_groups": groups, "param_shapes": shapes}
    if names:
        doc["group_params"] = [
            [{"name": names.get(id(p)), "requires_grad": p.requires_grad} for p in g["params"]]
            for g in opt.param_groups
        ]
    part.add_tensors(f"{stem}.safetensors", tensors, copy=copy)
    part.add_json(f"{stem}.json", doc)


def _refuse_meta(model: nn.Module) -> None:
    """A model with tensors on the meta device has no values to save: torch's copy
    raised ``NotImplementedError`` ("Cannot copy out of meta tensor") from deep in the
    staging (issue 52). Said before anything is written, with the fix."""
    meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if meta:
        shown = ", ".join(meta[:3]) + (f" and {len(meta) - 3} more" if len(meta) > 3 else "")
        raise CheckpointError(
            f"the model has {len(meta)} tensor(s) on the meta device ({shown}): they hold "
            "no values, so there is nothing to save; nothing was written",
            hint="materialize the model first: model.to_empty(device=...) allocates every "
            "tensor, then load its weights (model.load_state_dict(...), or "
            "guardrails.resume) before training and saving",
        )


def stage_replicated(
    *,
    model: nn.Module | None,
    optimizers: Mapping[str, Any] | None,
    schedulers: Mapping[str, Any] | None = None,
    scaler: Any = None,
    extras: Mapping[str, Any] | None = None,
    copy: bool = True,
    part: Part | None = None,
    extras_name: str = "extras",
    optimizer_state: Callable[[Any], Mapping[str, Any] | None] | None = None,
    scheduler_states: Mapping[str, Mapping[str, Any]] | None = None,
) -> Part:
    """Stage the state every rank holds the same copy of (written once, by rank 0).
    ``model`` ``None``: not here (absent, or sharded and saved by DCP); ``optimizers``:
    those whose state every rank holds the same copy of, by name; ``extras_name``: what
    the caller calls ``extras`` (``g.state``), in a message about a value in it that
    cannot be stored. ``optimizer_state(optimizer)``, ``scheduler_states``: the state
    dicts to save instead of their own (``None``: their own), for a failure save whose
    GPU is a step behind its host."""
    part = part if part is not None else Part()
    # Serialise the caller's values first: a TypeError for a bad extra must come before
    # any file is touched. Their tensors (a best loss kept on the GPU) are staged last,
    # after the model's and optimizers': the pinned staging memory is laid out for
    # those, in that order, ahead of the first save.
    extras_tensors: dict[str, Tensor] = {}
    part.add_json(
        "extras.json", encode(dict(extras or {}), extras_name, extras_tensors, devices=True)
    )
    if model is not None:
        _refuse_meta(model)
        part.add_tensors("model.safetensors", model.state_dict(), copy=copy)
    optimizers = dict(optimizers or {})
    names = param_names(model) if optimizers else {}
    for name, stem in stems("optimizer", list(optimizers)).items():
        opt = optimizers[name]
        sd = None if optimizer_state is None else optimizer_state(opt)
        stage_optimizer(part, stem, opt, copy=copy, names=names, state_dict=sd)
    schedulers = dict(schedulers or {})
    for name, stem in stems("scheduler", list(schedulers)).items():
        held = None if scheduler_states is None else scheduler_states.get(name)
        sd = dict(schedulers[name].state_dict() if held is None else held)
        try:
            part.add_json(f"{stem}.json", encode(sd, stem))
        except TypeError as e:
            # Schedulers with tensors or non-string keys in their state (rare, e.g. a
            # custom one) are not JSON; torch.save keeps them exact. resume() reads this
            # file with weights_only=True, so it can hold containers and tensors, never code.
            log.debug("guardrails: scheduler state is not JSON (%s); using %s.pt", e, stem)
            buf = io.BytesIO()
            torch.save(sd, buf)
            part.blobs[f"{stem}.pt"] = buf.getvalue()
    if scaler is not None:
        part.add_json("scaler.json", encode(scaler.state_dict(), "scaler"))
    if extras_tensors:
        part.add_tensors(EXTRAS_TENSORS, extras_tensors, copy=copy, sized=False)
    return part


def stage_rank(
    rank: int,
    *,
    state: Mapping[str, Any] | None = None,
    tensors: Mapping[str, Tensor] | None = None,
    optimizers: Mapping[str, Any] | None = None,
    part: Part | None = None,
    names: Mapping[int, str] | None = None,
    rng: Mapping[str, Any] | None = None,
    optimizer_state: Callable[[Any], Mapping[str, Any] | None] | None = None,
) -> Part:
    """Stage one rank's own state: every RNG stream (``rng``: the streams as a step
    boundary left them, ``engine/boundary.py``'s, instead of the current ones), plus
    ``state`` (JSON: data position, guard state), ``tensors`` (e.g. the epoch-start RNG
    states) and the state of the ``optimizers`` whose state differs per rank
    (``rank<R>.<stem>.*``; ``optimizers`` maps their stem to the optimizer; ``names``:
    their parameters' names in the model, by ``id``; ``optimizer_state``: as
    :func:`stage_replicated`'s)."""
    part = part if part is not None else Part()
    for stem, optimizer in (optimizers or {}).items():
        sd = None if optimizer_state is None else optimizer_state(optimizer)
        stage_optimizer(part, f"{_rank_name(rank)}.{stem}", optimizer, names=names, state_dict=sd)
    rng = current_streams() if rng is None else rng
    version, internal, gauss = rng["python"]
    kind, keys, pos, has_gauss, cached = rng["numpy"]
    doc = {
        "rank": rank,
        "rng": {
            "python": [version, list(internal), gauss],
            "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        },
        **encode(dict(state or {}), f"rank{rank}"),
    }
    streams = {k: v for k, v in rng.items() if k.startswith("torch.")}
    part.add_json(f"{_rank_name(rank)}.json", doc)
    rank_tensors = {**streams, **(tensors or {})}
    part.add_tensors(f"{_rank_name(rank)}.safetensors", rank_tensors, copy=True, sized=False)
    return part


def current_streams() -> dict[str, Any]:
    """Every RNG stream as it is now, as :func:`stage_rank`'s ``rng`` takes them (what it
    saves without one; a failure save after the update passes them)."""
    streams: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(legacy=True),
        "torch.cpu": torch.get_rng_state(),
    }
    # Only when CUDA is already initialized: reading the CUDA generators would otherwise
    # create a context on every device (seconds, and memory on each GPU) just to save a
    # state that nothing has drawn from.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            streams[f"torch.cuda.{i}"] = s
    return streams


def device_idle(stream: Any, *, within_s: float = 1.0) -> bool:
    """Whether the training ``stream`` (the main thread's at the guard's start) has
    finished all it was given (asked without waiting, for up to ``within_s``). The host
    runs ahead of a GPU: a rank stuck in step 72's backward had step 71's update still
    queued behind an all-reduce whose peer hung (2 DDP ranks over NCCL, H200), so its
    weights were step 70's."""
    deadline = time.monotonic() + within_s
    while not stream.query():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


class SideStreams:
    """CUDA streams of the failure save's own on ``device``, made ahead (the process's
    first ``torch.cuda.Stream()`` waits for the device: torch's stream pool starts; 3.06
    s behind a 3 s kernel on an H200, 0.04 s once made), and :meth:`pick`, which finds
    one whose queue moves. The driver maps streams onto a few hardware queues
    (``CUDA_DEVICE_MAX_CONNECTIONS``, 8 by default): a stream that shares one with the
    stuck training stream waits behind it whatever its own work: the likeliest cause of
    what two H200s showed (a thread's copy on its own stream into fresh pinned memory
    waited ~17 s for a spin kernel on the training stream; a 10 GB copy into plain
    memory behind a stuck NCCL all-reduce never ran; the same copy in another process
    did not wait). One stream per queue, and a probe on each."""

    def __init__(self, device: torch.device) -> None:
        queues = int(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "8") or 8)
        #: The main thread's stream at start (the training stream).
        self.training = torch.cuda.current_stream(device)
        self._streams = [torch.cuda.Stream(device) for _ in range(max(1, min(queues, 32)))]
        self._probes = [torch.cuda.Event() for _ in self._streams]
        #: How many streams the last :meth:`pick` found stuck (``None``: none asked).
        self.blocked: int | None = None
        #: The streams whose probe's record never returned (a full hardware queue).
        self._stuck: set[int] = set()

    @property
    def count(self) -> int:
        return len(self._streams)

    def pick(self, *, within_s: float = 1.0) -> Any | None:
        """A stream whose queue runs now: an event recorded on each, the first one done
        (asked without waiting, for up to ``within_s``); ``None`` when none is.

        Each record is pushed from a thread of its own: pushing onto a hardware queue
        that is full (the training stream's, behind a stuck all-reduce with a step's
        kernels queued after it) blocks the caller for good. Such a stream is never
        tried again; its thread is left where it waits."""
        recorded = {}
        for i, (stream, probe) in enumerate(zip(self._streams, self._probes, strict=True)):
            if i in self._stuck:
                continue
            recorded[i] = threading.Event()
            threading.Thread(
                target=self._record,
                args=(probe, stream, recorded[i]),
                name=f"guardrails-probe-{i}",
                daemon=True,
            ).start()
        deadline = time.monotonic() + within_s
        while True:
            done = [i for i, r in recorded.items() if r.is_set() and self._probes[i].query()]
            if done or time.monotonic() >= deadline:
                self._stuck |= {i for i, r in recorded.items() if not r.is_set()}
                self.blocked = len(self._streams) - len(done)
                return self._streams[done[0]] if done else None
            time.sleep(0.01)

    @staticmethod
    def _record(probe: Any, stream: Any, recorded: threading.Event) -> None:
        probe.record(stream)
        recorded.set()


@contextlib.contextmanager
def own_stream(stream: Any) -> Iterator[None]:
    """This thread's copies (and :meth:`Part.ready`'s wait) on ``stream`` (from
    :meth:`SideStreams.pick`), which waits for no other: a failure save from the watchdog's
    thread while the training stream is stuck in a collective. ``None``: nothing."""
    if stream is None:
        yield
        return
    with torch.cuda.stream(stream):
        yield
