"""The step's grad norm in one Triton kernel over a table of the gradients' addresses.

The eager norm, ``vector_norm(stack(_foreach_norm(grads)))``, creates one output tensor
per gradient and stacks them: ~2.1 us of host time per gradient on an H200 host (316 us
at 150 tensors, 3,529 us at 1,500; ``benchmarks/norm_host.py``), which would be the
guard's whole overhead on a host-bound step. Here the host reads each gradient's address
into a pinned int64 table, copies it to the device, and launches one kernel per dtype
that squares and sums every element of every gradient into per-chunk partial sums; the
last program to finish sums those in one fixed order and writes the square root. Host
time on an H200 host: ~90 us at 150 tensors (the address pass 36, the table's copy 17,
the launch 25), ~510 us at 1,500 (the Python pass over ``p.grad`` is what still grows,
~0.24 us a tensor). The launches and the tensors created are the same for 15 gradients
or 15,000. On the device it reads GPT-2 small's 124M float32 gradients in 122 us on an
H200 (~4.1 TB/s; ``_foreach_norm``: 160-190 us).

The kernel reads ``numel`` elements from each address, which is the gradient only when
it is dense: backward always leaves gradients in their parameter's layout, so the
parameters are checked once (contiguous, one device, float32/bfloat16/float16) and each
step checks that every gradient is still contiguous (a gradient assigned by hand as a
strided view is left to the eager norm for that step).

Numerically it is the eager norm's definition (float32 squares summed, square root),
summed in another order: within float32 rounding of it, and NaN or Inf exactly when a
gradient holds one (NanGuard's flag is the norm's finiteness).

Imported only where Triton is (it ships with torch's CUDA wheels); ``gradnorm.py`` falls
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

#: Compile options of every launch: 8 warps; fused multiply-adds asked for by name (the
#: default since Triton 2, and what the GPU figures were measured with: Triton 3.9
#: warns at the first compile when it is left unset, as its default changes in 3.10).
_OPTIONS: dict[str, Any] = {"num_warps": 8, "enable_fp_fusion": True}

_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _sum_of_squares(
    addresses,  # int64 [n_params]: each gradient's address this step, 0 for none
    numels,  # int64 [n_params]
    item_param,  # int32 [n_items]: the parameter each program reads a chunk of
    item_start,  # int64 [n_items]: the chunk's first element
    partials,  # float32 [n_total]: every program's sum of squares, this launch's at `first`
    first,  # this launch's first slot in `partials`
    finished,  # int32 [1]: programs of this step's launches that are done; 0 between steps
    n_total,  # programs in all of this step's launches (one launch per dtype)
    norm,  # float32 0-d: the step's norm, written by the last program to finish
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
    tl.store(partials + first + pid, tl.sum(acc, axis=0))
    # The last program to finish, of all this step's launches, sums every partial in one
    # fixed order (so the norm is deterministic) and writes its root: the step's norm
    # without a sum and a sqrt kernel (two launches, ~10 us of host time) after it. The
    # pattern of CUDA's threadFenceReduction sample: store, count with release and
    # acquire, read the others' partials from L2.
    tl.debug_barrier()  # every thread of this program is past its store before the count
    done = tl.atomic_add(finished, 1, sem="acq_rel")
    if done == n_total - 1:
        # Names of their own: Triton types a name once per function (int64 above).
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for first_slot in range(0, n_total, BLOCK):
            slot = first_slot + tl.arange(0, BLOCK)
            mask = slot < n_total
            total += tl.load(partials + slot, mask=mask, other=0.0, cache_modifier=".cg")
        tl.store(norm, tl.sqrt_rn(tl.sum(total, axis=0)))  # IEEE-rounded, as torch.sqrt
        tl.store(finished, 0)  # the next step's launches come after this one on the stream


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
    with _on_device(x.device):
        _flat_sum_of_squares[(FLAT_PROGRAMS,)](x, numel, chunk, partials, BLOCK=BLOCK, **_OPTIONS)


def _on_device(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Triton launches on the current device's current stream: make ``device`` current
    (a no-op, and no CUDA call, when it is already, as in a loop that set it, or on the
    CPU of Triton's interpreter, in the tests)."""
    if device.type != "cuda" or torch.cuda.current_device() == device.index:
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def _to_device(values: list[int], dtype: torch.dtype, device: torch.device) -> Tensor:
    """``values`` on ``device`` without a host sync (a pageable copy would be one)."""
    if device.type == "cpu":  # Triton's interpreter, in the tests: nothing to copy
        return torch.tensor(values, dtype=dtype)
    # Pinned, so the copy is asynchronous; the caching host allocator keeps the block
    # until the copy has run (it records an event on the copy's stream).
    table = torch.empty(len(values), dtype=dtype, pin_memory=True)
    table.numpy()[:] = values
    return table.to(device, non_blocking=True)


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
        self.numels = _to_device([p.numel() for p in params], torch.int64, self.device)
        # Planned once: a gradient has its parameter's dtype and size (torch refuses to
        # assign any other).
        plans = plan(params)
        self.n_total = sum(len(which) for _, which, _ in plans)
        self.partials = torch.empty(self.n_total, dtype=torch.float32, device=self.device)
        self.finished = torch.zeros(1, dtype=torch.int32, device=self.device)
        self.launches: list[tuple[Any, Tensor, Tensor, int]] = []
        first = 0
        for triton_dtype, which, starts in plans:
            self.launches.append(
                (
                    triton_dtype,
                    _to_device(which, torch.int32, self.device),
                    _to_device(starts, torch.int64, self.device),
                    first,
                )
            )
            first += len(which)

    def __call__(self, params: list[Tensor]) -> Tensor | None:
        addresses = self.addresses(params)
        if addresses is None:
            return None
        return self.launch(_to_device(addresses, torch.int64, self.device))

    @staticmethod
    def addresses(params: list[Tensor]) -> list[int] | None:
        """Each gradient's address, 0 for none; ``None`` if one is not contiguous (the
        kernel reads ``numel`` elements on from its address: another tensor's, or past
        an expanded one's storage) or is sparse (``is_contiguous()`` is False for one).
        One pass over ``params``, ~0.24 us a tensor on an H200 host, about a third of it
        the contiguity check, which only a gradient assigned by hand or a sparse one
        fails (backward leaves a dense gradient in its parameter's layout)."""
        addresses = [
            0 if (g := p.grad) is None else (g.data_ptr() if g.is_contiguous() else -1)
            for p in params
        ]
        return None if -1 in addresses else addresses

    def launch(self, addresses: Tensor) -> Tensor:
        """The norm of the gradients at ``addresses`` (int64, on the device, in the
        parameters' order), as a new float32 0-d tensor: a user may keep a step's norm
        past the next step."""
        norm = torch.empty((), dtype=torch.float32, device=self.device)
        with _on_device(self.device):
            for triton_dtype, which, starts, first in self.launches:
                _sum_of_squares[(len(which),)](
                    addresses,
                    self.numels,
                    which,
                    starts,
                    self.partials,
                    first,
                    self.finished,
                    self.n_total,
                    norm,
                    CHUNK=CHUNK,
                    BLOCK=BLOCK,
                    DTYPE=triton_dtype,
                    **_OPTIONS,
                )
        return norm
