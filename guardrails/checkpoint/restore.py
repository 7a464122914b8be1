"""Checkpoints that are complete, atomic and verified, and the exact resume that reads them.

A resumed run silently loses whatever the checkpoint left out: the optimizer moments,
the LR schedule position, the loss scale, the RNG streams (so dropout and shuffling
differ, and the run cannot be reproduced), and, worst, the checkpoint itself when the
job was killed halfway through ``torch.save``. This module is the on-disk format, the
atomic commit, checksum verification, retention and :func:`resume`; signals, periodic
and background saves and the data-loader position are :mod:`guardrails._checkpointer`,
sharded (FSDP2 / DTensor) model and optimizer state :mod:`guardrails._sharded`.

The format (``format_version`` 3; formats 1 and 2 still read), one directory per
committed step::

    root/
      step_000001200/
        model.safetensors       model.state_dict(); each storage once, tied keys recorded
                                as aliases in the header metadata ("guardrails.aliases")
        optimizer.safetensors   every tensor of optimizer.state_dict(), keyed
                                "<param_idx>.<name>" (e.g. "3.exp_avg")
        optimizer.json          param_groups and the non-tensor state, tensors referenced
                                as {"__tensor__": "3.exp_avg"}, and the shapes of the
                                parameters the state was saved for
        optimizer.<name>.*      the same, per optimizer, when the guard has several
        scheduler.json          scheduler.state_dict() (scheduler.pt when not JSON-able;
                                scheduler.<name>.* when several)
        scaler.json             GradScaler.state_dict()
        extras.json             the caller's extras (JSON values only)
        rank00000.json          each rank's own state: python and numpy RNG, the data
        rank00000.safetensors   position, the guard's state; torch CPU and CUDA RNG
        rank00001.* ...         (one pair per rank)
        rank00000.optimizer.*   optimizer state that differs per rank (a
                                ZeroRedundancyOptimizer's shard), one set per rank
        dcp/                    sharded model and optimizer state, written by every rank
                                through torch.distributed.checkpoint (instead of
                                model.safetensors and optimizer.*)
        manifest.json           written LAST: bytes and sha256 of every file above (a
                                file over 64 MiB: the sha256 of its 64 MiB pieces'
                                sha256 digests, "sha256_chunk_bytes" says so), step,
                                time, versions, world size and ranks; "contents" (each
                                optimizer's and scheduler's file stem, whether it was
                                saved per rank, and their classes, checked before
                                anything is applied at resume); "run" (the run's config
                                and its optimizers' settings as the code built them,
                                and "finished_at" once the run ended normally: see
                                :func:`run_record`); and "manifest_sha256", the
                                manifest's hash of itself
      step_000001300/ ...

What each format added: 2 moved the RNG streams from ``rng.json`` / ``rng.safetensors``
(rank 0's only) into the per-rank ``rank<R>.*`` files; 3 added several optimizers and
schedulers, optimizer state saved per rank, the parameter shapes, and ``contents``; 4
hashes a file over 64 MiB in pieces (``sha256_chunk_bytes``: written and verified by
several threads at disk speed, see ``_digest.py``), which a format-3 reader would take
for corruption. ``manifest_sha256``, the classes in ``contents`` and ``run`` are
optional on read, so checkpoints written before them still load.

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
  checkpoint is never deleted;
* killed during a re-save of a step that exists (a resumed run saving the step it
  resumed): the old ``step_<N>`` is renamed to ``.aside-step_<N>``, the new one renamed
  in, then the aside deleted. Between the two renames the aside is that step's
  checkpoint: :func:`list_checkpoints` lists it while ``step_<N>`` is missing, and the
  next save renames it back. Before this, a kill there lost both copies (both under
  names no reader picks), and with ``keep_last=1`` the run restarted at step 0.

Runs kept apart: a guard's checkpoints carry its run's id (``run.id`` in the manifest:
new for a fresh start, carried over by a resume). Retention counts only this run's
checkpoints, and a resume tries the run that saved last first
(:func:`~guardrails._manifest.resume_order`): a fresh run started beside another run's
checkpoints no longer has its low steps deleted for the other run's high ones, nor does
a later ``resume="auto"`` pick the other run's.

Storage errors: a save that cannot write (a full disk, a read-only remount, missing
permissions) raises :class:`~guardrails.CheckpointError` naming the cause and the fix
(free space, the permissions, another ``run_dir``) and the latest checkpoint that
remains; the partial temp directory is removed and nothing that resume would pick is
left behind.

Readers trust nothing: a checkpoint counts as valid only when ``manifest.json`` parses,
matches its own ``manifest_sha256`` (a flipped bit in the manifest could otherwise
change the step or a file's recorded hash), names no file outside its directory, and
every file it lists has the recorded size and sha256. Resuming from a run directory
takes the newest valid one and logs why each newer one was skipped (a disk that filled
up, a bit flip in transit, a truncated copy). Everything is checked (checksums, the
saved classes, then key names and shapes against the model and optimizer) before
anything is loaded, so a ``CheckpointError`` or ``ResumeError`` leaves the model,
optimizer, scheduler and scaler exactly as they were.

Distributed runs: :func:`save_checkpoint` called directly writes rank 0's copy, which
is complete for replicated state (DDP, where every rank holds the same weights and
optimizer state); other ranks return without writing. The guard's saves write every
rank's own files into one temp directory, and rank 0 writes the manifest and renames:
one atomic commit for the whole job (:mod:`guardrails._checkpointer`).

Only one process may save into a ``root`` at a time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import logging
import os
import pickle
import random
import re
import shutil
import signal
import struct
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from guardrails import _digest, _dist, _perms, _sharded, _storage
from guardrails._checks import named
from guardrails._errors import CheckpointError, GuardrailsError, ResumeError

# The manifest and the checks of a checkpoint's files, torch-free (`inspect` uses them).
from guardrails._manifest import (
    ASIDE_RE,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    SELF_HASH,
    STEP_RE,
    Bad,
    ManifestError,
    _contents,
    _dumps,
    _rank_name,
    _self_hash,
    list_checkpoints,
    not_regular,
    read_json,
    resume_order,
    run_of,
)
from guardrails._manifest import check_rng as _manifest_check_rng
from guardrails._manifest import problem as _manifest_problem
from guardrails._manifest import read_manifest as _manifest_read
from guardrails._text import shorten
from guardrails._version import __version__

log = logging.getLogger("guardrails.checkpoint")

_TMP_PREFIX = ".tmp-"
_TRASH_PREFIX = ".trash-"
_ASIDE_PREFIX = ".aside-"
#: Tests only: SIGKILL this process at the named point of a commit (a real kill, in the
#: real process), to check that every point leaves a loadable checkpoint.
CRASH_ENV = "GUARDRAILS_TEST_CRASH_AT"
#: Header metadata key of a .safetensors file that maps alias key -> stored key.
ALIASES_KEY = "guardrails.aliases"
#: Optimizer states that are elementwise copies of their parameter's shape, so a shape
#: mismatch is a certain sign of a different model. (Factored states such as
#: Adafactor's row/column statistics legitimately differ and are not checked.)
_ELEMENTWISE_STATE = frozenset(
    {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "sum"}
    | {"acc_delta", "grad_avg", "prev", "ax"}  # not NAdam's mu_product: a scalar
)


# ----------------------------------------------------------------------------- save


class Staging:
    """Pinned host memory for device tensors, allocated once and reused by every save.

    A fresh pinned allocation per save cost the first periodic save of a 10 GB state
    5.9 s on an H200 (pinning the pages is the slow part, not the copy). Here the
    memory is a few pinned blocks, laid out the same way at every save (the state's
    tensors keep their sizes), so from the second save on staging is only the
    device-to-host copy (~0.5 s for 10 GB at PCIe speed). :meth:`prepare` allocates
    the blocks ahead of the first save, in a thread. Blocks are powers of two (torch's
    pinned allocator rounds every request up to one, so a 10 GB block would pin 16).

    One save uses it at a time: a save waits for the previous save's writer, which
    reads from these blocks, before it stages.
    """

    #: At least this many bytes per block: few blocks (a handful of cudaHostAlloc calls)
    #: and at most one block's tail unused.
    BLOCK_BYTES = 1 << 30
    _ALIGN = 64  # each tensor's offset: any dtype's alignment, and a cache line

    def __init__(self) -> None:
        self._blocks: list[Tensor] = []
        self._lock = threading.Lock()  # prepare()'s thread vs a save's place()
        self._thread: threading.Thread | None = None

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self._blocks)

    def prepare(self, sizes: list[int], device: torch.device | None = None) -> None:
        """Allocate, in a background thread, the blocks a save of tensors of ``sizes``
        bytes needs (the layout :meth:`place` will use), pinned from ``device``'s CUDA
        context: a new thread's current device is GPU 0, whatever the rank's."""
        if self._thread is not None:
            return

        def grow() -> None:
            if device is not None and device.type == "cuda":
                torch.cuda.set_device(device)
            self._grow(sizes)

        self._thread = threading.Thread(target=grow, name="guardrails-checkpoint-pin", daemon=True)
        self._thread.start()

    def place(self, tensors: list[Tensor]) -> list[Tensor]:
        """A pinned host tensor for each device tensor (same dtype and shape), in this
        staging's blocks, allocating what is missing now."""
        if self._thread is not None:  # the ahead-of-time allocation: wait for it
            self._thread.join()
        sizes = [t.numel() * t.element_size() for t in tensors]
        self._grow(sizes)
        out = []
        for t, (block, offset, n) in zip(tensors, self._layout(sizes), strict=True):
            out.append(self._blocks[block][offset : offset + n].view(t.dtype).view(t.shape))
        return out

    def _grow(self, sizes: list[int]) -> None:
        with self._lock:
            self._layout(sizes, allocate=True)

    def _layout(self, sizes: list[int], *, allocate: bool = False) -> list[tuple[int, int, int]]:
        """``(block, offset, bytes)`` per tensor, first fit in order; with ``allocate``,
        missing blocks are allocated (else they must exist)."""
        where = []
        block, offset = 0, 0
        for n in sizes:
            while True:
                if block == len(self._blocks):
                    if not allocate:
                        raise RuntimeError("staging blocks were not allocated")
                    size = max(self.BLOCK_BYTES, 1 << max(0, (n - 1).bit_length()))
                    self._blocks.append(torch.empty(size, dtype=torch.uint8, pin_memory=True))
                if offset + n <= self._blocks[block].numel():
                    break
                block, offset = block + 1, 0
            where.append((block, offset, n))
            offset += -(-n // self._ALIGN) * self._ALIGN
        return where


class Part:
    """What one rank writes into one checkpoint, already copied off the live objects, so
    a writer thread can serialise it while training mutates the originals.

    Staging is the only part of a save that must block training: device tensors are
    copied to pinned host memory (``staging``'s reused blocks, or fresh pinned memory
    without one) with ``non_blocking`` copies and one wait at the end (:meth:`ready`),
    host tensors are cloned, and everything that is not a tensor is serialised to bytes
    at once.
    """

    def __init__(self, staging: Staging | None = None, *, measure: bool = False) -> None:
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
        self.write_s = 0.0
        self.fsync_s = 0.0
        #: Set to abandon the write (the pieces not yet written are not): a stop's save
        #: supersedes a periodic save still being written.
        self.cancel = threading.Event()
        self._staging = staging
        #: With ``measure``, nothing is copied: only the device tensors' byte sizes are
        #: collected (what :meth:`Staging.prepare` needs), in staging order.
        self._measure = measure
        self.device_bytes: list[int] = []
        # Device tensors waiting for ready(): (file name, key, tensor)
        self._on_device: list[tuple[str, str, Tensor]] = []

    @property
    def nbytes(self) -> int:
        n = sum(len(b) for b in self.blobs.values())
        for unique, _ in self.tensors.values():
            n += sum(t.numel() * t.element_size() for t in unique.values())
        return n

    def add_tensors(self, name: str, tensors: Mapping[str, Any], *, copy: bool) -> None:
        """Stage ``tensors`` for ``name`` (a .safetensors file), each storage once.

        safetensors refuses tensors that share memory (tied embeddings: ``lm_head.weight``
        *is* ``embed.weight``). The same view under two keys is stored once and the other
        key recorded as an alias; different views of one storage are copied apart.
        ``copy``: clone host tensors too (the caller goes on mutating them).
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
            if t.device.type != "cpu":
                # Copied into pinned memory by ready(), all at once, with one wait.
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
        if self._staging is not None:
            targets = self._staging.place(sources)
            for dst, src in zip(targets, sources, strict=True):
                dst.copy_(src, non_blocking=True)
        else:  # into fresh pinned memory
            targets = [t.to("cpu", non_blocking=True) for t in sources]
        for (name, key, _), dst in zip(self._on_device, targets, strict=True):
            self.tensors[name][0][key] = dst
        self._on_device = []
        torch.cuda.synchronize()

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
        files.update(_digest.write_files(jobs, timings=timings, cancel=self.cancel))
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
    zero = _dist.imported_class(
        "torch.distributed.optim.zero_redundancy_optimizer", "ZeroRedundancyOptimizer"
    )
    if zero is not None and isinstance(optimizer, zero):
        return optimizer.optim
    return optimizer


def stage_optimizer(part: Part, stem: str, optimizer: Any, *, copy: bool = True) -> None:
    """Stage ``optimizer``'s state as ``<stem>.safetensors`` + ``<stem>.json``, with the
    shapes of the parameters it was saved for (the resume's check: a state tensor need
    not have its parameter's shape, like Muon's stacked momentum)."""
    opt = per_rank(optimizer)
    sd = opt.state_dict()
    tensors: dict[str, Tensor] = {}
    state = {str(idx): _encode(s, str(idx), tensors) for idx, s in sd["state"].items()}
    groups = _encode(list(sd["param_groups"]), "param_groups", tensors)
    shapes = [list(p.shape) for g in opt.param_groups for p in g["params"]]
    part.add_tensors(f"{stem}.safetensors", tensors, copy=copy)
    part.add_json(f"{stem}.json", {"state": state, "param_groups": groups, "param_shapes": shapes})


def stage_replicated(
    *,
    model: nn.Module | None,
    optimizers: Mapping[str, Any] | None,
    schedulers: Mapping[str, Any] | None = None,
    scaler: Any = None,
    extras: Mapping[str, Any] | None = None,
    copy: bool = True,
    part: Part | None = None,
) -> Part:
    """Stage the state every rank holds the same copy of (written once, by rank 0).
    ``model`` ``None``: not here (absent, or sharded and saved by DCP); ``optimizers``:
    those whose state every rank holds the same copy of, by name."""
    part = part if part is not None else Part()
    # Serialise the caller's values first: a TypeError for a bad extra must come before
    # any file is touched.
    part.add_json("extras.json", _encode(dict(extras or {}), "extras"))
    if model is not None:
        part.add_tensors("model.safetensors", model.state_dict(), copy=copy)
    optimizers = dict(optimizers or {})
    for name, stem in stems("optimizer", list(optimizers)).items():
        stage_optimizer(part, stem, optimizers[name], copy=copy)
    schedulers = dict(schedulers or {})
    for name, stem in stems("scheduler", list(schedulers)).items():
        sd = dict(schedulers[name].state_dict())
        try:
            part.add_json(f"{stem}.json", _encode(sd, stem))
        except TypeError as e:
            # Schedulers with tensors or non-string keys in their state (rare, e.g. a
            # custom one) are not JSON; torch.save keeps them exact. resume() reads this
            # file with weights_only=True, so it can hold containers and tensors, never code.
            log.debug("guardrails: scheduler state is not JSON (%s); using %s.pt", e, stem)
            buf = io.BytesIO()
            torch.save(sd, buf)
            part.blobs[f"{stem}.pt"] = buf.getvalue()
    if scaler is not None:
        part.add_json("scaler.json", _encode(scaler.state_dict(), "scaler"))
    return part


def stage_rank(
    rank: int,
    *,
    state: Mapping[str, Any] | None = None,
    tensors: Mapping[str, Tensor] | None = None,
    optimizers: Mapping[str, Any] | None = None,
    part: Part | None = None,
) -> Part:
    """Stage one rank's own state: every RNG stream, plus ``state`` (JSON: data position,
    guard state), ``tensors`` (e.g. the epoch-start RNG states) and the state of the
    ``optimizers`` whose state differs per rank (``rank<R>.<stem>.*``; ``optimizers``
    maps their stem to the optimizer)."""
    part = part if part is not None else Part()
    for stem, optimizer in (optimizers or {}).items():
        stage_optimizer(part, f"{_rank_name(rank)}.{stem}", optimizer)
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    doc = {
        "rank": rank,
        "rng": {
            "python": [version, list(internal), gauss],
            "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        },
        **_encode(dict(state or {}), f"rank{rank}"),
    }
    rng = {"torch.cpu": torch.get_rng_state()}
    # Only when CUDA is already initialized: reading the CUDA generators would otherwise
    # create a context on every device (seconds, and memory on each GPU) just to save a
    # state that nothing has drawn from.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            rng[f"torch.cuda.{i}"] = s
    part.add_json(f"{_rank_name(rank)}.json", doc)
    part.add_tensors(f"{_rank_name(rank)}.safetensors", {**rng, **(tensors or {})}, copy=True)
    return part


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
) -> Path:
    """Seal ``tmp`` as ``root/step_<N>``: manifest last, fsync, one atomic rename.

    Called by rank 0 once every rank's files are in ``tmp`` (``files`` lists them all).
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
        "contents": dict(contents or {}),
        **({"run": dict(run)} if run else {}),
        "files": files,
    }
    # The manifest is the commit record of the files: written last, so its presence
    # means every file above was fully written and fsynced.
    manifest[SELF_HASH] = _self_hash(manifest)
    # Files safetensors and DCP created with their own mode (0o666 less the umask):
    # never group/other-writable once committed, even under umask 000.
    _perms.restrict_tree(tmp)
    _write_bytes(tmp / MANIFEST, _dumps(manifest), {})
    _digest.fsync_path(tmp)
    if final.exists():  # the same step saved again (a resumed run): replace it
        _replace(root, final, tmp)
    else:
        os.rename(tmp, final)
    _digest.fsync_path(root)
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
                _storage.fix_for(e, root),
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
    _digest.fsync_path(root)
    shutil.rmtree(aside, ignore_errors=True)


