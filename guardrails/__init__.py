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

Everything public lives in this one namespace; the ``_``-prefixed modules are private.
Names are imported on first use, so ``import guardrails`` alone does not import torch
and ``python -m guardrails report`` / ``inspect`` / ``--help`` start without it.

Logging: the library installs no handler. Each part logs to its own child of the
``guardrails`` logger, so one part can be quieted or raised without the others
(``logging.getLogger("guardrails.watchdog").setLevel(logging.ERROR)``); a part's events
(``run_dir/events.jsonl``) are logged to its logger too, and stay in the file whatever
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
    ``guardrails.preflight``    Preflight: checks before the first step
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
#: the CLI's report, inspect and --help need no torch, whose import was most of their
#: start (--help: 3.6-3.8 s median before, 0.08 s after; benchmarks/RESULTS.md).
_EXPORTS = {
    "CheckpointError": "_errors",
    "CollectiveAuditor": "_audit",
    "CollectiveMismatchError": "_errors",
    "Component": "_component",
    "ConfigMismatchError": "_errors",
    "ErrorExplainer": "_explain",
    "GCScheduler": "_gc",
    "Guard": "_guard",
    "GuardedDDP": "_ddp",
    "GuardrailsError": "_errors",
    "HangError": "_errors",
    "LaunchError": "_errors",
    "MLflowSink": "_sinks",
    "MemoryGuard": "_memory",
    "NanGuard": "_nan",
    "NonFiniteError": "_errors",
    "OutOfMemoryError": "_errors",
    "Preflight": "_preflight",
    "RankFailedError": "_errors",
    "ResumeError": "_errors",
    "SignalCheckpointer": "_checkpointer",
    "Sink": "_sinks",
    "Telemetry": "_telemetry",
    "TensorBoardSink": "_sinks",
    "UnevenDataError": "_errors",
    "WandbSink": "_sinks",
    "Watchdog": "_watchdog",
    "explain": "_explain",
    "guard": "_factory",
    "iter_metrics": "_metrics_file",
    "read_metrics": "_metrics_file",
    "record": "_record",
    "resume": "_checkpoint",
    "save_checkpoint": "_checkpoint",
}

#: The public names: _EXPORTS and __version__ (tests/test_api.py checks they agree).
__all__ = [
    "CheckpointError",
    "CollectiveAuditor",
    "CollectiveMismatchError",
    "Component",
    "ConfigMismatchError",
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
    "Preflight",
    "RankFailedError",
    "ResumeError",
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
    if name.startswith("_") and not name.startswith("__"):
        # A private module read as an attribute (``guardrails._checkpoint.x``): the
        # eager imports made that work; keep it working.
        try:
            return importlib.import_module(f"guardrails.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"guardrails.{name}":  # the module exists; its import failed
                raise
    raise AttributeError(f"module 'guardrails' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


if TYPE_CHECKING:  # what type checkers and IDEs see; tests/test_api.py keeps it = _EXPORTS
    from guardrails._audit import CollectiveAuditor
    from guardrails._checkpoint import resume, save_checkpoint
    from guardrails._checkpointer import SignalCheckpointer
    from guardrails._component import Component
    from guardrails._ddp import GuardedDDP
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
    from guardrails._explain import ErrorExplainer, explain
    from guardrails._factory import guard
    from guardrails._gc import GCScheduler
    from guardrails._guard import Guard
    from guardrails._memory import MemoryGuard
    from guardrails._metrics_file import iter_metrics, read_metrics
    from guardrails._nan import NanGuard
    from guardrails._preflight import Preflight
    from guardrails._record import record
    from guardrails._sinks import MLflowSink, Sink, TensorBoardSink, WandbSink
    from guardrails._telemetry import Telemetry
    from guardrails._watchdog import Watchdog
