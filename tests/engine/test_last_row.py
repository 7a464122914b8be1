"""The step that ends a run keeps its metrics row, whatever ended it: NanGuard's
NonFiniteError, an exception out of the optimizer's step, a KeyboardInterrupt, a
SIGTERM the stuck main thread never answers (exit 143). Real files, read back with
``guardrails.iter_metrics``; real processes and signals where the end is the
process's."""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import sys
import textwrap

import pyarrow as pa
import pytest
import torch
from conftest import Regressor, batches, patience, reference_grad_norm, run_script

import guardrails
from guardrails import Component, NanGuard, NonFiniteError


def rows_of(run_dir) -> dict[str, list]:
    """Every row on disk (iter_metrics: each once), sorted by step; each step once."""
    table = pa.Table.from_batches(list(guardrails.iter_metrics(run_dir)))
    rows = table.sort_by("step").to_pydict()
    assert len(set(rows["step"])) == len(rows["step"]), rows["step"]  # never twice
    assert len(set(rows["started_at"])) == 1
    return rows


def train(run_dir, data, *, at_step=None, hook=None, nan=None, opt_fn=None, components=None):
    """A seeded Regressor under the default guard; ``hook`` becomes an optimizer step
    pre-hook once ``at_step - 1`` steps are done (it runs inside step ``at_step``'s
    ``optimizer.step()``). Returns what the loop computed: {step: (loss, grad norm)}."""
    torch.manual_seed(0)
    model = Regressor()
    opt = (opt_fn or (lambda p: torch.optim.AdamW(p, lr=1e-2)))(model.parameters())
    seen: dict[int, tuple[float, float]] = {}
    if components is not None:  # these alone
        g = guardrails.Guard(model, opt, data, run_dir=run_dir, components=components)
    else:
        knobs = {"nan": nan} if nan is not None else {}
        g = guardrails.guard(
            model, opt, data, run_dir=run_dir, progress=False, metrics={"every_n_steps": 5}, **knobs
        )
    with g:
        for x, y in g:
            loss = model(x, y)
            loss.backward()
            seen[g.step + 1] = (loss.item(), reference_grad_norm(model))
            if hook is not None and g.step + 1 == at_step:
                opt.register_step_pre_hook(hook)
            opt.step()
            opt.zero_grad()
    return seen


# ---------------------------------------------------------------------- NonFiniteError


@pytest.mark.parametrize("lagged", [False, True], ids=["cpu_path", "lagged_path"])
def test_a_nonfinite_error_keeps_every_steps_row_up_to_the_raising_one(
    tmp_path, monkeypatch, lagged
):
    """Steps 10 on are non-finite; max_consecutive_skips=3 raises. On the CPU path it
    raises inside step 12's optimizer.step() (before its update: no step time); on the
    lagged path (a GPU's) when step 30 reads the copy holding steps 10-12, after its
    update. Before, that raising step had no row."""
    monkeypatch.setattr(NanGuard, "_lagged_on_cpu", lagged)
    data = batches(40)
    for x, _ in data[9:]:
        x[1, 2] = math.nan
    with pytest.raises(NonFiniteError) as info:
        train(tmp_path, data, nan={"max_consecutive_skips": 3})
    assert info.value.step == 10
    last = 30 if lagged else 12
    rows = rows_of(tmp_path)
    assert rows["step"] == list(range(1, last + 1))
    assert rows["skipped"] == [False] * 9 + [True] * (last - 9)
    assert all(math.isfinite(v) for v in rows["loss"][:9] + rows["grad_norm"][:9])
    assert all(math.isnan(v) for v in rows["grad_norm"][9:])  # as computed, not invented
    end = rows["step_time_s"][-1]
    if lagged:  # its update (skipped) went through; a later hook raised
        assert end > 0
    else:  # raised out of before_step: the step never ended, its time is unknown
        assert math.isnan(end) and rows["tokens_per_s"][-1] is None
    assert all(t > 0 for t in rows["step_time_s"][:-1])
    assert rows["lr"][-1] == 1e-2 and rows["time"] == sorted(rows["time"])


# ---------------------------------------------------------------------- loop exceptions


def _raise(error):
    def hook(*_):
        raise error

    return hook


