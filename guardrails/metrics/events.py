"""The events log: one JSON object per line, one file per node:
``run_dir/events.<host>.jsonl``.

Events are rare (start, end, warnings, skips, saves), so each is written at once with
a single ``os.write`` on an ``O_APPEND`` descriptor: a crash loses nothing already
logged, and lines from the ranks of one node sharing their file do not interleave
(appends of one small buffer are atomic on a local filesystem, and one NFS client
serialises its own appends). Appends from *different* hosts to one file on NFS are not
atomic: lines interleaved or were lost at scale (issue 52), so each node has its file,
and every reader merges them ordered by time (:func:`read_events`, :func:`tail_events`).
A run_dir from before keeps one ``events.jsonl``: read the same way. The file is opened
without following a link (``O_NOFOLLOW``). Read them all with :func:`read_events`, or
one with ``pandas.read_json(path, lines=True)``.

A file that cannot be written (a full disk, a read-only remount: any ``OSError``) does
not end the run: the events are kept in memory (at most :data:`MAX_PENDING`, the oldest
dropped beyond it and counted), the trouble is logged once (:mod:`guardrails.util.storage`)
and the next event retries, writing the kept ones first, in order. A full disk stopped
the guard from starting before this: the ``start`` event could not be written.
"""

from __future__ import annotations

import contextlib
import heapq
import json
import logging
import math
import os
import re
import socket
import stat
import sys
import threading
import time
from collections import deque
from pathlib import Path
from types import FrameType
from typing import Any

from guardrails.util import files
from guardrails.util.storage import Trouble

logger = logging.getLogger("guardrails.guard")

#: The one events file of a run_dir written before issue 52 (every node appended to
#: it); still read, never written.
EVENTS_FILE = "events.jsonl"
#: Every events file of a run_dir: the nodes' and the old shared one.
EVENTS_GLOB = "events*.jsonl"
#: Events kept in memory while events.jsonl cannot be written (362 bytes a line on
#: average in a test run's file, so ~4 MB at most); beyond it the oldest are dropped,
#: and counted.
MAX_PENDING = 10_000


class EventLog:
    """Appends events to this node's ``run_dir/events.<host>.jsonl`` and mirrors them
    to a logger: the emitting part's (``guardrails.nan``, ``guardrails.watchdog``...: see
    :func:`logger_of`), else ``guardrails.guard``; INFO, or WARNING for
    ``level="warning"``."""

    def __init__(self, run_dir: Path, *, rank: int) -> None:
        self.path = events_path(run_dir)
        self.rank = rank
        self._fd: int | None = None
        self._closed = False
        # Lines not written yet (the disk refused them), oldest first; the lock keeps
        # their order between threads (the checkpoint writer, the watchdog emit too).
        self._pending: deque[bytes] = deque()
        self.dropped = 0
        self._step = 0  # the last event's, for the record of a gap
        self._deleted_said = False  # the file was deleted under the run: said once
        self._lock = threading.Lock()
        self._trouble = Trouble(str(self.path), run_dir, logger)
        try:
            self._fd = self._open()
        except OSError as e:
            self._trouble.failed(e, "events are kept in memory")

    def emit(
        self,
        kind: str,
        *,
        step: int,
        level: str = "info",
        message: str = "",
        log: logging.Logger | None = None,
        ends_run: bool = False,
        **fields: Any,
    ) -> dict[str, Any]:
        """Write the event and mirror it to ``log``. ``ends_run``: ``message`` is the
        error now ending the run, which this rank prints whole once (``@record``'s
        summary, or Python's traceback; under torchrun its one-line root cause too):
        the file keeps the message, the log gets its head line, and only where the
        script configured logging. With none, Python's fallback would print the
        headline on stderr a second time per rank."""
        record: dict[str, Any] = {
            "time": time.time(),
            "rank": self.rank,
            "step": step,
            "kind": kind,
            "level": level,
            "message": message,
            **fields,
        }
        self._step = step
        if not self._closed:
            line = json.dumps(json_safe(record), default=str, separators=(",", ":")) + "\n"
            with self._lock:
                self._append(line.encode())
        to = log or logger
        if ends_run:
            if not to.hasHandlers():
                return record
            message = message.splitlines()[0] if message else message
        say = {"warning": to.warning, "error": to.error}.get(level, to.info)
        say("[rank %d step %d] %s%s", self.rank, step, kind, f": {message}" if message else "")
        return record

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._pending:
                logger.warning(
                    "guardrails: %d event(s) never reached %s (it could not be written to "
                    "the end of the run)%s",
                    len(self._pending),
                    self.path,
                    f"; {self.dropped} more were dropped before" if self.dropped else "",
                )
                self._pending.clear()
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def _open(self) -> int:
        files.make_dirs(self.path.parent)  # (once it could not be made, or was deleted)
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
        return os.open(self.path, flags, 0o644)

    def _append(self, line: bytes) -> None:
        """Write ``line`` after the lines kept from failed writes; on an ``OSError``
        keep it too (bounded), say so (rate-limited) and retry at the next event."""
        pending = self._pending
        pending.append(line)
        if len(pending) > MAX_PENDING:
            pending.popleft()
            self.dropped += 1
        data = b"".join(pending) if len(pending) > 1 else line
        total = len(data)
        try:
            if self._fd is None:
                self._fd = self._open()
            while data:  # one write normally; a nearly full disk may take part of it
                data = data[os.write(self._fd, data) :]
        except OSError as e:
            if len(data) < total:  # part of it went out: the rest, in order, as one piece
                pending.clear()
                pending.append(data)
            dropped = f", {self.dropped} older ones dropped" if self.dropped else ""
            self._trouble.failed(e, f"{len(pending)} event(s) kept in memory{dropped}")
            return
        pending.clear()
        if not self._deleted_said and os.fstat(self._fd).st_nlink == 0:
            self._deleted()
        if self._trouble.failing:
            dropped, self.dropped = self.dropped, 0
            self._trouble.recovered(
                f"{dropped} event(s) were dropped (over {MAX_PENDING} kept)" if dropped else ""
            )
            if dropped:  # the gap, said in the file itself for whoever reads it later
                gap = {"time": time.time(), "rank": self.rank, "step": self._step}
                gap.update(kind="events_dropped", level="warning", dropped=dropped)
                gap["message"] = f"{dropped} events were lost: {self.path} could not be written"
                with contextlib.suppress(OSError):
                    os.write(self._fd, (json.dumps(gap) + "\n").encode())

    def _deleted(self) -> None:
        """The file was deleted under the run (its run_dir, or a parent, removed while it
        trains): said once, in the log and in a new file where the run_dir was (made
        again), so that the events from here on are kept. The run's lock went with the
        directory: nothing keeps a second run out any more."""
        self._deleted_said = True
        message = (
            f"{self.path} was deleted while the run trains (its run_dir or a directory "
            "above it was removed): the events before are lost, and the run.lock that "
            "kept other runs out of this run_dir is gone with it. The run goes on; "
            "events from here on go to a new file there"
        )
        logger.warning("guardrails: %s", message)
        fd, self._fd = self._fd, None
        with contextlib.suppress(OSError):
            if fd is not None:
                os.close(fd)
            self._fd = self._open()
            gap = {"time": time.time(), "rank": self.rank, "step": self._step}
            gap.update(kind="run_dir_deleted", level="warning", message=message)
            os.write(self._fd, (json.dumps(gap) + "\n").encode())


