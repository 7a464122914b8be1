"""The step's grad norm in one Triton kernel over a table of the gradients' addresses.

The eager norm, ``vector_norm(stack(_foreach_norm(grads)))``, creates one output tensor
per gradient and stacks them: ~2.1 us of host time per gradient on an H200 host (316 us
at 150 tensors, 3,529 us at 1,500; ``benchmarks/norm_host.py``), which was the guard's
whole overhead on a host-bound step. Here the host reads each gradient's address into
a pinned int64 table, copies it to the device, and launches one kernel per dtype that
squares and sums every element of every gradient into per-chunk partial sums; the
total is their sum's square root: 107 us at 150 tensors, 550 us at 1,500 (the Python
pass over ``p.grad`` is what still grows, ~0.3 us a tensor). The launches and the
tensors created are the same for 15 gradients or 15,000. On the device it reads GPT-2
small's 124M float32 gradients in 122 us on an H200 (~4.1 TB/s; ``_foreach_norm``:
160-190 us).

The kernel reads ``numel`` elements from each address, which is the gradient only when
it is dense: backward always leaves gradients in their parameter's layout, so the
parameters are checked once (contiguous, one device, float32/bfloat16/float16) and each
step checks that every gradient is still contiguous (a gradient assigned by hand as a
strided view is left to the eager norm for that step).

Numerically it is the eager norm's definition (float32 squares summed, square root),
summed in another order: within float32 rounding of it, and NaN or Inf exactly when a
gradient holds one (NanGuard's flag is the norm's finiteness).

Imported only where Triton is (it ships with torch's CUDA wheels); ``_gradnorm`` falls
back to the eager norm where it is not, or where the kernel fails to build.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

#: Elements of one gradient a program sums: GPT-2 small's 124M gradients are ~1,900
#: programs (14 waves on an H100's 132 SMs), each reading 256 KiB in fp32.
CHUNK = 64 * 1024
#: Elements a program loads per iteration (8 per thread at 8 warps).
BLOCK = 2048

_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _sum_of_squares(
    addresses,  # int64 [n_params]: each gradient's address this step, 0 for none
    numels,  # int64 [n_params]
    item_param,  # int32 [n_items]: the parameter each program reads a chunk of
    item_start,  # int64 [n_items]: the chunk's first element
    partials,  # float32 [n_items]: each program's sum of squares
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    DTYPE: tl.constexpr,
):
    pid = tl.program_id(0)
    param = tl.load(item_param + pid)
    start = tl.load(item_start + pid)
    address = tl.load(addresses + param)
    end = tl.minimum(tl.load(numels + param), start + CHUNK)
    end = tl.where(address == 0, start, end)  # no gradient: nothing to read
    base = address.to(tl.pointer_type(DTYPE))
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for offset in range(start, end, BLOCK):
        index = offset + tl.arange(0, BLOCK)
        x = tl.load(base + index, mask=index < end, other=0.0).to(tl.float32)
        acc += x * x
    tl.store(partials + pid, tl.sum(acc, axis=0))


@triton.jit
def _flat_sum_of_squares(
    x,  # one contiguous tensor (a DDP bucket)
    numel,
    chunk,  # elements each program sums, a multiple of BLOCK
    partials,  # float32 [programs]: each program's sum of squares
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * chunk
    end = tl.minimum(start + chunk, numel)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for offset in range(start, end, BLOCK):
        index = offset + tl.arange(0, BLOCK)
        v = tl.load(x + index, mask=index < end, other=0.0).to(tl.float32)
        acc += v * v
    tl.store(partials + pid, tl.sum(acc, axis=0))


#: Programs a flat tensor's sum is split over (about two per SM of an H100/H200): a
#: fixed number, so each DDP bucket's partial sums have a fixed place whatever its size.
FLAT_PROGRAMS = 256


def flat_supports(x: Tensor) -> bool:
    """Whether :func:`flat_sum_of_squares` reads ``x`` (contiguous, a float dtype it
    sums exactly in float32)."""
    return x.dtype in _DTYPES and x.is_contiguous()


def flat_chunk(numel: int) -> int:
    """Elements each of the ``FLAT_PROGRAMS`` programs sums of a ``numel``-element
    tensor: a multiple of ``BLOCK``, enough for all of it."""
    per_program = -(-numel // FLAT_PROGRAMS)
    return max(BLOCK, -(-per_program // BLOCK) * BLOCK)


def flat_sum_of_squares(x: Tensor, partials: Tensor) -> None:
    """Write the sum of squares of contiguous ``x`` (float32/bfloat16/float16, CUDA) as
    ``FLAT_PROGRAMS`` partial sums into ``partials``, on the current stream of
    ``x``'s device (the caller's stream context, as any torch op)."""
    numel = x.numel()
    chunk = flat_chunk(numel)
    with _on_device(x.device.index):
        _flat_sum_of_squares[(FLAT_PROGRAMS,)](x, numel, chunk, partials, BLOCK=BLOCK, num_warps=8)


def _on_device(index: int) -> contextlib.AbstractContextManager[Any]:
    """Triton launches on the current device's current stream: make ``index`` current
    (a no-op, and no CUDA call, when it is already, as in a loop that set it)."""
    if torch.cuda.current_device() == index:
        return contextlib.nullcontext()
    return torch.cuda.device(index)


def _to_device(values: list[int], dtype: torch.dtype, device: torch.device) -> Tensor:
    """``values`` on ``device`` without a host sync (a pageable copy would be one)."""
    return torch.tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)


def supports(params: list[Tensor]) -> str | None:
    """Why the kernel cannot take these parameters' norm (``None``: it can)."""
    if any(torch.nn.parameter.is_lazy(p) for p in params):
        return "a lazy module's parameter is not initialized"
    devices = {p.device for p in params}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        return "the parameters are not all on one CUDA device"
    if any(p.dtype not in _DTYPES for p in params):
        return "a parameter's dtype is not float32, bfloat16 or float16"
    if not all(p.is_contiguous() for p in params):
        return "a parameter is not contiguous (channels_last)"
    return None


