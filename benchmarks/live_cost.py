"""What the live view (``guardrails top`` / ``stacks``, issue 51) costs a job.

    python benchmarks/live_cost.py [--worlds 2,4,8] [--ranks-per-node 2] [--steps 300]
                                   [--watch-steps 1000] [--out DIR]

1. Files per rank per minute at each world size: real gloo jobs of
   ``tests/live_worker.py healthy`` on simulated nodes of ``--ranks-per-node`` ranks
   (LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK as torchrun sets them with ``--nnodes``),
   each rank's counters from its last record: writes to the shared run_dir, ``stat``
   calls of it, writes to the node's shared memory, and the watchdog thread's
   milliseconds in the live view's tick. The store calls of the live view
   are none (it holds no store); ``benchmarks/store_calls.py`` counts the rest.
2. The step time of a 4-rank job with and without ``guardrails top --once`` run every
   second against it, alternated twice (the loop's own step times, median).

Prints a table and writes ``DIR/live_cost.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from _ranks import base_env, launch  # noqa: E402

WORKER = ROOT / "tests" / "live_worker.py"


def run_job(out: Path, world: int, *, steps: int, per_node: int, watch: bool) -> dict:
    argv = [sys.executable, WORKER, "healthy", "--out", out, "--steps", str(steps)]
    argv += ["--step-sleep-s", "0.02", "--ranks-per-node", str(per_node)]
    job = launch(argv, world, out=out)
    polls = 0
    while watch and not job.poll():
        subprocess.run(
            [sys.executable, "-m", "guardrails", "top", "--once", str(out / "run")],
            capture_output=True,
            env=base_env(),
        )
        polls += 1
        time.sleep(1.0)
    results = job.wait(timeout_s=600)
    assert all(r.code == 0 for r in results), [r.out[-2000:] for r in results]
    step_times = [t for r in range(world) for t in json.loads((out / f"steps{r}.json").read_text())]
    records = {}
    for node in (out / "run" / "live").glob("node*.json"):
        records.update(json.loads(node.read_text())["ranks"])
    per_min = {}
    for key in ("shared_writes", "shared_stats", "local_writes", "busy_ms"):
        rates = [
            60 * rec["counts"][key] / (rec["time"] - rec["started"]) for rec in records.values()
        ]
        per_min[key] = round(statistics.mean(rates), 2)
    return {
        "world": world,
        "ranks_per_node": per_node,
        "watched": watch,
        "top_polls": polls,
        "ranks_reported": len(records),
        "per_rank_per_minute": per_min,
        "step_ms_median": round(1e3 * statistics.median(step_times), 2),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worlds", default="2,4,8")
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--watch-steps", type=int, default=1000, help="steps of the watched jobs")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="live_cost-"))
    files = []
    for world in map(int, args.worlds.split(",")):
        res = run_job(
            out / f"files-{world}",
            world,
            steps=args.steps,
            per_node=args.ranks_per_node,
            watch=False,
        )
        files.append(res)
        print(f"{world} ranks: per rank per minute {res['per_rank_per_minute']}", flush=True)
    steps = []
    for i, watch in enumerate([False, True, False, True]):
        res = run_job(out / f"watch-{i}", 4, steps=args.watch_steps, per_node=4, watch=watch)
        steps.append(res)
        print(
            f"4 ranks, watched={watch} ({res['top_polls']} top calls): "
            f"step {res['step_ms_median']} ms median",
            flush=True,
        )
    (out / "live_cost.json").write_text(json.dumps({"files": files, "steps": steps}, indent=2))
    print(f"wrote {out / 'live_cost.json'}")


if __name__ == "__main__":
    main()
