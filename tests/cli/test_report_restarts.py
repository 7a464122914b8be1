"""``report``'s restarts and goodput: real runs that fail (an exception, a SIGKILL) and
are run again with ``resume="auto"``, a clean run that shows none, and hand-made run
directories whose times are exact, to check the arithmetic to the millisecond."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _ranks import patience
from conftest import read_events

ROOT = Path(__file__).resolve().parents[2]

WORKER = textwrap.dedent(
    """
    import os, signal, sys, time, torch
    sys.path.insert(0, {tests!r})
    import guardrails
    from conftest import Regressor, batches

    run_dir, steps, fault, at = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    torch.manual_seed(0)
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with guardrails.guard(model, opt, batches(steps), run_dir=run_dir, progress=False,
                          checkpoint={{"every_n_steps": 20}},
                          metrics={{"every_n_steps": 5, "write_every_s": 0}}) as g:
        for x, y in g:
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
            if g.step == at and fault == "raise":
                raise RuntimeError(f"injected fault at step {{g.step}}")
            if g.step == at and fault == "kill":
                time.sleep(0.5)  # the step-20 checkpoint's commit, in the background
                os.kill(os.getpid(), signal.SIGKILL)
    """
)


def train(tmp_path: Path, run_dir: Path, *, steps: int, fault: str = "none", at: int = 0) -> int:
    """One process of the worker: ``steps`` steps, a periodic checkpoint every 20, the
    fault at step ``at``; its exit code."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(tests=str(ROOT / "tests")))
    proc = subprocess.run(
        [sys.executable, str(script), str(run_dir), str(steps), fault, str(at)],
        capture_output=True,
        text=True,
        timeout=patience(120),
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    return proc.returncode


def report(run_dir: Path, *flags: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "guardrails", "report", str(run_dir), "--no-png", *flags],
        capture_output=True,
        text=True,
        timeout=patience(60),
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


PHASES = ("detection_s", "exit_s", "restart_s", "load_s", "first_step_s")


@pytest.mark.slow(reason="two training processes: an exception at step 30, then a resume")
def test_an_exception_then_a_resume_is_one_restart_with_its_times(tmp_path):
    run_dir = tmp_path / "run"
    assert train(tmp_path, run_dir, steps=50, fault="raise", at=30) == 1
    first = report(run_dir)
    assert "restarts" not in first  # one attempt so far: no restart to tell
    assert train(tmp_path, run_dir, steps=50) == 0

    facts = json.loads(report(run_dir, "--json"))
    (r,) = facts["restarts"]
    assert (r["from_run"], r["to_run"]) == (1, 2)
    assert r["cause"]["kind"] == "error" and r["cause"]["error_type"] == "RuntimeError"
    assert r["cause"]["message"] == "RuntimeError: injected fault at step 30"
    # Raised after step 30's update: the failure save keeps step 30, nothing is redone.
    assert (r["last_step"], r["resumed_step"], r["steps_redone"]) == (30, 30, 0)
    for phase in PHASES:
        assert r[phase] is not None and r[phase] >= 0, (phase, r)
    assert r["detection_s"] == 0  # an exception is its own verdict
    assert 0 < r["checkpoint_load_s"] < r["load_s"]  # the load holds the imports too
    assert r["to_training_s"] == pytest.approx(sum(r[p] for p in PHASES), abs=1e-6)
    assert r["process_started_from"] == "/proc/self/stat"
    job = facts["job"]
    assert job["attempts"] == 2 and job["runs"] == [1, 2] and job["steps_redone"] == 0
    # Useful: steps 2-30 of run 1 and 32-50 of run 2 (each attempt's first step holds
    # its start-up).
    assert job["useful_steps"] == 29 + 19
    assert 0 < job["goodput"] < 1
    assert job["useful_step_s"] == pytest.approx(job["goodput"] * job["wall_s"])

    text = report(run_dir)
    assert "  restarts     1 in 2 attempts (runs 1-2); goodput " in text, text
    assert (
        "    run 1 -> 2: RuntimeError: injected fault at step 30 (rank 0, step 30); "
        "failure save at step 30 in " in text
    ), text
    assert r["failure_saved"]["path"].endswith("step_000000030")
    assert r["failure_saved"]["state"] == "after_update"


@pytest.mark.slow(reason="two training processes: a clean run, then one extending it")
def test_a_clean_run_and_its_extension_show_no_restart(tmp_path):
    run_dir = tmp_path / "run"
    assert train(tmp_path, run_dir, steps=20) == 0
    assert "restarts" not in report(run_dir)
    # A finished run continued past its end (resumed at its step 20) is no restart.
    assert train(tmp_path, run_dir, steps=30) == 0
    facts = json.loads(report(run_dir, "--json"))
    assert facts["resumed"]["step"] == 20
    assert facts["restarts"] == [] and facts["job"] is None
    assert "restarts" not in report(run_dir, "--all")


@pytest.mark.slow(reason="two training processes: a SIGKILL at step 30, then a resume")
def test_a_sigkilled_run_then_a_resume_is_killed_without_a_word(tmp_path):
    run_dir = tmp_path / "run"
    assert train(tmp_path, run_dir, steps=50, fault="kill", at=30) == -9  # really killed
    assert train(tmp_path, run_dir, steps=50) == 0
    facts = json.loads(report(run_dir, "--json"))
    (r,) = facts["restarts"]
    assert r["cause"]["kind"] == "killed" and r["cause"]["message"] == "killed without a word"
    assert r["fault_is"] == "last sign of life"
    # No verdict, no end event: only what the next attempt says is timed.
    assert r["detection_s"] is None and r["exit_s"] is None
    for phase in ("restart_s", "load_s", "first_step_s"):
        assert r[phase] is not None and r[phase] >= 0, (phase, r)
    # Its rows were flushed as it went (write_every_s=0): step 30's at least, but not
    # necessarily the last one before the kill.
    assert 20 < r["last_step"] <= 30 and r["resumed_step"] == 20
    assert r["steps_redone"] == r["last_step"] - 20
    assert 0 < facts["job"]["goodput"] < 1
    text = report(run_dir)
    assert "    run 1 -> 2: killed without a word (step " in text, text
    assert "detection unknown, exit unknown, restart " in text


DDP_WORKER = textwrap.dedent(
    """
    import os, sys, torch, torch.distributed as dist
    sys.path.insert(0, {tests!r})
    import guardrails
    from conftest import Regressor, batches

    dist.init_process_group("gloo")
    run_dir, fail_at = sys.argv[1], int(sys.argv[2])
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(Regressor())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with guardrails.guard(model, opt, batches(50, seed=dist.get_rank()), run_dir=run_dir,
                          progress=False, checkpoint={{"every_n_steps": 20}},
                          metrics={{"every_n_steps": 5, "write_every_s": 0}}) as g:
        for x, y in g:
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
            if g.step == fail_at and dist.get_rank() == 1:
                raise RuntimeError(f"injected fault on rank 1 at step {{g.step}}")
    dist.destroy_process_group()
    """
)


@pytest.mark.slow(reason="two torchrun jobs of 2 gloo ranks: a failing rank, then a requeue")
def test_a_two_rank_torchrun_job_requeued_after_a_rank_failed(tmp_path):
    """Rank 1 raises after step 30's update; rank 0 sees it fail, waiting in step 31's
    all-reduce. Both save step 30 (rank 1 after its update, rank 0 before its next one),
    and the same torchrun command again (a requeue) resumes both ranks there."""
    from _ranks import torchrun

    script = tmp_path / "ddp.py"
    script.write_text(DDP_WORKER.format(tests=str(ROOT / "tests")))
    run_dir = tmp_path / "run"
    first = torchrun([script, run_dir, 30], out=tmp_path / "a", env={"OMP_NUM_THREADS": "1"})
    assert first.code != 0, first.text
    again = torchrun([script, run_dir, 0], out=tmp_path / "b", env={"OMP_NUM_THREADS": "1"})
    assert again.code == 0, again.text

    starts = read_events(run_dir)
    starts = [e for e in starts if e["kind"] == "start"]
    assert len(starts) == 4 and all(
        e["launcher"]["torchelastic_restart_count"] == 0 for e in starts
    )
    facts = json.loads(report(run_dir, "--json"))
    (r,) = facts["restarts"]
    assert r["cause"]["message"] == "RuntimeError: injected fault on rank 1 at step 30"
    assert (r["cause"]["rank"], r["fault_is"]) == (1, "error")
    assert (r["last_step"], r["resumed_step"], r["steps_redone"]) == (30, 30, 0)
    for phase in PHASES:
        assert r[phase] is not None and r[phase] >= 0, (phase, r)
    assert 0 < facts["job"]["goodput"] < 1


# ------------------------------------------------------ hand-made runs, exact times


def write_attempt(
    run_dir: Path,
    events: list[dict],
    rows: list[tuple[int, float, float]],
    *,
    started_at: float,
    rank: int = 0,
) -> None:
    """Append ``events`` to ``run_dir/events.jsonl`` and write one metrics part of
    ``rows`` (step, time, step_time_s) for ``rank``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from guardrails.metrics.file import METRICS_DIR, conform

    run_dir.mkdir(exist_ok=True)
    with (run_dir / "events.jsonl").open("a") as f:
        for e in events:
            f.write(json.dumps({"rank": rank, "level": "info", "message": "", **e}) + "\n")
    if not rows:
        return
    n = len(rows)
    table = {
        "step": [s for s, _, _ in rows],
        "rank": [rank] * n,
        "started_at": [started_at] * n,
        "time": [t for _, t, _ in rows],
        "loss": [1.0] * n,
        "grad_norm": [0.5] * n,
        "lr": [1e-3] * n,
        "step_time_s": [d for _, _, d in rows],
        "data_wait_s": [0.0] * n,
        "gc_s": [0.0] * n,
        "skipped": [False] * n,
    }
    (run_dir / METRICS_DIR).mkdir(exist_ok=True)
    name = f"part-r{rank:05d}-s{rows[0][0]:09d}-{started_at:.0f}.parquet"
    pq.write_table(conform(pa.table(table)), run_dir / METRICS_DIR / name)


def facts_of(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> dict:
    from guardrails.cli import report as cli_report

    args = argparse.Namespace(run_dir=run_dir, png=None, no_png=True, all=False, json=True)
    assert cli_report.main(args) == 0
    return json.loads(capsys.readouterr().out)


T0 = 1_800_000_000.0  # every time below is T0 plus a number binary floats hold exactly
LAUNCH = {"torchelastic_run_id": "job-7"}


def start(run: str, at: float, process_started: float, restart: int) -> dict:
    return {
        "time": T0 + at,
        "step": 0,
        "kind": "start",
        "run": run,
        "world_size": 1,
        "device": "cpu",
        "launcher": {**LAUNCH, "torchelastic_restart_count": restart},
        "process_started": T0 + process_started,
        "process_started_from": "/proc/self/stat",
    }


def test_a_hang_then_a_restart_is_timed_to_the_millisecond(tmp_path, capsys):
    """Attempt 1: steps 1-10, one a second, the last at +12 s; the hang verdict at +42
    s (the watchdog's 30 s after the last progress); its end at +43.5 s after a 1 s
    close. Attempt 2: its process up at +50.25 s, resumed at step 5 at +53 s, step 6
    done at +54.125 s, steps 6-20 then a clean end at +70 s."""
    run_dir = tmp_path / "run"
    hang = "HangError: rank 0 is stuck at step 11 in all_reduce"
    write_attempt(
        run_dir,
        [
            start("a", 2.0, 0.0, restart=0),
            {"time": T0 + 42.0, "step": 10, "kind": "hang", "level": "error", "message": hang},
            {"time": T0 + 43.5, "step": 10, "kind": "end", "error": hang, "closing_s": 1.0},
        ],
        [(s, T0 + 2.0 + s, 1.0) for s in range(1, 11)],
        started_at=T0 + 2.0,
    )
    resumed = {"time": T0 + 53.0, "step": 5, "kind": "resumed", "path": "ckpt/step_5"}
    write_attempt(
        run_dir,
        [
            start("b", 52.0, 50.25, restart=1),
            {**resumed, "load_s": 0.75},
            {"time": T0 + 70.0, "step": 20, "kind": "end", "error": None},
        ],
        [(s, T0 + 48.125 + s, 1.0) for s in range(6, 21)],
        started_at=T0 + 52.0,
    )
    facts = facts_of(run_dir, capsys)
    (r,) = facts["restarts"]
    assert r["cause"]["error_type"] == "HangError" and r["cause"]["message"] == hang
    assert r["fault_is"] == "last progress"
    exact = {
        "fault_time": T0 + 12.0,
        "verdict_time": T0 + 42.0,
        "detection_s": 30.0,
        "exit_s": 1.5,
        "restart_s": 6.75,
        "load_s": 2.75,
        "first_step_s": 1.125,
        "checkpoint_load_s": 0.75,
        "to_training_s": 42.125,
    }
    assert {k: r[k] for k in exact} == pytest.approx(exact, abs=1e-3)
    assert (r["last_step"], r["resumed_step"], r["steps_redone"]) == (10, 5, 5)
    # Useful: attempt 1's steps 2-5 (6-10 were redone), attempt 2's 7-20: 18 of 70 s.
    job = facts["job"]
    assert job["useful_steps"] == 18
    assert (job["useful_step_s"], job["wall_s"]) == pytest.approx((18.0, 70.0), abs=1e-3)
    assert job["goodput"] == pytest.approx(18 / 70, abs=1e-6)


def test_a_launcher_restart_without_a_checkpoint_redoes_every_step(tmp_path, capsys):
    """torchrun's restart (the same run id, restart count 1) of an attempt that saved
    nothing and whose rank 1 died without a word: the new attempt starts at step 0, and
    the report still calls it a restart; a run of another job after it is not one."""
    run_dir = tmp_path / "run"
    failed = "RankFailedError: rank 1 died (last heartbeat: step 8)"
    two = {"world_size": 2}
    write_attempt(run_dir, [{**start("a", 1.0, 0.5, restart=0), **two}], [], started_at=0, rank=1)
    write_attempt(
        run_dir,
        [
            {**start("a", 1.0, 0.5, restart=0), **two, "rank": 0},
            {"time": T0 + 20.0, "step": 8, "kind": "rank_failed", "message": failed},
            {"time": T0 + 20.5, "step": 8, "kind": "end", "error": failed, "closing_s": 0.25},
        ],
        [(s, T0 + 1.0 + s, 1.0) for s in range(1, 9)],
        started_at=T0 + 1.0,
    )
    write_attempt(
        run_dir,
        [{**start("b", 24.0, 22.0, restart=1), **two, "rank": r} for r in (0, 1)],
        [(s, T0 + 24.0 + s, 1.0) for s in range(1, 4)],
        started_at=T0 + 24.0,
    )
    facts = facts_of(run_dir, capsys)
    (r,) = facts["restarts"]
    assert r["cause"]["error_type"] == "RankFailedError"
    assert r["cause"]["missing_ranks"] == [1]
    assert (r["last_step"], r["resumed_step"], r["steps_redone"]) == (8, 0, 8)
    assert r["fault_time"] == pytest.approx(T0 + 9.0)  # step 8, the last progress
    assert (r["detection_s"], r["exit_s"], r["restart_s"]) == pytest.approx((11.0, 0.5, 1.5))
    assert r["checkpoint_load_s"] is None  # nothing to load: ready when it started
    assert (r["load_s"], r["first_step_s"]) == pytest.approx((2.0, 1.0))

    # Another job's run (another torchrun run id) after it is no restart.
    other = {**start("c", 40.0, 39.0, restart=0), "launcher": {"torchelastic_run_id": "job-8"}}
    write_attempt(run_dir, [other], [(1, T0 + 41.0, 1.0)], started_at=T0 + 40.0)
    facts = facts_of(run_dir, capsys)
    assert facts["restarts"] == [] and facts["job"] is None


def two_rank_restart(
    run_dir: Path,
    failed: list[tuple[int, dict]],
    *,
    first: tuple[float, float, int],
    again: tuple[float, float, int],
) -> None:
    """A 2-rank attempt that failed, then its requeue: the ``failed`` events (rank,
    event) after both ranks' starts; ``first`` = (its start, its processes' start, the
    steps rank 0 ran, one a second); ``again`` = (the requeue's start, its processes'
    start, the step it resumed at, trained once 1 s after its start)."""
    for rank, event in failed:
        write_attempt(run_dir, [event], [], started_at=0, rank=rank)
    at, process, steps = first
    lines = (run_dir / "events.jsonl").read_text()
    starts = [{**start("a", at, process, restart=0), "world_size": 2, "rank": r} for r in (0, 1)]
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in starts) + lines)
    rows = [(s, T0 + at + s, 1.0) for s in range(1, steps + 1)]
    write_attempt(run_dir, [], rows, started_at=T0 + at)
    at, process, step = again
    starts = [{**start("b", at, process, restart=0), "world_size": 2, "rank": r} for r in (0, 1)]
    resumed = {"time": T0 + at + 0.5, "step": step, "kind": "resumed", "path": f"ckpt/step_{step}"}
    write_attempt(run_dir, [*starts, resumed], [(step + 1, T0 + at + 1.0, 0.5)], started_at=T0 + at)


def test_the_launchers_sigterm_after_a_rank_error_is_not_the_cause(tmp_path, capsys):
    """Rank 1 raises after step 6; torchrun then SIGTERMs rank 0, which stops at its
    step boundary and saves: the cause is rank 1's error, seen by rank 0 when its stop
    began (the other ranks' ends time the detection where no verdict event does)."""
    run_dir = tmp_path / "run"
    error = "ValueError: bad shape"
    stop = {"kind": "stopped", "signal": "SIGTERM", "path": "ckpt/step_6", "level": "warning"}
    failed = [
        (1, {"time": T0 + 7.5, "step": 6, "kind": "end", "error": error, "closing_s": 0.5}),
        (0, {"time": T0 + 8.0, "step": 6, **stop}),
        (0, {"time": T0 + 9.0, "step": 6, "kind": "end", "error": "SystemExit: 143"}),
    ]
    two_rank_restart(run_dir, failed, first=(1.0, 0.5, 6), again=(12.0, 11.0, 6))

    facts = facts_of(run_dir, capsys)
    (r,) = facts["restarts"]
    assert r["cause"]["kind"] == "error" and r["cause"]["message"] == error
    assert r["cause"]["rank"] == 1 and r["fault_is"] == "error"
    assert r["fault_time"] == pytest.approx(T0 + 7.0)
    # Rank 0's stop at +8 is the others' first sign of it; its end at +9 the exit.
    assert (r["detection_s"], r["exit_s"]) == pytest.approx((1.0, 1.0))
    assert r["steps_redone"] == 0


def test_a_relaunch_after_a_clean_close_says_the_process_failed_after_it(tmp_path, capsys):
    """torchrun restarted a job whose guard had closed cleanly (the script failed after
    its loop): a restart, and its cause says where the failure was not."""
    run_dir = tmp_path / "run"
    end = {"time": T0 + 6.0, "step": 4, "kind": "end", "error": None, "closing_s": 0.5}
    write_attempt(
        run_dir,
        [start("a", 1.0, 0.5, restart=0), end],
        [(s, T0 + 1.0 + s, 1.0) for s in range(1, 5)],
        started_at=T0 + 1.0,
    )
    write_attempt(
        run_dir, [start("b", 9.0, 8.0, restart=1)], [(1, T0 + 10.0, 1.0)], started_at=T0 + 9.0
    )
    (r,) = facts_of(run_dir, capsys)["restarts"]
    assert r["cause"]["kind"] == "after_close" and r["steps_redone"] == 4
    assert r["fault_is"] == "last sign of life" and r["fault_time"] == pytest.approx(T0 + 6.0)


def test_a_failure_saves_wait_for_a_rank_is_said_from_the_committers_phases(tmp_path, capsys):
    """Two ranks fail on a hang; rank 1's failure_saved comes first but rank 0 committed
    (its phases: written at 0.5 s, the others' parts gathered at 10.5 s). The restart
    reports the committer's save, and its line says the 10 s it spent waiting."""
    run_dir = tmp_path / "run"
    hang = "HangError: rank 1 is stuck at step 11 in the loop body"
    saved = {"kind": "failure_saved", "step": 10, "path": "ckpt/step_10", "state": "live"}
    committed = {"written": 0.5, "gathered": 10.5, "committed": 10.6}
    failed = [
        (1, {"time": T0 + 42.0, **saved, "seconds": 0.2, "phases": {"written": 0.1}}),
        (0, {"time": T0 + 42.0, "step": 10, "kind": "hang", "level": "error", "message": hang}),
        (0, {"time": T0 + 53.0, **saved, "seconds": 10.6, "phases": committed}),
        (0, {"time": T0 + 54.0, "step": 10, "kind": "end", "error": hang, "closing_s": 11.5}),
        (1, {"time": T0 + 54.0, "step": 10, "kind": "end", "error": hang, "closing_s": 11.5}),
    ]
    two_rank_restart(run_dir, failed, first=(2.0, 0.0, 10), again=(62.0, 60.0, 10))

    facts = facts_of(run_dir, capsys)
    (r,) = facts["restarts"]
    assert r["failure_saved"]["rank"] == 0 and r["failure_saved"]["seconds"] == 10.6
    assert r["failure_saved"]["phases"]["gathered"] == 10.5
    from guardrails.cli import report as cli_report

    args = argparse.Namespace(run_dir=run_dir, png=None, no_png=True, all=False, json=False)
    assert cli_report.main(args) == 0
    text = capsys.readouterr().out
    assert (
        "failure save at step 10 in 10.6 s, 10 s of it waiting for the other ranks' parts" in text
    ), text
