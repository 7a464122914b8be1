"""NanGuard's spike rule: false spikes on recorded runs, and its host cost per block.

    python benchmarks/spike_rule.py RUN_DIR/metrics.parquet ...   # replay recorded runs
    python benchmarks/spike_rule.py --time                        # cost of _judge

Replay: each rank's (loss, grad norm) rows of a run's ``metrics.parquet`` go through
the rule NanGuard runs now (``_spikes`` with the run's scale, in blocks of ``check_every_n_steps``
as ``_judge`` does) and through the rule it ran before (5x / 4x the median of the last
100 finite values); the spike counts of both are printed per rank and metric. Telemetry
records each rank's own grad norm, so where the ranks' gradients differ at ``step()``
this replays a rank-local judgement (the guard judges the ranks' combined norm).

``--time``: the host cost of ``NanGuard._judge`` on one block of 10 finite rows with full
100-step windows (median of ``--repeats`` runs of ``--n`` blocks), against the old rule's
one median per metric. See benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections import deque
from pathlib import Path

from guardrails.guards.nan.spikes import SCALE_SHARE, _Series, _spikes

FACTORS = {"grad_norm": 5.0, "loss": 4.0}


def old_rule(values: list[float], factor: float, block: int, window: int) -> list[int]:
    """Indices over ``factor`` x the median of the last ``window`` finite values
    (guardrails 0.2.0 before issue 15), judged in blocks as _judge did."""
    seen: deque[float] = deque(maxlen=window)
    out = []
    for b in range(0, len(values), block):
        rows = values[b : b + block]
        if len(seen) >= 20:
            median = sorted(seen)[len(seen) // 2]
            if median > 0:
                out += [b + i for i, v in enumerate(rows) if v > factor * median]
        seen.extend(v for v in rows if v == v)
    return out


def new_rule(
    values: list[float], factor: float, block: int, window: int, share: float = 0.0
) -> list[int]:
    """NanGuard's rule: ``share`` of the run's scale is the least spike (SCALE_SHARE)."""
    seen = _Series(window, share)
    out = []
    for b in range(0, len(values), block):
        rows = values[b : b + block]
        out += [b + i for i, _, _ in _spikes(seen.values, rows, factor, seen.swing, seen.floor())]
        seen.extend([v for v in rows if -math.inf < v < math.inf])
    return out


def replay(paths: list[str], block: int, window: int) -> None:
    import pyarrow.parquet as pq

    for path in paths:
        cols = pq.read_table(path).to_pydict()
        ranks = cols.get("rank") or [0] * len(cols["step"])
        for rank in sorted(set(ranks)):
            mine = [i for i, r in enumerate(ranks) if r == rank and not cols["skipped"][i]]
            steps = [cols["step"][i] for i in mine]
            for metric, factor in FACTORS.items():
                values = [float(cols[metric][i]) for i in mine]
                old = old_rule(values, factor, block, window)
                new = new_rule(values, factor, block, window, SCALE_SHARE[metric])
                print(
                    f"{path} rank {rank} {metric}: {len(values)} steps, old rule "
                    f"{len(old)} spikes {[steps[i] for i in old][:8]}, new rule {len(new)} "
                    f"{[steps[i] for i in new][:8]}"
                )


def time_judge(n: int, repeats: int) -> None:
    import random

    import torch

    import guardrails
    from guardrails import NanGuard

    random.seed(0)
    model = torch.nn.Linear(4, 1)
    g = guardrails.guard(model, torch.optim.SGD(model.parameters(), lr=0.1)).start()
    nan = next(c for c in g.components if isinstance(c, NanGuard))
    # Healthy-looking values: a grad norm with ~30% step-to-step noise, a loss near 2.
    rows = [
        (i, 2.0 + random.random() * 0.1, math.exp(random.gauss(0, 0.3)), 1e-3)
        for i in range(nan.window_steps + 10)
    ]
    nan._unjudged = rows[: nan.window_steps]
    nan._judge()  # fills the windows (and the health check's first window)
    block = rows[-10:]

    def judge() -> None:
        nan._unjudged = list(block)
        nan._judge()

    norms = nan._spike_judge.norms.values

    def old_medians() -> None:  # the old rule's per-block work: one median per metric
        for window in (norms, nan._spike_judge.losses.values):
            median = sorted(window)[len(window) // 2]
            for row in block:
                _ = row[2] > 5 * median

    for name, fn in (
        ("_judge, 10 rows (new rule + health)", judge),
        ("_spikes, one metric", lambda: _spikes(norms, [r[2] for r in block], 5.0)),
        ("old rule's medians, both metrics", old_medians),
    ):
        fn()
        out = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            out.append((time.perf_counter() - t0) / n)
        print(f"{name}: {statistics.median(out) * 1e6:.1f} us per block")
    assert not nan.spikes, nan.spikes
    g.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("metrics", nargs="*", help="metrics.parquet files to replay")
    p.add_argument("--time", action="store_true", help="time _judge per block")
    p.add_argument("--block", type=int, default=10, help="check_every_n_steps")
    p.add_argument("--window", type=int, default=100, help="window_steps")
    p.add_argument("--n", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    if not args.metrics and not args.time:
        p.error("give metrics.parquet files, --time, or both")
    if args.metrics:
        missing = [m for m in args.metrics if not Path(m).exists()]
        if missing:
            sys.exit(f"not found: {missing}")
        replay(args.metrics, args.block, args.window)
    if args.time:
        time_judge(args.n, args.repeats)


if __name__ == "__main__":
    main()
