"""MemoryGuard: leaks named, data starvation measured, out-of-memory errors explained.

Three failure families of the seeds end in memory or in an idle accelerator, and each is
easy to name once the right numbers sit in one place:

* **Leaks** (seed 003: "OOM only in backward / later step ... accumulation holding
  graphs"). The classic is ``losses.append(loss)``: each kept loss keeps its autograd
  graph, memory grows every step, and the OOM comes hours later. Every
  ``leak_check_every_n_steps`` steps MemoryGuard reads two counters, both host reads with
  no device sync: Python heap blocks (``sys.getallocatedblocks()``, one per small
  object; 30 us, 120 us with 3M objects live, measured on CPU) and device memory
  (``torch.cuda.memory_allocated``, the allocator's host-side counter; RSS from
  ``/proc/self/statm`` on CPU). Only when one of them grew at each of the last
  ``leak_window_checks`` checks (a check at which it fell while a garbage collection ran
  is skipped: that collection freed older garbage, maybe someone else's) does it take a
  census (``gc.get_objects()``: a type histogram and the live tensors; 0.2 s with 2M
  objects, and after the GCScheduler's ``gc.freeze()`` only the objects allocated since,
  because frozen objects are not listed), and a second one a check later. Their
  difference decides, and is reported once as a ``leak`` event: the types that grew,
  whether the new tensors hold autograd graphs, the variable that holds them, and the
  fix. A census pair that finds nothing worth reporting doubles the window, so a slow
  benign growth (a list of floats) costs a handful of censuses per run, not one per
  window. The defaults line up with the GCScheduler's (both every 100 steps, and the
  scheduler runs first), so a check sees the heap right after a young collection,
  without the step's cyclic garbage.
* **Data starvation** (seed 003: "too slow: data starvation"): two float adds per step
  sum the time blocked in the loader and the step time; at the end of each window of
  ``data_starvation_window_steps`` (step 1 excluded: worker start-up, lazy init, the GC
  freeze) the share decides. One ``data_starvation`` event, with the numbers and the
  remedies that fit this loader (its ``num_workers``, ``pin_memory``...).
* **Out of memory** (seed 003's OOM section; seed 002 issue 6, "OOM on only some
  GPUs"): a ``torch.OutOfMemoryError`` (or the CPU allocator's ``RuntimeError``) that
  ends the guarded loop comes out as :class:`guardrails.OutOfMemoryError`, still a
  ``torch.OutOfMemoryError``, with the original as its ``__cause__``. It names the phase
  (data / forward / backward / optimizer step), step and rank; the allocator's numbers
  (allocated, reserved, peak, fragmentation = reserved - allocated); the largest live
  tensors (one ``gc.get_objects()`` scan, at the error, plus the parameters, gradients
  and optimizer state, which the GCScheduler's freeze hides from that scan); other
  ranks' memory; and the seeds' remedies ranked by what those numbers say.

  Other ranks are read without a collective (one may be the reason this rank is stuck
  or dying): in distributed runs each rank writes its memory numbers to
  ``run_dir/memory/rank-NNNNN.json`` at every leak check (one small file per rank per
  check, written atomically) and at its own OOM; the failing rank reads them. So the
  others' numbers are as of their last check, and the report says which step that was.
"""

from __future__ import annotations

import gc
import json
import logging
import math
import os
import re
import sys
import time
import weakref
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from types import FrameType, ModuleType
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from guardrails._checks import fraction, positive_int
from guardrails._component import Component
from guardrails._config import configure
from guardrails._errors import OutOfMemoryError

if TYPE_CHECKING:
    from guardrails._guard import Guard

logger = logging.getLogger("guardrails")

#: Growth below these rates is not reported unless it is tensors holding graphs: a
#: list of one float or one dict of metrics per step (1-5 heap blocks) is history, not a
#: leak, and telemetry's host rows alone add ~8 blocks a step between flushes (measured).
#: 100 objects a step is 10M objects (~1 GB, and a slower GC) over 100k steps; 64 KiB a
#: step is 6.4 GB over 100k steps.
MIN_OBJECTS_PER_STEP = 100
MIN_BYTES_PER_STEP = 64 * 1024

#: What each value of ``Guard.phase`` means, in the error message.
PHASES = {
    "setup": "before the first batch (model / optimizer setup inside the guard)",
    "data": "in the loader's next() (loading, collating or pinning a batch)",
    "forward": "in the model's forward",
    "backward": "after the model's forward and before optimizer.step() (the loss, "
    "backward, gradient clipping)",
    "optimizer": "in optimizer.step()",
    "loop": "in the loop body outside forward, backward and optimizer.step() (moving a "
    "batch to the device, zero_grad, logging, evaluation)",
}

_PROJECT_DIRS = (str(Path(__file__).parent), str(Path(torch.__file__).parent))
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_CPU_OOM = re.compile(r"DefaultCPUAllocator: (can't allocate|not enough) memory")
_REQUESTED = re.compile(
    r"[Tt]ried to allocate (?:(\d+) bytes|([\d.]+) (B|KiB|MiB|GiB|TiB))"
)  # CPU: "you tried to allocate 123 bytes"; CUDA: "Tried to allocate 2.00 GiB"
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


