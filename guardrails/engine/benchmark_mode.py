"""In-loop benchmark mode, ``guard(..., benchmark=True)``: what the guard costs in *your*
loop, on your model, data and machine.

How: after ``WARMUP_STEPS``, in every block of ``BLOCK_STEPS`` optimizer steps, three
steps are sampled (5% of steps run differently, 10% are timed):

* offset 5, **guarded**: the step as usual (the control);
* offset 10, **bypassed**: no component's per-step hook runs (``on_batch``,
  ``before_step``, ``after_step``; the engine's own bookkeeping still runs);
* offset 15, **one component bypassed**, in rotation: that component's cost.

A sampled step's time runs from the end of the step before it to its own end,
measured with CUDA events on a GPU (device timeline: what the guard's host work costs
shows up only where it makes the GPU wait, which is the cost that matters), with
``time.perf_counter`` on a CPU. Events are only read at close (one synchronize then).

Training is unchanged: bypassing skips checks and records, not math. What a bypassed
step does not get: NanGuard's check (a NaN on that step is not skipped), a telemetry
row, a GC collection or leak check scheduled on it. Components that decide control flow
(``essential = True``: the SignalCheckpointer, whose saves and stop agreements must
happen on their steps) are never bypassed.

At close the table goes to ``run_dir/benchmark.json``, a ``benchmark`` event and the log:
median step time guarded vs bypassed, the overhead with a 95% bootstrap interval of
the difference of medians, each component's cost, and a plain statement when the
interval includes zero (below what this run can resolve: run longer). Host syncs are
not counted in-loop (``tests/loops/test_gpu.py`` proves none under
``torch.cuda.set_sync_debug_mode("error")``).
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from guardrails.util import files, storage

if TYPE_CHECKING:
    from guardrails.engine.guard import Guard

logger = logging.getLogger("guardrails.benchmark")

#: Steps before sampling starts (compilation, allocator warm-up, GC freeze).
WARMUP_STEPS = 20
#: One block: one guarded, one bypassed and one single-component-bypassed sample.
BLOCK_STEPS = 20
_PER_STEP = ("on_batch", "before_step", "after_step")
_CONTROL, _NONE = 5, 10
_COMPONENT = 15


class StepBenchmark:
    """The engine's benchmark mode (see the module docstring). One per guard."""

    def __init__(self, guard: Guard, full: dict[str, list[Any]]) -> None:
        """``full``: the engine's hook table, every component's per-step hooks."""
        self._cuda = guard.device.type == "cuda"
        self.tables: dict[str, dict[str, list[Any]]] = {"guarded": full}
        essential = [c for c in guard.components if c.essential]
        self.tables["bypassed"] = _without(
            full, [c for c in guard.components if c not in essential]
        )
        self.optional = [
            c
            for c in guard.components
            if c not in essential and any(_hooks(c, h, full) for h in _PER_STEP)
        ]
        for c in self.optional:
            self.tables[f"only {c.name} bypassed"] = _without(full, [c])
        self._marks: dict[int, Any] = {}  # step -> end marker (event or float)
        self._modes: dict[int, str] = {}  # sampled step -> mode
        self._n = 0

    def mode_for(self, step: int) -> str | None:
        """The mode of optimizer step ``step`` (1-based), or ``None``: not sampled."""
        if step <= WARMUP_STEPS:
            return None
        block, offset = divmod(step - WARMUP_STEPS, BLOCK_STEPS)
        if offset == _CONTROL:
            return "guarded"
        if offset == _NONE:
            return "bypassed"
        if offset == _COMPONENT and self.optional:
            return f"only {self.optional[block % len(self.optional)].name} bypassed"
        return None

    def after_step(self, guard: Guard) -> dict[str, list[Any]]:
        """End of step ``guard.step``: mark its end if it or the next one is sampled;
        returns the hook table the engine runs the next step with."""
        step = guard.step
        nxt = self.mode_for(step + 1)
        if step in self._modes or nxt is not None:
            if self._cuda:
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                self._marks[step] = ev
            else:
                self._marks[step] = time.perf_counter()
        if nxt is not None:
            self._modes[step + 1] = nxt
        return self.tables[nxt] if nxt is not None else self.tables["guarded"]

    def finish(self, guard: Guard) -> dict[str, Any] | None:
        if self._cuda:
            torch.cuda.synchronize()  # once, at close: the events are read now
        samples: dict[str, list[float]] = {m: [] for m in self.tables}
        for step, mode in self._modes.items():
            a, b = self._marks.get(step - 1), self._marks.get(step)
            if a is None or b is None:
                continue
            ms = a.elapsed_time(b) if self._cuda else (b - a) * 1e3
            samples[mode].append(ms)
        if not samples["guarded"] or not samples["bypassed"]:
            guard.event(
                "benchmark",
                level="warning",
                message=f"benchmark mode needs more steps: sampling starts after step "
                f"{WARMUP_STEPS} and takes one guarded and one bypassed step per "
                f"{BLOCK_STEPS}; this run had {guard.step}.",
            )
            return None
        table = _table(samples, self._cuda)
        path = guard.run_dir / (
            "benchmark.json" if guard.rank == 0 else f"benchmark-rank{guard.rank}.json"
        )
        try:
            files.write_text(path, json.dumps(table, indent=1))
            saved = str(path)
        except OSError as e:  # the table is in the event and the log all the same
            saved = None
            logger.warning(
                "guardrails: %s could not be written (%s): %s",
                path,
                storage.cause_of(e, path) or e,
                storage.fix_for(e, path.parent),
            )
        guard.event(
            "benchmark",
            level="warning",
            message=render(table),
            path=saved,
            **{k: table[k] for k in ("overhead_ms", "overhead_pct")},
        )
        return table


