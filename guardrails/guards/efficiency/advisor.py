"""The fast-path advisor: settings that leave speed on the table, judged once, after the
run's first step (the step showed the compute dtype, the loader's batches and where
they live), each with its fix.

:func:`facts` reads what the rules need from the guard and torch; :func:`advice` turns
facts into advice, a pure function of them (so every rule is testable on any machine).
Each piece of advice is information, not a warning: a default setup that is healthy
hears nothing, and a setup that chose, say, full fp32 on purpose loses nothing but a
line in the log. The one warning is bf16 on a CPU that emulates it, many times slower
than float32.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from guardrails.guards.efficiency.flops import compute_dtype, device_name, params_dtype

if TYPE_CHECKING:
    from guardrails.engine.guard import Guard


@dataclass
class Facts:
    """What the rules read: the device, the step's compute dtype, the optimizers and
    the loader."""

    device_type: str
    #: The accelerator's name (``NVIDIA H100 80GB HBM3``), or ``cpu``.
    device_name: str = ""
    #: CUDA compute capability, e.g. ``(9, 0)``; ``None`` off CUDA.
    capability: tuple[int, int] | None = None
    #: Whether the device computes bf16 natively (a GPU's tensor cores, a CPU's
    #: avx512_bf16 / amx_bf16); ``None``: unknown.
    bf16_native: bool | None = None
    #: The step's matmul dtype: ``bf16``, ``fp16``, ``tf32`` or ``fp32``.
    compute: str = "fp32"
    #: bf16 was already visible at the start (bf16 parameters, autocast around the
    #: loop) and the preflight, which checks that at start, is running: it has told.
    bf16_told_at_start: bool = False
    #: Each optimizer: (name, class name, its ``foreach``, its ``fused``); the last two
    #: ``"n/a"`` when the class has no such option.
    optimizers: list[tuple[str, str, Any, Any]] = field(default_factory=list)
    #: The loader, when it is a torch ``DataLoader``: its ``num_workers``.
    loader_workers: int | None = None
    #: ... and its ``pin_memory``.
    loader_pinned: bool | None = None
    #: Whether the step's batches were already on the accelerator when fetched
    #: (a loader that yields device tensors needs neither workers nor pinning).
    batches_on_device: bool = False


@dataclass
class Advice:
    """One piece of advice: an event's kind, level and message."""

    kind: str
    message: str
    level: str = "info"
    fields: dict[str, Any] = field(default_factory=dict)


def facts(guard: Guard) -> Facts:
    """The facts of this guard's run, after its first step."""
    device = guard.device
    f = Facts(device_type=device.type, device_name=device_name(device))
    if device.type == "cuda":
        f.capability = tuple(torch.cuda.get_device_capability(device))  # type: ignore[assignment]
        f.bf16_native = bool(torch.cuda.is_bf16_supported())
    elif device.type == "cpu":
        from guardrails.util.probes import cpu_info

        with contextlib.suppress(Exception):  # no /proc/cpuinfo: unknown
            f.bf16_native = cpu_info().get("bf16_native")
    f.compute = compute_dtype(guard)
    for name, opt in guard.optimizers.items():
        defaults = getattr(opt, "defaults", {})
        f.optimizers.append(
            (
                name,
                type(opt).__name__,
                defaults.get("foreach", "n/a"),
                defaults.get("fused", "n/a"),
            )
        )
    loader = guard.loader
    if isinstance(loader, torch.utils.data.DataLoader):
        f.loader_workers = loader.num_workers
        f.loader_pinned = bool(loader.pin_memory)
    tensor = _first_tensor(guard.step_batches)
    f.batches_on_device = tensor is not None and tensor.device.type != "cpu"
    return f


def bf16_visible_at_start(guard: Guard) -> bool:
    """What the preflight's start-time check sees: bf16 parameters, or bf16 autocast
    already entered around the loop."""
    if params_dtype(guard) == torch.bfloat16:
        return True
    with contextlib.suppress(TypeError, RuntimeError):  # torch without per-device autocast
        return (
            torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        )
    return False


def advice(f: Facts) -> list[Advice]:
    """Every rule that applies to ``f``, in a fixed order."""
    return [*_precision(f), *_optimizers(f), *_loader(f), *_bf16_on_cpu(f)]


