"""Under ``umask 000`` nothing guardrails creates is writable by group or others: run
dir (and the parents it makes), metrics parts, events, checkpoints, NaN diagnoses. A
real run in a real process whose umask is 0, every path on disk checked."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _ranks import run_script
from conftest import events_path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import math, os, sys, torch
    os.umask(0)  # what some launchers and containers set: files 0o666, dirs 0o777
    sys.path.insert(0, {tests!r})
    from conftest import Regressor, batches, train_loop
    import guardrails

    run_dir, other = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = batches(6)
    data[3] = (data[3][0].clone().fill_(math.nan), data[3][1])  # a NaN: a diagnosis dir
    with guardrails.guard(model, opt, data, run_dir=run_dir, progress=False,
                          metrics={{"every_n_steps": 2, "write_every_s": 0}},
                          checkpoint={{"every_n_steps": 2}}) as g:
        train_loop(g, model, opt)
    guardrails.save_checkpoint(other, model=model, optimizer=opt, step=6)
    """
)


def _writable_by_others(root: Path) -> list[str]:
    bad = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [".", *dirnames, *filenames]:
            path = Path(dirpath, name)
            mode = os.lstat(path).st_mode
            if not stat.S_ISLNK(mode) and mode & (stat.S_IWGRP | stat.S_IWOTH):
                bad.append(f"{path.relative_to(root)} {stat.filemode(mode)}")
    return bad


def run_under_umask_0(tmp_path: Path, pythonpath: Path = ROOT) -> subprocess.CompletedProcess:
    script = tmp_path / "umask0.py"
    script.write_text(SCRIPT.format(tests=str(ROOT / "tests")))
    return run_script(
        [sys.executable, script, tmp_path / "a" / "b" / "run", tmp_path / "ckpts"],
        timeout_s=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(pythonpath)},
    )


@pytest.mark.slow(reason="a training process under umask 000")
def test_nothing_is_group_or_world_writable_under_umask_000(tmp_path):
    proc = run_under_umask_0(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = tmp_path / "a" / "b" / "run"
    # What the run wrote is all there, so the walk below checked real files.
    assert events_path(run).is_file()
    assert list((run / "metrics.parquet").glob("part-r00000-*.parquet"))
    assert list((run / "checkpoints").glob("step_*/manifest.json"))
    assert list((run / "checkpoints").glob("step_*/*.safetensors"))
    assert list((run / "nonfinite").glob("step*/info.json"))
    assert (tmp_path / "ckpts" / "step_000000006" / "manifest.json").is_file()
    assert _writable_by_others(tmp_path / "a") == []  # the parents guard() made too
    assert _writable_by_others(tmp_path / "ckpts") == []
    # Only bits are taken away: files stay readable (a resume by another process).
    mode = os.stat(events_path(run)).st_mode
    assert stat.S_IMODE(mode) == 0o644, oct(mode)
