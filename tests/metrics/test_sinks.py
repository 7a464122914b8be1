"""Metric sinks (guard(log_to=...)): every row of metrics.parquet, and the run's events,
reach TensorBoard, W&B, MLflow or a function, read back with each tool's own reader.

Real guarded loops, real files, real packages (each test skips, saying why, when its
package is not installed): nothing is mocked.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from conftest import Regressor, batches, patience, train_loop

import guardrails

ROOT = Path(__file__).resolve().parents[2]


class Recorder(guardrails.Sink):
    """Keeps what it is sent, in order: ("rows", table) and ("event", dict)."""

    def __init__(self) -> None:
        self.stream: list[tuple[str, object]] = []
        self.threads: set[str] = set()
        self.opened: Path | None = None
        self.closed = False

    def open(self, run_dir):
        self.opened = run_dir

    def write(self, rows):
        self.threads.add(threading.current_thread().name)
        self.stream.append(("rows", rows))

    def event(self, event):
        self.stream.append(("event", event))

    def close(self):
        self.closed = True

    def rows(self) -> pa.Table:
        return pa.concat_tables([t for kind, t in self.stream if kind == "rows"])

    def events(self) -> list[dict]:
        return [e for kind, e in self.stream if kind == "event"]


def train(run_dir, n_steps, *, inside=None, fail_at=None, stop_at=None, seed=0, **knobs):
    """A seeded Regressor under guard(); ``inside(g)`` after each step; ``fail_at``
    raises at that step, ``stop_at`` sends this process SIGTERM (a pre-emption:
    saved, the loop ends)."""
    torch.manual_seed(seed)
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    knobs.setdefault("progress", False)
    knobs.setdefault("checkpoint", {"exit_on_signal": False})
    with guardrails.guard(
        model, opt, batches(n_steps), scheduler=sched, run_dir=run_dir, **knobs
    ) as g:
        # Not train_loop: a scheduler steps, `inside(g)` runs, a failure at `fail_at`.
        for x, y in g:
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            if inside is not None:
                inside(g)
            if g.step == fail_at:
                raise RuntimeError(f"planted failure at step {g.step}")
            if g.step == stop_at:
                os.kill(os.getpid(), signal.SIGTERM)
    return g


def our_warnings(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("guardrails") and r.levelno >= logging.WARNING
    ]


def assert_in_step_order(stream):
    """Each event comes after the rows of the steps it follows and before later rows."""
    last_row = 0
    for kind, item in stream:
        if kind == "rows":
            steps = item.column("step").to_pylist()
            assert steps == list(range(last_row + 1, last_row + 1 + len(steps))), steps
            last_row = steps[-1]
        elif item["kind"] != "end":
            assert (
                item["step"] <= last_row
                or all(  # an event waits for its step's rows
                    k == "event" for k, _ in stream[stream.index((kind, item)) :]
                )
            ), (item, last_row)


# ---------------------------------------------------------------------- the stream


def test_every_row_arrives_once_in_order_with_the_events(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    sink = Recorder()

    def inside(g):
        if g.step == 6:
            g.event("custom", message="hello", value=3)

    g = train(
        tmp_path,
        13,  # not a multiple of the ring: the tail arrives at close
        inside=inside,
        log_to=sink,
        metrics={"every_n_steps": 4, "write_every_s": 0},
    )
    table = guardrails.read_metrics(tmp_path)
    assert sink.rows().equals(table)  # every column, every row, bitwise
    assert sink.rows().column("step").to_pylist() == list(range(1, 14))
    assert_in_step_order(sink.stream)
    events = sink.events()
    custom = next(e for e in events if e["kind"] == "custom")
    assert custom == {**custom, "step": 6, "message": "hello", "value": 3, "rank": 0}
    # The custom event sits between the rows of step 6 and step 7.
    i = sink.stream.index(("event", custom))
    before = [t for k, t in sink.stream[:i] if k == "rows"]
    assert before[-1].column("step").to_pylist()[-1] == 6
    assert events[-1]["kind"] == "end" and events[-1]["error"] is None
    assert events[-1]["step"] == 13
    assert sink.opened == tmp_path and sink.closed
    assert sink.threads == {"guardrails-sinks"}  # never the training thread
    assert g.component("telemetry").rows_written == 13
    assert our_warnings(caplog) == []


def test_a_function_gets_the_rows_and_a_list_takes_several_sinks(tmp_path):
    got = []
    sink = Recorder()
    train(tmp_path, 5, log_to=[got.append, sink], metrics={"every_n_steps": 2})
    assert pa.concat_tables(got).equals(guardrails.read_metrics(tmp_path))
    assert sink.rows().equals(guardrails.read_metrics(tmp_path))


def test_sinks_are_called_once_per_part_not_per_step(tmp_path):
    """The per-step path is telemetry's own: a sink is handed each parquet part once
    (gc=False, efficiency=False: the GC scheduler's events at step 1 and the FLOP count's
    at step 2 would cut a part in two)."""
    sink = Recorder()
    metrics = {"every_n_steps": 4, "write_every_s": 0}
    train(tmp_path, 23, log_to=sink, gc=False, efficiency=False, metrics=metrics)
    parts = list((tmp_path / "metrics.parquet").glob("*.parquet"))
    writes = [t for k, t in sink.stream if k == "rows"]
    assert len(parts) == len(writes) == 6  # ceil(23 / 4) parts, 23 steps
    # The default cadence (a part every 60 s and at close): one write for the run.
    sink = Recorder()
    train(tmp_path / "b", 23, log_to=sink, gc=False, efficiency=False, metrics={"every_n_steps": 4})
    assert [t.num_rows for k, t in sink.stream if k == "rows"] == [23]


def python_calls_in_steps(tmp_path, **knobs):
    """Python calls made from or into guardrails code during steps 3-8 (the profile
    hook of tests/test_structure.py)."""
    from collections import Counter

    pkg = str(Path(guardrails.__file__).parent)
    calls: Counter[str] = Counter()

    def ours(frame):
        return frame is not None and frame.f_code.co_filename.startswith(pkg)

    def prof(frame, event, arg):
        if event == "call" and (ours(frame) or ours(frame.f_back)):
            calls[frame.f_code.co_name] += 1
        elif event == "c_call" and ours(frame):
            calls[f"c:{getattr(arg, '__name__', '?')}"] += 1

    def inside(g):
        if g.step == 2:
            sys.setprofile(prof)
        if g.step == 8:
            sys.setprofile(None)

    train(tmp_path, 10, inside=inside, metrics={"every_n_steps": 1000}, **knobs)
    return calls


def test_a_sink_adds_no_python_call_to_the_step(tmp_path):
    plain = python_calls_in_steps(tmp_path / "a")
    with_sinks = python_calls_in_steps(tmp_path / "b", log_to=[Recorder(), print])
    assert with_sinks == plain


class FileSink(guardrails.Sink):
    """Appends what it is sent to ``path`` as JSON lines (a rank's own file)."""

    def __init__(self, path) -> None:
        self.path = Path(path)

    def write(self, rows):
        with self.path.open("a") as f:
            for row in rows.to_pylist():
                f.write(json.dumps({"row": row["step"], "rank": row["rank"]}) + "\n")

    def event(self, event):
        with self.path.open("a") as f:
            f.write(json.dumps({"event": event["kind"], "rank": event["rank"]}) + "\n")


def _two_ranks(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = DDP(Regressor())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sink = FileSink(Path(out, f"sink.rank{rank}.jsonl"))
        with guardrails.guard(
            model,
            opt,
            batches(7, seed=rank),
            run_dir=Path(out, "run"),
            log_to=sink,
            progress=False,
            metrics={"every_n_steps": 2, "write_every_s": 0},
        ) as g:
            train_loop(g, model, opt)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow(reason="2 real ranks (gloo), each importing torch")
def test_sinks_run_on_rank_0_only(tmp_path):
    from conftest import free_port, spawn

    spawn(_two_ranks, (free_port(), str(tmp_path)))
    assert not (tmp_path / "sink.rank1.jsonl").exists()
    lines = [json.loads(x) for x in (tmp_path / "sink.rank0.jsonl").read_text().splitlines()]
    assert [x["row"] for x in lines if "row" in x] == list(range(1, 8))
    assert {x["rank"] for x in lines} == {0}  # rank 0's rows and events, not rank 1's
    assert lines[-1] == {"event": "end", "rank": 0}
    table = guardrails.read_metrics(tmp_path / "run")  # every rank's rows are still here
    assert sorted(set(table.column("rank").to_pylist())) == [0, 1]


# ---------------------------------------------------------------------- failures


class Broken(Recorder):
    def __init__(self, fail_in: str, at_call: int = 1) -> None:
        super().__init__()
        self.fail_in, self.at_call, self.n = fail_in, at_call, 0

    def _maybe_fail(self, method):
        if method == self.fail_in:
            self.n += 1
            if self.n == self.at_call:
                raise ConnectionError("tracking server unreachable")

    def open(self, run_dir):
        self._maybe_fail("open")
        super().open(run_dir)

    def write(self, rows):
        self._maybe_fail("write")
        super().write(rows)

    def event(self, event):
        self._maybe_fail("event")
        super().event(event)


@pytest.mark.parametrize("fail_in", ["open", "write", "event"])
def test_a_sink_that_raises_is_turned_off_with_one_warning(tmp_path, caplog, fail_in):
    caplog.set_level(logging.INFO)
    broken, healthy = Broken(fail_in, at_call=2 if fail_in == "write" else 1), Recorder()
    g = train(
        tmp_path,
        9,
        log_to=[broken, healthy],
        gc=False,  # no event at step 1: the parts are the writes
        metrics={"every_n_steps": 2, "write_every_s": 0},
    )
    assert g.step == 9  # training went on
    warnings = our_warnings(caplog)
    assert len(warnings) == 1, warnings
    assert "Broken" in warnings[0] and f"in {fail_in}()" in warnings[0]
    assert "ConnectionError: tracking server unreachable" in warnings[0]
    assert "metrics.parquet" in warnings[0] and "off for the rest of this run" in warnings[0]
    table = guardrails.read_metrics(tmp_path)
    assert healthy.rows().equals(table)  # the other sink missed nothing
    assert table.num_rows == 9
    if fail_in == "write":
        assert broken.rows().column("step").to_pylist() == [1, 2]  # then nothing more
        assert broken.closed  # given the chance to release what it holds
    if fail_in == "open":
        assert broken.stream == [] and not broken.closed


class Stuck(Recorder):
    """A sink whose server stopped answering: write blocks until released."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def write(self, rows):
        self.release.wait(60)
        super().write(rows)


def test_a_stuck_sink_never_stalls_the_steps_and_the_end_waits_a_bounded_time(tmp_path, caplog):
    sink = Stuck()
    step_times = []

    def inside(g):
        step_times.append(time.perf_counter())

    try:
        t0 = time.perf_counter()
        g = train(
            tmp_path,
            12,
            inside=inside,
            metrics={
                "sinks": [sink],
                "every_n_steps": 2,
                "write_every_s": 0,
                "sink_close_timeout_s": 0.5,
            },
        )
        took = time.perf_counter() - t0
    finally:
        sink.release.set()
    assert g.step == 12
    # Six parts were handed to a sink that never returned, and no step waited for it.
    assert max(b - a for a, b in itertools.pairwise(step_times)) < 5
    assert took < 30  # the close waited 0.5 s for it, not the 60 s it blocks
    warnings = our_warnings(caplog)
    assert len(warnings) == 1 and "Stuck" in warnings[0]
    assert "still writing 0.5 s after the run ended" in warnings[0]
    assert guardrails.read_metrics(tmp_path).num_rows == 12


def test_a_failing_run_still_sends_its_rows_and_an_end_with_the_error(tmp_path):
    sink = Recorder()
    with pytest.raises(RuntimeError, match="planted failure"):
        train(tmp_path, 9, fail_at=5, log_to=sink, metrics={"every_n_steps": 2})
    assert sink.rows().column("step").to_pylist() == [1, 2, 3, 4, 5]
    end = sink.events()[-1]
    assert end["kind"] == "end" and end["level"] == "error"
    assert "RuntimeError: planted failure at step 5" in end["error"]


# ---------------------------------------------------------------------- configuration


def test_log_to_is_checked_when_the_guard_is_built(tmp_path, monkeypatch):
    def build(**kw):
        model = Regressor()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return guardrails.guard(model, opt, batches(2), run_dir=tmp_path, **kw)

    with pytest.raises(ValueError, match=r"unknown sink 'tensorbord'\. Did you mean 'tensorboard'"):
        build(log_to="tensorbord")
    with pytest.raises(ValueError, match="'tensorboard', 'wandb', 'mlflow'"):
        build(log_to=["wandb", "comet"])
    with pytest.raises(TypeError, match="a function"):
        build(log_to=3)
    with pytest.raises(TypeError, match=r"pass TensorBoardSink\(\), not TensorBoardSink"):
        build(log_to=guardrails.TensorBoardSink)
    with pytest.raises(TypeError, match=r"metrics=False\) turns telemetry off"):
        build(log_to=print, metrics=False)
    with pytest.raises(
        TypeError, match=r"given log_to twice.*guard\(metrics=\.\.\.\) \(as sinks\)"
    ):
        build(log_to=print, metrics={"sinks": [len]})
    with pytest.raises(ValueError, match="unknown sink"):
        build(metrics={"sinks": "nope"})  # the section's knob: the same check
    # A missing package: the command that installs it (find_spec sees None in
    # sys.modules as "not installed", as for a package that is not there).
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'torch-guardrails\[wandb\]'"):
        build(log_to="wandb")
    g = build(log_to=print)
    assert g.component("telemetry").sinks == (print,)
    g = build(metrics={"sinks": [print]}, log_to=print)  # the same both ways: fine
    assert g.component("telemetry").sinks == (print,)


@pytest.mark.slow(reason="a process with 3 guarded runs")
def test_no_sink_package_is_imported_unless_used(tmp_path):
    """One process: guards without sinks, with a function, then with TensorBoard; which
    of the sinks' packages each left imported."""
    script = textwrap.dedent(
        f"""
        import importlib.util, sys, torch
        sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
        from conftest import Regressor, batches, train_loop
        import guardrails
        names = ("tensorboard", "torch.utils.tensorboard", "wandb", "mlflow")
        runs = [None, len]  # len: a function of the rows that prints nothing
        if importlib.util.find_spec("tensorboard"):
            runs.append("tensorboard")
        for i, log_to in enumerate(runs):
            model = Regressor()
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            with guardrails.guard(model, opt, batches(3), run_dir=f"{{sys.argv[1]}}/{{i}}",
                                  log_to=log_to, progress=False) as g:
                train_loop(g, model, opt)
            print(sorted(n for n in names if n in sys.modules))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=patience(120),
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[:2] == ["[]", "[]"]  # no sink; a function
    if len(lines) < 3:
        pytest.skip("the tensorboard extra is not installed: checked without it")
    assert lines[2] == "['tensorboard', 'torch.utils.tensorboard']"  # not wandb, mlflow


# ---------------------------------------------------------------------- TensorBoard


def read_tensorboard(log_dir):
    ea_mod = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator",
        reason="the tensorboard extra is not installed",
    )
    acc = ea_mod.EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def tb_texts(acc, kind):
    return [
        (e.step, e.tensor_proto.string_val[0].decode())
        for e in acc.Tensors(f"events/{kind}/text_summary")
    ]


def test_tensorboard_scalars_and_events_read_back(tmp_path, caplog):
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    caplog.set_level(logging.INFO)

    def inside(g):
        if g.step == 4:
            g.event("custom", level="warning", message="look here")

    train(
        tmp_path,
        11,
        inside=inside,
        log_to="tensorboard",
        metrics={"every_n_steps": 3, "write_every_s": 0},
    )
    rows = guardrails.read_metrics(tmp_path).to_pydict()
    acc = read_tensorboard(tmp_path / "tensorboard")
    for column, tag in (
        ("loss", "train/loss"),
        ("grad_norm", "train/grad_norm"),
        ("lr", "train/lr"),
    ):
        got = acc.Scalars(tag)
        assert [s.step for s in got] == rows["step"] == list(range(1, 12))
        # TensorBoard keeps float32 (the loss and grad norm are float32 already).
        assert [s.value for s in got] == [float(np.float32(v)) for v in rows[column]], tag
        assert [s.wall_time for s in got] == pytest.approx(rows["time"])
    assert "train/tokens" not in acc.Tags()["scalars"]  # unknown for float batches
    assert [s.value for s in acc.Scalars("train/skipped")] == [0.0] * 11
    assert tb_texts(acc, "custom") == [(4, "step 4, rank 0: custom (warning): look here")]
    assert tb_texts(acc, "end") == [(11, "step 11, rank 0: end")]
    warnings = [m for m in our_warnings(caplog) if "look here" not in m]
    assert warnings == []


def test_tensorboard_every_n_steps_keeps_the_skipped_steps(tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    torch.manual_seed(0)
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = batches(10)
    data[4][0][0, 0] = float("nan")  # step 5's gradients are NaN: NanGuard skips it
    with guardrails.guard(
        model,
        opt,
        data,
        run_dir=tmp_path,
        progress=False,
        log_to=guardrails.TensorBoardSink(every_n_steps=3),
    ) as g:
        train_loop(g, model, opt)
    acc = read_tensorboard(tmp_path / "tensorboard")
    assert [s.step for s in acc.Scalars("train/loss")] == [3, 5, 6, 9]
    assert [s.value for s in acc.Scalars("train/skipped")] == [0.0, 1.0, 0.0, 0.0]
    assert math.isnan(acc.Scalars("train/loss")[1].value)
    with pytest.raises(ValueError, match="every_n_steps must be a positive int"):
        guardrails.WandbSink(every_n_steps=0)


def test_tensorboard_continues_the_step_axis_across_a_resume(tmp_path):
    """A run that fails at step 8 after a checkpoint at step 5, then resumed: its
    steps 6-8 are logged twice, and TensorBoard shows the resumed run's (purge_step).
    (No failure save, which would keep step 8 and leave nothing to log twice.)"""
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    knobs = {
        "log_to": "tensorboard",
        "metrics": {"every_n_steps": 2, "write_every_s": 0},
        "checkpoint": {"every_n_steps": 5, "exit_on_signal": False, "save_on_failure": False},
    }
    with pytest.raises(RuntimeError):
        train(tmp_path, 13, fail_at=8, **knobs)
    g = train(tmp_path, 13, **knobs)
    assert g.step == 13
    table = guardrails.read_metrics(tmp_path)
    starts = sorted(set(table.column("started_at").to_pylist()))
    second = table.filter(pa.compute.equal(table.column("started_at"), starts[1])).to_pydict()
    assert second["step"] == list(range(6, 14))
    acc = read_tensorboard(tmp_path / "tensorboard")
    loss = acc.Scalars("train/loss")
    assert [s.step for s in loss] == list(range(1, 14))  # each step once
    assert [s.value for s in loss][5:] == second["loss"]  # 6-13: the resumed run's


def test_tensorboard_after_a_sigterm_save_and_resume(tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    knobs = {"log_to": "tensorboard", "metrics": {"every_n_steps": 2}}
    g = train(tmp_path, 10, stop_at=4, **knobs)
    assert g.step == 4 and g.stopping
    g = train(tmp_path, 10, **knobs)
    assert g.step == 10
    acc = read_tensorboard(tmp_path / "tensorboard")
    assert [s.step for s in acc.Scalars("train/loss")] == list(range(1, 11))
    assert [s.value for s in acc.Scalars("train/loss")] == guardrails.read_metrics(tmp_path).column(
        "loss"
    ).to_pylist()
    assert [step for step, _ in tb_texts(acc, "stopped")] == [4]
    assert [step for step, _ in tb_texts(acc, "resumed")] == [4]


# ---------------------------------------------------------------------- W&B

WANDB_BLOCK = 32768  # the .wandb file is a LevelDB log: 32 KiB blocks of records


def read_wandb(run_dir) -> list:
    """The records of the one offline W&B run under ``run_dir``."""
    [path] = Path(run_dir, "wandb").glob("offline-run-*/run-*.wandb")
    return read_wandb_file(path)


def read_wandb_file(path) -> list:
    """The records of a finished offline run's ``.wandb`` file. wandb's service process
    writes it after ``finish()`` returns (measured: a process's second run's file held
    only its header just after), so wait for the run's ``exit`` record."""
    limit = patience(60)
    deadline = time.monotonic() + limit
    while True:
        records = _wandb_records(path)
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            return records
        assert time.monotonic() < deadline, f"{path} has no exit record after {limit:.0f} s"
        time.sleep(0.2)


def _wandb_records(path) -> list:
    """The records of a ``.wandb`` file, parsed with wandb's protobuf: the bytes ``wandb
    sync`` would upload."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    pos, chunks, records = 7, b"", []
    while pos + 7 <= len(data):
        if WANDB_BLOCK - pos % WANDB_BLOCK < 7:  # a block's tail too short for a header
            pos += WANDB_BLOCK - pos % WANDB_BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if (kind == 0 and length == 0) or pos + 7 + length > len(data):
            break  # the end, or a record still being written
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        chunks = chunk if kind in (1, 2) else chunks + chunk  # FULL, FIRST / MIDDLE, LAST
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(chunks)
            records.append(rec)
    return records


def wandb_history(records) -> list[dict]:
    out = []
    for rec in records:
        if rec.WhichOneof("record_type") == "history":
            out.append(
                {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in rec.history.item
                }
            )
    return out


@pytest.fixture
def wandb_offline(monkeypatch):
    wandb = pytest.importorskip("wandb", reason="the wandb extra is not installed")
    for key, value in {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CONSOLE": "off",
        "WANDB_DISABLE_GIT": "true",
        "WANDB_DISABLE_CODE": "true",
    }.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    yield wandb
    if wandb.run is not None:
        wandb.run.finish()


@pytest.mark.slow(reason="imports wandb and runs it offline: ~2.2 CPU-s")
def test_wandb_offline_run_holds_every_row_at_its_step(tmp_path, wandb_offline, caplog):
    caplog.set_level(logging.INFO)
    g = train(
        tmp_path / "exp1",
        9,
        log_to="wandb",
        metrics={"every_n_steps": 2, "write_every_s": 0},
        inside=lambda g: g.step == 3 and g.event("custom", level="warning", message="odd"),
    )
    assert g.step == 9 and wandb_offline.run is None  # the run it started is finished
    records = read_wandb(tmp_path / "exp1")
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.project == "exp1"  # from the run directory's name
    rows = guardrails.read_metrics(tmp_path / "exp1").to_pydict()
    history = [h for h in wandb_history(records) if "train/loss" in h]
    assert [h["_step"] for h in history] == rows["step"] == list(range(1, 10))
    assert [h["train/loss"] for h in history] == pytest.approx(rows["loss"], rel=1e-7)
    assert [h["train/lr"] for h in history] == rows["lr"]
    tables = [h for h in wandb_history(records) if "guardrails/events/_type" in h]
    assert tables and all(t["guardrails/events/_type"] == "table-file" for t in tables)
    assert tables[-1]["guardrails/events/nrows"] >= 2  # custom, end
    exits = [r.exit for r in records if r.WhichOneof("record_type") == "exit"]
    assert exits and exits[-1].exit_code == 0
    assert our_warnings(caplog) == [m for m in our_warnings(caplog) if "odd" in m]


@pytest.mark.slow(reason="imports wandb and runs it offline: ~2.3 CPU-s")
def test_wandb_uses_the_users_run_and_leaves_it_open(tmp_path, wandb_offline):
    run = wandb_offline.init(project="mine", dir=str(tmp_path))
    with pytest.raises(RuntimeError):
        train(tmp_path, 6, fail_at=4, log_to="wandb", metrics={"every_n_steps": 2})
    assert wandb_offline.run is run  # not finished: it is the user's
    assert run.summary["guardrails/end"].startswith("RuntimeError: planted failure")
    run.log({"after": 1.0}, step=10)  # still usable
    run.finish()
    history = wandb_history(read_wandb(tmp_path))
    assert [h["_step"] for h in history if "train/loss" in h] == [1, 2, 3, 4]


def test_wandb_resumed_run_continues_the_step_axis(tmp_path, wandb_offline):
    knobs = {"log_to": "wandb", "metrics": {"every_n_steps": 2}}
    train(tmp_path, 8, stop_at=3, **knobs)
    train(tmp_path, 8, **knobs)
    files = sorted(Path(tmp_path, "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2  # one W&B run per process
    steps = []
    for f in files:
        recs = read_wandb_file(f)
        steps.append([h["_step"] for h in wandb_history(recs) if "train/loss" in h])
    assert sorted(steps) == [[1, 2, 3], [4, 5, 6, 7, 8]]


# ---------------------------------------------------------------------- MLflow


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow", reason="the mlflow extra is not installed")
    # MLflow 3 keeps its file store only on request; the test needs no database.
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = f"file:{tmp_path / 'mlruns'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    for key in ("MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    yield mlflow, mlflow.MlflowClient(tracking_uri=uri)
    while mlflow.active_run() is not None:
        mlflow.end_run()


def test_mlflow_file_store_holds_every_row_at_its_step(tmp_path, mlflow_store, caplog):
    _, client = mlflow_store
    caplog.set_level(logging.INFO)
    train(
        tmp_path / "exp2",
        9,
        log_to="mlflow",
        metrics={"every_n_steps": 2, "write_every_s": 0},
        inside=lambda g: g.step == 3 and g.event("custom", level="warning", message="odd"),
    )
    [run] = client.search_runs(["0"])
    assert run.info.run_name == "exp2" and run.info.status == "FINISHED"
    rows = guardrails.read_metrics(tmp_path / "exp2").to_pydict()
    for column in ("loss", "grad_norm", "lr"):
        hist = sorted(
            client.get_metric_history(run.info.run_id, f"train/{column}"), key=lambda m: m.step
        )
        assert [m.step for m in hist] == rows["step"] == list(range(1, 10))
        assert [m.value for m in hist] == pytest.approx(rows[column], rel=1e-7)
        assert [m.timestamp for m in hist] == [int(t * 1000) for t in rows["time"]]
    assert run.data.tags["guardrails.end"] == "ok"
    assert run.data.tags["guardrails.custom"] == "step 3, rank 0: custom (warning): odd"
    text = Path(run.info.artifact_uri.removeprefix("file:"), "guardrails", "events.jsonl")
    kinds = [json.loads(line)["kind"] for line in text.read_text().splitlines()]
    assert kinds[-1] == "end" and "custom" in kinds
    assert [m for m in our_warnings(caplog) if "odd" not in m] == []


def test_mlflow_uses_the_active_run_and_leaves_it_open(tmp_path, mlflow_store):
    mlflow, client = mlflow_store
    with mlflow.start_run(run_name="mine") as mine:
        with pytest.raises(RuntimeError):
            train(tmp_path, 6, fail_at=4, log_to="mlflow", metrics={"every_n_steps": 2})
        assert mlflow.active_run().info.run_id == mine.info.run_id
        assert client.get_run(mine.info.run_id).info.status == "RUNNING"
    run = client.get_run(mine.info.run_id)
    assert run.info.status == "FINISHED"  # ended by the user's with-block, not by us
    hist = client.get_metric_history(run.info.run_id, "train/loss")
    assert sorted(m.step for m in hist) == [1, 2, 3, 4]
    assert run.data.tags["guardrails.end"].startswith("RuntimeError: planted failure")


def test_mlflow_a_run_it_started_fails_with_the_loop(tmp_path, mlflow_store):
    _, client = mlflow_store
    with pytest.raises(RuntimeError):
        train(tmp_path, 6, fail_at=4, log_to=guardrails.MLflowSink(run_name="r1"))
    [run] = client.search_runs(["0"])
    assert run.info.run_name == "r1" and run.info.status == "FAILED"


def test_mlflow_resumed_run_continues_the_step_axis(tmp_path, mlflow_store):
    _, client = mlflow_store
    knobs = {"log_to": "mlflow", "metrics": {"every_n_steps": 2}}
    train(tmp_path, 8, stop_at=3, **knobs)
    train(tmp_path, 8, **knobs)
    runs = client.search_runs(["0"], order_by=["attributes.start_time ASC"])
    steps = [
        sorted(m.step for m in client.get_metric_history(r.info.run_id, "train/loss")) for r in runs
    ]
    assert steps == [[1, 2, 3], [4, 5, 6, 7, 8]]
    assert not math.isnan(runs[1].data.metrics["train/loss"])