def _crash_point(name: str) -> None:
    """Tests: a real SIGKILL of this process at commit point ``name`` when the
    environment asks for it (:data:`CRASH_ENV`)."""
    if os.environ.get(CRASH_ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)


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
    cause = _storage.cause_of(e, root)
    text = f"could not write checkpoint {final}: {f'{cause}: ' if cause else ''}{e}"
    if latest:
        text += f"; the latest checkpoint is still {latest[0]} (step {latest[1]}), untouched"
    elif latest is None:
        text += f"; no earlier checkpoint exists under {root}"
    return CheckpointError(
        text,
        step=step,
        path=str(final),
        hint=_storage.fix_for(e, root, run_dir=run_dir) + ".",
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
        extras: the caller's own state (``{"best_val": 1.92, "epoch": 3}``); JSON values
            only, a ``TypeError`` says which key is not.
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
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if not isinstance(model, nn.Module):
        # resume() always loads a model: a checkpoint without one could never be
        # resumed, and that would only be found at the restart that needs it.
        raise TypeError(
            f"save_checkpoint() needs the model (an nn.Module), got {type(model).__name__}: "
            "resume() loads a checkpoint into a model, so a checkpoint without one could "
            "not be resumed. Pass model=your_model."
        )
    root = Path(root)
    final = root / f"step_{step:09d}"
    optimizers = {} if optimizer is None else named("optimizer", optimizer, torch.optim.Optimizer)
    schedulers = {} if scheduler is None else named("scheduler", scheduler, object)
    if _dist.world_size() > 1 and any(per_rank(o) is not o for o in optimizers.values()):
        raise ValueError(
            "save_checkpoint() writes rank 0's copy of the state, but a "
            "ZeroRedundancyOptimizer holds a different shard on every rank. Save with "
            "the guard instead (g.save_checkpoint(), periodic or signal saves): every "
            "rank writes its own part."
        )
    rank = _dist.rank()
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
    tmp: Path | None = None
    files: dict[str, dict[str, Any]] = {}
    try:
        _perms.make_dirs(root)
        remove_leftovers(root)
        tmp = begin(root, step, uuid.uuid4().hex[:8])
        part.write(tmp, files)
        final = commit(
            root,
            step,
            tmp,
            files,
            world_size=_dist.world_size(),
            ranks=[0],
            keep_last=keep_last,
            contents=contents_of(optimizers, schedulers, set()),
        )
    except BaseException as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if not _storage.is_storage_error(e):
            raise
        raise write_error(final, step, e, run_dir=False) from e
    log.info(
        "guardrails: checkpoint step %d committed to %s (%.1f MB in %.2f s)",
        step,
        final,
        part.nbytes / 1e6,
        time.perf_counter() - t0,
    )
    return final


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
            raise e.rehint(_skip_hint(ckpt)) from None
    else:
        found, plan, skipped = pick(path, prep)
        for name, why in skipped:
            log.warning("guardrails: skipped checkpoint %s: %s; using %s", name, why, found)
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
) -> Plan:
    """Read every part of ``ckpt`` this rank loads and check it against what it loads
    into; nothing is modified. Only files the manifest lists are read (each was
    verified by :func:`pick`: its size, sha256 and schema). A part whose content cannot
    be decoded or does not fit its own class's state is a ``CheckpointError`` naming
    the file and the field (the checkpoint is damaged: a resume from the root falls
    back to an older one); one that does not fit this run (another model, optimizer,
    world size) is a ``ResumeError``. ``check(rank_state, rank_file)``: the caller's
    own checks of this rank's saved state (the guard's: the data position against its
    loader)."""
    manifest = _read_manifest(ckpt)
    step = int(manifest["step"])
    files = manifest["files"]
    rank, world = _dist.rank(), _dist.world_size()
    saved_world = int(manifest.get("world_size", 1))
    if saved_world != world and not allow_world_size_change:
        raise ResumeError(
            f"checkpoint {ckpt} was written by {saved_world} rank(s); this run has {world}. "
            "Restorable: the model, optimizer, scheduler, scaler and extras (every rank "
            "holds the same copy). Not restorable: each rank's RNG streams and data "
            "position, because each rank's share of the data changes with the world size",
            step=step,
            rank=rank,
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
    opt_sds: list[tuple[Any, dict[str, Any]]] = []
    pairs = [] if sharded else _pair(ckpt, step, "optimizer", optimizers, contents, strict)
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
        with reader.reading(f"{stem}.json"):
            _check_optimizer(ckpt, step, name if len(optimizers) > 1 else None, opt, sd, model)
            _check_optimizer_values(reader, f"{stem}.json", opt, sd)
        opt_sds.append((opt, sd))
    sched_sds = []
    for _, sched, saved in _pair(ckpt, step, "scheduler", schedulers, contents, strict):
        sd = _component_state(reader, saved, strict)
        if isinstance(sd, Mapping) and _torch_own(sched, "torch.optim.lr_scheduler"):
            reader.like(f"{saved}.json", sd, sched.state_dict())
        sched_sds.append((sched, sd))
    scaler_sd = None if scaler is None else _component_state(reader, "scaler", strict)
    if scaler_sd is not None and not scaler_sd and scaler.is_enabled():
        raise ResumeError(
            f"checkpoint {ckpt} holds the state of a disabled GradScaler; this run's is "
            "enabled, so there is no scale to continue from",
            step=step,
            path=str(ckpt),
            hint="resume with the scaler as it was saved (enabled=False), or without it: "
            "leave scaler= out and the scaler starts from its initial scale. Nothing was "
            "modified.",
        )
    if scaler_sd and _torch_own(scaler, "torch."):
        reader.like("scaler.json", scaler_sd, scaler.state_dict())
    extras = _decode(reader.json("extras.json")) if "extras.json" in files else {}
    if not isinstance(extras, dict):
        raise reader.bad("extras.json", "", f"holds {type(extras).__name__}, not an object")
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
        rank_state = _decode(reader.json(f"{name}.json"))
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
    else:
        log.warning(
            "guardrails: %s holds no state of rank %d (it was saved by rank 0 alone, with "
            "save_checkpoint()); this rank's RNG streams start fresh",
            ckpt,
            rank,
        )
    return Plan(
        ckpt=ckpt,
        step=step,
        model=model,
        strict=strict,
        sharded=sharded,
        model_sd=model_sd,
        optimizers=optimizers,
        opt_sds=opt_sds,
        sched_sds=sched_sds,
        scaler=scaler,
        scaler_sd=scaler_sd,
        extras=extras,
        rank_state=rank_state,
        rank_tensors=rank_tensors,
        rng=rng,
    )


def apply(plan: Plan) -> dict[str, Any]:
    """Apply what :func:`prepare` read and checked. Every check that can fail on a
    mismatch or a damaged file ran there."""
    if plan.sharded:
        # A collective: every rank loads together (one optimizer with sharded state).
        _sharded.load(plan.ckpt, plan.model, next(iter(plan.optimizers.values()), None))
    elif plan.model_sd is not None:
        plan.model.load_state_dict(plan.model_sd, strict=plan.strict)
    for opt, sd in plan.opt_sds:
        per_rank(opt).load_state_dict(sd)
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
    }


