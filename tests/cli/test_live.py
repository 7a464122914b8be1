"""The live view on real jobs (issue 51): ``guardrails top`` against a healthy job,
``guardrails stacks`` against ranks stuck in a collective, a sleep, a C call and a
computing loop, ``report`` of a crashed run's last snapshot, and the store left alone;
the same views of a single-process run.

Each job is real processes (``tests/live_worker.py``), real gloo, real files; the
commands run as a user runs them (``python -m guardrails ...``), from outside the job.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _ranks import ROOT, Job, base_env, launch, patience, run_script

from guardrails.cli.stacks import ranges
from guardrails.metrics import live

WORKER = ROOT / "tests" / "live_worker.py"
BENCH = ROOT / "benchmarks" / "store_calls.py"


def start(scenario: str, world: int, out: Path, *extra: str) -> Job:
    return launch([sys.executable, WORKER, scenario, "--out", out, *extra], world, out=out)


def cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return run_script(
        [sys.executable, "-m", "guardrails", *map(str, args)],
        timeout_s=60,
        env=base_env(),
        cwd=ROOT,
    )


def wait_for(what: str, ok, *, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + patience(timeout_s)
    while not ok():
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(0.2)


def remove_shared_memory(records: dict[int, dict]) -> None:
    """A killed job leaves its node folders in /dev/shm: the test's to remove."""
    for run_id in {rec.get("run_id") for rec in records.values()}:
        for path in Path("/dev/shm").glob(f"guardrails-live-{run_id}-node*"):
            shutil.rmtree(path, ignore_errors=True)


def line_of(tag: str) -> int:
    return next(i for i, text in enumerate(WORKER.read_text().splitlines(), 1) if tag in text)


@pytest.mark.slow(reason="a real 4-rank gloo job for ~15 s, top run three times")
def test_top_once_shows_every_rank_of_a_healthy_job_advancing(tmp_path):
    run = tmp_path / "run"
    # Two simulated nodes of two ranks: two node files, each by its node's lowest rank.
    args = ("--steps", "400", "--step-sleep-s", "0.05", "--ranks-per-node", "2")
    job = start("healthy", 4, tmp_path, *args)
    try:
        wait_for("snapshot of 4 ranks", lambda: len(live.read_snapshot(run)) == 4)
        first = cli("top", run, "--once", "--json")
        assert first.returncode == 0, first.stderr
        time.sleep(3.0)  # more than a node file's period (2 s)
        second = cli("top", run, "--once", "--json")
        text = cli("top", run, "--once")
        nodes = cli("top", run, "--once", "--per-rank-up-to", "2")
    finally:
        job.kill()
        remove_shared_memory(live.read_snapshot(run))
    a, b = json.loads(first.stdout), json.loads(second.stdout)
    assert [r["rank"] for r in a["ranks"]] == [r["rank"] for r in b["ranks"]] == [0, 1, 2, 3]
    for before, after in zip(a["ranks"], b["ranks"], strict=True):
        assert after["step"] > before["step"] > 0, (before, after)
        assert after["state"] == "running" and after["cpu"] is not None
        assert after["gpu"] is None  # on CPU: skipped cleanly
        assert after["step_time_s"] > 0.05 and set(after["phases"]) >= {"data", "other"}
    job_line = b["job"]
    assert job_line["ranks"] == 4 and job_line["running"] == 4 and job_line["nodes"] == 2
    assert sorted(p.name for p in live.node_files(run)) == ["node0.json", "node1.json"]
    # 32 tokens a batch on each rank, steps of ~0.05-0.1 s; a list of 400 batches: an ETA.
    assert job_line["tokens_per_s"] > 4 * 32 and job_line["eta_s"] > 0
    assert text.returncode == 0
    assert "job: 4 ranks on 2 node(s), 4 running" in text.stdout, text.stdout
    # Above --per-rank-up-to ranks: a row per node, the medians of its two ranks.
    rows = [ln.split() for ln in nodes.stdout.splitlines()[2:]]
    assert [r[:2] for r in rows[:2]] == [["node", "0"], ["node", "1"]], nodes.stdout
    assert nodes.stdout.count("2 ranks (median)") == 2, nodes.stdout
    assert len([ln for ln in text.stdout.splitlines() if "in the loop body" in ln]) >= 1