class MemoryGuard(Component):
    """Reports growing memory (leaks) and data starvation, and explains out-of-memory
    errors. Knobs: :class:`MemoryGuard.Config` (``guardrails.guard(memory=...)``)."""

    @dataclass(kw_only=True)
    class Config:
        """MemoryGuard's knobs.

        Attributes:
            leak_check_every_n_steps: read live Python objects and device memory every
                this many optimizer steps (host counters only, no device sync) and
                report steady growth once as a ``leak`` event naming what grows and
                what holds it. ``None`` turns leak detection off. Default 100.
            leak_window_checks: suspect a leak after growth at this many consecutive
                checks, then confirm it with a census of live objects. Default 4.
            data_starvation_window_steps: report once (a ``data_starvation`` event)
                when, over a window of this many steps, waiting for the loader takes at
                least ``data_starvation_fraction`` of the step time. ``None`` turns the
                report off. Default 100.
            data_starvation_fraction: see ``data_starvation_window_steps``. Default 0.3.
            explain_oom: re-raise an out-of-memory error that ends the loop as
                :class:`~guardrails.OutOfMemoryError` (still a
                ``torch.OutOfMemoryError``) with where it happened, the memory summary,
                the largest tensors and ranked remedies. Default True.
        """

        leak_check_every_n_steps: int | None = 100
        leak_window_checks: int = 4
        data_starvation_window_steps: int | None = 100
        data_starvation_fraction: float = 0.3
        explain_oom: bool = True

        def __post_init__(self) -> None:
            positive_int("leak_check_every_n_steps", self.leak_check_every_n_steps, allow_none=True)
            positive_int("leak_window_checks", self.leak_window_checks)
            positive_int(
                "data_starvation_window_steps", self.data_starvation_window_steps, allow_none=True
            )
            fraction("data_starvation_fraction", self.data_starvation_fraction)
            self.data_starvation_fraction = float(self.data_starvation_fraction)
            self.explain_oom = bool(self.explain_oom)

        @property
        def does_anything(self) -> bool:
            """Whether any of its three features is on (``guard()`` leaves it out if not)."""
            return (
                self.leak_check_every_n_steps is not None
                or self.data_starvation_window_steps is not None
                or self.explain_oom
            )

    name = "memory"
    # A leak check at a collection step must see the heap without that step's cyclic
    # garbage: the GC scheduler's after_step collects first.
    after = ("gc",)

    def __init__(self, config: MemoryGuard.Config | None = None, /, **knobs: Any) -> None:
        configure(self, config, knobs)
        #: The fields of the ``leak`` event once reported, else ``None``.
        self.leak: dict[str, Any] | None = None
        #: The fields of the ``data_starvation`` event once reported, else ``None``.
        self.starvation: dict[str, Any] | None = None
        #: Censuses taken (each a ``gc.get_objects()`` scan): ``(step, seconds)``.
        self.censuses: list[tuple[int, float]] = []

    # ------------------------------------------------------------------ lifecycle

    def on_start(self, guard: Guard) -> None:
        self._device = guard.device
        self._cuda = guard.device.type == "cuda"
        # (step, heap blocks, memory bytes, collections so far)
        self._samples: list[tuple[int, int, int, int]] = []
        self._need = self.leak_window_checks  # growing checks before a census
        self._census: _Census | None = None
        self._next_leak = self.leak_check_every_n_steps or math.inf
        self._wait_s = self._step_s = 0.0
        self._window_start = 1
        self._next_window = 1 if self.data_starvation_window_steps else math.inf
        self._next = min(self._next_leak, self._next_window)
        self._rank_file: Path | None = None
        if guard.world_size > 1:
            self._rank_file = _rank_file(guard.run_dir, guard.rank)
            # A file left by an earlier run in this run_dir would pass for this one's.
            self._rank_file.unlink(missing_ok=True)

    def after_step(self, guard: Guard) -> None:
        # Per step: two float adds and a compare; everything else at window ends.
        self._wait_s += guard.data_wait_s
        self._step_s += guard.step_time_s
        if guard.step >= self._next:
            step = guard.step
            if step >= self._next_window:
                self._end_window(guard, step)
            if step >= self._next_leak:
                self._next_leak = step + self.leak_check_every_n_steps  # type: ignore[operator]
                self._check_leak(guard, step)
            self._next = min(self._next_leak, self._next_window)

    def on_end(self, guard: Guard, exc: BaseException | None) -> None:
        self._census = None
        if exc is not None and self.explain_oom and is_oom(exc):
            guard.replace_error(self._explain_oom(guard, exc))

    # ------------------------------------------------------------------ data starvation

    def _end_window(self, guard: Guard, step: int) -> None:
        window = self.data_starvation_window_steps
        assert window is not None
        first, n = self._window_start + 1, step - self._window_start
        wait, total = self._wait_s, self._step_s
        self._wait_s = self._step_s = 0.0
        self._window_start = step
        self._next_window = step + window
        if n == 0 or not total > 0:  # step 1: the warm-up, excluded
            return
        share = wait / total
        if share < self.data_starvation_fraction:
            return
        self._next_window = math.inf  # reported once per run
        fields = {
            "share": share,
            "mean_wait_s": wait / n,
            "mean_step_s": total / n,
            "window_steps": [first, step],
            "loader": _loader_settings(guard.loader),
        }
        remedies = _starvation_remedies(fields["loader"])
        fields["remedies"] = remedies
        self.starvation = fields
        guard.event(
            "data_starvation",
            level="warning",
            message=(
                f"data starvation: over steps {first}-{step} this rank waited for the "
                f"loader {share:.0%} of the step time ({fields['mean_wait_s'] * 1e3:.1f} ms "
                f"of {fields['mean_step_s'] * 1e3:.1f} ms per step), so the accelerator idles "
                "that long each step. Remedies: " + "; ".join(remedies)
            ),
            **fields,
        )

    # ------------------------------------------------------------------ leaks

    def _check_leak(self, guard: Guard, step: int) -> None:
        if self._rank_file is not None:
            _write_rank_file(self._rank_file, guard, self._device)
        if self.leak is not None:  # reported once
            return
        samples = self._samples
        samples.append(
            (
                step,
                sys.getallocatedblocks(),
                _memory_bytes(self._device),
                sum(g["collections"] for g in gc.get_stats()),  # ~1 us
            )
        )
        if self._census is not None:
            # Growth suspected at the previous check: the second census decides.
            self._confirm(guard, step)
            return
        # Bounded: a window's worth of checks, with room for inconclusive intervals.
        del samples[: -(4 * self._need + 1)]
        if _growing(samples, 1, self._need) or _growing(samples, 2, self._need):
            self._census = self._take_census(step, None)[0]

    def _take_census(self, step: int, before: _Census | None) -> tuple[_Census, list[Tensor]]:
        census, fresh = _take_census(step, before)
        self.censuses.append((step, census.seconds))
        return census, fresh

    def _confirm(self, guard: Guard, step: int) -> None:
        before = self._census
        assert before is not None
        self._census = None
        after, fresh = self._take_census(step, before)
        sample: Tensor | None = None
        try:
            first_step, b_first, m_first, _ = self._samples[0]
            _, b_now, m_now, _ = self._samples[-1]
            span = max(step - first_step, 1)
            n = max(step - before.step, 1)
            new_graphs = [t for t in fresh if t.requires_grad and not t.is_leaf]
            graph_growth = after.graph_tensors - before.graph_tensors
            tensor_growth = after.tensors - before.tensors
            tensor_bytes_per_step = (after.tensor_bytes - before.tensor_bytes) / n
            objects_per_step = (b_now - b_first) / span
            bytes_per_step = (m_now - m_first) / span
            candidates: list[Tensor] = []
            if graph_growth >= 2 and new_graphs:
                cause, candidates = "tensors_holding_graphs", new_graphs
            elif tensor_bytes_per_step >= MIN_BYTES_PER_STEP:
                cause, candidates = "tensors", fresh
            elif self._cuda and bytes_per_step >= MIN_BYTES_PER_STEP:
                # CUDA's counter is exact: growth no Python tensor accounts for is held
                # in C++ (autograd's saved tensors, an extension). RSS on CPU is too
                # noisy (allocator caches, fragmentation) to be a cause on its own.
                cause = "memory"
            elif objects_per_step >= MIN_OBJECTS_PER_STEP:
                cause = "python_objects"
            else:
                # Growth too slow to matter (history lists, caches filling up): look
                # again after a window twice as long, so censuses stay rare.
                self._need *= 2
                del self._samples[:-1]
                return
            grown = after.types - before.types
            # Census A itself is alive: its object, histogram, dict of weak references.
            grown.subtract({_Census: 1, Counter: 1, dict: 1, weakref.ref: before.tensors})
            growing = [[_type_name(t), k] for t, k in grown.most_common(5) if k > 0]
            fields: dict[str, Any] = {
                "cause": cause,
                "window_steps": [first_step, step],
                "objects_per_step": objects_per_step,
                "memory_bytes_per_step": bytes_per_step,
                "memory_kind": "cuda_allocated" if self._cuda else "rss",
                "tensors_per_step": tensor_growth / n,
                "tensor_bytes_per_step": tensor_bytes_per_step,
                "graph_tensors_per_step": graph_growth / n,
                "growing_types": growing,
                "tensor": None,
                "held_by": None,
                "census_s": before.seconds + after.seconds,
            }
            if candidates:
                fields["held_by"], sample = _holder(candidates, (fresh, new_graphs))
                fields["tensor"] = _describe(sample)
        finally:
            del fresh, sample
        self._samples = []
        self.leak = fields
        message, hint = _leak_message(fields)
        guard.event("leak", level="warning", message=f"{message} Fix: {hint}", fix=hint, **fields)

    # ------------------------------------------------------------------ out of memory

    def _explain_oom(self, guard: Guard, exc: BaseException) -> OutOfMemoryError:
        phase = guard.phase
        step = guard.step + 1  # the step in progress, 1-based as in metrics.parquet
        device = _oom_device(exc, guard.device)
        memory = _memory_summary(device, exc)
        tensors, by_kind = _live_tensors(guard, device)
        memory["by_kind"] = by_kind
        per_rank: dict[int, Any] | None = None
        if guard.world_size > 1:
            per_rank = _read_rank_files(guard, device)
        remedies = _oom_remedies(guard, phase, memory, per_rank, self.leak)
        text = _oom_message(guard, phase, step, device, memory, tensors, per_rank)
        hint = "\n".join(f"  {i}. {text}" for i, (_, text) in enumerate(remedies, 1))
        keys = [key for key, _ in remedies]
        guard.event(
            "oom",
            level="error",
            message=text,
            phase=phase,
            in_step=step,
            memory=memory,
            largest_tensors=tensors,
            per_rank=per_rank,
            remedies=keys,
        )
        return OutOfMemoryError(
            text,
            rank=guard.rank,
            step=step,
            hint="remedies, most likely first:\n" + hint,
            phase=phase,
            memory=memory,
            largest_tensors=tensors,
            remedies=keys,
            per_rank=per_rank,
        )