class _Reader:
    """Reads a checkpoint's listed files, and only those, turning whatever a damaged
    file raises (``SafetensorError``, ``JSONDecodeError``, ``KeyError``...) into a
    ``CheckpointError`` naming the file and the field."""

    def __init__(self, ckpt: Path, step: int, files: Mapping[str, Any]) -> None:
        self.ckpt, self.step, self.files = ckpt, step, files

    def path(self, name: str) -> Path:
        if name not in self.files:
            raise self.bad(name, "", f"is not among the files {MANIFEST} lists, so it is not read")
        return self.ckpt / name

    def json(self, name: str) -> Any:
        with self.reading(name):
            return read_json(self.path(name))

    def tensors(self, name: str) -> dict[str, Tensor]:
        with self.reading(name):
            return _read_tensors(self.path(name))

    @contextlib.contextmanager
    def reading(self, name: str, field: str = "") -> Iterator[None]:
        try:
            yield
        except GuardrailsError:
            raise
        except Bad as e:
            raise self.bad(name, e.field, e.why) from None
        except _DAMAGE as e:
            raise self.bad(name, field, f"cannot be decoded ({type(e).__name__}: {e})") from None

    def bad(self, name: str, field: str, why: str) -> CheckpointError:
        f = self.ckpt / name
        what = f"field {field} " if field else ""
        return CheckpointError(
            f"checkpoint {self.ckpt} is not valid: {f} is corrupt: {what}{why}",
            step=self.step,
            path=str(f),
            field=field or None,
        )

    def like(self, name: str, saved: Any, live: Any) -> None:
        """``saved`` (a state_dict read from ``name``) has the types of ``live`` (the
        live object's own state_dict, of the same class): a number where it holds a
        number, a list as long as its list. Strings, booleans and ``None`` on the live
        side are not compared (their defaults change between torch versions)."""
        problem = _unlike(saved, live, "")
        if problem is not None:
            raise self.bad(name, *problem)


