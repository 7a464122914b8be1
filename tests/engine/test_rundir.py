"""The run directory at the guard's start: a run_dir that cannot work is an error before
step one, and one run holds a run_dir at a time (an advisory lock the kernel releases
when its process dies). Real files, real processes, real SIGKILL."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _ranks import launch, patience
from conftest import Regressor, batches, train_loop

import guardrails
from guardrails.engine.rundir import LOCK_NAME

ROOT = Path(__file__).resolve().parents[2]


def _guarded(run_dir, n=2, **knobs):
    torch.manual_seed(0)
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    knobs = {"progress": False, "checkpoint": False, **knobs}
    with guardrails.guard(model, opt, batches(n), run_dir=run_dir, **knobs) as g:
        train_loop(g, model, opt)
    return g


# ------------------------------------------------------------------ a run_dir checked at start


@pytest.mark.parametrize("shape", ["file", "below_a_file"])
def test_a_run_dir_that_is_or_is_below_a_file_is_an_error_before_step_one(tmp_path, shape):
    afile = tmp_path / "exp1"
    afile.write_text("notes\n")
    run_dir = afile if shape == "file" else afile / "sub" / "run"
    trained = []
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(guardrails.LaunchError) as info:
        with guardrails.guard(model, opt, batches(2), run_dir=run_dir, progress=False) as g:
            trained.extend(g)
    err = info.value
    assert err.check == "run_dir" and not trained
    assert str(run_dir) in str(err)
    if shape == "file":
        assert "exists and is a file" in str(err)
    else:
        assert f"{str(afile)!r} above it is a file" in str(err)
    assert "guard(run_dir=...)" in err.hint
    assert afile.read_text() == "notes\n"  # untouched


def test_an_empty_run_dir_is_refused_where_it_is_passed(tmp_path):
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"guard\(run_dir=''\) is empty.*runs/exp1"):
        guardrails.guard(model, opt, batches(2), run_dir="")
    with pytest.raises(TypeError, match=r"run_dir=.*takes a path.*got int 5"):
        guardrails.guard(model, opt, batches(2), run_dir=5)


_UNWRITABLE = """
import sys, json
sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
import torch, guardrails
from conftest import Regressor, batches
model = Regressor(); opt = torch.optim.SGD(model.parameters(), lr=0.1)
try:
    with guardrails.guard(model, opt, batches(2), run_dir={run_dir!r}, progress=False) as g:
        for _ in g: pass
    print(json.dumps({{"started": True}}))
except guardrails.LaunchError as e:
    print(json.dumps({{"check": e.check, "message": str(e)}}))
"""


def _as_unprivileged() -> list[str] | None:
    """Where file modes apply: nothing for a user; for root, ``setpriv`` without the
    capabilities that bypass them; ``None`` when neither works."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        return None
    caps = "-dac_override,-dac_read_search"
    return ["setpriv", f"--bounding-set={caps}", f"--inh-caps={caps}"]


@pytest.mark.slow(reason="a process per case (file modes apply only without root's capabilities)")
def test_a_run_dir_or_parent_without_write_permission_is_an_error_naming_it(tmp_path):
    prefix = _as_unprivileged()
    if prefix is None:
        pytest.skip("running as root without setpriv(1): file modes are not enforced")
    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / "run").mkdir()
    locked.chmod(0o555)
    (locked / "run").chmod(0o555)
    try:
        for run_dir, named in [(locked / "new", locked), (locked / "run", locked / "run")]:
            script = _UNWRITABLE.format(
                root=str(ROOT), tests=str(ROOT / "tests"), run_dir=str(run_dir)
            )
            got = subprocess.run(
                [*prefix, sys.executable, "-c", script],
                capture_output=True,
                text=True,
                timeout=patience(60),
            )
            assert got.returncode == 0, got.stderr
            out = json.loads(got.stdout.strip().splitlines()[-1])
            assert out.get("check") == "run_dir", (run_dir, out, got.stderr)
            assert f"may not create files in {str(named)!r} (mode 555)" in out["message"]
    finally:
        (locked / "run").chmod(0o755)
        locked.chmod(0o755)


# ------------------------------------------------------------------ one run per run_dir

_HOLDER = """
import sys, time
sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
import torch, guardrails
from conftest import Regressor, batches
model = Regressor(); opt = torch.optim.SGD(model.parameters(), lr=0.1)
with guardrails.guard(model, opt, batches(2), run_dir={run_dir!r}, progress=False,
                      checkpoint=False) as g:
    print("holding", flush=True)
    time.sleep(600)
"""


