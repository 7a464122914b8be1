"""``run_dir/metrics.parquet``: its schema and its reader, torch-free.

:class:`guardrails.Telemetry` writes the parts; :func:`guardrails.read_metrics` and
``python -m guardrails report`` read them. Kept apart from the writer so the report
starts without importing torch (~2.3 s on its own): 0.65-0.7 s median for a 100k-row run
on a loaded CPU host.

Two kinds of file hold the rows: the parts a rank writes (``part-r<rank>-s<step>-*``,
one per ``write_every_s``) and, once an hour is over, one ``compact-r<rank>-t<time>-*``
per rank and hour that merges them (``metrics/compact.py``). A compacted file names the
parts it holds in its parquet metadata (``guardrails.sources``) and is renamed into
place before they are deleted, so a part and the file holding it can both be on disk
for a moment (or, after a kill in that moment, until the rank's next start). The reader
here reads each row once whatever it finds: it skips every part a compacted file names,
and it takes a shared ``flock`` on ``.lock`` while it lists and reads, which the
compactor takes exclusively for the rename and the deletes (milliseconds), so no part
it listed disappears before it is read.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from guardrails.util.checks import path_like

logger = logging.getLogger("guardrails.telemetry")
#: The unreadable parts already named (path, size, mtime): a report reads twice.
_said_unreadable: set[tuple[str, int, float]] = set()

try:
    import fcntl
except ImportError:  # pragma: no cover (Windows: no compaction races to guard)
    fcntl = None  # type: ignore[assignment]

METRICS_DIR = "metrics.parquet"
PART_PREFIX = "part-"
COMPACT_PREFIX = "compact-"
#: Parquet key-value metadata of a compacted file: the JSON list of the parts it holds.
SOURCES_KEY = b"guardrails.sources"
#: Taken shared by readers, exclusively by a compaction's commit (rename and deletes).
LOCK_FILE = ".lock"
#: Rows read at a time by :func:`iter_metrics` (and a compacted file's row group): the
#: report's memory is bounded by this, not by the length of the run.
BATCH_ROWS = 65_536

#: The schema of ``metrics.parquet``; documented in docs/metrics.md (tests/test_docs.py checks).
SCHEMA = pa.schema(
    [
        ("step", pa.int64()),  # optimizer step, 1-based
        ("rank", pa.int32()),
        ("started_at", pa.float64()),  # unix time this guard started: tells runs apart
        ("time", pa.float64()),  # unix time at the end of the step
        ("loss", pa.float32()),  # mean loss over the step's micro-batches
        ("grad_norm", pa.float32()),  # total L2 grad norm before the update
        ("lr", pa.float64()),  # first param group's LR
        ("step_time_s", pa.float64()),  # end of previous step -> end of this one
        ("data_wait_s", pa.float64()),  # time blocked in the loader's next()
        ("forward_s", pa.float64()),  # in the step's training forwards
        ("backward_s", pa.float64()),  # first forward -> optimizer.step(), less the above
        ("optimizer_s", pa.float64()),  # in optimizer.step()
        ("tokens", pa.int64()),  # tokens in the step (null when unknown)
        ("tokens_per_s", pa.float64()),
        ("gc_s", pa.float64()),  # time in Python's GC during the step (GCScheduler)
        ("mem_peak_bytes", pa.int64()),  # CUDA max allocated so far / CPU peak RSS
        ("skipped", pa.bool_()),  # the update was skipped (NanGuard)
    ]
)


def read_metrics(run_dir: str | Path) -> pa.Table:
    """All rows of ``run_dir/metrics.parquet`` (every rank, every run that used this
    directory), sorted by (started_at, rank, step). Each row once, parts and compacted
    files alike. It holds every row in memory: for a long run read
    :func:`iter_metrics` instead (what ``guardrails report`` does)."""
    table = pa.Table.from_batches(list(iter_metrics(run_dir)), schema=SCHEMA)
    return table.sort_by(
        [("started_at", "ascending"), ("rank", "ascending"), ("step", "ascending")]
    )


def metrics_dir(run_dir: str | Path) -> Path:
    """``run_dir/metrics.parquet``; ``FileNotFoundError`` saying why when missing."""
    path_like("run_dir", run_dir)
    path = Path(run_dir) / METRICS_DIR
    if not path.is_dir():
        raise FileNotFoundError(
            f"no metrics at {path}: was a guard run with run_dir={str(run_dir)!r} and "
            "metrics on? Metrics are written at close and every write_every_s "
            "(guard(metrics={'write_every_s': ...}))."
        )
    return path


def iter_metrics(
    run_dir: str | Path, columns: Iterable[str] | None = None, batch_rows: int = BATCH_ROWS
) -> Iterator[pa.RecordBatch]:
    """Every row of ``run_dir/metrics.parquet`` once, ``batch_rows`` at most at a time,
    in no particular order, as record batches of ``columns`` (default all) typed as in
    :data:`SCHEMA` (a column a file lacks comes back null). Memory is one batch, however
    long the run. Compactions wait until the generator is exhausted or closed. A file
    that cannot be read (a torn part, another user's) is skipped, named in a warning:
    one such part hid every row of the run ("no metric rows were written")."""
    path = metrics_dir(run_dir)
    names = list(SCHEMA.names if columns is None else columns)
    unknown = [n for n in names if n not in SCHEMA.names]
    if unknown:
        raise ValueError(f"no column(s) {unknown} in metrics.parquet; columns: {SCHEMA.names}")
    schema = pa.schema([SCHEMA.field(n) for n in names])
    with lock(path, exclusive=False):
        for file in snapshot(path):
            try:
                pf = pq.ParquetFile(file)
            except (OSError, pa.ArrowException) as err:
                _skipped(file, err)
                continue
            try:
                have = [n for n in names if n in pf.schema_arrow.names]
                for batch in pf.iter_batches(batch_size=batch_rows, columns=have):
                    yield _conform(batch, schema)
            except (OSError, pa.ArrowException) as err:  # torn past its footer
                _skipped(file, err)
            finally:
                pf.close()


def _skipped(file: Path, err: Exception) -> None:
    """Say once per process that ``file`` was left out, and why."""
    try:
        st = file.stat()
        key = (str(file), st.st_size, st.st_mtime)
    except OSError:
        key = (str(file), -1, 0.0)
    if key in _said_unreadable:
        return
    _said_unreadable.add(key)
    logger.warning(
        "guardrails: %s cannot be read (%s: %s); its rows are left out, the other files' are read",
        file,
        type(err).__name__,
        err,
    )


def snapshot(directory: Path) -> list[Path]:
    """The parquet files of ``directory`` that hold every row exactly once: all of
    them, less the parts a compacted file already holds. Call it under :func:`lock`."""
    names = set()
    with os.scandir(directory) as entries:
        for e in entries:
            if e.name.endswith(".parquet") and not e.name.startswith((".", "_")) and e.is_file():
                names.add(e.name)
    held: set[str] = set()
    for name in names:
        if name.startswith(COMPACT_PREFIX):
            with contextlib.suppress(OSError, pa.ArrowException):  # skipped when read
                held.update(sources(directory / name))
    return [directory / n for n in sorted(names - held)]


def sources(path: Path) -> list[str]:
    """The part names a compacted file holds (its footer's ``guardrails.sources``)."""
    meta = pq.read_metadata(path).metadata or {}
    raw = meta.get(SOURCES_KEY)
    return [] if raw is None else list(json.loads(raw))


@contextlib.contextmanager
def lock(directory: Path, *, exclusive: bool, timeout_s: float | None = None) -> Iterator[bool]:
    """``flock`` ``directory/.lock``: shared for readers, exclusive for a compaction's
    commit. Yields whether it is held: ``False`` only when someone else still held it
    after ``timeout_s`` (``None``: wait as long as it takes). A reader that cannot open
    the lock file (a read-only directory where no compaction ever ran, so none can be
    under way) reads without."""
    if fcntl is None:
        yield True
        return
    path = directory / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            if exclusive:
                raise
            yield True
            return
    try:
        op = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        if timeout_s is None:
            fcntl.flock(fd, op)
        else:
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    fcntl.flock(fd, op | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        yield False
                        return
                    time.sleep(0.05)
        yield True
    finally:
        os.close(fd)  # releases the lock


def conform(table: pa.Table) -> pa.Table:
    """``table`` with exactly :data:`SCHEMA`'s columns and types (missing ones null)."""
    return pa.Table.from_batches([_conform(b, SCHEMA) for b in table.to_batches()], schema=SCHEMA)


def _conform(batch: pa.RecordBatch, schema: pa.Schema) -> pa.RecordBatch:
    arrays = []
    for field in schema:
        i = batch.schema.get_field_index(field.name)
        arr = pa.nulls(batch.num_rows, field.type) if i < 0 else batch.column(i)
        arrays.append(arr if arr.type == field.type else arr.cast(field.type))
    return pa.RecordBatch.from_arrays(arrays, schema=schema)
