"""Loops as users write them around the guard, stopped by a real SIGTERM and resumed
with the same command (tests/user_loop_worker.py): their own epoch loop, an EMA of the
model, batches from the loop's own ``torch.Generator``, and re-running a finished
script. Each compares, bitwise, the final state of the resumed run against one never
interrupted, or checks the warning that tells how to write the loop.
"""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import assert_state_equal, read_events, run_worker

WORKER = Path(__file__).resolve().parents[1] / "user_loop_worker.py"
SIGTERM_EXIT = 128 + signal.SIGTERM


def _run(run_dir: Path, out: Path, *args: object) -> subprocess.CompletedProcess[str]:
    return run_worker(WORKER, run_dir, out, *args)


def _straight_and_resumed(
    tmp_path: Path, *args: object, stop_at: int
) -> tuple[dict, dict, subprocess.CompletedProcess[str]]:
    """The worker run to its end, and run again in another run_dir SIGTERMed after
    ``stop_at`` then re-run with the same command: both final states and the re-run."""
    straight = _run(tmp_path / "a", tmp_path / "a.pt", *args)
    assert straight.returncode == 0, straight.stderr
    stopped = _run(tmp_path / "b", tmp_path / "b.pt", *args, "--sigterm-at", stop_at)
    assert stopped.returncode == SIGTERM_EXIT, stopped.stderr
    resumed = _run(tmp_path / "b", tmp_path / "b.pt", *args)
    assert resumed.returncode == 0, resumed.stderr
    assert [e["step"] for e in read_events(tmp_path / "b") if e["kind"] == "resumed"] == [stop_at]
    a = torch.load(tmp_path / "a.pt", weights_only=False)
    b = torch.load(tmp_path / "b.pt", weights_only=False)
    return a, b, resumed


def _warnings(run_dir: Path) -> list[dict]:
    """Warnings besides the stop itself."""
    return [
        e for e in read_events(run_dir) if e.get("level") == "warning" and e["kind"] != "stopped"
    ]


# ------------------------------------------------------------ the user's epoch loop


@pytest.mark.slow(reason="3 runs: straight, stopped, resumed")
def test_epoch_loop_counting_from_zero_is_told_at_step_1_and_at_the_resumed_pass(tmp_path):
    # for epoch in range(3): for batch in g: -- resumed in epoch 1, the loop makes three
    # passes after the resume begins: 8 steps more than the 24 of 3 epochs of 8 batches.
    a, b, resumed = _straight_and_resumed(tmp_path, "--loop", "range", stop_at=12)
    assert (a["step"], a["epoch"]) == (24, 3)
    assert (b["step"], b["epoch"]) == (32, 4)  # the loop's own bound: not the guard's to cut
    # Told first at the first run's first step, read from the loop's source: in time to
    # fix the loop before a resume.
    for run in ("a", "b"):
        (early,) = [e for e in read_events(tmp_path / run) if e["kind"] == "epoch_loop_from_zero"]
        assert early["step"] == 1 and early["variable"] == "epoch"
        assert "`for epoch in range(args.epochs):` (user_loop_worker.py:" in early["message"]
        assert "`for epoch in range(g.epoch, n_epochs):`" in early["message"]
    # The resumed run says it at its resumed pass (how many passes more), not twice.
    (warned,) = [e for e in read_events(tmp_path / "b") if e["kind"] == "epoch_loop_restarted"]
    assert warned["step"] == 12 and (warned["variable"], warned["value"]) == ("epoch", 0)
    assert "`for epoch in range(g.epoch, n_epochs):`" in warned["message"]
    assert "epoch_loop_restarted" in resumed.stderr
    # Told at the resumed pass, before it trained a step: the first event after the resume.
    kinds = [e["kind"] for e in read_events(tmp_path / "b")]
    assert kinds[kinds.index("resumed") :].index("epoch_loop_restarted") < kinds[
        kinds.index("resumed") :
    ].index("end")
    # Never on the run that was not interrupted.
    assert not [e for e in read_events(tmp_path / "a") if e["kind"] == "epoch_loop_restarted"]


