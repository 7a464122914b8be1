"""Bounded metrics over a month: each rank's parts merged into one file per hour.

Telemetry writes one parquet part per ``write_every_s`` (60 s): 43,200 files per rank
in 30 days (518,400 at ``write_every_s=1``), and every reader lists and opens them all.
Once an hour (``compact_every_s``) is over, this merges the rank's parts of that hour
into one ``compact-r<rank>-t<hour start>-<id>.parquet``: 720 files per rank and month.

A merge, on its own thread (never the training thread's time):

1. reads the hour's parts one at a time and writes them, ``BATCH_ROWS`` rows per row
   group, to a temp file (``.compact-*.parquet.tmp``: no ``*.parquet`` glob matches it)
   whose footer names every part it holds (``guardrails.sources``); fsync;
2. under the exclusive lock that readers take shared (``metrics/file.lock``): renames
   it into place, fsyncs the directory, deletes the parts.

A reader (``metrics/file.snapshot``) skips every part a compacted file names, so a row
is never read twice, and a part it listed is not deleted until it is done reading, so
none is missed. A SIGKILL leaves either the temp file (removed at the rank's next start;
the parts are untouched) or the compacted file and some of its parts (the reader skips
them; the next pass deletes them). An hour is merged once every row of it is on disk:
once this process has written a part whose first row is past the hour's end (rows
reach parts in time order); an earlier process's parts merge with them once this
process has written its first part past their hour.

Each rank merges only its own files, so ranks never coordinate. Failures (a full disk)
are logged once and retried at the next part; training never waits for this.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from guardrails.metrics.file import (
    BATCH_ROWS,
    COMPACT_PREFIX,
    PART_PREFIX,
    SCHEMA,
    SOURCES_KEY,
    conform,
    lock,
    sources,
)
from guardrails.util.files import fsync_path, restrict

logger = logging.getLogger("guardrails.telemetry")

_PART = re.compile(r"part-r(\d+)-s(\d+)-[0-9a-f]+\.parquet$")
#: How long a commit waits for readers to finish before trying again at the next part.
LOCK_WAIT_S = 5.0


@dataclass
class _Part:
    path: Path
    first_time: float  # the part's earliest row time: which window it belongs to
    started_at: float
    first_step: int


class Compactor:
    """Merges rank ``rank``'s parts in ``directory`` into one file per ``every_s``
    seconds (windows aligned on the unix epoch, so on hours by default)."""

    def __init__(self, directory: Path, rank: int, every_s: float) -> None:
        self.directory = directory
        self.rank = rank
        self.every_s = every_s
        self.merged_files = 0  # compacted files written by this object
        self.merged_parts = 0  # parts they replaced
        self._parts: dict[str, _Part] = {}
        self._watermark = -math.inf  # every row of this process before it is on disk
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._warned = False
        self._mutex = threading.Lock()  # _parts: added from the writer, read here

    # ------------------------------------------------------------------ the writer's side

    def scan(self) -> None:
        """Find what an earlier process of this rank left: its temp files (removed), the
        parts compacted files already hold (deleted), the parts still to merge."""
        prefix_part = f"{PART_PREFIX}r{self.rank:05d}-"
        prefix_compact = f"{COMPACT_PREFIX}r{self.rank:05d}-"
        held: set[str] = set()
        parts = []
        for e in os.scandir(self.directory):
            name = e.name
            if name.startswith(f".{prefix_compact}") and name.endswith(".tmp"):
                Path(e.path).unlink(missing_ok=True)  # a merge killed while writing
            elif name.startswith(prefix_compact) and name.endswith(".parquet"):
                held.update(sources(Path(e.path)))
            elif name.startswith(prefix_part) and name.endswith(".parquet"):
                parts.append(Path(e.path))
        for path in parts:
            if path.name in held:  # a merge killed between its rename and its deletes
                path.unlink(missing_ok=True)
                continue
            part = _describe(path)
            if part is not None:
                with self._mutex:
                    self._parts[path.name] = part

    def add(self, path: Path, first_time: float, started_at: float, first_step: int) -> None:
        """A part this process just wrote, whose first row is at ``first_time``: every
        earlier row of this process is on disk."""
        with self._mutex:
            self._parts[path.name] = _Part(path, first_time, started_at, first_step)
            self._watermark = max(self._watermark, first_time)
        self._wake.set()

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._loop, name=f"guardrails-compact-r{self.rank}", daemon=True
        )
        self._thread.start()

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop after the merge under way, if any (a kill in it is safe too)."""
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    # ------------------------------------------------------------------ the merging side

    def _loop(self) -> None:
        try:  # here, not at start: a run_dir from before compaction holds many parts
            self.scan()
        except OSError as err:
            logger.warning(
                "guardrails: could not list %s to merge its parts: %s", self.directory, err
            )
        while not self._stop:
            self._wake.wait()
            self._wake.clear()
            if self._stop:
                return
            try:
                self.run_once()
            except Exception as err:  # a full or read-only disk: training goes on
                if not self._warned:
                    self._warned = True
                    logger.warning(
                        "guardrails: could not merge rank %d's metrics parts in %s (%s: %s); "
                        "they stay as they are (every row is kept) and the merge is retried "
                        "after the next part",
                        self.rank,
                        self.directory,
                        type(err).__name__,
                        err,
                    )

    def run_once(self, upto: float | None = None) -> int:
        """Merge every window over before ``upto`` (default: this process's watermark;
        parts of earlier processes count as complete). Returns the files written."""
        with self._mutex:
            parts = list(self._parts.values())
            mark = self._watermark if upto is None else upto
        windows: dict[int, list[_Part]] = {}
        for p in parts:
            w = math.floor(p.first_time / self.every_s)
            windows.setdefault(w, []).append(p)
        written = 0
        for w in sorted(windows):
            group = windows[w]
            if self._stop:
                break
            if (w + 1) * self.every_s > mark or len(group) < 2:
                continue  # not over yet (rows may still come), or nothing to merge
            if self._merge(w, group):
                written += 1
        return written

    def _merge(self, window: int, group: list[_Part]) -> bool:
        group = sorted(group, key=lambda p: (p.started_at, p.first_step, p.path.name))
        start = int(window * self.every_s)
        name = f"{COMPACT_PREFIX}r{self.rank:05d}-t{start:010d}-{uuid.uuid4().hex[:8]}.parquet"
        tmp = self.directory / f".{name}.tmp"
        final = self.directory / name
        names = [p.path.name for p in group]
        schema = SCHEMA.with_metadata({SOURCES_KEY: json.dumps(names).encode()})
        try:
            with pq.ParquetWriter(tmp, schema) as writer:
                held: list[pa.Table] = []
                rows = 0
                for p in group:  # one part in memory at a time, plus one row group
                    table = conform(pq.read_table(p.path)).replace_schema_metadata(schema.metadata)
                    held.append(table)
                    rows += table.num_rows
                    if rows >= BATCH_ROWS:
                        writer.write_table(pa.concat_tables(held), row_group_size=BATCH_ROWS)
                        held, rows = [], 0
                if held:
                    writer.write_table(pa.concat_tables(held), row_group_size=BATCH_ROWS)
            fsync_path(tmp)
            restrict(tmp)  # pyarrow creates it 0o666 less the umask
            # Readers hold it shared while they read: wait a little, else next time.
            with lock(self.directory, exclusive=True, timeout_s=LOCK_WAIT_S) as got:
                # A part already gone was merged by another process of this rank (two
                # jobs sharing a run_dir): committing would hold its rows twice.
                if not got or not all(p.path.exists() for p in group):
                    tmp.unlink(missing_ok=True)
                    if got:
                        with self._mutex:
                            for n in names:
                                self._parts.pop(n, None)
                    return False
                os.rename(tmp, final)
                fsync_path(self.directory)  # the merged file is durable before its parts go
                for p in group:
                    p.path.unlink(missing_ok=True)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        with self._mutex:
            for n in names:
                self._parts.pop(n, None)
        self.merged_files += 1
        self.merged_parts += len(group)
        logger.debug("guardrails: merged %d metrics parts into %s", len(group), final.name)
        return True


def _describe(path: Path) -> _Part | None:
    """A part's window and order keys, from its footer's statistics (no rows read)."""
    m = _PART.search(path.name)
    try:
        meta = pq.read_metadata(path)
        lo: dict[str, float] = {}
        for rg in range(meta.num_row_groups):
            group = meta.row_group(rg)
            for c in range(group.num_columns):
                col = group.column(c)
                stats = col.statistics
                if col.path_in_schema in ("time", "started_at") and stats and stats.has_min_max:
                    v = float(stats.min)
                    lo[col.path_in_schema] = min(lo.get(col.path_in_schema, v), v)
        if "time" not in lo:  # no statistics: read the two columns
            t = pq.read_table(path, columns=["time", "started_at"])
            if t.num_rows == 0:
                return None
            lo = {c: float(pc.min(t[c]).as_py()) for c in ("time", "started_at")}
    except (OSError, pa.ArrowInvalid) as err:  # a foreign or damaged file: leave it
        logger.debug("guardrails: not merging %s: %s", path, err)
        return None
    return _Part(path, lo["time"], lo.get("started_at", 0.0), int(m.group(2)) if m else 0)
