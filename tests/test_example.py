"""The README's main job, run for real: it learns, and writes its metrics. Also under
torchrun with two real gloo ranks (DDP)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import guardrails

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_gpt.py"


def run(args, tmp_path, timeout=600, torchrun=False):
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
    assert proc.returncode == 0, proc.stdout + proc.stderr
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
