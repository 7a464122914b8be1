"""FLOPs per step and the device's peak: what model FLOPs utilisation (MFU) is made of.

MFU = the model's FLOPs per optimizer step / (step time x the device's dense peak
FLOP/s for the dtype the matmuls run in). The FLOPs are counted once, by torch's
``FlopCounterMode`` over a replay of one training step's forwards (every micro-batch)
and a backward, on fake tensors (:class:`Replay`), never over the step itself:
it counts matmuls, convolutions and attention, the work tensor cores do, and nothing
elementwise (the optimizer's update, norms, activations), which is how MFU is
conventionally defined. Counted on this rank: under DDP its own batch through the
whole model. A sharded model (FSDP, tensor parallelism) is not replayed: pass
``flops_per_step``. Attention is counted as torch counts
its GPU kernels (full, not halved for a causal mask; the backward's recomputed scores
included), on a CPU too. A formula that fails on an op gives the count up; it never
fails the step.

The peaks are the vendors' dense figures (no 2:4 sparsity), per GPU, in FLOP/s.
"""

from __future__ import annotations

import copy as _copy
import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from guardrails.engine.model import unwrap, wrappers

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
    ``model.compile()``, under a DDP wrapper or over one): not counted, since a replay
    of its eager forward would count ops that its compiled kernels fuse or drop."""
    return any(
        hasattr(m, "_orig_mod") or getattr(m, "_compiled_call_impl", None) is not None
        for model in models
        for m in wrappers(model)
    )


#: A training forward: the module called, its positional and keyword arguments.
Call = tuple[torch.nn.Module, tuple[Any, ...], dict[str, Any]]


class Replay:
    """The FLOPs of one training step, counted on a replay of its forwards (and their
    backward) on fake tensors: a copy of each model whose parameters and buffers are
    ``FakeTensor`` s (shapes, dtypes and devices, no storage: no copy of the weights),
    called on fake copies of the step's inputs under torch's ``FlopCounterMode``. No
    kernel runs, no generator is drawn from, and the live modules are not called: their
    buffers (BatchNorm's running stats), their Python attributes and the RNG streams
    are the step's own.

    Not the real step under the counter: ``FlopCounterMode`` decomposes every op its
    formulas do not cover and that has a composite form (``func.decompose()`` in its
    ``__torch_dispatch__``, torch 2.13), and ``aten.silu_backward`` is such an op: under
    the counter SiLU's gradient ran as sigmoid/mul/add instead of the fused kernel, one
    rounding apart (5.96e-08 in an MLP's bias after the counted step, then Adam's state),
    so a guarded run no longer trained bitwise as the plain one did.

    The backward is seeded with ones at each forward's output: a scalar output (a loss
    the model returns) alone when there is one, else every float output that needs a
    gradient. The user's loss function is not replayed (elementwise: no matmul FLOPs)."""

    def __init__(self) -> None:
        #: Why the count was given up (an op whose formula failed, a forward that
        #: cannot run on fake tensors), or ``None``.
        self.failed: str | None = None
        #: Whether the failure is the replay's (the forward cannot run on fake
        #: tensors), not a formula's.
        self.unreplayable = False

    def count(self, calls: Iterable[Call], device: torch.device) -> int | None:
        """The FLOPs of ``calls`` (a step's training forwards: module, args, kwargs,
        on ``device``), or ``None`` when they could not be counted (why:
        :attr:`failed`)."""
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.utils._python_dispatch import _disable_current_modes

        counter = _counter()
        # Off the loop's own dispatch modes (``after_step`` may run inside one: a
        # profiler's), which would see the replay's ops; the copies' forwards draw
        # nothing on fake tensors, and the default generators (the host's, the step's
        # GPU's) are put back all the same, should a forward draw on a real tensor.
        gpus = [device] if device.type == "cuda" else []
        with _disable_current_modes(), torch.random.fork_rng(devices=gpus):
            try:
                fake = FakeTensorMode(allow_non_fake_inputs=True)
                copies: dict[int, torch.nn.Module] = {}
                runs = []
                for module, args, kwargs in calls:
                    bare = unwrap(module)
                    if id(bare) not in copies:
                        copies[id(bare)] = _fake_copy(bare, module, fake)
                    runs.append((copies[id(bare)], _fake(args, fake), _fake(kwargs, fake)))
                with torch.enable_grad(), fake, counter:
                    for copy, args, kwargs in runs:
                        _backward(copy(*args, **kwargs))
            except Exception as e:  # the user's forward, on fake tensors: anything
                self.failed = f"{type(e).__name__}: {e}"
                self.unreplayable = True
                return None
        self.failed = counter.failed
        return None if self.failed is not None else int(counter.get_total_flops())


