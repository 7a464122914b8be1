"""Per-step health signals, kept on the device and flushed lagged: ``metrics.parquet``.

The standard advice is "watch loss, grad-norm, LR and tokens/sec", and also "remove
.item() from the hot loop" (a per-step ``.item()`` costs 2-7% of a GPT-2-small step on
an H200). Telemetry does both:

* Device values (loss, grad norm, skipped flag) are written each step into a
  preallocated ``(every_n_steps, 3)`` ring on the device with one ``torch.stack(...,
  out=row)`` kernel. Host values (step, time, lr, step time, data wait, tokens, memory)
  go into a numpy ring of the same length.
* Every ``every_n_steps`` steps the ring is copied to pinned host memory with one
  ``non_blocking`` copy and a CUDA event is recorded. The copy is read one interval
  later, when it has long finished, so the host never waits on the device. On CPU the
  copy is a plain memcpy.
* Rows are written as parquet "parts" under ``run_dir/metrics.parquet/`` (a directory
  dataset: ``pandas.read_parquet(dir)``, ``pyarrow.parquet.read_table(dir)``, duckdb
  ``read_parquet('dir/*.parquet')`` all read it). A part is written at most every
  ``write_every_s`` seconds and at close, each atomically (temp name, then rename), so a
  run killed by SIGKILL keeps every part written before it died. Once an hour
  (``compact_every_s``) is over, a thread merges the rank's parts of that hour into one
  file (``metrics/compact.py``): 720 files per rank in 30 days, not 43,200.
* A part that cannot be written (a full disk, a read-only remount, a quota: any
  ``OSError``) does not stop training: its rows stay in memory (at most
  :data:`MAX_PENDING_ROWS`, the oldest dropped beyond it and counted in
  ``rows_dropped``), the trouble is logged once (again at most every 10 min) and the
  next part writes them too. Otherwise a full disk would end a run at its next part.

Rank 0 also shows a tqdm bar (step, loss, grad norm, tok/s), updated from the same
lagged values: it costs no sync, and its loss is up to ``2 * every_n_steps`` old. Over a
loader with a length its total is the step the current pass ends at (and so its ETA).

Each part also goes to the ``sinks`` (TensorBoard, W&B, MLflow, a function:
``metrics/sinks.py``) on rank 0, with the events written since the last part, through
one queue put: the sinks run on their own thread, once per part, never per step.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from tqdm.auto import tqdm

from guardrails.engine.component import Component
from guardrails.engine.config import configure
from guardrails.engine.lagged import Copy
from guardrails.metrics.compact import Compactor
from guardrails.metrics.events import events_path
from guardrails.metrics.file import METRICS_DIR, SCHEMA
from guardrails.metrics.sinks import (
    ABORT_WAIT_S,
    EventTail,
    SinkRunner,
    build,
    check_sinks,
    end_event,
)
from guardrails.util.checks import flag, non_negative, positive, positive_int
from guardrails.util.files import make_dirs, restrict
from guardrails.util.storage import Trouble

if TYPE_CHECKING:
    from guardrails.engine.guard import Guard

try:  # ru_maxrss gives peak RSS on CPU runs; absent on Windows.
    import resource
except ImportError:  # pragma: no cover
    resource = None  # type: ignore[assignment]

logger = logging.getLogger("guardrails.telemetry")

#: Device columns, in ring order. float32: the loss and norm are read for humans.
DEVICE_COLUMNS = ("loss", "grad_norm", "skipped")
#: Host columns, in ring order. float64 holds step counts and byte counts exactly.
HOST_COLUMNS = (
    "step",
    "time",
    "lr",
    "step_time_s",
    "data_wait_s",
    "forward_s",
    "backward_s",
    "optimizer_s",
    "tokens",
    "gc_s",
    "mem_peak_bytes",
)
#: Part files the whole job may create a second, whatever its size: every rank writes
#: into one directory, usually on a shared filesystem whose metadata server serves the
#: whole cluster. A part a minute from 10,000 ranks would be 167 creations a second;
#: from 600 ranks on, the cadence stretches instead (1,000 s at 10,000 ranks), and the
#: compaction span with it (:func:`file_cadence`).
JOB_PARTS_PER_S = 10.0

#: Rows kept in memory while no part can be written (~100 bytes each as a table, so
#: ~10 MB): 2.8 h of a run at 10 steps/s. Beyond it the oldest rows are dropped.
MAX_PENDING_ROWS = 100_000


def file_cadence(
    write_every_s: float, compact_every_s: float | None, world: int
) -> tuple[float, float | None]:
    """``(write_every_s, compact_every_s)`` for a job of ``world`` ranks: as given, or
    both stretched by the same factor so that the job's part files stay within
    :data:`JOB_PARTS_PER_S` (and its compacted files in the same proportion)."""
    if write_every_s <= 0:  # a part at every copy: asked for, kept
        return write_every_s, compact_every_s
    factor = max(1.0, world / (JOB_PARTS_PER_S * write_every_s))
    if factor == 1.0:
        return write_every_s, compact_every_s
    compact = None if compact_every_s is None else compact_every_s * factor
    return write_every_s * factor, compact


class Telemetry(Component):
    """Records the per-step signals to ``run_dir/metrics.parquet`` and draws the bar.
    Knobs: :class:`Telemetry.Config` (``guardrails.guard(metrics=...)``)."""

    @dataclass(kw_only=True)
    class Config:
        """Telemetry's knobs.

        Attributes:
            every_n_steps: ring length: one device-to-host copy per this many steps (the
                only transfer telemetry makes). Larger means fewer copies and older
                values on the bar. Default 50.
            write_every_s: at most one parquet part file per this many seconds (and one
                at close). Bounds both the number of files and what a SIGKILL can lose.
                Default 60. Stretched from 600 ranks on (60 s x N / 600: 1,000 s at
                10,000 ranks) so the job creates at most 10 files a second in the
                shared directory.
            progress: show the tqdm bar on rank 0. ``None`` (default): only when stderr
                is a terminal and ``CI`` is not set.
            sinks: where rank 0 also sends every row and its events, at each part (so
                ``write_every_s`` is their cadence too): ``"tensorboard"``, ``"wandb"``,
                ``"mlflow"``, a :class:`~guardrails.Sink` (``TensorBoardSink(log_dir=...)``,
                your own), a function of the rows (a ``pyarrow.Table``), or a list of
                those. ``guard(log_to=...)`` sets it. Default: none.
            sink_close_timeout_s: at the end, how long to wait for the sinks' last
                writes (a W&B run they started finishing its upload). Default 120.
            compact_every_s: once each such span of time (aligned on the unix epoch)
                is over, merge this rank's parts of it into one file, on a thread of its
                own, so a long run is a bounded number of files. Default 3600 (hourly:
                720 files per rank in 30 days instead of 43,200); ``None`` keeps every
                part. Stretched with ``write_every_s``, by the same factor.
        """

        every_n_steps: int = 50
        write_every_s: float = 60.0
        progress: bool | None = None
        sinks: tuple[Any, ...] = ()
        sink_close_timeout_s: float = 120.0
        compact_every_s: float | None = 3600.0

        def __post_init__(self) -> None:
            positive_int("every_n_steps", self.every_n_steps)
            if self.progress is not None:
                flag("progress", self.progress)
            non_negative("write_every_s", self.write_every_s)
            self.write_every_s = float(self.write_every_s)
            self.sinks = check_sinks(self.sinks, "sinks")
            non_negative("sink_close_timeout_s", self.sink_close_timeout_s)
            if self.compact_every_s is not None:
                positive("compact_every_s", self.compact_every_s)
                self.compact_every_s = float(self.compact_every_s)

    name = "telemetry"

    def __init__(self, config: Telemetry.Config | None = None, /, **knobs: Any) -> None:
        configure(self, config, knobs)
        # The newest row that reached the host, (device columns, host columns): made
        # into a dict only when read (latest), not at every flush.
        self._newest: tuple[np.ndarray, np.ndarray] | None = None
        self.rows_written = 0
        #: Rows dropped because no part could be written for too long (a full disk).
        self.rows_dropped = 0
        # Rows a failed part could not write, retried with the next part.
        self._unwritten: pa.Table | None = None
        self._bar: Any = None
        self._sinks: SinkRunner | None = None
        self._tail: EventTail | None = None
        self._compactor: Compactor | None = None
        # Whichever of on_end (main thread) and on_abort (a thread ending the process)
        # comes first writes the last rows, under this lock; the other writes none.
        # Before, a rank the watchdog ended wrote its last rows twice: on_abort's, then
        # on_end's once the abort of its process group freed its main thread.
        self._end_lock = threading.Lock()
        self._ended = False

    # ------------------------------------------------------------------ lifecycle

    def on_start(self, guard: Guard) -> None:
        n = self.every_n_steps
        self._dir = guard.run_dir / METRICS_DIR
        self._trouble = Trouble(f"metrics to {self._dir}", guard.run_dir, logger)
        with contextlib.suppress(OSError):  # a full or read-only disk: retried at each part
            make_dirs(self._dir)
        self._rank = guard.rank
        # A part being written when its process was killed stays as a temp file: this
        # rank's are removed (older versions' names ended in .parquet and broke *.parquet
        # globs: duckdb's and polars' readers failed on the half-written file).
        for pattern in (f".part-r{self._rank:05d}-*.tmp", f".tmp-part-r{self._rank:05d}-*"):
            for stale in self._dir.glob(pattern):
                stale.unlink(missing_ok=True)
        self._started_at = time.time()
        self.write_every_s, self.compact_every_s = file_cadence(
            self.write_every_s, self.compact_every_s, guard.world_size
        )
        if self.compact_every_s is not None:
            self._compactor = Compactor(self._dir, self._rank, self.compact_every_s)
            self._compactor.start()
        self._device = guard.device
        self._cuda = guard.device.type == "cuda"
        # The device columns are the step ring's row, written once per step for NanGuard
        # and telemetry (engine/lagged.StepRing), copied to the host once per interval and
        # read an interval later; each copy keeps the host columns of its rows (meta).
        self._ring = guard.step_ring
        self._copies = self._ring.reader(n)
        self._host_rows: list[tuple[float, ...]] = []
        self._gc_total = guard.shared.gc_total_s
        self._arrived: list[tuple[np.ndarray, np.ndarray]] = []  # (device, host) blocks
        # The step of the last row flushed (0: none), so the end tells whether the step
        # the run ended inside was recorded already (set once per interval).
        self._flushed_step = 0.0
        self._last_write = time.monotonic()
        show = self.progress
        if show is None:
            show = sys.stderr.isatty() and not os.environ.get("CI")
        # Drawn from the first step on (_open_bar): a resumed run's count then starts
        # at its checkpoint's step, and a step's batches are known (its total).
        self._want_bar = bool(show) and guard.rank == 0
        self._bar_epoch: int | None = None  # the pass the bar's total was computed for
        if self.sinks and guard.rank == 0:
            self._tail = EventTail(events_path(guard.run_dir), guard.rank)
            self._sinks = SinkRunner(build(self.sinks), guard.run_dir)

    def after_step(self, guard: Guard) -> None:
        count = guard.step_row()  # written by NanGuard already, or now (no kernel on CPU)
        skipped = guard.skipped
        if skipped is not None:
            flag = self._ring.flags[self._ring.i]
            if skipped is not flag:  # NanGuard's is the row's own slot: nothing to copy
                flag.copy_(skipped)
        rows = self._host_rows
        # A tuple append (~0.3 us) rather than seven numpy item writes (~1 us); its
        # order is HOST_COLUMNS without the last (mem_peak_bytes, read at flush), then
        # the row's count in the step ring.
        rows.append(
            (
                guard.step,
                time.time(),
                guard.lr,
                guard.step_time_s,
                guard.data_wait_s,
                guard.forward_s,
                guard.backward_s,
                guard.optimizer_s,
                math.nan if guard.tokens is None else guard.tokens,
                guard.shared.gc_total_s,  # cumulative here; per step at flush
                count,
            )
        )
        bar = self._bar
        if bar is not None:
            # A new pass, or past the total (an accumulation carried over a pass's end).
            if guard.epoch != self._bar_epoch or (bar.total is not None and guard.step > bar.total):
                self._set_total(guard)
            bar.update(1)
        elif self._want_bar:
            self._open_bar(guard)
        if len(rows) == self.every_n_steps:
            self._flush()

    def on_end(self, guard: Guard, exc: BaseException | None) -> None:
        # Also on a crash: what was measured up to the failure is what a
        # post-mortem needs most, the step that failed first of all (NanGuard's
        # NonFiniteError, an optimizer that raised): its row, when it has one.
        try:
            with self._end_lock:
                if not self._ended:  # else on_abort wrote them: not twice
                    self._add_open_row(guard)
                    self._drain()
                    self._write()
                    self._lost()
                    self._ended = True
        finally:
            if self._compactor is not None:
                self._compactor.close()
                self._compactor = None
            if self._bar is not None:
                self._bar.close()
                self._bar = None
            if self._sinks is not None:
                with guard.pause_watchdog("metrics sinks"):  # rank 0 alone, not stuck
                    end = end_event(guard.step, self._rank, exc)
                    self._close_sinks(end, self.sink_close_timeout_s)

    # ------------------------------------------------------------------ the bar

    def _open_bar(self, guard: Guard) -> None:
        """The bar, at the end of the first step this process ran: its count starts
        at the step before (a resumed run's checkpoint step, so the rate and ETA are of
        this run's steps alone), its total where the pass's length is known."""
        self._want_bar = False
        total = self._total(guard)
        self._bar = tqdm(
            desc=_bar_desc(guard, total),
            unit="step",
            initial=guard.step - 1,
            total=total,
            dynamic_ncols=True,
            file=sys.stderr,
        )
        self._bar.update(1)

    def _set_total(self, guard: Guard) -> None:
        """A new pass (or a total overrun): the bar's total again."""
        total = self._total(guard)
        self._bar.total = total
        self._bar.set_description(_bar_desc(guard, total), refresh=False)

    def _total(self, guard: Guard) -> int | None:
        """The step at which this pass over the loader ends, from the loader's length
        (per rank under a DistributedSampler) and the batches the step just ended took
        (several under gradient accumulation); ``None`` where either is unknown (a
        loader without ``len()``, a loop that feeds its own data). Once per pass:
        ``len()`` of a DataLoader is not free."""
        self._bar_epoch = guard.epoch
        total = None
        per_step = len(guard.step_batches)
        if per_step and guard.loader is not None:
            try:
                per_pass: int | None = len(guard.loader)
            except (TypeError, NotImplementedError):  # an iterable without a length
                per_pass = None
            left = None if per_pass is None else per_pass - guard.batch_in_epoch
            # Whole steps only: a last partial accumulation makes no step of its own.
            if left is not None and left >= 0:
                total = guard.step + left // per_step
        return total

    @property
    def latest(self) -> dict[str, Any] | None:
        """The newest row that reached the host (a dict of column -> value), or None."""
        if self._newest is None:
            return None
        dev, host = self._newest
        latest = dict(zip(HOST_COLUMNS, host.tolist(), strict=True))
        latest.update(zip(DEVICE_COLUMNS, dev.tolist(), strict=True))
        latest["tokens_per_s"] = float(_tokens_per_s(host[None])[0])
        return latest

    # ------------------------------------------------------------------ the end

    def _open_row(self, guard: Guard, rows: list[tuple[float, ...]]) -> tuple[float, ...] | None:
        """The host columns of the step the run ended inside (``Guard.open_row()``) when
        ``rows`` (this component's unflushed rows) and the flushed ones lack it: what
        is known of it, NaN for the rest (no step time where its optimizer step never
        returned)."""
        open_row = guard.open_row()
        if open_row is None:
            return None
        last = rows[-1][0] if rows else self._flushed_step
        if open_row.step <= last:  # after_step recorded it before a later hook raised
            return None
        return (
            open_row.step,
            open_row.time,
            guard.lr,
            guard.step_time_s if open_row.finished else math.nan,
            guard.data_wait_s,
            guard.forward_s,
            guard.backward_s,
            guard.optimizer_s if open_row.finished else math.nan,
            math.nan if guard.tokens is None else guard.tokens,
            guard.shared.gc_total_s,
            open_row.row,
        )

    def _add_open_row(self, guard: Guard) -> None:
        """At close: the row of the step the run ended inside joins the rows to flush,
        with its skipped flag as after_step would have recorded it."""
        row = self._open_row(guard, self._host_rows)
        if row is None:
            return
        skipped = guard.skipped
        if skipped is not None:
            flag = self._ring.flags[int(row[-1]) % self._ring.length]
            if skipped is not flag:
                with contextlib.suppress(RuntimeError):  # a broken device: as written
                    flag.copy_(skipped)
        self._host_rows.append(row)

    def _drain(self) -> None:
        """At close: every row recorded, read back from the device. Where the device
        cannot be read any more (a CUDA error ended the run: every later call raises
        it), the rows keep their host columns and NaN device columns, instead of the
        run's last rows (up to ``write_every_s`` of them, already on the host) being
        lost with the failed read."""
        copy = self._copies.take()
        rows, self._host_rows = self._host_rows, []
        # The host columns of the rows still to read back, made first: host work only.
        blocks: list[np.ndarray] = [] if copy is None else [copy.meta]
        counts: list[int] = []
        if rows:
            host, counts = self._host_block(rows)
            self._flushed_step = host[-1, 0]
            blocks.append(host)
        try:
            if copy is not None:
                self._collect(copy)
                blocks.pop(0)
            if counts:
                self._copies.start(counts, blocks[0])  # nothing pending: returns None
                self._collect(self._copies.take())
                blocks.pop(0)
        except RuntimeError as e:  # torch's device errors (torch.AcceleratorError too)
            logger.warning(
                "guardrails: %d metric rows (steps %d-%d) are written without loss, grad "
                "norm and skipped (NaN): the device could not be read at the end: %s",
                sum(len(b) for b in blocks),
                blocks[0][0, 0],
                blocks[-1][-1, 0],
                e,
            )
            width = len(DEVICE_COLUMNS)
            self._arrived += [(np.full((len(b), width), math.nan), b) for b in blocks]

    # ------------------------------------------------------------------ plumbing

    def _flush(self) -> None:
        """Start the device-to-host copy of the filled rows; read the previous one."""
        rows, self._host_rows = self._host_rows, []
        self._flushed_step = rows[-1][0]
        host, counts = self._host_block(rows)
        self._collect(self._copies.start(counts, host))
        if not self._cuda:
            self._collect(self._copies.take())  # nothing to wait for on CPU: publish at once

    def _host_block(self, rows: list[tuple[float, ...]]) -> tuple[np.ndarray, list[int]]:
        """The host columns of ``rows`` as one array, GC time made per step, and the
        rows' counts in the step ring."""
        # One pass over the values (np.fromiter): np.array of the tuples first discovers
        # their shape and types (~250,000 instructions for 50 rows, callgrind), an
        # assignment into an empty array more. The last column holds each row's count
        # until mem_peak_bytes replaces it.
        width = len(HOST_COLUMNS)
        host = np.fromiter(chain.from_iterable(rows), np.float64, len(rows) * width)
        host = host.reshape(len(rows), width)
        counts = host[:, -1].astype(np.int64).tolist()
        # Peak memory only grows, so one reading per interval (not one per step) bounds
        # every row in it; it also keeps the per-step host path shorter.
        host[:, -1] = _mem_peak_bytes(self._device)
        gc_total = host[:, HOST_COLUMNS.index("gc_s")]
        last = float(gc_total[-1])
        # Cumulative -> per step: np.diff's subtractions without its ~10 us of Python.
        gc_total[1:] -= gc_total[:-1].copy()
        gc_total[0] -= self._gc_total
        self._gc_total = last
        return host, counts

    def on_abort(self, guard: Guard, error: BaseException) -> None:
        # The main thread is stuck (guard.die): write the rows the host holds. On CUDA
        # the newest rows' device columns (loss, grad norm, skipped) stay NaN: reading
        # them would queue behind the stuck kernel or collective. Otherwise a rank the
        # watchdog ended would lose every row since its last part (up to 60 s of steps).
        # on_end may be writing them already (the main thread got free): wait for it a
        # while; past that it is stuck itself (a device read) and these rows go now.
        locked = self._end_lock.acquire(timeout=ABORT_WAIT_S / 2)
        try:
            if not self._ended:
                self._abort_rows(guard)
                self._ended = True
        finally:
            if locked:
                self._end_lock.release()
        if self._sinks is not None:
            end = end_event(guard.step, self._rank, error, aborted=True)
            self._close_sinks(end, ABORT_WAIT_S)  # inside the process's 5 s of last words

    def _abort_rows(self, guard: Guard) -> None:
        """on_abort's rows: those the host holds, the pending copy's where it finished
        (else its host columns), and the open step's."""
        pending = self._copies.pending
        if pending is not None:
            if pending.ready():
                self._collect(self._copies.take())
            else:  # behind the stuck kernel: the host columns still go, device ones NaN
                self._copies.take()
                width = len(DEVICE_COLUMNS)
                self._arrived.append((np.full((len(pending.meta), width), math.nan), pending.meta))
        # Taken, not copied: a main thread that runs on must not flush them again (a
        # row it appends meanwhile may be lost; none is written twice).
        rows, self._host_rows = self._host_rows, []
        # The step the main thread is stuck in (an optimizer step that never returns, a
        # collective inside it), or ended in: its row, when its values were computed.
        row = self._open_row(guard, rows)
        if row is not None:
            rows.append(row)
        if rows:
            host, counts = self._host_block(rows)
            if self._ring.host:
                dev = self._ring.host_rows(counts)
            else:
                dev = np.full((len(rows), len(DEVICE_COLUMNS)), math.nan)
            self._arrived.append((dev, host))
        self._write()
        self._lost()

    def _close_sinks(self, end: dict[str, Any], timeout_s: float) -> None:
        """Hand the sinks the events not sent yet and the end (the guard writes its own
        ``end`` to events.jsonl after every component has closed), and close them."""
        sinks, tail = self._sinks, self._tail
        self._sinks = self._tail = None
        if sinks is None or tail is None:
            return
        events = tail.read()
        tail.close()
        sinks.deliver(None, [*events, end])
        sinks.close(timeout_s)

    def _collect(self, copy: Copy | None) -> None:
        """Take ``copy`` (a copy's rows and their host columns) once the device has
        finished it. Called one interval after the copy was issued, so it has long
        finished and this does not wait."""
        if copy is None:
            return
        # Issued a whole interval ago, so normally long finished and read() returns at
        # once; it only blocks if the device is that far behind the host.
        dev = copy.read().numpy().astype(np.float64)
        host = copy.meta
        self._arrived.append((dev, host))
        self._newest = (dev[-1], host[-1])
        if self._bar is not None:
            self._bar.set_postfix(_postfix(self.latest), refresh=False)
        if time.monotonic() - self._last_write >= self.write_every_s:
            self._write()

    def _write(self) -> None:
        """Write what has arrived as one parquet part, atomically (temp, then rename),
        with the rows earlier parts could not write; on an ``OSError`` keep them all
        (bounded) for the next part."""
        if not self._arrived or self._ended:  # ended: the last rows went already
            return
        dev = np.concatenate([d for d, _ in self._arrived])
        host = np.concatenate([h for _, h in self._arrived])
        self._arrived = []
        table = _to_table(dev, host, self._rank, self._started_at)
        rows = table if self._unwritten is None else pa.concat_tables([self._unwritten, table])
        first = rows.column("step")[0].as_py()
        name = f"part-r{self._rank:05d}-s{first:09d}-{uuid.uuid4().hex[:8]}.parquet"
        tmp = self._dir / f".{name}.tmp"  # matches no *.parquet glob, even half-written
        try:
            make_dirs(self._dir)
            pq.write_table(rows, tmp)
            restrict(tmp)  # pyarrow creates it 0o666 less the umask
            os.replace(tmp, self._dir / name)
        except OSError as e:  # the disk, not the run: keep the rows, retry at the next part
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            excess = rows.num_rows - MAX_PENDING_ROWS
            if excess > 0:
                rows = rows.slice(excess)
                self.rows_dropped += excess
            self._unwritten = rows
            dropped = f", the {self.rows_dropped} oldest dropped" if self.rows_dropped else ""
            self._trouble.failed(e, f"{rows.num_rows} metric rows kept in memory{dropped}")
        else:
            self._unwritten = None
            self.rows_written += rows.num_rows
            if self._compactor is not None:  # merged into its hour's file once that is over
                self._compactor.add(
                    self._dir / name,
                    float(pc.min(rows.column("time")).as_py()),
                    self._started_at,
                    first,
                )
            if self._trouble.failing:
                dropped, self.rows_dropped = self.rows_dropped, 0
                self._trouble.recovered(
                    f"{dropped} rows were dropped (over {MAX_PENDING_ROWS} kept)" if dropped else ""
                )
        self._last_write = time.monotonic()
        # The sinks get each row once, whether or not its part was written: they may
        # write elsewhere (W&B, a TensorBoard dir on another disk).
        sinks, tail = self._sinks, self._tail  # on_abort's thread may clear them
        if sinks is not None and tail is not None:
            sinks.deliver(table, tail.read())  # a queue put: the sink thread writes

    def _lost(self) -> None:
        """At the end: say what never reached the disk."""
        if self._unwritten is not None:
            logger.warning(
                "guardrails: %d metric rows (steps %d-%d) never reached %s: it could not be "
                "written to the end of the run%s",
                self._unwritten.num_rows,
                self._unwritten.column("step")[0].as_py(),
                self._unwritten.column("step")[-1].as_py(),
                self._dir,
                f"; {self.rows_dropped} older rows were dropped" if self.rows_dropped else "",
            )
            self._unwritten = None


def _to_table(dev: np.ndarray, host: np.ndarray, rank: int, started_at: float) -> pa.Table:
    cols = dict(zip(HOST_COLUMNS, host.T, strict=True))
    cols.update(zip(DEVICE_COLUMNS, dev.T, strict=True))
    tokens = cols["tokens"]
    step_time = cols["step_time_s"]
    tps = _tokens_per_s(host)
    mem = cols["mem_peak_bytes"]
    n = len(tokens)
    arrays = {
        "step": pa.array(cols["step"].astype(np.int64)),
        "rank": pa.array(np.full(n, rank, dtype=np.int32)),
        "started_at": pa.array(np.full(n, started_at)),
        "time": pa.array(cols["time"]),
        "loss": pa.array(cols["loss"].astype(np.float32)),
        "grad_norm": pa.array(cols["grad_norm"].astype(np.float32)),
        "lr": pa.array(cols["lr"]),
        "step_time_s": pa.array(step_time),
        "data_wait_s": pa.array(cols["data_wait_s"]),
        "forward_s": pa.array(cols["forward_s"]),
        "backward_s": pa.array(cols["backward_s"]),
        "optimizer_s": pa.array(cols["optimizer_s"]),
        "tokens": pa.array(np.nan_to_num(tokens).astype(np.int64), mask=np.isnan(tokens)),
        "tokens_per_s": pa.array(tps, mask=np.isnan(tps)),
        "gc_s": pa.array(cols["gc_s"]),
        "mem_peak_bytes": pa.array(np.nan_to_num(mem).astype(np.int64), mask=np.isnan(mem)),
        # Null where the device columns could not be read (NaN: an abort on a GPU, a
        # broken device at the end): unknown, not "applied".
        "skipped": pa.array(cols["skipped"] > 0.5, mask=np.isnan(cols["skipped"])),
    }
    return pa.table(arrays, schema=SCHEMA)


def _tokens_per_s(host: np.ndarray) -> np.ndarray:
    """tokens / step_time_s for host rows; NaN where tokens are unknown."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return host[:, HOST_COLUMNS.index("tokens")] / host[:, HOST_COLUMNS.index("step_time_s")]


def _bar_desc(guard: Guard, total: int | None) -> str:
    # "epoch N" with a total: the total (and the ETA) is this pass's, not the run's.
    return "train" if total is None else f"train epoch {guard.epoch}"


def _postfix(row: dict[str, Any]) -> dict[str, str]:
    out = {"loss": f"{row['loss']:.4f}", "gnorm": f"{row['grad_norm']:.3g}"}
    if not math.isnan(row["tokens_per_s"]):
        out["tok/s"] = f"{row['tokens_per_s']:.0f}"
    return out


def _mem_peak_bytes(device: torch.device) -> float:
    # Host-side allocator counters: no sync. Not reset per step: resetting the peak
    # would clobber the user's own torch.cuda.max_memory_allocated() readings.
    if device.type == "cuda":
        try:
            return float(torch.cuda.max_memory_allocated(device))
        except RuntimeError:  # a device a CUDA error broke: the rows still go, without it
            return math.nan
    if resource is not None:
        return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # KiB on Linux
    return math.nan