def _hooks(component: Any, hook: str, table: dict[str, list[Any]]) -> bool:
    return any(getattr(fn, "__self__", None) is component for fn in table.get(hook, []))


def _without(full: dict[str, list[Any]], gone: list[Any]) -> dict[str, list[Any]]:
    out = dict(full)
    for hook in _PER_STEP:
        out[hook] = [fn for fn in full[hook] if getattr(fn, "__self__", None) not in gone]
    return out


def _median_diff_ci(a: list[float], b: list[float], n: int = 2000) -> tuple[float, float]:
    """95% bootstrap interval of median(a) - median(b)."""
    rng = np.random.default_rng(0)
    xa, xb = np.asarray(a), np.asarray(b)
    da = np.median(rng.choice(xa, (n, len(xa))), axis=1)
    db = np.median(rng.choice(xb, (n, len(xb))), axis=1)
    lo, hi = np.percentile(da - db, [2.5, 97.5])
    return float(lo), float(hi)


def _table(samples: dict[str, list[float]], cuda: bool) -> dict[str, Any]:
    guarded, bypassed = samples["guarded"], samples["bypassed"]
    g_med, b_med = float(np.median(guarded)), float(np.median(bypassed))
    lo, hi = _median_diff_ci(guarded, bypassed)
    components = {}
    for mode, xs in samples.items():
        if mode.startswith("only ") and xs:
            name = mode.removeprefix("only ").removesuffix(" bypassed")
            c_lo, c_hi = _median_diff_ci(guarded, xs)
            components[name] = {
                "cost_ms": g_med - float(np.median(xs)),
                "ci_ms": [c_lo, c_hi],
                "samples": len(xs),
            }
    return {
        "timing": "cuda events" if cuda else "perf_counter",
        "guarded_ms": g_med,
        "bypassed_ms": b_med,
        "overhead_ms": g_med - b_med,
        "overhead_pct": 100 * (g_med - b_med) / b_med,
        "overhead_ci_ms": [lo, hi],
        "resolved": not (lo <= 0 <= hi),
        "samples": {"guarded": len(guarded), "bypassed": len(bypassed)},
        "components": components,
        "host_syncs": "not counted in-loop: tests/loops/test_gpu.py proves none under "
        "torch.cuda.set_sync_debug_mode('error')",
    }


def render(t: dict[str, Any]) -> str:
    lines = [
        f"guard overhead in this loop ({t['timing']}): step {t['guarded_ms']:.3f} ms guarded vs "
        f"{t['bypassed_ms']:.3f} ms bypassed = {t['overhead_ms'] * 1e3:+.0f} us "
        f"({t['overhead_pct']:+.2f}%), 95% interval [{t['overhead_ci_ms'][0] * 1e3:+.0f}, "
        f"{t['overhead_ci_ms'][1] * 1e3:+.0f}] us over {t['samples']['guarded']} + "
        f"{t['samples']['bypassed']} sampled steps"
        + (
            ""
            if t["resolved"]
            else "; the interval includes zero: below this run's resolution, run longer"
        ),
    ]
    for name, c in sorted(t["components"].items()):
        lines.append(
            f"  {name}: {c['cost_ms'] * 1e3:+.0f} us, 95% [{c['ci_ms'][0] * 1e3:+.0f}, "
            f"{c['ci_ms'][1] * 1e3:+.0f}] ({c['samples']} samples)"
        )
    return "\n".join(lines)
