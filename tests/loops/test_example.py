"""The README's main job, run for real: it learns, and writes its metrics. Also under
torchrun with two real gloo ranks (DDP)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _ranks import patience, run_script

import guardrails

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_gpt.py"
# A 1-layer, 32-wide GPT (~10x cheaper steps than the default 0.8M parameters): for the
# tests about flags, faults and resumes, which do not depend on the model's size.
SMALL = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2"]
# Every test runs the example: a process importing torch, or torchrun and 2 ranks.
pytestmark = pytest.mark.slow(reason="runs the example GPT: a process, or torchrun and 2 ranks")


def run(args, tmp_path, timeout=600, torchrun=False, ok=True):
    env = {
        **os.environ,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1" if torchrun else "2"),
    }
    env.pop("CI", None)  # the example must behave as it does for a user
    launcher = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        if torchrun
        else [sys.executable]
    )
    argv = [*launcher, str(EXAMPLE), "--run-dir", str(tmp_path / "run"), *args]
    if torchrun:
        proc = subprocess.run(
            argv, capture_output=True, text=True, timeout=patience(timeout), env=env, cwd=tmp_path
        )
    else:  # forked from the fork server: torch imported once, not per run
        proc = run_script(argv, timeout_s=timeout, env=env, cwd=tmp_path)
    assert (proc.returncode == 0) == ok, proc.stdout + proc.stderr
    return proc, guardrails.read_metrics(tmp_path / "run").to_pydict()


@pytest.mark.slow(reason="100 steps of the 0.8M-parameter GPT")
def test_default_run_learns(tmp_path):
    """The README command with 100 steps instead of 500 (its defaults otherwise: the
    model, the batch, warmup and cosine LR over the steps, a sample): the loss falls
    clearly from ~4.2, where the model knows nothing."""
    proc, rows = run(["--steps", "100"], tmp_path)
    assert rows["step"] == list(range(1, 101))
    first = sum(rows["loss"][:10]) / 10
    last = sum(rows["loss"][-10:]) / 10
    assert first > 3.5, first  # about ln(65): knows nothing
    # ~2.5 after 100 steps (~1.9 after the default 500): characters and common words.
    assert last < 3.0 and first - last > 1.0, (first, last)
    assert all(t == 64 * 32 for t in rows["tokens"])
    assert "done: 100 steps" in proc.stdout and "sample:" in proc.stdout


def test_grad_accumulation_flag_counts_optimizer_steps(tmp_path):
    _, rows = run(["--steps", "6", "--grad-accum", "3", "--sample", "0", *SMALL], tmp_path)
    assert rows["step"] == [1, 2, 3, 4, 5, 6]
    assert all(t == 3 * 64 * 32 for t in rows["tokens"])  # three micro-batches per step


def test_torchrun_two_ranks_ddp(tmp_path):
    _, rows = run(["--steps", "12", "--sample", "0", *SMALL], tmp_path, torchrun=True)
    by_rank = {r: [] for r in (0, 1)}
    for r, s, gn, loss in zip(
        rows["rank"], rows["step"], rows["grad_norm"], rows["loss"], strict=True
    ):
        by_rank[r].append((s, gn, loss))
    assert [s for s, _, _ in by_rank[0]] == list(range(1, 13))
    assert [s for s, _, _ in by_rank[1]] == list(range(1, 13))
    # DDP averages the gradients, so both ranks see the same norm, bit for bit; their
    # losses differ because they read different shards.
    assert [gn for _, gn, _ in by_rank[0]] == [gn for _, gn, _ in by_rank[1]]
    assert [lo for _, _, lo in by_rank[0]] != [lo for _, _, lo in by_rank[1]]


def test_inject_bad_sample_is_skipped_and_named(tmp_path):
    args = ["--steps", "30", "--inject", "bad_sample", "--sample", "0", *SMALL]
    proc, rows = run(args, tmp_path)
    assert [s for s, k in zip(rows["step"], rows["skipped"], strict=True) if k] == [15]
    assert "done: 30 steps" in proc.stdout  # the run went on
    assert "sample row(s) [3]" in proc.stderr and "argument `weights`" in proc.stderr
    info = json.loads((tmp_path / "run/nonfinite/step00000015-rank0/info.json").read_text())
    assert info["cause"] == "bad_data" and info["samples"] == [3]


def test_inject_nan_lr_stops_with_an_optimization_blowup(tmp_path):
    args = ["--steps", "40", "--inject", "nan_lr", "--sample", "0", *SMALL]
    proc, rows = run(args, tmp_path, ok=False)
    assert "NonFiniteError" in proc.stderr and "[optimization_blowup]" in proc.stderr
    assert "10 optimizer steps in a row" in proc.stderr and "check the LR schedule" in proc.stderr
    assert "the learning rate jumped from" in proc.stderr
    skipped = [s for s, k in zip(rows["step"], rows["skipped"], strict=True) if k]
    assert skipped and skipped[0] >= 20  # nothing skipped before the fault


@pytest.fixture(scope="module")
def stop_resume(tmp_path_factory):
    """One run stopped by ``--inject sigterm`` (half way, step 15), the same command
    again (resumes and finishes) and once more (finished); and the same run never
    stopped. 5871 windows / 256 = 22 steps an epoch, so the resume crosses an epoch."""
    tmp = tmp_path_factory.mktemp("stop_resume")
    args = ["--steps", "30", "--sample", "0", "--batch-size", "256", *SMALL]
    (tmp / "a").mkdir()
    (tmp / "b").mkdir()
    _, straight = run(args, tmp / "a")
    stop = [*args, "--inject", "sigterm"]
    stopped, _ = run(stop, tmp / "b", ok=False)
    resumed, metrics = run(stop, tmp / "b")  # the same command: resumes at step 15
    ckpts = sorted(p.name for p in (tmp / "b" / "run" / "checkpoints").glob("step_*"))
    finished, _ = run(stop, tmp / "b")  # once more
    return {
        "straight": straight,
        "stopped": stopped,
        "resumed": resumed,
        "metrics": metrics,
        "ckpts": ckpts,
        "finished": finished,
    }


@pytest.mark.slow(reason="the shared stop/resume fixture: 4 runs of the example")
def test_inject_sigterm_saves_exits_and_the_same_command_resumes(stop_resume):
    proc = stop_resume["stopped"]
    assert proc.returncode == 143, proc.stderr
    assert "stopped at step 15" in proc.stderr and "run the same command" in proc.stderr
    # The resumed process ran steps 16-30 only: it says so, not "30 steps".
    assert "done: steps 16-30 (15 this run; resumed at 15)" in stop_resume["resumed"].stdout
    assert stop_resume["ckpts"] == ["step_000000015", "step_000000030"]
    metrics = stop_resume["metrics"]
    second = max(metrics["started_at"])
    pairs = zip(metrics["step"], metrics["started_at"], strict=True)
    resumed = [s for s, t in pairs if t == second]
    assert min(resumed) == 16 and max(resumed) == 30
    proc = stop_resume["finished"]  # the run is finished, and says so
    assert "nothing to do" in proc.stdout and "step 30" in proc.stdout


@pytest.mark.slow(reason="the shared stop/resume fixture: 4 runs of the example")
def test_sigterm_resume_across_an_epoch_trains_exactly_as_the_straight_run(stop_resume):
    # The example's sampler shuffles with its own seeded generator: a resume that did
    # not carry that generator's state replayed the first epoch's order in the second
    # (the README's demo diverged at the epoch boundary). 22 steps an epoch; stopped at
    # 15, run to 30: every resumed step's loss, bit for bit.
    straight, resumed = stop_resume["straight"], stop_resume["metrics"]
    want = dict(zip(straight["step"], straight["loss"], strict=True))
    second = max(resumed["started_at"])
    got = {
        s: loss
        for s, loss, t in zip(resumed["step"], resumed["loss"], resumed["started_at"], strict=True)
        if t == second
    }
    assert sorted(got) == list(range(16, 31))
    assert got == {s: want[s] for s in got}


def test_inject_desync_under_torchrun_names_both_calls(tmp_path):
    args = ["--steps", "40", "--inject", "desync", "--sample", "0", *SMALL]
    proc, _ = run(args, tmp_path, torchrun=True, ok=False, timeout=300)
    out = proc.stdout + proc.stderr
    assert "CollectiveMismatchError" in out and "To enable traceback" not in out
    assert "barrier" in out and "all_reduce" in out and "train_gpt.py:" in out
    # Each rank's headline at most twice: its report, and its line in torchrun's
    # summary, whose root cause is ours. The event's log line repeated it (6 in all).
    assert "CollectiveMismatchError" in out[out.index("Root Cause") :], out[-3000:]
    for rank in range(2):
        assert 1 <= out.count(f"[rank {rank}, step") <= 2, out


def test_inject_stuck_under_torchrun_is_a_hang_error_naming_the_rank(tmp_path):
    args = ["--steps", "40", "--inject", "stuck", "--hang-timeout-s", "3", "--sample", "0", *SMALL]
    proc, _ = run(args, tmp_path, torchrun=True, ok=False, timeout=300)
    out = proc.stdout + proc.stderr
    assert "HangError" in out and "rank 1" in out and "time.sleep" in out
