"""The live view's publisher: what ``guardrails top`` and ``guardrails stacks`` read of a
running job, written from the watchdog's thread (issue 51); in a single process too,
where that thread runs only this (rank 0 of 1: a node of one, its own gatherer).

The training step pays nothing: the watchdog's thread, once a tick, reads the plain
attributes the engine already publishes (``step``, the phases of the last step,
``tokens``, ``phase``, the auditor's collective) and the main thread's CPU share the
watchdog's clock already samples. No store call, no collective, no host sync: on a GPU
only the caching allocator's counters and NVML (``torch.cuda.utilization``), never the
stream.

What it costs the filesystem stays flat per rank whatever the number of ranks N:

* each rank writes its record (~1 KB) to the node's shared memory (``/dev/shm``: no
  disk, no network) every tick (1 s);
* the node's lowest local rank gathers its node's records from there and writes one
  file per node to ``run_dir/live/`` every ``write_every_s``: 2 s, stretched so that
  all nodes together write at most :data:`SHARED_WRITES_PER_S` files a second (2 s up
  to 200 nodes; 12.5 s at 1,250 nodes of 8, 10,000 ranks). One file per rank each
  second would be 10,000 writes a second on NFS at that size;
* a stack request (``run_dir/live/stacks.request``) is seen by the node's lowest rank
  with one ``stat`` a period (at most :data:`SHARED_STATS_PER_S` over the job), passed
  to its node's ranks through shared memory (one ``stat`` of a tmpfs file a tick
  each), and answered from each rank's watchdog thread, so a main thread stuck in a C
  call still answers: ``sys._current_frames()`` shows the Python frame that called
  into C. The node's lowest rank writes its node's answers into one file.

At the end of the guard each rank writes its final record (``closed``, ``failed`` with
the error); the last rank of a node to close writes the node's file and removes the
node's shared-memory folder: ``report`` shows that last snapshot. A rank killed
without a word leaves its last periodic record.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

from guardrails.distributed.dist import local_world_size
from guardrails.engine.where import STACK_FRAMES, data_position
from guardrails.guards.watchdog.records import (
    _first_line,
    _jsonable,
    _where,
    ddp_wrapped_models,
    gone_here,
)
from guardrails.metrics import live as files

if TYPE_CHECKING:
    from guardrails.engine.guard import Guard

log = logging.getLogger("guardrails.watchdog")

#: The node files' period when the job is small: what ``top`` refreshes at.
WRITE_EVERY_S = 2.0
#: Files written to run_dir/live/ per second over the whole job, at most: a shared
#: filesystem's metadata server takes thousands a second; 100 leave it to the job.
SHARED_WRITES_PER_S = 100.0
#: ``stat`` calls of the request file per second over the whole job, at most.
SHARED_STATS_PER_S = 1000.0
#: Step times kept for a rank's trend and phase shares: 20 sampled steps.
WINDOW = 20
#: A node's lowest rank gathers its ranks' answers to a request this long at most.
ANSWER_FOR_S = 30.0


class LivePublisher:
    """One per rank, owned by the watchdog and run on its thread: :meth:`tick` each
    tick, :meth:`close` at the guard's end. Never raises: the live view must not take
    the watchdog down with it."""

    def __init__(self, guard: Guard, *, host: str, tick_s: float) -> None:
        rank, world = guard.rank, guard.world_size
        self.rank, self.world, self.host = rank, world, host
        # torchrun's numbering; a single process is its own node whatever its shell
        # left in the environment (a LOCAL_RANK of a launcher it did not run under).
        env = os.environ if world > 1 else {}
        local_world = local_world_size(world)
        local_rank = int(env.get("LOCAL_RANK", rank % local_world) or 0)
        first = rank - local_rank  # torchrun numbers a node's ranks in a row
        self.node = int(env.get("GROUP_RANK", first // max(1, local_world)) or 0)
        self.node_ranks = range(first, min(world, first + local_world))
        self.leader = local_rank == 0
        nodes = math.ceil(world / max(1, local_world))
        #: Each rank's shared-memory write, and its node file's, every this many s.
        self.write_every_s = max(WRITE_EVERY_S, nodes / SHARED_WRITES_PER_S)
        self._request_every_s = max(tick_s, nodes / SHARED_STATS_PER_S)
        self._dir = files.live_dir(guard.run_dir)
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        self._shm = Path(shm) / f"guardrails-live-{guard.run_id}-node{self.node}"
        #: What this rank cost the filesystem: writes to the shared run_dir, stats of
        #: it, writes to the node's shared memory; published in its record.
        #: And the watchdog thread's time in :meth:`tick`, in ms.
        self.counts: dict[str, float] = {
            "shared_writes": 0,
            "shared_stats": 0,
            "local_writes": 0,
            "busy_ms": 0.0,
        }
        self._started = time.time()
        self._start_step = guard.step
        self._written_at = -math.inf
        self._stat_at = -math.inf
        self._request_stat: tuple[int, int, int] | None = None
        self._request: dict[str, Any] | None = None  # the one being answered
        self._answered: set[str] = set()
        self._gathered = 0
        # Trend and phase shares: the last WINDOW steps the ticks saw.
        self._steps: deque[tuple[float, ...]] = deque(maxlen=WINDOW)
        self._last_step = guard.step
        self._last_step_time = self._started
        self._busy_s = 0.0  # step time summed over the steps seen: goodput's numerator
        self._pass_len: tuple[int, int | None] | None = None  # (epoch, len(loader))
        self._trouble = False
        with contextlib.suppress(OSError):
            self._shm.mkdir(mode=0o700, parents=True, exist_ok=True)
        if self.leader:
            _remove_abandoned(self._shm.parent)

    # ------------------------------------------------------------------ each tick

    def tick(self, guard: Guard, cpu: float | None) -> None:
        began = time.perf_counter()
        try:
            self._sample(guard)
            # Its own record every tick (shared memory: no disk, no network), so the
            # node's file holds records at most a tick apart; the node's file itself
            # every write_every_s.
            self._write_own(self._record(guard, cpu))
            now = time.monotonic()
            if self.leader and now - self._written_at >= self.write_every_s:
                self._written_at = now
                self._write_node()
            self._serve_stacks(guard, cpu, now)
        except Exception as exc:  # a full disk, a removed run_dir: said once, then quiet
            if not self._trouble:
                self._trouble = True
                log.warning("guardrails: the live view could not publish: %s", exc)
        self.counts["busy_ms"] += round(1e3 * (time.perf_counter() - began), 3)

    def _sample(self, guard: Guard) -> None:
        """A new step since the last tick: its phases into the window."""
        step = guard.step
        if step == self._last_step:
            return
        total = guard.step_time_s
        if not math.isnan(total):
            phases = (guard.data_wait_s, guard.forward_s, guard.backward_s, guard.optimizer_s)
            self._steps.append((total, *phases, guard.tokens or 0))
            # Steps since the last tick, each about as long as the last one.
            if self._last_step != self._start_step:  # the first step (start-up) is not useful
                self._busy_s += total * max(1, step - self._last_step)
        self._last_step, self._last_step_time = step, time.time()

    def _record(self, guard: Guard, cpu: float | None, **end: Any) -> dict[str, Any]:
        steps = list(self._steps)
        step_time = steps[-1][0] if steps else None
        coll = guard.shared.collective
        here = {
            "collective": _jsonable(coll) if coll else None,
            "phase": guard.phase,
            "ddp": ddp_wrapped_models(guard),
        }
        now = time.time()
        return {
            "rank": self.rank,
            "world": self.world,
            "host": self.host,
            "pid": os.getpid(),
            "run_id": guard.run_id,
            "started": self._started,
            "time": now,
            "step": guard.step,
            "epoch": data_position(guard)[0],
            "step_time_s": step_time,
            "trend": _trend([s[0] for s in steps]),
            "phases": _shares(steps),
            "tokens_per_s": _tokens_per_s(steps),
            "cpu": cpu,
            "gpu": _gpu(guard),
            "phase": guard.phase,
            "paused": guard.paused,
            "where": _where(here),
            "last_step_at": self._last_step_time,
            # Unknown (not 0%) until two ticks have seen steps: the first one only starts.
            "goodput": round(min(1.0, self._busy_s / max(1e-9, now - self._started)), 3)
            if self._busy_s > 0
            else None,
            "eta_s": self._eta_s(guard, steps),
            "state": "running",
            "counts": dict(self.counts),
            **end,
        }

    def _eta_s(self, guard: Guard, steps: list[tuple[float, ...]]) -> float | None:
        """Seconds to the end of this pass over the loader, where it has a length."""
        if not steps or guard.loader is None:
            return None
        if self._pass_len is None or self._pass_len[0] != guard.epoch:
            try:  # once a pass: len() of a DataLoader is not free
                self._pass_len = (guard.epoch, len(guard.loader))
            except (TypeError, NotImplementedError):  # no length
                self._pass_len = (guard.epoch, None)
        length, per_step = self._pass_len[1], len(guard.step_batches) or 1
        if length is None:
            return None
        left = max(0, length - guard.batch_in_epoch) // per_step
        return round(left * sum(s[0] for s in steps) / len(steps), 1)

    # ------------------------------------------------------------------ files

    def _write_own(self, record: dict[str, Any]) -> None:
        files.write_json(self._shm / f"rank{self.rank}.json", record)
        self.counts["local_writes"] += 1

    def _node_records(self) -> dict[int, dict[str, Any]]:
        out = {}
        for r in self.node_ranks:
            rec = files.read_json(self._shm / f"rank{r}.json")
            if rec is not None:
                out[r] = rec
        return out

    def gone_peers(self) -> dict[int, dict[str, Any]]:
        """This node's other ranks whose record says they run but whose process is gone
        (SIGKILL, the OOM killer), with those last records: read from the node's shared
        memory, no store call, O(ranks per node)."""
        return {
            r: rec
            for r, rec in self._node_records().items()
            if r != self.rank and rec.get("state") == "running" and gone_here(rec, self.host)
        }

    def exited(self, r: int) -> dict[str, Any] | None:
        """Rank ``r``'s last record when it ran on this node and its process is gone,
        whatever its state (``running``: killed; ``failed`` or ``closed``: it ended);
        ``None`` otherwise. One file read, no store call."""
        if r == self.rank or r not in self.node_ranks:
            return None
        rec = files.read_json(self._shm / f"rank{r}.json")
        return rec if rec is not None and gone_here(rec, self.host) else None

    def _write_node(self, records: dict[int, dict[str, Any]] | None = None) -> None:
        records = self._node_records() if records is None else records
        node = {"node": self.node, "time": time.time(), "ranks": records}
        files.write_json(self._dir / f"node{self.node}.json", node)
        self.counts["shared_writes"] += 1

    def close(self, guard: Guard, cpu: float | None, exc: BaseException | None) -> None:
        """This rank's final record; the node's file (and the shared-memory folder's
        removal) by the last rank of the node to close, and by its lowest rank."""
        try:
            self._sample(guard)
            end: dict[str, Any] = {"state": "closed"}
            if exc is not None and not isinstance(exc, (StopIteration, SystemExit)):
                end = {"state": "failed", "error": f"{type(exc).__name__}: {_first_line(exc)}"}
            self._write_own(self._record(guard, cpu, **end))
            records = self._node_records()
            last = len(records) == len(self.node_ranks) and all(
                rec.get("state") != "running" for rec in records.values()
            )
            if last or self.leader:
                self._write_node(records)
            if last:
                shutil.rmtree(self._shm, ignore_errors=True)
        except Exception as err:
            log.debug("guardrails: the live view's last record was not written: %s", err)

    # ------------------------------------------------------------------ stacks

    def _serve_stacks(self, guard: Guard, cpu: float | None, now: float) -> None:
        """See a request (the node's lowest rank: the run_dir's file, once a period;
        the others: its copy in shared memory), answer it, and gather the node's."""
        if self.leader and now - self._stat_at >= self._request_every_s:
            self._stat_at = now
            request = self._new_request(self._dir / files.REQUEST_FILE, shared=True)
            if request is not None:
                files.write_json(self._shm / files.REQUEST_FILE, request)
                self.counts["local_writes"] += 1
        elif not self.leader:
            self._new_request(self._shm / files.REQUEST_FILE, shared=False)
        request = self._request
        if request is None:
            return
        if request["id"] not in self._answered:
            self._answered.add(request["id"])
            answer = {"id": request["id"], **self._record(guard, cpu), "threads": thread_stacks()}
            files.write_json(self._shm / f"stacks{self.rank}.json", answer)
            self.counts["local_writes"] += 1
        if self.leader:
            self._gather(request)

    def _new_request(self, path: Path, *, shared: bool) -> dict[str, Any] | None:
        """The request at ``path`` if it is new since the last look and fresh."""
        try:
            st = os.stat(path)
        except OSError:
            return None
        finally:
            if shared:
                self.counts["shared_stats"] += 1
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        if key == self._request_stat:
            return None
        self._request_stat = key
        request = files.read_json(path)
        if request is None or time.time() - float(request.get("time", 0)) > files.REQUEST_FRESH_S:
            return None
        if self._request is not None and self._request["id"] == request["id"]:
            return None
        self._request, self._gathered = request, 0
        return request

    def _gather(self, request: dict[str, Any]) -> None:
        """The node's answers into one file, again whenever more ranks answered."""
        answers = {}
        for r in self.node_ranks:
            answer = files.read_json(self._shm / f"stacks{r}.json")
            if answer is not None and answer.get("id") == request["id"]:
                answers[r] = answer
        if len(answers) > self._gathered:
            self._gathered = len(answers)
            path = files.answers_dir(self._dir.parent, request["id"]) / f"node{self.node}.json"
            files.write_json(path, {"node": self.node, "time": time.time(), "ranks": answers})
            self.counts["shared_writes"] += 1
        too_old = time.time() - float(request["time"]) > ANSWER_FOR_S
        if len(answers) == len(self.node_ranks) or too_old:
            self._request = None


