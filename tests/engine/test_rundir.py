"""The run directory at the guard's start: a run_dir that cannot work is an error before
step one, and one run holds a run_dir at a time (an advisory lock the kernel releases
when its process dies). Real files, real processes, real SIGKILL."""

from __future__ import annotations

import contextlib
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
from conftest import Regressor, batches, events_path, read_events, train_loop

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
                      checkpoint={checkpoint!r}) as g:
    print("holding", flush=True)
    time.sleep(600)
"""


def _hold(run_dir: Path, checkpoint: dict | bool = False) -> subprocess.Popen:
    script = _HOLDER.format(
        root=str(ROOT), tests=str(ROOT / "tests"), run_dir=str(run_dir), checkpoint=checkpoint
    )
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
        kinds = [e["kind"] for e in read_events(run_dir)]
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


@pytest.mark.slow(reason="a holding process, a second run refused, a SIGKILL, then a run")
def test_two_runs_sharing_a_checkpoint_directory_are_refused(tmp_path):
    # Issue 52: two run_dirs with one checkpoint={"directory": ...} both trained, left
    # broken step_* directories, and the next resume continued whichever saved last.
    shared = tmp_path / "shared_ckpts"
    holder = _hold(tmp_path / "a", {"directory": str(shared)})
    try:
        with pytest.raises(guardrails.LaunchError) as caught:
            _guarded(tmp_path / "b", checkpoint={"directory": str(shared)})
        err = caught.value
        assert err.check == "run_dir_in_use"
        assert f"checkpoint directory {str(shared)!r} is in use by another run" in str(err)
        assert f"process {holder.pid} on host" in str(err)
        assert "another checkpoint directory" in err.hint
        assert not list(shared.glob("step_*"))  # the refused run saved nothing
        # ...and it left run_dir b free: its own lock was released with the refusal.
        assert _guarded(tmp_path / "b", n=1).step == 1
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    g = _guarded(tmp_path / "b", n=2, checkpoint={"directory": str(shared), "every_n_steps": 2})
    assert g.step == 2 and list(shared.glob("step_*"))
    # A checkpoint directory inside run_dir is run_dir's lock's: no second lock file.
    _guarded(tmp_path / "c", n=1, checkpoint={"directory": str(tmp_path / "c" / "ck")})
    assert not (tmp_path / "c" / "ck" / LOCK_NAME).exists()


def test_the_ranks_of_one_job_share_its_run_dir_and_sequential_runs_take_turns(tmp_path):
    # One process: guards one after another on one run_dir (a resume after a run).
    assert _guarded(tmp_path, n=2).step == 2
    assert _guarded(tmp_path, n=2).step == 2


def test_a_lock_file_that_cannot_be_opened_is_a_refusal_that_says_what_to_do(tmp_path):
    # Issue 52: as a warning, two jobs trained at once on a run.lock that was a
    # directory. Now nothing trains, and the error names the file and the fix.
    (tmp_path / LOCK_NAME).mkdir()
    with pytest.raises(guardrails.LaunchError) as caught:
        _guarded(tmp_path, n=2)
    err = caught.value
    assert err.check == "run_dir_lock"
    assert f"{tmp_path / LOCK_NAME} cannot be opened (it is a directory)" in str(err)
    assert "two jobs would train at once" in str(err)
    assert f"remove or rename {tmp_path / LOCK_NAME}" in err.hint
    assert read_events(tmp_path) == []  # not a word of the refused run
    (tmp_path / LOCK_NAME).rmdir()
    assert _guarded(tmp_path, n=2).step == 2


# ------------------------------------------------------------------ no link followed


@pytest.mark.parametrize("name", [LOCK_NAME, "events.jsonl", "node"])
def test_a_run_dir_whose_own_files_are_links_is_refused_and_the_target_untouched(tmp_path, name):
    # Issue 52: run.lock followed a symlink and truncated its target (as root: any file
    # on the machine); events appended through one.
    if name == "node":
        name = events_path(tmp_path / "run").name
    target = tmp_path / "precious"
    target.write_text("keep me\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / name).symlink_to(target)
    with pytest.raises(guardrails.LaunchError) as caught:
        _guarded(run_dir)
    err = caught.value
    assert err.check == "run_dir_link"
    assert f"{str(run_dir / name)!r} -> {str(target)!r}" in str(err)
    assert f"rm {run_dir / name}" in err.hint
    assert target.read_text() == "keep me\n"


def test_the_lock_is_never_opened_through_a_link_placed_after_the_check(tmp_path):
    # The check at start and the open are two moments: a link placed in between (a
    # race, or a run_dir another user can write) is refused by the open itself.
    from guardrails.engine.rundir import RunLock

    target = tmp_path / "precious"
    target.write_text("keep me\n")
    (tmp_path / LOCK_NAME).symlink_to(target)
    refusal = RunLock(tmp_path).acquire("r")
    assert refusal is not None and refusal.check == "run_dir_link"
    assert target.read_text() == "keep me\n"


def test_files_guardrails_creates_are_never_written_through_a_link(tmp_path):
    # Checkpoint files, last_failure.json, the write probe: util/files.open_new.
    import errno

    from guardrails.util import files

    target = tmp_path / "precious"
    target.write_text("keep me\n")
    (tmp_path / "made.json").symlink_to(target)
    with pytest.raises(OSError) as caught:
        files.write_text(tmp_path / "made.json", "{}")
    assert caught.value.errno == errno.ELOOP
    assert target.read_text() == "keep me\n"


# ------------------------------------------------------------------ forks and dead holders

_FORKING_HOLDER = """
import os, sys, time
sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
import torch, guardrails
from conftest import Regressor, batches
model = Regressor(); opt = torch.optim.SGD(model.parameters(), lr=0.1)
with guardrails.guard(model, opt, batches(2), run_dir={run_dir!r}, progress=False,
                      checkpoint=False) as g:
    lock = os.path.realpath({lock!r})
    def holds():
        return any(os.path.realpath(f"/proc/self/fd/" + fd) == lock
                   for fd in os.listdir("/proc/self/fd") if os.path.exists(f"/proc/self/fd/" + fd))
    def say(line):  # one write(2) per line: parent and child share the pipe, and print()
        os.write(1, (line + "\\n").encode())  # writes its pieces apart under PYTHONUNBUFFERED
    assert holds()
    if {how!r} == "fork":  # a DataLoader worker, multiprocessing's fork
        child = os.fork()
        if child == 0:
            say("child holds" if holds() else "child free")
            time.sleep(600)
            os._exit(0)
    else:  # a user's subprocess handed the descriptor past O_CLOEXEC
        import subprocess
        fd = next(int(fd) for fd in os.listdir("/proc/self/fd")
                  if os.path.realpath("/proc/self/fd/" + fd) == lock)
        child = subprocess.Popen(["sleep", "600"], pass_fds=(fd,)).pid
        say("child holds")
    say(f"child {{child}}")
    time.sleep(600)
