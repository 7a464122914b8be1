"""A job restarted by torchrun (``--max-restarts``), as users run it (issue 50, row 3).

The real launcher, real gloo ranks, a real hang, a real SIGKILL: the restarted attempt
connects (its rendezvous is its own, ``distributed/attempt.py``), does not die of the
verdict the attempt before left in the agent's store (``store.side_store``), a survivor
dates a dead peer's death by its own step, and a failure no restart can fix is refused
at once on the restart that follows it (``engine/last_failure.py``).
"""

from __future__ import annotations

import itertools
import json
import re
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from _ranks import free_port, launch, launch_torchrun
from conftest import read_events

from guardrails import CollectiveMismatchError, RankFailedError
from guardrails.distributed import attempt
from guardrails.distributed.store import News, claim_verdict
from guardrails.engine import last_failure

HERE = Path(__file__).resolve()
WORKER = HERE.parents[1] / "restart_worker.py"


def _torchrun(tmp_path: Path, fault: str, *, restarts: int, timeout_s: float = 150.0, **env: str):
    """torchrun --standalone --max-restarts ``restarts`` of the worker: its result and
    how long it ran."""
    env = {"RUN_DIR": str(tmp_path / "run"), "FAULT": fault, **env}
    args = ["--max-restarts", str(restarts), WORKER]
    t0 = time.monotonic()
    with launch_torchrun(args, out=tmp_path / "torchrun", env=env) as job:
        result = job.wait(timeout_s)[0]
    return result, time.monotonic() - t0


@pytest.mark.slow(reason="torchrun, 2 ranks, a 5 s hang, then a restart")
def test_a_hang_then_the_restarted_attempt_connects_and_finishes(tmp_path):
    result, _ = _torchrun(tmp_path, "hang", restarts=1)
    text = result.out + result.err
    # Attempt 0: both ranks name the hang of rank 1 ...
    for rank in (0, 1):
        assert f"guardrails: rank {rank} failed with HangError (exit code 83)" in text, text[-4000:]
    assert "rank 1 is stuck at step 20" in text
    assert "a restart can fix this" in text
    # ... attempt 1 connects (no "connectFullMesh failed"), is not ended by attempt 0's
    # verdict (the restart died of it at step 11), and trains to the end.
    # (It starts at step 0, or where attempt 0's failure save left it.)
    assert re.search(r"attempt 1: start at step \d+", text), text[-4000:]
    assert "attempt 1: done at step 40" in text, text[-4000:]
    assert result.code == 0, text[-4000:]
    assert "connectFullMesh" not in text


@pytest.mark.slow(reason="torchrun, 2 ranks, a SIGKILL, then a restart")
def test_a_dead_rank_is_dated_by_the_survivors_step(tmp_path):
    result, _ = _torchrun(tmp_path, "kill", restarts=1)
    text = result.out + result.err
    assert result.code == 0, text[-4000:]  # the restart trains to the end
    # The survivor's report says the step rank 1 died in, not its first heartbeat's: from
    # its own all-reduce it waits in, or, when its watchdog saw the pid gone before this
    # rank reached that all-reduce (2 loaded cores), as the step this rank is at.
    dated = ("rank 1 died during step 20 (this rank was waiting for it", "this rank is at step 20")
    assert any(d in text for d in dated), text[-4000:]
    # Its start's record is never told as its step (it said "was at step 0"): "no heartbeat
    # after its start", or the heartbeat it sent when a slow first step made a rank suspect.
    assert "was at step 0" not in text, text[-4000:]
    said = ("it sent no heartbeat after its start", "its last heartbeat, ")
    assert any(s in text for s in said), text[-4000:]
    events = json.dumps(read_events(tmp_path / "run"))
    assert any(d in events for d in dated)  # the end event of rank 0's run


