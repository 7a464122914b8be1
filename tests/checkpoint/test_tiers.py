"""The node-local checkpoint tier (``checkpoint={"local_directory": ...}``): saves commit
there first and are drained into ``run_dir/checkpoints``; a resume takes the newest valid
copy of either tier, the local one first at the same step.

Real files, real processes: a drain cut by a real SIGKILL (``GUARDRAILS_TEST_CRASH_AT``
at the point between the files and the manifest), a tier too small on a real tmpfs of
4 MB (a user namespace's mount), two gloo ranks stopped by a real SIGTERM.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _ranks import run_ranks, run_script
from conftest import Regressor, assert_state_equal, batches, read_events

import guardrails
from guardrails.checkpoint.common import CRASH_ENV
from guardrails.checkpoint.manifest import MANIFEST, list_checkpoints, problem
from guardrails.cli.inspect import inspect_dir

TESTS = Path(__file__).resolve().parents[1]
WORKER = TESTS / "ckpt_worker.py"
TMPFS = 'mount -t tmpfs -o size=4m tmpfs "$1" && shift && exec "$@"'


def train(
    run_dir: str | Path,
    local: str | Path,
    n: int,
    *,
    every: int | None,
    width: int = 8,
    local_keep_last: int = 1,
    sigterm_at: int = 0,
    grace_s: float = 30.0,
    fail_at: int = 0,
) -> dict:
    """A seeded Regressor trained with AdamW to step ``n`` under a guard whose saves
    (every ``every`` steps) go through the local tier ``local``: its state at the end.
    ``sigterm_at``: a real SIGTERM after that step (the loop then ends after the
    stop's save); ``fail_at``: a ``ValueError`` at the top of the step after that one
    (the failure save's case). Also run in a child process (:func:`_train_in_child`)."""
    torch.manual_seed(0)
    model = Regressor(width=width)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    knobs = {
        "every_n_steps": every,
        "keep_last": 3,
        "strict_cadence": True,  # every save is made: the tiers' contents are known
        "local_directory": local,
        "local_keep_last": local_keep_last,
        "grace_s": grace_s,
        "exit_on_signal": False,
    }
    with guardrails.guard(
        model, opt, batches(n), run_dir=run_dir, checkpoint=knobs, progress=False, gc=False
    ) as g:
        for x, y in g:
            if fail_at and g.step == fail_at:
                raise ValueError(f"boom after step {fail_at}")
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
            if g.step == sigterm_at:
                os.kill(os.getpid(), signal.SIGTERM)
    return {"step": g.step, "model": model.state_dict(), "opt": opt.state_dict()["state"]}


def _train_in_child(*args: object, env: dict | None = None, prefix: tuple[str, ...] = ()):
    """:func:`train` in a process of its own (``prefix``: what runs it, an unshare)."""
    code = (
        f"import sys; sys.path[:0] = [{str(TESTS)!r}, {str(TESTS / 'checkpoint')!r}]; "
        f"from test_tiers import train; train(*{[str(a) for a in args[:2]]!r}, "
        f"{args[2]!r}, **{args[3]!r})"
    )
    return run_script(
        [*prefix, sys.executable, "-c", code], timeout_s=240, env={**os.environ, **(env or {})}
    )


def names(root: Path) -> list[str]:
    return [p.name for _, p in list_checkpoints(root)]


def steps(*ns: int) -> list[str]:
    return [f"step_{n:09d}" for n in ns]


def resumed_from(run_dir: Path) -> list[str]:
    return [e["path"] for e in read_events(run_dir) if e["kind"] == "resumed"]


def test_a_periodic_save_commits_locally_then_lands_whole_in_the_run_dir(tmp_path):
    local, durable = tmp_path / "local", tmp_path / "run" / "checkpoints"
    train(tmp_path / "run", local, 6, every=2)
    # local_keep_last=1 keeps the newest locally; keep_last=3 keeps three durable copies.
    assert names(local) == steps(6)
    assert names(durable) == steps(2, 4, 6)
    for ckpt in [local / "step_000000006", *(durable / n for n in steps(2, 4, 6))]:
        assert problem(ckpt) is None, ckpt  # the whole check: manifest, sizes, digests
    # The same bytes in both tiers (the end's finished mark too).
    for name in os.listdir(local / "step_000000006"):
        same = (local / "step_000000006" / name).read_bytes()
        assert same == (durable / "step_000000006" / name).read_bytes(), name
    events = read_events(tmp_path / "run")
    saved = [e["path"] for e in events if e["kind"] == "checkpoint"]
    drained = [e["path"] for e in events if e["kind"] == "checkpoint_drained"]
    assert saved == [str(local / n) for n in steps(2, 4, 6)]
    assert drained == [str(durable / n) for n in steps(2, 4, 6)]
    assert not [e for e in events if e["level"] == "warning"]
    # inspect lists both tiers, marked, and answers as resume does: the local copy.
    facts = inspect_dir(tmp_path / "run")
    assert facts["local_root"] == str(local)
    tiers = [(r["step"], r["tier"]) for r in facts["checkpoints"]]
    assert tiers == [(2, "durable"), (4, "durable"), (6, "local"), (6, "durable")]
    assert facts["resume_would_use"] == str(local / "step_000000006")
    assert not facts["leftovers"]


def test_a_drain_killed_mid_copy_leaves_nothing_complete_and_the_resume_takes_the_local_copy(
    tmp_path,
):
    run, local = tmp_path / "run", tmp_path / "local"
    durable = run / "checkpoints"
    # SIGKILL between the drain's files and its manifest: the first save's copy.
    got = _train_in_child(run, local, 8, {"every": 4}, env={CRASH_ENV: "drain:files"})
    assert got.returncode == -signal.SIGKILL, got.stderr
    assert names(local) == steps(4) and problem(local / "step_000000004") is None
    assert names(durable) == []  # nothing there looks like a checkpoint
    [cut] = [p for p in durable.iterdir() if p.name.startswith(".tmp-drain-")]
    assert not (cut / MANIFEST).exists() and (cut / "model.safetensors").exists()
    # The same command again resumes the local copy and ends bitwise where a run that
    # was never interrupted does; its first drain removes the cut one.
    resumed = train(run, local, 8, every=4)
    assert resumed_from(run) == [str(local / "step_000000004")]
    straight = train(tmp_path / "straight", tmp_path / "straight_local", 8, every=4)
    assert_state_equal(resumed, straight)
    assert names(durable) == steps(8) and not list(durable.glob(".tmp-*"))


def test_a_wiped_local_tier_resumes_from_the_durable_copy_bitwise(tmp_path):
    run, local = tmp_path / "run", tmp_path / "local"
    train(run, local, 6, every=3)
    for p in local.iterdir():  # a new node: its local directory is empty
        subprocess.run(["rm", "-rf", str(p)], check=True)
    resumed = train(run, local, 9, every=3)
    assert resumed_from(run) == [str(run / "checkpoints" / "step_000000006")]
    straight = train(tmp_path / "straight", tmp_path / "straight_local", 9, every=3)
    assert_state_equal(resumed, straight)
    # The wiped tier numbers its saves after the durable ones: the run order holds.
    seqs = [
        json.loads((run / "checkpoints" / n / MANIFEST).read_text())["seq"] for n in steps(3, 6, 9)
    ]
    assert seqs == sorted(seqs) and len(set(seqs)) == 3


def test_resume_prefers_the_local_copy_and_falls_back_to_the_durable_one_when_damaged(
    tmp_path,
):
    run, local = tmp_path / "run", tmp_path / "local"
    train(run, local, 6, every=3)
    train(run, local, 8, every=3)
    assert resumed_from(run) == [str(local / "step_000000006")]
    # Local step 8 damaged (a flipped byte): the durable copy of step 8 is resumed, and
    # the skip names the node-local copy.
    weights = local / "step_000000008" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    train(run, local, 10, every=3)
    assert resumed_from(run)[-1] == str(run / "checkpoints" / "step_000000008")
    [skip] = [e for e in read_events(run) if e["kind"] == "checkpoint_invalid"]
    assert "node-local copy" in skip["message"] and "step_000000008" in skip["message"]


def test_the_knobs_are_checked_when_the_guard_is_built(tmp_path):
    with pytest.raises(ValueError, match="local_keep_last"):
        guardrails.SignalCheckpointer(local_directory=tmp_path, local_keep_last=0)
    with pytest.raises(TypeError, match="local_directory"):
        guardrails.SignalCheckpointer(local_directory=3)


def _tmpfs(tmp_path: Path) -> tuple[str, ...]:
    """The prefix that runs a command with a 4 MB tmpfs mounted at its first argument
    (a user namespace's), or a skip where the kernel refuses one."""
    probe = tmp_path / "probe"
    probe.mkdir()
    prefix = ("unshare", "-Urm", "sh", "-c", TMPFS, "sh")
    got = subprocess.run([*prefix, str(probe), "true"], capture_output=True, text=True)
    if got.returncode != 0:
        pytest.skip(f"no tmpfs without root here: {got.stderr.strip()}")
    return prefix


def test_a_local_tier_too_small_for_one_checkpoint_is_refused_before_training(tmp_path):
    local = tmp_path / "local"
    local.mkdir()
    prefix = (*_tmpfs(tmp_path), str(local))
    # width 1024: 4.2 MB of weights, and AdamW's two moments to come: ~12.7 MB > 4 MB.
    got = _train_in_child(tmp_path / "run", local, 4, {"every": 2, "width": 1024}, prefix=prefix)
    assert got.returncode != 0
    assert "CheckpointError" in got.stderr, got.stderr
    assert re.search(r"has 4\.\d MB of room, .* needs about 12\.\d MB", got.stderr), got.stderr
    assert "local_directory" in got.stderr  # the fix: another disk, or the knob off
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert not [e for e in read_events(tmp_path / "run") if e["kind"] == "step"]
    # Room for one, but not for local_keep_last=5 plus the save being written: a
    # warning at start, and the run goes on.
    got = _train_in_child(
        tmp_path / "run2", local, 4, {"every": 2, "width": 256, "local_keep_last": 5}, prefix=prefix
    )
    assert got.returncode == 0, got.stderr
    [small] = [
        e for e in read_events(tmp_path / "run2") if e["kind"] == "checkpoint_local_tier_small"
    ]
    assert "local_keep_last=5 needs 6" in small["message"]


@pytest.mark.slow(reason="3 runs of 2 ranks: straight, stopped, resumed")
def test_two_ranks_commit_locally_and_a_sigterm_resumes_bitwise(tmp_path):
    def job(run_dir: Path, out: Path, *args: object) -> list[tuple[int, str]]:
        cmd = [sys.executable, WORKER, run_dir, out, "--steps", 30, "--every-n", 4]
        cmd += ["--background", *args, "--rank", "{rank}", "--world", "{world}"]
        got = run_ranks([*cmd, "--port", "{port}"], 2, out=f"{out}.logs", timeout_s=240)
        return [(r.code, r.out) for r in got]

    straight = job(tmp_path / "straight", tmp_path / "a")  # no local tier: as today
    assert [rc for rc, _ in straight] == [0, 0], straight
    run, local = tmp_path / "stopped", tmp_path / "local"
    args = ("--local-dir", local, "--sigterm-at", 11, "--kill-ranks", 1)
    stopped = job(run, tmp_path / "b", *args)
    assert [rc for rc, _ in stopped] == [143, 143], stopped
    # The stop's save (at the step the ranks agreed on) committed locally with both
    # ranks' files, and was drained within the grace period.
    [at] = {e["step"] for e in read_events(run) if e["kind"] == "stopped"}
    name = f"step_{at:09d}"
    assert names(local) == [name]
    assert names(run / "checkpoints")[-1] == name
    for ckpt in (local / name, run / "checkpoints" / name):
        assert problem(ckpt) is None
        assert json.loads((ckpt / MANIFEST).read_text())["ranks"] == [0, 1]
    assert not [e for e in read_events(run) if e["kind"] == "checkpoint_local_only"]
    resumed = job(run, tmp_path / "b", *args)
    assert [rc for rc, _ in resumed] == [0, 0], resumed
    assert str(local / name) in resumed_from(run)
    for rank in (0, 1):
        a = torch.load(f"{tmp_path / 'a'}.rank{rank}.pt", weights_only=False)
        b = torch.load(f"{tmp_path / 'b'}.rank{rank}.pt", weights_only=False)
        assert_state_equal(
            {k: a[k] for k in ("step", "model", "opt", "sched", "rng")},
            {k: b[k] for k in ("step", "model", "opt", "sched", "rng")},
        )


def test_a_signal_save_whose_copy_outlasts_the_grace_period_says_where_it_lives(tmp_path):
    run, local = tmp_path / "run", tmp_path / "local"
    # A grace period too short for any copy: the stop's save commits locally and says
    # that the checkpoint lives on this node only, and where.
    train(run, local, 8, every=None, sigterm_at=3, grace_s=0.001)
    assert names(local) == steps(3) and problem(local / "step_000000003") is None
    [only] = [e for e in read_events(run) if e["kind"] == "checkpoint_local_only"]
    assert only["host"] == socket.gethostname() and only["path"] == str(local / "step_000000003")
    assert "on this node only" in only["message"] and "the grace period" in only["message"]
    assert names(run / "checkpoints") == []  # the copy, cut, left nothing complete
    train(run, local, 8, every=None)
    assert resumed_from(run) == [str(local / "step_000000003")]


def test_ranks_on_two_hosts_save_straight_to_the_run_dir(tmp_path):
    # Rank 1 in a UTS namespace of its own: another host name, as on a second node.
    other = ("unshare", "-u", "sh", "-c", 'hostname other-node && exec "$@"', "sh")
    if subprocess.run([*other, "true"], capture_output=True).returncode != 0:
        pytest.skip("no UTS namespace here (unshare -u needs CAP_SYS_ADMIN)")
    run, local = tmp_path / "run", tmp_path / "local"

    def argv(rank: int) -> list:
        cmd = [sys.executable, WORKER, run, tmp_path / "out", "--steps", 8, "--every-n", 4]
        cmd += ["--local-dir", local, "--rank", "{rank}", "--world", "{world}", "--port", "{port}"]
        return [*(other if rank == 1 else ()), *cmd]

    got = run_ranks(argv, 2, out=tmp_path / "logs", timeout_s=240)
    assert [r.code for r in got] == [0, 0], [r.out for r in got]
    [off] = [e for e in read_events(run) if e["kind"] == "checkpoint_local_tier_off"]
    assert "several hosts" in off["message"]
    assert not local.exists() and names(run / "checkpoints") == steps(4, 8)


@pytest.mark.slow(reason="3 runs of 2 FSDP2 ranks: straight, stopped, resumed")
def test_fsdp2_shards_are_drained_whole_and_resumed_bitwise(tmp_path):
    def job(run_dir: Path, out: Path, *args: object) -> list[int]:
        cmd = [sys.executable, WORKER, run_dir, out, "--steps", 10, "--every-n", 4, "--fsdp"]
        cmd += ["--background", *args, "--rank", "{rank}", "--world", "{world}"]
        got = run_ranks([*cmd, "--port", "{port}"], 2, out=f"{out}.logs", timeout_s=240)
        return [r.code for r in got]

    assert job(tmp_path / "straight", tmp_path / "a") == [0, 0]
    run, local = tmp_path / "stopped", tmp_path / "local"
    args = ("--local-dir", local, "--sigterm-at", 6, "--kill-ranks", 0)
    assert job(run, tmp_path / "b", *args) == [143, 143]
    [at] = {e["step"] for e in read_events(run) if e["kind"] == "stopped"}
    durable = run / "checkpoints" / f"step_{at:09d}"
    assert problem(durable) is None  # DCP's shards and metadata, in dcp/, checked
    assert (durable / "dcp" / ".metadata").is_file()
    assert job(run, tmp_path / "b", *args) == [0, 0]
    assert resumed_from(run) == [str(local / durable.name)] * 2  # each rank says it
    for rank in (0, 1):
        a = torch.load(f"{tmp_path / 'a'}.rank{rank}.pt", weights_only=False)
        b = torch.load(f"{tmp_path / 'b'}.rank{rank}.pt", weights_only=False)
        assert_state_equal(
            {k: a[k] for k in ("step", "model", "opt", "rng")},
            {k: b[k] for k in ("step", "model", "opt", "rng")},
        )


def test_a_failure_save_commits_locally_and_is_copied_to_the_run_dir(tmp_path):
    run, local = tmp_path / "run", tmp_path / "local"
    with pytest.raises(ValueError, match="boom after step 5"):
        train(run, local, 8, every=None, fail_at=5)
    [saved] = [e for e in read_events(run) if e["kind"] == "failure_saved"]
    assert saved["path"] == str(local / "step_000000005"), saved
    for root in (local, run / "checkpoints"):
        assert names(root) == steps(5) and problem(root / "step_000000005") is None
    resumed = train(run, local, 8, every=None)
    assert resumed_from(run) == [str(local / "step_000000005")]
    straight = train(tmp_path / "straight", tmp_path / "straight_local", 8, every=None)
    assert_state_equal(resumed, straight)
