"""States checked against what they load into, before anything is applied.

A copied-in or hand-edited checkpoint whose manifest was re-sealed (every checksum
agrees) passes the file checks; what it holds must still fit the live objects: the
scheduler's and the scaler's keys, the optimizer's param-group settings and state
types, the model's dtypes, and the rank file the manifest says was saved. Each misfit
is an error naming the file, the key, what was found and what was expected, with the
model, optimizer, scheduler, scaler and RNG streams bitwise as they were. The
checkpoints come from the fuzz harness's real guarded run (``_ckpt_fuzz.py``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import _ckpt_fuzz as F
import pytest
import torch

import guardrails

# Every test reads the module's fixture: one real guarded run writing two checkpoints.
pytestmark = pytest.mark.slow(reason="the fixture: a real guarded run, ~5 s, shared by the module")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return F.pristine(tmp_path_factory.mktemp("fit") / "pristine")


def _model_dtype(d: Path, scratch: Path) -> None:
    """model.safetensors' first tensor saved as int32 (F32 -> I32), the file relisted."""
    from safetensors.torch import load_file, save_file

    f = d / "model.safetensors"
    tensors = load_file(str(f))
    key = sorted(tensors)[0]
    tensors[key] = tensors[key].to(torch.int32)
    save_file(tensors, str(f), metadata={"guardrails.aliases": "{}"})
    F._relist(d, f.name)


def _state_number(doc) -> None:
    doc["state"]["0"]["exp_avg"] = 0.5


def _omit_rank_file(d: Path, scratch: Path) -> None:
    m = F._manifest(d)
    del m["files"]["rank00000.json"], m["files"]["rank00000.safetensors"]
    F._write_manifest(d, m)


# (id, damage, error type, words: the file, the key, what was found, what was expected)
MISFITS = [
    (
        "scheduler {}",
        F._edit_json("scheduler.json", lambda doc: {}),
        guardrails.CheckpointError,
        ["scheduler.json", "step_size is missing", "StepLR's state holds 'step_size'"],
    ),
    (
        "scheduler extra key",
        F._edit_json("scheduler.json", F._set(("optimizer",), None)),
        guardrails.CheckpointError,
        ["scheduler.json", "field optimizer is None", "a key StepLR's state does not have"],
    ),
    (
        "scheduler missing key",
        F._edit_json("scheduler.json", F._drop(("gamma",))),
        guardrails.CheckpointError,
        ["scheduler.json", "gamma is missing", "0.5 in this run"],
    ),
    (
        "param group without betas",
        F._edit_json("optimizer.json", F._drop(("param_groups", 0, "betas"))),
        guardrails.CheckpointError,
        ["optimizer.json", "param_groups[0].betas is missing", "AdamW's param groups hold"],
    ),
    (
        "state entry a number",
        F._edit_json("optimizer.json", _state_number),
        guardrails.CheckpointError,
        ["optimizer.json", "state.0.exp_avg is 0.5", "where a tensor belongs"],
    ),
    (
        "model dtype F32 -> I32",
        _model_dtype,
        guardrails.ResumeError,
        [
            "does not fit this model",
            "dtype mismatch",
            "checkpoint torch.int32 vs model torch.float32",
        ],
    ),
    (
        "manifest omits the rank file",
        _omit_rank_file,
        guardrails.CheckpointError,
        ["manifest.json", 'files["rank00000.json"] is missing', "RNG streams and data position"],
    ),
    (
        "scaler extra key",
        F._edit_json("scaler.json", F._set(("foo",), 1)),
        guardrails.CheckpointError,
        ["scaler.json", "field foo is 1", "GradScaler's state"],
    ),
]


def _copy(pristine, tmp_path: Path) -> Path:
    root = tmp_path / "checkpoints"
    shutil.copytree(pristine.root, root)
    return root


@pytest.mark.parametrize(
    ("damage", "kind", "words"), [m[1:] for m in MISFITS], ids=[m[0] for m in MISFITS]
)
def test_a_state_that_does_not_fit_is_refused_by_name_before_anything_changes(
    pristine, tmp_path, damage, kind, words
):
    root = _copy(pristine, tmp_path)
    newest = root / F.NEWEST_DIR
    damage(newest, tmp_path)
    model, opt, sched, scaler = F.make_run(7)
    before = F.state_of(model, opt, sched, scaler)
    with pytest.raises(kind) as info:
        guardrails.resume(newest, model, opt, scheduler=sched, scaler=scaler)
    message = str(info.value)
    for word in words:
        assert word in message, (word, message)
    assert F.same(before, F.state_of(model, opt, sched, scaler))  # nothing applied
    if kind is guardrails.CheckpointError:
        # Damaged, not another model's: a resume from the root continues from the
        # previous one, saying which it skipped and why.
        got = guardrails.resume(root, model, opt, scheduler=sched, scaler=scaler)
        assert got["step"] == F.PREVIOUS
        assert F.same(model.state_dict(), pristine.weights[F.PREVIOUS])


def test_another_torch_versions_state_may_differ_by_a_key_but_not_be_empty(pristine, tmp_path):
    # A checkpoint from another torch version: its classes' states may gain or lose a
    # key between versions, which load_state_dict handles; no false alarm for that.
    root = _copy(pristine, tmp_path)
    newest = root / F.NEWEST_DIR
    F._edit_json("scheduler.json", F._drop(("gamma",)))(newest, tmp_path)
    m = F._manifest(newest)
    m["torch"] = "2.8.0"
    F._write_manifest(newest, m)
    model, opt, sched, scaler = F.make_run(7)
    assert guardrails.resume(newest, model, opt, scheduler=sched, scaler=scaler)["step"] == 4
    assert sched.last_epoch == 4 and sched.gamma == 0.5
    # ...but an empty state, or a key that replaces the scheduler's optimizer, still is.
    for edit in (lambda doc: {}, F._set(("optimizer",), None)):
        shutil.rmtree(newest)
        shutil.copytree(pristine.root / F.NEWEST_DIR, newest)
        F._edit_json("scheduler.json", edit)(newest, tmp_path)
        m = F._manifest(newest)
        m["torch"] = "2.8.0"
        F._write_manifest(newest, m)
        model, opt, sched, scaler = F.make_run(7)
        with pytest.raises(guardrails.CheckpointError, match="scheduler.json"):
            guardrails.resume(newest, model, opt, scheduler=sched, scaler=scaler)


def test_a_float_saved_at_another_width_still_loads(pristine, tmp_path):
    # A run moved to bf16 resumes its fp32 checkpoint (converted by load_state_dict):
    # a width change is not a kind change.
    root = _copy(pristine, tmp_path)
    model = F.make_run(7)[0]
    model.to(torch.bfloat16)
    got = guardrails.resume(root / F.NEWEST_DIR, model)
    assert got["step"] == F.NEWEST
    assert next(model.parameters()).dtype == torch.bfloat16
    assert json.loads((root / F.NEWEST_DIR / "manifest.json").read_text())["step"] == 4


def test_a_group_key_another_object_put_there_is_not_required(pristine, tmp_path):
    # A scheduler writes `initial_lr` into the optimizer's groups when it is built: a
    # checkpoint saved before there was one lacks it rightly (the step never reads it).
    root = _copy(pristine, tmp_path)
    newest = root / F.NEWEST_DIR
    F._edit_json("optimizer.json", F._drop(("param_groups", 0, "initial_lr")))(newest, tmp_path)
    model, opt, sched, scaler = F.make_run(7)
    assert "initial_lr" in opt.param_groups[0]
    assert guardrails.resume(newest, model, opt, scheduler=sched, scaler=scaler)["step"] == 4
