"""A user re-runs their script in the same run_dir (issue 19): resume="auto" finds the
previous run's checkpoints. A finished run is said, a changed config is refused before
anything is restored, every resume is announced once on the console, an optimizer
setting the resume puts back over the code's is named, and healthy resumes (the same
settings, LR schedulers moving lr) stay silent. Real scripts in real processes, real
files, real signals."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from _loops import train_loop_signalled
from conftest import Regressor, batches, read_events, run_script, train_loop
from torch import nn

import guardrails
from guardrails.checkpoint.manifest import _self_hash, list_checkpoints
from guardrails.checkpoint.read import verify_checkpoint

ROOT = Path(__file__).resolve().parents[2]

# A user's script: a DataLoader over a map-style dataset (resumes by replay, so the
# only lines on stderr are the guard's own), an epoch loop counted from g.epoch,
# periodic saves, the config given to the guard; it writes its final weights. Saves
# wait for the previous one (strict_cadence): a toy step is faster than a write, and a
# skipped save would make the checkpoints, and its warning the console, timing-dependent;
# memory=False: its step-time detectors (data starvation) read a toy step on the suite's
# loaded cores, and the console lines asserted on here are the resume's.
SCRIPT = textwrap.dedent(
    """
    import json, logging, os, signal, sys
    import torch
    from torch import nn
    import guardrails

    args = json.loads(sys.argv[1])
    if args.get("log_info"):
        logging.basicConfig(level=logging.INFO, format="LOG %(message)s")
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=args["lr"], momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    gen = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(40, 4, generator=gen), torch.randn(40, 1, generator=gen)
    )
    loader = torch.utils.data.DataLoader(
        data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(1)
    )
    with guardrails.guard(
        model, opt, loader, scheduler=sched, run_dir=args["run_dir"],
        config={"lr": args["lr"], "model": {"width": 4}},
        checkpoint={"every_n_steps": args["every"], "strict_cadence": True},
        progress=False, memory=False,
    ) as g:
        print("start step", g.step, flush=True)
        for epoch in range(g.epoch, args["epochs"]):
            for x, y in g:
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
                sched.step()
                if g.step == args.get("sigterm_at"):  # a pre-emption
                    os.kill(os.getpid(), signal.SIGTERM)
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, args["out"])
    print("end step", g.step, flush=True)
    """
)


def user_run(tmp_path: Path, ok: bool = True, **args) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    args = {
        "lr": 0.1,
        "epochs": 2,
        "every": 5,
        "run_dir": "run",  # relative, as a user writes it
        "out": str(tmp_path / "final.pt"),
        **args,
    }
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("CI", None)
    proc = run_script(
        [sys.executable, script, json.dumps(args)], timeout_s=240, env=env, cwd=tmp_path
    )
    assert (proc.returncode == 0) == ok, proc.stdout + proc.stderr
    return proc


def warnings_in(run_dir: Path, *, last_run: bool = False) -> list[dict]:
    """The warning events in ``run_dir`` (``last_run``: of its last run only)."""
    events = read_events(run_dir)
    if last_run:
        start = max(i for i, e in enumerate(events) if e["kind"] == "start")
        events = events[start:]
    return [e for e in events if e["level"] == "warning"]


def manifest(ckpt: Path) -> dict:
    return json.loads((ckpt / "manifest.json").read_text())


def files_of(root: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``root``: its bytes and modification time, to show that
    nothing was written."""
    return {
        str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


# --------------------------------------------------------------------- finished runs


@pytest.mark.slow(reason="3 training processes")
def test_rerunning_a_finished_run_says_so_and_that_it_trained_nothing(tmp_path):
    # 5 batches a pass, 2 passes: 10 steps, saved every 5. The save at step 10 is
    # committed before the loop learns that the data ran out: the mark comes after.
    first = user_run(tmp_path)
    assert "end step 10" in first.stdout
    assert first.stderr == ""  # a fresh run: nothing on the console
    assert warnings_in(tmp_path / "run") == []
    ckpt = list_checkpoints(tmp_path / "run" / "checkpoints")[-1][1]
    assert ckpt.name == "step_000000010"
    marked = manifest(ckpt)["run"]["finished_at"]
    assert isinstance(marked, float)
    assert verify_checkpoint(ckpt) is None  # the marked manifest is still valid
    weights = torch.load(tmp_path / "final.pt")

    again = user_run(tmp_path)  # the same command: its epoch loop ends at once
    assert "start step 10" in again.stdout and "end step 10" in again.stdout
    lines = again.stderr.splitlines()
    resumed = [line for line in lines if "resumed from" in line]
    assert len(resumed) == 1, again.stderr
    assert resumed[0].startswith(f"guardrails: resumed from {ckpt.relative_to(tmp_path)} ")
    assert "(step 10): the end of a run that finished" in resumed[0]
    assert "run_dir of its own" in resumed[0]
    nothing = [line for line in lines if "nothing_trained" in line]
    assert len(nothing) == 1, again.stderr
    assert "trained no step" in nothing[0]
    assert "raise the script's step or epoch count" in nothing[0]
    assert [e["kind"] for e in warnings_in(tmp_path / "run")] == ["nothing_trained"]
    after = torch.load(tmp_path / "final.pt")
    assert all(torch.equal(weights[k], after[k]) for k in weights)
    # Nothing was saved, and the mark keeps its time.
    assert list_checkpoints(tmp_path / "run" / "checkpoints")[-1][1] == ckpt
    assert manifest(ckpt)["run"]["finished_at"] == marked

    # The user raises the epoch count to train on (legit: said, no warning); with
    # logging configured at INFO the line is the event's log record, still once.
    more = user_run(tmp_path, epochs=3, log_info=True)
    assert "start step 10" in more.stdout and "end step 15" in more.stdout
    resumed = [line for line in more.stderr.splitlines() if "resumed from" in line]
    assert len(resumed) == 1, more.stderr
    assert resumed[0].startswith("LOG ") and "continues past it" in resumed[0]
    assert warnings_in(tmp_path / "run", last_run=True) == []
    new = manifest(tmp_path / "run/checkpoints/step_000000015")["run"]["finished_at"]
    assert new > marked


@pytest.mark.slow(reason="2 training processes, the first SIGTERMed")
def test_a_resume_is_announced_once_on_the_console(tmp_path):
    # Pre-empted at step 4 (a checkpoint, not a finished run), then the same command.
    user_run(tmp_path, sigterm_at=4, ok=False)
    proc = user_run(tmp_path, sigterm_at=4)
    assert "start step 4" in proc.stdout and "end step 10" in proc.stdout
    resumed = [line for line in proc.stderr.splitlines() if "resumed from" in line]
    assert len(resumed) == 1, proc.stderr
    assert resumed[0].startswith("guardrails: resumed from run/checkpoints/step_000000004 ")
    assert "(step 4, saved " in resumed[0] and " s ago, at " in resumed[0]
    assert "finished" not in resumed[0]
    assert warnings_in(tmp_path / "run", last_run=True) == []


@pytest.mark.parametrize("every", [5, 3], ids=["last-save-at-the-end", "save-at-close"])
def test_the_checkpoint_a_run_ends_with_is_marked_finished(tmp_path, every):
    g = guarded_run_with(tmp_path, None, steps=10, every=every)
    assert g.step == 10
    found = list_checkpoints(tmp_path / "checkpoints")
    assert found[-1][0] == 10
    marks = ["finished_at" in manifest(p)["run"] for _, p in found]
    assert marks == [False] * (len(found) - 1) + [True]
    assert verify_checkpoint(found[-1][1]) is None
    assert not list((found[-1][1]).glob(".tmp-*"))  # the new manifest's temp file


def test_a_run_stopped_by_a_signal_is_not_finished(tmp_path):
    torch.manual_seed(0)
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ck = {"every_n_steps": 2, "exit_on_signal": False, "strict_cadence": True}
    with guardrails.guard(
        model, opt, batches(10), run_dir=tmp_path, progress=False, checkpoint=ck
    ) as g:
        train_loop_signalled(g, model, opt, after_step=3)
    assert g.stopping is not None and g.step == 3
    found = list_checkpoints(tmp_path / "checkpoints")
    assert found[-1][1].name == "step_000000003"
    assert all("finished_at" not in manifest(p)["run"] for _, p in found)


# --------------------------------------------------------------------- config changes


def test_a_changed_config_is_refused_before_anything_changes(tmp_path):
    guarded_run_with(tmp_path, {"lr": 0.1, "model": {"width": 8}})  # step 2
    ckpts = tmp_path / "checkpoints"
    before = files_of(ckpts)
    torch.manual_seed(7)
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    weights = [p.detach().clone() for p in model.parameters()]
    config = {"lr": 0.5, "model": {"width": 8}, "warmup": 10}
    g = guardrails.guard(model, opt, run_dir=tmp_path, config=config)
    with pytest.raises(guardrails.ResumeError) as err:
        try:
            g.start()
        finally:
            g.close()  # a guard that did start (and should not have) is not left running
    e = err.value
    assert e.changed == {"lr": (0.1, 0.5), "warmup": ("(absent)", 10)}
    assert e.step == 2 and e.path == str(ckpts / "step_000000002")
    assert pickle.loads(pickle.dumps(e)).changed == e.changed  # survives an error file
    text = str(e)
    assert "another config" in text and "lr: 0.1 -> 0.5; warmup: (absent) -> 10" in text
    assert "run_dir of its own" in e.hint and "--run-dir" in e.hint
    assert "allow_config_change" in e.hint and "Nothing was modified" in e.hint
    assert files_of(ckpts) == before
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters(), strict=True))
    assert opt.state_dict()["state"] == {} and opt.param_groups[0]["lr"] == 0.5

    # Allowing some keys to change refuses the others, the same way.
    g = guardrails.guard(
        model, opt, run_dir=tmp_path, config=config, checkpoint={"allow_config_change": ["warmup"]}
    )
    with pytest.raises(guardrails.ResumeError) as err:
        try:
            g.start()
        finally:
            g.close()
    assert err.value.changed == {"lr": (0.1, 0.5)} and "['lr']" in err.value.hint
    assert files_of(ckpts) == before
    with pytest.raises(TypeError, match="allow_config_change takes True, False or a list"):
        guardrails.guard(model, opt, checkpoint={"allow_config_change": "lr"})

    # The explicit way on: resumed, said with the changed keys, and the next
    # checkpoints hold the new config.
    with guardrails.guard(
        model,
        opt,
        run_dir=tmp_path,
        config=config,
        checkpoint={"allow_config_change": True, "every_n_steps": 1},
        progress=False,
    ) as g:
        assert g.step == 2
        for x, y in batches(2):
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
    assert g.step == 4
    resumed = [e for e in read_events(tmp_path) if e["kind"] == "resumed"]
    assert resumed[-1]["config_changed"] == ["lr", "warmup"]
    assert (
        "continues past it, with a changed config (allow_config_change): lr: 0.1 -> 0.5"
        in (resumed[-1]["message"])
    )
    saved = manifest(ckpts / "step_000000004")["run"]["config"]
    assert saved == {"lr": 0.5, "model.width": 8, "warmup": 10}