def thread_stacks() -> list[dict[str, Any]]:
    """Every thread's Python stack, innermost frame last, each frame ``[file, line,
    function, source]``: a thread inside a C call shows the Python line that called
    it. The main thread first."""
    frames = sys._current_frames()
    main = threading.main_thread().ident
    out = []
    for thread in threading.enumerate():
        frame = frames.get(thread.ident or -1)
        if frame is None:
            continue
        summary = traceback.extract_stack(frame)[-STACK_FRAMES:]
        out.append(
            {
                "name": thread.name,
                "main": thread.ident == main,
                "daemon": thread.daemon,
                "native_id": thread.native_id,
                "stack": [[f.filename, f.lineno, f.name, (f.line or "").strip()] for f in summary],
            }
        )
    return sorted(out, key=lambda t: not t["main"])


# ---------------------------------------------------------------------- the numbers


def _trend(times: list[float]) -> float | None:
    """The newer half's median step time over the older half's, less 1 (``+0.2``: 20%
    slower; medians: one slow step, a save or an eval, is not a trend); ``None`` with
    fewer than 6 steps seen."""
    if len(times) < 6:
        return None
    half = len(times) // 2
    old, new = statistics.median(times[:half]), statistics.median(times[half:])
    return round(new / old - 1, 3) if old > 0 else None


