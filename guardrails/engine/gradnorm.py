"""The total gradient norm, once per step: by one Triton kernel over the gradients'
addresses on one CUDA device, eagerly elsewhere, or shared with a norm the step
computes anyway (GuardedDDP's buckets, the loop's own ``clip_grad_norm_``).

Eagerly the norm is three ops, ``vector_norm(stack(_foreach_norm(grads)))``, but
``_foreach_norm`` returns one tensor per gradient: on GPT-2 small (148 gradients) the
host spends ~316 us per step on the three (H200 host, ``benchmarks/norm_host.py``),
~3.5 ms for 1,500 gradients. That would be the guard's largest per-step host cost, and
it lands on the step time whenever the loop is host-bound (GPT-2 small at 2x1024).

**The kernel** (``gradnorm_kernel.TableNorm``, the default on one CUDA device): the
host reads each gradient's address into a pinned table and launches one kernel per
dtype that sums every square into per-chunk partials, whose last program writes the
norm. ~90 us of host time at 150 gradients, ~510 at 1,500; 122 us of kernel time for GPT-2
small's gradients where ``_foreach_norm`` took ~160-190. Left to the eager norm: a
torch without Triton, a build failure (once, at the first step), a gradient that is
not contiguous (that step), CPU, several devices, DTensors, a step being captured into
a CUDA graph, and ``graph_grad_norm=True``.

**The graph** (``graph_grad_norm=True``, experimental): the eager norm's kernels are
captured into a CUDA graph and replayed: one launch, the same kernels on the device
(~63 us of host time per step, measured on an H100). A graph reads the gradients
at the addresses it was captured with, so before each replay the guard looks the
current addresses up (one ``data_ptr()`` per gradient) among the layouts it holds a
graph for, and replays only on an exact match. Gradients freed by
``zero_grad(set_to_none=True)`` come back from the caching allocator at addresses that
depend on its state: a layout seen again within ``RECENT_LAYOUTS`` steps gets a graph
(up to ``MAX_CAPTURES``); after ``MAX_MISSES`` eager steps in a row the guard stays
eager for the run. Off by default: in the first loop measured (GPT-2 small, 8x1024,
30-step runs) the gradients never came back to the previous step's addresses.

**On CPU** ``_foreach_norm`` has no fused kernel: it is one full ``linalg_vector_norm``
dispatch per gradient, ~5 us each on a CPU host. Where the model is small
for its number of tensors (``FLAT_NUMEL_PER_TENSOR`` elements a tensor or fewer, on
average), the gradients are copied into one flat tensor by torch's C++
``flatten_dense_tensors`` and its norm taken, two calls: the guard's norm in 7.1 us
instead of 13.1 for 4 small tensors, 135 instead of 329 for 148
(``benchmarks/norm_host.py --device cpu``). Past that size the copy costs more than
the dispatches it saves, and the norm stays per tensor.

**Sparse gradients** (``nn.Embedding(sparse=True)``): ``linalg_vector_norm`` has no
sparse kernel, so a sparse gradient enters the norm as its coalesced values (repeated
rows summed first, as the optimizer applies them). Found at the first step that has
one; from then on the eager path, with a ``coalesce()`` a sparse gradient a step (on
CUDA that reads its row count back: one host sync a step, for such a model only).

Never captured (eager, exactly as without the knob): CPU, gradients on several devices
(model parallel), sharded gradients (DTensor: the norm is an all-reduce), a loop that is
itself being captured.

**GuardedDDP's buckets** (:class:`BucketNorms`): DDP already passes every gradient
through its all-reduce buckets. GuardedDDP's comm hook takes each reduced bucket's norm
right after its all-reduce (one small kernel per bucket, reading a bucket NCCL has just
written, often still in L2), and the step's norm is the norm of those: no pass over the
parameters on the host (one launch per ~25 MB bucket instead of one output per
gradient). Used when the buckets hold exactly the guard's parameters and every bucket
was reduced since the last step; not under a GradScaler (its gradients are unscaled
after the all-reduce) nor DDP's own mixed precision.

**The loop's own clipping** (:func:`share_clip_norm`): most loops call
``torch.nn.utils.clip_grad_norm_`` before ``optimizer.step()``, which computes the same
total norm and hands it back. While a guard runs, the two module globals it calls
(``torch.nn.utils.clip_grad._get_total_norm`` and ``_clip_grads_with_norm_``, also
exported as ``torch.nn.utils.get_total_norm`` / ``clip_grads_with_norm_``) are wrapped,
so the guard sees that norm whichever way the function was imported, and uses it as the
step's norm instead of reading every gradient a second time (GPT-2 small: ~0.2 ms of
device time and ~0.5 ms of host time a step). Only when it is provably the same
number: an L2 norm, over exactly the guard's parameters, after the step's last training
forward, on the guard's device, and not over gradients a GradScaler has yet to unscale.
"""

