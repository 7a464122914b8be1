"""Two versions of guardrails timed against each other in ONE process, on overhead.py's
tiny CPU loop: plain, version A and version B runs interleaved (the order rotating),
so load from other processes on a shared machine hits all three alike, run by run.

    python benchmarks/version_inproc.py BASE_DIR [THIS_DIR] [--repeats 40] [--steps 300]

Each version's package is imported from its own checkout under the name
``guardrails`` (its modules are swapped into ``sys.modules`` before each of its runs,
so its lazy imports resolve to itself). Reported: each version's median per-step cost
over the plain loop and the median of the paired difference B - A (runs next to each
other), with the half-width of its interquartile range. ``--clock cpu`` times the
process's CPU time instead of wall time.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from overhead import Tiny  # noqa: E402


def _ours(name: str) -> bool:
    return name == "guardrails" or name.startswith("guardrails.")


def load(path: Path) -> dict[str, ModuleType]:
    """Import guardrails from ``path`` and every module it imports on a guarded loop."""
    for k in [k for k in sys.modules if _ours(k)]:
        del sys.modules[k]
    sys.path.insert(0, str(path))
    try:
        g = importlib.import_module("guardrails")
        assert Path(g.__file__).resolve().parent.parent == path.resolve(), g.__file__
        run(g, 30)  # imports what a guarded loop imports lazily
    finally:
        sys.path.remove(str(path))
    return {k: v for k, v in sys.modules.items() if _ours(k)}


def use(mods: dict[str, ModuleType]) -> ModuleType:
    for k in [k for k in sys.modules if _ours(k) and k not in mods]:
        del sys.modules[k]
    sys.modules.update(mods)
    return mods["guardrails"]


MODEL: dict[str, object] = {}
WARMUP = 10


def run(g: ModuleType | None, steps: int, clock=time.perf_counter) -> float:
    model, opt, data = MODEL["model"], MODEL["opt"], MODEL["data"]
    total = WARMUP + steps
    batches = [data[i % len(data)] for i in range(total)]

    def loop(it) -> float:
        t0 = 0.0
        for i, (x, y) in enumerate(it):
            if i == WARMUP:
                t0 = clock()
            model(x, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return (clock() - t0) / steps

    if g is None:
        return loop(batches)
    with tempfile.TemporaryDirectory() as d:
        with g.guard(model, opt, batches, run_dir=d, progress=False) as guard:
            return loop(guard)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("a", type=Path, help="version A's checkout (the baseline)")
    p.add_argument("b", type=Path, nargs="?", default=HERE.parent, help="version B's checkout")
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    args = p.parse_args()
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(1)
    logging.getLogger("guardrails").setLevel(logging.ERROR)
    torch.manual_seed(0)
    model = Tiny()
    MODEL.update(
        model=model,
        opt=torch.optim.AdamW(model.parameters(), lr=1e-4),
        data=[(torch.randn(8, 16), torch.randn(8)) for _ in range(8)],
    )
    versions = {"A": load(args.a), "B": load(args.b)}
    times: dict[str, list[float]] = {"plain": [], "A": [], "B": []}
    orders = [("plain", "A", "B"), ("B", "plain", "A"), ("A", "B", "plain")]
    for r in range(args.repeats):
        for k in orders[r % 3]:
            g = None if k == "plain" else use(versions[k])
            times[k].append(run(g, args.steps, clock))
    plain = times["plain"]
    print(f"torch {torch.__version__}, {args.repeats} x {args.steps} steps, clock={args.clock}")
    print(f"  A = {args.a}\n  B = {args.b}")
    print(f"  plain        {statistics.median(plain) * 1e6:8.1f} us/step")
    for k in ("A", "B"):
        d = sorted((t - q) * 1e6 for t, q in zip(times[k], plain, strict=True))
        q1, _, q3 = statistics.quantiles(d, n=4)
        print(f"  {k} - plain    {statistics.median(d):+8.1f} us/step (IQR {q1:+.1f} .. {q3:+.1f})")
    d = sorted((b - a) * 1e6 for a, b in zip(times["A"], times["B"], strict=True))
    q1, _, q3 = statistics.quantiles(d, n=4)
    print(f"  B - A        {statistics.median(d):+8.1f} us/step (IQR {q1:+.1f} .. {q3:+.1f})")


if __name__ == "__main__":
    main()
