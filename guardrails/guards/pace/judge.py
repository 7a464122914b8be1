"""The judgements of :class:`~guardrails.guards.pace.pace.Pace`, as plain functions of
window summaries: which rank straggles and in what, whether a rank slowed down against
its own best, whether the step is communication-bound. No torch, no store: the tests
feed them numbers.

A *window* is one rank's summary of a run of steps: the median of each phase's seconds
per step (medians, so one evaluation pause or checkpoint save in a window moves
nothing). Phases: ``data`` (the loader's ``next()``), ``forward`` (the training
forwards), ``backward`` (first forward to ``optimizer.step()``, less the above: the
loss, the backward, the gradients' all-reduce, clipping), ``optimizer``
(``optimizer.step()``) and ``other`` (the rest of the step: the loop's own code).

Where ranks synchronize (DDP's all-reduce at the end of the backward; FSDP's
all-gathers in the forward too; a collective the loop calls itself), a fast rank waits
for the slowest: its time in that phase grows by the straggler's excess elsewhere. So
with two ranks the times alone are symmetric (the straggler's forward is 40 ms longer,
its peer's backward 40 ms longer) and only the phases where no rank waits tell who is
slow: a straggler is judged on those *unsynchronized* phases only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

PHASES = ("data", "forward", "backward", "optimizer", "other")

#: The engine's ``guard.phase`` names that differ from these: its "loop" (the loop's
#: own code between the guard's points) is the step's "other".
PHASE_OF = {"loop": "other"}

#: The least excess a phase must show to name a straggler, whatever its share: below
#: ~2 ms, one rank's scheduling on a shared CPU host moves medians that much.
MIN_EXCESS_S = 0.002

#: Non-overlapped communication below this per step is never "communication-bound":
#: a small model's all-reduce over loopback takes a large share of a tiny step, and
#: nothing a user could change would matter.
MIN_EXPOSED_COMM_S = 0.005

#: Gradients below this per step are never "communication-bound" either: their
#: all-reduce time is latency (and the wait for the slower rank), not bandwidth.
MIN_COMM_BYTES = 1 << 20

#: What each phase covers, in a message.
WORDS = {
    "data": "wait for the loader",
    "forward": "forward",
    "backward": "backward",
    "optimizer": "optimizer step",
    "other": "loop code between steps",
}

#: What to look at when a rank straggles in each phase.
ADVICE = {
    "data": (
        "its loader is slower than the others': its share of the data (longer samples, "
        "a slower disk or network mount), fewer loader workers or CPU cores left to "
        "them (another process on that host: top)"
    ),
    "forward": (
        "its compute is slower than the others': another process on its GPU or CPU "
        "(nvidia-smi, top on that host), a GPU throttled by clocks or temperature "
        "(nvidia-smi -q -d PERFORMANCE), a different device or dtype there, or longer "
        "sequences in its batches"
    ),
    "optimizer": (
        "its optimizer step is slower than the others': another process on its device, "
        "a throttled GPU, or optimizer state on the CPU there"
    ),
    "other": (
        "the loop's own code between steps is slower there: work done on that rank "
        "only (logging, evaluation, writing files: often rank 0's), or host syncs "
        "(.item(), print(tensor)) waiting for its device"
    ),
    "backward": "its backward is slower than the others'",
}


@dataclass(frozen=True)
class Window:
    """One rank's summary of the steps ``first..last``: median seconds per step."""

    rank: int
    first: int
    last: int
    step_s: float
    phases: dict[str, float]
    #: Forward, backward and optimizer are the device's (CUDA events), not the host's.
    device: bool = False
    #: Per step, over the window (totals, not medians: a busy machine may stall one
    #: step in ten for a whole time slice): wall seconds, and the loop thread's seconds
    #: on a CPU and waiting for one that other processes held (the kernel's schedstat,
    #: read at the window's two ends). NaN where the platform does not say.
    wall_step_s: float = math.nan
    cpu_step_s: float = math.nan
    wait_step_s: float = math.nan

    def to_json(self) -> dict[str, object]:
        return {
            "rank": self.rank,
            "steps": [self.first, self.last],
            "step_s": self.step_s,
            "phases": self.phases,
            "device": self.device,
            "wall_step_s": self.wall_step_s,
            "cpu_step_s": self.cpu_step_s,
            "wait_step_s": self.wait_step_s,
        }

    @classmethod
    def from_json(cls, d: dict) -> Window:
        first, last = d["steps"]
        step_s, phases = float(d["step_s"]), dict(d["phases"])
        usage = (float(d.get(k, math.nan)) for k in ("wall_step_s", "cpu_step_s", "wait_step_s"))
        return cls(
            int(d["rank"]), int(first), int(last), step_s, phases, bool(d.get("device")), *usage
        )


