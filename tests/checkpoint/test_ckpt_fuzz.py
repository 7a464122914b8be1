"""Checkpoints that verify themselves: a seeded, bounded fuzz over a real checkpoint.

A real guarded run (small model, AdamW, StepLR, an enabled GradScaler, a DataLoader
mid-epoch, the NaN guard's statistics) writes step_2 and step_4; copies of it get
step_4 damaged (truncations, bit and byte flips, deleted files, edited manifest fields
with and without their checksum recomputed, schema violations, files whose every
checksum agrees but whose content is wrong, unlisted files, links, FIFOs, directories,
planted DCP metadata, a data position no loader reaches, a newer format), and each copy
is resumed four ways: ``resume(root)``, ``resume(step_dir)``, ``guard(resume="auto")``
in a real loop, and ``inspect``. What each way must do is in ``_ckpt_fuzz.py``: only a
``CheckpointError`` / ``ResumeError`` escapes, naming the file and the field; nothing
is modified by a refused resume; a resume from the root falls back to step_2 and says
which checkpoint it skipped and why; ``inspect`` reports the reason; nothing hangs.

The suite runs a stratified sample (every kind of damage, a few cases each; the same
cases at every run); ``benchmarks/ckpt_fuzz.py`` runs them all and counts them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import _ckpt_fuzz as F
import pytest
import torch
from conftest import patience, read_events

import guardrails

ROOT = Path(__file__).resolve().parents[2]
SEED = 20
#: Cases per kind of damage in the suite's sample (the benchmark runs every case).
PER_KIND = 8


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return F.pristine(tmp_path_factory.mktemp("fuzz") / "pristine")


def _sample(cases: list[F.Case], per_kind: int, seed: int) -> list[F.Case]:
    """Up to ``per_kind`` cases of each kind, drawn with ``seed`` (every kind present)."""
    rng = random.Random(seed)
    kinds: dict[str, list[F.Case]] = {}
    for c in cases:
        kinds.setdefault(c.kind, []).append(c)
    out = []
    for group in kinds.values():
        out += rng.sample(group, min(per_kind, len(group)))
    return out


def _run(cases, pristine, tmp_path, ways):
    outcomes = []
    for i, case in enumerate(cases):
        outcomes += F.run_case(
            case, pristine, tmp_path / f"case{i}", ways=ways, timeout_s=patience(20)
        )
    per_kind, per_way, problems = F.summarize(outcomes)
    return per_kind, per_way, problems


@pytest.mark.slow(reason="resumes from many damaged checkpoints: ~3 CPU-s")
def test_damaged_checkpoints_resume_cleanly_or_are_refused_by_name(pristine, tmp_path):
    """``resume(root)``, ``resume(step_dir)`` and ``inspect`` on a sample of every kind of
    damage: the newest loads (harmless damage), the previous one loads with a warning
    naming the skipped checkpoint and why, or a CheckpointError / ResumeError names
    the file and the field with every live object bitwise as it was. Before this, 118
    raw exceptions (ValueError, JSONDecodeError, SafetensorError, OverflowError...),
    followed links, a FIFO that hung inspect, and edited manifests that loaded."""
    cases = F.cases(random.Random(SEED), F.sizes_of(pristine), flips_per_file=2)
    chosen = _sample(cases, PER_KIND, SEED)
    per_kind, per_way, problems = _run(
        chosen, pristine, tmp_path, ("resume(root)", "resume(step)", "inspect")
    )
    assert not problems, "\n".join(problems[:40])
    kinds = {c.kind for c in cases}
    assert set(per_kind) == kinds and len(kinds) >= 14, per_kind
    # Each outcome the fuzz is built to reach was reached.
    assert per_way[("resume(root)", "previous")] > 0 and per_way[("resume(root)", "newest")] > 0
    assert per_way[("resume(step)", "CheckpointError")] > 0
    assert per_way[("resume(step)", "ResumeError")] > 0
    assert per_way[("inspect", "invalid")] > 0 and per_way[("inspect", "valid")] > 0


@pytest.mark.slow(reason="a guarded run per damaged checkpoint")
def test_damaged_checkpoints_under_a_real_guarded_loop(pristine, tmp_path):
    """``guard(..., resume="auto")`` and two steps of a real loop, one case of each kind
    and every data-position case: the run starts from step_2 past a damaged step_4
    (a ``checkpoint_invalid`` event names it and why), from step_4 when the damage is
    harmless, or refuses to start with nothing modified (a newer format, a data
    position of 10**12 batches in an 8-batch loader: at once, not fast-forwarding)."""
    cases = F.cases(random.Random(SEED), F.sizes_of(pristine), flips_per_file=1)
    chosen = _sample([c for c in cases if c.kind != "loader"], 1, SEED)
    chosen += [c for c in cases if c.kind == "loader"]
    t0 = time.perf_counter()
    _, per_way, problems = _run(chosen, pristine, tmp_path, ("guard",))
    assert not problems, "\n".join(problems[:40])
    assert per_way[("guard", "previous")] > 0 and per_way[("guard", "ResumeError")] >= 3
    # The 10**12-batch position ended at once (the deadline per case is 20 s).
    assert time.perf_counter() - t0 < 20 * len(chosen)


def test_inspect_answers_on_a_fifo_named_manifest_json(pristine, tmp_path):
    """``python -m guardrails inspect`` never opens a FIFO (it blocked until a writer
    came): the checkpoint is invalid, named, and the previous one is what resume uses."""
    root = tmp_path / "run" / "checkpoints"
    shutil.copytree(pristine.root, root)
    manifest = root / F.NEWEST_DIR / "manifest.json"
    manifest.unlink()
    os.mkfifo(manifest)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "guardrails", "inspect", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=patience(60),
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert f"why: {manifest} is not a regular file (it is a FIFO)" in proc.stdout, proc.stdout
    assert proc.stdout.rstrip().endswith(str(root / F.PREVIOUS_DIR)), proc.stdout


class Batches:
    """An iterable without a length: 8 batches per pass (as a generator-backed loader)."""

    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        for _ in range(F.LOADER_LEN):
            yield torch.randn(8, 4, generator=g), torch.randn(8, generator=g)


def test_a_position_past_a_loader_without_length_ends_when_it_runs_out(tmp_path):
    """A loader without ``len()`` cannot be checked before the resume; fast-forwarding it
    to a position of 10**12 batches (an edited checkpoint) stops when the loader runs
    out, with a ResumeError naming both numbers, instead of never ending."""
    run_dir = tmp_path / "run"
    model, opt, sched, scaler = F.make_run(0)
    with guardrails.guard(
        model, opt, Batches(), run_dir=run_dir, checkpoint={"every_n_steps": 4}, **F.GUARD_KNOBS
    ) as g:
        for x, y in g:
            F.train_step(model, opt, sched, scaler, x, y)
            if g.step == 4:
                break
    ckpt = run_dir / "checkpoints" / F.NEWEST_DIR
    doc = json.loads((ckpt / "rank00000.json").read_text())
    assert doc["data"]["kind"] == "fast_forward" and doc["data"]["batch_in_epoch"] == 4
    doc["data"]["batch_in_epoch"] = 10**12
    F._edit_json("rank00000.json", lambda d: doc)(ckpt, tmp_path)
    model, opt, sched, scaler = F.make_run(1)
    limit = patience(60)  # "instead of never ending": 60 s on an idle machine
    t0 = time.perf_counter()
    with (
        F.deadline(limit),
        pytest.raises(guardrails.ResumeError) as err,
        guardrails.guard(model, opt, Batches(), run_dir=run_dir, **F.GUARD_KNOBS) as g,
    ):
        for _ in g:
            pass
    assert time.perf_counter() - t0 < limit
    msg = str(err.value)
    assert "1000000000000 batches" in msg and f"exhausted after {F.LOADER_LEN}" in msg, msg
    assert err.value.field == "data.batch_in_epoch"


def test_a_healthy_resume_says_nothing_and_reads_only_listed_files(pristine, tmp_path, caplog):
    """No false alarms: resuming an intact checkpoint (one with an unlisted file beside
    it, which is never read) logs no warning and writes no warning event."""
    run_dir = tmp_path / "run"
    shutil.copytree(pristine.root, run_dir / "checkpoints")
    # A damaged model file the manifest does not list, in a subdirectory: never read.
    (run_dir / "checkpoints" / F.NEWEST_DIR / "old").mkdir()
    (run_dir / "checkpoints" / F.NEWEST_DIR / "old" / "model.safetensors").write_bytes(b"\xff")
    model, opt, sched, scaler = F.make_run(1)
    with caplog.at_level(logging.WARNING, logger="guardrails"):
        assert guardrails.resume(run_dir / "checkpoints", model, opt)["step"] == F.NEWEST
        with guardrails.guard(
            model,
            opt,
            F.make_loader(),
            scheduler=sched,
            scaler=scaler,
            run_dir=run_dir,
            checkpoint={"save_on_signal": False},
            **F.GUARD_KNOBS,
        ) as g:
            assert g.step == F.NEWEST
            for n, (x, y) in enumerate(g):
                F.train_step(model, opt, sched, scaler, x, y)
                if n == 1:
                    break
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    warnings = [e for e in read_events(run_dir) if e.get("level") == "warning"]
    assert not warnings, warnings


def test_a_model_file_the_manifest_does_not_list_is_never_loaded(pristine, tmp_path):
    """Only listed files are read: with model.safetensors dropped from the manifest (its
    checksum recomputed) and the file replaced by other weights, the resume says the
    checkpoint holds no model, and the model is as it was (the file was loaded
    unverified before)."""
    root = tmp_path / "checkpoints"
    shutil.copytree(pristine.root, root)
    ckpt = root / F.NEWEST_DIR
    manifest = json.loads((ckpt / "manifest.json").read_text())
    del manifest["files"]["model.safetensors"]
    F._write_manifest(ckpt, manifest)
    other, *_ = F.make_run(99)
    from safetensors.torch import save_file

    save_file(other.state_dict(), str(ckpt / "model.safetensors"))
    model, opt, sched, scaler = F.make_run(1)
    before = F.state_of(model, opt, sched, scaler)
    with pytest.raises(guardrails.ResumeError, match="holds no model state"):
        guardrails.resume(ckpt, model, opt, scheduler=sched, scaler=scaler)
    assert F.same(before, F.state_of(model, opt, sched, scaler))
    assert not F.same(model.state_dict(), other.state_dict())
    # The file's checksum never mattered: it is not part of the checkpoint.
    digest = hashlib.sha256((ckpt / "model.safetensors").read_bytes()).hexdigest()
    assert digest not in (ckpt / "manifest.json").read_text()


class HistoryScheduler:
    """A user's scheduler whose state grows (a history of lrs): a fresh one's state is
    no template for a saved one."""

    def __init__(self, opt):
        self.opt, self.history = opt, []

    def step(self):
        self.history.append(self.opt.param_groups[0]["lr"])

    def state_dict(self):
        return {"history": list(self.history)}

    def load_state_dict(self, state):
        self.history = list(state["history"])


def _schedulers(opt):
    lr = torch.optim.lr_scheduler
    return {
        "step": lr.StepLR(opt, step_size=2, gamma=0.5),
        "onecycle": lr.OneCycleLR(  # cycles betas / momentum where the class has them
            opt,
            max_lr=0.1,
            total_steps=20,
            cycle_momentum=bool({"betas", "momentum"} & opt.defaults.keys()),
        ),
        "plateau": lr.ReduceLROnPlateau(opt, patience=1),
        "sequential": lr.SequentialLR(
            opt, [lr.LinearLR(opt, 0.1, total_iters=2), lr.ExponentialLR(opt, 0.9)], [2]
        ),
        "restarts": lr.CosineAnnealingWarmRestarts(opt, T_0=2),
        "multistep": lr.MultiStepLR(opt, milestones=[1, 3]),  # int-keyed: scheduler.pt
        "history": HistoryScheduler(opt),
    }


@pytest.mark.parametrize(
    "cls",
    [
        *("Adam", "AdamW", "SGD", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam"),
        *("RMSprop", "Rprop", "ASGD", "Adafactor", "Muon"),
    ],
)
def test_every_torch_optimizer_and_scheduler_resumes_without_a_false_alarm(tmp_path, cls):
    """The content checks know the plain torch.optim classes' states (tensors and
    numbers; elementwise ones of their parameter's shape; NAdam's mu_product is a
    scalar): a checkpoint of each, with schedulers of several kinds (one whose state
    grows), verifies and resumes, and the resumed state is the saved one."""

    def build(seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 3))
        kw = {"momentum": 0.9} if cls in ("SGD", "RMSprop") else {}
        if cls == "Muon":  # 2-D parameters only
            model = torch.nn.Sequential(torch.nn.Linear(4, 6, bias=False))
        opt = getattr(torch.optim, cls)(model.parameters(), lr=0.01, **kw)
        return model, opt, _schedulers(opt)

    model, opt, scheds = build(0)
    for _ in range(3):
        model(torch.randn(5, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        for name, s in scheds.items():
            s.step(1.0) if name == "plateau" else s.step()
    ckpt = guardrails.save_checkpoint(tmp_path, 3, model=model, optimizer=opt, scheduler=scheds)
    from guardrails.checkpoint.read import verify_checkpoint

    assert verify_checkpoint(ckpt) is None
    model2, opt2, scheds2 = build(1)
    guardrails.resume(ckpt, model2, opt2, scheduler=scheds2)
    assert F.same(opt2.state_dict(), opt.state_dict())
    assert F.same(model2.state_dict(), model.state_dict())
    for name, s in scheds.items():
        assert F.same(scheds2[name].state_dict(), s.state_dict()), name
