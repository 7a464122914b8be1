"""Metric sinks: telemetry's rows and the run's events, also sent to TensorBoard,
Weights & Biases, MLflow or a function of yours (``guard(log_to=...)``).

Telemetry already brings every step's row to the host without a sync
(``engine/lagged.py``) and writes them as a parquet part every ``write_every_s`` seconds
and at close. A sink receives exactly those parts, as the same ``pyarrow.Table``, so it
costs the training step nothing: no per-step call, no host read of a device value.
Between the rows come the events of the same rank (skips, spikes, saves, a stop, the
end), read from this node's events file, each placed after the rows of the steps it follows, so
a sink sees one stream in step order.

Sinks run on rank 0 only (one dashboard curve per run; every rank's rows stay in
``metrics.parquet``), and not on the training thread: the main thread hands each part
to one ``guardrails-sinks`` thread, which calls the sinks in order. A slow tracking
server (an HTTP request per batch) or ``wandb``'s own work never stalls a step and
never makes rank 0 the straggler the other ranks wait for. A sink that raises is
turned off with one warning naming it and the error; training goes on.

The three packages are optional extras, imported only when their sink opens:
``pip install torch-guardrails[tensorboard]`` (``[wandb]``, ``[mlflow]``).

What a sink costs is its own work per row, on its thread: measured on a busy CPU
host (benchmarks/sinks_bench.py), TensorBoard ~0.1-0.3 ms a row, W&B offline ~0.6-2.5 ms,
MLflow's file store ~1-2 ms. The training thread's share is ~2 us a part. On a
host-bound loop of ~2 ms steps with all three on 2 cores that CPU work showed as
+2.2 ms a step (the cores are shared); each sink's ``every_n_steps`` thins the rows it
logs.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import json
import logging
import math
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from guardrails.util.checks import positive_int

logger = logging.getLogger("guardrails.sinks")

#: Each column of ``metrics.parquet`` a sink shows, and its name there: one namespace,
#: the same in every tool, so a TensorBoard and a W&B chart of a run read alike.
SCALARS: dict[str, str] = {
    "loss": "train/loss",
    "grad_norm": "train/grad_norm",
    "lr": "train/lr",
    "tokens_per_s": "train/tokens_per_s",
    "tokens": "train/tokens",
    "step_time_s": "train/step_time_s",
    "data_wait_s": "train/data_wait_s",
    "forward_s": "train/forward_s",
    "backward_s": "train/backward_s",
    "optimizer_s": "train/optimizer_s",
    "gc_s": "train/gc_s",
    "mem_peak_bytes": "train/mem_peak_bytes",
    "skipped": "train/skipped",
}
#: Columns whose NaN is a finding (a non-finite loss or gradient), shown as NaN. In the
#: others a NaN means "not measured" (a learning rate kept on the device) and is left out.
_NAN_IS_NEWS = ("loss", "grad_norm")

#: ``log_to="..."``: the sinks known by name -> (the package it needs, the extra).
NAMED: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
}

#: How long the end of a run waits for the sinks' last writes after the watchdog ended
#: the process from a thread: inside the 5 s the process has for its last words.
ABORT_WAIT_S = 3.0


class Sink:
    """Where telemetry's rows go besides ``metrics.parquet``: subclass it (or pass any
    object with a ``write`` method, or a plain function of the rows) to
    ``guard(log_to=...)``.

    ``open`` runs once at the guard's start, on the main thread of rank 0; ``write``,
    ``event`` and ``close`` run on guardrails' sink thread, in step order: a part's
    rows (every ``metrics={"write_every_s": ...}`` seconds and at close; the same
    ``pyarrow.Table`` as the parquet part), with this rank's events placed after the
    rows of the steps they follow. A method that raises turns this sink off for the
    rest of the run, with one warning; training goes on.
    """

    def open(self, run_dir: Path) -> None:
        """At the guard's start (main thread): open files, runs, connections."""

    def write(self, rows: pa.Table) -> None:
        """Rows of consecutive steps, in order, each exactly once: the columns of
        ``metrics.parquet`` (``step``, ``loss``, ``grad_norm``, ``lr``...). For a list
        of dicts: ``rows.to_pylist()``."""
        raise NotImplementedError

    def event(self, event: dict[str, Any]) -> None:
        """One line of ``events.jsonl`` (``time``, ``rank``, ``step``, ``kind``,
        ``level``, ``message`` and the kind's fields), the ``end`` event last."""

    def close(self) -> None:
        """At the guard's end, after the last rows and the ``end`` event."""