def plan(params: list[Tensor]) -> list[tuple[Any, list[int], list[int]]]:
    """The launches of :func:`_sum_of_squares` for ``params``' gradients: for each dtype
    present, its Triton dtype and, per program, the parameter index and the first
    element of the ``CHUNK`` it sums (one program for an empty parameter)."""
    plans = []
    for dtype, triton_dtype in _DTYPES.items():
        which, starts = [], []
        for i, p in enumerate(params):
            if p.dtype == dtype:
                for start in range(0, max(p.numel(), 1), CHUNK):
                    which.append(i)
                    starts.append(start)
        if which:
            plans.append((triton_dtype, which, starts))
    return plans


class TableNorm:
    """The L2 norm of ``params``' gradients by one kernel per dtype over their
    addresses; ``None`` from :meth:`__call__` when a gradient is not contiguous."""

    def __init__(self, params: list[Tensor]) -> None:
        self.device = params[0].device
        self.index = self.device.index if self.device.index is not None else 0
        self.numels = _to_device([p.numel() for p in params], torch.int64, self.device)
        # Planned once: a gradient has its parameter's dtype and size (torch refuses to
        # assign any other).
        plans = plan(params)
        self.partials = torch.empty(
            sum(len(w) for _, w, _ in plans), dtype=torch.float32, device=self.device
        )
        self.launches: list[tuple[Any, Tensor, Tensor, Tensor]] = []
        offset = 0
        for triton_dtype, which, starts in plans:
            self.launches.append(
                (
                    triton_dtype,
                    _to_device(which, torch.int32, self.device),
                    _to_device(starts, torch.int64, self.device),
                    self.partials[offset : offset + len(which)],
                )
            )
            offset += len(which)

    def __call__(self, params: list[Tensor]) -> Tensor | None:
        # One pass over the parameters: each gradient's address, 0 for none, -1 for one
        # that is not contiguous (the kernel reads `numel` elements on from its address:
        # another tensor's, or past an expanded one's storage). The contiguity check is
        # ~35% of this pass's ~0.3 us a tensor; only a gradient assigned by hand can
        # fail it (backward leaves each in its parameter's layout).
        addresses = [
            0 if (g := p.grad) is None else (g.data_ptr() if g.is_contiguous() else -1)
            for p in params
        ]
        if -1 in addresses:
            return None
        # Pinned, so the copy is asynchronous; the caching host allocator keeps the
        # block until the copy has run (it records an event on the copy's stream).
        table = torch.empty(len(addresses), dtype=torch.int64, pin_memory=True)
        table.numpy()[:] = addresses
        on_device = table.to(self.device, non_blocking=True)
        with _on_device(self.index):
            for triton_dtype, which, starts, partials in self.launches:
                _sum_of_squares[(len(which),)](
                    on_device,
                    self.numels,
                    which,
                    starts,
                    partials,
                    CHUNK=CHUNK,
                    BLOCK=BLOCK,
                    DTYPE=triton_dtype,
                    num_warps=8,
                )
        return self.partials.sum().sqrt()
