"""metrics.parquet and events.jsonl hold what the loop computed, on real files."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import textwrap
import time

import pyarrow.parquet as pq
import pytest
import torch
from conftest import Regressor, batches, guarded_run, read_events, reference_grad_norm

import guardrails


def test_metrics_equal_what_the_loop_computed(tmp_path):
    torch.manual_seed(0)
    model = Regressor(depth=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    expect = {"loss": [], "grad_norm": [], "lr": []}
    n_steps = 13  # not a multiple of the ring length: the tail is flushed at close
    with guardrails.guard(
        model,
        opt,
        batches(n_steps),
        scheduler=sched,
        run_dir=tmp_path,
        metrics={"every_n_steps": 5},
    ) as g:
        for x, y in g:
            loss = model(x, y)
            loss.backward()
            expect["loss"].append(loss.item())
            expect["grad_norm"].append(reference_grad_norm(model))
            expect["lr"].append(opt.param_groups[0]["lr"])
            opt.step()
            opt.zero_grad()
            sched.step()
    rows = guardrails.read_metrics(tmp_path).to_pydict()
    assert rows["step"] == list(range(1, n_steps + 1))
    assert rows["rank"] == [0] * n_steps
    assert rows["loss"] == pytest.approx(expect["loss"], rel=1e-6)
    assert rows["grad_norm"] == pytest.approx(expect["grad_norm"], rel=1e-5)
    assert rows["lr"] == expect["lr"]  # exact: 1e-2 * 0.5**k
    assert rows["skipped"] == [False] * n_steps
    assert all(t > 0 for t in rows["step_time_s"])
    assert all(m > 0 for m in rows["mem_peak_bytes"])  # peak RSS on CPU
    assert rows["time"] == sorted(rows["time"])
    assert len(set(rows["started_at"])) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("lagged", [False, True], ids=["cpu_path", "lagged_path"])
def test_recorded_loss_and_grad_norm_are_the_steps_float32_values_bitwise(
    tmp_path, monkeypatch, lagged, dtype
):
    """The step's row is written once for NanGuard and telemetry (from host memory on a
    CPU, by one stack on a GPU): metrics.parquet holds, bit for bit, the float32 of the
    step's loss and of the guard's fused grad norm, as when each component stacked its
    own row; a float64 model's loss is rounded to float32 as the stack's cast rounds it.
    A non-finite step is recorded skipped with its NaN norm."""
    from guardrails.engine.gradnorm import flat_norm

    monkeypatch.setattr(guardrails.NanGuard, "_lagged_on_cpu", lagged)
    torch.manual_seed(0)
    model = Regressor(depth=3).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = [(x.to(dtype), y.to(dtype)) for x, y in batches(23)]
    data[6][0][1, 2] = math.nan  # step 7
    expect: dict[str, list[float]] = {"loss": [], "grad_norm": []}
    with guardrails.guard(
        model, opt, data, run_dir=tmp_path, progress=False, metrics={"every_n_steps": 5}
    ) as g:
        for x, y in g:
            loss = model(x, y)
            loss.backward()
            grads = [p.grad for p in model.parameters()]
            expect["loss"].append(loss.detach().float().item())
            assert g._norm.flat  # a small model on CPU: the norm of one flat copy
            expect["grad_norm"].append(flat_norm(grads).item())
            opt.step()
            opt.zero_grad()
    rows = guardrails.read_metrics(tmp_path).to_pydict()
    assert rows["step"] == list(range(1, 24))
    assert rows["skipped"] == [s == 7 for s in range(1, 24)]
    for col in ("loss", "grad_norm"):
        got, want = rows[col], expect[col]
        same = [a == b or (math.isnan(a) and math.isnan(b)) for a, b in zip(got, want, strict=True)]
        assert all(same), (
            col,
            [(i + 1, a, b) for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b],
        )
    assert math.isnan(rows["grad_norm"][6]) and not math.isnan(rows["loss"][5])


def test_data_wait_and_tokens_per_second(tmp_path):
    """A slow loader shows up as data-wait time; integer (batch, seq) batches give
    tokens and tokens/s."""
    torch.manual_seed(0)
    emb = torch.nn.Sequential(
        torch.nn.Embedding(50, 8), torch.nn.Flatten(), torch.nn.Linear(8 * 6, 1)
    )
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    delay_s = 0.03

    def slow_loader():
        for _ in range(4):
            time.sleep(delay_s)  # a starving input pipeline
            yield torch.randint(0, 50, (5, 6))

    with guardrails.guard(emb, opt, slow_loader(), run_dir=tmp_path) as g:
        for ids in g:
            emb(ids).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    rows = guardrails.read_metrics(tmp_path).to_pydict()
    assert all(w >= delay_s for w in rows["data_wait_s"])  # sleep is a lower bound
    assert all(t >= w for t, w in zip(rows["step_time_s"], rows["data_wait_s"], strict=True))
    assert rows["tokens"] == [30] * 4
    for tps, tok, st in zip(rows["tokens_per_s"], rows["tokens"], rows["step_time_s"], strict=True):
        assert tps == pytest.approx(tok / st)


def test_tokens_per_batch_knob_overrides_inference(tmp_path):
    guarded_run(tmp_path, tokens_per_batch=1024)
    assert guardrails.read_metrics(tmp_path).column("tokens").to_pylist() == [1024, 1024]


def test_float_batches_have_unknown_tokens(tmp_path):
    guarded_run(tmp_path)
    rows = guardrails.read_metrics(tmp_path).to_pydict()
    assert rows["tokens"] == [None, None] and rows["tokens_per_s"] == [None, None]


def test_parts_are_plain_parquet_and_a_rerun_appends(tmp_path):
    for _run in range(2):
        guarded_run(tmp_path, 7, metrics={"every_n_steps": 2, "write_every_s": 0})
    parts = sorted((tmp_path / "metrics.parquet").glob("*.parquet"))
    assert len(parts) == 8  # 4 flushes (2+2+2+1 rows) per run, one part each
    assert not list((tmp_path / "metrics.parquet").glob(".tmp-*"))
    # Readable without guardrails, as a directory dataset.
    table = pq.read_table(tmp_path / "metrics.parquet")
    assert table.num_rows == 14
    starts = sorted(set(table.column("started_at").to_pylist()))
    assert len(starts) == 2
    for start in starts:
        steps = [
            s
            for s, t in zip(
                table.column("step").to_pylist(),
                table.column("started_at").to_pylist(),
                strict=True,
            )
            if t == start
        ]
        assert sorted(steps) == list(range(1, 8))


@pytest.mark.slow(reason="a training process, SIGKILLed")
def test_sigkill_keeps_every_part_written_before_it(tmp_path):
    """A run killed with SIGKILL (no cleanup at all) keeps the metrics it flushed."""
    script = textwrap.dedent(
        f"""
        import os, signal, sys, torch
        sys.path.insert(0, {str(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))!r})
        from _loops import train_loop_signalled
        from conftest import Regressor, batches
        import guardrails
        torch.manual_seed(0)
        model = Regressor()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with guardrails.guard(model, opt, batches(50), run_dir={str(tmp_path)!r},
                              metrics={{"every_n_steps": 5, "write_every_s": 0}}) as g:
            train_loop_signalled(g, model, opt, after_step=23, signum=signal.SIGKILL)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    rows = guardrails.read_metrics(tmp_path).to_pydict()
    assert rows["step"] == list(range(1, 21))  # flushed at 5, 10, 15, 20; 21-23 were in the ring
    assert all(not math.isnan(v) for v in rows["loss"])
    events = read_events(tmp_path)
    kinds = [e["kind"] for e in events]
    assert kinds[0] == "start" and "end" not in kinds  # no "end": it really was killed