def _counter() -> Any:
    from torch.utils.flop_counter import FlopCounterMode

    class Counter(FlopCounterMode):
        # A formula that fails on an op's shapes (torch's own asserts) gives the count
        # up, not the replay.
        failed: str | None = None

        def _count_flops(self, func_packet: Any, out: Any, args: Any, kwargs: Any) -> Any:
            try:
                return super()._count_flops(func_packet, out, args, kwargs)
            except Exception as e:
                self.failed = self.failed or f"{func_packet}: {type(e).__name__}: {e}"
                return out

    return Counter(display=False, custom_mapping=_cpu_attention())


def _fake_copy(bare: torch.nn.Module, called: torch.nn.Module, fake: Any) -> torch.nn.Module:
    """A copy of ``bare`` whose parameters, buffers and tensor attributes are fake (the
    deep copy's memo maps each real tensor to its fake, so none is copied), its forward
    the model's own, not the guard's wrapper (set on the instance of ``called``)."""
    memo: dict[int, Any] = {}
    for m in bare.modules():
        for p in m._parameters.values():
            if p is not None and id(p) not in memo:
                memo[id(p)] = torch.nn.Parameter(fake.from_tensor(p), p.requires_grad)
        for t in (*m._buffers.values(), *vars(m).values()):
            if isinstance(t, torch.Tensor) and id(t) not in memo:
                memo[id(t)] = fake.from_tensor(t)
    copy = _copy.deepcopy(bare, memo)
    for m in copy.modules():
        # The user's hooks (an activation logger, a probe appending to a list) and the
        # guard's are for the real step: on the copy they would see fake tensors. Its
        # own dicts (the deep copy made them), so the live modules keep theirs. Shapes,
        # and so the count, do not depend on them.
        for hooks in _HOOKS:
            getattr(m, hooks, {}).clear()
    own = vars(copy)
    wrapper = vars(called).get("forward") if called is bare else None
    if wrapper is not None and own.get("forward") is wrapper:
        # The guard's wrapper calls the live module's forward: the copy gets the one it
        # wraps, bound to the copy (or the class's, when it wrapped the class's).
        del own["forward"]
        inner = getattr(wrapper, "__wrapped__", None)
        if getattr(inner, "__self__", None) is bare:
            func = inner.__func__  # type: ignore[union-attr]
            if func is not type(bare).forward:
                own["forward"] = func.__get__(copy)
        elif inner is not None:
            raise TypeError(f"its forward is wrapped ({inner!r})")
    return copy


#: A module's own hook tables (torch 2.13), emptied on the replay's copy.
_HOOKS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_pre_hooks",
    "_backward_hooks",
)


def _fake(tree: Any, fake: Any) -> Any:
    from torch.utils._pytree import tree_map_only

    return tree_map_only(torch.Tensor, fake.from_tensor, tree)


def _backward(output: Any) -> None:
    """The backward of a replayed forward: from its scalar outputs (a loss it returns)
    if any, else from every float output that needs a gradient."""
    leaves = [t for t in _leaves(output) if t.requires_grad and t.is_floating_point()]
    scalars = [t for t in leaves if t.dim() == 0]
    roots = scalars or leaves
    if roots:
        torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])


def _leaves(output: Any) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, Mapping):  # a dict, a transformers ModelOutput
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in _leaves(item)]
    return []


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