# ---------------------------------------------------------------------- leak helpers


@dataclass
class _Census:
    """What one ``gc.get_objects()`` scan saw. Holds no reference to the objects."""

    step: int
    types: Counter[type]
    tensors: int
    tensor_bytes: int
    graph_tensors: int
    #: Weak references to the tensors seen, by id: an id alone would be reused by a
    #: tensor allocated where a dead one was (this step's loss in last step's grad).
    tensor_refs: dict[int, weakref.ref[Tensor]]
    seconds: float


def _take_census(step: int, before: _Census | None) -> tuple[_Census, list[Tensor]]:
    """Census the objects the GC tracks (frozen ones are not listed). Also returns the
    tensors that were not in ``before`` (strong references: the caller drops them)."""
    t0 = time.perf_counter()
    objs = gc.get_objects()
    try:
        types = Counter(map(type, objs))
        # A set lookup per object: isinstance(o, Tensor) goes through torch's metaclass
        # and costs ~0.15 us each (0.3 s for 2M objects, measured).
        kinds = {t for t in types if issubclass(t, Tensor)}
        tensors = [o for o in objs if type(o) in kinds]
    finally:
        del objs
    old = before.tensor_refs if before is not None else {}
    fresh = [t for t in tensors if (ref := old.get(id(t))) is None or ref() is not t]
    census = _Census(
        step=step,
        types=types,
        tensors=len(tensors),
        tensor_bytes=sum(_storages(tensors).values()),
        graph_tensors=sum(1 for t in tensors if t.requires_grad and not t.is_leaf),
        tensor_refs={id(t): weakref.ref(t) for t in tensors},
        seconds=0.0,
    )
    del tensors
    census.seconds = time.perf_counter() - t0
    return census, fresh


