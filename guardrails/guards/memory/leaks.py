"""Leak detection: memory that grows every step, named with what holds it and the fix.

The classic is ``losses.append(loss)``: each kept loss keeps its autograd graph, memory
grows every step, and the out-of-memory error comes hours later, far from its cause.
Every ``leak_check_every_n_steps`` steps :class:`LeakDetector` reads two counters, both
host reads with no device sync: Python heap blocks (``sys.getallocatedblocks()``, one
per small object; 30 us, 120 us with 3M objects live, measured on CPU) and device
memory (``torch.cuda.memory_allocated``, the allocator's host-side counter; RSS from
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
"""

from __future__ import annotations

import gc
import logging
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

from guardrails.engine.where import PACKAGE_DIR, TORCH_DIR, frame_locals
from guardrails.guards.memory.stats import fmt_bytes, memory_bytes, storages

if TYPE_CHECKING:
    from guardrails.engine.guard import Guard

logger = logging.getLogger("guardrails.memory")

#: Growth below these rates is not reported unless it is tensors holding graphs: a
#: list of one float or one dict of metrics per step (1-5 heap blocks) is history, not a
#: leak, and telemetry's host rows alone add ~8 blocks a step between flushes (measured).
#: 100 objects a step is 10M objects (~1 GB, and a slower GC) over 100k steps; 64 KiB a
#: step is 6.4 GB over 100k steps.
MIN_OBJECTS_PER_STEP = 100
MIN_BYTES_PER_STEP = 64 * 1024

#: Frames in these directories are ours or torch's: not where a user's variable lives.
_PROJECT_DIRS = (PACKAGE_DIR, TORCH_DIR)


class LeakDetector:
    """The leak check of one guarded run: the counter samples, the pending census, the
    window (doubled after each census pair that found nothing worth reporting).
    ``censuses`` gets ``(step, seconds)`` for every census taken."""

    def __init__(
        self, device: torch.device, window_checks: int, censuses: list[tuple[int, float]]
    ) -> None:
        self._device = device
        self._cuda = device.type == "cuda"
        # (step, heap blocks, memory bytes, collections so far)
        self._samples: list[tuple[int, int, int, int]] = []
        self._need = window_checks  # growing checks before a census
        self._census: _Census | None = None
        self.censuses = censuses

    def close(self) -> None:
        """Drop a pending census (it holds weak references to every tensor it saw)."""
        self._census = None

    def check(self, guard: Guard, step: int) -> dict[str, Any] | None:
        """One check: sample the counters; census when they grew through the window;
        decide on the second census. Returns the ``leak`` event's fields once a leak
        is reported (the event is written here), else None."""
        samples = self._samples
        samples.append(
            (
                step,
                sys.getallocatedblocks(),
                memory_bytes(self._device),
                sum(g["collections"] for g in gc.get_stats()),  # ~1 us
            )
        )
        if self._census is not None:
            # Growth suspected at the previous check: the second census decides.
            return self._confirm(guard, step)
        # Bounded: a window's worth of checks, with room for inconclusive intervals.
        del samples[: -(4 * self._need + 1)]
        if growing(samples, 1, self._need) or growing(samples, 2, self._need):
            self._census = self._take_census(step, None)[0]
        return None

    def _take_census(self, step: int, before: _Census | None) -> tuple[_Census, list[Tensor]]:
        census, fresh = take_census(step, before)
        self.censuses.append((step, census.seconds))
        return census, fresh

    def _confirm(self, guard: Guard, step: int) -> dict[str, Any] | None:
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
                return None
            grown = after.types - before.types
            # Census A itself is alive: its object, histogram, dict of weak references.
            grown.subtract({_Census: 1, Counter: 1, dict: 1, weakref.ref: before.tensors})
            grew = [[type_name(t), k] for t, k in grown.most_common(5) if k > 0]
            fields: dict[str, Any] = {
                "cause": cause,
                "window_steps": [first_step, step],
                "objects_per_step": objects_per_step,
                "memory_bytes_per_step": bytes_per_step,
                "memory_kind": "cuda_allocated" if self._cuda else "rss",
                "tensors_per_step": tensor_growth / n,
                "tensor_bytes_per_step": tensor_bytes_per_step,
                "graph_tensors_per_step": graph_growth / n,
                "growing_types": grew,
                "tensor": None,
                "held_by": None,
                "census_s": before.seconds + after.seconds,
            }
            if candidates:
                fields["held_by"], sample = holder(candidates, (fresh, new_graphs))
                fields["tensor"] = describe(sample)
        finally:
            del fresh, sample
        self._samples = []
        message, hint = leak_message(fields)
        # How a run whose growth is meant (a cache filling to its bound) tells it apart,
        # and the knob, so a healthy run's user is not left to turn the whole guard off.
        meant = (
            " Growth that stops by itself (a cache filling up to its bound) is not a "
            "leak: watch mem_peak_bytes in metrics.parquet level off, or turn the "
            "check off with guard(..., memory={'leak_check_every_n_steps': None})."
        )
        guard.event(
            "leak", level="warning", message=f"{message} Fix: {hint}{meant}", fix=hint, **fields
        )
        return fields


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


def take_census(step: int, before: _Census | None) -> tuple[_Census, list[Tensor]]:
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
        tensor_bytes=sum(storages(tensors).values()),
        graph_tensors=sum(1 for t in tensors if t.requires_grad and not t.is_leaf),
        tensor_refs={id(t): weakref.ref(t) for t in tensors},
        seconds=0.0,
    )
    del tensors
    census.seconds = time.perf_counter() - t0
    return census, fresh


def growing(samples: list[tuple[int, int, int, int]], i: int, need: int) -> bool:
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


def leak_message(f: dict[str, Any]) -> tuple[str, str]:
    steps = f"steps {f['window_steps'][0]}-{f['window_steps'][1]}"
    mem = (
        f"device memory grew {fmt_bytes(f['memory_bytes_per_step'])} per step"
        if f["memory_kind"] == "cuda_allocated"
        else f"RSS grew {fmt_bytes(f['memory_bytes_per_step'])} per step"
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


def describe(t: Tensor) -> str:
    fn = t.grad_fn
    graph = f", grad_fn={type(fn).__name__}" if fn is not None else ""
    shape = "0-d" if t.ndim == 0 else "x".join(map(str, t.shape))
    return f"a {shape} {str(t.dtype).removeprefix('torch.')} {t.device} tensor{graph}"


def holder(new: list[Tensor], exclude: tuple[list[Any], ...]) -> tuple[str | None, Tensor]:
    """What keeps the new tensors alive: the container holding the most of them, named
    when it is a local variable (or an attribute of one) of a frame on the stack, else
    as the GC's referrer. Returns (that description or None, one tensor it holds).

    The most, not the first: the step's own tensors (this loss, this batch) are new
    too, held by plain variables or for one step; a leak holds one per step. Frame
    locals first: the loop's variables are GC roots (no referrer lists them), and a
    container made before the GCScheduler's freeze is frozen, which
    ``gc.get_referrers`` does not search (read through ``where.frame_locals``, which
    leaves no snapshot of them on the frame).
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
            for name, value in frame_locals(frame).items():
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


def type_name(t: type) -> str:
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"