@pytest.mark.parametrize(
    "error",
    [RuntimeError("the optimizer failed"), KeyboardInterrupt()],
    ids=["runtime_error", "keyboard_interrupt"],
)
def test_an_exception_out_of_the_optimizer_step_keeps_that_steps_row(tmp_path, error):
    """The step's loss and grad norm were computed (before_step) when its optimizer
    step raised: its row holds them, unskipped, with no step time; nothing else is
    made up. Before, the last row on disk was the step before."""
    with pytest.raises(type(error)):
        train(tmp_path, batches(20), at_step=12, hook=_raise(error))
    # The same seed, run again to step 12 without the error: the values it computed.
    seen = train(tmp_path / "ref", batches(12))
    rows = rows_of(tmp_path)
    assert rows["step"] == list(range(1, 13))
    assert rows["skipped"] == [False] * 12
    assert rows["loss"][-1] == pytest.approx(seen[12][0], rel=1e-6)
    assert rows["grad_norm"][-1] == pytest.approx(seen[12][1], rel=1e-5)
    assert math.isnan(rows["step_time_s"][-1]) and rows["tokens"][-1] is None
    assert rows["data_wait_s"][-1] >= 0 and rows["lr"][-1] == 1e-2


def test_an_exception_before_the_step_has_no_row_of_its_own(tmp_path):
    """Raised between backward and optimizer.step(): the grad norm was never computed,
    so that step gets no row (none invented); every step before it has its row."""
    torch.manual_seed(0)
    model = Regressor()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(RuntimeError, match="body"):
        with guardrails.guard(model, opt, batches(20), run_dir=tmp_path, progress=False) as g:
            for x, y in g:
                model(x, y).backward()
                if g.step == 11:
                    raise RuntimeError("the loop body failed")
                opt.step()
                opt.zero_grad()
    rows = rows_of(tmp_path)
    assert rows["step"] == list(range(1, 12))
    assert all(t > 0 for t in rows["step_time_s"])


class _FailsAfterStep(Component):
    """Raises in after_step at step 12, before telemetry records it."""

    name = "fails_after_step"
    before = ("telemetry",)

    def after_step(self, guard) -> None:
        if guard.step == 12:
            raise RuntimeError(f"after_step failed at step {guard.step}")


class _FailsAfterTelemetry(_FailsAfterStep):
    """The same, after telemetry recorded the step."""

    before = ()
    after = ("telemetry",)


@pytest.mark.parametrize("first", [True, False], ids=["before_telemetry", "after_telemetry"])
def test_a_component_raising_after_the_update_gives_its_step_one_row(tmp_path, first):
    """A component that ends the run in after_step (after the update): its step has one
    row with its step time, whether telemetry's after_step ran before it (no second
    row at close) or not (the row added at close)."""
    telemetry = guardrails.Telemetry(every_n_steps=5, progress=False)
    components = [_FailsAfterStep(), telemetry] if first else [telemetry, _FailsAfterTelemetry()]
    with pytest.raises(RuntimeError, match="after_step failed at step 12"):
        train(tmp_path, batches(20), components=components)
    rows = rows_of(tmp_path)
    assert rows["step"] == list(range(1, 13))
    assert all(t > 0 for t in rows["step_time_s"])
    assert all(math.isfinite(v) for v in rows["loss"] + rows["grad_norm"])


def test_a_healthy_run_has_no_extra_row_and_no_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="guardrails"):
        seen = train(tmp_path, batches(13))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    rows = rows_of(tmp_path)
    assert rows["step"] == list(range(1, 14))
    assert all(t > 0 for t in rows["step_time_s"])
    assert rows["loss"] == pytest.approx([seen[s][0] for s in range(1, 14)], rel=1e-6)


# ---------------------------------------------------------------------- SIGTERM, stuck


@pytest.mark.slow(reason="a training process stuck for 5 s before it ends")
def test_a_sigterm_the_stuck_step_never_answers_keeps_that_steps_row(tmp_path):
    """SIGTERM while the main thread is stuck inside step 12's optimizer.step() (a C
    call that never returns in time): the signal watcher ends the process with 143
    after 5 s without progress (on_abort). Step 12's loss and grad norm were computed:
    its row is on disk, with every step before it. Before, it ended at step 11."""
    script = textwrap.dedent(
        f"""
        import os, signal, sys, time, torch
        sys.path.insert(0, {os.path.dirname(os.path.dirname(os.path.abspath(__file__)))!r})
        from conftest import Regressor, batches
        import guardrails
        torch.manual_seed(0)
        model = Regressor()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        def stuck(*_):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(60)  # the handler runs, the sleep goes on: no progress
        with guardrails.guard(model, opt, batches(40), run_dir={str(tmp_path)!r},
                              progress=False, metrics={{"every_n_steps": 5}}) as g:
            for x, y in g:
                model(x, y).backward()
                if g.step == 11:
                    opt.register_step_pre_hook(stuck)
                opt.step()
                opt.zero_grad()
        """
    )
    proc = run_script([sys.executable, "-c", script], timeout_s=120)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    assert "made no progress" in proc.stderr
    seen = train(tmp_path / "ref", batches(12))
    rows = rows_of(tmp_path)
    assert rows["step"] == list(range(1, 13))
    assert rows["skipped"] == [False] * 12
    assert rows["loss"] == pytest.approx([seen[s][0] for s in range(1, 13)], rel=1e-6)
    assert rows["grad_norm"][-1] == pytest.approx(seen[12][1], rel=1e-5)
    assert math.isnan(rows["step_time_s"][-1])
    assert all(t > 0 for t in rows["step_time_s"][:-1])


