"""The test harness's own promises: its waits stretch with the machine's load and
GUARDRAILS_TEST_PATIENCE, and a rank that never ends still fails the test (killed,
named), however patient the wait."""

from __future__ import annotations

import os
import sys

import pytest
from _ranks import MAX_STRETCH, PATIENCE_VAR, launch, patience


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