@pytest.mark.slow(reason="torchrun, 2 ranks, a desync, up to 3 attempts")
def test_an_unfixable_failure_is_refused_on_the_restart_at_once(tmp_path):
    # 0.6 s a step: attempt 0 trains ~12 s before the desync, as a real run trains
    # minutes; a refused restart must cost none of it.
    result, _ = _torchrun(tmp_path, "desync", restarts=2, STEP_SLEEP_S="0.6")
    ended = time.time()
    text = result.out + result.err
    assert result.code != 0
    # Attempt 0 fails with the desync on both ranks; each restart refuses it, same class
    # and code. In a restart the first rank to refuse ends the attempt: torchrun then
    # SIGTERMs the other, which on a loaded machine may still be importing torch (CI, 2
    # cores: rank 0 was killed before its first line in both restarts), so each restart
    # is said by at least one rank, and torchrun's own report names exit code 82.
    assert text.count("failed with CollectiveMismatchError (exit code 82)") >= 4, text[-6000:]
    assert text.count("this failure recurs on every restart; fix it and relaunch") >= 2
    assert re.search(r"exitcode\s*: 82", text), text[-3000:]
    assert "attempt 1: start" not in text and "attempt 2: start" not in text
    assert "a restart will fail the same way" in text
    record = json.loads((tmp_path / "run" / last_failure.FILE_NAME).read_text())
    assert record["error_class"] == "CollectiveMismatchError" and record["exit_code"] == 82
    assert record["restartable"] is False and record["first_restart_count"] == 0
    # The restarts cost their start only: far less than attempt 0, which trained 20
    # steps and named the desync (measured on 2 busy cores: attempt 0 ~22 s, each
    # refused restart 6-10 s: the interpreter, torch's import, torchrun's rendezvous).
    launched = [float(line.split()[-1]) for line in text.splitlines() if "launched attempt" in line]
    assert len(launched) == 3, text[-3000:]
    attempt0, *refusals = [b - a for a, b in itertools.pairwise([*launched, ended])]
    assert max(refusals) < attempt0 - 6, (attempt0, refusals)  # none of the 12 s trained
    assert sum(refusals) < attempt0, (attempt0, refusals)  # all: below 2x one attempt


# ----------------------------------------------------------------- a store reused


def _side(store: dist.Store, monkeypatch: pytest.MonkeyPatch, restart: str, name: str):
    """Generation 0's side store ``name`` of attempt ``restart``, as its ranks see it:
    under the prefixes torch gives the default process group's store (``default_pg``,
    then the group's name, ``0``; the control case fails if they change)."""
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", restart)
    monkeypatch.setenv("GROUP_WORLD_SIZE", "1")
    default = dist.PrefixStore("0/", dist.PrefixStore("default_pg", store))
    return dist.PrefixStore(f"guardrails/{attempt.key_prefix()}g0/{name}/", default)


def _plant_verdict(store: dist.Store, monkeypatch: pytest.MonkeyPatch, restart: str) -> None:
    """Leave in ``store`` what attempt ``restart``'s watchdog leaves there when it
    claims a hang: rank 1's verdict, the news counter moved."""
    verdict = {
        "cls": "HangError",
        "message": "no progress for 5 s: rank 1 is stuck at step 19 (planted)",
        "hint": "a verdict an earlier attempt left in the store",
        "fields": {"stuck_ranks": [1]},
        "by": 1,
    }
    assert claim_verdict(_side(store, monkeypatch, restart, "watchdog"), verdict)
    News(_side(store, monkeypatch, restart, "news"), world=2).post(verdict=True)


