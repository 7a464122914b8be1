"""The report's numbers, computed while streaming ``metrics.parquet``: memory bounded by
one batch of rows, not by the length of the run.

Every row of every rank loaded into numpy (``read_metrics``) would be ~15 GB for one
rank's month at 10 steps/s, so the report reads in two passes, a batch (``BATCH_ROWS``
rows) at a time (``metrics/file.iter_metrics``):

1. :func:`scan_keys`: the columns ``rank``, ``started_at``, ``step``, ``time`` and
   ``step_time_s``, kept only as one :class:`KeyInfo` per (rank, started_at) pair (rows,
   first and last step, and when they ended): what splits rows into runs, and what
   times a restart;
2. :func:`stream`: every column, each batch handed to the aggregators of the runs it
   belongs to: :class:`RunStats` (counts, sums, minima and maxima, the first and last
   ten losses, medians) and :class:`Curves` (the plot's lines, binned by step).

Medians are exact up to :data:`EXACT_VALUES` values, then estimated from log-spaced
buckets within 0.05% (:class:`Median`). The plot keeps at most :data:`MAX_POINTS` points
per rank and line: beyond that, each point is the mean of a bin of steps, with its
minimum and maximum drawn as a band, so a spike stays visible. Torch-free.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from guardrails.metrics.file import iter_metrics

#: Values a median keeps exactly (512 KiB of float64) before it switches to buckets.
EXACT_VALUES = 1 << 16
#: Bucket ratio of an estimated median: its relative error is at most (g - 1) / (g + 1).
_GAMMA = 1.001
#: Points per rank and line in the plot (a 900-pixel-wide panel shows fewer).
MAX_POINTS = 4000
#: Skipped steps listed (the count is always exact for the lead rank).
MAX_SKIPPED_LISTED = 100_000
#: The loss story: the mean of this many steps at the start and at the end.
FIRST_LAST = 10
#: Columns read as float64 with null -> NaN.
_NULLABLE = ("tokens", "mem_peak_bytes", "tokens_per_s")

Key = tuple[int, float]  # (rank, started_at): one rank of one run
Rows = dict[str, np.ndarray]

#: The step's phases in ``metrics.parquet``; what is left of ``step_time_s`` is "other".
ANATOMY_COLUMNS = ("data_wait_s", "forward_s", "backward_s", "optimizer_s")
ANATOMY_NAMES = ("data", "forward", "backward", "optimizer", "other")
#: The step shares count the steps after this one (see ``RunStats.add``).
ANATOMY_FROM_STEP = 2


def anatomy(sums: dict[int, np.ndarray]) -> dict[str, Any] | None:
    """Shares of step time per phase, over every rank (``all``) and per rank, from
    per-rank sums (data, forward, backward, optimizer, step time); ``None`` without
    rows that have them."""

    def shares(acc: np.ndarray) -> dict[str, float] | None:
        total = acc[-1]
        if not total > 0:
            return None
        parts = [*acc[:-1].tolist(), max(0.0, total - float(acc[:-1].sum()))]
        return {n: float(v / total) for n, v in zip(ANATOMY_NAMES, parts, strict=True)}

    if not sums:
        return None
    every = shares(sum(sums.values()))
    if every is None:
        return None
    by_rank = {int(r): sh for r, acc in sorted(sums.items()) if (sh := shares(acc)) is not None}
    return {"all": every, "by_rank": by_rank}


@dataclass
class KeyInfo:
    """One rank of one run in the metrics: its rows and step range; when its first
    row's step ended (``first_time``); its last finished step and when it ended
    (``done_step``, ``done_time``: the rank's last progress). A row without a step time
    is not a finished step: the open row a failed run ends with (``Guard.open_row``)."""

    rows: int
    step_min: int
    step_max: int
    first_time: float = math.nan
    done_step: int = 0
    done_time: float = math.nan

    def add(self, step: np.ndarray, time: np.ndarray, step_time: np.ndarray) -> None:
        """A batch of this key's rows (the first batch too: built empty, then added)."""
        self.rows += len(step)
        self.step_max = max(self.step_max, int(step.max()))
        i = int(step.argmin())
        if step[i] < self.step_min or self.first_time != self.first_time:
            self.step_min, self.first_time = int(step[i]), float(time[i])
        done = np.isfinite(step_time)
        if done.any():
            j = int(np.where(done, step, np.iinfo(np.int64).min).argmax())
            if step[j] > self.done_step:
                self.done_step, self.done_time = int(step[j]), float(time[j])


def scan_keys(run_dir: Path) -> dict[Key, KeyInfo]:
    """Pass 1: each (rank, started_at) with its row count, step range and times."""
    keys: dict[Key, KeyInfo] = {}
    names = ["rank", "started_at", "step", "time", "step_time_s"]
    for batch in iter_metrics(run_dir, columns=names):
        rank, started, step, time, step_time = (
            c.to_numpy(zero_copy_only=False) for c in batch.columns
        )
        for key, idx in _groups(rank, started):
            cols = [c if idx is None else c[idx] for c in (step, time, step_time)]
            info = keys.get(key)
            if info is None:
                info = keys[key] = KeyInfo(0, int(cols[0].min()), int(cols[0].max()))
            info.add(*cols)
    return keys


#: A consumer of rows and the last step it takes (``inf``: all).
Feed = tuple[Callable[[Rows], None], float]


def stream(run_dir: Path, feeds: dict[Key, list[Feed]]) -> int:
    """Pass 2: hand each batch's rows of each key to that key's feeds. Returns the
    largest number of rows held at once (one batch): the report's memory bound."""
    if not feeds:
        return 0
    peak = 0
    for batch in iter_metrics(run_dir):
        cols: Rows = {}
        for name, col in zip(batch.schema.names, batch.columns, strict=True):
            arr = col.to_numpy(zero_copy_only=False)
            cols[name] = arr.astype(np.float64) if name in _NULLABLE else arr
        peak = max(peak, batch.num_rows)
        for key, idx in _groups(cols["rank"], cols["started_at"]):
            targets = feeds.get(key)
            if not targets:
                continue
            rows = cols if idx is None else {n: c[idx] for n, c in cols.items()}
            for fn, bound in targets:
                keep = rows["step"] <= bound
                if keep.all():
                    fn(rows)
                elif keep.any():
                    fn({n: c[keep] for n, c in rows.items()})
    return peak


def _groups(rank: np.ndarray, started: np.ndarray) -> Iterable[tuple[Key, np.ndarray | None]]:
    """The (rank, started_at) pairs of a batch, each with its row indices (``None``: all
    rows, the usual case: a part or a compacted file holds one rank, mostly one run)."""
    if len(rank) == 0:
        return
    if (rank == rank[0]).all() and (started == started[0]).all():
        yield (int(rank[0]), float(started[0])), None
        return
    pairs = np.empty(len(rank), dtype=[("r", np.int64), ("t", np.float64)])
    pairs["r"], pairs["t"] = rank, started
    uniq, inverse = np.unique(pairs, return_inverse=True)
    for j, (r, t) in enumerate(uniq.tolist()):
        yield (int(r), float(t)), np.flatnonzero(inverse == j)


class Median:
    """The median of values added in batches: exact while at most :data:`EXACT_VALUES`
    are held, then from buckets of ratio 1.001 (relative error at most 0.05%), in memory
    bounded by the range of magnitudes, never by the count. NaN and infinities are
    ignored."""

    def __init__(self) -> None:
        self._exact: list[np.ndarray] | None = []
        self._held = 0
        self._buckets: dict[int, int] = {}  # signed bucket index -> count
        self._zeros = 0
        self.count = 0

    def add(self, values: np.ndarray) -> None:
        v = np.asarray(values, dtype=np.float64)
        v = v[np.isfinite(v)]
        if not len(v):
            return
        self.count += len(v)
        if self._exact is not None:
            self._exact.append(v)
            self._held += len(v)
            if self._held <= EXACT_VALUES:
                return
            v = np.concatenate(self._exact)
            self._exact = None
        self._bucket(v)

    def _bucket(self, v: np.ndarray) -> None:
        zero = v == 0
        self._zeros += int(zero.sum())
        v = v[~zero]
        # Bucket i holds magnitudes in (g^(i-1), g^i]; the sign goes on the index (+1
        # so that no magnitude's index is 0 and the sign is never lost).
        idx = np.ceil(np.log(np.abs(v)) / math.log(_GAMMA)).astype(np.int64)
        signed = np.where(v > 0, idx + (1 << 40), -(idx + (1 << 40)))
        for i, n in zip(*np.unique(signed, return_counts=True), strict=True):
            self._buckets[int(i)] = self._buckets.get(int(i), 0) + int(n)

    @property
    def exact(self) -> bool:
        return self._exact is not None

    def value(self) -> float | None:
        if self.count == 0:
            return None
        if self._exact is not None:
            return float(np.median(np.concatenate(self._exact)))
        lo, hi = (self.count - 1) // 2, self.count // 2
        return (self._at(lo) + self._at(hi)) / 2

    def _at(self, rank: int) -> float:
        """The estimated value of the ``rank``-th smallest (0-based)."""
        seen = 0
        neg = sorted(i for i in self._buckets if i < 0)  # most negative first
        pos = sorted(i for i in self._buckets if i > 0)
        for i in neg:
            seen += self._buckets[i]
            if rank < seen:
                return -self._representative(-i - (1 << 40))
        seen += self._zeros
        if rank < seen:
            return 0.0
        for i in pos:
            seen += self._buckets[i]
            if rank < seen:
                return self._representative(i - (1 << 40))
        return self._representative(pos[-1] - (1 << 40)) if pos else 0.0

    @staticmethod
    def _representative(i: int) -> float:
        # The value within 0.05% of every magnitude in (g^(i-1), g^i].
        return 2 * _GAMMA**i / (_GAMMA + 1)


class _Ends:
    """The ``n`` finite values with the smallest and largest (started_at, step) keys."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.first = np.empty((0, 3))  # rows of (started_at, step, value)
        self.last = np.empty((0, 3))

    def add(self, started: np.ndarray, step: np.ndarray, value: np.ndarray) -> None:
        ok = np.isfinite(value)
        new = np.column_stack([started[ok], step[ok], value[ok]])
        if not len(new):
            return
        for attr, pick in (("first", slice(None, self.n)), ("last", slice(-self.n, None))):
            both = np.concatenate([getattr(self, attr), new])
            order = np.lexsort((both[:, 1], both[:, 0]))
            setattr(self, attr, both[order][pick])

    def means(self) -> tuple[float | None, float | None]:
        if not len(self.first):
            return None, None
        return float(self.first[:, 2].mean()), float(self.last[:, 2].mean())


class RunStats:
    """What :func:`guardrails.cli.report_summary.summarize` says of a run's rows, added a batch at
    a time. ``lead``: the rank that tells the loss story (the lowest with rows);
    ``first``: the lead rank's first row (started_at, step), left out of the step-time
    median as the original report did (it includes start-up)."""

    def __init__(self, lead: int | None, first: tuple[float, int] | None, lead_rows: int) -> None:
        self.lead = lead
        # A lead rank with one row keeps it (the median of nothing is no answer).
        self._first = first if lead_rows > 1 else None
        self.rows = 0
        self.step_max: dict[int, int] = {}
        self.time_max = -math.inf
        self._ends = _Ends(FIRST_LAST)
        self._gn = Median()
        self._gn_lo, self._gn_hi = math.inf, -math.inf
        self._lr_lo, self._lr_hi = math.inf, -math.inf
        self._tps: dict[int, Median] = {}
        self._step_time = Median()
        self._wait = np.zeros(2)  # seconds waiting, seconds of step: rows past step 1
        self._wait_all = np.zeros(2)  # the same over every row
        self._wait_n = np.zeros(2, dtype=np.int64)  # rows counted in each
        self._any_later = False  # any row past step 1: then only those count
        self._gc: dict[int, float] = {}
        # Per rank, past step 2: seconds of data wait, forward, backward, optimizer, and
        # of step time, over the rows that have them all (older files lack them).
        self._anatomy: dict[int, np.ndarray] = {}
        self._mem = -math.inf
        self._skipped = np.empty(0, dtype=np.int64)
        self.skipped_truncated = False
        self.lead_skipped_rows = 0

    def add(self, rows: Rows) -> None:
        step, rank = rows["step"], rows["rank"]
        n = len(step)
        if not n:
            return
        self.rows += n
        for r in np.unique(rank).tolist():
            m = rank == r
            self.step_max[r] = max(self.step_max.get(r, -(1 << 62)), int(step[m].max()))
            self._gc[r] = self._gc.get(r, 0.0) + float(np.nansum(rows["gc_s"][m]))
            tps = rows["tokens_per_s"][m & (step > 1)]  # step 1 includes start-up
            if np.isfinite(tps).any():
                self._tps.setdefault(r, Median()).add(tps)
        t = rows["time"]
        if np.isfinite(t).any():
            self.time_max = max(self.time_max, float(np.nanmax(t)))
        mem = rows["mem_peak_bytes"]
        if np.isfinite(mem).any():
            self._mem = max(self._mem, float(np.nanmax(mem)))
        later = step > 1
        self._any_later = self._any_later or bool(later.any())
        wait, total = rows["data_wait_s"], rows["step_time_s"]
        ok = np.isfinite(wait) & np.isfinite(total)
        self._wait_all += (wait[ok].sum(), total[ok].sum())
        self._wait += (wait[ok & later].sum(), total[ok & later].sum())
        self._wait_n += (int(ok.sum()), int((ok & later).sum()))
        phases = [rows[c] for c in ANATOMY_COLUMNS]
        # Steps 1 and 2 hold start-up (lazy init, compilation, and the GC's one freeze
        # after step 1, which lands in step 2's time: 2 s of a 28 s run of 3 ranks).
        whole = (step > ANATOMY_FROM_STEP) & np.isfinite(total) & np.isfinite(wait)
        for col in phases[1:]:
            whole &= np.isfinite(col)
        if whole.any():
            for r in np.unique(rank[whole]).tolist():
                m = whole & (rank == r)
                sums = [float(c[m].sum()) for c in phases] + [float(total[m].sum())]
                acc = self._anatomy.setdefault(r, np.zeros(len(sums)))
                acc += sums
        sk = rows["skipped"].astype(bool)
        if sk.any():
            self._skip(step[sk])
        if self.lead is None:
            return
        m = rank == self.lead
        if not m.any():
            return
        started, lstep = rows["started_at"][m], step[m]
        self.lead_skipped_rows += int(sk[m].sum())
        self._ends.add(started, lstep, rows["loss"][m].astype(np.float64))
        gn = rows["grad_norm"][m].astype(np.float64)
        fin = gn[np.isfinite(gn)]
        if len(fin):
            self._gn.add(fin)
            self._gn_lo, self._gn_hi = min(self._gn_lo, fin.min()), max(self._gn_hi, fin.max())
        lr = rows["lr"][m]
        lr = lr[np.isfinite(lr)]
        if len(lr):
            self._lr_lo, self._lr_hi = min(self._lr_lo, lr.min()), max(self._lr_hi, lr.max())
        st = rows["step_time_s"][m]
        if self._first is not None:
            at = np.flatnonzero((started == self._first[0]) & (lstep == self._first[1]))
            if len(at):  # the lead's first row: once
                st = np.delete(st, at[0])
                self._first = None
        self._step_time.add(st)

    def _skip(self, steps: np.ndarray) -> None:
        merged = np.union1d(self._skipped, steps.astype(np.int64))
        if len(merged) > MAX_SKIPPED_LISTED:
            merged = merged[:MAX_SKIPPED_LISTED]
            self.skipped_truncated = True
        self._skipped = merged

    def facts(self) -> dict[str, Any]:
        """The summary's metrics fields."""
        s: dict[str, Any] = {"lead_rank": self.lead}
        s["loss_first"], s["loss_last"] = self._ends.means()
        s["grad_norm"] = (
            None
            if self._gn.count == 0
            else {"min": float(self._gn_lo), "median": self._gn.value(), "max": float(self._gn_hi)}
        )
        s["lr"] = (
            None
            if self._lr_lo == math.inf
            else {"min": float(self._lr_lo), "max": float(self._lr_hi)}
        )
        tps = {r: m.value() for r, m in sorted(self._tps.items()) if m.count}
        s["tokens_per_s_median"] = tps or None
        s["step_time_median_s"] = self._step_time.value()
        # Start-up is in step 1's wait: only later steps count, when there are any.
        w, n_ok = (
            (self._wait, self._wait_n[1]) if self._any_later else (self._wait_all, self._wait_n[0])
        )
        s["data_wait_share"] = float(w[0] / w[1]) if n_ok and w[1] > 0 else None
        s["gc_total_s"] = {int(r): v for r, v in sorted(self._gc.items())}
        s["step_anatomy"] = anatomy(self._anatomy)
        s["mem_peak_bytes"] = None if self._mem == -math.inf else self._mem
        s["skipped_steps"] = self._skipped.tolist()
        estimated = [
            name
            for name, m in (("grad_norm", self._gn), ("step_time", self._step_time))
            if not m.exact
        ] + [f"tokens_per_s rank {r}" for r, m in sorted(self._tps.items()) if not m.exact]
        if estimated:  # medians of more than EXACT_VALUES values: within 0.05%
            s["medians_estimated"] = estimated
        if self.skipped_truncated:
            s["skipped_steps_listed"] = MAX_SKIPPED_LISTED
        return s


class Curves:
    """The plot's loss, grad-norm and LR lines per rank, binned by step over
    ``[lo, hi]``: one bin per step up to :data:`MAX_POINTS` steps (the lines are then
    exactly the rows), else each bin's mean, minimum and maximum."""

    COLUMNS = ("loss", "grad_norm", "lr")

    def __init__(
        self, lo: int, hi: int, max_points: int = MAX_POINTS, lead: int | None = None
    ) -> None:
        self.lo, self.span = lo, max(hi - lo + 1, 1)
        self.bins = min(self.span, max_points)
        self.binned = self.bins < self.span
        self._ranks: dict[int, dict[str, np.ndarray]] = {}
        #: The lead rank's step time and its phases: per bin, the sum of each over
        #: the rows that have them all, and their count (one rank: memory flat in N).
        self.lead = lead
        self._phases = np.zeros((len(ANATOMY_COLUMNS) + 1, self.bins))
        self._phase_rows = np.zeros(self.bins, np.int64)

    def _arrays(self, rank: int) -> dict[str, np.ndarray]:
        a = self._ranks.get(rank)
        if a is None:
            n = self.bins
            a = {"rows": np.zeros(n, np.int64), "step_sum": np.zeros(n)}
            for c in self.COLUMNS:
                a[f"{c}_n"] = np.zeros(n, np.int64)
                a[f"{c}_sum"] = np.zeros(n)
                a[f"{c}_min"] = np.full(n, np.inf)
                a[f"{c}_max"] = np.full(n, -np.inf)
            self._ranks[rank] = a
        return a

    def add(self, rows: Rows) -> None:
        rank = rows["rank"]
        for r in np.unique(rank).tolist():
            m = rank == r
            step = rows["step"][m].astype(np.int64)
            b = np.clip((step - self.lo) * self.bins // self.span, 0, self.bins - 1)
            if r == self.lead:
                self._add_phases(rows, m, b)
            a = self._arrays(r)
            a["rows"] += np.bincount(b, minlength=self.bins)
            a["step_sum"] += np.bincount(b, weights=step, minlength=self.bins)
            for c in self.COLUMNS:
                y = rows[c][m].astype(np.float64)
                ok = np.isfinite(y) & ((y > 0) if c == "grad_norm" else True)  # log axis
                bb, yy = b[ok], y[ok]
                a[f"{c}_n"] += np.bincount(bb, minlength=self.bins)
                a[f"{c}_sum"] += np.bincount(bb, weights=yy, minlength=self.bins)
                np.minimum.at(a[f"{c}_min"], bb, yy)
                np.maximum.at(a[f"{c}_max"], bb, yy)

    def _add_phases(self, rows: Rows, m: np.ndarray, b: np.ndarray) -> None:
        cols = [rows[c][m] for c in (*ANATOMY_COLUMNS, "step_time_s")]
        ok = np.logical_and.reduce([np.isfinite(c) for c in cols])
        ok &= rows["step"][m] > ANATOMY_FROM_STEP
        self._phase_rows += np.bincount(b[ok], minlength=self.bins)
        for i, c in enumerate(cols):
            self._phases[i] += np.bincount(b[ok], weights=c[ok], minlength=self.bins)

    def phases(self) -> tuple[np.ndarray, dict[str, np.ndarray]] | None:
        """The lead rank's mean seconds per step in each phase, by bin: x (the bins'
        middle step) and each phase's line (``other`` the rest of the step); ``None``
        when no row has them (an older run's file, step 1 only)."""
        has = self._phase_rows > 0
        if not has.any():
            return None
        n = self._phase_rows[has]
        means = self._phases[:, has] / n
        x = self.lo + (np.flatnonzero(has) + 0.5) * self.span / self.bins
        lines = dict(zip(ANATOMY_NAMES[:-1], means[:-1], strict=True))
        lines["other"] = np.maximum(means[-1] - means[:-1].sum(axis=0), 0.0)
        return x, lines

    @property
    def ranks(self) -> list[int]:
        return sorted(self._ranks)

    def line(self, rank: int, column: str) -> tuple[np.ndarray, ...]:
        """x (the bin's mean step), y (mean; NaN where the bin has rows but no finite
        value: a gap, as a skipped step is), and the bin's minimum and maximum."""
        a = self._ranks[rank]
        has = a["rows"] > 0
        x = a["step_sum"][has] / a["rows"][has]
        n = a[f"{column}_n"][has]
        with np.errstate(invalid="ignore", divide="ignore"):
            y = np.where(n > 0, a[f"{column}_sum"][has] / np.maximum(n, 1), np.nan)
        lo = np.where(n > 0, a[f"{column}_min"][has], np.nan)
        hi = np.where(n > 0, a[f"{column}_max"][has], np.nan)
        return x, y, lo, hi


class Counter:
    """Counts the rows it is fed (an earlier run's rows that start a resumed plot)."""

    def __init__(self) -> None:
        self.rows = 0

    def add(self, rows: Rows) -> None:
        self.rows += len(rows["step"])