def _growing(samples: list[tuple[int, int, int, int]], i: int, need: int) -> bool:
    """Whether ``sample[i]`` rose in each of the last ``need`` intervals that tell. An
    interval in which it fell while a garbage collection ran says nothing (the
    collection freed older garbage, possibly someone else's) and is skipped; a fall
    with no collection means no steady growth."""
    rises = 0
    for newer, older in pairwise(reversed(samples)):
        if newer[i] > older[i]:
            rises += 1
            if rises >= need:
                return True
        elif newer[3] == older[3]:
            return False
    return False


def _leak_message(f: dict[str, Any]) -> tuple[str, str]:
    steps = f"steps {f['window_steps'][0]}-{f['window_steps'][1]}"
    mem = (
        f"device memory grew {_fmt(f['memory_bytes_per_step'])} per step"
        if f["memory_kind"] == "cuda_allocated"
        else f"RSS grew {_fmt(f['memory_bytes_per_step'])} per step"
    )
    held = f", held by {f['held_by']}" if f.get("held_by") else ""
    types = ", ".join(f"{name} +{n}" for name, n in f["growing_types"]) or "none the GC tracks"
    if f["cause"] == "tensors_holding_graphs":
        message = (
            f"memory leak: live tensors that hold autograd graphs grow by "
            f"{f['graph_tensors_per_step']:.1f} per step (newest: {f['tensor']}{held}). "
            "Each one keeps its whole graph alive (the graph's nodes, and the activations "
            f"it saved if no backward ran through it); over {steps} Python objects grew "
            f"{f['objects_per_step']:.1f} per step and {mem}. Most likely "
            "`losses.append(loss)` or `total += loss`: a loss kept with its graph."
        )
        hint = (
            "keep `loss.detach()` (stays on the device, no sync) or, only every N steps, "
            "`loss.item()`; never a tensor that still has a grad_fn."
        )
    elif f["cause"] in ("tensors", "memory"):
        what = "live tensors" if f["cause"] == "tensors" else "memory"
        message = (
            f"memory leak: {what} grow steadily over {steps}: {mem}, "
            f"{f['tensors_per_step']:.1f} more tensors per step"
            + (f" (newest: {f['tensor']}{held})" if f.get("tensor") else "")
            + f"; types that grew most between the last two checks: {types}."
        )
        hint = (
            "find what keeps tensors from past steps: a list or dict of outputs, "
            "activations or batches kept for logging, a cache that is never trimmed, "
            "`retain_graph=True`. Keep detached, reduced values (`t.detach()`, "
            "`t.mean().detach()`), move them to the CPU in bulk every N steps, or drop them."
        )
    else:
        message = (
            f"memory leak: Python objects grow by {f['objects_per_step']:.0f} per step over "
            f"{steps} ({mem}); the types that grew most between the last two checks: "
            f"{types}."
            + (
                ""
                if f["growing_types"]
                else " None of them is tracked by the GC: str, bytes, int, float, or "
                "containers of only those (a list of strings, a dict of floats)."
            )
        )
        hint = (
            "something keeps per-step objects: a history list, a cache or a dict that is "
            "never trimmed. Keep only what you need, trim it, or write it out every N steps."
        )
    return message, hint


