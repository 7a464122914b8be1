"""What each rank tells the others at preflight: its facts, gathered locally and
made comparable (plain, picklable values), before the one exchange.

* :func:`param_table`: parameter names, shapes, dtypes and a checksum of each tensor's
  initial weights;
* :func:`batch_fingerprint`: the first batch's structure;
* ``_versions``, ``_compute``, ``_optimizer_facts``, ``_gpu_identity``: torch / CUDA /
  NCCL versions, compute dtypes, optimizer hyperparameters, the physical GPU.

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
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from guardrails.engine import model as _model

if TYPE_CHECKING:
    from guardrails.engine.guard import Guard

#: Strided elements hashed per parameter tensor (bitwise).
SAMPLE_PER_TENSOR = 64


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
