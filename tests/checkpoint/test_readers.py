"""Every reader of a checkpoint applies the same checks (issue 52): resume, rewind's
fallback, ``inspect`` and ``report`` all go through ``manifest.problem``. Real
checkpoints, forged the way a person editing one would: the bytes kept, the header
changed, every checksum recomputed."""

from __future__ import annotations

import hashlib
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import Regressor, batches, train_loop

import guardrails
from guardrails.checkpoint.manifest import MANIFEST, _self_hash
from guardrails.checkpoint.read import verify_checkpoint

ROOT = Path(__file__).resolve().parents[2]


class MyAdam(torch.optim.Adam):
    """A user's optimizer: its state's names mean nothing to guardrails."""


def _saved(
    run_dir: Path, cls: type = torch.optim.Adam
) -> tuple[Path, Regressor, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Regressor()
    opt = cls(model.parameters(), lr=0.01)
    knobs = {"every_n_steps": 3, "background": False}
    with guardrails.guard(
        model, opt, batches(3), run_dir=run_dir, progress=False, checkpoint=knobs
    ) as g:
        train_loop(g, model, opt)
    (ckpt,) = (run_dir / "checkpoints").glob("step_*")
    return ckpt, model, opt


def _retype(ckpt: Path, name: str, key: str, dtype: str) -> None:
    """``key``'s dtype in ``name``'s header set to ``dtype`` (same width: the bytes stay
    valid), the file's size and sha256 recorded again, the manifest re-hashed."""
    path = ckpt / name
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header[key]["dtype"] = dtype
    body = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + n :])
    manifest = json.loads((ckpt / MANIFEST).read_text())
    data = path.read_bytes()
    manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest["manifest_sha256"] = _self_hash(manifest)
    (ckpt / MANIFEST).write_text(json.dumps(manifest, indent=1))


def test_an_optimizer_state_saved_as_another_dtype_is_refused_by_every_reader(tmp_path):
    # Issue 52: Adam's exp_avg (F32) rewritten as I32, the manifest re-hashed, loaded.
    ckpt, model, opt = _saved(tmp_path / "run")
    _retype(ckpt, "optimizer.safetensors", "0.exp_avg", "I32")
    before = [p.detach().clone() for p in model.parameters()]
    why = verify_checkpoint(ckpt)
    said = 'field state["0"].exp_avg is a tensor of I32, where the optimizer keeps a float'
    assert why is not None and said in why, why
    with pytest.raises(guardrails.CheckpointError) as caught:
        guardrails.resume(ckpt, model, opt)
    assert said in str(caught.value)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    # inspect says the same, without torch.
    got = subprocess.run(
        [sys.executable, "-m", "guardrails", "inspect", str(ckpt.parent), "--json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert got.returncode == 1, got.stdout + got.stderr
    (row,) = json.loads(got.stdout)["checkpoints"]
    assert row["valid"] is False and said in row["problem"]


def test_a_state_of_another_kind_than_the_live_optimizers_is_refused_at_resume(tmp_path):
    # A user's optimizer's state is not known by name: it is held against the live one.
    ckpt, model, opt = _saved(tmp_path / "run", MyAdam)
    _retype(ckpt, "optimizer.safetensors", "0.exp_avg_sq", "I32")
    assert verify_checkpoint(ckpt) is None  # its files are all they claim
    with pytest.raises(guardrails.CheckpointError) as caught:
        guardrails.resume(ckpt, model, opt)
    assert "state.0.exp_avg_sq" in str(caught.value)
    assert "MyAdam keeps 'exp_avg_sq' as torch.float32" in str(caught.value)


def test_report_marks_the_checkpoints_resume_would_refuse(tmp_path):
    # Issue 52: report listed checkpoints that resume would refuse, unmarked.
    run_dir = tmp_path / "run"
    ckpt, _, _ = _saved(run_dir)
    _retype(ckpt, "optimizer.safetensors", "0.exp_avg", "I32")

    def report() -> tuple[dict, str]:
        got = subprocess.run(
            [sys.executable, "-m", "guardrails", "report", str(run_dir), "--no-png"],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        assert got.returncode == 0, got.stderr
        facts = subprocess.run(
            [sys.executable, "-m", "guardrails", "report", str(run_dir), "--json", "--no-png"],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        (row,) = json.loads(facts.stdout)["checkpoints"]
        return row, got.stdout

    row, text = report()
    assert 'state["0"].exp_avg is a tensor of I32' in row["refused"], row
    assert f"step 3: resume would refuse it: {ckpt}/optimizer.json is corrupt" in text, text
    # A link in its place: refused too, as resume skips it.
    ckpt.rename(tmp_path / "elsewhere")
    ckpt.symlink_to(tmp_path / "elsewhere")
    row, _ = report()
    assert f"{ckpt} is a link" in row["refused"], row