# ---------------------------------------------------------------------- resume


def _resumable(run_dir, *, fail_at: int | None) -> None:
    torch.manual_seed(0)
    model = Regressor()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with guardrails.guard(
        model,
        opt,
        batches(20),
        run_dir=run_dir,
        progress=False,
        resume="auto",
        checkpoint={"every_n_steps": 5},
        metrics={"every_n_steps": 5},
    ) as g:
        for x, y in g:
            model(x, y).backward()
            if fail_at is not None and g.step + 1 == fail_at:
                opt.register_step_pre_hook(_raise(RuntimeError("the optimizer failed")))
            opt.step()
            opt.zero_grad()


@pytest.mark.slow(reason="2 runs and a report process")
def test_a_resumed_run_sees_the_failed_runs_last_rows_once(tmp_path):
    """Run 1 fails inside step 12 (rows 1-12, the last one its own) after saving
    checkpoints every 5 steps; run 2 resumes from the last one committed (step 10, or
    5 where step 10's background write was abandoned by the failure). Each run has each
    step once, and the resumed run's story takes run 1's rows up to its resume step
    only: run 1's rows after it are not seen twice."""
    with pytest.raises(RuntimeError, match="optimizer failed"):
        _resumable(tmp_path, fail_at=12)
    _resumable(tmp_path, fail_at=None)
    proc = run_script(
        [sys.executable, "-m", "guardrails", "report", str(tmp_path), "--json"],
        timeout_s=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    story = json.loads(out)
    at = story["resumed"]["step"]
    assert at in (5, 10)
    table = pa.Table.from_batches(list(guardrails.iter_metrics(tmp_path)))
    runs: dict[float, list[int]] = {}
    for t, s in zip(table["started_at"].to_pylist(), table["step"].to_pylist(), strict=True):
        runs.setdefault(t, []).append(s)
    assert [sorted(v) for _, v in sorted(runs.items())] == [
        list(range(1, 13)),
        list(range(at + 1, 21)),
    ]
    assert story["metrics_rows"] == 20 - at and story["last_step"] == 20
    assert story["resumed"]["earlier_rows"] == at


# ---------------------------------------------------------------------- abort, then close


def test_rows_written_by_the_abort_are_not_written_again_at_close(tmp_path):
    """A rank the watchdog (or a stuck SIGTERM) ends from a thread writes its last rows
    in guard.die's last words; the abort of its process group then frees the main
    thread, which closes the guard while the process is still ending. Here: the last
    words run (the real code path of guard.die, before its os._exit) while the main
    thread is stuck inside step 12's optimizer step; then that step raises and the
    guard closes. Each row is on disk once, step 12's too. Before, the close wrote
    steps 1-11 a second time (seen on the 2-rank watchdog job too)."""
    import threading

    aborted = threading.Event()

    def stuck(*_):
        words = threading.Thread(target=running[0]._last_words, args=(RuntimeError("hang"),))
        words.start()
        words.join(patience(30))
        aborted.set()
        raise RuntimeError("the process group was aborted")

    running: list = []
    torch.manual_seed(0)
    model = Regressor()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(RuntimeError, match="aborted"):
        with guardrails.guard(
            model, opt, batches(20), run_dir=tmp_path, progress=False, metrics={"every_n_steps": 5}
        ) as g:
            running.append(g)
            for x, y in g:
                model(x, y).backward()
                if g.step == 11:
                    opt.register_step_pre_hook(stuck)
                opt.step()
                opt.zero_grad()
    assert aborted.is_set()
    rows = rows_of(tmp_path)  # asserts each step once
    assert rows["step"] == list(range(1, 13))
    assert math.isfinite(rows["grad_norm"][-1]) and math.isnan(rows["step_time_s"][-1])
