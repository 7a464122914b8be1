"""How a run ends, told: the grad norm's summary events, the error the user sees, and
the one line that points to the run's report. Plain functions of what the guard
hands them; the guard emits the events and raises the error.
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from guardrails._errors import GuardrailsError
from guardrails.engine.gradnorm import GradNorm

#: The guard's logger: the pointer to the report is the guard's line.
logger = logging.getLogger("guardrails.guard")


def norm_summary(norm: GradNorm, clip_norm_steps: int, steps: int) -> list[tuple[str, Any]]:
    """Close ``norm`` (eager from here on) and return ``(kind, fields)`` of each event
    that says how the run's grad norms were taken: a CUDA graph's counts, the kernel
    over the gradients' addresses, GuardedDDP's buckets, the loop's clip_grad_norm_."""
    from_buckets = norm.from_buckets
    kernel_steps, kernel_failed = norm.kernel_steps, norm.kernel_gave_up
    counts = norm.close()
    events: list[tuple[str, Any]] = []
    if norm.wanted:
        events.append(("grad_norm_graph", counts))
    if kernel_steps or kernel_failed:
        failed = f" (it failed to build, eager instead: {kernel_failed})" if kernel_failed else ""
        events.append(
            (
                "grad_norm_kernel",
                {
                    "message": f"the grad norm of {kernel_steps} of {steps} steps was taken by "
                    f"one kernel over the gradients' addresses{failed}",
                    "steps": kernel_steps,
                    "failed": kernel_failed,
                },
            )
        )
    if from_buckets:
        events.append(
            (
                "grad_norm_shared",
                {
                    "message": f"the grad norm of {from_buckets} of {steps} steps came from "
                    "GuardedDDP's all-reduce buckets (no second pass over the gradients)",
                    "steps": from_buckets,
                    "source": "ddp_buckets",
                },
            )
        )
    if clip_norm_steps:
        events.append(
            (
                "grad_norm_shared",
                {
                    "message": f"the grad norm of {clip_norm_steps} of {steps} steps was the "
                    "one the loop's clip_grad_norm_ computed (no second pass over the "
                    "gradients)",
                    "steps": clip_norm_steps,
                    "source": "clip_grad_norm_",
                },
            )
        )
    return events


def final_error(
    exc: BaseException | None, replacement: BaseException | None, errors: list[BaseException]
) -> BaseException | None:
    """The error the user will see: the loop's own ``exc``, or the ``replacement`` a
    component explained it with, or a component's failure while closing (``errors``)."""
    if exc is not None:
        return replacement or exc
    if errors:
        # Ours first: a component's diagnosis (a watchdog verdict) explains the
        # plain error another component hit while closing (a peer gone mid-agree).
        return next((e for e in errors if isinstance(e, GuardrailsError)), errors[0])
    return None


def point_to_report(run_dir: Path) -> None:
    """One line (rank 0's) at a clean end or a signal stop: the command that tells the
    run's story. Not after an error: its own report follows on stderr, and a line
    before it would only push it up. Logged at INFO where the user's logging shows
    that, else printed when stderr is a terminal outside CI (the progress bar's rule):
    a script under a test runner or a benchmark loop stays quiet."""
    line = f"guardrails: this run's report: guardrails report {shlex.quote(str(run_dir))}"
    if logger.isEnabledFor(logging.INFO) and logger.hasHandlers():
        logger.info(line)
    elif sys.stderr is not None and sys.stderr.isatty() and not os.environ.get("CI"):
        print(line, file=sys.stderr, flush=True)
