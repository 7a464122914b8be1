"""What a checkpoint saves beside the model, as users' loops keep it: tensors in
``g.state``, optimizers whose steps reduce over their state (LBFGS), param groups added
mid-run, LR schedulers. Each runs tests/state_worker.py in real processes with a real
SIGTERM and compares, bitwise, the final state of a run that was stopped and resumed
with the same command against one that was never interrupted.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_state_equal, read_events

WORKER = Path(__file__).with_name("state_worker.py")
SIGTERM_EXIT = 128 + signal.SIGTERM


def _run(run_dir: Path, out: Path, *args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(WORKER), str(run_dir), str(out), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=240,
    )


def _stop_and_resume(tmp_path: Path, *args: object, stop_at: int) -> tuple[dict, dict, Path]:
    """The worker run to its end, and run again in another run_dir SIGTERMed after
    ``stop_at`` then re-run with the same command: both final states, and the stop's
    checkpoint."""
    straight = _run(tmp_path / "a", tmp_path / "a.pt", *args)
    assert straight.returncode == 0, straight.stderr
    stopped = _run(tmp_path / "b", tmp_path / "b.pt", *args, "--sigterm-at", stop_at)
    assert stopped.returncode == SIGTERM_EXIT, stopped.stderr
    ckpt = tmp_path / "b" / "checkpoints" / f"step_{stop_at:09d}"
    assert (ckpt / "manifest.json").is_file(), stopped.stderr
    resumed = _run(tmp_path / "b", tmp_path / "b.pt", *args)
    assert resumed.returncode == 0, resumed.stderr
    assert [e["path"] for e in read_events(tmp_path / "b") if e["kind"] == "resumed"] == [str(ckpt)]
    a = torch.load(tmp_path / "a.pt", weights_only=False)
    b = torch.load(tmp_path / "b.pt", weights_only=False)
    return a, b, ckpt


# ------------------------------------------------------------- optimizer state layout


@pytest.mark.slow(reason="3 runs per optimizer: straight, stopped, resumed")
@pytest.mark.parametrize("opt", ["lbfgs", "adam", "adamw", "sgdm"])
def test_every_optimizer_resumes_bitwise(tmp_path, opt):
    # LBFGS reduces over its state (dot products of its history): restored value for
    # value but lying at the file reader's offsets, its sums rounded differently and the
    # resumed weights left the uninterrupted run's (4e-6 after 10 steps here).
    a, b, _ = _stop_and_resume(tmp_path, "--opt", opt, "--steps", 10, stop_at=4)
    assert_state_equal(a, b)
