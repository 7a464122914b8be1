"""``@guardrails.record`` and ``_exit``: the error file torchrun reads, the summary, the
exit codes, faulthandler restored. Real files, real subprocesses for ``die``."""

from __future__ import annotations

import faulthandler
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import free_port, patience, read_events, run_script

import guardrails
from guardrails import _errors
from guardrails.engine.process import EXIT_CODES, code_for


def _raise(error: BaseException):
    @guardrails.record
    def main() -> None:
        raise error

    return main


def test_guardrails_error_goes_to_the_error_file_in_torchruns_schema(tmp_path, monkeypatch, capsys):
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    err = guardrails.HangError(
        "rank 1 is stuck at step 7", rank=0, step=7, hint="look at rank 1", stuck_ranks=[1]
    )
    before = int(time.time())
    with pytest.raises(SystemExit) as info:
        _raise(err)()
    assert info.value.code == 83
    data = json.loads(path.read_text())
    # torch's ErrorHandler.record_exception schema; ProcessFailure reads message and
    # extraInfo.timestamp, ChildFailedError shows extraInfo.py_callstack.
    msg = data["message"]
    assert msg["message"].startswith("HangError: [rank 0, step 7] rank 1 is stuck")
    extra = msg["extraInfo"]
    assert int(extra["timestamp"]) >= before
    # torchrun shows py_callstack for every failed rank: one line there (each rank
    # printed its whole report on its own stderr); the whole report stays in the file.
    assert extra["py_callstack"] == (
        "HangError (exit code 83): [rank 0, step 7] rank 1 is stuck at step 7 "
        "(the whole report is on rank 0's stderr above)"
    )
    assert "guardrails: rank 0 failed with HangError (exit code 83)" in extra["report"]
    assert "fix: look at rank 1" in extra["report"]
    assert extra["fields"] == {"stuck_ranks": [1]}
    assert (extra["error_class"], extra["exit_code"], extra["rank"]) == ("HangError", 83, 0)
    # torch's own reader accepts it and takes our text as the message.
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    failure = ProcessFailure(local_rank=0, pid=1, exitcode=83, error_file=str(path))
    assert failure.message["extraInfo"]["py_callstack"] == extra["py_callstack"]
    # One summary block on stderr, no traceback.
    err_text = capsys.readouterr().err
    assert err_text.count("guardrails: rank 0 failed with HangError") == 1
    assert "Traceback" not in err_text


def test_other_exceptions_keep_torchs_behaviour(tmp_path, monkeypatch):
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    with pytest.raises(KeyError, match="missing"):
        _raise(KeyError("missing"))()
    extra = json.loads(path.read_text())["message"]["extraInfo"]
    assert "Traceback (most recent call last)" in extra["py_callstack"]
    assert "KeyError" in extra["py_callstack"]


