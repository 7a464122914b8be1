"""A rank's month of metrics: files on disk before and after compaction, and what
``guardrails report`` needs to read it. Synthesized, not run: the parts are the ones
Telemetry writes (same names, schema and row count per part), their rows' clock spread
over the simulated time.

    python benchmarks/month_bench.py                      # 30 days, 10 steps/s, a part a minute
    python benchmarks/month_bench.py --days 1 --write-every-s 1    # 86,400 parts
    python benchmarks/month_bench.py --days 30 --old-report-days 1 # also the old report on 1 day

Prints: parts written, files after each rank's hours are merged
(``_metrics_compact.Compactor``, as the Telemetry thread does), the merge's time, and
for ``guardrails report --json`` on the merged directory its wall time and peak RSS
(``VmHWM`` of a fresh process: ``ru_maxrss`` counts the parent's from before exec).
With ``--old-report-days`` it also runs the report of a given checkout (``--old-tree``,
which loaded every row) on that many days' parts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from guardrails.metrics.compact import Compactor  # noqa: E402
from guardrails.metrics.file import METRICS_DIR, SCHEMA  # noqa: E402

T0 = 1_767_225_600.0  # 2026-01-01 00:00 UTC


def synthesize(run_dir: Path, days: float, steps_per_s: float, write_every_s: float) -> int:
    """Rank 0's parts for ``days`` at ``steps_per_s``, one per ``write_every_s``."""
    d = run_dir / METRICS_DIR
    d.mkdir(parents=True, exist_ok=True)
    rows = max(int(steps_per_s * write_every_s), 1)
    n_parts = int(days * 86400 / write_every_s)
    rng = np.random.default_rng(0)
    base = np.arange(rows)
    template = {
        "rank": pa.array(np.zeros(rows, np.int32)),
        "started_at": pa.array(np.full(rows, T0)),
        "lr": pa.array(np.full(rows, 3e-4)),
        "tokens": pa.array(np.full(rows, 524_288, np.int64)),
        "gc_s": pa.array(np.zeros(rows)),
        "skipped": pa.array(np.zeros(rows, bool)),
    }
    for i in range(n_parts):
        first = 1 + i * rows
        steps = first + base
        step_time = (0.09 + 0.02 * rng.random(rows)) / (steps_per_s / 10)
        cols = {
            **template,
            "step": pa.array(steps.astype(np.int64)),
            "time": pa.array(T0 + steps / steps_per_s),
            "loss": pa.array((3.0 / np.log(steps + 2)).astype(np.float32)),
            "grad_norm": pa.array((0.5 + rng.random(rows)).astype(np.float32)),
            "step_time_s": pa.array(step_time),
            "data_wait_s": pa.array(0.01 * step_time),
            "tokens_per_s": pa.array(524_288 / step_time),
            "mem_peak_bytes": pa.array(np.full(rows, 60 * 2**30, np.int64)),
        }
        table = pa.table({f.name: cols[f.name] for f in SCHEMA}, schema=SCHEMA)
        pq.write_table(table, d / f"part-r00000-s{first:09d}-{uuid.uuid4().hex[:8]}.parquet")
    return n_parts


def count(run_dir: Path) -> int:
    return sum(1 for p in (run_dir / METRICS_DIR).glob("*.parquet"))


def report(run_dir: Path, tree: Path) -> dict[str, float]:
    """``guardrails report --json --no-png`` of ``tree`` in a fresh process: wall time
    and peak RSS."""
    code = (
        "import json, re, sys, time; t = time.perf_counter(); "
        "from guardrails.__main__ import main; "
        "import contextlib, io; out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out): rc = main(['report', sys.argv[1], '--json', "
        "'--no-png'])\n"
        "facts = json.loads(out.getvalue())\n"
        "print(json.dumps({'rc': rc, 's': time.perf_counter() - t, 'rows': facts['metrics_rows'],"
        " 'rss_mib': int(re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read())"
        ".group(1)) / 1024}))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(run_dir)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(tree)},
        cwd=run_dir.parent,  # not a checkout: `-c` puts the cwd first on sys.path
    )
    if proc.returncode:
        return {"error": proc.stderr[-2000:]}  # type: ignore[dict-item]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--days", type=float, default=30)
    p.add_argument("--steps-per-s", type=float, default=10)
    p.add_argument("--write-every-s", type=float, default=60)
    p.add_argument("--compact-every-s", type=float, default=3600)
    p.add_argument("--old-report-days", type=float, default=0)
    p.add_argument("--old-tree", type=Path, help="a checkout whose report loads every row")
    p.add_argument("--dir", type=Path, help="where to write (default: a temp dir)")
    p.add_argument("--out", help="append a JSON line with the results here")
    args = p.parse_args()
    base = args.dir or Path(tempfile.mkdtemp(prefix="month-"))
    res: dict[str, object] = {"args": {k: str(v) for k, v in vars(args).items()}}
    run_dir = base / "month"
    t = time.perf_counter()
    parts = synthesize(run_dir, args.days, args.steps_per_s, args.write_every_s)
    res["parts"] = parts
    res["synthesize_s"] = time.perf_counter() - t
    res["bytes"] = sum(f.stat().st_size for f in (run_dir / METRICS_DIR).iterdir())
    print(f"{parts:,} parts ({res['bytes'] / 2**30:.2f} GiB) in {res['synthesize_s']:.0f} s")
    if args.old_report_days and args.old_tree:
        old_dir = base / "old"
        synthesize(old_dir, args.old_report_days, args.steps_per_s, args.write_every_s)
        for name, tree in (("old", args.old_tree), ("new", ROOT)):
            r = report(old_dir, tree)
            res[f"report_{name}_{args.old_report_days:g}d_parts"] = r
            print(f"report ({name}) on {args.old_report_days:g} day(s) of parts: {r}")
    r = report(run_dir, ROOT)
    res["report_parts"] = r
    print(f"report on {parts:,} parts: {r}")
    t = time.perf_counter()
    c = Compactor(run_dir / METRICS_DIR, 0, args.compact_every_s)
    c.scan()
    scan_s = time.perf_counter() - t
    c.run_once(upto=float("inf"))
    res["compact_s"] = time.perf_counter() - t
    res["compact_scan_s"] = scan_s
    res["files_after"] = count(run_dir)
    print(
        f"merged into {res['files_after']:,} files in {res['compact_s']:.0f} s "
        f"(listing and footers {scan_s:.1f} s)"
    )
    r = report(run_dir, ROOT)
    res["report_merged"] = r
    print(f"report on {res['files_after']:,} merged files: {r}")
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    main()
