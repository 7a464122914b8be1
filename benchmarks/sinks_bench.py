"""What the metric sinks (guard(log_to=...)) cost, and where.

    python benchmarks/sinks_bench.py [--rows 2000] [--steps 3000] [--rounds 3]
        [--device cuda] [--width 8] [--batch 8] [--sinks tensorboard,wandb,mlflow]

1. The training thread, once per parquet part: ``SinkRunner.deliver`` (a queue put)
   plus reading the events written since the last part. Never per step.
2. The sink thread, per row: each built-in sink's ``write`` of a real metrics table
   (TensorBoard's event file, W&B offline, MLflow's file store).
3. End to end, an MLP (by default tiny: host-bound, the worst case for any host work)
   under guard(), without sinks and with them at the harshest cadence (a part every
   interval of 50 steps, ``write_every_s=0``), alternating which runs first; us/step.

Sinks whose package is missing are left out (said in the output).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import guardrails
from guardrails.metrics.events import EventLog
from guardrails.metrics.sinks import EventTail, SinkRunner

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("WANDB_CONSOLE", "off")
os.environ.setdefault("WANDB_DISABLE_GIT", "true")
os.environ.setdefault("WANDB_DISABLE_CODE", "true")
os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")


def available(wanted: list[str]) -> list[str]:
    have = [n for n in wanted if importlib.util.find_spec(n)]
    missing = sorted(set(wanted) - set(have))
    if missing:
        print(f"left out (not installed): {', '.join(missing)}")
    return have


def loop(run_dir: Path, steps: int, log_to, args) -> float:
    """Seconds per step of a guarded MLP loop (the first 50 steps left out)."""
    from conftest import Regressor, batches

    torch.manual_seed(0)
    dev = torch.device(args.device)
    model = Regressor(width=args.width).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = [(x.to(dev), y.to(dev)) for x, y in batches(steps + 50, batch=args.batch)]
    with guardrails.guard(
        model,
        opt,
        data,
        run_dir=run_dir,
        progress=False,
        log_to=log_to,
        metrics={"every_n_steps": 50, "write_every_s": 0},
    ) as g:
        for x, y in g:
            if g.step == 50:
                t0 = time.perf_counter()
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
    return elapsed / steps


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=2000)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--width", type=int, default=8)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--sinks", default="tensorboard,wandb,mlflow")
    args = p.parse_args()
    names = available(args.sinks.split(","))
    tmp = Path(tempfile.mkdtemp(prefix="sinks-bench-"))
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"file:{tmp / 'mlruns'}")
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "no GPU"
    print(
        f"torch {torch.__version__}, python {sys.version.split()[0]}, {os.cpu_count()} cpus, {gpu}"
    )
    print(f"model: MLP width {args.width}, batch {args.batch}, on {args.device}")

    # A real table: a guarded run's rows.
    loop(tmp / "source", args.rows, None, args)
    table = guardrails.read_metrics(tmp / "source")
    print(f"table: {table.num_rows} rows")

    # 1. The training thread's share, per part.
    run_dir = tmp / "deliver"
    run_dir.mkdir()
    log = EventLog(run_dir, rank=0)
    tail = EventTail(log.path, 0)
    runner = SinkRunner([lambda rows: None], run_dir)
    part = table.slice(0, 50)
    times = []
    for i in range(2000):
        if i % 100 == 0:
            log.emit("custom", step=i, message="an event now and then")
        t0 = time.perf_counter()
        runner.deliver(part, tail.read())
        times.append(time.perf_counter() - t0)
    runner.close(30)
    median_us = statistics.median(times) * 1e6
    print(f"training thread, per part (deliver + read events): {median_us:.1f} us median")

    # 2. The sink thread's share, per row.
    for name in names:
        sink = guardrails.metrics.sinks.build([name])[0]
        sink.open(tmp / f"write-{name}")
        per = []
        for k in range(3):
            part = table.slice(k * (table.num_rows // 3), table.num_rows // 3)
            t0 = time.perf_counter()
            sink.write(part)
            per.append((time.perf_counter() - t0) / part.num_rows)
        sink.close()
        print(f"sink thread, {name}.write: {statistics.median(per) * 1e6:.0f} us per row")

    # 3. End to end, alternating.
    if not args.rounds:
        return
    plain, sinks = [], []
    for r in range(args.rounds):
        order = [(plain, None), (sinks, names)] if r % 2 == 0 else [(sinks, names), (plain, None)]
        for out, log_to in order:
            run_dir = tmp / f"e2e-{r}-{bool(log_to)}"
            out.append(loop(run_dir, args.steps, log_to or None, args) * 1e6)
    print(f"end to end, us/step without sinks: {', '.join(f'{v:.1f}' for v in plain)}")
    print(f"end to end, us/step with {names}: {', '.join(f'{v:.1f}' for v in sinks)}")
    diff = statistics.median(s - p for s, p in zip(sinks, plain, strict=True))
    print(f"paired median difference: {diff:+.1f} us/step")


if __name__ == "__main__":
    main()