@pytest.mark.slow(reason="a real 5-rank gloo job stuck four ways, stacks and top against it")
def test_stacks_names_each_stuck_rank_and_its_line_grouped(tmp_path):
    run = tmp_path / "run"
    job = start("stuck", 5, tmp_path)
    try:
        stuck = [tmp_path / f"stuck{r}" for r in range(5)]
        wait_for("every rank stuck", lambda: all(p.exists() for p in stuck))
        time.sleep(2.5)  # a CPU share measured over the stuck span (the clock's 0.5 s+)
        asked = time.monotonic()
        answer = cli("stacks", run, "--json")
        took = time.monotonic() - asked
        text = cli("stacks", run)
        top = cli("top", run, "--once", "--json")
    finally:
        job.kill()
        remove_shared_memory(live.read_snapshot(run))
    assert answer.returncode == 0, answer.stdout + answer.stderr
    got = json.loads(answer.stdout)
    assert got["missing"] == [] and sorted(map(int, got["ranks"])) == [0, 1, 2, 3, 4]
    # Seen within a period, answered within the next two: well under the 15 s wait.
    assert got["took_s"] < 5.0 and took < patience(10.0), got["took_s"]
    cpu = {int(r): a["cpu"] for r, a in got["ranks"].items()}
    assert cpu[1] <= 0.05 and cpu[2] <= 0.05, cpu  # asleep: in Python and in C
    assert cpu[3] >= 0.1, cpu  # the straggler computes
    # Grouped by identical stacks: the two ranks in the collective are one line.
    lines = {ln.split(":", 1)[0].strip(): ln for ln in text.stdout.splitlines() if "rank " in ln}
    assert text.returncode == 0, text.stdout
    assert f"in all_reduce at live_worker.py:{line_of('LIVE-ALLREDUCE')}" in lines["rank 0,4"]
    assert f"at live_worker.py:{line_of('LIVE-SLEEP')} (stuck): time.sleep" in lines["rank 1"]
    assert f"at live_worker.py:{line_of('LIVE-CCALL')} (stuck): ctypes" in lines["rank 2"]
    assert f"at live_worker.py:{line_of('LIVE-SPIN')}" in lines["rank 3"]
    assert "(0% CPU)" in lines["rank 1"] and "(0% CPU)" in lines["rank 2"]
    # top says the same in its own terms: the straggler busy, the sleepers blocked.
    rows = {r["rank"]: r for r in json.loads(top.stdout)["ranks"]}
    assert rows[3]["cpu"] >= 0.1 and rows[1]["cpu"] <= 0.05
    assert "all_reduce" in rows[0]["where"]
    # The answers are a moment's: the command removed them.
    assert not list((run / live.LIVE_DIR / "stacks").glob("*/*.json"))


@pytest.mark.slow(reason="a real 2-rank gloo job that crashes, then report")
def test_report_shows_the_last_snapshot_of_a_crashed_run(tmp_path):
    job = start("raise", 2, tmp_path)
    results = job.wait(timeout_s=120, fail=False)
    assert [r.code for r in results] == [1, 1], [r.out[-2000:] for r in results]
    run = tmp_path / "run"
    report = cli("report", run, "--no-png")
    assert report.returncode == 0, report.stderr
    text = report.stdout.split("last snapshot of each rank", 1)
    assert len(text) == 2, report.stdout
    rows = {ln.split()[0]: ln for ln in text[1].splitlines()[2:] if ln.strip()}
    assert "failed: ValueError: boom: a bug on rank 1 only" in rows["1"]
    assert "failed: RankFailedError" in rows["0"], rows["0"]  # the diagnosis, not gloo's
    assert " 3 " in rows["1"]  # its step
    facts = json.loads(cli("report", run, "--no-png", "--json").stdout)
    snap = facts["last_snapshot"]
    assert [r["state"] for r in snap["ranks"]] == ["failed", "failed"]
    assert snap["job"]["running"] == 0 and snap["job"]["eta_s"] is None
    # Every rank closed: the last one removed the node's shared memory.
    run_id = snap["ranks"][0]["run_id"]
    assert not list(Path("/dev/shm").glob(f"guardrails-live-{run_id}-node*"))


@pytest.mark.slow(reason="a real torchrun job of 2 ranks under the store-call counter, ~20 s")
def test_a_watched_job_makes_no_store_call_for_the_live_view(tmp_path):
    """The live view is on in every distributed run and costs the store nothing: a
    healthy rank's calls stay the news poll's (benchmarks/store_calls.py counts every
    call on the real store), while its records reach run_dir/live/."""
    args = [sys.executable, BENCH, "--world", "2", "--scenarios", "steady"]
    args += ["--steady-s", "4", "--out", tmp_path]
    proc = subprocess.run(
        list(map(str, args)), capture_output=True, text=True, timeout=patience(300)
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "results.json").read_text())[0]
    for data in res["ranks"].values():
        table = data["phases"]["steady"]
        t0 = data["t0"]
        later = [t for p, t in t0.items() if t > t0["steady"]]
        secs = (min(later) if later else data["now"]) - t0["steady"]
        # The same owners as before the live view (the news poll, the stop/save
        # agreement, the auditor's records: tests/distributed/test_scale.py), and the
        # watchdog, which publishes the live view, still at no call of its own.
        owners = {k.split(".")[1] for k in table if k.startswith("store.")}
        assert owners <= {"news", "agree", "audit", "watchdog"}, table
        assert sum(v[0] for k, v in table.items() if k.startswith("store.watchdog")) / secs < 0.2
        assert sum(v[0] for k, v in table.items() if k.startswith("store.news")) / secs < 1.5
    nodes = list(tmp_path.rglob(f"{live.LIVE_DIR}/node*.json"))
    assert nodes, "the live view published nothing"
    records = json.loads(nodes[0].read_text())["ranks"]
    assert sorted(map(int, records)) == [0, 1]