def test_config_as_a_dataclass_is_compared_key_by_key(tmp_path):
    @dataclasses.dataclass
    class Model:
        width: int = 8
        act: object = torch.tanh  # a repr with an address: not a change

    @dataclasses.dataclass
    class Config:
        lr: float = 0.1
        model: Model = dataclasses.field(default_factory=Model)
        path: Path = Path("data")

    guarded_run_with(tmp_path, Config())
    guarded_run_with(tmp_path, Config())  # the same settings: resumes
    with pytest.raises(guardrails.ResumeError) as err:
        guarded_run_with(tmp_path, Config(model=Model(width=16)))
    assert err.value.changed == {"model.width": (8, 16)}
    with pytest.raises(TypeError, match="config must be a mapping.*dataclass instance"):
        guardrails.guard(nn.Linear(1, 1), torch.optim.SGD(nn.Linear(1, 1).parameters()), config=3)


def loader(n: int) -> torch.utils.data.DataLoader:
    """``n`` batches of 8 from a map-style dataset: a resume replays its order and loads
    only what is left (a list would be fetched again, with a warning of its own)."""
    x, y = zip(*batches(n), strict=True)
    data = torch.utils.data.TensorDataset(torch.cat(x), torch.cat(y))
    return torch.utils.data.DataLoader(data, batch_size=8)