def events_path(run_dir: Path, host: str | None = None) -> Path:
    """This node's events file (``host``'s): ``run_dir/events.<host>.jsonl``, the host
    name kept to letters, digits, ``.``, ``_`` and ``-``."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", host or socket.gethostname())[:200] or "host"
    return run_dir / f"events.{name}.jsonl"


def event_files(run_dir: Path) -> list[Path]:
    """Every events file of ``run_dir`` (the nodes', the old shared one), regular files
    only: a link is never followed, a FIFO never opened."""
    found = []
    for path in sorted(run_dir.glob(EVENTS_GLOB)):
        with contextlib.suppress(OSError):
            if stat.S_ISREG(os.lstat(path).st_mode):
                found.append(path)
    return found


def read_events(run_dir: Path, *, tail_bytes: int | None = None) -> list[dict[str, Any]]:
    """Every event of ``run_dir``, the nodes' files merged ordered by time (each file's
    own order kept). ``tail_bytes``: only each file's last bytes (its first, cut line
    dropped). A line that is not a JSON object (a torn write) is skipped, with a log
    line when whole files are read."""
    per_file = [_parse(path, tail_bytes) for path in event_files(run_dir)]
    return list(heapq.merge(*per_file, key=_time_of))


def _parse(path: Path, tail_bytes: int | None) -> list[dict[str, Any]]:
    try:
        with open(path, "rb") as f:
            if tail_bytes is not None:
                f.seek(max(0, os.fstat(f.fileno()).st_size - tail_bytes))
            lines = f.read().splitlines()
    except OSError as err:
        logger.warning("guardrails: %s could not be read (%s); its events are left out", path, err)
        return []
    events = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except ValueError:  # a torn line; with tail_bytes, the cut first one
            if tail_bytes is None:
                logger.warning("guardrails: %s line %d is not JSON; skipped", path, n)
            continue
        if isinstance(event, dict):
            events.append(event)
    return events


def _time_of(event: dict[str, Any]) -> float:
    t = event.get("time")
    return float(t) if isinstance(t, (int, float)) and math.isfinite(t) else 0.0


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