@dataclass(frozen=True)
class Straggling:
    """This rank is slower than its neighbours in ``phase`` over one window."""

    phase: str
    mine_s: float
    theirs_s: float
    ranks: tuple[int, ...]
    step_s: float


def straggling(
    mine: Window,
    peers: Sequence[Window],
    synced: frozenset[str],
    *,
    factor: float,
    min_share: float,
) -> Straggling | None:
    """The unsynchronized phase in which ``mine`` is slower than every one of ``peers``
    (each a neighbour's latest window) by ``factor`` or more, by at least
    ``min_share`` of the step and :data:`MIN_EXCESS_S`; the largest such excess, or
    ``None``. Slower than *every* neighbour: a rank beside a straggler is not slow."""
    if not peers:
        return None
    best: Straggling | None = None
    for phase in PHASES:
        if phase in synced:
            continue
        m = mine.phases.get(phase, math.nan)
        theirs = [p.phases.get(phase, math.nan) for p in peers]
        if math.isnan(m) or any(math.isnan(t) for t in theirs):
            continue
        ref = max(theirs)
        excess = m - ref
        if excess < max(MIN_EXCESS_S, min_share * mine.step_s) or m < factor * ref:
            continue
        if best is None or excess > best.mine_s - best.theirs_s:
            best = Straggling(phase, m, ref, tuple(p.rank for p in peers), mine.step_s)
    return best


def straggler_message(rank: int, s: Straggling, since: int, synced: frozenset[str]) -> str:
    ratio = s.mine_s / s.theirs_s if s.theirs_s > 0 else math.inf
    times = f"{ratio:.1f}x" if ratio < 100 else "over 100x"
    peers = " and ".join(str(r) for r in s.ranks)
    where = f" (their {' and '.join(sorted(synced))} is that much longer)" if synced else ""
    return (
        f"rank {rank} is slower than its neighbours (rank{'s' if len(s.ranks) > 1 else ''} "
        f"{peers}) since step {since}: its {WORDS[s.phase]} takes {s.mine_s * 1e3:.1f} ms "
        f"a step against {s.theirs_s * 1e3:.1f} ms ({times}). The other ranks wait "
        f"for it every step{where}, so the job runs at this rank's pace "
        f"({s.step_s * 1e3:.1f} ms a step). Look at this rank: {ADVICE[s.phase]}."
    )


def slowdown(
    mine: Window, best: Window, synced: frozenset[str], *, factor: float
) -> tuple[str, float] | None:
    """``(phase, extra seconds)``: the unsynchronized phase that grew most when
    ``mine``'s step time is ``factor`` times ``best``'s or more; ``None`` otherwise (or
    when only synchronized phases grew: this rank is waiting for another, whose own
    report names it)."""
    if not mine.step_s >= factor * best.step_s:
        return None
    growth = {
        p: mine.phases.get(p, math.nan) - best.phases.get(p, math.nan)
        for p in PHASES
        if p not in synced
    }
    growth = {p: g for p, g in growth.items() if not math.isnan(g)}
    if not growth:
        return None
    phase = max(growth, key=lambda p: growth[p])
    # The phase must carry most of the slowdown, not a sliver of a synchronized wait.
    if growth[phase] < 0.5 * (mine.step_s - best.step_s):
        return None
    return phase, growth[phase]