@pytest.mark.slow(reason="3 runs: straight, stopped, resumed")
def test_epoch_loop_counting_from_g_epoch_resumes_bitwise_and_silent(tmp_path):
    a, b, resumed = _straight_and_resumed(tmp_path, "--loop", "g_epoch", stop_at=12)
    assert (a["step"], a["epoch"]) == (b["step"], b["epoch"]) == (24, 3)
    assert_state_equal(a, b)
    for run in ("a", "b"):
        assert not _warnings(tmp_path / run), _warnings(tmp_path / run)
    assert "epoch_loop_restarted" not in resumed.stderr


# ------------------------------------------------------------------------ an EMA


@pytest.mark.slow(reason="3 runs: straight, stopped, resumed")
def test_ema_passed_with_the_model_resumes_bitwise_without_a_warning(tmp_path):
    # torch.optim.swa_utils.AveragedModel updated each step: guard([model, ema], ...)
    # saves it with the model; its parameters are not in the optimizer by design.
    a, b, _ = _straight_and_resumed(tmp_path, "--ema", "passed", stop_at=12)
    assert a["ema"]["n_averaged"].item() == 24
    assert_state_equal(a, b)
    for run in ("a", "b"):
        assert not _warnings(tmp_path / run), _warnings(tmp_path / run)


@pytest.mark.slow(reason="a guarded run in a subprocess, stopped by SIGTERM")
def test_ema_kept_but_not_passed_is_named_at_step_1_before_the_sigterms_save(tmp_path):
    # No periodic saves: the SIGTERM's save is the first, and it leaves the EMA out.
    stopped = _run(tmp_path / "r", tmp_path / "r.pt", "--ema", "kept", "--sigterm-at", 3)
    assert stopped.returncode == SIGTERM_EXIT, stopped.stderr
    events = read_events(tmp_path / "r")
    (warned,) = [e for e in events if e["kind"] == "ema_not_saved"]
    assert warned["step"] == 1 and warned["modules"] == ["ema"]
    assert "`ema` (AveragedModel, user_loop_worker.py, main())" in warned["message"]
    assert "guard([model, ema], ...)" in warned["message"]
    kinds = [e["kind"] for e in events]
    assert kinds.index("ema_not_saved") < kinds.index("checkpoint")
    assert "ema_not_saved" in stopped.stderr


def test_ema_parameters_are_not_the_steps_gradients(tmp_path):
    # The step's grad norm is over the trained parameters only: a loop that clips
    # model.parameters() shares its norm with the guard, EMA or not.
    import guardrails

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    ema = torch.optim.swa_utils.AveragedModel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guardrails.guard([model, ema], opt, run_dir=tmp_path, progress=False) as g:
        for _ in range(3):
            model(torch.randn(8, 4)).pow(2).mean().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            ema.update_parameters(model)
    assert g.clip_norm_steps == 3
    assert not _warnings(tmp_path)


# ------------------------------------------------- the loop's own torch.Generator


@pytest.mark.slow(reason="3 runs: straight, stopped, resumed")
def test_loop_generator_passed_to_the_guard_resumes_bitwise_and_silent(tmp_path):
    # No loader: a diffusion-style loop (a SiLU MLP, an EMA), its noise and timesteps
    # drawn from the loop's own generator. The resumed run counts its FLOPs at its own
    # second step (7): the count must leave that step as it is.
    args = ("--loop", "generator", "--generators", "passed", "--steps", 12)
    args += ("--model", "diffusion", "--ema", "passed")
    a, b, _ = _straight_and_resumed(tmp_path, *args, stop_at=5)
    assert a["step"] == b["step"] == 12
    assert_state_equal(a, b)
    for run in ("a", "b"):
        assert not _warnings(tmp_path / run), _warnings(tmp_path / run)
    counted = [e["step"] for e in read_events(tmp_path / "b") if e["kind"] == "flops"]
    assert counted == [2, 7]