def test_events_log(tmp_path):
    guarded_run(tmp_path, inside=lambda g: g.event("custom", message="hello", value=3))
    # The GC's and the efficiency component's own events (flops, at step 2) aside.
    events = [
        e for e in read_events(tmp_path) if not e["kind"].startswith("gc_") and e["kind"] != "flops"
    ]
    assert [e["kind"] for e in events] == ["start", "custom", "end"]
    assert events[0]["components"] == [
        "explain",
        "gc",
        "memory",
        "nan",
        "watchdog",  # a single process: its thread publishes the live view only
        "telemetry",
        "pace",
        "preflight",
        "checkpoint",
        "efficiency",
    ]
    assert events[0]["device"] == "cpu"
    assert events[1] == {**events[1], "step": 2, "message": "hello", "value": 3, "rank": 0}
    assert events[2]["error"] is None


def test_progress_bar_on_request_and_off_in_ci(tmp_path, capsys, monkeypatch):
    def run(**kw):
        guarded_run(tmp_path, 6, metrics={"every_n_steps": 2}, **kw)
        return capsys.readouterr().err

    err = run(progress=True)
    assert "train" in err and "6/6" in err and "loss=" in err and "gnorm=" in err
    monkeypatch.setenv("CI", "true")
    assert "loss=" not in run()  # auto: off in CI
    assert "loss=" not in run(progress=False)