#: A slowdown is the machine's, not the loop's, when most of the extra time a step is
#: the loop thread waiting for a CPU that other processes held (ready to run, not
#: running: a sleep, a blocking read or a wait for the GPU is none of it). The loop's
#: own CPU time is no alibi either way while it shares a core: the switches cost it
#: work (caches refilled after each), 1.2-2.2x a step with 4 busy processes on its core
#: (2 cores, 10 runs), so a loop that also does more work is judged once the machine is
#: quiet again (its own report, a warning).
BUSY_WAIT_SHARE = 0.5
#: Up to this growth of the loop's CPU time a step, a busy machine's report says the
#: loop does the same work; past it, that its work grew too, in part the sharing's cost.
BUSY_MAX_WORK = 1.6


def machine_busy(mine: Window, best: Window) -> float | None:
    """The share of the time the loop thread was ready to run in ``mine`` that it got a
    CPU, when waiting for a CPU other processes held carries the slowdown (see
    :data:`BUSY_WAIT_SHARE`); ``None`` when the slowdown is the loop's own (or the
    platform does not say)."""
    extra = mine.wall_step_s - best.wall_step_s
    if not (extra > 0 and best.cpu_step_s > 0):
        return None  # NaN: no schedstat
    if not mine.wait_step_s - best.wait_step_s >= BUSY_WAIT_SHARE * extra:
        return None
    return mine.cpu_step_s / (mine.cpu_step_s + mine.wait_step_s)


def slowdown_message(
    rank: int, mine: Window, best: Window, phase: str, extra_s: float, since: int
) -> str:
    return (
        f"rank {rank}'s steps got slower: {mine.step_s * 1e3:.1f} ms a step since step "
        f"{since}, {mine.step_s / best.step_s:.1f}x its best ({best.step_s * 1e3:.1f} ms "
        f"over steps {best.first}-{best.last}); the time went to its {WORDS[phase]} "
        f"(+{extra_s * 1e3:.1f} ms a step). " + _SLOWDOWN_ADVICE[phase] + " If the slower "
        "steps are expected (longer sequences by design, a curriculum), raise "
        'pace={"slowdown_factor": ...} or leave it: it is reported once.'
    )


def busy_message(rank: int, mine: Window, best: Window, share: float, since: int) -> str:
    work = (
        f"{mine.cpu_step_s * 1e3:.1f} ms of CPU time a step, against "
        f"{best.cpu_step_s * 1e3:.1f} ms then"
    )
    if mine.cpu_step_s <= BUSY_MAX_WORK * best.cpu_step_s:
        loop = f"and the loop is not at fault: it does the same work a step ({work})."
    else:
        loop = (
            f"mostly waiting for a CPU; its own work grew too ({work}), in part the cost "
            "of sharing a core (caches refilled after every switch): if the loop itself "
            "got slower, that is reported once the machine is quiet."
        )
    return (
        f"rank {rank}'s steps got slower: {mine.step_s * 1e3:.1f} ms a step since step "
        f"{since}, {mine.step_s / best.step_s:.1f}x its best ({best.step_s * 1e3:.1f} ms "
        f"over steps {best.first}-{best.last}), {loop} The machine is busy: this process "
        f"got {share:.0%} of the CPU time it was ready to use, other processes took the "
        f"rest (it waited {mine.wait_step_s * 1e3:.1f} ms a step for a CPU, against "
        f"{best.wait_step_s * 1e3:.1f} ms then). See what else runs on this host (top: another "
        "job, another run's loader workers); give the job cores of its own (taskset, "
        "the cluster scheduler's exclusive allocation) or fewer threads to share them "
        "(torch.set_num_threads). Nothing to change in the loop; it is reported once "
        '(pace={"slowdown_factor": ...} raises the bar).'
    )