#: What reading a damaged file can raise, besides guardrails' own errors.
_DAMAGE = (
    OSError,
    ValueError,
    TypeError,
    KeyError,
    IndexError,
    OverflowError,
    RecursionError,
    AttributeError,
    SafetensorError,
    RuntimeError,
    pickle.UnpicklingError,
    EOFError,
)


def _torch_own(obj: Any, module: str) -> bool:
    """Whether ``obj`` is of one of torch's own classes, whose state keeps its shape
    (a list of one lr per group); a user's scheduler may keep a history that grows, so
    its fresh state is no template for a saved one."""
    return type(obj).__module__.startswith(module)


def _unlike(saved: Any, live: Any, field: str) -> tuple[str, str] | None:
    """``(field, why)`` where ``saved`` does not have ``live``'s types, or ``None``."""
    if isinstance(live, bool) or live is None or isinstance(live, str):
        return None
    if isinstance(live, (int, float)):
        # Not int against float: a scheduler decays an lr given as 1 to 0.5; the fields
        # that must be integers are checked with the file (_manifest's schemas).
        if isinstance(saved, bool) or not isinstance(saved, (int, float, Tensor)):
            return field, f"is {_show(saved)}, where this run's holds a number ({live!r})"
        return None
    if isinstance(live, Tensor):
        if not isinstance(saved, (Tensor, int, float)) or isinstance(saved, bool):
            return field, f"is {_show(saved)}, where this run's holds a tensor"
        return None
    if isinstance(live, (list, tuple)):
        if not isinstance(saved, (list, tuple)):
            return field, f"is {_show(saved)}, where this run's holds a list of {len(live)}"
        if len(saved) != len(live):
            return field, f"has {len(saved)} items, where this run's has {len(live)}"
        for i, (s, v) in enumerate(zip(saved, live, strict=True)):
            found = _unlike(s, v, f"{field}[{i}]")
            if found is not None:
                return found
        return None
    if isinstance(live, Mapping):
        if not isinstance(saved, Mapping):
            return field, f"is {_show(saved)}, where this run's holds an object"
        for key in saved:
            if key in live:
                found = _unlike(saved[key], live[key], f"{field}.{key}" if field else str(key))
                if found is not None:
                    return found
    return None


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:30] + "..."


