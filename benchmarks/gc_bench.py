"""Python GC strategies in a training loop over a large live heap, in one process.

    python benchmarks/gc_bench.py                      # 3M long-lived objects, 2000 steps
    python benchmarks/gc_bench.py --objects 1000000 --steps 500    # a quick look

The "GPU at 0%, pauses of seconds" stall is the cyclic collector scanning
every long-lived object of the process. This puts a realistic heap in place first: a
dataset index of ``--objects`` tracked Python objects (1/3 ``Sample`` instances, 1/3
token lists, 1/3 small dicts of document metadata, plus a 1M-entry vocabulary dict), as
large tokenizer / dataset indexes create. Then a training-like step, on CPU:

* build a batch in Python, ``--prefetch`` batches ahead (as a loader's prefetch queue
  does): 64 records from the index, each a dict with a 258-token list and 16 spans
  (19 tracked objects), then collate the oldest batch into a tensor. Batches in the
  queue are alive across several young collections, so they are promoted to the
  oldest generation and counted toward Python's next full collection (3.11 runs one
  when those survivors exceed 25% of the long-lived objects): that is how a real loop
  reaches full collections of the whole heap;
* forward/backward/AdamW on a 256-1024-256 MLP (one torch thread);
* make ``--garbage`` objects of cyclic garbage (a parsed tree with parent pointers, the
  kind only the cyclic GC frees) and keep the last 100 steps' metrics records (bounded
  history: they survive young collections and die later, as real loops' objects do).
  With ``--survive K`` each step's tree stays alive K steps before it becomes garbage
  (a cache of recent parses): with K above the young-collection interval every tree
  lives through one young collection, is promoted to the oldest generation, and only a
  full collection frees it.

Strategies, each run ``--steps`` timed steps after ``--warmup`` untimed ones, all inside a
``guardrails.Guard`` (so the engine's own cost is the same in every row):

* ``floor``: the GC disabled, never collected (the no-GC floor; memory grows). Run first
  and last: the two bound the drift of the machine over the benchmark.
* ``default``: Python's automatic GC, default thresholds.
* ``nanochat``: after step 1, ``gc.collect(); gc.freeze(); gc.disable()``, never again.
* ``torchtitan``: ``gc.disable()`` and ``gc.collect(1)`` every 50 steps (its default).
* ``guardrails``: :class:`guardrails.GCScheduler` with its defaults (after step 1 one full
  collection and ``gc.freeze()``; ``gc.collect(1)`` every 100 steps, a full
  ``gc.collect(2)`` instead every 1000); ``guardrails/50`` and ``guardrails/200``
  collect every 50 (torchtitan's frequency) and every 200 steps: the same garbage in
  more, smaller pauses or fewer, larger ones; ``guardrails/no-full`` never runs a full
  collection after the freeze (the default before full collections were scheduled).

Reported per strategy: p50 / p99 / max step time, the GC time per 1000 steps (every
collection timed through ``gc.callbacks``), collections by generation, the longest
full (generation-2) collection in the timed steps, and the growth
of live GC-tracked objects over the timed steps, counted outside the timing (a bounded
strategy stays flat, up to one collection interval of garbage; one that never collects
grows by all the garbage it makes: ``--garbage`` x 3 objects a step). Between
strategies the GC state is reset (unfreeze, enable, default thresholds, full
collection), so each starts from the same heap.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable

import torch
from torch import nn

import guardrails
from guardrails import GCScheduler, Guard

DEFAULT_THRESHOLD = (700, 10, 10)


class Sample:
    __slots__ = ("doc", "length", "offset")

    def __init__(self, doc: int, offset: int, length: int) -> None:
        self.doc, self.offset, self.length = doc, offset, length


class TreeNode:
    """A parsed record with a parent pointer: a reference cycle per child."""

    def __init__(self, parent: TreeNode | None, value: int) -> None:
        self.parent = parent
        self.children: list[TreeNode] = []
        self.value = [value] * 8
        if parent is not None:
            parent.children.append(self)


def build_heap(n: int) -> dict[str, object]:
    """About ``n`` GC-tracked long-lived objects, like a dataset index and a tokenizer."""
    third = n // 3
    samples = [Sample(i, i * 7, 128 + i % 512) for i in range(third)]
    tokens = [[i, i + 1, i + 2] for i in range(third)]
    # A dict of only atoms is not tracked by the GC; one holding a list is (2 objects).
    meta = [{"doc": i, "tags": ["web", "en"]} for i in range(third // 2)]
    vocab = {f"tok{i}": i for i in range(1_000_000)}
    return {"samples": samples, "tokens": tokens, "meta": meta, "vocab": vocab}


def live_objects() -> int:
    """GC-tracked objects alive (or uncollected garbage), frozen ones included."""
    return len(gc.get_objects()) + gc.get_freeze_count()


class Timer:
    """Times every collection, whoever starts it."""

    def __init__(self) -> None:
        self.total = 0.0
        self.by_gen = [0, 0, 0]
        self.longest = 0.0
        self.longest_by_gen = [0.0, 0.0, 0.0]
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        pause = time.perf_counter() - self._t0
        self.total += pause
        self.longest = max(self.longest, pause)
        gen = info["generation"]
        self.by_gen[gen] += 1
        self.longest_by_gen[gen] = max(self.longest_by_gen[gen], pause)


def reset_gc() -> None:
    gc.unfreeze()
    gc.set_threshold(*DEFAULT_THRESHOLD)
    gc.enable()
    gc.collect()


def run(
    name: str,
    heap: dict[str, object],
    args: argparse.Namespace,
    components: list,
    on_step: Callable[[int], None],
) -> dict[str, object]:
    reset_gc()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    samples, tokens = heap["samples"], heap["tokens"]
    history: deque[dict] = deque(maxlen=100)
    alive: deque[TreeNode] = deque(maxlen=max(args.survive, 1))

    def make_batch(step: int) -> list[dict]:
        rows = []
        for j in range(64):
            k = (step * 64 + j) % len(samples)
            s = samples[k]
            spans = [[i, i + 8] for i in range(0, 128, 8)]
            rows.append({"doc": s.doc, "ids": tokens[k] * 86, "len": s.length, "spans": spans})
        return rows

    queue = deque(make_batch(i) for i in range(args.prefetch))
    n_steps = args.warmup + args.steps
    times: list[float] = []
    timer = Timer()
    live0 = 0
    with tempfile.TemporaryDirectory() as run_dir:
        g = Guard(model, opt, range(n_steps), run_dir=run_dir, components=components)
        with g:
            t_prev = time.perf_counter()
            for step in g:
                # Batches built in Python from the index ahead of use, then collated.
                queue.append(make_batch(step + args.prefetch))
                rows = queue.popleft()
                x = torch.tensor([r["ids"][:256] for r in rows], dtype=torch.float32) / 1e6
                loss = model(x).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                root = TreeNode(None, step)  # cyclic garbage, freed only by the cyclic GC
                for i in range(args.garbage - 1):
                    TreeNode(root, i)
                if args.survive:
                    alive.append(root)  # garbage args.survive steps from now
                del root
                history.append({"step": step, "loss": loss.detach(), "rows": len(rows)})
                on_step(g.step)
                now = time.perf_counter()
                if step >= args.warmup:
                    times.append(now - t_prev)
                elif step == args.warmup - 1:  # untimed: counting walks the whole heap
                    live0 = live_objects()
                    gc.callbacks.append(timer)
                    now = time.perf_counter()
                t_prev = now
            gc.callbacks.remove(timer)
            live1 = live_objects()  # before the guard's exit unfreezes and collects
    times.sort()
    ms = [t * 1e3 for t in times]
    result = {
        "strategy": name,
        "p50_ms": statistics.median(ms),
        "p99_ms": ms[int(0.99 * (len(ms) - 1))],
        "max_ms": ms[-1],
        "mean_ms": statistics.fmean(ms),
        "gc_ms_per_1000_steps": timer.total * 1e3 * 1000 / len(ms),
        "longest_gc_ms": timer.longest * 1e3,
        "longest_full_gc_ms": timer.longest_by_gen[2] * 1e3,
        "collections_by_gen": timer.by_gen,
        "live_objects_growth": live1 - live0,
    }
    reset_gc()
    return result


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--objects", type=int, default=3_000_000)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--garbage", type=int, default=200, help="cyclic objects made per step")
    p.add_argument("--prefetch", type=int, default=8, help="batches built ahead of use")
    p.add_argument(
        "--survive", type=int, default=0, help="steps each step's garbage tree stays alive"
    )
    p.add_argument("--only", help="comma-separated strategy names to run (default: all)")
    p.add_argument("--out", help="append a JSON line with the results here")
    args = p.parse_args()
    torch.set_num_threads(1)

    t0 = time.perf_counter()
    heap = build_heap(args.objects)
    gc.collect()
    t_build = time.perf_counter() - t0
    t0 = time.perf_counter()
    gc.collect()
    full_ms = (time.perf_counter() - t0) * 1e3
    tracked = len(gc.get_objects())
    print(
        f"heap: {tracked:,} GC-tracked objects (built in {t_build:.1f} s); one full "
        f"collection takes {full_ms:.0f} ms",
        flush=True,
    )

    def never(step: int) -> None:
        pass

    def nanochat(step: int) -> None:
        if step == 1:
            gc.collect()
            gc.freeze()
            gc.disable()

    def torchtitan(step: int) -> None:
        if step == 1:
            gc.disable()
            gc.collect(1)
        elif step % 50 == 0:
            gc.collect(1)

    def floor(step: int) -> None:
        if step == 1:
            gc.disable()

    plan = [
        ("floor", [], floor),
        ("default", [], never),
        ("nanochat", [], nanochat),
        ("torchtitan", [], torchtitan),
        ("guardrails", [GCScheduler()], never),
        ("guardrails/50", [GCScheduler(every_n_steps=50)], never),
        ("guardrails/200", [GCScheduler(every_n_steps=200)], never),
        ("guardrails/no-full", [GCScheduler(full_every_n_steps=None)], never),
        ("floor (again)", [], floor),
    ]
    if args.only:
        wanted = set(args.only.split(","))
        plan = [row for row in plan if row[0] in wanted]
    results = []
    header = (
        f"{'strategy':<18} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'GC ms/1k':>9} "
        f"{'longest GC':>10} {'full GC':>8} {'gen0/1/2':>12} {'objects +':>10}"
    )
    print(header, flush=True)
    for name, components, hook in plan:
        r = run(name, heap, args, components, hook)
        results.append(r)
        gens = "/".join(map(str, r["collections_by_gen"]))
        print(
            f"{name:<18} {r['p50_ms']:8.2f} {r['p99_ms']:8.2f} {r['max_ms']:8.2f} "
            f"{r['gc_ms_per_1000_steps']:9.1f} {r['longest_gc_ms']:8.1f}ms "
            f"{r['longest_full_gc_ms']:6.1f}ms {gens:>12} "
            f"{r['live_objects_growth']:10,d}",
            flush=True,
        )
    floors = [r["p99_ms"] for r in results if r["strategy"].startswith("floor")]
    ours = next((r for r in results if r["strategy"] == "guardrails"), None)
    if floors and ours is not None:
        best_floor = min(floors)
        print(
            f"guardrails p99 vs the no-GC floor: {ours['p99_ms']:.2f} ms vs "
            f"{best_floor:.2f}-{max(floors):.2f} ms "
            f"({(ours['p99_ms'] / best_floor - 1) * 100:+.1f}% of the lower floor; target +2%)"
        )
    if args.out:
        record = {
            "date": time.strftime("%Y-%m-%d"),
            "machine": platform.node(),
            "cpu": platform.processor() or platform.machine(),
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "guardrails": guardrails.__version__,
            "args": vars(args),
            "tracked_objects": tracked,
            "full_collection_ms": full_ms,
            "results": results,
        }
        with open(args.out, "a") as f:
            f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