from __future__ import annotations

import functools
import logging
import operator
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

logger = logging.getLogger("guardrails.guard")

#: Take the norm by one kernel over the gradients' addresses where it applies
#: (``gradnorm_kernel.py``). A switch for benchmarks and tests, which compare it with
#: the eager norm in one process; not a user knob.
USE_KERNEL = True
#: Captures allowed in one run before the guard stays eager (each costs ~1 ms of host
#: time and one graph kept; a loop whose gradients move every step would otherwise
#: capture every step).
MAX_CAPTURES = 8
#: Eager steps in a row (gradients at addresses no graph has) before giving up: the
#: allocator's layout can take tens of steps to settle after the first ones.
MAX_MISSES = 50
#: A layout seen again among the last this many steps gets a graph: the allocator may
#: cycle through a few (measured: GPT-2 small at 8x1024 never repeated the previous
#: step's addresses in 20 steps).
RECENT_LAYOUTS = 4
#: On CPU, the norm of one flat copy of the gradients when the model has at most this
#: many elements per gradient tensor on average: 16 float32 tensors of 4,096 elements,
#: 27 us flat against 38 per tensor; of 16,384, 94 against 57 (a CPU host).
FLAT_NUMEL_PER_TENSOR = 4096


def total_norm(grads: list[Tensor], device: torch.device, multi_device: bool) -> Tensor:
    """L2 norm of all gradients as a float32 0-d tensor on ``device``, without a sync."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    if multi_device:
        # Model parallel: one fused norm per device, summed on ``device``.
        by_device: dict[torch.device, list[Tensor]] = {}
        for g in grads:
            by_device.setdefault(g.device, []).append(g)
        parts = [
            torch.linalg.vector_norm(torch.stack(torch._foreach_norm(gs)).float()).to(device)
            for gs in by_device.values()
        ]
        return torch.linalg.vector_norm(torch.stack(parts))
    # _foreach_norm: one multi-tensor kernel per dtype, not one launch per parameter.
    stacked = torch.stack(torch._foreach_norm(grads))
    if stacked.dtype != torch.float32:  # bf16/fp16 grads; skips a no-op call otherwise
        stacked = stacked.float()
    total = torch.linalg.vector_norm(stacked)
    if hasattr(total, "full_tensor"):
        # Sharded grads (FSDP2 / DTensor): the norm of local shards is partial; the
        # whole one is an all-reduce over the mesh, the same one torch's own
        # clip_grad_norm_ does for DTensors (one small collective per step).
        total = total.full_tensor()
    return total


_GRAD = operator.attrgetter("grad")
_IS_SET = functools.partial(operator.is_not, None)


def grads_of(params: list[Tensor]) -> list[Tensor]:
    """The gradients of ``params`` that have one, in order, gathered by C code (``map``
    of an ``attrgetter``, ``filter`` of an ``operator.is_not``): no Python bytecode per
    tensor, so the step's Python work is the same for 150 tensors and 1,500
    (tests/test_structure.py counts it). One ``.grad`` read a parameter, as before."""
    return list(filter(_IS_SET, map(_GRAD, params)))


def flat_norm(grads: list[Tensor]) -> Tensor:
    """:func:`total_norm` of dense CPU ``grads`` by one flat copy: two torch calls
    however many gradients (see the module docstring). Float32; a bfloat16/float16
    model's is summed in float32."""
    if not grads:  # no parameter has a gradient this step (cat refuses an empty list)
        return total_norm(grads, torch.device("cpu"), False)
    # The C++ op under torch._utils._flatten_dense_tensors (which adds a Python frame):
    # one cat of each tensor's view(-1), dispatched from C++.
    flat = torch._C._nn.flatten_dense_tensors(grads)
    if flat.dtype in (torch.bfloat16, torch.float16):
        return torch.linalg.vector_norm(flat, dtype=torch.float32)
    total = torch.linalg.vector_norm(flat)
    return total if total.dtype == torch.float32 else total.float()