def guarded_run_with(run_dir: Path, config, *, steps: int = 2, every: int = 1) -> guardrails.Guard:
    """A Regressor trained over ``steps`` batches with ``config``, saved every ``every``."""
    torch.manual_seed(0)
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ck = {"every_n_steps": every, "strict_cadence": True}  # see SCRIPT
    with guardrails.guard(
        model, opt, loader(steps), run_dir=run_dir, config=config, checkpoint=ck, progress=False
    ) as g:
        train_loop(g, model, opt)
    return g


def test_checkpoints_saved_without_a_config_still_resume(tmp_path):
    # Written before the manifest had "run" (or by save_checkpoint()): nothing to
    # compare, the resume goes on and is announced.
    guarded_run_with(tmp_path, {"lr": 0.1})
    ckpt = tmp_path / "checkpoints" / "step_000000002"
    m = manifest(ckpt)
    del m["run"]
    m["manifest_sha256"] = _self_hash(m)
    (ckpt / "manifest.json").write_text(json.dumps(m))
    g = guarded_run_with(tmp_path, {"lr": 0.5})
    assert g.step == 2  # resumed at the end of its pass: a finished run, unmarked
    assert [e["kind"] for e in warnings_in(tmp_path)] == []
    assert [e["step"] for e in read_events(tmp_path) if e["kind"] == "resumed"] == [2]