def test_without_torchrun_no_file_but_same_exit_code(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        _raise(guardrails.UnevenDataError("rank 1 ran out", rank=1, lengths={0: 5, 1: 4}))()
    assert info.value.code == 85
    assert list(tmp_path.iterdir()) == []
    assert "rank 1 failed with UnevenDataError" in capsys.readouterr().err


@pytest.mark.parametrize("enabled_before", [False, True])
def test_faulthandler_on_inside_and_restored_after(enabled_before):
    seen = []

    @guardrails.record
    def main() -> int:
        seen.append(faulthandler.is_enabled())
        return 7

    was = faulthandler.is_enabled()
    try:
        (faulthandler.enable if enabled_before else faulthandler.disable)()
        assert main() == 7
        assert seen == [True]
        assert faulthandler.is_enabled() is enabled_before
        with pytest.raises(SystemExit):
            _raise(guardrails.HangError("x"))()
        assert faulthandler.is_enabled() is enabled_before
    finally:
        (faulthandler.enable if was else faulthandler.disable)()


def test_clean_sys_exit_returns_like_torchs_record():
    @guardrails.record
    def main() -> None:
        sys.exit(0)

    assert main() is None


def test_one_distinct_exit_code_per_error_class():
    classes = [
        getattr(_errors, name)
        for name in dir(_errors)
        if isinstance(getattr(_errors, name), type)
        and issubclass(getattr(_errors, name), _errors.GuardrailsError)
    ]
    codes = {cls: code_for(cls("x")) for cls in classes}
    assert all(80 <= c <= 99 for c in codes.values())
    assert len(set(codes.values())) == len(codes), codes  # one per class
    assert code_for(ValueError("x")) == 1
    assert EXIT_CODES[guardrails.HangError] == 83


def test_die_from_a_thread_ends_a_stuck_process(tmp_path):
    """The last resort: the main thread blocked in a C call (a read nobody writes to),
    a thread calls die(): error file, summary, the error's exit code."""
    path = tmp_path / "error.json"
    code = (
        "import os, threading, time\n"
        "import guardrails\n"
        "from guardrails.engine.process import die\n"
        "err = guardrails.RankFailedError('rank 1 died', rank=0, step=3, failed_rank=1)\n"
        "threading.Timer(0.5, die, args=(err,)).start()\n"
        "r, w = os.pipe()\n"
        "os.read(r, 1)\n"
    )
    env = {"TORCHELASTIC_ERROR_FILE": str(path), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=patience(60)
    )
    assert proc.returncode == 84
    assert proc.stderr.count("guardrails: rank 0 failed with RankFailedError") == 1
    extra = json.loads(path.read_text())["message"]["extraInfo"]
    assert extra["fields"] == {"failed_rank": 1}


PREEMPTED = """
import os, signal, sys, torch
sys.path.insert(0, {tests!r})
from _loops import train_loop_signalled
from conftest import Regressor, batches
import guardrails

@guardrails.record
def main():
    torch.manual_seed(0)
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guardrails.guard(model, opt, batches(20), run_dir=sys.argv[1]) as g:
        train_loop_signalled(g, model, opt, after_step=5)

main()
"""


@pytest.mark.slow(reason="a training process, SIGTERMed")
def test_a_preemption_says_so_in_the_error_file(tmp_path):
    # torchrun shows the error file of a rank that exited non-zero as the root cause:
    # after a signal save that is what happened and what to do, not "To enable
    # traceback see ...".
    script = tmp_path / "train.py"
    script.write_text(PREEMPTED.format(tests=str(Path(__file__).resolve().parents[1])))
    error_file = tmp_path / "error.json"
    env = {**os.environ, "TORCHELASTIC_ERROR_FILE": str(error_file)}
    proc = run_script([sys.executable, script, tmp_path / "run"], timeout_s=120, env=env)
    assert proc.returncode == 143, proc.stderr
    msg = json.loads(error_file.read_text())["message"]
    assert msg["message"].startswith("pre-empted by SIGTERM at step 5: SIGTERM received")
    assert "checkpoints/step_000000005" in msg["message"]
    assert "run the same command" in msg["message"]
    assert msg["extraInfo"]["exit_code"] == 143


@pytest.mark.parametrize(
    "launch",
    [["-m", "guardrails", "run"], ["-m", "guardrails.run"], ["-m", "guardrails.run", "-m"]],
)
@pytest.mark.slow(reason="a training process per launcher")
def test_a_flat_script_runs_under_record_through_the_launcher(tmp_path, launch):
    # `python -m guardrails run SCRIPT`, `python -m guardrails.run SCRIPT` and its
    # `-m MODULE` form (torchrun ... -m guardrails.run -m scripts.base_train): the same
    # error file, summary and exit code as a decorated main().
    from test_loops import FLAT_SCRIPT  # a flat script; "nan": NonFiniteError at step 13

    (tmp_path / "flat_train.py").write_text(
        FLAT_SCRIPT.format(tests=str(Path(__file__).resolve().parents[1]))
    )
    target = "flat_train" if launch[-1] == "-m" else str(tmp_path / "flat_train.py")
    error_file = tmp_path / "error.json"
    env = {**os.environ, "TORCHELASTIC_ERROR_FILE": str(error_file)}
    proc = run_script(
        [sys.executable, *launch, target, str(tmp_path / "run"), "nan"],
        timeout_s=120,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 81, proc.stderr
    assert proc.stderr.count("failed with NonFiniteError (exit code 81)") == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    extra = json.loads(error_file.read_text())["message"]["extraInfo"]
    assert (extra["error_class"], extra["exit_code"]) == ("NonFiniteError", 81)
    events = read_events(tmp_path / "run")
    (end,) = [e for e in events if e["kind"] == "end"]
    assert end["error"].startswith("NonFiniteError")


@pytest.mark.slow(reason="a process importing torch")
def test_the_launcher_says_what_it_needs(tmp_path):
    proc = run_script(
        [sys.executable, "-m", "guardrails.run", str(tmp_path / "missing.py")], timeout_s=60
    )
    assert proc.returncode == 1 and "no such script" in proc.stderr and "usage:" in proc.stderr


# ---------------------------------------------------------------------- launch checks

LAUNCHED = """
import os, sys
import guardrails

@guardrails.record
def main():
    if os.environ.get("WORLD_SIZE", "1") != "1":
        import torch, torch.distributed as dist
        dist.init_process_group("gloo")
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == dist.get_world_size()
    print("main ran")

main()
"""

_LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_ERROR_FILE",
)


def _launch_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    return {**env, **extra}


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 but WORLD_SIZE=2"),
        ({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "4"}, "LOCAL_WORLD_SIZE=4 processes"),
        ({"RANK": "one"}, "RANK='one' is not an integer"),
    ],
    ids=["rank_past_world", "local_world_past_world", "not_an_integer"],
)
def test_record_stops_a_launch_that_cannot_work_before_main(tmp_path, bad, says):
    # Before main: no init_process_group has run, so the rendezvous would have waited
    # (for a rank that can never come) instead of failing.
    script = tmp_path / "train.py"
    script.write_text(LAUNCHED)
    error_file = tmp_path / "error.json"
    env = _launch_env(TORCHELASTIC_ERROR_FILE=str(error_file), **bad)
    proc = run_script([sys.executable, script], timeout_s=120, env=env)
    assert proc.returncode == 90, proc.stdout + proc.stderr
    assert "main ran" not in proc.stdout
    assert proc.stderr.count("failed with LaunchError (exit code 90)") == 1, proc.stderr
    assert says in proc.stderr and "fix: " in proc.stderr
    assert "Traceback" not in proc.stderr
    extra = json.loads(error_file.read_text())["message"]["extraInfo"]
    assert (extra["error_class"], extra["exit_code"]) == ("LaunchError", 90)


def test_record_is_silent_on_a_healthy_single_process_run(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(LAUNCHED)
    proc = run_script([sys.executable, script], timeout_s=120, env=_launch_env())
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "main ran\n" and proc.stderr == ""


@pytest.mark.slow(reason="torchrun and its 2 ranks")
def test_record_is_silent_on_a_healthy_torchrun_gloo_run(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(LAUNCHED)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            str(free_port()),
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=patience(180),
        env=_launch_env(OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("main ran") == 2
    assert "guardrails" not in proc.stderr and "LaunchError" not in proc.stderr, proc.stderr