def test_metrics_off_is_a_real_no_op(tmp_path):
    g = guarded_run(
        tmp_path,
        metrics=False,
        gc=False,
        nan=False,
        explain=False,
        memory={
            "leak_check_every_n_steps": None,
            "data_starvation_window_steps": None,
            "explain_oom": False,
        },
        checkpoint={"save_on_signal": False, "save_on_failure": False},
        preflight=False,
        pace=False,
        efficiency={"advise": False, "count_flops": False, "host_syncs": False},
        watchdog=False,  # a single process's live view
        resume=None,
    )
    assert g.components == []
    assert not (tmp_path / "metrics.parquet").exists()
    with pytest.raises(FileNotFoundError, match="no metrics at"):
        guardrails.read_metrics(tmp_path)


def test_a_killed_writers_temp_part_is_no_parquet_file_and_is_removed_at_the_next_start(tmp_path):
    """A part half-written when its process was SIGKILLed must not match ``*.parquet``
    (duckdb's and polars' globs failed on it), and the next run of that rank removes it."""
    parts = tmp_path / "metrics.parquet"
    parts.mkdir()
    stale = [
        parts / ".part-r00000-s000000001-deadbeef.parquet.tmp",  # this rank's temps
        parts / ".tmp-part-r00000-s000000001-cafecafe.parquet",  # (the old spelling)
    ]
    other = parts / ".part-r00001-s000000001-feedf00d.parquet.tmp"  # rank 1 may be writing
    for f in [*stale, other]:
        f.write_bytes(b"PAR1 half a file")
    guarded_run(tmp_path, 3, metrics={"every_n_steps": 2, "write_every_s": 0})
    assert not any(f.exists() for f in stale) and other.exists()
    written = sorted(p.name for p in parts.glob("*.parquet"))
    assert written and all(n.startswith("part-r00000-") for n in written)
    assert guardrails.read_metrics(tmp_path).column("step").to_pylist() == [1, 2, 3]


def test_file_cadence_keeps_the_jobs_file_creations_flat_in_the_number_of_ranks():
    from guardrails.guards.telemetry import JOB_PARTS_PER_S, file_cadence

    # Up to 600 ranks a part a minute and an hourly merge, as configured.
    assert file_cadence(60.0, 3600.0, 2) == (60.0, 3600.0)
    assert file_cadence(60.0, 3600.0, 600) == (60.0, 3600.0)
    # Beyond, both stretch by one factor: the job's parts stay at 10 a second.
    for world in (1_200, 10_000, 100_000):
        write_s, compact_s = file_cadence(60.0, 3600.0, world)
        assert world / write_s == pytest.approx(JOB_PARTS_PER_S)
        assert compact_s == pytest.approx(3600.0 * write_s / 60.0)
    assert file_cadence(60.0, 3600.0, 10_000)[0] == pytest.approx(1000.0)
    assert file_cadence(60.0, None, 10_000)[1] is None
    # Already slow enough, or a part at every copy (0) on purpose: as given.
    assert file_cadence(3600.0, 7200.0, 10_000) == (3600.0, 7200.0)
    assert file_cadence(0.0, 3600.0, 10_000) == (0.0, 3600.0)


