"""FLOPs per step and the device's peak: what model FLOPs utilisation (MFU) is made of.

MFU = the model's FLOPs per optimizer step / (step time x the device's dense peak
FLOP/s for the dtype the matmuls run in). The FLOPs are counted once, by torch's
``FlopCounterMode`` over one training step (forward and backward, every micro-batch):
it counts matmuls, convolutions and attention, the work tensor cores do, and nothing
elementwise (the optimizer's update, norms, activations), which is how MFU is
conventionally defined. Counted on this rank: under DDP or FSDP its own batch through
the whole model (FSDP computes with the gathered layers). Tensor parallelism (DTensor
compute) is not verified: the count may be the global one there; pass
``flops_per_step``. Attention is counted as torch counts
its GPU kernels (full, not halved for a causal mask; the backward's recomputed scores
included), on a CPU too. A formula that fails on an op gives the count up; it never
fails the step.

The peaks are the vendors' dense figures (no 2:4 sparsity), per GPU, in FLOP/s.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from guardrails.engine.model import wrappers

if TYPE_CHECKING:
    from guardrails.engine.guard import Guard


def _tflops(
    bf16: float | None, fp16: float, tf32: float | None, fp32: float
) -> dict[str, float | None]:
    return {
        "bf16": None if bf16 is None else bf16 * 1e12,
        "fp16": fp16 * 1e12,
        "tf32": None if tf32 is None else tf32 * 1e12,
        "fp32": fp32 * 1e12,
    }


#: Dense peak FLOP/s by GPU, for bf16 / fp16 (fp32 accumulate) / tf32 / fp32 matmuls,
#: matched against ``torch.cuda.get_device_name()`` in this order (the first pattern
#: that matches wins, so the more specific names come first). ``None``: the GPU has no
#: such tensor-core path (V100: no bf16, no tf32).
PEAKS: tuple[tuple[str, str, dict[str, float | None]], ...] = (
    # (pattern, name, dense TFLOP/s for bf16, fp16, tf32, fp32)
    (r"H100.*PCI", "H100 PCIe", _tflops(756, 756, 378, 51.2)),
    (r"H100.*NVL", "H100 NVL", _tflops(835, 835, 418, 60)),
    (r"H100|GH200", "H100 SXM", _tflops(989, 989, 495, 67)),
    (r"H200.*NVL", "H200 NVL", _tflops(835, 835, 418, 60)),
    (r"H200", "H200 SXM", _tflops(989, 989, 495, 67)),
    (r"A100", "A100", _tflops(312, 312, 156, 19.5)),
    (r"L40S", "L40S", _tflops(362, 362, 183, 91.6)),
    (r"\bL4\b", "L4", _tflops(121, 121, 60, 30.3)),
    (r"A10G", "A10G", _tflops(70, 70, 35, 31.2)),
    (r"\bA10\b", "A10", _tflops(125, 125, 62.5, 31.2)),
    (r"V100.*PCI", "V100 PCIe", _tflops(None, 112, None, 14)),
    (r"V100", "V100 SXM2", _tflops(None, 125, None, 15.7)),
    (r"RTX 4090", "RTX 4090", _tflops(165, 165, 82.6, 82.6)),
    (r"RTX 3090", "RTX 3090", _tflops(71, 71, 35.6, 35.6)),
)


def device_name(device: torch.device) -> str:
    """The accelerator's name (``NVIDIA H100 80GB HBM3``), or ``cpu``."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def peak_flops(name: str, dtype: str) -> tuple[float | None, str | None]:
    """(dense peak FLOP/s, the table's name for the device) for matmuls in ``dtype``
    (``bf16``, ``fp16``, ``tf32``, ``fp32``) on the device named ``name``; ``(None,
    None)`` for a device not in :data:`PEAKS`, ``(None, its name)`` for a dtype it has
    no figure for."""
    for pattern, known, peaks in PEAKS:
        if re.search(pattern, name):
            return peaks.get(dtype), known
    return None, None


def tf32_enabled() -> bool:
    """Whether float32 matmuls on CUDA may use TF32 tensor cores (either API)."""
    mm = torch.backends.cuda.matmul
    return (
        torch.get_float32_matmul_precision() != "highest"
        or bool(getattr(mm, "allow_tf32", False))
        or getattr(mm, "fp32_precision", None) == "tf32"
    )


def params_dtype(guard: Guard) -> torch.dtype:
    """The dtype most of the trained parameters' elements are in (a lazy module's
    parameters, not yet materialized, have no size: left out)."""
    sizes: dict[torch.dtype, int] = {}
    for p in guard.params:
        if torch.nn.parameter.is_lazy(p):
            continue
        sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
    return max(sizes, key=lambda d: sizes[d]) if sizes else torch.float32


