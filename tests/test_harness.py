"""The test harness's own promises: its waits stretch with the machine's load and
GUARDRAILS_TEST_PATIENCE, and a rank that never ends still fails the test (killed,
named), however patient the wait; ``spawn``'s ranks, forked from a fork server that
imported torch once, get what a spawned process gets: the caller's environment, working
directory and ``sys.path`` at the call, a process of their own, their output shown; a
``python SCRIPT`` forked from the script fork server is what a fresh ``python SCRIPT``
is, to what the script can see."""

from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path

import pytest
from _ranks import (
    FORKSERVER_VAR,
    MAX_STRETCH,
    PATIENCE_VAR,
    ForkServer,
    base_env,
    launch,
    patience,
    run_script,
    spawn,
)


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


#: What a process can see of how it was started, then its end: ``exit CODE``,
#: ``raise``, ``sigterm`` (the default action: death by SIGTERM), ``open`` (a file left
#: open and unflushed, which the interpreter's exit flushes).
PROBE = """
import faulthandler, json, os, resource, signal, sys, threading
seen = {
    "name": __name__, "file": globals().get("__file__"), "argv": sys.argv, "path": sys.path,
    "cwd": os.getcwd(), "mark": os.environ.get("PROBE_MARK"), "stdin": sys.stdin.read(),
    "session": os.getsid(0) == os.getpid(), "group": os.getpgid(0) == os.getpid(),
    "signals": {s.name: str(signal.getsignal(s)) for s in signal.Signals
                if s not in (signal.SIGKILL, signal.SIGSTOP)},
    "blocked": sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])),
    "faulthandler": faulthandler.is_enabled(), "threads": len(os.listdir("/proc/self/task")),
    "buffered": sys.stdout.line_buffering, "umask": os.umask(0o22),
    "core": resource.getrlimit(resource.RLIMIT_CORE), "cpus": sorted(os.sched_getaffinity(0)),
    "main_thread": threading.main_thread().native_id == threading.get_native_id() == os.getpid(),
}
print(json.dumps(seen))
print(os.getppid())
how = sys.argv[1]
if how == "exit":
    sys.exit(3)
if how == "raise":
    raise ValueError("on purpose")
if how == "sigterm":
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGTERM)
if how == "open":
    kept = open(sys.argv[2], "w")
    kept.write("flushed at exit")
"""


@pytest.mark.parametrize("how", ["exit", "raise", "sigterm", "open"])
def test_a_forked_script_is_what_a_fresh_python_script_is(tmp_path, monkeypatch, how):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    monkeypatch.setenv("PROBE_MARK", how)  # set after the server may have started
    monkeypatch.delenv(FORKSERVER_VAR, raising=False)
    # Inherited from the test's process as it is at the launch: a umask, a core limit.
    umask = os.umask(0o027)
    core = resource.getrlimit(resource.RLIMIT_CORE)
    resource.setrlimit(resource.RLIMIT_CORE, (0, core[1]))
    try:
        runs = _probe_both_ways(tmp_path, script, how)
    finally:
        os.umask(umask)
        resource.setrlimit(resource.RLIMIT_CORE, core)
    (seen, forked_parent), (fresh_seen, fresh_parent) = [
        runs[fresh].out.splitlines()[:2] for fresh in (False, True)
    ]
    server = ForkServer.for_env(base_env()).proc.pid  # launch()'s environment
    assert [forked_parent, fresh_parent] == [str(server), str(os.getpid())]
    assert json.loads(seen) == json.loads(fresh_seen)
    assert json.loads(seen)["umask"] == 0o027 and json.loads(seen)["core"][0] == 0
    assert json.loads(seen)["main_thread"]  # its thread ids are its own
    forked, real = runs[False], runs[True]
    assert forked.code == real.code == {"exit": 3, "raise": 1, "sigterm": -15, "open": 0}[how]
    assert forked.err == real.err  # the same traceback, none of the server's frames


def _probe_both_ways(tmp_path: Path, script: Path, how: str) -> dict:
    runs, kept = {}, tmp_path / "kept.txt"
    argv = [sys.executable, script, how, kept]
    # Its own module search path (an empty entry and a relative one included).
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), "", "rel/"])}
    for fresh in (False, True):
        out = tmp_path / f"fresh{fresh}"
        with launch(argv, 1, out=out, env=env, merge=False, fresh=fresh) as job:
            [runs[fresh]] = job.wait(60)
        if how == "open":
            assert kept.read_text() == "flushed at exit", f"fresh={fresh}"
            kept.unlink()
    return runs


def test_script_processes_are_forked_from_the_server_unless_asked_otherwise(tmp_path, monkeypatch):
    code = "import os, sys; print(os.getppid(), 'torch' in sys.modules, hash('guardrails'))"
    argv = [sys.executable, "-c", code]
    monkeypatch.delenv(FORKSERVER_VAR, raising=False)
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    server = ForkServer.get().proc.pid
    forked = run_script(argv, timeout_s=60).stdout.split()
    assert forked[:2] == [str(server), "True"]  # torch came with the fork
    fresh = run_script(argv, timeout_s=60, fresh=True).stdout.split()
    assert fresh[:2] == [str(os.getpid()), "False"]
    monkeypatch.setenv(FORKSERVER_VAR, "0")  # the developer's way out, for every launch
    assert run_script(argv, timeout_s=60).stdout.split()[:2] == fresh[:2]
    # A variable read at start-up: a server of its own, started with it.
    monkeypatch.setenv(FORKSERVER_VAR, "1")
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    seeded = run_script(argv, timeout_s=60).stdout.split()
    other = ForkServer.get().proc.pid
    assert other != server and seeded[:2] == [str(other), "True"]
    assert seeded[2] == run_script(argv, timeout_s=60, fresh=True).stdout.split()[2]
    monkeypatch.delenv("PYTHONHASHSEED")
    assert run_script(argv, timeout_s=60).stdout.split()[0] == str(server)  # still there