"""


@pytest.mark.slow(reason="a holding process forks, is SIGKILLed, then a run")
@pytest.mark.parametrize("how", ["fork", "inherited"])
def test_a_child_of_a_killed_holder_does_not_keep_the_run_dir(tmp_path, how):
    # Issue 52: a child forked after the guard started kept the lock once its parent
    # was SIGKILLed: the relaunch was refused naming a dead process.
    run_dir = tmp_path / "run"
    script = _FORKING_HOLDER.format(
        root=str(ROOT),
        tests=str(ROOT / "tests"),
        run_dir=str(run_dir),
        lock=str(run_dir / LOCK_NAME),
        how=how,
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    # Two lines, from the parent and (forked) the child, in either order.
    lines = [proc.stdout.readline().strip() for _ in range(2)]
    pids = [ln.split()[1] for ln in lines if ln.startswith("child ") and ln.split()[1].isdigit()]
    said = [ln for ln in lines if ln in ("child holds", "child free")]
    if len(pids) != 1 or len(said) != 1:
        proc.kill()
        pytest.fail(f"the holder did not fork: {lines!r} {proc.stderr.read()}")
    child = int(pids[0])
    try:
        # A forked child closed its copy at fork; a child handed it still holds it.
        assert said == ["child free" if how == "fork" else "child holds"]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        os.kill(child, 0)  # the child outlived its parent
        g = _guarded(run_dir, n=2)
        assert g.step == 2
        assert json.loads((run_dir / LOCK_NAME).read_text())["pid"] == os.getpid()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
        proc.kill()
        proc.wait(timeout=30)


def test_a_live_holder_forking_still_holds_the_run_dir(tmp_path):
    # The fork hook closes only the child's copy: the parent keeps the lock.
    from guardrails.engine.rundir import RunLock

    lock = RunLock(tmp_path)
    assert lock.acquire("r") is None
    child = os.fork()
    if child == 0:
        os._exit(0)
    os.waitpid(child, 0)
    try:
        refusal = RunLock(tmp_path).acquire("s")
        assert refusal is not None and refusal.check == "run_dir_in_use"
        assert f"process {os.getpid()} on host" in refusal.message
    finally:
        lock.release()


# ------------------------------------------------------------------ a run_dir deleted mid-run


def test_a_run_dir_deleted_mid_run_is_said_once_and_its_events_go_on(tmp_path, caplog):
    # Issue 52: the run trained on while its events and its lock silently vanished.
    run_dir = tmp_path / "parent" / "run"
    caplog.set_level("WARNING", logger="guardrails")
    torch.manual_seed(0)
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guardrails.guard(
        model, opt, batches(6), run_dir=run_dir, progress=False, checkpoint=False
    ) as g:
        for i, (x, y) in enumerate(g):
            if i == 2:
                shutil.rmtree(tmp_path / "parent")
            if i >= 2:
                g.event("custom", message=f"after the deletion {i}")
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    assert g.step == 6
    said = [
        r.getMessage()
        for r in caplog.records
        if "was deleted while the run trains" in r.getMessage()
    ]
    assert len(said) == 1, said
    assert "run.lock that kept other runs out of this run_dir is gone" in said[0]
    kinds = [e["kind"] for e in read_events(run_dir)]
    assert kinds[0] == "run_dir_deleted" and kinds.count("custom") == 3 and kinds[-1] == "end"
