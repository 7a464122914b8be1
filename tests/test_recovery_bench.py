"""The recovery benchmark's arithmetic (benchmarks/recovery/measure.py) on a synthetic log.

The benchmark itself runs real multi-rank jobs for minutes (``driver.py --smoke``) and is
not part of the suite; what is checked here is what it computes from the ranks' clock logs:
the fault schedule, each fault's times and steps redone, and the goodput.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "recovery" / "measure.py"
_spec = importlib.util.spec_from_file_location("recovery_measure", _PATH)
measure = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = measure  # @dataclass looks its module up there, once
_spec.loader.exec_module(measure)
del sys.modules[_spec.name]


def steps(rank: int, pid: int, first: int, last: int, t0: float, dt: float = 1.0) -> list:
    """Steps ``first..last`` (1-based counts) finished every ``dt`` from ``t0``."""
    return [
        {"ev": "step", "t": t0 + (s - first + 1) * dt, "rank": rank, "pid": pid, "step": s,
         "dt": dt, "nan": False}
        for s in range(first, last + 1)
    ]  # fmt: skip


def two_attempts() -> list[dict]:
    """Rank 0 and 1 train steps 1-10 (t 1..10), rank 1 is killed at t 10.5, rank 0 logs an
    error at t 11, the job exits at t 12, the restart starts at t 14, resumes from step 6 at
    t 16 (rank 0) and t 17 (rank 1), and trains steps 7-12 from t 18."""
    ev = []
    for rank in (0, 1):
        ev += [{"ev": "start", "t": 0.0, "rank": rank, "pid": 10 + rank}]
        ev += [{"ev": "resumed", "t": 0.5, "rank": rank, "pid": 10 + rank, "step": 0}]
        ev += steps(rank, 10 + rank, 1, 10, t0=0.0)
        ev += [{"ev": "start", "t": 14.0 + rank * 0.1, "rank": rank, "pid": 20 + rank}]
        ev += [{"ev": "resumed", "t": 16.0 + rank, "rank": rank, "pid": 20 + rank, "step": 6}]
        ev += steps(rank, 20 + rank, 7, 12, t0=17.0)
    ev += [{"ev": "error", "t": 11.0, "rank": 0, "pid": 10, "kind": "RuntimeError"}]
    return sorted(ev, key=lambda e: e["t"])


def test_schedule_leaves_the_last_recovery_inside_the_run():
    got = measure.schedule(minutes=10, fault_every_s=60, kinds=["kill9", "hang", "nan"])
    assert [t for t, _ in got] == [60 * k for k in range(1, 10)]  # 600 s: 540 is the last
    assert [k for _, k in got[:4]] == ["kill9", "hang", "nan", "kill9"]
    assert measure.schedule(minutes=1.5, fault_every_s=30, kinds=["kill9", "sigterm"]) == [
        (30, "kill9"),
        (60, "sigterm"),
    ]


def test_a_requeued_fault_is_timed_from_the_injection_and_counts_its_redone_steps():
    rec = measure.recovery(
        "kill9", 10.5, two_attempts(), until_t=100.0, exits=[12.0], error_lines=[11.5]
    )
    assert rec.restarted
    assert rec.last_step_before == 10
    assert rec.detect_s == pytest.approx(0.5)  # rank 0's error line, before the agent's
    assert rec.exit_s == pytest.approx(1.5)
    assert rec.restart_s == pytest.approx(3.5)
    assert rec.resumed_s == pytest.approx(6.5)  # the slower rank
    assert rec.training_s == pytest.approx(7.5)  # rank 0's step 7 at t 18
    assert (rec.resumed_step, rec.steps_redone) == (6, 4)


def test_a_fault_absorbed_in_process_is_training_again_at_its_first_clean_step():
    ev = steps(0, 10, 1, 20, t0=0.0)
    for e in ev:
        e["nan"] = 5 <= e["step"] <= 9  # a NaN streak, skipped, no restart
    rec = measure.recovery("nan", 4.5, ev, until_t=100.0, exits=[], error_lines=[])
    assert not rec.restarted
    assert rec.training_s == pytest.approx(5.5)  # step 10 at t 10
    assert rec.steps_redone == 0
    assert rec.detect_s is None


def test_goodput_counts_each_step_once_with_its_last_run():
    got = measure.goodput(two_attempts(), start_t=0.0, end_t=25.0)
    assert got["unique_steps"] == 12
    assert got["steps_run"] == 16
    assert got["steps_redone"] == 4
    assert got["useful_s"] == pytest.approx(12.0)
    assert got["goodput"] == pytest.approx(12.0 / 25.0)
    assert got["nan_steps"] == 0


def test_read_events_merges_ranks_in_clock_order_and_drops_a_torn_line(tmp_path):
    (tmp_path / "rank0.jsonl").write_text(
        json.dumps({"ev": "start", "t": 2.0}) + "\n" + '{"ev": "st'  # cut by a SIGKILL
    )
    (tmp_path / "rank1.jsonl").write_text(json.dumps({"ev": "start", "t": 1.0}) + "\n")
    got = measure.read_events(tmp_path)
    assert [(e["rank"], e["t"]) for e in got] == [(1, 1.0), (0, 2.0)]


def test_steps_past_the_final_one_and_an_earlier_attempts_lead_do_not_count():
    # Attempt 1 trains 1-10 and dies unsaved; attempt 2 restarts from 0, trains 1-4, and
    # is hit at t 16.5; attempt 3 restarts from 0 and stops after step 3.
    ev = steps(0, 10, 1, 10, t0=0.0) + steps(0, 20, 1, 4, t0=12.0)
    ev += [{"ev": "start", "t": 18.0, "rank": 0, "pid": 30}]
    ev += [{"ev": "resumed", "t": 19.0, "rank": 0, "pid": 30, "step": 0}]
    ev += steps(0, 30, 1, 3, t0=19.0)
    ev.sort(key=lambda e: e["t"])
    rec = measure.recovery("sigterm", 16.5, ev, until_t=100.0, exits=[17.0], error_lines=[])
    assert rec.last_step_before == 4  # not attempt 1's 10
    assert rec.steps_redone == 4
    got = measure.goodput(ev, start_t=0.0, end_t=22.0, final_step=3)
    assert got["unique_steps"] == 3
    assert got["useful_s"] == pytest.approx(3.0)