@pytest.mark.slow(reason="a real single-process run for ~10 s, top twice, then report")
def test_a_single_process_run_shows_in_top_then_in_its_report(tmp_path):
    """The one-GPU run (``python train.py``: no torchrun, no process group) publishes
    the live view from its watchdog thread: a node of one rank, advancing in ``top``,
    and its last snapshot in the report once it finished."""
    run = tmp_path / "run"
    job = start("healthy", 1, tmp_path, "--steps", "150", "--step-sleep-s", "0.05")
    try:
        wait_for("a snapshot", lambda: live.read_snapshot(run))
        first = cli("top", run, "--once", "--json")
        time.sleep(3.0)  # more than the node file's period (2 s)
        second = cli("top", run, "--once", "--json")
        [result] = job.wait(timeout_s=120)
    finally:
        job.kill()
    assert result.code == 0, result.text[-2000:]
    assert first.returncode == second.returncode == 0, first.stdout + first.stderr
    [a], [b] = json.loads(first.stdout)["ranks"], json.loads(second.stdout)["ranks"]
    assert (a["rank"], a["node"], a["state"]) == (0, 0, "running"), a
    assert b["step"] > a["step"] > 0, (a, b)
    assert b["step_time_s"] > 0.05 and b["cpu"] is not None
    # A rank's goodput is unknown until two ticks saw steps (the first record said 0%).
    assert a["goodput"] is None or a["goodput"] > 0, a
    assert 0.3 < b["goodput"] <= 1.0, b  # 50 ms steps, sleeping: most of the wall time
    assert json.loads(second.stdout)["job"]["ranks"] == 1
    assert [p.name for p in live.node_files(run)] == ["node0.json"]
    report = cli("report", run, "--no-png", "--json")
    assert report.returncode == 0, report.stderr
    snap = json.loads(report.stdout)["last_snapshot"]
    assert [(r["state"], r["step"]) for r in snap["ranks"]] == [("closed", 150)], snap
    assert not list(Path("/dev/shm").glob(f"guardrails-live-{a['run_id']}-node*"))


@pytest.mark.slow(reason="a real single process stuck in a sleep, then stacks")
@pytest.mark.parametrize(
    ("alone_in", "tag", "call"),
    [("sleep", "LIVE-SLEEP", "time.sleep"), ("ccall", "LIVE-CCALL", "ctypes")],
)
def test_stacks_names_the_line_a_single_process_is_stuck_on(tmp_path, alone_in, tag, call):
    """Answered by the watchdog's thread while the main thread sleeps, in Python or in
    a C call."""
    run = tmp_path / "run"
    job = start("stuck", 1, tmp_path, "--alone-in", alone_in)
    try:
        wait_for("the process stuck", lambda: (tmp_path / "stuck0").exists())
        wait_for("a snapshot", lambda: live.read_snapshot(run))  # its first tick (1 s)
        answer = cli("stacks", run, "--json")
        text = cli("stacks", run)
    finally:
        job.kill()
        remove_shared_memory(live.read_snapshot(run))
    assert answer.returncode == 0, answer.stdout + answer.stderr
    got = json.loads(answer.stdout)
    assert got["missing"] == [] and list(got["ranks"]) == ["0"]
    assert got["ranks"]["0"]["threads"][0]["main"]
    assert text.returncode == 0, text.stdout
    want = f"rank 0: at live_worker.py:{line_of(tag)} (stuck): {call}"
    assert want in text.stdout, text.stdout


def test_rank_lists_are_cut_into_runs():
    assert ranges([0, 2, 3, 4, 7]) == "0,2-4,7"
    assert ranges([5]) == "5" and ranges([]) == ""


def test_a_rank_in_backward_is_in_ddps_all_reduce_only_under_ddp():
    """Where ``top`` and a hang's report say a rank is: a rank in backward waits in the
    gradients' all-reduce only when DDP wraps its model (a single GPU's run said so)."""
    from guardrails.guards.watchdog.records import _where

    plain = _where({"phase": "backward", "ddp": False})
    assert plain == "in backward, between forward and optimizer.step()"
    assert "DDP" in _where({"phase": "backward", "ddp": True})
