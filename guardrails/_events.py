"""The events log: one JSON object per line in ``run_dir/events.jsonl``.

Events are rare (start, end, warnings, skips, saves), so each is written at once with
a single ``os.write`` on an ``O_APPEND`` descriptor: a crash loses nothing already
logged, and lines from several ranks sharing the file do not interleave (appends of
one small buffer are atomic on local filesystems; on NFS, give each run its own dir).
Read it with ``pandas.read_json(path, lines=True)`` or ``pyarrow.json.read_json``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

logger = logging.getLogger("guardrails.guard")

EVENTS_FILE = "events.jsonl"


class EventLog:
    """Appends events to ``run_dir/events.jsonl`` and mirrors them to a logger: the
    emitting part's (``guardrails.nan``, ``guardrails.watchdog``...: see
    :func:`logger_of`), else ``guardrails.guard``; INFO, or WARNING for
    ``level="warning"``."""

    def __init__(self, run_dir: Path, *, rank: int) -> None:
        self.path = run_dir / EVENTS_FILE
        self.rank = rank
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def emit(
        self,
        kind: str,
        *,
        step: int,
        level: str = "info",
        message: str = "",
        log: logging.Logger | None = None,
        **fields: Any,
    ) -> dict[str, Any]:
        record: dict[str, Any] = {
            "time": time.time(),
            "rank": self.rank,
            "step": step,
            "kind": kind,
            "level": level,
            "message": message,
            **fields,
        }
        if self._fd is not None:
            line = json.dumps(json_safe(record), default=str, separators=(",", ":")) + "\n"
            os.write(self._fd, line.encode())
        to = log or logger
        say = {"warning": to.warning, "error": to.error}.get(level, to.info)
        say("[rank %d step %d] %s%s", self.rank, step, kind, f": {message}" if message else "")
        return record

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def logger_of(frame: FrameType | None) -> logging.Logger | None:
    """The logger of the guardrails module running ``frame`` (its module-level
    ``logger`` or ``log``, a ``guardrails.<part>`` logger), or ``None``. How an event
    reaches the logger of the part that emitted it, so a user can quiet that part alone,
    without every call site naming its logger. Events are rare (not per step): the
    lookup is two dict reads."""
    if frame is None:
        return None
    for name in ("logger", "log"):
        found = frame.f_globals.get(name)
        if isinstance(found, logging.Logger) and found.name.startswith("guardrails."):
            return found
    return None


def json_safe(obj: Any) -> Any:
    """``obj`` with non-finite floats as the strings "nan", "inf", "-inf": strict JSON
    (jq, JavaScript, most parsers) has no NaN or Infinity, and a NaN is exactly what
    guardrails events report."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def to_console(text: str, *, log: logging.Logger = logger) -> None:
    """Show ``text`` on stderr when ``log``'s INFO records would reach no handler: the
    script configured no logging, and Python then shows only warnings (through its
    last-resort handler). For a notice the user must see without asking (a resume);
    with logging configured, the notice's own log record (its event's) is the one
    line, and the user's handlers and levels decide. Through ``tqdm.write``, so a
    progress bar on the terminal is redrawn below it rather than broken."""
    if log.hasHandlers():
        return
    from tqdm.auto import tqdm

    tqdm.write(text, file=sys.stderr)