# --------------------------------------------------------------------- optimizer settings


def adam_run(run_dir, *, lr=1e-2, weight_decay=0.1, sched="step", steps=4, signal_at=None):
    """AdamW under a scheduler, stopped by SIGTERM at ``signal_at`` (not finished)."""
    torch.manual_seed(0)
    model = Regressor()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    schedulers = {
        "step": lambda: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
        "cosine": lambda: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10),
        "warmup": lambda: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1, (s + 1) / 5)),
        "onecycle": lambda: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=20),
    }
    scheduler = schedulers[sched]()
    ck = {"exit_on_signal": False}
    with guardrails.guard(
        model,
        opt,
        loader(steps),
        scheduler=scheduler,
        run_dir=run_dir,
        checkpoint=ck,
        progress=False,
        # Its step-time detectors (data starvation) read a ~1 ms toy step on the suite's
        # loaded 2 cores; the warnings asserted on here are the resume's.
        memory=False,
    ) as g:
        # Not train_loop: a scheduler steps, a SIGTERM at `signal_at`.
        for x, y in g:
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
            scheduler.step()
            if g.step == signal_at:
                os.kill(os.getpid(), signal.SIGTERM)
    return g, opt


@pytest.mark.parametrize("sched", ["step", "cosine", "warmup", "onecycle"])
def test_a_healthy_resume_under_a_scheduler_warns_nothing(tmp_path, sched, caplog):
    # The scheduler moved lr (and OneCycle the betas) before the save: the same
    # script resumed is not a settings change.
    adam_run(tmp_path, sched=sched, steps=8, signal_at=3)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="guardrails"):
        g, _ = adam_run(tmp_path, sched=sched, steps=8)
    assert g.step == 8
    assert warnings_in(tmp_path, last_run=True) == []
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    announced = [r for r in caplog.records if "resumed from" in r.getMessage()]
    assert len(announced) == 1  # and resume() no longer logs its own line beside it


def test_optimizer_settings_that_differ_from_the_checkpoint_are_named(tmp_path, caplog):
    adam_run(tmp_path, lr=1e-2, weight_decay=0.1, steps=8, signal_at=3)  # lr 1e-2 -> 5e-3
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="guardrails"):
        g, opt = adam_run(tmp_path, lr=2e-2, weight_decay=0.0, steps=3)
    assert g.step == 3  # resumed at 3, the 3-batch loader continues its pass: no step
    [event] = warnings_in(tmp_path, last_run=True)
    assert event["kind"] == "optimizer_settings_changed"
    assert event["settings"] == [
        "group 0 lr: checkpoint 0.01, code 0.02",
        "group 0 weight_decay: checkpoint 0.1, code 0.0",
    ]
    assert "The checkpoint's values are used now" in event["message"]
    assert "base_lrs" in event["message"]  # a scheduler is attached: it holds the lr
    # ... and they are: the restored group's settings are the checkpoint's.
    assert opt.param_groups[0]["weight_decay"] == 0.1 and opt.param_groups[0]["lr"] == 5e-3
    assert sum("optimizer_settings_changed" in r.getMessage() for r in caplog.records) == 1


