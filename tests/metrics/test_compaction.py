"""A month-long run is a bounded number of metrics files, read in bounded memory.

Each rank's parquet parts are merged into one file per hour (``compact_every_s``); a
reader sees every row exactly once whatever state a merge is in, including after a
real SIGKILL in the middle of one; ``guardrails report`` streams a batch at a time.
Parts are synthesized with real pyarrow writes (a month is not run)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import Regressor, batches, patience

import guardrails
from guardrails.cli.report_stats import EXACT_VALUES, Median
from guardrails.metrics.compact import Compactor
from guardrails.metrics.file import BATCH_ROWS, METRICS_DIR, SCHEMA, sources

ROOT = Path(__file__).resolve().parents[2]
T0 = 1_767_225_600.0  # 2026-01-01 00:00 UTC: windows start on the hour


def rows_table(rank: int, first_step: int, n: int, started_at: float, dt: float) -> pa.Table:
    """``n`` rows of a rank, one step every ``dt`` seconds from ``started_at``."""
    steps = np.arange(first_step, first_step + n, dtype=np.int64)
    rng = np.random.default_rng(first_step + 1000 * rank)
    bad = steps % 997 == 0  # a NaN loss, the update skipped
    step_time = dt * (0.5 + rng.random(n))
    loss = (2.0 / np.sqrt(steps) + 0.01 * rng.random(n)).astype(np.float32)
    loss[bad] = np.nan
    cols = {
        "step": steps,
        "rank": np.full(n, rank, np.int32),
        "started_at": np.full(n, started_at),
        "time": started_at + steps * dt,
        "loss": loss,
        "grad_norm": np.where(bad, np.inf, 1.0 + rng.random(n)).astype(np.float32),
        "lr": 3e-4 * np.minimum(1.0, steps / 1000),
        "step_time_s": step_time,
        "data_wait_s": 0.2 * step_time * rng.random(n),
        "forward_s": 0.3 * step_time,
        "backward_s": 0.4 * step_time,
        "optimizer_s": 0.05 * step_time,
        "tokens": np.full(n, 4096, np.int64),
        "tokens_per_s": 4096 / step_time,
        "gc_s": np.where(steps % 100 == 0, 1e-3 * rng.random(n), 0.0),
        "mem_peak_bytes": (2**30 + steps * 64).astype(np.int64),
        "skipped": bad,
    }
    return pa.table(cols, schema=SCHEMA)


def write_parts(
    run_dir: Path,
    *,
    rank: int = 0,
    parts: int,
    rows_per_part: int,
    dt: float,
    started_at: float = T0,
    first_step: int = 1,
) -> int:
    """Parts named as Telemetry names them, each ``rows_per_part`` steps. Returns the
    next step."""
    d = run_dir / METRICS_DIR
    d.mkdir(parents=True, exist_ok=True)
    step = first_step
    for _ in range(parts):
        t = rows_table(rank, step, rows_per_part, started_at, dt)
        pq.write_table(t, d / f"part-r{rank:05d}-s{step:09d}-{uuid.uuid4().hex[:8]}.parquet")
        step += rows_per_part
    return step


def files(run_dir: Path, prefix: str = "") -> list[str]:
    return sorted(p.name for p in (run_dir / METRICS_DIR).glob(f"{prefix}*.parquet") if p.is_file())


def assert_same_rows(run_dir: Path, expected: pa.Table) -> None:
    """``read_metrics`` gives exactly ``expected``: every column bitwise (NaNs too,
    which ``Table.equals`` calls unequal), the same nulls."""
    got = guardrails.read_metrics(run_dir)
    assert got.num_rows == expected.num_rows, (got.num_rows, expected.num_rows)
    assert got.schema.equals(expected.schema)
    for name in expected.column_names:
        a, b = got.column(name).combine_chunks(), expected.column(name).combine_chunks()
        assert a.is_null().equals(b.is_null()), name
        x, y = a.to_numpy(zero_copy_only=False), b.to_numpy(zero_copy_only=False)
        if x.dtype.kind == "f":
            x, y = x.view(f"u{x.itemsize}"), y.view(f"u{y.itemsize}")
        assert np.array_equal(x, y), name


# ---------------------------------------------------------------------------- merging


@pytest.mark.slow(reason="hours of metric parts written and merged: ~3 CPU-s")
def test_parts_of_each_finished_hour_become_one_file_and_rows_stay_exact(tmp_path):
    # 6 h of rank 0 and 1 at one step a second, one part a minute: 720 parts; the last
    # hour is not over (its rows may still come), so it stays as parts.
    for rank in (0, 1):
        write_parts(tmp_path, rank=rank, parts=360, rows_per_part=60, dt=1.0)
    before = guardrails.read_metrics(tmp_path)
    assert before.num_rows == 2 * 360 * 60
    for rank in (0, 1):
        c = Compactor(tmp_path / METRICS_DIR, rank, 3600.0)
        c.scan()
        assert c.run_once(upto=T0 + 5 * 3600 + 30) == 5  # hours 0-4 are over
    merged = files(tmp_path, "compact-")
    assert len(merged) == 10  # 5 per rank
    assert len(files(tmp_path, "part-")) == 2 * 60  # hour 5's parts
    assert_same_rows(tmp_path, before)
    # Each merged file names the parts it holds, which are gone; one hour per file,
    # named by the hour's start.
    for name in merged:
        held = sources(tmp_path / METRICS_DIR / name)
        assert len(held) == 60
        assert not any((tmp_path / METRICS_DIR / p).exists() for p in held)
        start = int(name.split("-t")[1][:10])
        t = pq.read_table(tmp_path / METRICS_DIR / name, columns=["time"])["time"].to_numpy()
        assert start % 3600 == 0 and start <= t.min() and t.max() <= start + 3600
    # Plain readers of the directory see each row once too (no part is left behind).
    assert pq.read_table(tmp_path / METRICS_DIR).num_rows == before.num_rows
    # Nothing it made is group/other-writable, whatever the umask.
    for name in merged:
        assert not os.stat(tmp_path / METRICS_DIR / name).st_mode & 0o022


def test_compact_every_s_is_checked():
    with pytest.raises(ValueError, match="compact_every_s"):
        guardrails.Telemetry(compact_every_s=0)
    assert guardrails.Telemetry(compact_every_s=None).compact_every_s is None


@pytest.mark.slow(reason="a 3 s run: merges of 1 s windows")
def test_a_guarded_run_merges_its_parts_off_the_training_thread(tmp_path, caplog):
    # Windows of 1 s and a part every 2 steps: the run's 3 s leave a few merged files.
    caplog.set_level(logging.WARNING, logger="guardrails")
    torch.manual_seed(0)
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    threads = set()
    with guardrails.guard(
        model,
        opt,
        batches(60),
        run_dir=tmp_path,
        progress=False,
        checkpoint=False,
        metrics={"every_n_steps": 2, "write_every_s": 0, "compact_every_s": 1},
    ) as g:
        # Not train_loop: 50 ms steps, the threads alive after each recorded.
        for x, y in g:
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
            time.sleep(0.05)
            threads.update(t.name for t in threading.enumerate())
    assert "guardrails-compact-r0" in threads  # its own thread
    assert not [t for t in threading.enumerate() if t.name.startswith("guardrails-compact")]
    merged = files(tmp_path, "compact-")
    assert merged, files(tmp_path)
    assert len(files(tmp_path)) < 30  # 30 parts written
    steps = guardrails.read_metrics(tmp_path)["step"].to_pylist()
    assert steps == list(range(1, 61))  # every row once
    assert not caplog.records, caplog.text  # merging is silent


def test_a_part_left_next_to_the_file_holding_it_is_read_once_and_removed(tmp_path):
    """The state a kill between a merge's rename and its deletes leaves, made by hand:
    the merged file and some of its parts are both on disk."""
    write_parts(tmp_path, parts=30, rows_per_part=60, dt=1.0)  # 30 min of parts
    before = guardrails.read_metrics(tmp_path)
    d = tmp_path / METRICS_DIR
    saved = {p.name: p.read_bytes() for p in d.glob("part-*.parquet")}
    c = Compactor(d, 0, 600.0)
    c.scan()
    assert c.run_once(upto=T0 + 3600) == 3
    for name in list(saved)[:7]:  # seven parts back, as if never deleted
        (d / name).write_bytes(saved[name])
    (d / ".compact-r00000-t0000000000-deadbeef.parquet.tmp").write_bytes(b"PAR1 torn")
    assert_same_rows(tmp_path, before)
    assert sum(b.num_rows for b in guardrails.iter_metrics(tmp_path)) == before.num_rows
    Compactor(d, 0, 600.0).scan()  # the rank's next start
    assert files(tmp_path, "part-") == [] and not list(d.glob(".compact-*"))
    assert_same_rows(tmp_path, before)


def test_a_merge_waits_for_a_reader_and_never_deletes_a_part_under_it(tmp_path):
    """While a reader holds the lock (as iter_metrics does for its whole read) a merge
    renames and deletes nothing; it commits once the reader is done."""
    from guardrails.metrics.file import lock

    write_parts(tmp_path, parts=8, rows_per_part=60, dt=1.0)
    d = tmp_path / METRICS_DIR
    c = Compactor(d, 0, 3600.0)
    c.scan()
    done = []
    with lock(d, exclusive=False):
        t = threading.Thread(target=lambda: done.append(c.run_once(upto=float("inf"))))
        t.start()
        time.sleep(1.0)
        assert len(files(tmp_path, "part-")) == 8 and not files(tmp_path, "compact-")
    t.join()
    assert done == [1] and files(tmp_path, "part-") == []


KILLED = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from guardrails.metrics.compact import Compactor
    c = Compactor(Path(sys.argv[1]), 0, 60.0)
    c.scan()
    print("ready", flush=True)
    c.run_once(upto=float("inf"))
    print("done", flush=True)
    """
)