@pytest.mark.parametrize("restart", ["1", "0"])
@pytest.mark.slow(reason="2 ranks (gloo) against one store")
def test_a_verdict_left_by_the_attempt_before_is_not_news(tmp_path, monkeypatch, restart):
    """The store of torchrun's agent outlives an attempt; here the test hosts it and
    plants attempt 0's hang verdict, then starts 2 ranks as clients of it, as torchrun's
    workers are (``TORCHELASTIC_USE_AGENT_STORE``), their process group made outside
    ``@guardrails.record`` (no namespaced rendezvous): only the side store's attempt
    prefix keeps the old verdict from them. Once they train, the test moves their news
    counter (any rank's news does: a peer's end, a request for heartbeats), so each
    rank looks for a verdict: as attempt 1 they find none and train to the end; as
    attempt 0 again (the control), the planted one ends them."""
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    _plant_verdict(server, monkeypatch, "0")
    env = {
        "RECORD": "0",
        "STEP_SLEEP_S": "0.1",
        "RUN_DIR": str(tmp_path / "run"),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": restart,
        "TORCHELASTIC_RUN_ID": "test",
        "GROUP_WORLD_SIZE": "1",
    }
    with launch([sys.executable, WORKER], out=tmp_path, env=env, port=port) as job:
        deadline = time.monotonic() + 60
        while "start at step" not in (tmp_path / "rank0.out").read_text():
            assert time.monotonic() < deadline and not job.poll()
            time.sleep(0.1)
        News(_side(server, monkeypatch, restart, "news"), world=2).post()
        results = job.wait(60)
    text = "".join(r.out for r in results)
    if restart == "1":
        assert [r.code for r in results] == [0, 0], text[-4000:]
        assert "attempt 1: done at step 40" in text
    else:
        assert all(r.code != 0 for r in results), text[-4000:]
        assert "(planted)" in text
    del server


# ----------------------------------------------------------------- the handlers


def test_the_rendezvous_handlers_are_put_back(monkeypatch):
    """Inside, env:// and tcp:// yield a store of this attempt's own; outside, torch's
    handlers are back, the very objects (and nested, one prefix, not two)."""
    import importlib

    handlers = importlib.import_module("torch.distributed.rendezvous")._rendezvous_handlers
    before = dict(handlers)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "1")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # a client, as a worker
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    with attempt.namespaced_rendezvous():
        inside = dict(handlers)
        with attempt.namespaced_rendezvous():
            assert dict(handlers) == inside
        store, _, _ = next(
            dist.rendezvous(f"tcp://127.0.0.1:{port}?rank=0&world_size=1", timeout=_td(10))
        )
        store.set("k", "v")
    assert handlers == before and all(handlers[s] is before[s] for s in before)
    assert inside["env"] is not before["env"] and inside["tcp"] is not before["tcp"]
    assert server.check(["guardrails-attempt3/k"]) and not server.check(["k"])
    del server


def test_across_nodes_the_attempt_is_not_guessed(monkeypatch):
    # Two agents count restarts each their own way: no prefix, no wrapped handler.
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    assert attempt.number() is None and attempt.key_prefix() == ""
    monkeypatch.setenv("GROUP_WORLD_SIZE", "1")
    assert attempt.key_prefix() == "attempt1/"
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    assert attempt.key_prefix() == ""


def _td(seconds: float):
    from datetime import timedelta

    return timedelta(seconds=seconds)