def _check_optimizer_values(
    reader: _Reader, name: str, optimizer: Any, saved: Mapping[str, Any]
) -> None:
    """The saved param groups' settings have the types of the live optimizer's (a
    string ``lr`` loads, then the first step dies)."""
    groups = per_rank(optimizer).param_groups
    for i, (g, s) in enumerate(zip(groups, saved["param_groups"], strict=True)):
        if not isinstance(s, Mapping):
            raise reader.bad(name, f"param_groups[{i}]", f"is {_show(s)}, not an object")
        # Numbers and tuples only (lr, betas): settings, fixed in shape; a user's
        # optimizer may keep a list in its group that grows.
        live = {
            k: v
            for k, v in g.items()
            if k not in ("params", "param_names") and not isinstance(v, (list, Mapping))
        }
        problem = _unlike({k: v for k, v in s.items() if k in live}, live, f"param_groups[{i}]")
        if problem is not None:
            raise reader.bad(name, *problem)


def _check_rng(
    reader: _Reader,
    name: str,
    tensors_name: str,
    states: Mapping[str, Any] | None,
    tensors: Mapping[str, Tensor],
) -> None:
    """The RNG streams load: each one set into a scratch generator of its kind (their
    own checks, exact), so none can fail while being restored."""
    if states is not None:
        with reader.reading(name, "rng"):
            _manifest_check_rng(states, "rng")
            kind, keys, pos, has_gauss, cached = states["numpy"]
            np.random.RandomState().set_state(
                (kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached)
            )
    for key, t in tensors.items():
        if key == "torch.cpu" or key.startswith("torch.cuda."):
            with reader.reading(tensors_name, key):
                if t.dtype != torch.uint8 or t.dim() != 1:
                    raise ValueError(
                        f"a {t.dtype} tensor of shape {tuple(t.shape)}, not a byte tensor"
                    )
                if key == "torch.cpu":
                    torch.Generator().set_state(t)


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
    _digest.fsync_path(ckpt)


