"""``run_dir/metrics.parquet``: its schema and its reader, torch-free.

:class:`guardrails.Telemetry` writes the parts; :func:`guardrails.read_metrics` and
``python -m guardrails report`` read them. Kept apart from the writer so the report
starts without importing torch (3.7 s median before, 0.65-0.7 s after, for a 100k-row run on a
loaded 2-core VM; benchmarks/RESULTS.md).
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

METRICS_DIR = "metrics.parquet"

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
        ("tokens", pa.int64()),  # tokens in the step (null when unknown)
        ("tokens_per_s", pa.float64()),
        ("gc_s", pa.float64()),  # time in Python's GC during the step (GCScheduler)
        ("mem_peak_bytes", pa.int64()),  # CUDA max allocated so far / CPU peak RSS
        ("skipped", pa.bool_()),  # the update was skipped (NanGuard)
    ]
)


def read_metrics(run_dir: str | Path) -> pa.Table:
    """All rows of ``run_dir/metrics.parquet`` (every rank, every run that used this
    directory), sorted by (started_at, rank, step)."""
    path = Path(run_dir) / METRICS_DIR
    if not path.is_dir():
        raise FileNotFoundError(
            f"no metrics at {path}: was a guard run with run_dir={str(run_dir)!r} and "
            "metrics=True? Metrics are written at close and every metrics_write_every_s."
        )
    table = pq.read_table(path, schema=SCHEMA)
    return table.sort_by(
        [("started_at", "ascending"), ("rank", "ascending"), ("step", "ascending")]
    )