def dense(grads: list[Tensor]) -> list[Tensor]:
    """``grads`` with each sparse gradient replaced by its coalesced values, whose norm
    is the gradient's (an uncoalesced one may hold a row more than once)."""
    return [g.coalesce().values() if g.is_sparse else g for g in grads]


class GradNorm:
    """The step's norm (see the module docstring): GuardedDDP's buckets where they
    stand for it, else the kernel on one GPU, else the CUDA graph when asked for and the
    gradients are where one was captured, else eagerly (:func:`flat_norm` for a small
    model on CPU, :func:`total_norm` otherwise)."""

    def __init__(self, params: list[Tensor], *, use_graph: bool) -> None:
        #: Per-bucket norms from GuardedDDP's comm hook, when they can stand for the
        #: gradients' norm (set by the guard from the model's attach handle).
        self.buckets: BucketNorms | None = None
        #: Set once a GradScaler steps the optimizer: bucket norms are of scaled
        #: gradients then.
        self.scaled = False
        self.from_buckets = 0  # steps whose norm came from the buckets
        self.device = params[0].device
        self.multi_device = len({p.device for p in params}) > 1
        # Sharded parameters (DTensor) have a full_tensor(); their norm is a collective.
        sharded = any(hasattr(p, "full_tensor") for p in params)
        #: Whether the graph was asked for and can apply here (the end-of-run event).
        self.wanted = (
            use_graph and self.device.type == "cuda" and not self.multi_device and not sharded
        )
        self.enabled = self.wanted  # False once given up or closed: eager from then on
        #: The norm by one Triton kernel over the gradients' addresses
        #: (``gradnorm_kernel.py``): the default on one CUDA device, ``None`` where it
        #: does not apply (CPU, several devices, DTensor, no Triton) or was given up;
        #: ``True`` until the first step builds it (a lazy module's parameters have no
        #: size before its first forward).
        self.kernel: Any = None
        #: Steps whose norm the kernel computed; why it was given up, if it was.
        self.kernel_steps = 0
        self.kernel_gave_up: str | None = None
        #: CPU: the norm by one flat copy (:func:`flat_norm`), for a model small for its
        #: number of tensors (a lazy module's size is unknown: per tensor).
        self.flat = (
            self.device.type == "cpu"
            and not self.multi_device
            and not sharded
            and not any(torch.nn.parameter.is_lazy(p) for p in params)
            and sum(p.numel() for p in params) <= FLAT_NUMEL_PER_TENSOR * len(params)
        )
        #: Set at the first step with a sparse gradient: the eager norm of
        #: :func:`dense` gradients from then on.
        self.sparse = False
        #: Every parameter had a gradient at every step so far: the eager gather
        #: needs no filter (see __call__).
        self.every_grad = True
        on_one_gpu = self.device.type == "cuda" and not self.multi_device and not sharded
        if USE_KERNEL and on_one_gpu and not self.wanted:
            self.kernel = True
        # The gradients' addresses -> (graph, its output): one graph per layout the
        # allocator cycles through.
        self._graphs: dict[tuple[int, ...], tuple[Any, Tensor]] = {}
        self._recent: deque[tuple[int, ...]] = deque(maxlen=RECENT_LAYOUTS)
        self._misses = 0  # eager steps in a row
        self._stream: Any = None
        #: Counters for the end-of-run event: steps replayed, steps computed eagerly
        #: while the graph was wanted, graphs captured.
        self.replays = 0
        self.eager = 0
        self.captures = 0
        #: Why the graph was given up during the run, or ``None``.
        self.gave_up: str | None = None

    def __call__(self, params: list[Tensor], step: int = -1) -> Tensor:
        """The norm of ``params``' gradients (those that have one) at step ``step``
        (the guard's completed steps)."""
        if self.buckets is not None and not self.scaled:
            total = self.buckets.total(step)
            if total is not None:
                self.from_buckets += 1
                return total
        if self.kernel is not None and not torch.cuda.is_current_stream_capturing():
            total = self.kernel(params) if self.kernel_steps else self._first_kernel(params)
            if total is not None:
                self.kernel_steps += 1
                return total
        if not self.enabled:  # (a sparse gradient gave the graph up: see _found_sparse)
            # One ``.grad`` read per parameter, not two: ``p.grad`` on a Parameter (a
            # Tensor subclass) looks up ``__torch_function__`` each time. The gather is
            # C calls over the list (no bytecode a tensor): ``map`` alone while every
            # parameter has had a gradient (torch's ops refuse a None in the list),
            # ``grads_of`` (``filter`` too) once one had none.
            if self.every_grad and not self.sparse:
                grads = list(map(_GRAD, params))
                try:  # free until it raises
                    if self.flat:
                        return flat_norm(grads)
                    return total_norm(grads, self.device, self.multi_device)
                except (TypeError, AttributeError, NotImplementedError, RuntimeError):
                    # A parameter without a gradient (frozen, or unused this step):
                    # filtered from now on; a sparse gradient: see _eager.
                    if any(g is None for g in grads):
                        self.every_grad = False
            return self._eager(grads_of(params))
        # One pass over the parameters, as the eager gather: each gradient's address, 0
        # for none (so a different set of parameters with gradients never matches).
        try:
            key = tuple([0 if (g := p.grad) is None else g.data_ptr() for p in params])
        except RuntimeError:  # a sparse gradient has no address (nor a graph)
            self._found_sparse()
            return self(params, step)
        hit = self._graphs.get(key)
        if hit is not None:
            graph, out = hit
            graph.replay()
            self.replays += 1
            self._misses = 0
            # A clone (one small kernel): the graph's output is overwritten by the next
            # replay, and a user may keep g.grad_norm() past this step.
            return out.clone()
        self.eager += 1
        self._misses += 1
        grads = grads_of(params)
        out = total_norm(grads, self.device, False)
        if grads and not torch.cuda.is_current_stream_capturing():
            if self._misses > MAX_MISSES:
                self._give_up(f"the gradients were at new addresses {MAX_MISSES} steps in a row")
            elif key in self._recent:  # a layout that came back: worth a graph
                if self.captures == MAX_CAPTURES:
                    self._give_up(f"the gradients kept moving after {MAX_CAPTURES} captures")
                else:
                    self._capture(grads, key)
        self._recent.append(key)
        return out

    def _eager(self, grads: list[Tensor]) -> Tensor:
        """The norm of ``grads`` (each one a tensor) on the host path: the flat copy or
        the per-tensor norm, or, once a gradient was sparse, the norm of dense values."""
        if not self.sparse:
            try:  # free until it raises
                if self.flat:
                    return flat_norm(grads)
                return total_norm(grads, self.device, self.multi_device)
            except (NotImplementedError, RuntimeError):
                if not any(g.is_sparse for g in grads):
                    raise
                self._found_sparse()
        return total_norm(dense(grads), self.device, self.multi_device)

    def _found_sparse(self) -> None:
        """A sparse gradient (``nn.Embedding(sparse=True)``): the eager norm of dense
        values for the rest of the run (the kernel and a graph read strided memory)."""
        logger.debug("guardrails: a gradient is sparse: the grad norm is eager from now on")
        self.sparse = True
        self.kernel = None
        if self.enabled:
            self._give_up("a gradient is sparse")

    def _first_kernel(self, params: list[Tensor]) -> Tensor | None:
        """Until a step's norm came from the kernel: build its plan (once) and launch it
        (the first launch compiles it, ~1 s, or loads it from Triton's cache). A failure
        leaves the eager norm for the run; ``None`` (a strided gradient): this step's."""
        try:
            if self.kernel is True:
                self.kernel = _table_norm(params)
                if self.kernel is None:  # no Triton, or parameters it cannot read
                    return None
            return self.kernel(params)
        except Exception as err:  # an old or broken Triton: the eager norm is exact too
            logger.debug("guardrails: the grad norm kernel failed to build: %r", err)
            self.kernel = None
            self.kernel_gave_up = f"{type(err).__name__}: {err}"
            return None

    def _capture(self, grads: list[Tensor], key: tuple[int, ...]) -> None:
        """Capture the norm's kernels on a side stream (capture needs one that is not
        the default stream). Not ``torch.cuda.graph(...)``: its ``__enter__``
        synchronizes the device, runs ``gc.collect()`` and empties the allocator's
        cache, which would cost a host sync and move every gradient."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)
        graph = torch.cuda.CUDAGraph()
        # "thread_local": CUDA calls from other threads (a checkpoint writer copying to
        # pinned memory) neither break this capture nor are broken by it.
        with torch.cuda.stream(self._stream):
            # Its own memory pool (a few KiB: the per-gradient norms), freed with it.
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                out = total_norm(grads, self.device, False)
            finally:
                graph.capture_end()
        current.wait_stream(self._stream)
        self._graphs[key] = (graph, out)
        self.captures += 1

    def _give_up(self, why: str) -> None:
        logger.debug("guardrails: grad norm stays eager: %s", why)
        self.gave_up = why
        self.enabled = False
        self._graphs.clear()

    def close(self) -> dict[str, Any]:
        """Drop the graphs (their memory pools go with them) and compute eagerly from
        now on; returns the counters."""
        self.enabled = False
        self._graphs.clear()
        self.buckets = None
        self.kernel = None
        return {
            "replays": self.replays,
            "eager": self.eager,
            "captures": self.captures,
            "gave_up": self.gave_up,
        }


def _table_norm(params: list[Tensor]) -> Any:
    """The kernel norm for ``params`` (``gradnorm_kernel.TableNorm``), or ``None``
    where Triton is missing or the parameters do not suit it."""
    kernel = _kernel_module()
    if kernel is None:  # a CUDA torch without Triton (it ships with its wheels)
        return None
    why = kernel.supports(params)
    if why is not None:
        logger.debug("guardrails: the grad norm stays eager: %s", why)
        return None
    return kernel.TableNorm(params)


class BucketNorms:
    """The L2 norm of each of a DDP model's gradient buckets after its all-reduce,
    written by the comm hook (:meth:`record`), and their total once every bucket of a
    backward reported (:meth:`total`).

    On CUDA each bucket's sum of squares is taken by the guard's Triton kernel
    (``gradnorm_kernel.flat_sum_of_squares``, ``FLAT_PROGRAMS`` partial sums a bucket,
    in fixed slots): GPT-2 small's 13 buckets in 207 us of kernel time beside backward
    on 2 H200s, where ``vector_norm`` and its memsets took 255 us. Elsewhere (gloo on
    CPU, no Triton, a float64 bucket) one ``vector_norm`` per bucket.

    Ordering without a sync: :meth:`record` runs in the all-reduce future's callback,
    whose kernels run on a stream that waits for the all-reduce; DDP's reducer makes the
    training stream wait for that callback's work before backward returns, so the
    norms are written before anything the step enqueues after backward reads them.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._flat = _kernel_module() if device.type == "cuda" else None
        #: Slots each bucket writes: its norm (no kernel here), or ``FLAT_PROGRAMS``
        #: sums of squares (kept if the kernel later fails to build: see _flat_sum).
        self._width = 1 if self._flat is None else self._flat.FLAT_PROGRAMS
        self._slots = torch.zeros(0, dtype=torch.float32, device=device)
        self._n = 0  # buckets in the last complete set
        self._ready_at = -1  # the guard's completed steps when the last set completed
        # gloo completes each bucket's all-reduce on a thread of its own, so callbacks
        # run at once: a slot written into the old tensor while another callback grew
        # it would be lost, and two growths raced ("expanded size ... must match" in
        # 1 of 4 runs of tests/guards/test_ddp.py). NCCL runs them on the autograd thread,
        # one at a time: the lock is uncontended there.
        self._lock = threading.Lock()

    def record(self, index: int, bucket: Tensor, last: bool, step: int) -> None:
        """Bucket ``index`` (``last``: the backward's final one) was reduced at step
        ``step``: keep its norm. DDP rebuilds its buckets after the first step, so the
        slots grow as needed (a new tensor: a set in flight keeps the old one)."""
        with self._lock:
            width = self._width
            slots = self._slots
            if (index + 1) * width > len(slots):
                grown = torch.zeros(
                    max(index + 1, 2 * (len(slots) // width)) * width, device=self.device
                )
                grown[: len(slots)] = slots
                self._slots = slots = grown
            mine = slots[index * width : (index + 1) * width]
            if width == 1:
                _norm_into(bucket, mine[0])
            elif not self._flat_sum(bucket, mine):
                # A float64 or complex bucket, or no kernel: its sum of squares by hand
                # in the same slots.
                _norm_into(bucket, mine[0])
                mine[0].square_()
                mine[1:].zero_()
            if last:
                self._n, self._ready_at = index + 1, step

    def _flat_sum(self, bucket: Tensor, mine: Tensor) -> bool:
        """The kernel's partial sums of ``bucket`` into ``mine``; False where it cannot
        read the bucket, or has failed to build (its first launch compiles it: an old or
        broken Triton), after which it is not tried again."""
        flat = self._flat
        if flat is None or not flat.flat_supports(bucket):
            return False
        try:
            flat.flat_sum_of_squares(bucket, mine)
        except Exception as err:  # vector_norm is exact too
            logger.debug("guardrails: the bucket norm kernel failed to build: %r", err)
            self._flat = None
            return False
        return True

    def total(self, step: int) -> Tensor | None:
        """The total norm when a whole set of buckets was reduced during step ``step``
        (since the last optimizer step), else ``None``."""
        if self._ready_at != step or not self._n:
            return None
        if self._width == 1:
            return torch.linalg.vector_norm(self._slots[: self._n])
        return self._slots[: self._n * self._width].sum().sqrt()


def _norm_into(bucket: Tensor, slot: Tensor) -> None:
    """Write ``bucket``'s L2 norm into the float32 0-d ``slot``."""
    if bucket.dtype in (torch.float32, torch.bfloat16, torch.float16):
        torch.linalg.vector_norm(bucket, dtype=torch.float32, out=slot)
    else:  # float64 or complex: in its own precision (vector_norm refuses to narrow)
        slot.copy_(torch.linalg.vector_norm(bucket))


def _kernel_module() -> Any:
    """``gradnorm_kernel`` where Triton is, else ``None``."""
    try:
        from guardrails.engine import gradnorm_kernel
    except ImportError:
        return None
    return gradnorm_kernel


def share_clip_norm(on_clip: Callable[[list[Any], Tensor], None]) -> Callable[[], None]:
    """Wrap torch's clipping internals so that every ``clip_grad_norm_`` (or
    ``get_total_norm`` + ``clip_grads_with_norm_``) call with an L2 norm reports
    ``on_clip(parameters, total_norm)`` after clipping; returns the function that puts
    torch's functions back exactly.

    Module globals, not ``torch.nn.utils.clip_grad_norm_``: ``clip_grad_norm_`` looks
    both up in its module at each call (torch 2.8-2.13), so a loop that did
    ``from torch.nn.utils import clip_grad_norm_`` before the guard started is seen too.
    A torch without them (renamed) is left alone: the guard then computes its own norm.
    """
    from torch.nn import utils
    from torch.nn.utils import clip_grad

    get_norm = getattr(clip_grad, "_get_total_norm", None)
    clip = getattr(clip_grad, "_clip_grads_with_norm_", None)
    if get_norm is None or clip is None:
        return lambda: None
    # The L2 totals this process computed and has not clipped with yet (by identity:
    # clip_grads_with_norm_ gets the tensor get_total_norm returned). One at a time
    # in practice; a small list so a GAN's two clips in a row are both recognised.
    l2_totals: list[Tensor] = []

    @functools.wraps(get_norm)
    def get_total_norm(tensors: Any, norm_type: float = 2.0, *args: Any, **kwargs: Any) -> Tensor:
        total = get_norm(tensors, norm_type, *args, **kwargs)
        if float(norm_type) == 2.0:
            del l2_totals[:-3]
            l2_totals.append(total)
        return total

    @functools.wraps(clip)
    def clip_grads_with_norm_(
        parameters: Any, max_norm: float, total_norm: Tensor, *args: Any, **kwargs: Any
    ) -> None:
        clip(parameters, max_norm, total_norm, *args, **kwargs)
        if any(t is total_norm for t in l2_totals):
            l2_totals.clear()
            if isinstance(parameters, list):  # clip_grad_norm_ passes its list
                on_clip(parameters, total_norm)

    swapped = [
        (module, name, old, new)
        for module in (clip_grad, utils)
        for name, old, new in (
            ("_get_total_norm", get_norm, get_total_norm),
            ("_clip_grads_with_norm_", clip, clip_grads_with_norm_),
            ("get_total_norm", get_norm, get_total_norm),
            ("clip_grads_with_norm_", clip, clip_grads_with_norm_),
        )
        if getattr(module, name, None) is old
    ]
    for module, name, _, new in swapped:
        setattr(module, name, new)

    def undo() -> None:
        for module, name, old, new in swapped:
            if getattr(module, name, None) is new:  # not if another tool wrapped it since
                setattr(module, name, old)

    return undo