@pytest.mark.slow(reason="3 runs: straight, stopped, resumed")
def test_loop_generator_not_passed_is_named_at_the_first_step(tmp_path):
    args = ("--loop", "generator", "--steps", 12)
    a, b, _ = _straight_and_resumed(tmp_path, *args, stop_at=5)
    assert not torch.equal(a["gen"], b["gen"])  # what the warning is about
    warned = [e for e in read_events(tmp_path / "b") if e["kind"] == "generator_not_saved"]
    # At each run's first step: before the stop's save (the run's only one), in time.
    assert [e["step"] for e in warned] == [1, 6]
    assert warned[0]["generators"] == ["gen"]
    assert 'guard(..., generators={"gen": gen})' in warned[0]["message"]
    assert "user_loop_worker.py, main()" in warned[0]["message"]


def test_generator_that_only_built_the_data_before_the_guard_is_not_named(tmp_path):
    # Drawn from before the guard started (the dataset), never in the loop.
    import guardrails

    data_gen = torch.Generator().manual_seed(5)
    xs = torch.randn(2, 8, 4, generator=data_gen)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guardrails.guard(model, opt, run_dir=tmp_path, progress=False) as g:
        for x in xs:
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        g.save_checkpoint()
    assert not _warnings(tmp_path)


# ------------------------------------------ what checkpoints leave out, told at step 1


def _loop_keeping_state(run_dir: Path, passed: bool) -> None:
    """A loop as users write it, in-process: an LR scheduler, noise from its own
    ``torch.Generator``, an ``AveragedModel`` and an EMA copy of its own updated each
    step, a frozen copy of the model (a distillation teacher), and an epoch loop,
    ``range(2)`` unless everything is ``passed`` to the guard."""
    import copy

    import guardrails

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    noise = torch.Generator().manual_seed(1)
    ema = torch.optim.swa_utils.AveragedModel(model)
    own_ema = copy.deepcopy(model).requires_grad_(False)
    teacher = copy.deepcopy(model).requires_grad_(False)
    loader = [torch.randn(8, 4) for _ in range(3)]
    knobs: dict = {"run_dir": run_dir, "progress": False}
    models: list = [model]
    if passed:
        knobs |= {"scheduler": sched, "generators": {"noise": noise}}
        models = [model, ema, own_ema]

    def step(x: torch.Tensor) -> None:
        with torch.no_grad():
            target = teacher(x)
        out = model(x) + torch.randn(1, generator=noise)
        torch.nn.functional.mse_loss(out, target).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        ema.update_parameters(model)
        with torch.no_grad():  # an EMA of its own, the old way: .data leaves no trace
            for e, p in zip(own_ema.parameters(), model.parameters(), strict=True):
                e.data.mul_(0.9).add_(p.data, alpha=0.1)

    with guardrails.guard(models, opt, loader, **knobs) as g:
        if passed:
            for epoch in range(g.epoch, 2):  # noqa: B007 (as users write it)
                for x in g:
                    step(x)
        else:
            for epoch in range(2):  # noqa: B007
                for x in g:
                    step(x)


def test_what_checkpoints_leave_out_is_named_at_the_first_step_with_the_fix(tmp_path, caplog):
    # No periodic saves: the first save would be a SIGTERM's, too late to fix the loop.
    _loop_keeping_state(tmp_path, passed=False)
    events = read_events(tmp_path)
    assert not [e for e in events if e["kind"] == "checkpoint"]
    warned = {e["kind"]: e for e in _warnings(tmp_path)}
    assert set(warned) == {
        "scheduler_not_saved",
        "generator_not_saved",
        "ema_not_saved",
        "epoch_loop_from_zero",
    }, warned
    assert all(e["step"] == 1 for e in warned.values()), warned
    assert "guard(..., scheduler=sched)" in warned["scheduler_not_saved"]["message"]
    assert 'generators={"noise": noise}' in warned["generator_not_saved"]["message"]
    ema = warned["ema_not_saved"]
    assert ema["modules"] == ["ema", "own_ema"]  # the frozen teacher is not an EMA
    assert "guard([model, ema, own_ema], ...)" in ema["message"]
    assert "(AveragedModel, test_user_loops.py, step()" not in ema["message"]
    assert "`ema` (AveragedModel, test_user_loops.py, _loop_keeping_state())" in ema["message"]
    loop = warned["epoch_loop_from_zero"]
    assert "`for epoch in range(2):` (test_user_loops.py:" in loop["message"]
    assert "`for epoch in range(g.epoch, n_epochs):`" in loop["message"]
    said = caplog.text  # the console's lines (pytest holds the stderr handler's records)
    for kind in warned:
        assert f"[rank 0 step 1] {kind}: " in said, said