def sink_name(sink: Any) -> str:
    """How warnings name a sink: its class, or a function's qualified name."""
    if isinstance(sink, _Function):
        sink = sink.fn
    name = getattr(sink, "__qualname__", None) or type(sink).__qualname__
    return str(name)


def check_sinks(value: Any, knob: str = "sinks") -> tuple[Any, ...]:
    """``value`` (a name, a sink, a function, or a list of those) as a tuple, each
    checked: an unknown name or object raises naming the valid choices; a named sink
    whose package is missing raises naming the extra that installs it. Nothing is
    imported here (``find_spec`` looks the package up without importing it)."""
    if value is None:
        return ()
    items = tuple(value) if isinstance(value, (list, tuple)) else (value,)
    for item in items:
        if isinstance(item, str):
            if item not in NAMED:
                close = difflib.get_close_matches(item.lower(), NAMED, n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise ValueError(
                    f"{knob}: unknown sink {item!r}.{hint} The named ones are "
                    f"{', '.join(repr(n) for n in NAMED)}; or pass a guardrails.Sink, an "
                    "object with a write(rows) method, or a function(rows)."
                )
        elif isinstance(item, type):
            raise TypeError(
                f"{knob} takes sink objects, not classes: pass {item.__name__}(), not "
                f"{item.__name__}."
            )
        elif not (callable(getattr(item, "write", None)) or callable(item)):
            raise TypeError(
                f"{knob} takes {', '.join(repr(n) for n in NAMED)}, a guardrails.Sink, an "
                "object with a write(rows) method or a function(rows: pyarrow.Table), or "
                f"a list of those; got {type(item).__name__}."
            )
    # Packages last: a misspelled name is said even where another sink's package is missing.
    for item in items:
        if isinstance(item, str):
            require(item)
    return items


def require(name: str) -> None:
    """Raise ``ModuleNotFoundError`` with the install command if the package the named
    sink needs is not installed."""
    package, extra = NAMED[name]
    if importlib.util.find_spec(package) is None:
        raise ModuleNotFoundError(
            f"log_to={name!r} needs the {package} package, which is not installed: "
            f"pip install 'torch-guardrails[{extra}]' (or pip install {package}).",
            name=package,
        )


def build(items: Sequence[Any]) -> list[Any]:
    """The sink objects for the checked ``items``: names become the built-in sinks,
    functions are wrapped."""
    made: list[Any] = []
    for item in items:
        if isinstance(item, str):
            made.append(
                {"tensorboard": TensorBoardSink, "wandb": WandbSink, "mlflow": MLflowSink}[item]()
            )
        elif callable(getattr(item, "write", None)):
            made.append(item)
        else:
            made.append(_Function(item))
    return made


class _Function(Sink):
    """A plain function of the rows, as a sink."""

    def __init__(self, fn: Callable[[pa.Table], Any]) -> None:
        self.fn = fn

    def write(self, rows: pa.Table) -> None:
        self.fn(rows)


# ---------------------------------------------------------------------- the runner


class SinkRunner:
    """Rank 0's sinks, fed from the training thread and called on their own thread.

    :meth:`deliver` only puts the part on a queue (a few microseconds, once per part);
    the thread places the events between the rows (:meth:`_dispatch`) and calls each
    sink. One thread for all sinks keeps each sink's calls in order.
    """

    def __init__(self, sinks: Sequence[Any], run_dir: Path) -> None:
        self.run_dir = run_dir
        self.sinks: list[Any] = []
        for sink in sinks:  # on the caller's thread: W&B and MLflow look for its run
            if self._call(sink, "open", run_dir, opening=True):
                self.sinks.append(sink)
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._held: list[dict[str, Any]] = []  # events after the last row delivered
        self._thread = threading.Thread(target=self._loop, name="guardrails-sinks", daemon=True)
        self._thread.start()

    def deliver(self, rows: pa.Table | None, events: list[dict[str, Any]]) -> None:
        """Queue a part's rows (or ``None``) and the events read with it."""
        if rows is not None or events:
            self._queue.put((rows, events))

    def close(self, timeout_s: float) -> bool:
        """Deliver what is queued, close the sinks; wait at most ``timeout_s``. Returns
        whether everything was delivered in time."""
        self._queue.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning(
                "guardrails: the metrics sinks (%s) were still writing %g s after the "
                "run ended; the rows they had not sent are in %s",
                ", ".join(sink_name(s) for s in self.sinks),
                timeout_s,
                self.run_dir / "metrics.parquet",
            )
            return False
        return True

    # ------------------------------------------------------------- the sink thread

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                break
            self._dispatch(*item)
        held, self._held = self._held, []
        for event in held:  # events after the last row (the end)
            self._each("event", event)
        for sink in list(self.sinks):
            self._call(sink, "close")
        self.sinks = []

    def _dispatch(self, rows: pa.Table | None, events: list[dict[str, Any]]) -> None:
        """The rows, with each held or new event after the rows of its step; an event
        past the last row waits for the rows of its step (they reach the host later
        than the event is written)."""
        pending = sorted(self._held + events, key=lambda e: _step_of(e))
        self._held = []
        if rows is None or rows.num_rows == 0:
            self._held = pending
            return
        steps = rows.column("step").to_numpy()
        done = 0
        for i, event in enumerate(pending):
            step = _step_of(event)
            if step > steps[-1]:
                self._held = pending[i:]
                break
            upto = int(np.searchsorted(steps, step, side="right"))
            if upto > done:
                self._each("write", rows.slice(done, upto - done))
                done = upto
            self._each("event", event)
        if done < rows.num_rows:
            self._each("write", rows.slice(done))

    def _each(self, method: str, arg: Any) -> None:
        for sink in list(self.sinks):
            if not self._call(sink, method, arg):
                self.sinks.remove(sink)

    def _call(self, sink: Any, method: str, *args: Any, opening: bool = False) -> bool:
        fn = getattr(sink, method, None)
        if fn is None:  # a duck-typed sink without this method
            return True
        try:
            fn(*args)
        except Exception as err:
            logger.warning(
                "guardrails: the metrics sink %s failed in %s(): %s: %s. It is off for the "
                "rest of this run; training goes on and every row is still in %s.",
                sink_name(sink),
                method,
                type(err).__name__,
                err,
                self.run_dir / "metrics.parquet",
            )
            if method != "close" and not opening:
                try:  # let it release what it holds (a W&B run it started)
                    close = getattr(sink, "close", None)
                    if close is not None:
                        close()
                except Exception as again:
                    logger.debug("guardrails: closing the failed sink raised %r", again)
            return False
        return True


def _step_of(event: dict[str, Any]) -> int:
    step = event.get("step")
    return step if isinstance(step, int) else 0


class EventTail:
    """The lines this node's events file (``path``: ``events.<host>.jsonl``, where
    this rank writes) gained since this guard started, of one rank: read at each part
    (one ``read`` of the new bytes; events are rare), not per step."""

    def __init__(self, path: Path, rank: int) -> None:
        self.rank = rank
        self._file: Any = None
        self._partial = b""
        try:
            self._file = open(path, "rb")  # noqa: SIM115 (kept open for the run)
            self._file.seek(0, os.SEEK_END)  # this run's start event is already there
        except OSError as err:  # no events file (a read-only run_dir): the rows still go
            logger.debug("guardrails: the sinks get no events: %r", err)

    def read(self) -> list[dict[str, Any]]:
        if self._file is None:
            return []
        try:
            data = self._partial + self._file.read()
        except (OSError, ValueError) as err:  # never fail the training step for this
            logger.debug("guardrails: reading the events for the sinks failed: %r", err)
            return []
        lines = data.split(b"\n")
        self._partial = lines.pop()  # a line another rank is writing right now
        out = []
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("rank") == self.rank:
                out.append(record)
        return out

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


# ---------------------------------------------------------------------- helpers


def rows_to_scalars(
    rows: pa.Table, every_n_steps: int = 1
) -> Iterator[tuple[int, float, dict[str, float]]]:
    """``(step, unix time, {name: value})`` per row: the :data:`SCALARS` a row has
    (unknown tokens, a NaN learning rate left out; a NaN loss kept). With
    ``every_n_steps`` > 1, the rows of steps divisible by it, every skipped step and
    every non-finite loss."""
    cols = {}
    for column in SCALARS:
        if column in rows.column_names:
            values = rows.column(column).to_pylist()
            cols[column] = values
    steps = rows.column("step").to_pylist()
    times = rows.column("time").to_pylist()
    skipped, loss = cols.get("skipped"), cols.get("loss")
    for i, step in enumerate(steps):
        if every_n_steps > 1 and step % every_n_steps:
            finding = (skipped and skipped[i]) or (loss and not math.isfinite(loss[i] or 0.0))
            if not finding:
                continue
        out: dict[str, float] = {}
        for column, values in cols.items():
            v = values[i]
            if v is None:
                continue
            v = float(v)
            if math.isnan(v) and column not in _NAN_IS_NEWS:
                continue
            out[SCALARS[column]] = v
        yield step, times[i], out


def event_text(event: dict[str, Any]) -> str:
    """One line for an event: ``step 12, rank 0: nonfinite (warning): <message>``;
    with no message, its fields."""
    kind = event.get("kind", "event")
    level = event.get("level", "info")
    head = f"step {event.get('step')}, rank {event.get('rank')}: {kind}"
    if level != "info":
        head += f" ({level})"
    message = event.get("message") or ""
    if not message:
        skip = ("time", "rank", "step", "kind", "level", "message")
        fields = {k: v for k, v in event.items() if k not in skip and v is not None}
        message = json.dumps(fields, default=str) if fields else ""
    return f"{head}: {message}" if message else head


def end_event(step: int, rank: int, error: BaseException | None, **fields: Any) -> dict[str, Any]:
    """The ``end`` event as sinks see it, written by telemetry at its close (the guard
    writes its own to ``events.jsonl`` after every component has closed)."""
    text = None
    if error is not None:
        text = getattr(error, "guardrails_message", None) or f"{type(error).__name__}: {error}"
    return {
        "time": time.time(),
        "rank": rank,
        "step": step,
        "kind": "end",
        "level": "info" if error is None else "error",
        "message": "" if text is None else text,
        "error": text,
        **fields,
    }


def _import(name: str) -> Any:
    """Import the package a named sink needs, or raise with the install command."""
    require(name)
    return importlib.import_module(NAMED[name][0])


# ---------------------------------------------------------------------- TensorBoard


class TensorBoardSink(Sink):
    """Scalars (``train/loss``, ``train/grad_norm``, ``train/lr``,
    ``train/tokens_per_s``... at the training step) and events (text under
    ``events/<kind>``) in TensorBoard's files, through
    ``torch.utils.tensorboard.SummaryWriter``.

    Args:
        log_dir: where the event files go; default ``run_dir/tensorboard``. A resumed
            run writes to the same directory and its first step purges what the
            interrupted process logged after its checkpoint, so each step shows once
            and the curve continues.
        every_n_steps: log the rows of every this many steps (and every skipped or
            non-finite step); default 1, every row. A row costs the sink thread
            ~0.1-0.3 ms of CPU (measured on a busy CPU host).
    """

    def __init__(
        self, log_dir: str | os.PathLike[str] | None = None, *, every_n_steps: int = 1
    ) -> None:
        positive_int("every_n_steps", every_n_steps)
        self.every_n_steps = every_n_steps
        self.log_dir = None if log_dir is None else Path(log_dir)
        self._writer: Any = None
        self._file_writer: Any = None

    def open(self, run_dir: Path) -> None:
        _import("tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self._cls = SummaryWriter
        self._dir = run_dir / "tensorboard" if self.log_dir is None else self.log_dir
        self._writer = None

    def _open_writer(self, first_step: int) -> None:
        # purge_step: TensorBoard drops what earlier files hold from this step on (an
        # interrupted process's steps after its checkpoint), so a resumed run's curve
        # continues without a doubled stretch.
        self._writer = self._cls(log_dir=str(self._dir), purge_step=first_step)
        self._file_writer = getattr(self._writer, "_get_file_writer", None)

    def write(self, rows: pa.Table) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        if self._writer is None:
            self._open_writer(rows.column("step")[0].as_py())
        fw = self._file_writer() if self._file_writer is not None else None
        for step, t, values in rows_to_scalars(rows, self.every_n_steps):
            if fw is not None:
                # One Summary per row rather than one add_scalar per value: 96 us a row
                # instead of 520 us (10 values, this machine).
                summary = Summary(
                    value=[Summary.Value(tag=k, simple_value=v) for k, v in values.items()]
                )
                fw.add_summary(summary, step, t)
            else:  # pragma: no cover (a torch without the private helper)
                for k, v in values.items():
                    self._writer.add_scalar(k, v, global_step=step, walltime=t)
        self._writer.flush()

    def event(self, event: dict[str, Any]) -> None:
        if self._writer is None:
            self._open_writer(_step_of(event) + 1)  # the next row's step
        self._writer.add_text(
            f"events/{event.get('kind', 'event')}",
            event_text(event),
            global_step=_step_of(event),
            walltime=event.get("time"),
        )

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


# ---------------------------------------------------------------------- W&B


class WandbSink(Sink):
    """Scalars to Weights & Biases with ``step=`` the training step; events in a
    ``guardrails/events`` table and the run's summary (``guardrails/end``).

    Uses the run you started (``wandb.init(...)`` before the guard) and leaves it
    open; else starts one (``project``: this argument, ``WANDB_PROJECT``, or the run
    directory's name; files under ``run_dir/wandb``) and finishes it at the end, marked
    failed if the loop failed. A resumed process starts a new W&B run whose steps
    continue where the checkpoint left off.

    Args:
        project: the W&B project of a run this sink starts.
        every_n_steps: log the rows of every this many steps (and every skipped or
            non-finite step); default 1, every row. A row costs the sink thread
            ~0.6-2.5 ms of CPU in ``wandb.log`` (measured offline on a busy CPU
            host): raise this for loops of more than a few hundred steps a second.
        init: more ``wandb.init`` arguments for a run this sink starts.
    """

    def __init__(self, project: str | None = None, *, every_n_steps: int = 1, **init: Any) -> None:
        positive_int("every_n_steps", every_n_steps)
        self.every_n_steps = every_n_steps
        self.project = project
        self.init = init
        self._run: Any = None
        self._owns = False

    def open(self, run_dir: Path) -> None:
        wandb = _import("wandb")
        self._wandb = wandb
        self._events: list[list[Any]] = []
        self._dirty = False
        self._step = 0
        self._error: str | None = None
        if wandb.run is not None:
            self._run, self._owns = wandb.run, False
            return
        kw = {
            "project": self.project or os.environ.get("WANDB_PROJECT") or run_dir.name,
            "dir": str(run_dir),
            **self.init,
        }
        self._run, self._owns = wandb.init(**kw), True

    def write(self, rows: pa.Table) -> None:
        self._log_events()
        for step, _t, values in rows_to_scalars(rows, self.every_n_steps):
            if step < self._step:  # W&B drops a step below its newest: never send one
                continue
            self._run.log(values, step=step)
            self._step = step

    def event(self, event: dict[str, Any]) -> None:
        self._events.append(
            [
                _step_of(event),
                event.get("rank"),
                event.get("kind"),
                event.get("level"),
                event_text(event),
            ]
        )
        self._dirty = True
        if event.get("kind") == "end":
            self._error = event.get("error")
            self._run.summary["guardrails/end"] = self._error or "ok"

    def _log_events(self) -> None:
        if not self._dirty:
            return
        self._dirty = False
        table = self._wandb.Table(
            columns=["step", "rank", "kind", "level", "text"], data=list(self._events)
        )
        # At W&B's newest step: an event may concern an older step (a lagged NaN
        # verdict), and W&B drops anything logged below its newest step.
        self._run.log({"guardrails/events": table}, step=self._step)

    def close(self) -> None:
        if self._run is None:
            return
        try:
            self._log_events()
        finally:
            run, self._run = self._run, None
            if self._owns:
                run.finish(exit_code=0 if self._error is None else 1)


# ---------------------------------------------------------------------- MLflow


class MLflowSink(Sink):
    """Scalars to MLflow (``log_batch``, 1000 values a request, ``step=`` the training
    step); events in the run's artifact ``guardrails/events.jsonl``, warnings and
    errors also as tags ``guardrails.<kind>``, and the end as ``guardrails.end``.

    Uses the run active when the guard starts (``mlflow.start_run()`` before it) and
    leaves it open; else starts one in ``experiment_name`` (or ``MLFLOW_EXPERIMENT_NAME``
    / ``MLFLOW_EXPERIMENT_ID`` / the one ``mlflow.set_experiment`` chose / Default),
    named ``run_name`` or the run directory's name, and ends it at the end (``FAILED``
    if the loop failed). A resumed process starts a new MLflow run whose steps
    continue where the checkpoint left off.

    Args:
        experiment_name: the experiment of a run this sink starts (created if missing).
        run_name: the name of a run this sink starts.
        tracking_uri: the tracking server or store; default MLflow's own
            (``MLFLOW_TRACKING_URI``, ``mlflow.set_tracking_uri``).
        every_n_steps: log the rows of every this many steps (and every skipped or
            non-finite step); default 1, every row. A row costs the sink thread ~1-2 ms
            of CPU with MLflow's file store (one file append per value; measured on a
            a busy CPU host), less through a tracking server (one request a batch).
    """

    #: MLflow's limit of values per ``log_batch`` request.
    BATCH = 1000

    def __init__(
        self,
        *,
        experiment_name: str | None = None,
        run_name: str | None = None,
        tracking_uri: str | None = None,
        every_n_steps: int = 1,
    ) -> None:
        positive_int("every_n_steps", every_n_steps)
        self.every_n_steps = every_n_steps
        self.experiment_name = experiment_name
        self.run_name = run_name
        self.tracking_uri = tracking_uri
        self.run_id: str | None = None
        self._owns = False

    def open(self, run_dir: Path) -> None:
        mlflow = _import("mlflow")
        from mlflow import MlflowClient

        self._events: list[dict[str, Any]] = []
        self._dirty = False
        self._error: str | None = None
        # The active run is the main thread's (MLflow keeps it per thread): look now,
        # then log through the client from the sink thread.
        active = mlflow.active_run()
        self._client = MlflowClient(tracking_uri=self.tracking_uri)
        if active is not None and self.tracking_uri is None:
            self.run_id, self._owns = active.info.run_id, False
            return
        run = self._client.create_run(self._experiment_id(), run_name=self.run_name or run_dir.name)
        self.run_id, self._owns = run.info.run_id, True

    def _experiment_id(self) -> str:
        name = self.experiment_name or os.environ.get("MLFLOW_EXPERIMENT_NAME")
        if name:
            found = self._client.get_experiment_by_name(name)
            return found.experiment_id if found else self._client.create_experiment(name)
        # mlflow.set_experiment() sets this variable too.
        return os.environ.get("MLFLOW_EXPERIMENT_ID") or "0"  # "0": MLflow's Default

    def write(self, rows: pa.Table) -> None:
        from mlflow.entities import Metric

        self._log_events()
        metrics = [
            Metric(key, value, int(t * 1000), step)
            for step, t, values in rows_to_scalars(rows, self.every_n_steps)
            for key, value in values.items()
        ]
        for i in range(0, len(metrics), self.BATCH):
            self._client.log_batch(self.run_id, metrics=metrics[i : i + self.BATCH])

    def event(self, event: dict[str, Any]) -> None:
        self._events.append(event)
        self._dirty = True
        kind = event.get("kind", "event")
        if kind == "end":
            self._error = event.get("error")
            self._client.set_tag(self.run_id, "guardrails.end", (self._error or "ok")[:5000])
        elif event.get("level") in ("warning", "error"):
            self._client.set_tag(self.run_id, f"guardrails.{kind}", event_text(event)[:5000])

    def _log_events(self) -> None:
        if not self._dirty:
            return
        self._dirty = False
        from guardrails.metrics.events import json_safe

        text = "".join(json.dumps(json_safe(e), default=str) + "\n" for e in self._events)
        self._client.log_text(self.run_id, text, "guardrails/events.jsonl")

    def close(self) -> None:
        if self.run_id is None:
            return
        try:
            self._log_events()
        finally:
            run_id, self.run_id = self.run_id, None
            if self._owns:
                status = "FINISHED" if self._error is None else "FAILED"
                self._client.set_terminated(run_id, status=status)
