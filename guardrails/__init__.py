"""guardrails: guards for PyTorch training loops.

Wrap the loop once and a hang, a desync, a NaN, a SIGTERM or a bad batch becomes a
precise error or a clean checkpoint::

    import guardrails

    with guardrails.guard(model, opt, loader, run_dir="runs/exp1") as g:
        for batch in g:
            loss = model(*batch)
            loss.backward()
            opt.step()
            opt.zero_grad()

Everything public lives in this one namespace; the subpackages (``engine``, ``guards``,
``checkpoint``, ``metrics``, ...) and the ``_``-prefixed modules are private, laid out
as ARCHITECTURE.md draws them.
Names are imported on first use, so ``import guardrails`` alone does not import torch
and ``python -m guardrails report`` / ``inspect`` / ``--help`` start without it.

Logging: the library installs no handler. Each part logs to its own child of the
``guardrails`` logger, so one part can be quieted or raised without the others
(``logging.getLogger("guardrails.watchdog").setLevel(logging.ERROR)``); a part's events
(``run_dir/events.<host>.jsonl``) are logged to its logger too, and stay in the file whatever
the level:

    ==========================  ====================================================
    ``guardrails.guard``        the guard itself: start, end, hooks, grad norm
    ``guardrails.data``         the data position: resume fast-forward, loader state
    ``guardrails.nan``          NanGuard: non-finite steps, spikes, their diagnosis
    ``guardrails.watchdog``     Watchdog: hangs, stuck ranks
    ``guardrails.audit``        CollectiveAuditor: collective mismatches, uneven data
    ``guardrails.checkpoint``   SignalCheckpointer, save / resume: signals, saves
    ``guardrails.telemetry``    Telemetry: ``metrics.parquet``
    ``guardrails.sinks``        metric sinks: TensorBoard, W&B, MLflow, your own
    ``guardrails.gc``           GCScheduler: GC pauses, freezing
    ``guardrails.memory``       MemoryGuard: leaks, data starvation, out of memory
    ``guardrails.pace``         Pace: stragglers, slowdowns, communication-bound steps
    ``guardrails.preflight``    Preflight: checks before the first step
    ``guardrails.rewind``       Rewind: back to a snapshot before a divergence
    ``guardrails.efficiency``   Efficiency: FLOPs per step, host syncs, the fast path
    ``guardrails.launch``       launch checks (``check_launch``, ``@record``)
    ``guardrails.record``       ``@record``: error files, the process's exit
    ``guardrails.ddp``          GuardedDDP
    ``guardrails.benchmark``    benchmark mode (``guard(benchmark=True)``)
    ``guardrails.report``       ``python -m guardrails report``
    ``guardrails.doctor``       ``python -m guardrails doctor``
    ==========================  ====================================================
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from guardrails._version import __version__

#: Each public name -> the private module that defines it, imported on first use:
#: the CLI's report, inspect and --help need no torch, whose import (~2.3 s on a
#: CPU host) would be most of their start (--help starts in 0.08 s median without it).
_EXPORTS = {
    "CheckpointError": "_errors",
    "CollectiveAuditor": "guards.audit.auditor",
    "CollectiveMismatchError": "_errors",
    "Component": "engine.component",
    "ConfigMismatchError": "_errors",
    "Efficiency": "guards.efficiency.efficiency",
    "ErrorExplainer": "guards.explain",
    "GCScheduler": "guards.gc",
    "Guard": "engine.guard",
    "GuardedDDP": "guards.ddp",
    "GuardrailsError": "_errors",
    "HangError": "_errors",
    "LaunchError": "_errors",
    "MLflowSink": "metrics.sinks",
    "MemoryGuard": "guards.memory.guard",
    "NanGuard": "guards.nan.guard",
    "NonFiniteError": "_errors",
    "OutOfMemoryError": "_errors",
    "Pace": "guards.pace.pace",
    "Preflight": "guards.preflight.preflight",
    "RankFailedError": "_errors",
    "ResumeError": "_errors",
    "Rewind": "guards.rewind.rewind",
    "SignalCheckpointer": "guards.checkpointer.checkpointer",
    "Sink": "metrics.sinks",
    "Telemetry": "guards.telemetry",
    "TensorBoardSink": "metrics.sinks",
    "UnevenDataError": "_errors",
    "WandbSink": "metrics.sinks",
    "Watchdog": "guards.watchdog.watchdog",
    "explain": "guards.explain",
    "guard": "_factory",
    "iter_metrics": "metrics.file",
    "read_metrics": "metrics.file",
    "record": "engine.record",
    "resume": "checkpoint.restore",
    "save_checkpoint": "checkpoint.commit",
}

#: The public names: _EXPORTS and __version__ (tests/test_api.py checks they agree).
__all__ = [
    "CheckpointError",
    "CollectiveAuditor",
    "CollectiveMismatchError",
    "Component",
    "ConfigMismatchError",
    "Efficiency",
    "ErrorExplainer",
    "GCScheduler",
    "Guard",
    "GuardedDDP",
    "GuardrailsError",
    "HangError",
    "LaunchError",
    "MLflowSink",
    "MemoryGuard",
    "NanGuard",
    "NonFiniteError",
    "OutOfMemoryError",
    "Pace",
    "Preflight",
    "RankFailedError",
    "ResumeError",
    "Rewind",
    "SignalCheckpointer",
    "Sink",
    "Telemetry",
    "TensorBoardSink",
    "UnevenDataError",
    "WandbSink",
    "Watchdog",
    "__version__",
    "explain",
    "guard",
    "iter_metrics",
    "read_metrics",
    "record",
    "resume",
    "save_checkpoint",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(f"guardrails.{module}"), name)
        globals()[name] = value  # later lookups are plain attribute reads
        return value
    if not name.startswith("__"):
        # A private subpackage read as an attribute (``guardrails.engine.guard``), as
        # ``import guardrails.engine`` would make it one.
        try:
            return importlib.import_module(f"guardrails.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"guardrails.{name}":  # the module exists; its import failed
                raise
    raise AttributeError(f"module 'guardrails' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


if TYPE_CHECKING:  # what type checkers and IDEs see; tests/test_api.py keeps it = _EXPORTS
    from guardrails._errors import (
        CheckpointError,
        CollectiveMismatchError,
        ConfigMismatchError,
        GuardrailsError,
        HangError,
        LaunchError,
        NonFiniteError,
        OutOfMemoryError,
        RankFailedError,
        ResumeError,
        UnevenDataError,
    )
    from guardrails._factory import guard
    from guardrails.checkpoint.commit import save_checkpoint
    from guardrails.checkpoint.restore import resume
    from guardrails.engine.component import Component
    from guardrails.engine.guard import Guard
    from guardrails.engine.record import record
    from guardrails.guards.audit.auditor import CollectiveAuditor
    from guardrails.guards.checkpointer.checkpointer import SignalCheckpointer
    from guardrails.guards.ddp import GuardedDDP
    from guardrails.guards.efficiency.efficiency import Efficiency
    from guardrails.guards.explain import ErrorExplainer, explain
    from guardrails.guards.gc import GCScheduler
    from guardrails.guards.memory.guard import MemoryGuard
    from guardrails.guards.nan.guard import NanGuard
    from guardrails.guards.pace.pace import Pace
    from guardrails.guards.preflight.preflight import Preflight
    from guardrails.guards.rewind.rewind import Rewind
    from guardrails.guards.telemetry import Telemetry
    from guardrails.guards.watchdog.watchdog import Watchdog
    from guardrails.metrics.file import iter_metrics, read_metrics
    from guardrails.metrics.sinks import MLflowSink, Sink, TensorBoardSink, WandbSink