def _hold(run_dir: Path) -> subprocess.Popen:
    script = _HOLDER.format(root=str(ROOT), tests=str(ROOT / "tests"), run_dir=str(run_dir))
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    line = proc.stdout.readline()  # blocks until the guard started (or the process died)
    if line.strip() != "holding":
        proc.kill()
        pytest.fail(f"the holder did not start: {line!r} {proc.stderr.read()}")
    return proc


_SECOND_JOB = """
import sys
sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
import torch, torch.distributed as dist, guardrails
from conftest import Regressor, batches
dist.init_process_group("gloo")
if dist.get_rank() == 0:  # rank 0 slow to take the lock: rank 1 must wait for its verdict
    import time
    from guardrails.engine import rundir
    _acquire = rundir.RunLock.acquire
    rundir.RunLock.acquire = lambda self, *a: (time.sleep(2), _acquire(self, *a))[1]
model = Regressor(); opt = torch.optim.SGD(model.parameters(), lr=0.1)
try:
    with guardrails.guard(model, opt, batches(2), run_dir={run_dir!r}, progress=False) as g:
        for _ in g: pass
    print("STARTED")
except guardrails.LaunchError as e:
    print("REFUSED", e.check, e.rank, str(e).replace(chr(10), " "))
dist.destroy_process_group()
"""


@pytest.mark.slow(reason="a holding process, a 2-rank job refused, a SIGKILL, then a run")
def test_a_second_run_on_a_held_run_dir_is_refused_and_a_killed_holder_leaves_no_lock(tmp_path):
    run_dir = tmp_path / "run"
    holder = _hold(run_dir)
    try:
        info = json.loads((run_dir / LOCK_NAME).read_text())
        assert info["pid"] == holder.pid
        # A second process (this one) is refused at once, naming the holder.
        t0 = time.monotonic()
        with pytest.raises(guardrails.LaunchError) as caught:
            _guarded(run_dir)
        assert time.monotonic() - t0 < patience(5)
        err = caught.value
        assert err.check == "run_dir_in_use"
        assert f"process {holder.pid} on host {info['host']}, since {info['since']}" in str(err)
        assert "another run_dir" in err.hint and "stop the other job" in err.hint
        # Not a word of the refused run in the holder's events.
        kinds = [json.loads(x)["kind"] for x in (run_dir / "events.jsonl").read_text().splitlines()]
        assert kinds == ["start"], kinds
        # A second job of 2 ranks: every rank refused with the same error (rank 1 hears
        # it from rank 0, which holds the job's lock), none hangs.
        script = tmp_path / "second_job.py"
        script.write_text(
            _SECOND_JOB.format(root=str(ROOT), tests=str(ROOT / "tests"), run_dir=str(run_dir))
        )
        with launch([sys.executable, str(script)], 2, out=tmp_path / "job") as job:
            ranks = job.wait(120)
        for r in ranks:
            assert r.code == 0, r.text
            assert f"REFUSED run_dir_in_use {r.rank} " in r.out, r.text
            assert f"process {holder.pid} on host" in r.out
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    # The kernel released the SIGKILLed holder's lock: the next run starts and trains.
    g = _guarded(run_dir, n=3)
    assert g.step == 3
    # ...and released its own at close: one more run in the same process starts too.
    assert _guarded(run_dir, n=1).step == 1
    assert json.loads((run_dir / LOCK_NAME).read_text())["pid"] == os.getpid()


def test_the_ranks_of_one_job_share_its_run_dir_and_sequential_runs_take_turns(tmp_path):
    # One process: guards one after another on one run_dir (a resume after a run).
    assert _guarded(tmp_path, n=2).step == 2
    assert _guarded(tmp_path, n=2).step == 2


def test_a_lock_file_that_cannot_be_opened_is_a_warning_not_a_refusal(tmp_path, caplog):
    # The lock protects; it never stops a run by itself failing: a lock path that is a
    # directory cannot be opened, and the run goes on, warned once.
    (tmp_path / LOCK_NAME).mkdir()
    caplog.set_level("WARNING", logger="guardrails")
    assert _guarded(tmp_path, n=2).step == 2
    said = [r.getMessage() for r in caplog.records if LOCK_NAME in r.getMessage()]
    assert len(said) == 1 and "goes on without that protection" in said[0], said