# --------------------------------------------------------------------- other runs' checkpoints


def test_a_checkpoint_of_another_world_size_names_a_run_dir_of_its_own(tmp_path):
    # What the README's torchrun demos met after the one-process --inject sigterm demo
    # in the same run_dir: the hint says how to resume it, and how to keep a new run
    # apart (in guard()'s terms, not with a deprecated knob).
    guarded_run_with(tmp_path, None)
    ckpt = tmp_path / "checkpoints" / "step_000000002"
    m = manifest(ckpt)
    m["world_size"] = 2
    m["manifest_sha256"] = _self_hash(m)
    (ckpt / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(guardrails.ResumeError, match="written by 2 rank") as err:
        guarded_run_with(tmp_path, None)
    hint = err.value.hint
    assert "relaunch with 2 rank(s)" in hint
    assert "checkpoint={'allow_world_size_change': True}" in hint
    assert "run_dir of its own" in hint and "--run-dir" in hint
    assert "resume_allow_world_size_change" not in hint
    # The way out it names works.
    assert guarded_run_with(tmp_path / "new", None).step == 2


def test_a_fresh_run_beside_another_runs_checkpoints_is_warned(tmp_path):
    # resume=None with periodic saves into a directory holding steps 1-2 of another
    # run: keep_last=3 would retire this run's own step 1 first, and resume="auto"
    # would later pick the other run's step 2.
    guarded_run_with(tmp_path, None)
    torch.manual_seed(0)
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ck = {"every_n_steps": 1, "keep_last": 2, "strict_cadence": True}
    with guardrails.guard(
        model, opt, batches(1), run_dir=tmp_path, resume=None, checkpoint=ck, progress=False
    ) as g:
        train_loop(g, model, opt)
    [event] = warnings_in(tmp_path)
    assert event["kind"] == "fresh_run_beside_checkpoints"
    assert "step_000000002" in event["message"] and "keep_last=2" in event["message"]
    assert "run_dir of its own" in event["message"]
    # A fresh run into an empty directory says nothing.
    with guardrails.guard(
        model,
        opt,
        batches(1),
        run_dir=tmp_path / "b",
        resume=None,
        checkpoint=ck,
        progress=False,
    ) as g:
        train_loop(g, model, opt)
    assert warnings_in(tmp_path / "b") == []


# --------------------------------------------------------------------- two ranks


@pytest.mark.slow(reason="3 runs of 2 ranks")
def test_two_ranks_rerun_said_once_and_a_changed_config_refused_on_every_rank(tmp_path):
    from _ranks import run_ranks

    worker = Path(__file__).resolve().parents[1] / "ckpt_worker.py"

    def job(*args):
        cmd = [sys.executable, worker, tmp_path / "run", tmp_path / "out", "--steps", 6]
        cmd += ["--every-n", 4]
        cmd += ["--rank", "{rank}", "--world", "{world}", "--port", "{port}", *args]
        return run_ranks(cmd, 2, out=tmp_path / "logs", timeout_s=240)

    first = job()
    assert [r.code for r in first] == [0, 0], [r.out for r in first]
    ckpts = tmp_path / "run" / "checkpoints"
    (_, early), (step, ckpt) = list_checkpoints(ckpts)
    assert step == 6 and "finished_at" in manifest(ckpt)["run"]  # marked by rank 0
    assert "finished_at" not in manifest(early)["run"]

    again = job()  # the same command: said once, on rank 0, and nothing trained
    assert [r.code for r in again] == [0, 0], [r.out for r in again]
    said = [line for line in again[0].out.splitlines() if "resumed from" in line]
    assert len(said) == 1 and "the end of a run that finished" in said[0], again[0].out
    assert "resumed from" not in again[1].out
    kinds = [(e["rank"], e["kind"]) for e in warnings_in(tmp_path / "run", last_run=True)]
    assert kinds == [(0, "nothing_trained")]

    before = files_of(ckpts)
    changed = job("--lr", "0.02")
    assert [r.code for r in changed] == [1, 1], [r.out for r in changed]
    for r in changed:
        assert "ResumeError" in r.out and "lr: 0.01 -> 0.02" in r.out, r.out
        assert "allow_config_change" in r.out
    assert files_of(ckpts) == before
