"""Ending a process that cannot end itself.

A background thread (watchdog, auditor) that finds a fatal problem while the main
thread is stuck in a collective or a C call cannot raise into it: Python delivers
exceptions to the main thread only between bytecodes. So it reports and exits the
process itself, non-zero, and the launcher (torchrun) tears the job down and shows the
report instead of waiting out NCCL's 10 minutes or gloo's 30.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn

log = logging.getLogger("guardrails")


def die(error: BaseException, *, exit_code: int = 1) -> NoReturn:
    """Report ``error`` on stderr and end this process at once with ``exit_code``."""
    message = f"guardrails: {type(error).__name__}: {error}\n"
    try:
        log.error("%s", message.rstrip())
        sys.stderr.write(message)
        sys.stderr.flush()
        sys.stdout.flush()
    finally:
        os._exit(exit_code)