def _shares(steps: list[tuple[float, ...]]) -> dict[str, float] | None:
    """The window's share of step time in each phase (data, forward, backward,
    optimizer, other), from the engine's host clock."""
    total = sum(s[0] for s in steps)
    if not steps or total <= 0:
        return None
    names = ("data", "forward", "backward", "optimizer")
    shares = {n: sum(_finite(s[i + 1]) for s in steps) / total for i, n in enumerate(names)}
    shares["other"] = max(0.0, 1.0 - sum(shares.values()))
    return {k: round(v, 3) for k, v in shares.items()}


def _finite(x: float) -> float:
    return 0.0 if x is None or math.isnan(x) else x


def _tokens_per_s(steps: list[tuple[float, ...]]) -> float | None:
    total, tokens = sum(s[0] for s in steps), sum(s[5] for s in steps)
    return round(tokens / total, 1) if steps and tokens and total > 0 else None


def _gpu(guard: Guard) -> dict[str, Any] | None:
    """Utilisation and memory of this rank's GPU, where torch can say without touching
    the stream: the allocator's counters, NVML's utilisation (``None`` without
    pynvml). ``None`` off a GPU."""
    device = guard.device
    if device.type != "cuda":
        return None
    import torch

    out: dict[str, Any] = {
        "memory_gb": round(torch.cuda.memory_allocated(device) / 2**30, 2),
        "reserved_gb": round(torch.cuda.memory_reserved(device) / 2**30, 2),
        "util": None,
    }
    with contextlib.suppress(Exception):  # no pynvml / amdsmi: utilisation unknown
        out["util"] = torch.cuda.utilization(device) / 100
    with contextlib.suppress(Exception):
        out["total_gb"] = round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1)
    return out


#: A node folder in shared memory untouched this long belongs to a job that was killed
#: (a live one renames a file into it every tick): removed by the next job's start.
ABANDONED_AFTER_S = 3600.0


def _remove_abandoned(shm: Path) -> None:
    """The shared-memory folders that killed jobs left (no rank closed to remove them)."""
    with contextlib.suppress(OSError):
        for path in shm.glob("guardrails-live-*"):
            with contextlib.suppress(OSError):
                if time.time() - path.stat().st_mtime > ABANDONED_AFTER_S:
                    shutil.rmtree(path, ignore_errors=True)