def verify_checkpoint(ckpt: str | os.PathLike[str]) -> str | None:
    """``None`` when ``ckpt`` is a valid checkpoint, else why not (one line, naming the
    file and the field). Reads every byte once (sha256) and checks every listed file's
    content against what guardrails writes there."""
    problem = _problem(Path(ckpt))
    return None if problem is None else problem[1]


def _problem(ckpt: Path, *, entry: bool = False) -> tuple[str, str] | None:
    """``(file, why)`` for the first problem found in ``ckpt``, or ``None``. ``entry``:
    found under a root, so it must not be a link."""
    try:
        return _manifest_problem(ckpt, entry=entry, metadata_check=_sharded.metadata_problem)
    except ManifestError as e:  # a newer format: intact, but not ours to read
        raise _manifest_error(e) from None


def _pick(path: Path) -> Path:
    """The checkpoint directory to load: ``path`` itself when it is one, else the newest
    valid ``step_*`` under it (the skipped ones logged)."""
    found, _, skipped = pick(path)
    for name, why in skipped:
        log.warning("guardrails: skipped checkpoint %s: %s; using %s", name, why, found)
    return found


def pick(path: Path, prepare: Any = None) -> tuple[Path, Any, list[tuple[str, str]]]:
    """``(checkpoint, plan, skipped)``: ``path`` itself when it is a checkpoint, else the
    newest valid ``step_*`` under it, and ``skipped``, each newer one passed over as
    ``(name, why)``. Valid: :func:`_problem` finds nothing and, with ``prepare``,
    ``prepare(ckpt)`` (its ``plan``) raises no ``CheckpointError``: a damaged file is
    damage wherever it is found, so the resume falls back past it. A ``ResumeError``
    (intact, but it does not fit this run, or a newer format) stops the search: an
    older checkpoint would load the same mismatch, or silently lose the newest."""
    if os.path.lexists(path / MANIFEST) or (STEP_RE.match(path.name) and path.is_dir()):
        problem = _problem(path)
        if problem is not None:
            raise _corrupt(path, *problem)
        try:
            return path, None if prepare is None else prepare(path), []
        except CheckpointError as e:  # the hint is computed once, here: it verifies
            raise e.rehint(_skip_hint(path)) from None  # the older checkpoints
    candidates = list_checkpoints(path)
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
            skipped.append((ckpt.name, problem[1]))
            continue
        try:
            return ckpt, None if prepare is None else prepare(ckpt), skipped
        except CheckpointError as e:
            skipped.append((ckpt.name, e.message))
    reasons = "; ".join(f"{n}: {w}" for n, w in skipped)
    raise ResumeError(
        f"every checkpoint under {path} is invalid ({len(skipped)}): {reasons}",
        path=str(path),
        hint="no intact checkpoint is left to resume from: restore the directory from "
        "a backup copy, or start the run from scratch (resume=None, or move these "
        "step_* directories away).",
        remedy="all_invalid",
    )


