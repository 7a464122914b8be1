"""A checkpoint directory at scale: ``inspect`` lists thousands of checkpoints from
their manifests and verifies (hashes) only what a resume would read, or every one with
``--verify``; thousands of invalid newer directories are one line in the log and one
event, with the count and examples. Small fake checkpoints: one real save, its files
hard-linked into many step directories, each manifest re-sealed for its step."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time

import pytest
import torch
from _ranks import patience
from conftest import Regressor, batches, read_events, train_loop

import guardrails
from guardrails.__main__ import main
from guardrails.checkpoint.manifest import MANIFEST, _dumps, _self_hash
from guardrails.cli.inspect import inspect_dir

N_VALID = 400  # enough to see the listing stay cheap while hashing grows with N
N_INVALID = 2000


@pytest.fixture(scope="module")
def many(tmp_path_factory):
    """``run/checkpoints`` with ``N_VALID`` valid checkpoints (steps 1..N) of one real
    save, and a sibling root whose ``N_INVALID`` newer directories hold no manifest."""
    base = tmp_path_factory.mktemp("scale")
    torch.manual_seed(0)
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    real = guardrails.save_checkpoint(base / "real", 1, model=model, optimizer=opt)
    manifest = json.loads((real / MANIFEST).read_text())
    root = base / "run" / "checkpoints"
    root.mkdir(parents=True)
    for step in range(1, N_VALID + 1):
        d = root / f"step_{step:09d}"
        d.mkdir()
        for name in manifest["files"]:
            os.link(real / name, d / name)
        m = dict(manifest, step=step, seq=step)
        m["manifest_sha256"] = _self_hash(m)
        (d / MANIFEST).write_bytes(_dumps(m))
    bad = base / "bad" / "checkpoints"
    bad.mkdir(parents=True)
    good = bad / "step_000000001"
    good.mkdir()
    for name in [*manifest["files"], MANIFEST]:
        os.link(real / name, good / name)
    for step in range(2, N_INVALID + 2):  # newer, and not checkpoints at all
        (bad / f"step_{step:09d}").mkdir()
    return base


def test_inspect_lists_every_checkpoint_and_verifies_only_what_resume_reads(many, capsys):
    root = many / "run" / "checkpoints"
    t0 = time.perf_counter()
    facts = inspect_dir(many / "run")
    listed_s = time.perf_counter() - t0
    rows = facts["checkpoints"]
    assert len(rows) == N_VALID
    assert facts["resume_would_use"] == str(root / f"step_{N_VALID:09d}")
    verified = [r["step"] for r in rows if r["verified"]]
    assert verified == [N_VALID]  # the newest, which resume would load: nothing else hashed
    assert all(r["valid"] is None and r["holds"] for r in rows[:-1])
    t0 = time.perf_counter()
    every = inspect_dir(many / "run", verify=True)
    verified_s = time.perf_counter() - t0
    assert all(r["verified"] and r["valid"] for r in every["checkpoints"])
    # Listing reads one manifest per checkpoint; verifying hashes every file as well.
    assert listed_s < verified_s, (listed_s, verified_s)
    assert listed_s < patience(10)
    # The command: exit 0, the listed ones said as such, --verify named.
    assert main(["inspect", str(root)]) == 0
    out = capsys.readouterr().out
    status = [line.split()[2] for line in out.splitlines() if line.startswith("  step ")]
    assert status.count("listed") == N_VALID - 1 and status.count("valid") == 1
    assert f"{N_VALID - 1} older checkpoint(s) listed from their manifests" in out
    assert "guardrails inspect --verify" in out
    assert main(["inspect", "--verify", str(root)]) == 0
    out = capsys.readouterr().out
    status = [line.split()[2] for line in out.splitlines() if line.startswith("  step ")]
    assert status == ["valid"] * N_VALID and "not verified" not in out


def test_thousands_of_invalid_newer_directories_are_one_line_with_a_count(many, caplog):
    root = many / "bad" / "checkpoints"
    caplog.set_level(logging.WARNING, logger="guardrails")
    got = guardrails.resume(root, Regressor())
    assert got["step"] == 1
    said = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(said) == 1, len(said)
    assert f"skipped {N_INVALID} invalid checkpoints newer than the one used" in said[0]
    assert f"step_{N_INVALID + 1:09d}: " in said[0]  # an example, with its reason
    assert f"{N_INVALID - 2} more: guardrails inspect {root}" in said[0]
    # inspect says why for each it verified (every one newer than the valid one).
    facts = inspect_dir(root)
    assert facts["resume_would_use"] == str(root / "step_000000001")
    assert sum(1 for r in facts["checkpoints"] if r["valid"] is False) == N_INVALID


def test_a_guard_resuming_past_them_says_one_event(many, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(many / "bad" / "checkpoints", run_dir / "checkpoints")
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guardrails.guard(model, opt, batches(2), run_dir=run_dir, progress=False) as g:
        train_loop(g, model, opt)
    events = [e for e in read_events(run_dir) if e["kind"] == "checkpoint_invalid"]
    assert len(events) == 1 and events[0]["count"] == N_INVALID, events
    assert (
        events[0]["checkpoint"] is None and "resuming from step_000000001" in events[0]["message"]
    )