def _precision(f: Facts) -> list[Advice]:
    """TF32 off, or float32 on a GPU that computes bf16 natively."""
    out: list[Advice] = []
    cuda = f.device_type == "cuda"
    fp32 = f.compute in ("fp32", "tf32")
    if cuda and f.compute == "fp32" and f.capability is not None and f.capability >= (8, 0):
        out.append(
            Advice(
                "tf32_off",
                f"float32 matmuls run in full fp32 on this {f.device_name} (TF32 is off): "
                "its tensor cores do TF32 at ~8x the fp32 rate, for a 10-bit mantissa in the "
                "matmul inputs (accumulation stays fp32). Turn it on with "
                "torch.set_float32_matmul_precision('high') before training, or train in "
                "bf16 autocast.",
                fields={"capability": list(f.capability)},
            )
        )
    if cuda and fp32 and f.bf16_native:
        out.append(
            Advice(
                "bf16_available",
                f"the step runs in {f.compute} (float32 parameters, no autocast) on a "
                f"{f.device_name}, which computes bf16 natively: mixed precision roughly "
                "doubles matmul throughput and halves activation memory, with no loss "
                "scaling (bf16 has float32's range). Wrap the forward and the loss in "
                "`with torch.autocast('cuda', dtype=torch.bfloat16):` (parameters and "
                "optimizer state stay float32).",
                fields={"compute_dtype": f.compute},
            )
        )
    return out


def _optimizers(f: Facts) -> list[Advice]:
    """An optimizer on a GPU that updates one parameter at a time."""
    out: list[Advice] = []
    if f.device_type == "cuda":
        for name, cls, foreach, fused in f.optimizers:
            # foreach=None is torch's default: it picks the foreach path on CUDA itself.
            if foreach is False and fused in (None, False):
                out.append(
                    Advice(
                        "optimizer_not_fused",
                        f"optimizer {name!r} ({cls}) runs its update one parameter at a "
                        "time (foreach=False, not fused): a kernel launch per parameter "
                        f"and per operation. Build it with fused=True (or leave foreach at "
                        "its default): one or a few kernels for all the parameters.",
                        fields={"optimizer": name, "class": cls},
                    )
                )
    return out


def _loader(f: Facts) -> list[Advice]:
    """A DataLoader feeding a GPU without workers or pinned memory."""
    out: list[Advice] = []
    cuda = f.device_type == "cuda"
    if cuda and f.loader_workers is not None and not f.batches_on_device:
        if f.loader_workers == 0:
            out.append(
                Advice(
                    "loader_no_workers",
                    "the DataLoader has num_workers=0: every batch is loaded and collated "
                    "in the training process between steps, while the GPU waits (the "
                    "data_wait_s column shows how long). Give it workers: "
                    "DataLoader(..., num_workers=4, persistent_workers=True) (a few per "
                    "GPU; more if decoding or augmentation is heavy).",
                )
            )
        if not f.loader_pinned:
            out.append(
                Advice(
                    "loader_not_pinned",
                    "the DataLoader has pin_memory=False: each batch's copy to the GPU "
                    "goes through a staging buffer and cannot overlap the compute. Use "
                    "DataLoader(..., pin_memory=True) and batch.to('cuda', "
                    "non_blocking=True).",
                )
            )
    return out


def _bf16_on_cpu(f: Facts) -> list[Advice]:
    """bf16 compute on a CPU that emulates it (unless told at start already)."""
    out: list[Advice] = []
    if (
        f.device_type == "cpu"
        and f.compute == "bf16"
        and f.bf16_native is False
        and not f.bf16_told_at_start
    ):
        out.append(
            Advice(
                "bf16_on_cpu",
                "the step computed in bfloat16 (autocast in the forward) on a CPU without "
                "native bf16 (no avx512_bf16 / amx_bf16): bf16 math is emulated through "
                "float32 and can be many times slower. Train CPU runs in float32, and "
                "pick the dtype from the device you train on, not from "
                "torch.cuda.is_available() (True on any machine with a GPU, also for a "
                "run on its CPU).",
                level="warning",
            )
        )
    return out


def _first_tensor(obj: Any, depth: int = 0) -> torch.Tensor | None:
    """The first tensor in a batch (nested tuples, lists, dicts), or ``None``."""
    if isinstance(obj, torch.Tensor):
        return obj
    if depth > 4:
        return None
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    for item in items:
        t = _first_tensor(item, depth + 1)
        if t is not None:
            return t
    return None