def _kill_when(d: Path, script: Path, seen_before: set[str], ready, *, delay_s: float = 0.0):
    """Start a compaction process; SIGKILL it once ``ready(names)`` holds for the
    directory's new names (polled every 0.5 ms) or, with ``delay_s``, that long after
    it starts merging. Returns whether it was killed (not finished first)."""
    proc = subprocess.Popen(
        [sys.executable, str(script), str(d)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.stdout.readline().strip() == "ready"
    deadline = time.monotonic() + patience(120)
    if delay_s:
        time.sleep(delay_s)
    else:
        while proc.poll() is None and time.monotonic() < deadline:
            names = {e.name for e in os.scandir(d)} - seen_before
            if ready(names):
                break
            time.sleep(0.0005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return proc.returncode == -signal.SIGKILL


@pytest.mark.slow(reason="compaction processes SIGKILLed mid-merge")
def test_sigkill_in_the_middle_of_merges_never_loses_or_repeats_a_row(tmp_path):
    """Real SIGKILLs of a compaction (6 windows of 100 parts) at its two dangerous
    moments, found by watching the directory: while the merged file is written, and
    right after its rename, while the parts it holds are being deleted; then at random
    moments. After each kill, and at every read of a reader running alongside, each
    row is there exactly once; the next start cleans up and finishes."""
    run_dir = tmp_path / "run"
    write_parts(run_dir, parts=600, rows_per_part=6, dt=0.1)  # 100 parts a minute
    expected = guardrails.read_metrics(run_dir)
    script = tmp_path / "compact.py"
    script.write_text(KILLED)
    d = run_dir / METRICS_DIR
    reads: list[bool] = []
    stop = threading.Event()

    def reader():
        while not stop.is_set():
            try:
                assert_same_rows(run_dir, expected)
                reads.append(True)
            except AssertionError:
                reads.append(False)
            time.sleep(0.2)

    t = threading.Thread(target=reader)
    t.start()
    try:
        # 1. While the merged file is written: a temp file, every part untouched.
        assert _kill_when(d, script, set(), lambda new: any(n.startswith(".compact-") for n in new))
        assert list(d.glob(".compact-*.parquet.tmp")) and not files(run_dir, "compact-")
        assert len(files(run_dir, "part-")) == 600
        assert_same_rows(run_dir, expected)
        # 2. Just after the rename: the merged file and (some of) its parts, both there.
        between = 0
        for _ in range(5):
            before = {e.name for e in os.scandir(d)}
            killed = _kill_when(
                d, script, before, lambda new: any(n.startswith("compact-") for n in new)
            )
            assert killed
            names = {e.name for e in os.scandir(d)}
            held = set().union(*(sources(d / n) for n in names if n.startswith("compact-")))
            between += bool(held & names)
            assert_same_rows(run_dir, expected)
            if between:
                break  # else too late (all deleted): the next try merges the next window
        assert between, "no kill landed between a rename and its deletes"
        # 3. At random moments.
        rng = np.random.default_rng(0)
        for _ in range(3):
            _kill_when(d, script, set(), None, delay_s=float(rng.uniform(0.01, 0.5)))
            assert_same_rows(run_dir, expected)
    finally:
        stop.set()
        t.join()
    assert reads and all(reads), f"{reads.count(False)} of {len(reads)} reads differed"
    c = Compactor(d, 0, 60.0)  # the next start: leftovers gone, the rest merged
    c.scan()
    c.run_once(upto=float("inf"))
    assert files(run_dir, "part-") == [] and not list(d.glob(".compact-*"))
    assert len(files(run_dir, "compact-")) >= 2  # one per window (or per killed pass)
    assert_same_rows(run_dir, expected)


# ---------------------------------------------------------------------------- the report


def test_a_median_is_exact_then_within_005_percent():
    rng = np.random.default_rng(0)
    small = rng.lognormal(0, 2, EXACT_VALUES)
    m = Median()
    m.add(small[:1000])
    m.add(small[1000:])
    assert m.exact and m.value() == float(np.median(small))
    big = np.concatenate([rng.lognormal(0, 2, 10**6), -rng.lognormal(0, 1, 10**5), [0.0] * 7])
    m = Median()
    for chunk in np.array_split(big, 97):
        m.add(chunk)
    assert not m.exact
    assert abs(m.value() / np.median(big) - 1) <= 0.0005


REPORT_RSS = textwrap.dedent(
    r"""
    import json, re, sys
    from guardrails.__main__ import main
    code = main(["report", sys.argv[1], "--json", "--png", sys.argv[2]])
    # This process's peak RSS (ru_maxrss would include the parent's, from before exec).
    hwm = re.search(r"VmHWM:\s+(\d+) kB", open("/proc/self/status").read()).group(1)
    print(json.dumps({"code": code, "rss": int(hwm)}))
    """
)


def _report_rss(run_dir: Path, tmp_path: Path) -> tuple[dict, int]:
    script = tmp_path / "rss.py"
    script.write_text(REPORT_RSS)
    proc = subprocess.run(
        [sys.executable, str(script), str(run_dir), str(run_dir / "r.png")],
        capture_output=True,
        text=True,
        timeout=patience(600),
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    last = json.loads(lines[-1])
    facts = json.loads("\n".join(lines[:-1]))
    return facts, last["rss"] * 1024


@pytest.mark.slow(reason="2 report processes, one over 2.16M rows")
def test_the_report_reads_a_batch_at_a_time_whatever_the_length_of_the_run(tmp_path):
    """The report's memory is one batch of rows: its peak RSS for 2.16M rows (a rank's
    2.5 days at 10 steps/s, merged hourly) is that for 36k rows (an hour). The old
    report loaded every row: peak RSS 231 -> 1,418 MiB for these two (now 147 -> 145);
    ~15 GB for a month. It drew a line per skipped step too (+300 MB for 8,666)."""
    from guardrails.cli import report_runs

    sizes = {}
    for name, hours in (("short", 1), ("long", 60)):
        run_dir = tmp_path / name
        write_parts(run_dir, parts=hours, rows_per_part=36_000, dt=0.1)  # an hour a file
        facts, rss = _report_rss(run_dir, tmp_path)
        sizes[name] = (facts, rss)
        assert facts["metrics_rows"] == hours * 36_000 and facts["last_step"] == hours * 36_000
        assert (run_dir / "r.png").read_bytes()[:4] == b"\x89PNG"
        # Structural: the streaming pass holds one batch, never the run.
        events: list = []
        runs = report_runs.split_runs(events, report_runs._metrics_keys(run_dir)[0])
        peak = report_runs.gather(run_dir, runs, runs, plots=True)
        assert 0 < peak <= BATCH_ROWS
        assert len(runs[0].curves.line(0, "loss")[0]) <= 4000
    (short, rss_short), (long, rss_long) = sizes["short"], sizes["long"]
    grown = rss_long - rss_short
    print(f"peak RSS {rss_short / 2**20:.0f} MiB -> {rss_long / 2**20:.0f} MiB")
    assert grown < 32 * 2**20, f"peak RSS grew by {grown / 2**20:.0f} MiB for 60x the rows"
    # Medians over more rows than are kept exactly are estimated, and say so.
    assert long.get("medians_estimated") and "medians_estimated" not in short
    assert abs(long["grad_norm"]["median"] / 1.5 - 1) < 0.002  # uniform on [1, 2)
    assert long["loss_first"] > long["loss_last"]


@pytest.mark.parametrize("compact", [False, True])
@pytest.mark.slow(reason="a run's report read twice, from parts and merged: ~2 CPU-s each")
def test_report_facts_are_the_same_from_parts_and_from_merged_files(tmp_path, compact):
    """Two ranks, two hours, NaN steps: the streaming report says exactly what the
    report that loaded every row said (its output on this data, from the code before
    streaming, is the reference), from parts and from merged files alike."""
    run_dir = tmp_path / "run"
    for rank in (0, 1):
        write_parts(run_dir, rank=rank, parts=120, rows_per_part=60, dt=1.0)
        if compact:
            c = Compactor(run_dir / METRICS_DIR, rank, 3600.0)
            c.scan()
            assert c.run_once(upto=float("inf")) == 2
    assert bool(files(run_dir, "compact-")) == compact
    facts, _ = _report_rss(run_dir, tmp_path)
    reference = json.loads((ROOT / "tests" / "data" / "report_2x7200_rows.json").read_text())
    assert reference["skipped_steps"]  # the data has skipped steps to agree on
    for key, value in reference.items():
        # Sums may differ in their last bit: the rows are added in another order.
        assert facts[key] == (value if value is None else pytest.approx(value, rel=1e-12)), key
