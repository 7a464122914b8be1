"""Every case of the checkpoint fuzz (``tests/_ckpt_fuzz.py``), each resumed four ways,
with the counts: cases per kind of damage, outcomes per way, and every problem found.

    python benchmarks/ckpt_fuzz.py [--seed 0] [--flips 3] [--timeout-s 10] [--json out.json]

A real guarded run writes step_2 and step_4 (small model, AdamW, StepLR, an enabled
GradScaler, a DataLoader mid-epoch); each case damages a fresh copy's step_4 and tries
``resume(root)``, ``resume(step_dir)``, ``guard(resume="auto")`` with two steps of a
real loop, and ``inspect`` (its function); a case whose newest manifest is a FIFO is
also inspected once through ``python -m guardrails inspect``. The suite
(``tests/checkpoint/test_ckpt_fuzz.py``) runs a sample of the same cases. Run it from the
repository root against any checkout (``PYTHONPATH=.``): the outcomes are what that
checkout's code does, so the same script measures the code before and after a change.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import _ckpt_fuzz as F  # noqa: E402
import torch  # noqa: E402


def cli_inspect_on_a_fifo(pristine: F.Pristine, work: Path, timeout_s: float) -> str:
    """``python -m guardrails inspect`` on a copy whose newest manifest is a FIFO."""
    root = work / "cli" / "checkpoints"
    shutil.copytree(pristine.root, root)
    manifest = root / F.NEWEST_DIR / "manifest.json"
    manifest.unlink()
    os.mkfifo(manifest)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "guardrails", "inspect", str(root)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
    except subprocess.TimeoutExpired:
        return f"hang (no answer in {timeout_s} s)"
    tail = "traceback" if "Traceback" in proc.stderr else "no traceback"
    return f"exit {proc.returncode}, {tail}: {proc.stdout.strip().splitlines()[-1][:120]}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--flips", type=int, default=3, help="bit and byte flips per file")
    p.add_argument("--timeout-s", type=float, default=10.0, help="a way's deadline (a hang)")
    p.add_argument("--json", type=Path, help="write the counts and problems here")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ckpt-fuzz-"))
    t0 = time.perf_counter()
    try:
        pristine = F.pristine(work / "pristine")
        cases = F.cases(random.Random(args.seed), F.sizes_of(pristine), flips_per_file=args.flips)
        outcomes = []
        seconds: Counter[str] = Counter()
        for i, case in enumerate(cases):
            for o in F.run_case(case, pristine, work / "case", timeout_s=args.timeout_s):
                outcomes.append(o)
                seconds[o.way] += o.seconds
            if (i + 1) % 50 == 0:
                print(f"  {i + 1}/{len(cases)} cases", file=sys.stderr, flush=True)
        cli = cli_inspect_on_a_fifo(pristine, work, args.timeout_s * 3)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    per_kind, per_way, problems = F.summarize(outcomes)
    total = time.perf_counter() - t0
    print(
        f"{len(cases)} cases x {len(F.WAYS)} ways = {len(outcomes)} resumes, seed {args.seed}, "
        f"{total:.0f} s; torch {torch.__version__}, Python {platform.python_version()}, "
        f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}"
    )
    print("\ncases per kind:")
    for kind, n in sorted(per_kind.items(), key=lambda kv: -kv[1]):
        print(f"  {kind:<10} {n}")
    print("\noutcomes per way:")
    for way in F.WAYS:
        row = {r: n for (w, r), n in per_way.items() if w == way}
        text = ", ".join(f"{r} {n}" for r, n in sorted(row.items(), key=lambda kv: -kv[1]))
        print(f"  {way:<13} {text}  ({seconds[way]:.1f} s)")
    print(f"\npython -m guardrails inspect, newest manifest a FIFO: {cli}")
    print(f"\nproblems: {len(problems)}")
    for line in problems[:200]:
        print("  " + line)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "cases": len(cases),
                    "per_kind": dict(per_kind),
                    "per_way": {f"{w}: {r}": n for (w, r), n in per_way.items()},
                    "cli_fifo": cli,
                    "problems": problems,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
