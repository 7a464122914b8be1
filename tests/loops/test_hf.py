"""HF accelerate and transformers, guarded as users combine them with PyTorch (issue 15's
accelerate / transformers row): the ``accelerator.prepare()``d model, optimizer, loader
and scheduler passed to the guard as they are, and a loop that trains a transformers
model through its ``ModelOutput`` (``out = model(input_ids=x, labels=y)``).

The stop-and-resume test runs tests/hf_worker.py in real processes with a real SIGTERM
and compares, bitwise, the final state of a run that was stopped and resumed with one
that was never interrupted. Nothing is downloaded: the models are built from configs.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate", reason="the accelerate tests need HF accelerate (.[dev])")
pytest.importorskip("transformers", reason="the transformers tests need HF transformers (.[dev])")

import pyarrow.parquet as pq
import torch
from conftest import assert_state_equal, patience, read_events
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2ForSequenceClassification

import guardrails

WORKER = Path(__file__).resolve().parents[1] / "hf_worker.py"
ROOT = Path(__file__).resolve().parents[2]
#: The worker's GradScaler starts at 2**126: the first step's scaled loss overflows
#: (loss ~4.2 x 8.5e37 > 3.4e38, float32's largest), the next ones do not.
SCALE = 2.0**126


def _run(run_dir: Path, *args: object) -> tuple[int, str]:
    cmd = [sys.executable, str(WORKER), str(run_dir), str(run_dir), *map(str, args)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=patience(240))
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.slow(reason="3 runs, each importing transformers and accelerate")
def test_accelerate_prepared_loop_stops_on_sigterm_and_resumes_bitwise(tmp_path):
    # accelerate's documented loop over a GPT-2: model, optimizer, loader and scheduler
    # prepare()d and passed as they are, gradient accumulation of 2 through
    # accelerator.accumulate() (opt.step() on every micro-batch, a no-op on the first),
    # and the GradScaler accelerate's fp16 runs inside the optimizer's step().
    args = ("--steps", 8, "--accumulate", 2, "--scale", SCALE)
    rc, out = _run(tmp_path / "a", *args)
    assert rc == 0, out
    straight = torch.load(tmp_path / "a.rank0.pt", weights_only=False)
    # A step is an optimizer step, not a micro-batch; the overflowing first step went
    # to the scaler, which skipped it and halved its scale (left out of the scaler,
    # the scale never drops and every step overflows: NonFiniteError).
    assert straight["step"] == 8
    assert {s["step"].item() for s in straight["opt"]["state"].values()} == {7}
    assert straight["scaler"]["scale"] == SCALE / 2
    assert straight["sched"]["last_epoch"] == 7  # the scheduler skips with the scaler

    rc, out = _run(tmp_path / "b", *args, "--sigterm-at", 3)
    assert rc == 128 + signal.SIGTERM, out  # saved, not "'DataLoader' ... dl_state_dict"
    ckpt = tmp_path / "b/checkpoints/step_000000003"
    assert sorted(p.name for p in ckpt.parent.iterdir()) == [ckpt.name]
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert {"optimizer.json", "scheduler.json", "scaler.json"} <= set(manifest["files"])
    data = json.loads((ckpt / "rank00000.json").read_text())["data"]
    # 3 steps of 2 micro-batches trained; the position is a count (no loader state).
    assert data["kind"] == "fast_forward" and data["batch_in_epoch"] == 6
    assert "loader" not in data
    (warned,) = [e for e in read_events(tmp_path / "b") if e["kind"] == "loader_state_unavailable"]
    assert warned["level"] == "warning" and warned["step"] == 3
    assert warned["loader"] == "DataLoaderShard" and warned["resume"] == "fast_forward"
    assert "dl_state_dict" in warned["error"] and "fetches and drops" in warned["message"]

    rc, out = _run(tmp_path / "b", *args)  # the same command again: resumes
    assert rc == 0, out
    events = read_events(tmp_path / "b")
    assert [e["path"] for e in events if e["kind"] == "resumed"] == [str(ckpt)]
    (ff,) = [e for e in events if e["kind"] == "data_fast_forward"]
    assert ff["batches"] == 6 and "DataLoaderShard" in ff["message"]
    assert_state_equal(straight, torch.load(tmp_path / "b.rank0.pt", weights_only=False))


def test_transformers_model_output_loss_bad_labels_and_module_replay(tmp_path):
    # A transformers regression model trained through its ModelOutput. Step 2's batch
    # holds a NaN target (sample row 1); from step 5 one weight column of the second
    # block's MLP projection is 3e38, so its output overflows from finite inputs.
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, num_labels=1,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    model = GPT2ForSequenceClassification(config)
    ids = torch.randint(1, 64, (40, 16), generator=torch.Generator().manual_seed(1))
    targets = torch.randn(40)
    targets[4 + 1] = float("nan")
    loader = DataLoader(TensorDataset(ids, targets), batch_size=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = {}
    with pytest.raises(guardrails.NonFiniteError) as info:
        with guardrails.guard(
            model, opt, loader, run_dir=tmp_path, progress=False, nan={"max_consecutive_skips": 3}
        ) as g:
            for x, y in g:
                if g.step == 4:
                    with torch.no_grad():
                        model.transformer.h[1].mlp.c_proj.weight[:, 0] = 3e38
                out = model(input_ids=x, labels=y)
                out.loss.backward()
                losses[g.step + 1] = out.loss.item()
                opt.step()
                opt.zero_grad()
    err = info.value
    assert err.cause == "numerics" and err.step == 5
    assert "`transformer.h.1.mlp.c_proj` (Conv1D)" in str(err) and "steps 5-7" in str(err)
    skips = {e["step"]: e for e in read_events(tmp_path) if e["kind"] == "nonfinite"}
    assert sorted(skips) == [2, 5]
    bad = skips[2]  # named down to the keyword argument and the sample
    assert bad["cause"] == "bad_data" and bad["tensor"] == "labels" and bad["samples"] == [1]
    assert (tmp_path / "nonfinite/step00000002-rank0/batch.safetensors").is_file()
    replayed = skips[5]  # the recorded model(input_ids=..., labels=...) call, replayed
    assert replayed["replayed"] and replayed["module"] == "transformer.h.1.mlp.c_proj"
    assert replayed["input_finite"] and replayed["params_finite"]
    # The loss was picked up from the ModelOutput: the metrics hold the loop's values.
    rows = pq.read_table(tmp_path / "metrics.parquet").to_pydict()
    got = dict(zip(rows["step"], rows["loss"], strict=True))
    assert {s: got[s] for s in (1, 3, 4)} == {s: losses[s] for s in (1, 3, 4)}
    assert rows["skipped"][:5] == [False, True, False, False, True]