def _corrupt(ckpt: Path, bad_file: str, why: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {ckpt} is not valid: {why}",
        path=bad_file,
        hint=_skip_hint(ckpt),
    )


def _skip_hint(ckpt: Path) -> str:
    """What to do about an invalid checkpoint: the previous valid one next to it, if
    any (each older one verified, newest first), else a backup."""
    previous = None
    m = STEP_RE.match(ckpt.name) or ASIDE_RE.match(ckpt.name)  # a re-save's aside copy too
    step = int(m.group(m.lastindex or 1)) if m else -1
    for s, p in reversed(list_checkpoints(ckpt.parent)):
        try:
            if s < step and verify_checkpoint(p) is None:
                previous = p
                break
        except GuardrailsError:  # an older one in a newer format: not a candidate
            continue
    if previous is not None:
        return (
            f"resume from the previous valid checkpoint instead ({previous}), or delete "
            f"or move away {ckpt}: a resume from the run's checkpoint directory then "
            "uses the previous one (it skips invalid ones by itself); or start fresh "
            "with resume=None."
        )
    return (
        f"no earlier valid checkpoint exists next to it: restore {ckpt} from a backup, "
        "or start fresh with resume=None (or delete or move it away)."
    )


def _read_manifest(ckpt: Path) -> dict[str, Any]:
    try:
        return _manifest_read(ckpt)
    except ManifestError as e:
        raise _manifest_error(e) from None


def _manifest_error(e: ManifestError) -> CheckpointError | ResumeError:
    if e.too_new:
        return ResumeError(e.message, path=e.path, hint=e.hint, field=e.field)
    return CheckpointError(e.message, path=e.path, field=e.field)


def _check_materialized(ckpt: Path, step: int, model: nn.Module) -> None:
    """The model's tensors have storage: a model built on the meta device (``with
    torch.device("meta")``, accelerate's ``init_empty_weights``) takes no values from
    ``load_state_dict`` (it "resumed" and loaded nothing)."""
    meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if meta:
        raise ResumeError(
            f"the model has {len(meta)} tensor(s) on the meta device ({_short(meta, 3)}): "
            f"they hold no memory, so nothing from {ckpt} could be loaded into them",
            step=step,
            path=str(ckpt),
            hint="materialize the model first, then resume: model.to_empty(device=...) "
            "(allocates every tensor, uninitialized; the resume then fills them). "
            "Nothing was modified.",
        )


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
        hint = (
            "build the model with the same architecture and config that was saved "
            "(width, depth, vocab size, wrappers such as DDP or torch.compile add a "
            "'module.' / '_orig_mod.' prefix)"
        )
        if not shapes:  # only keys differ: loading the matching part can work
            hint += (
                "; to load only the matching part, e.g. a backbone under a new head, pass "
                "strict=False"
            )
        raise ResumeError(
            f"checkpoint {ckpt} does not fit this model; " + "; ".join(problems),
            step=step,
            path=str(ckpt),
            hint=hint + ". The model was not modified.",
            remedy=None if shapes else "strict",
        )


def _pair(
    ckpt: Path,
    step: int,
    kind: str,
    live: Mapping[str, Any],
    contents: Mapping[str, Any],
    strict: bool,
) -> list[tuple[str, Any, Any]]:
    """``(name, live object, what the manifest says of it)`` for each live optimizer /
    scheduler: matched by name, or the lone one to the lone one."""
    saved = contents[f"{kind}s"]
    if not live:
        return []
    if not saved:
        if strict:
            raise _missing(ckpt, step, kind)
        return []
    if len(live) == 1 and len(saved) == 1:
        return [(next(iter(live)), next(iter(live.values())), next(iter(saved.values())))]
    unknown = [n for n in live if n not in saved]
    if unknown and strict:
        raise ResumeError(
            f"checkpoint {ckpt} holds no {kind} named {_short(unknown)}: it holds "
            f"{_short(list(saved))}, this run has {_short(list(live))}",
            step=step,
            path=str(ckpt),
            hint=f"pass the {kind}s under the names they were saved with (the keys of the "
            f"dict, or their positions in the list, given to guard()). Nothing was modified.",
        )
    return [(n, obj, saved[n]) for n, obj in live.items() if n in saved]