_SLOWDOWN_ADVICE = {
    "data": (
        "The loader slowed down: a slower part of the dataset or storage, workers "
        "starved of CPU, or a cache that stopped fitting in memory."
    ),
    "forward": (
        "The compute slowed down: another process on the device, thermal throttling, "
        "longer sequences, or recompiles (torch._dynamo's recompile logs)."
    ),
    "backward": (
        "The backward slowed down: another process on the device, thermal throttling, "
        "or longer sequences."
    ),
    "optimizer": (
        "The optimizer step slowed down: another process on the device, or its state moved off it."
    ),
    "other": (
        "The loop's own code between steps slowed down: logging or evaluation every "
        "step, host syncs, a growing Python structure walked every step."
    ),
}


@dataclass(frozen=True)
class CommStats:
    """DDP's own timing of one sampled iteration's gradient all-reduce (it samples the
    first ten and every 100th)."""

    iteration: int
    comm_s: float  # first bucket's all-reduce start -> last one's end
    overlap_s: float  # of which overlapped with the backward's compute
    bytes: int  # the gradient bytes all-reduced per step (its buckets)
    buckets: int


def comm_bound(stats: CommStats, window: Window, *, share: float) -> float | None:
    """The share of the step spent in communication that nothing overlaps, when it is
    at least ``share`` (and :data:`MIN_EXPOSED_COMM_S`, of :data:`MIN_COMM_BYTES` or
    more); else ``None``. ``stats`` is one sampled iteration: it must agree with the
    window's medians (the exposed time fits inside the median backward, where DDP
    waits for it), or it was an outlier (a peer descheduled, a checkpoint save)."""
    exposed = stats.comm_s - stats.overlap_s
    step_s = window.step_s
    backward = window.phases.get("backward", math.nan)
    if not step_s > 0 or exposed < MIN_EXPOSED_COMM_S or stats.bytes < MIN_COMM_BYTES:
        return None
    if not exposed <= 1.5 * backward:
        return None
    frac = exposed / step_s
    return frac if frac >= share else None


def bus_bandwidth(stats: CommStats, world: int) -> float:
    """Bytes per second on the wire per rank, the way nccl-tests count an all-reduce's
    bus bandwidth: ``2 (n - 1) / n * bytes / time``."""
    if stats.comm_s <= 0 or world < 2:
        return math.nan
    return 2 * (world - 1) / world * stats.bytes / stats.comm_s


def comm_message(stats: CommStats, step_s: float, frac: float, world: int, backend: str) -> str:
    bw = bus_bandwidth(stats, world)
    exposed = stats.comm_s - stats.overlap_s
    env = "NCCL_SOCKET_IFNAME" if backend == "nccl" else "GLOO_SOCKET_IFNAME"
    return (
        f"communication-bound: the gradients' all-reduce ({stats.bytes / 2**20:.1f} MiB "
        f"a step in {stats.buckets} bucket{'s' if stats.buckets != 1 else ''}) takes "
        f"{stats.comm_s * 1e3:.1f} ms, {exposed * 1e3:.1f} ms of it not overlapped with "
        f"the backward: {frac:.0%} of the {step_s * 1e3:.1f} ms step, while no rank "
        f"straggles. Achieved bus bandwidth {bw / 1e9:.2f} GB/s ({world} ranks, "
        f"{backend}). If that is far below the link (NVLink: hundreds of GB/s, "
        f"InfiniBand: 25-50 GB/s, 10 GbE: ~1.2 GB/s), check that {env} names the fast "
        "interface and that the job is not crossing a slow one. Otherwise do more work "
        "per all-reduce: a larger batch per step or gradient accumulation under "
        "model.no_sync(), bf16 gradients (DDP's bf16_compress_hook), or shard the "
        "gradients and optimizer state (FSDP / ZeRO)."
    )