def test_a_scripts_module_level_init_under_guardrails_run_is_namespaced(tmp_path):
    """``python -m guardrails.run SCRIPT``: the script's init_process_group at module
    level runs inside @record, so its store is this attempt's own too."""
    script = tmp_path / "flat.py"
    script.write_text(
        "import torch.distributed as dist\n"
        'dist.init_process_group("gloo")\n'
        'dist.distributed_c10d._get_default_store().set("probe", "1")\n'
        "dist.destroy_process_group()\n"
    )
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    env = {
        **{"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"},
        **{"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": "2",
        "TORCHELASTIC_RUN_ID": "test",
        "GROUP_WORLD_SIZE": "1",
    }
    cmd = [sys.executable, "-m", "guardrails.run", script]
    with launch(cmd, 1, out=tmp_path / "out", env=env, port=port) as job:
        (result,) = job.wait(60)
    assert result.code == 0, result.out[-3000:]
    # Under the attempt's prefix, then torch's own for the default group (default_pg, 0).
    ours = dist.PrefixStore("guardrails-attempt2", server)
    assert dist.PrefixStore("0/", dist.PrefixStore("default_pg", ours)).check(["probe"])
    assert not dist.PrefixStore("0/", dist.PrefixStore("default_pg", server)).check(["probe"])
    del server


# ----------------------------------------------------------------- last_failure.json


def _desync() -> CollectiveMismatchError:
    return CollectiveMismatchError("rank 0 issued a barrier", rank=0, step=20, hint="fix it")


def _job(monkeypatch: pytest.MonkeyPatch, run_id: str, restart: int) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", run_id)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(restart))
    monkeypatch.delenv(last_failure.RETRY_ENV, raising=False)


def test_the_restart_of_the_same_job_refuses_a_requeue_warns(tmp_path, monkeypatch, caplog):
    _job(monkeypatch, "job1", 0)
    last_failure.write(_desync(), exit_code=82, run_dir=tmp_path)
    # The next attempt of job1: the same class, its exit code, the original words.
    _job(monkeypatch, "job1", 1)
    with pytest.raises(CollectiveMismatchError) as refused:
        last_failure.check_at_start(tmp_path, 1)
    text = str(refused.value)
    assert "rank 0 issued a barrier" in text and "recurs on every restart" in text
    assert last_failure.RETRY_ENV in text and str(tmp_path / last_failure.FILE_NAME) in text
    # The refusal is recorded with its attempt: the restart after it refuses too.
    last_failure.write(refused.value, exit_code=82, run_dir=tmp_path)
    record = json.loads((tmp_path / last_failure.FILE_NAME).read_text())
    assert record["restart_count"] == 1 and record["first_restart_count"] == 0
    assert record["message"] == "rank 0 issued a barrier" and record["step"] == 20
    _job(monkeypatch, "job1", 2)
    with pytest.raises(CollectiveMismatchError):
        last_failure.check_at_start(tmp_path, 0)
    # A new job (a requeue) starts, warned; so does a retry asked for.
    _job(monkeypatch, "job2", 0)
    last_failure.check_at_start(tmp_path, 0)
    assert "a failure a restart does not fix" in caplog.text and "new launch" in caplog.text
    _job(monkeypatch, "job1", 3)
    monkeypatch.setenv(last_failure.RETRY_ENV, "1")
    last_failure.check_at_start(tmp_path, 0)
    last_failure.forget()


def test_a_restartable_failure_does_not_hide_the_unfixable_one(tmp_path, monkeypatch):
    # Rank 1's desync, then the survivor's "rank 1 died" of the same attempt.
    _job(monkeypatch, "job1", 0)
    last_failure.write(_desync(), exit_code=82, run_dir=tmp_path)
    last_failure.write(RankFailedError("rank 1 died", rank=0), exit_code=84, run_dir=tmp_path)
    record = json.loads((tmp_path / last_failure.FILE_NAME).read_text())
    assert record["error_class"] == "CollectiveMismatchError"
    # A restartable failure of a later attempt replaces it; the restart then runs.
    _job(monkeypatch, "job1", 1)
    last_failure.write(RankFailedError("rank 1 died", rank=0), exit_code=84, run_dir=tmp_path)
    _job(monkeypatch, "job1", 2)
    last_failure.check_at_start(tmp_path, 0)
    last_failure.forget()


def test_a_main_that_returns_clears_the_record(tmp_path, monkeypatch):
    from guardrails.engine.record import record

    _job(monkeypatch, "job1", 0)
    last_failure.write(_desync(), exit_code=82, run_dir=tmp_path)

    @record
    def main() -> None:
        last_failure.check_at_start(tmp_path, 0)  # what a guard's start does

    main()
    assert not (tmp_path / last_failure.FILE_NAME).exists()