def test_what_the_loop_passes_to_the_guard_is_not_named(tmp_path):
    _loop_keeping_state(tmp_path, passed=True)
    assert not _warnings(tmp_path), _warnings(tmp_path)


@pytest.mark.slow(reason="7 guarded loops, one per shape")
def test_epoch_loops_that_count_from_the_guards_epoch_are_not_told(tmp_path):
    # while g.epoch < n; one pass, no epoch loop; a range that stops on g.epoch itself;
    # a range of the passes left; one that skips the passes done; a loop over something
    # else than a range.
    import guardrails

    def run(name: str, shape: str) -> list[dict]:
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = [torch.randn(8, 4) for _ in range(2)]
        with guardrails.guard(model, opt, loader, run_dir=tmp_path / name, progress=False) as g:

            def train(x: torch.Tensor) -> None:
                model(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()

            if shape == "while":
                while g.epoch < 2:
                    for x in g:
                        train(x)
            elif shape == "once":
                for x in g:
                    train(x)
            elif shape == "break":
                for _ in range(100):
                    if g.epoch >= 2:
                        break
                    for x in g:
                        train(x)
            elif shape == "left":
                for _ in range(2 - g.epoch):
                    for x in g:
                        train(x)
            elif shape == "left_var":
                left = 2 - g.epoch
                for _ in range(left):
                    for x in g:
                        train(x)
            elif shape == "skip":
                start = g.epoch
                for epoch in range(2):
                    if epoch < start:
                        continue
                    for x in g:
                        train(x)
            else:
                for _ in ("a", "b"):
                    for x in g:
                        train(x)
        assert g.step >= 2
        return _warnings(tmp_path / name)

    for shape in ("while", "once", "break", "left", "left_var", "skip", "tuple"):
        warned = run(shape, shape)
        assert not warned, (shape, warned)


# --------------------------------------------------- re-running a finished script


def test_rerun_of_a_run_that_finished_without_saving_says_it_trains_again(tmp_path):
    finished = _run(tmp_path / "run", tmp_path / "a.pt")  # no periodic saves
    assert finished.returncode == 0, finished.stderr
    assert not (tmp_path / "run" / "checkpoints").exists() or not any(
        (tmp_path / "run" / "checkpoints").iterdir()
    )
    again = _run(tmp_path / "run", tmp_path / "b.pt")
    assert again.returncode == 0, again.stderr
    (warned,) = [e for e in read_events(tmp_path / "run") if e["kind"] == "finished_run_not_saved"]
    assert warned["step"] == 0 and warned["finished_step"] == 24
    assert "checkpoint={'every_n_steps': N}" in warned["message"]
    assert "finished_run_not_saved" in again.stderr
    # What it says: the same training again, from step 0.
    assert_state_equal(
        torch.load(tmp_path / "a.pt", weights_only=False),
        torch.load(tmp_path / "b.pt", weights_only=False),
    )


def test_rerun_of_a_run_that_saved_resumes_as_finished_and_silent(tmp_path):
    for out in ("a.pt", "b.pt"):
        done = _run(tmp_path / "run", tmp_path / out, "--every", 5)
        assert done.returncode == 0, done.stderr
    assert [e["step"] for e in read_events(tmp_path / "run") if e["kind"] == "resumed"] == [24]
    kinds = {e["kind"] for e in read_events(tmp_path / "run")}
    assert "finished_run_not_saved" not in kinds
    # A first run in a fresh directory says nothing either.
    fresh = _run(tmp_path / "other", tmp_path / "c.pt", "--sigterm-at", 3)
    assert fresh.returncode == SIGTERM_EXIT
    assert "finished_run_not_saved" not in {e["kind"] for e in read_events(tmp_path / "other")}
