"""The node-local checkpoint tier against saving straight to the run directory: what a
save blocks, how long it takes to commit, how long the copy to the durable directory
takes behind it, and how long a SIGTERM's save takes to commit, in one process.

    python benchmarks/tier_bench.py --mb 300 --durable /tmp/tierbench --local /dev/shm/tierbench

For each mode (``durable``: ``local_directory=None``, today; ``local``: saves commit to
``--local`` and are drained to ``--durable``), a Linear model sized to ``--mb`` of
checkpoint (weights and AdamW's two moments) trains on CPU:

* ``periodic``: a background save every ``--every`` steps; reported: the median time
  the save blocked training (``blocking_times_s``: staging), the median time to its
  commit (``save_times_s``: where a restart can resume it), and, with the local tier,
  the median drain (``checkpoint_drained``'s seconds: when the durable copy is there).
* ``sigterm``: a real SIGTERM after a step, ``exit_on_signal=False``: the time from the
  signal to the loop's end (the agreement, the stop's save, its commit, and with the
  tier the drain within the grace period).

Each figure is the median of ``--repeats`` runs, the modes interleaved; the
directories are emptied between runs. The disk floor (the same bytes written by one
thread to ``--durable``, then fsync) is printed beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import guardrails


def build(mb: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A square Linear whose weights and AdamW moments are about ``mb`` MB."""
    side = int((mb * 1e6 / 12) ** 0.5)
    torch.manual_seed(0)
    model = nn.Linear(side, side, bias=False)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def floor_s(nbytes: int, where: Path) -> float:
    """One thread writing ``nbytes`` to ``where`` then fsync: the disk's floor."""
    where.mkdir(parents=True, exist_ok=True)
    path = where / "floor.bin"
    block = os.urandom(1 << 20) * 64
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            f.write(block[: min(left, len(block))])
            left -= len(block)
        f.flush()
        os.fsync(f.fileno())
    took = time.perf_counter() - t0
    path.unlink()
    return took


def one_run(args, local: Path | None, *, sigterm: bool) -> dict[str, float]:
    run_dir = Path(args.durable) / "run"
    for d in (run_dir, local):
        if d is not None:
            shutil.rmtree(d, ignore_errors=True)
    model, opt = build(args.mb)
    side = model.in_features
    data = [torch.randn(4, side) for _ in range(args.steps)]
    knobs = {
        "every_n_steps": None if sigterm else args.every,
        "local_directory": local,
        "exit_on_signal": False,
        "keep_last": 2,
        "strict_cadence": True,
    }
    signalled = 0.0
    with guardrails.guard(
        model, opt, data, run_dir=run_dir, checkpoint=knobs, progress=False, gc=False
    ) as g:
        for x in g:
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            if sigterm and g.step == args.steps // 2:
                signalled = time.perf_counter()
                os.kill(os.getpid(), signal.SIGTERM)
        ended = time.perf_counter()
        ck = g.component("checkpoint")
    from guardrails.metrics.events import read_events

    events = read_events(run_dir)
    drained = [e["seconds"] for e in events if e["kind"] == "checkpoint_drained"]
    only_local = [e for e in events if e["kind"] == "checkpoint_local_only"]
    out = {
        "blocking_s": statistics.median(ck.blocking_times_s),
        "commit_s": statistics.median(ck.save_times_s),
        "drain_s": statistics.median(drained) if drained else 0.0,
        "local_only": float(len(only_local)),
    }
    if sigterm:
        out["signal_to_end_s"] = ended - signalled
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=int, default=300, help="checkpoint size, MB")
    p.add_argument("--durable", default="/tmp/tierbench", help="the run directory's disk")
    p.add_argument("--local", default="/dev/shm/tierbench", help="the node-local directory")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(2)
    nbytes = build(args.mb)[0].weight.nelement() * 12
    floors = [floor_s(nbytes, Path(args.durable)) for _ in range(args.repeats)]
    print(
        f"checkpoint ~{nbytes / 1e6:.0f} MB; durable disk floor {statistics.median(floors):.3f} s"
    )
    # The modes interleaved, repeat by repeat: a shared machine's load falls on both.
    modes = [
        (m, loc, sig)
        for m, loc in (("durable", None), ("local", Path(args.local)))
        for sig in (False, True)
    ]
    rows: dict[tuple[str, bool], list[dict[str, float]]] = {(m, sig): [] for m, _, sig in modes}
    for _ in range(args.repeats):
        for mode, local, sigterm in modes:
            rows[mode, sigterm].append(one_run(args, local, sigterm=sigterm))
    for (mode, sigterm), got in rows.items():
        med = {k: round(statistics.median(r[k] for r in got), 3) for k in got[0]}
        print(f"{mode:8} {'sigterm' if sigterm else 'periodic':9} {json.dumps(med)}")
    for d in (Path(args.durable), Path(args.local)):
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
