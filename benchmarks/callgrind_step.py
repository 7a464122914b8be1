"""The guard's per-step host cost as counted by valgrind (callgrind with its cache
simulation), on overhead.py's tiny CPU loop: instructions, L1 instruction and data
misses and an estimated cycle count per step, exact and the same on a loaded machine
(wall-clock A/Bs on the shared 2-core VM swing by tens of microseconds).

    python benchmarks/callgrind_step.py [--base DIR] [--split] [--steps 200]
    python benchmarks/callgrind_step.py --tensors 150 --steps 10 --warmup 30 --base DIR
        # the guard's host cost against the number of parameter tensors (overhead.py's
        # stack model: tensors/2 Linear(16, 16) layers)

Runs, each in its own process under ``valgrind --tool=callgrind --cache-sim=yes``:
the plain loop, and the guarded loop (``guardrails.guard()`` defaults) of this
checkout and of ``--base`` (another checkout). Only the measured steps are collected
(``--toggle-collect`` on the C iterator that drives them), after 120 warm-up steps
(lazy imports, the first telemetry flush, the health checks' first window), with
telemetry's parquet writes off (``write_every_s``: valgrind's slow clock would write
parts mid-run). ``--split`` also runs each guarded loop once more with the main
per-step pieces called through distinct C iterators, so callgrind's inclusive cost of
each iterator is that piece's cost (plus ~1,500 instructions of the wrapper's own).

Estimated cycles = Ir + 10 x (L1 misses) + 100 x (last-level misses): a model, not a
reading; on this VM it tracked the wall-clock overhead (288,000 for ~89 us).
Needs valgrind on PATH; ~3-8 minutes a run.
"""

from __future__ import annotations

import argparse
import collections
import functools
import itertools
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
WARMUP = 120
EVENTS = ("Ir", "Dr", "Dw", "I1mr", "D1mr", "D1mw", "ILmr", "DLmr", "DLmw")
#: --split: the C iterator each piece runs inside, and what it measures.
PIECES = {
    "takewhile_next": (
        "guardrails.guards.nan.guard",
        "NanGuard",
        "before_step",
        "NanGuard.before_step (with the row write and grad norm)",
    ),
    "filterfalse_next": ("guardrails.engine.gradnorm", "GradNorm", "__call__", "the grad norm"),
    "functools_reduce": ("guardrails.guards.nan.guard", "NanGuard", "_judge", "NanGuard._judge"),
    "dropwhile_next": (
        "guardrails.guards.telemetry",
        "Telemetry",
        "after_step",
        "Telemetry.after_step (with its flush)",
    ),
    "groupby_next": ("guardrails.guards.telemetry", "Telemetry", "_flush", "Telemetry._flush"),
}


def _through(c_iter: str, fn):
    """``fn`` called inside the C iterator ``c_iter`` (see PIECES)."""

    def call(*a):
        out: list = []
        run = lambda _: out.append(fn(*a))  # noqa: E731
        if c_iter == "takewhile_next":
            collections.deque(itertools.takewhile(lambda x: run(x) or False, (0,)), 0)
        elif c_iter == "dropwhile_next":
            collections.deque(itertools.dropwhile(lambda x: run(x) or True, (0,)), 0)
        elif c_iter == "filterfalse_next":
            collections.deque(itertools.filterfalse(lambda x: run(x) or True, (0,)), 0)
        elif c_iter == "groupby_next":
            collections.deque(itertools.groupby((0,), key=run), 0)
        else:
            functools.reduce(lambda x, y: run(x), (0, 0))
        return out[0]

    return call


