"""The README's main job, run for real: it learns, and writes its metrics. Also under
torchrun with two real gloo ranks (DDP)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import guardrails

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_gpt.py"


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
    proc = subprocess.run(
        [*launcher, str(EXAMPLE), "--run-dir", str(tmp_path / "run"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=tmp_path,
    )
    assert (proc.returncode == 0) == ok, proc.stdout + proc.stderr
    return proc, guardrails.read_metrics(tmp_path / "run").to_pydict()


def test_default_run_learns(tmp_path):
    """The exact README command (defaults): loss from ~4.2 to near 2."""
    proc, rows = run([], tmp_path)
    assert rows["step"] == list(range(1, 501))
    first = sum(rows["loss"][:10]) / 10
    last = sum(rows["loss"][-10:]) / 10
    assert first > 3.5, first  # about ln(65): knows nothing
    assert last < 2.3, last  # has learned characters, words and line structure
    assert all(t == 64 * 32 for t in rows["tokens"])
    assert "done: 500 steps" in proc.stdout and "sample:" in proc.stdout


def test_grad_accumulation_flag_counts_optimizer_steps(tmp_path):
    _, rows = run(["--steps", "6", "--grad-accum", "3", "--sample", "0"], tmp_path)
    assert rows["step"] == [1, 2, 3, 4, 5, 6]
    assert all(t == 3 * 64 * 32 for t in rows["tokens"])  # three micro-batches per step


def test_torchrun_two_ranks_ddp(tmp_path):
    _, rows = run(["--steps", "12", "--sample", "0"], tmp_path, torchrun=True)
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
    proc, rows = run(["--steps", "30", "--inject", "bad_sample", "--sample", "0"], tmp_path)
    assert [s for s, k in zip(rows["step"], rows["skipped"], strict=True) if k] == [15]
    assert "done: 30 steps" in proc.stdout  # the run went on
    assert "sample row(s) [3]" in proc.stderr and "argument `weights`" in proc.stderr
    info = json.loads((tmp_path / "run/nonfinite/step00000015-rank0/info.json").read_text())
    assert info["cause"] == "bad_data" and info["samples"] == [3]


def test_inject_nan_lr_stops_with_an_optimization_blowup(tmp_path):
    proc, rows = run(["--steps", "40", "--inject", "nan_lr", "--sample", "0"], tmp_path, ok=False)
    assert "NonFiniteError" in proc.stderr and "[optimization_blowup]" in proc.stderr
    assert "10 optimizer steps in a row" in proc.stderr and "lower the peak LR" in proc.stderr
    skipped = [s for s, k in zip(rows["step"], rows["skipped"], strict=True) if k]
    assert skipped and skipped[0] >= 20  # nothing skipped before the fault


def test_inject_sigterm_saves_exits_and_the_same_command_resumes(tmp_path):
    args = ["--steps", "40", "--inject", "sigterm", "--sample", "0"]
    proc, _ = run(args, tmp_path, ok=False)
    assert proc.returncode == 143, proc.stderr
    assert "stopped at step 20" in proc.stderr and "run the same command" in proc.stderr
    proc, metrics = run(args, tmp_path)  # the same command: resumes at step 20
    assert "done: 40 steps" in proc.stdout
    ckpts = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*"))
    assert ckpts == ["step_000000020", "step_000000040"]
    second = max(metrics["started_at"])
    pairs = zip(metrics["step"], metrics["started_at"], strict=True)
    resumed = [s for s, t in pairs if t == second]
    assert min(resumed) == 21 and max(resumed) == 40
    proc, _ = run(args, tmp_path)  # once more: the run is finished, and says so
    assert "nothing to do" in proc.stdout and "step 40" in proc.stdout


def test_sigterm_resume_across_an_epoch_trains_exactly_as_the_straight_run(tmp_path):
    # The example's sampler shuffles with its own seeded generator: a resume that did
    # not carry that generator's state replayed the first epoch's order in the second
    # (the README's demo diverged at the epoch boundary). 5871 windows / 256 = 22 steps
    # an epoch; stop at 15, run to 30: every resumed step's loss, bit for bit.
    small = ["--batch-size", "256", "--n-layer", "1", "--n-embd", "32", "--n-head", "2"]
    args = ["--steps", "30", "--sample", "0", *small]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    _, straight = run(args, tmp_path / "a")
    stop = ["--inject", "sigterm", "--inject-step", "15"]
    proc, _ = run([*args, *stop], tmp_path / "b", ok=False)
    assert proc.returncode == 143, proc.stderr
    _, resumed = run([*args, *stop], tmp_path / "b")
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
    args = ["--steps", "40", "--inject", "desync", "--sample", "0"]
    proc, _ = run(args, tmp_path, torchrun=True, ok=False, timeout=300)
    out = proc.stdout + proc.stderr
    assert "CollectiveMismatchError" in out and "To enable traceback" not in out
    assert "barrier" in out and "all_reduce" in out and "train_gpt.py:" in out


def test_inject_stuck_under_torchrun_is_a_hang_error_naming_the_rank(tmp_path):
    args = ["--steps", "40", "--inject", "stuck", "--hang-timeout-s", "3", "--sample", "0"]
    proc, _ = run(args, tmp_path, torchrun=True, ok=False, timeout=300)
    out = proc.stdout + proc.stderr
    assert "HangError" in out and "rank 1" in out and "time.sleep" in out