def _describe(t: Tensor) -> str:
    fn = t.grad_fn
    graph = f", grad_fn={type(fn).__name__}" if fn is not None else ""
    shape = "0-d" if t.ndim == 0 else "x".join(map(str, t.shape))
    return f"a {shape} {str(t.dtype).removeprefix('torch.')} {t.device} tensor{graph}"


def _holder(new: list[Tensor], exclude: tuple[list[Any], ...]) -> tuple[str | None, Tensor]:
    """What keeps the new tensors alive: the container holding the most of them, named
    when it is a local variable (or an attribute of one) of a frame on the stack, else
    as the GC's referrer. Returns (that description or None, one tensor it holds).

    The most, not the first: the step's own tensors (this loss, this batch) are new
    too, held by plain variables or for one step; a leak holds one per step. Frame
    locals first: the loop's variables are GC roots (no referrer lists them), and a
    container made before the GCScheduler's freeze is frozen, which
    ``gc.get_referrers`` does not search. On Python 3.11/3.12 reading ``f_locals``
    leaves a snapshot of the frame's locals on the frame until its next read; this
    runs once per run, at the leak report.
    """
    ids = {id(t) for t in new}
    best: tuple[int, str | None, Any] = (0, None, None)
    frame = sys._getframe(1)
    for _ in range(64):
        if frame is None:
            break
        code = frame.f_code
        if not code.co_filename.startswith(_PROJECT_DIRS):
            where = f"{code.co_name} ({Path(code.co_filename).name}:{frame.f_lineno})"
            for name, value in list(frame.f_locals.items()):
                best = _more(best, value, ids, f"`{name}`", where)
                if isinstance(value, (type, ModuleType)) or callable(value):
                    continue
                try:
                    attrs = vars(value)
                except TypeError:
                    continue
                for attr, inner in list(attrs.items()):
                    best = _more(best, inner, ids, f"`{name}.{attr}`", where)
        frame = frame.f_back
    if best[0] < 2:
        for ref in gc.get_referrers(*new[:64]):
            if not isinstance(ref, FrameType) and not any(ref is e for e in exclude):
                best = _more(best, ref, ids, None, "not a variable of the loop's frames")
    if best[2] is None:
        return None, new[0]
    _, label, container = best
    items = container.values() if isinstance(container, dict) else container
    sample = next(x for x in reversed(list(items)) if id(x) in ids)
    return label, sample


def _more(
    best: tuple[int, str | None, Any], value: Any, ids: set[int], name: str | None, where: str
) -> tuple[int, str | None, Any]:
    """``best``, or ``value`` if it is a container holding more of ``ids``."""
    if isinstance(value, (list, tuple, deque)):
        items: Iterable[Any] = value
    elif isinstance(value, dict):
        items = value.values()
    else:
        return best
    count = sum(1 for x in items if id(x) in ids)
    if count <= best[0]:
        return best
    kind = f"a {type(value).__name__} of {len(value)}"
    label = f"{name} ({kind}) in {where}" if name else f"{kind} ({where})"
    return count, label, value


def _type_name(t: type) -> str:
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


# ---------------------------------------------------------------------- memory numbers


def _memory_bytes(device: torch.device) -> int:
    """Device memory in use: CUDA's allocated bytes (a host-side counter, no sync), or
    this process's RSS on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    return _rss_bytes()


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):  # not Linux
        return 0


def _peak_rss_bytes() -> int | None:
    try:
        import resource
    except ImportError:  # pragma: no cover
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("MemTotal", "MemAvailable"):
                    out[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError):
        pass
    return out


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` is an out-of-memory error MemoryGuard explains: torch's
    ``OutOfMemoryError`` (CUDA and other accelerators) or the CPU allocator's
    ``RuntimeError``. Not one guardrails already explained."""
    if isinstance(exc, OutOfMemoryError):
        return False
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and bool(_CPU_OOM.search(str(exc)))


def _requested_bytes(exc: BaseException) -> int | None:
    m = _REQUESTED.search(str(exc))
    if m is None:
        return None
    if m.group(1) is not None:
        return int(m.group(1))
    return int(float(m.group(2)) * _UNITS[m.group(3)])


def _oom_device(exc: BaseException, default: torch.device) -> torch.device:
    m = re.search(r"GPU (\d+) has a total capacity", str(exc))
    if m is not None and torch.cuda.is_available():
        return torch.device("cuda", int(m.group(1)))
    if _CPU_OOM.search(str(exc)):
        return torch.device("cpu")
    return default


