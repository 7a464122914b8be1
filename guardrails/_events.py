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
from typing import Any

logger = logging.getLogger("guardrails")

EVENTS_FILE = "events.jsonl"


class EventLog:
    """Appends events to ``run_dir/events.jsonl`` and mirrors them to the
    ``guardrails`` logger (INFO, or WARNING for ``level="warning"``)."""

    def __init__(self, run_dir: Path, *, rank: int) -> None:
        self.path = run_dir / EVENTS_FILE
        self.rank = rank
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def emit(
        self, kind: str, *, step: int, level: str = "info", message: str = "", **fields: Any
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
        log = {"warning": logger.warning, "error": logger.error}.get(level, logger.info)
        log("[rank %d step %d] %s%s", self.rank, step, kind, f": {message}" if message else "")
        return record

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


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