def _check_optimizer(
    ckpt: Path,
    step: int,
    name: str | None,
    optimizer: Any,
    saved: Mapping[str, Any],
    model: nn.Module,
) -> None:
    """The saved state fits ``optimizer``: the same param groups, the same number of
    parameters in each, each parameter the shape it had when saved. The state tensors
    themselves are trusted to fit (a state need not have its parameter's shape: Muon
    keeps one stacked momentum per group of parameters)."""
    opt = per_rank(optimizer)
    which = "optimizer" if name is None else f"optimizer {name!r}"
    groups = opt.param_groups
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
        names = {id(p): n for n, p in model.named_parameters()}
        params = [p for g in groups for p in g["params"]]
        ids = [i for s in saved_groups for i in s["params"]]
        shapes = saved.get("param_shapes")
        for pos, (idx, p) in enumerate(zip(ids, params, strict=True)):
            label = f"param {idx}" + (f" (`{names[id(p)]}`)" if id(p) in names else "")
            if shapes is not None:  # format 3: the shape each parameter was saved with
                if tuple(shapes[pos]) != tuple(p.shape):
                    problems.append(
                        f"{label}: saved for shape {tuple(shapes[pos])}, the parameter is "
                        f"{tuple(p.shape)} now"
                    )
                continue
            for key, v in saved["state"].get(idx, {}).items():  # formats 1-2
                if key in _ELEMENTWISE_STATE and isinstance(v, Tensor) and v.shape != p.shape:
                    problems.append(
                        f"{label} {key}: checkpoint {tuple(v.shape)} vs parameter {tuple(p.shape)}"
                    )
    if problems:
        raise ResumeError(
            f"checkpoint {ckpt} {which} state does not fit this {which}; " + _short(problems),
            step=step,
            path=str(ckpt),
            hint="build the optimizer over the same parameters, in the same order and "
            "param groups, as the run that saved it; to restart the optimizer from "
            "scratch, pass optimizer=None. Nothing was modified.",
            remedy="no_optimizer",
        )


def _check_classes(
    ckpt: Path,
    step: int,
    contents: Mapping[str, Any],
    optimizers: Mapping[str, Any],
    schedulers: Mapping[str, Any],
) -> None:
    """Each optimizer and scheduler is of the class whose state was saved (checkpoints
    that record classes: written by guardrails 0.2 since this check)."""
    saved = contents.get("classes") or {}
    wrong = []
    for kind, objs in (("optimizer", optimizers), ("scheduler", schedulers)):
        for name, obj in objs.items():
            was = saved.get(f"{kind}:{name}")
            now = type(per_rank(obj) if kind == "optimizer" else obj).__name__
            if was is not None and was != now:
                who = kind if len(objs) == 1 else f"{kind} {name!r}"
                wrong.append(f"the {who} was saved from {was}, this run's is {now}")
    if wrong:
        raise ResumeError(
            f"checkpoint {ckpt} does not fit this run: " + "; ".join(wrong) + " (another "
            "class's state would load half-way and fail later)",
            step=step,
            path=str(ckpt),
            hint="resume with the classes that saved it, or start this configuration as a "
            "new run (a new run_dir, or guard(..., resume=None)). Nothing was modified.",
        )


def _component_state(reader: _Reader, name: str, strict: bool) -> Any:
    """The saved state_dict of an optional component (``scheduler``, ``scaler``): its
    ``<name>.json``, or ``<name>.pt`` when it was not JSON-able; ``None`` if absent and
    not ``strict``."""
    if f"{name}.json" in reader.files:
        return _decode(reader.json(f"{name}.json"))
    if f"{name}.pt" in reader.files:
        with reader.reading(f"{name}.pt"):
            path = reader.path(f"{name}.pt")
            why = not_regular(path)
            if why is not None:
                raise OSError(why)
            return torch.load(path, weights_only=True)
    if strict:
        raise _missing(reader.ckpt, reader.step, name)
    return None


def _missing(ckpt: Path, step: int, what: str) -> ResumeError:
    if what == "model":
        return ResumeError(
            f"checkpoint {ckpt} holds no model state: its {MANIFEST} lists no "
            "model.safetensors (field files), and files it does not list are never read",
            step=step,
            path=str(ckpt / MANIFEST),
            field="files",
            hint="resume from an older step_* directory; or pass strict=False to leave "
            "the model as it is and restore the rest. Nothing was modified.",
            remedy="no_model",
        )
    return ResumeError(
        f"checkpoint {ckpt} holds no {what} state, but a {what} was passed to resume()",
        step=step,
        path=str(ckpt),
        hint=f"pass {what}=None to keep this {what} as it is, or strict=False to skip "
        "what the checkpoint lacks. Nothing was modified.",
        remedy=f"no_{what}",
    )


def _load_optimizer(reader: _Reader, stem: str = "optimizer") -> dict[str, Any]:
    tensors = {}
    if f"{stem}.safetensors" in reader.files:
        tensors = reader.tensors(f"{stem}.safetensors")
    raw = reader.json(f"{stem}.json")
    with reader.reading(f"{stem}.json", "state"):
        if not isinstance(raw, dict) or not isinstance(raw.get("state"), dict):
            raise ValueError("the state is not an object")
        state = {int(k): _decode(v, tensors) for k, v in raw["state"].items()}
    with reader.reading(f"{stem}.json", "param_groups"):
        out = {"state": state, "param_groups": _decode(raw["param_groups"], tensors)}
        if not isinstance(out["param_groups"], list):
            raise ValueError("param_groups is not a list")
    if "param_shapes" in raw:
        out["param_shapes"] = raw["param_shapes"]
    return out


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
    _digest.fsync_path(root)


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


# ------------------------------------------------------------------ files and encoding


def _read_tensors(path: Path) -> dict[str, Tensor]:
    """Inverse of :meth:`Part.add_tensors`: aliases point at the same tensor again.
    ``path`` must be a regular file (a FIFO would block the reader forever)."""
    why = not_regular(path)
    if why is not None:
        raise OSError(why)
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


def _write_bytes(path: Path, data: bytes, files: dict[str, Any]) -> None:
    with os.fdopen(_perms.open_new(path), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    files[path.name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _seal(paths: Sequence[Path], files: dict[str, Any], prefix: str = "") -> None:
    """fsync files written by someone else (DCP, safetensors) and record each one's size
    and sha256 under ``prefix + name``, reading them back once, in parallel."""
    for path, record in zip(paths, _digest.seal(paths), strict=True):
        files[prefix + path.name] = record


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
    if isinstance(obj, tuple):  # decoded once already, without the tensors
        return tuple(_decode(v, tensors) for v in obj)
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
