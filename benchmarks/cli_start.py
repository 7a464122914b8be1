"""Wall time of the CLI's quick commands, two versions of guardrails interleaved:
``--help``, ``report`` (text only and with the PNG) and ``inspect``.

    python benchmarks/cli_start.py BEFORE_TREE RUN_DIR [MORE_RUN_DIRS...] [--rounds 10]

BEFORE_TREE is another checkout of the package (``git archive main | tar -x -C
/tmp/base``); this one is "after". RUN_DIR is a real run directory (metrics,
events, ``checkpoints/``): ``report`` and ``inspect`` read it; MORE_RUN_DIRS are
reported on too (a long run's metrics). Each round runs every command once under each
version, alternating which goes first, so a load that comes and goes hits both alike;
printed: the median and the minimum per command and version.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

AFTER = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("before", type=Path)
    p.add_argument("run_dirs", type=Path, nargs="+")
    p.add_argument("--rounds", type=int, default=10)
    a = p.parse_args()
    png = Path(tempfile.mkdtemp()) / "report.png"
    first = a.run_dirs[0]
    cases = {
        "--help": ["--help"],
        f"report {first.name} --no-png": ["report", str(first), "--no-png"],
        f"report {first.name} (PNG)": ["report", str(first), "--png", str(png)],
        **{f"report {d.name} --no-png": ["report", str(d), "--no-png"] for d in a.run_dirs[1:]},
        f"inspect {first.name}": ["inspect", str(first)],
    }
    trees = {"before": a.before.resolve(), "after": AFTER}
    times: dict[str, dict[str, list[float]]] = {c: {t: [] for t in trees} for c in cases}
    for i in range(a.rounds):
        for case, args in cases.items():
            for tag in list(trees) if i % 2 == 0 else list(trees)[::-1]:
                env = {**os.environ, "PYTHONPATH": str(trees[tag]), "OMP_NUM_THREADS": "1"}
                t0 = time.perf_counter()
                proc = subprocess.run(
                    [sys.executable, "-m", "guardrails", *args],
                    env=env,
                    cwd=png.parent,  # not a checkout: -m must find the tree on PYTHONPATH
                    capture_output=True,
                    text=True,
                )
                times[case][tag].append(time.perf_counter() - t0)
                if proc.returncode != 0:
                    sys.exit(f"{tag} {case}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
    print(f"{a.rounds} rounds; medians (min) in seconds")
    for case, by in times.items():
        b, f = by["before"], by["after"]
        print(
            f"  {case:40s} before {statistics.median(b):5.2f} ({min(b):.2f})"
            f"   after {statistics.median(f):5.2f} ({min(f):.2f})"
        )


if __name__ == "__main__":
    main()