def _memory_summary(device: torch.device, exc: BaseException) -> dict[str, Any]:
    """The allocator's numbers, in bytes. Read at the error only: host counters."""
    out: dict[str, Any] = {"device": str(device), "requested": _requested_bytes(exc)}
    if device.type == "cuda" and torch.cuda.is_available():
        stats = torch.cuda.memory_stats(device)
        allocated = int(stats.get("allocated_bytes.all.current", 0))
        reserved = int(stats.get("reserved_bytes.all.current", 0))
        out.update(
            allocated=allocated,
            reserved=reserved,
            peak=int(stats.get("allocated_bytes.all.peak", 0)),
            fragmentation=reserved - allocated,
            alloc_retries=int(stats.get("num_alloc_retries", 0)),
        )
        try:
            free, total = torch.cuda.mem_get_info(device)
            out.update(free=int(free), total=int(total))
        except RuntimeError:  # the context may be unusable after some failures
            pass
        return out
    info = _meminfo()
    out.update(
        rss=_rss_bytes(),
        peak=_peak_rss_bytes(),
        free=info.get("MemAvailable"),
        total=info.get("MemTotal"),
    )
    return out


def _live_tensors(
    guard: Guard, device: torch.device, top: int = 10
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """The largest live tensors (one entry per storage, so views are not counted twice)
    and the bytes on ``device`` by kind: parameters, gradients, optimizer state, other.

    The GC lists every tensor Python can reach except frozen ones; the GCScheduler
    freezes the model and optimizer state after step 1, so those are added by name.
    Activations saved for backward live in the autograd graph, not in Python objects:
    on CUDA they are in ``allocated`` minus what is listed here.
    """
    names: dict[int, tuple[str, str]] = {}  # id(tensor) -> (kind, name)
    named: list[Tensor] = []
    for pname, p in guard.model.named_parameters():
        names[id(p)] = ("parameter", pname)
        named.append(p)
        if p.grad is not None:
            names[id(p.grad)] = ("gradient", f"{pname}.grad")
            named.append(p.grad)
    by_id = {id(p): n for n, p in guard.model.named_parameters()}
    states = [(p, s) for opt in guard.optimizers.values() for p, s in opt.state.items()]
    for p, state in states:
        for key, value in state.items() if isinstance(state, dict) else ():
            if isinstance(value, Tensor):
                names[id(value)] = ("optimizer_state", f"{key} of {by_id.get(id(p), '?')}")
                named.append(value)
    objs = gc.get_objects()
    try:
        types = {t for t in set(map(type, objs)) if issubclass(t, Tensor)}
        found = [o for o in objs if type(o) in types]
    finally:
        del objs
    seen: dict[Any, dict[str, Any]] = {}
    totals = {"parameters": 0, "gradients": 0, "optimizer_state": 0, "other_tensors": 0}
    plural = {
        "parameter": "parameters",
        "gradient": "gradients",
        "optimizer_state": "optimizer_state",
        "other": "other_tensors",
    }
    for t in named + found:
        found_storage = _storage(t)
        if found_storage is None:
            continue
        key, nbytes = found_storage
        if key in seen or nbytes == 0:
            continue
        kind, name = names.get(id(t), ("other", None))
        seen[key] = {
            "name": name,
            "kind": kind,
            "shape": list(t.shape),
            "dtype": str(t.dtype).removeprefix("torch."),
            "device": str(t.device),
            "bytes": int(nbytes),
            "holds_graph": bool(t.requires_grad and not t.is_leaf),
        }
        if _same_device(t.device, device):
            totals[plural[kind]] += int(nbytes)
    del found, named
    largest = sorted(seen.values(), key=lambda d: d["bytes"], reverse=True)[:top]
    return largest, totals


def _storage(t: Tensor) -> tuple[tuple[str, int], int] | None:
    """(key, bytes) of the memory behind ``t``; views of one storage share the key."""
    # Only plain tensors and parameters own real memory we can key: a subclass may be
    # a FakeTensor (torch.compile's tracing leftovers), whose data_ptr() warns and will
    # raise, or a wrapper (DTensor) whose storage is not where its bytes are.
    if type(t) not in (Tensor, torch.nn.Parameter) or t.is_meta:
        return None
    try:
        s = t.untyped_storage()
        return (str(s.device), s.data_ptr()), int(s.nbytes())
    except Exception:  # sparse, meta, fake or other storage-less tensors
        return None


def _storages(tensors: list[Tensor]) -> dict[tuple[str, int], int]:
    """Bytes per distinct storage, so views are counted once."""
    out: dict[tuple[str, int], int] = {}
    for t in tensors:
        found = _storage(t)
        if found is not None:
            out[found[0]] = found[1]
    return out


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    return a.type == "cpu" or (a.index or 0) == (b.index or 0)


# ---------------------------------------------------------------------- ranks


def _rank_file(run_dir: Path, rank: int) -> Path:
    return run_dir / "memory" / f"rank-{rank:05d}.json"


def _write_rank_file(path: Path, guard: Guard, device: torch.device) -> None:
    """This rank's memory numbers for the others to read at an OOM: one small atomic
    write (temp file, then rename), at leak checks and at this rank's own OOM."""
    record: dict[str, Any] = {"rank": guard.rank, "step": guard.step, "time": time.time()}
    if device.type == "cuda":
        record.update(
            allocated=int(torch.cuda.memory_allocated(device)),
            reserved=int(torch.cuda.memory_reserved(device)),
            peak=int(torch.cuda.max_memory_allocated(device)),
        )
    else:
        record.update(allocated=_rss_bytes(), reserved=None, peak=_peak_rss_bytes())
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".tmp-{path.name}")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)
    except OSError as err:  # a full or read-only disk must not stop training
        logger.warning("guardrails: could not write %s: %s", path, err)


