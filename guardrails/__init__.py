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
The library logs to ``logging.getLogger("guardrails")`` and installs no handler.
"""

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
from guardrails._nan import NanGuard
from guardrails._preflight import Preflight
from guardrails._record import record
from guardrails._sinks import MLflowSink, Sink, TensorBoardSink, WandbSink
from guardrails._telemetry import Telemetry, read_metrics
from guardrails._version import __version__
from guardrails._watchdog import Watchdog

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
    "read_metrics",
    "record",
    "resume",
    "save_checkpoint",
]