def child(mode: str, steps: int, split: bool, tensors: int = 0, warmup: int = WARMUP) -> None:
    import importlib

    import numpy.ma  # noqa: F401  (imported lazily by np.median: not in the window)
    import torch

    sys.path.insert(0, str(HERE))
    from overhead import Stack, Tiny

    import guardrails

    torch.set_num_threads(1)
    logging.getLogger("guardrails").setLevel(logging.CRITICAL)
    if split:
        for c_iter, (module, cls, name, _) in PIECES.items():
            owner = getattr(importlib.import_module(module), cls)
            setattr(owner, name, _through(c_iter, getattr(owner, name)))
    torch.manual_seed(0)
    model = Stack(tensors) if tensors else Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = [(torch.randn(8, 16), torch.randn(8)) for _ in range(8)]
    batches = [data[i % 8] for i in range(warmup + steps)]

    def run(it) -> None:
        def step() -> None:
            x, y = next(it)
            model(x, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for _ in range(warmup):
            step()
        # Collected by callgrind: the steps run inside starmap's C iterator.
        collections.deque(itertools.starmap(step, itertools.repeat((), steps)), 0)

    if mode == "plain":
        run(iter(batches))
        return
    with tempfile.TemporaryDirectory() as d:
        knobs = {"metrics": {"write_every_s": 1e9}}
        with guardrails.guard(model, opt, batches, run_dir=d, progress=False, **knobs) as g:
            run(iter(g))


def callgrind(argv: list[str], out: Path, pythonpath: str | None = None) -> dict[str, int]:
    """Run ``python argv`` under callgrind with its cache simulation, collecting only
    inside starmap's C iterator (the caller's measured calls); the totals of EVENTS."""
    # Fixed hash seed and no address randomisation: the same dict layouts and cache sets
    # run to run (with both random, a run's guard cost moved by ~5%).
    env = dict(os.environ, PYTHONHASHSEED="0")
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    norandom = ["setarch", os.uname().machine, "-R"] if shutil.which("setarch") else []
    tool = [
        "valgrind",
        "--tool=callgrind",
        "--cache-sim=yes",
        "--collect-atstart=no",
        "--toggle-collect=starmap_next",
        f"--callgrind-out-file={out}",
    ]
    subprocess.run(
        [*norandom, *tool, sys.executable, *argv], env=env, check=True, capture_output=True
    )
    totals = {}
    for line in out.read_text().splitlines():
        if line.startswith("summary:"):
            values = list(map(int, line.split()[1:])) + [0] * len(EVENTS)
            totals = dict(zip(EVENTS, values, strict=False))
    return totals


def measure(
    pythonpath: str | None,
    mode: str,
    steps: int,
    split: bool,
    out: Path,
    tensors: int = 0,
    warmup: int = WARMUP,
):
    argv = [__file__, "--child", mode, "--steps", str(steps)] + (["--split"] if split else [])
    argv += ["--tensors", str(tensors), "--warmup", str(warmup)]
    totals = callgrind(argv, out, pythonpath)
    pieces = {}
    if split:
        ann = subprocess.run(
            [
                "callgrind_annotate",
                "--inclusive=yes",
                "--threshold=100",
                "--show=Ir,I1mr,D1mr,D1mw",
                str(out),
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for line in ann.splitlines():
            for c_iter in PIECES:
                # The first line is the function's own (the list is by cost, highest
                # first); later ones name it as a caller or callee.
                if c_iter not in pieces and re.search(rf"[:\s]{c_iter}( |$)", line):
                    fields = re.findall(r"([\d,]+)(?:\s+\([^)]*\))?", line)[:4]
                    ir, i1, d1r, d1w = (int(f.replace(",", "")) for f in fields)
                    pieces[c_iter] = (ir, i1 + d1r + d1w)
    return totals, pieces


def est(t: dict[str, int]) -> int:
    l1 = t["I1mr"] + t["D1mr"] + t["D1mw"]
    return t["Ir"] + 10 * l1 + 100 * (t["ILmr"] + t["DLmr"] + t["DLmw"])


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--base", help="another checkout to compare with")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--split", action="store_true")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--tensors", type=int, default=0, help="overhead.py's stack model (0: tiny)")
    p.add_argument("--warmup", type=int, default=WARMUP, help="untimed steps first")
    args = p.parse_args()
    if args.child:
        child(args.child, args.steps, args.split, args.tensors, args.warmup)
        return
    runs = [("plain", None, "plain"), ("this", str(HERE.parent), "guarded")]
    if args.base:
        runs.append(("base", args.base, "guarded"))
    n = args.steps
    with tempfile.TemporaryDirectory() as d:
        res = {}
        for label, path, mode in runs:
            out = Path(d) / f"{label}.out"
            totals, _ = measure(path, mode, n, False, out, args.tensors, args.warmup)
            pieces = {}
            if args.split and mode == "guarded":  # its own run: the wrappers cost a little
                out = Path(d) / f"{label}-split.out"
                _, pieces = measure(path, mode, n, True, out, args.tensors, args.warmup)
            res[label] = (totals, pieces)
    plain = res["plain"][0]
    model = f"stack model, {args.tensors} tensors" if args.tensors else "tiny model"
    print(f"per step, {n} steps after {args.warmup} warm-up, {model} (callgrind, cache sim)")
    for label, (t, pieces) in res.items():
        misses = (t["I1mr"] + t["D1mr"] + t["D1mw"]) / n
        line = f"  {label:6s} Ir {t['Ir'] / n:10.0f}  L1 misses {misses:7.0f}"
        line += f"  est. cycles {est(t) / n:10.0f}"
        if label != "plain":
            line += (
                f"   guard: Ir {(t['Ir'] - plain['Ir']) / n:+8.0f}"
                f"  est. cycles {(est(t) - est(plain)) / n:+8.0f}"
            )
        print(line)
        for c_iter, (ir, piece_misses) in pieces.items():
            cycles = (ir + 10 * piece_misses) / n
            print(f"      {PIECES[c_iter][3]:55s} Ir {ir / n:8.0f}  est. cycles {cycles:8.0f}")


if __name__ == "__main__":
    main()