def _read_rank_files(guard: Guard, device: torch.device) -> dict[int, Any]:
    _write_rank_file(_rank_file(guard.run_dir, guard.rank), guard, device)
    out: dict[int, Any] = {}
    for path in sorted((guard.run_dir / "memory").glob("rank-*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and 0 <= record.get("rank", -1) < guard.world_size:
            out[int(record["rank"])] = record
    return out


def _imbalance(rank: int, per_rank: dict[int, Any] | None) -> tuple[float, float] | None:
    """(this rank's peak, the median of the others'), when the others are known."""
    if not per_rank or rank not in per_rank:
        return None
    others = sorted(r["peak"] for k, r in per_rank.items() if k != rank and r.get("peak"))
    mine = per_rank[rank].get("peak")
    if not others or not mine:
        return None
    return float(mine), float(others[len(others) // 2])


# ---------------------------------------------------------------------- the OOM message


def _fmt(n: float | None) -> str:
    if n is None:
        return "?"
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    return f"{sign}{n:.2f} GiB"  # pragma: no cover


def _oom_message(
    guard: Guard,
    phase: str,
    step: int,
    device: torch.device,
    memory: dict[str, Any],
    tensors: list[dict[str, Any]],
    per_rank: dict[int, Any] | None,
) -> str:
    mode = "" if guard.model.training else " (the model is in eval() mode)"
    lines = [
        f"out of memory on {device} {PHASES.get(phase, phase)}{mode}, during step {step}"
        f" ({guard.step} completed)"
        + (f"; tried to allocate {_fmt(memory['requested'])}" if memory.get("requested") else "")
        + (
            f" with {_fmt(memory['free'])} free of {_fmt(memory['total'])}"
            if memory.get("total")
            else ""
        )
        + "."
    ]
    if "reserved" in memory:
        lines.append(
            f"memory: allocated {_fmt(memory['allocated'])}, reserved "
            f"{_fmt(memory['reserved'])} (fragmentation, reserved but not allocated: "
            f"{_fmt(memory['fragmentation'])}), peak {_fmt(memory['peak'])}."
        )
    else:
        lines.append(f"memory: RSS {_fmt(memory['rss'])}, peak RSS {_fmt(memory['peak'])}.")
    kinds = memory["by_kind"]
    parts = [
        f"parameters {_fmt(kinds['parameters'])}",
        f"gradients {_fmt(kinds['gradients'])}",
        f"optimizer state {_fmt(kinds['optimizer_state'])}",
        f"other live tensors {_fmt(kinds['other_tensors'])}",
    ]
    if "allocated" in memory:
        rest = memory["allocated"] - sum(kinds.values())
        parts.append(f"not in any Python tensor (saved activations, autograd) {_fmt(rest)}")
    lines.append(f"on {device} by kind: " + ", ".join(parts) + ".")
    if tensors:
        lines.append("largest live tensors:")
        for t in tensors[:5]:
            name = f" {t['name']}" if t["name"] else ""
            graph = ", holds a graph" if t["holds_graph"] else ""
            shape = "x".join(map(str, t["shape"])) or "0-d"
            lines.append(
                f"  {_fmt(t['bytes'])}  {t['kind']}{name}: {shape} {t['dtype']} on "
                f"{t['device']}{graph}"
            )
    if per_rank:
        shown = ", ".join(
            f"rank {r}: peak {_fmt(rec.get('peak'))} (step {rec.get('step')})"
            for r, rec in sorted(per_rank.items())
        )
        lines.append(
            f"ranks, as of their last memory check (run_dir/memory/, no collective): {shown}."
        )
    return "\n".join(lines)


def _oom_remedies(
    guard: Guard,
    phase: str,
    memory: dict[str, Any],
    per_rank: dict[int, Any] | None,
    leak: dict[str, Any] | None,
) -> list[tuple[str, str]]:
    """The seeds' OOM remedies, each scored by what the numbers say; best first."""
    scored: list[tuple[int, str, str]] = []
    kinds = memory["by_kind"]
    allocated = memory.get("allocated")
    requested = memory.get("requested")
    in_model = phase in ("forward", "backward")
    state = kinds["parameters"] + kinds["gradients"] + kinds["optimizer_state"]

    if in_model and not guard.model.training:
        scored.append(
            (
                100,
                "no_grad_eval",
                "the OOM is in an evaluation forward (model.eval()): run it under "
                "`with torch.no_grad():` (or torch.inference_mode()) if it is not; "
                "otherwise each forward keeps its activations for a backward that never "
                "comes.",
            )
        )
    if leak is not None:
        scored.append(
            (
                95,
                "fix_leak",
                f"memory was growing before the OOM ({leak['cause']}"
                + (f", held by {leak['held_by']}" if leak.get("held_by") else "")
                + "): see the `leak` event; fix that first, the OOM is its symptom.",
            )
        )
    imbalance = _imbalance(guard.rank, per_rank)
    if imbalance is not None and imbalance[0] > 1.2 * imbalance[1]:
        scored.append(
            (
                90,
                "rank_imbalance",
                f"this rank peaked at {_fmt(imbalance[0])}, the other ranks at a median of "
                f"{_fmt(imbalance[1])}: make every rank get the same batch size "
                "(DistributedSampler, drop_last=True) and look for work done on this rank "
                "only (metrics, logging tensors, an extra eval on rank 0).",
            )
        )
    frag = memory.get("fragmentation")
    if frag is not None and memory.get("reserved"):
        if requested and frag >= requested:
            score = 92
            why = f"more than the {_fmt(requested)} requested: the memory exists, in pieces"
        elif frag > 0.1 * memory["reserved"]:
            score = 60
            why = f"{frag / memory['reserved']:.0%} of what PyTorch reserved"
        else:
            score = 0
            why = ""
        if score:
            scored.append(
                (
                    score,
                    "expandable_segments",
                    f"fragmentation is {_fmt(frag)} ({why}): start the process with "
                    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True so freed blocks "
                    "serve other sizes.",
                )
            )
    activations = None if allocated is None else allocated - state
    act_share = activations / allocated if activations is not None and allocated else None
    if phase in ("forward", "backward", "loop"):
        score = 85 if act_share is not None and act_share >= 0.5 else 55
        share = (
            f" ({_fmt(activations)}, {act_share:.0%} of allocated, is not parameters, "
            "gradients or optimizer state)"
            if act_share is not None
            else ""
        )
        scored.append(
            (
                score,
                "activation_checkpointing",
                f"activations dominate{share}: use activation checkpointing "
                "(torch.utils.checkpoint around each block) to recompute them in backward "
                "instead of keeping them.",
            )
        )
    scored.append(
        (
            80 if in_model else 40,
            "smaller_micro_batch",
            "halve the micro-batch (or the sequence length) and accumulate gradients over "
            "2 micro-batches per optimizer step: the same effective batch with about half "
            "the activation memory.",
        )
    )
    if in_model:
        scored.append(
            (
                50,
                "bf16",
                "run the forward under torch.autocast(device_type, dtype=torch.bfloat16): "
                "activations take half the bytes.",
            )
        )
    if phase == "optimizer" or (allocated and state >= 0.5 * allocated):
        first = phase == "optimizer" and guard.step == 0
        scored.append(
            (
                88 if first else 65,
                "shard_optimizer_state",
                (
                    "the first optimizer step allocates the optimizer's state (Adam: "
                    "8 bytes per fp32 parameter, ~12 with master weights)"
                    if first
                    else f"parameters, gradients and optimizer state take {_fmt(state)}"
                )
                + ": shard them (FSDP / ZeRO), use an 8-bit optimizer (e.g. "
                "bitsandbytes AdamW8bit) or offload optimizer state to the CPU.",
            )
        )
    if phase == "data":
        scored.append(
            (
                85,
                "smaller_batch_in_loader",
                "the loader ran out of memory building a batch: lower its batch size, or "
                "move device-side transforms out of collate_fn / the dataset.",
            )
        )
    if guard.step > 0 and phase in ("backward", "optimizer"):
        scored.append(
            (
                45,
                "memory_held_across_steps",
                f"{guard.step} earlier steps fit and this one did not: look for memory "
                "held across steps (kept losses or outputs, retain_graph=True) and for "
                "fragmentation.",
            )
        )
    scored.sort(key=lambda s: -s[0])
    return [(key, text) for _, key, text in scored]


# ---------------------------------------------------------------------- data starvation


def _loader_settings(loader: Any) -> dict[str, Any] | None:
    if not isinstance(loader, torch.utils.data.DataLoader):
        return None
    return {
        "num_workers": loader.num_workers,
        "prefetch_factor": loader.prefetch_factor,
        "pin_memory": loader.pin_memory,
        "persistent_workers": loader.persistent_workers,
    }


def _starvation_remedies(settings: dict[str, Any] | None) -> list[str]:
    cores = os.cpu_count() or 1
    if settings is None:
        return [
            "load in worker processes: torch.utils.data.DataLoader(dataset, "
            f"num_workers=4..8, this machine has {cores} cores) instead of in the loop",
            "prefetch: prefetch_factor=4 with workers",
            "pin_memory=True and .to(device, non_blocking=True)",
            "persistent_workers=True so workers survive between epochs",
            "pack sequences to cut padding; pre-tokenize and store shards",
        ]
    out = []
    workers = settings["num_workers"]
    if workers == 0:
        out.append(
            f"num_workers=0 loads every batch in the training process: set num_workers to "
            f"4-8 (this machine has {cores} cores)"
        )
    else:
        out.append(f"more workers than num_workers={workers} (this machine has {cores} cores)")
        if not settings["persistent_workers"]:
            out.append("persistent_workers=True so workers are not restarted every epoch")
        out.append(f"a deeper prefetch than prefetch_factor={settings['prefetch_factor']}")
    if not settings["pin_memory"]:
        out.append("pin_memory=True with .to(device, non_blocking=True)")
    out.append("pack sequences to cut padding; pre-tokenize and store shards")
    return out