def compute_dtype(guard: Guard) -> str:
    """The dtype the step's matmuls run in, as the peak table names it: autocast's
    (seen in a training forward), else the parameters'; float32 on CUDA is ``tf32``
    when TF32 is enabled."""
    if guard.bf16_autocast:
        return "bf16"
    if guard.fp16_autocast:
        return "fp16"
    dtype = params_dtype(guard)
    if dtype == torch.bfloat16:
        return "bf16"
    if dtype == torch.float16:
        return "fp16"
    if guard.device.type == "cuda" and tf32_enabled():
        return "tf32"
    return "fp32"


def compiled(models: Iterable[torch.nn.Module]) -> bool:
    """Whether a guarded model is compiled (``torch.compile(model)`` or
    ``model.compile()``, under a DDP wrapper or over one): under a dispatch mode its
    compiled code would not run (Dynamo runs the step eagerly), so it is not counted."""
    return any(
        hasattr(m, "_orig_mod") or getattr(m, "_compiled_call_impl", None) is not None
        for model in models
        for m in wrappers(model)
    )


class FlopCount:
    """``FlopCounterMode`` entered at one hook (a step's boundary) and left at a later
    one: a pass-through dispatch mode, so the step's numbers, its RNG draws and its
    gradients are what they would be without it. The count is read where the step ends
    (:meth:`total`, in ``after_step``, which runs inside ``optimizer.step()``, maybe
    inside the loop's own dispatch mode); the mode is left where it is on top of the
    stack again (:meth:`leave`, at the next boundary), never from under another."""

    def __init__(self) -> None:
        from torch.utils.flop_counter import FlopCounterMode

        class Counter(FlopCounterMode):
            # A formula that fails on an op's shapes (torch's own asserts) must not end
            # the user's step: the op's result goes on, the count is given up.
            failed: str | None = None

            def _count_flops(self, func_packet: Any, out: Any, args: Any, kwargs: Any) -> Any:
                try:
                    return super()._count_flops(func_packet, out, args, kwargs)
                except Exception as e:
                    self.failed = self.failed or f"{func_packet}: {type(e).__name__}: {e}"
                    return out

        self._mode: Any = Counter(display=False, custom_mapping=_cpu_attention())
        self._mode.__enter__()

    def total(self) -> int | None:
        """The FLOPs counted so far, or ``None`` when an op's count failed (why:
        :attr:`failed`)."""
        if self.failed is not None:
            return None
        return int(self._mode.get_total_flops())

    @property
    def failed(self) -> str | None:
        """Why the count was given up (an op whose formula failed), or ``None``."""
        return getattr(self._mode, "failed", None)

    def leave(self) -> bool:
        """Leave the mode if it is the innermost one; whether it was left."""
        from torch.utils._python_dispatch import _get_current_dispatch_mode

        if self._mode.mode is not None and _get_current_dispatch_mode() is not self._mode.mode:
            return False
        self._mode.__exit__(None, None, None)
        return True


def _cpu_attention() -> dict[Any, Any]:
    """The CPU kernels of ``scaled_dot_product_attention``, which torch's formulas leave
    out (the CUDA ones are in): the same formulas, so attention counts alike on every
    device (full, not causal-halved, as torch counts it; the backward recomputes the
    scores)."""
    from torch.utils import flop_counter

    aten = torch.ops.aten
    forward = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    backward = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    sdpa = getattr(flop_counter, "sdpa_flop", None)
    sdpa_backward = getattr(flop_counter, "sdpa_backward_flop", None)
    out: dict[Any, Any] = {}
    for op, formula in ((forward, sdpa), (backward, sdpa_backward)):
        if op is not None and formula is not None:
            out[op] = _raw(formula)
    return out


def _raw(formula: Any) -> Any:
    """Torch's registered formula (already taking tensors), marked so that
    ``custom_mapping`` does not wrap it a second time."""

    def count(*args: Any, **kwargs: Any) -> Any:
        return formula(*args, **kwargs)

    count._get_raw = True  # type: ignore[attr-defined]
    return count


def dispatch_mode_active() -> bool:
    """Whether a ``TorchDispatchMode`` is already on this thread's stack (a profiler,
    a test's counter): one entered on top of it could not be left in order."""
    try:
        return torch._C._len_torch_dispatch_stack() > 0
    except AttributeError:  # an older torch: assume the worst
        return True
