"""How long ``guardrails stacks`` takes to hear from every rank, at several world sizes.

    python benchmarks/stacks_scale.py [--worlds 16,32,64] [--ranks-per-node 8] [--out DIR]

Real gloo jobs of ``tests/live_worker.py stuck`` (each rank its own process, forked from
the tests' fork server; simulated nodes of ``--ranks-per-node`` ranks): after 3 steps rank
1 sleeps in ``time.sleep``, rank 2 in a C call, rank 3 computes (a straggler), rank 0 and
every rank from 4 on wait in an ``all_reduce`` ranks 1-3 never join. Once every rank is
there, ``guardrails stacks RUN_DIR --json`` is timed (from the command's start to its
answer: request seen by each rank's watchdog thread, stacks written, files read) and its
grouped text checked: the odd ranks named on their own line. Prints a table and writes
``DIR/stacks_scale.json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from _ranks import base_env, launch  # noqa: E402

WORKER = ROOT / "tests" / "live_worker.py"


def cli(*args: object) -> tuple[subprocess.CompletedProcess[str], float]:
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "guardrails", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        env=base_env(),
        cwd=ROOT,
    )
    return done, time.monotonic() - t0


def one(out: Path, world: int, per_node: int) -> dict:
    argv = [sys.executable, WORKER, "stuck", "--out", out, "--ranks-per-node", str(per_node)]
    job = launch(argv, world, out=out)
    try:
        deadline = time.monotonic() + 600
        while not all((out / f"stuck{r}").exists() for r in range(world)):
            if time.monotonic() > deadline or job.poll():
                raise SystemExit(f"{world} ranks: not every rank got stuck")
            time.sleep(0.5)
        time.sleep(3.0)  # the CPU share is measured over the stuck span
        answer, took = cli("stacks", out / "run", "--json")
        text, _ = cli("stacks", out / "run")
    finally:
        job.kill()
        for path in Path("/dev/shm").glob("guardrails-live-*"):
            shutil.rmtree(path, ignore_errors=True)
    got = json.loads(answer.stdout)
    lines = [ln for ln in text.stdout.splitlines() if ln.lstrip().startswith("rank ")]
    return {
        "world": world,
        "answered": len(got["ranks"]),
        "missing": got["missing"],
        "took_s_reported": got["took_s"],
        "command_s": round(took, 2),
        "groups": len(lines),
        "lines": lines,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worlds", default="16,32,64")
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    out = a.out or Path(tempfile.mkdtemp(prefix="stacks-scale-"))
    rows = []
    for world in map(int, a.worlds.split(",")):
        row = one(out / f"w{world}", world, a.ranks_per_node)
        rows.append(row)
        print(
            f"{world:>4} ranks: {row['answered']} answered, missing {row['missing']}, "
            f"{row['took_s_reported']:.2f} s to the last answer, command {row['command_s']:.2f} s, "
            f"{row['groups']} groups",
            flush=True,
        )
        for line in row["lines"]:
            print("      " + line[:150])
    (out / "stacks_scale.json").write_text(json.dumps(rows, indent=1))
    print(f"wrote {out / 'stacks_scale.json'}")


if __name__ == "__main__":
    main()