def _bar_of(tmp_path, capsys, data, *, accumulate: int = 1, **knobs) -> str:
    """The progress bar's text (stderr) of a plain loop over ``data``, stepping every
    ``accumulate`` batches (a last partial accumulation makes no step)."""
    torch.manual_seed(0)
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with guardrails.guard(model, opt, data, run_dir=tmp_path, progress=True, **knobs) as g:
        for i, (x, y) in enumerate(g, 1):
            model(x, y).backward()
            if i % accumulate == 0:
                opt.step()
                opt.zero_grad()
    return capsys.readouterr().err


def test_progress_bar_has_the_pass_total_over_a_sized_loader(tmp_path, capsys):
    err = _bar_of(tmp_path / "a", capsys, batches(12))
    assert "12/12" in err and "train epoch 0" in err, err
    # Gradient accumulation: 3 batches a step, so 4 steps in the pass; 14 batches
    # make 4 whole steps too (the last 2 make none).
    err = _bar_of(tmp_path / "b", capsys, batches(14), accumulate=3)
    assert "4/4" in err and "/14" not in err and "/12" not in err, err
    # No length (a generator): a plain count, no total.
    err = _bar_of(tmp_path / "c", capsys, (b for b in batches(5)))
    assert "5step" in err.replace(" ", "") and "/5" not in err, err


def test_progress_bar_of_a_resumed_run_counts_from_its_checkpoint(tmp_path, capsys):
    data = batches(12)

    torch.manual_seed(0)
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with guardrails.guard(model, opt, data, run_dir=tmp_path, progress=False) as g:
        # Not train_loop: it saves and breaks at step 4.
        for x, y in g:
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
            if g.step == 4:
                g.save_checkpoint()
                break
    capsys.readouterr()
    err = _bar_of(tmp_path, capsys, data, resume="auto")
    # Steps 5-12 of the pass's 12: the bar starts at 4 and its rate is of this run's 8.
    assert "4/12" in err and "12/12" in err, err


def test_an_event_that_ends_the_run_is_not_printed_twice(tmp_path, capsys):
    """A desync's, a hang's or an OOM's event carries the message of the error that
    ends the run, which that rank prints whole (its report): with no logging set up,
    Python's fallback printed the event's copy too (under torchrun, each rank's
    headline 3 times with torchrun's summary). The file keeps the whole message; a
    configured log gets its head line."""
    import logging

    from guardrails.metrics.events import EventLog

    log = logging.getLogger("guardrails.test_ends_run")
    log.propagate = False  # no handler anywhere up the tree: what a plain script has
    events = EventLog(tmp_path, rank=1)
    text = "[rank 1, step 6] collective mismatch\n  rank 0: barrier\n  rank 1: all_reduce"
    events.emit("collective_mismatch", step=6, level="error", message=text, log=log, ends_run=True)
    assert "collective mismatch" not in capsys.readouterr().err
    # Another error-level event still reaches the console through Python's fallback.
    events.emit("other", step=6, level="error", message="still said", log=log)
    assert "still said" in capsys.readouterr().err
    # Configured logging gets the event's head line only.
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    log.addHandler(handler)
    try:
        events.emit("hang", step=7, level="error", message=text, log=log, ends_run=True)
    finally:
        log.removeHandler(handler)
    assert seen == ["[rank 1 step 7] hang: [rank 1, step 6] collective mismatch"]
    events.close()
    written = read_events(tmp_path)
    assert written[0]["message"] == text and written[2]["message"] == text
