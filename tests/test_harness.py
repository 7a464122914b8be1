"""The test harness's own promises: its waits stretch with the machine's load and
GUARDRAILS_TEST_PATIENCE, and a rank that never ends still fails the test (killed,
named), however patient the wait; ``spawn``'s ranks, forked from a fork server that
imported torch once, get what a spawned process gets: the caller's environment, working
directory and ``sys.path`` at the call, a process of their own, their output shown."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from _ranks import MAX_STRETCH, PATIENCE_VAR, launch, patience, spawn


def test_patience_multiplies_by_the_env_var_and_never_shrinks_with_load(monkeypatch):
    monkeypatch.delenv(PATIENCE_VAR, raising=False)
    assert patience(10) >= 10  # the load only stretches
    monkeypatch.setenv(PATIENCE_VAR, "3")
    before = os.getloadavg()[0]
    got = patience(10)
    after = os.getloadavg()[0]
    per_core = [
        min(MAX_STRETCH, max(1.0, load / (os.cpu_count() or 1))) for load in (before, after)
    ]
    assert 30 * min(per_core) <= got <= 30 * max(per_core)  # the load per core, read now
    assert got <= 30 * MAX_STRETCH  # a hung test still fails, at most 4x later
    for bad in ("0", "-1", "soon"):
        monkeypatch.setenv(PATIENCE_VAR, bad)
        with pytest.raises(ValueError, match=PATIENCE_VAR):
            patience(10)


def test_a_rank_that_never_ends_still_fails_the_wait(tmp_path, monkeypatch):
    monkeypatch.setenv(PATIENCE_VAR, "0.01")  # 60 s of patience: 0.6 s idle, more if busy
    job = launch([sys.executable, "-c", "import time; time.sleep(600)"], 1, out=tmp_path)
    with job, pytest.raises(pytest.fail.Exception, match=r"still running after .* \[0\]"):
        job.wait(60)
    assert all(p.returncode == -9 for p in job.procs)  # killed, not left running


def _report(rank: int, out: str, fail_rank: int) -> None:
    print(f"rank {rank} says hello", flush=True)
    seen = {"pid": os.getpid(), "cwd": os.getcwd(), "mark": os.environ.get("SPAWN_MARK")}
    seen["path"] = sys.path[:2]
    (Path(out) / f"seen{rank}.json").write_text(json.dumps(seen))
    if rank == fail_rank:
        raise ValueError(f"rank {rank} fails on purpose")


def test_spawned_ranks_get_the_callers_environment_and_directory_at_the_call(
    tmp_path, monkeypatch, capfd
):
    # Set after the fork server may have started (an earlier test in this worker): a
    # rank forked from it must still see them, as a spawned process would.
    monkeypatch.setenv("SPAWN_MARK", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    spawn(_report, (str(tmp_path), -1))
    seen = [json.loads((tmp_path / f"seen{r}.json").read_text()) for r in (0, 1)]
    assert [s["mark"] for s in seen] == [str(tmp_path)] * 2
    assert [s["cwd"] for s in seen] == [str(tmp_path)] * 2
    assert all(s["path"][0] == str(tmp_path) for s in seen)
    assert len({os.getpid(), *(s["pid"] for s in seen)}) == 3  # processes of their own
    err = capfd.readouterr().err
    assert "rank 0 says hello" in err and "rank 1 says hello" in err


def test_a_spawned_rank_that_raises_fails_the_test_with_its_traceback(tmp_path, capfd):
    import torch.multiprocessing as mp

    with pytest.raises(mp.ProcessRaisedException, match="rank 1 fails on purpose"):
        spawn(_report, (str(tmp_path), 1))
    assert "rank 1 says hello" in capfd.readouterr().err  # its output is still shown


def _sleep(rank: int) -> None:
    import time

    time.sleep(600)


def test_a_spawned_rank_that_never_ends_still_fails_the_test(monkeypatch):
    monkeypatch.setenv(PATIENCE_VAR, "0.01")  # 60 s of patience: 0.6 s idle, more if busy
    with pytest.raises(pytest.fail.Exception, match="ranks still running after .*: a hang"):
        spawn(_sleep, (), deadline_s=60)
