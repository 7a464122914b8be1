"""The runs in a run_dir, for ``report``: events and metrics rows grouped into runs
(restarts, resumes), which earlier runs' rows start a resumed run's curve, and the one
streaming pass over ``metrics.parquet`` that fills each chosen run's numbers.

A run_dir can hold several runs: they are told apart by their ``start`` events (one per
rank, sharing the run's id) and the ``started_at`` column. Torch-free.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from guardrails.cli.report_stats import (
    Counter,
    Curves,
    Feed,
    Key,
    KeyInfo,
    RunStats,
    scan_keys,
    stream,
)
from guardrails.metrics import events as events_file
from guardrails.metrics.file import METRICS_DIR

logger = logging.getLogger("guardrails.report")


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    """Every event of ``run_dir``: each node's ``events.<host>.jsonl`` (and the one
    ``events.jsonl`` of a run_dir from before them), merged ordered by time; a torn line
    (a crash mid-write on a filesystem without atomic appends) is skipped, with a log
    line. The live view reads through this too."""
    return events_file.read_events(run_dir)


def _metrics_keys(run_dir: Path) -> tuple[dict[Key, KeyInfo], str | None]:
    """Each (rank, started_at) of the metrics with its rows and steps (empty when nothing
    was written), and why if unreadable. Reads three columns a batch at a time."""
    try:
        return scan_keys(run_dir), None
    except FileNotFoundError:
        return {}, f"no {METRICS_DIR} in {run_dir}"
    except Exception as exc:  # a torn part from an old writer, a schema change
        return {}, f"{METRICS_DIR} unreadable: {type(exc).__name__}: {exc}"


class Run:
    """One run: its start time per rank, its events, which metrics rows are its own
    (by (rank, started_at)) and, once streamed, what they say (``stats``)."""

    def __init__(self, starts: dict[int, float], run_id: str | None = None) -> None:
        self.starts = starts  # rank -> start time (start event, else started_at)
        self.run_id = run_id  # the start events' shared id (None in logs from before it)
        self.world_size: int | None = None  # from the start events
        self.events: list[dict[str, Any]] = []
        self.keys: dict[Key, KeyInfo] = {}  # its metrics rows, per rank and guard start
        self.stats: RunStats | None = None  # filled by the streaming pass
        self.earlier: Counter | None = None  # earlier runs' rows that start its plot
        self.curves: Curves | None = None  # its plot's lines

    @property
    def started(self) -> float:
        return min(self.starts.values())

    @property
    def n_rows(self) -> int:
        return sum(k.rows for k in self.keys.values())

    @property
    def step_min(self) -> int | None:
        return min((k.step_min for k in self.keys.values()), default=None)

    def lead(self) -> tuple[int | None, tuple[float, int] | None, int]:
        """The rank that tells the loss story (the lowest with rows), its first row
        (started_at, step) and its row count."""
        if not self.keys:
            return None, None, 0
        lead = min(r for r, _ in self.keys)
        mine = sorted((t, k.step_min, k.rows) for (r, t), k in self.keys.items() if r == lead)
        return lead, (mine[0][0], mine[0][1]), sum(n for _, _, n in mine)

    def takes(self, rank: int, world_size: int | None) -> bool:
        """Whether a ``start`` of ``rank`` without a run id joins this run (logs
        written before start events carried one): every rank starts once per run, a run
        has ``world_size`` ranks and the next run may have another world size."""
        if self.run_id is not None or rank in self.starts:
            return False
        if world_size is None or self.world_size is None:
            return True
        full = len(self.starts) >= self.world_size
        return world_size == self.world_size and rank < world_size and not full


def split_runs(events: list[dict[str, Any]], keys: dict[Key, KeyInfo]) -> list[Run]:
    """Group events and metrics rows into runs, oldest first.

    The ``start`` events say which run a rank's start belongs to: the id on each
    (``run``, shared by the ranks of one run). Logs from before the id fall back to a
    rule: a run takes one start per rank, up to its ``world_size`` ranks. Each rank's
    later events and rows then belong to that rank's latest run started before them.
    """
    starts = sorted(
        (float(e["time"]), int(e.get("rank", 0)), e) for e in events if e.get("kind") == "start"
    )
    have = {r for _, r, _ in starts}
    if keys:  # ranks with metrics but no start event (events turned off)
        starts += sorted((t, r, {}) for r, t in keys if r not in have)
        starts.sort(key=lambda x: (x[0], x[1]))
    runs: list[Run] = []
    by_id: dict[str, Run] = {}
    for t, r, e in starts:
        run_id = e.get("run")
        world = e.get("world_size")
        if run_id is not None:
            run = by_id.get(run_id)
            if run is None:
                run = by_id[run_id] = Run({}, run_id)
                runs.append(run)
        else:
            # The newest run without an id that can still take this rank, else a new one.
            old = [x for x in runs if x.run_id is None]
            run = old[-1] if old and old[-1].takes(r, world) else None
            if run is None:
                run = Run({})
                runs.append(run)
        run.starts[r] = t
        if world is not None:
            run.world_size = int(world)
    if not runs and events:  # events but no start (a truncated log): one run
        runs.append(Run({int(events[0].get("rank", 0)): float(events[0]["time"])}))
    runs.sort(key=lambda x: x.started)

    def owner(rank: int, t: float) -> Run | None:
        best = None
        for run in runs:
            s = run.starts.get(rank)
            if s is not None and s <= t + 1e-6 and (best is None or s >= best.starts[rank]):
                best = run
        if best is None:  # before any start of this rank (a torn log): its first run
            best = next((x for x in runs if rank in x.starts), runs[0] if runs else None)
        return best

    for e in events:
        run = owner(int(e.get("rank", 0)), float(e.get("time", 0.0)))
        if run is not None:
            run.events.append(e)
    for key, info in keys.items():
        run = owner(int(key[0]), float(key[1]))
        if run is not None:
            run.keys[key] = info
    return runs


def gather(
    run_dir: Path,
    chosen: list[Run],
    runs: list[Run],
    plots: bool,
    *,
    extra: Iterable[dict[Key, list[Feed]]] = (),
) -> int:
    """Stream the metrics once into what ``chosen`` runs need: each one's
    :class:`RunStats`, the count of earlier runs' rows its plot starts with and, with
    ``plots``, its :class:`Curves`; and the ``extra`` feeds (a job's useful step time,
    ``report_restarts``). Returns the most rows held at once (one batch).

    Each key takes rows up to the last step the first pass saw: a live run's parts
    written since add nothing, so the facts and the plot are of one moment."""
    feeds: dict[Key, list[tuple[Any, float]]] = {}

    def feed(run: Run, fn: Any, bound: float) -> None:
        for key, info in run.keys.items():
            feeds.setdefault(key, []).append((fn, min(bound, info.step_max)))

    for run in chosen:
        run.stats = RunStats(*run.lead())
        feed(run, run.stats.add, math.inf)
        chain = _chain(run, runs)
        run.earlier = Counter()
        for other, bound in chain[:-1]:
            feed(other, run.earlier.add, bound)
        if plots and run.keys:
            lo = min(o.step_min or 0 for o, _ in chain if o.keys)
            hi = max(
                min(max(k.step_max for k in o.keys.values()), bound) for o, bound in chain if o.keys
            )
            run.curves = Curves(int(lo), int(max(hi, lo)), lead=run.lead()[0])
            for other, bound in chain:
                feed(other, run.curves.add, bound)
    for more in extra:
        for key, fns in more.items():
            feeds.setdefault(key, []).extend(fns)
    return stream(run_dir, feeds) if any(r.keys for r in runs) else 0


# ---------------------------------------------------------------------------- a resume's chain


def _source(run: Run, runs: list[Run], ev: dict[str, Any]) -> Run | None:
    """The earlier run that saved the checkpoint ``run`` resumed from (its ``resumed``
    event ``ev``): the one that logged saving that path, else the newest earlier run
    with rows up to the resume step."""
    before = runs[: runs.index(run)] if run in runs else []
    path, step = ev.get("path"), int(ev["step"])
    for other in reversed(before):
        for e in other.events:
            if e.get("kind") in ("checkpoint", "stopped") and _same_path(e.get("path"), path):
                return other
    for other in reversed(before):
        lo = other.step_min
        if lo is not None and lo <= step:
            return other
    return None


def _chain(run: Run, runs: list[Run]) -> list[tuple[Run, float]]:
    """The runs whose rows make ``run``'s curve, oldest first, each with the last step
    it contributes: the run it resumed from up to the resume step (and so on back, each
    bounded by every later resume), then ``run`` itself (all of it). The curve of the
    training, not of the process."""
    chain: list[tuple[Run, float]] = [(run, math.inf)]
    bound = math.inf
    cur = run
    for _ in range(64):
        ev = next((e for e in cur.events if e.get("kind") == "resumed"), None)
        src = None if ev is None or not cur.keys else _source(cur, runs, ev)
        if src is None or src is cur or any(src is r for r, _ in chain):
            break
        bound = min(bound, int(ev["step"]))  # type: ignore[index]
        chain.insert(0, (src, bound))
        cur = src
    return chain


def _same_path(a: str | None, b: str | None) -> bool:
    if not a or not b:
        return False
    try:
        return Path(a).resolve() == Path(b).resolve()
    except OSError:
        return a == b
