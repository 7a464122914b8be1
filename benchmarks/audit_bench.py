"""Per-collective host overhead of the CollectiveAuditor, against the same loop
unaudited and against ``TORCH_DISTRIBUTED_DEBUG=DETAIL``, in one run.

    python benchmarks/audit_bench.py --out /tmp/audit                  # CPU, gloo, 2 ranks
    python benchmarks/audit_bench.py --backend nccl --out /tmp/audit   # 2 GPUs, NCCL

Three measurements, each over ``--rounds`` interleaved rounds (plain, audited, DETAIL,
plain, ...) so drift of a shared machine hits every mode alike; medians reported:

* ``wrapper``: the auditor's own host work per call, isolated: its interception wrapper
  around a function that does nothing, minus calling that function directly. This is
  what the auditor adds to every collective on the calling thread, whatever the backend.
  ``background``: what each call later costs the auditor's thread (hashing it into the
  rolling hash), which shares the GIL with the training loop.
* ``loop``: a tight loop of ``--calls`` blocking ``all_reduce`` of ``--numel`` float32
  elements (default 1: latency-bound, the worst case for a fixed per-call cost), per
  call (median over chunks of 100 calls), for: ``plain`` (no guard), ``audited`` (a
  started Guard with the auditor, background thread running) and ``detail`` (a process
  group created under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``, which checks every collective
  with an extra one). On a loaded machine this loop's noise (+-100 us per call seen on
  2 shared cores) hides a few microseconds: read ``wrapper`` for the auditor's own cost.
* ``step`` (``--backend nccl`` only, or ``--steps``): a training-like step of
  ``--per-step`` all-reduces of ``--bucket-numel`` elements (DDP-bucket-sized) plus a
  synchronize, per step, for the same three modes: the step-time overhead.

Rank 0 prints a table and writes ``audit_bench.json`` (with the machine, torch version
and date) under ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import guardrails
from guardrails.guards.audit.calls import OPS


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _guard(device: torch.device, run_dir: str) -> guardrails.Guard:
    model = torch.nn.Linear(2, 2).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return guardrails.Guard(
        model, opt, run_dir=run_dir, components=[guardrails.CollectiveAuditor()]
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _loop_us(calls: int, t: torch.Tensor, group: Any, device: torch.device) -> float:
    """Per-call time: the median over chunks of 100 calls, so that a preemption of one
    rank by another process (both ranks wait for the slower) hits one chunk, not all."""
    all_reduce = dist.all_reduce  # looked up once: the patched one when audited
    chunk = min(100, calls)
    per_call = []
    for _ in range(max(1, calls // chunk)):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(chunk):
            all_reduce(t, group=group)
        _sync(device)
        per_call.append((time.perf_counter() - t0) / chunk * 1e6)
    return statistics.median(per_call)


def _step_ms(
    steps: int, per_step: int, buf: torch.Tensor, group: Any, device: torch.device
) -> float:
    all_reduce = dist.all_reduce
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        for _ in range(per_step):
            all_reduce(buf, group=group)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _wrapper_us(auditor: guardrails.CollectiveAuditor, n: int = 20000) -> tuple[float, float]:
    """The auditor's work per call: on the calling thread (its wrapper around a no-op,
    minus the no-op), and on its background thread (folding the queued entries into
    the rolling hash). The background thread is stopped first so that it does not
    share the GIL with the timed loop; the queue is then drained here, timed."""
    auditor._stop.set()
    if auditor._thread is not None:
        auditor._thread.join()
    auditor._drain()

    def noop(*args: Any, **kwargs: Any) -> None:
        return None

    wrapped = auditor._wrap("all_reduce", noop, OPS["all_reduce"])
    t = torch.ones(1)
    best = []
    for fn in (noop, wrapped, noop, wrapped):
        t0 = time.perf_counter()
        for _ in range(n):
            fn(t)
        best.append((time.perf_counter() - t0) / n * 1e6)
    queued = len(auditor._queue)
    t0 = time.perf_counter()
    auditor._drain()
    drain_us = (time.perf_counter() - t0) / max(1, queued) * 1e6
    return min(best[1], best[3]) - min(best[0], best[2]), drain_us


def worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    use_cuda = args.backend == "nccl"
    if use_cuda:
        torch.cuda.set_device(rank)
    device = torch.device(f"cuda:{rank}" if use_cuda else "cpu")
    dist.init_process_group(args.backend, rank=rank, world_size=world)
    # DETAIL applies to process groups created after the debug level is set: a second
    # group over the same ranks, wrapped by torch in its ProcessGroupWrapper at creation
    # (distributed_c10d._new_process_group_helper, "Process group wrapper initialization
    # for supported PGs when TORCH_DISTRIBUTED_DEBUG is set"), whose every collective is
    # "communication_op in origin_backend + runCollectiveChecks in gloo": a fingerprint
    # exchange and a monitoredBarrier (pytorch/pytorch#124447's description).
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    dist.set_debug_level_from_env()
    detail_group = dist.new_group(backend=args.backend)
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "OFF"
    dist.set_debug_level_from_env()

    small = torch.ones(args.numel, device=device)
    bucket = torch.ones(args.bucket_numel, device=device)
    steps = args.steps if args.steps else (20 if use_cuda else 0)
    run_dir = tempfile.mkdtemp(prefix="audit_bench_")
    rows: dict[str, list[float]] = {}
    for _ in range(args.warmup):
        _loop_us(args.calls // 10 or 1, small, None, device)
    for _ in range(args.rounds):
        for mode in ("plain", "audited", "detail"):
            group = detail_group if mode == "detail" else None
            g = _guard(device, run_dir) if mode == "audited" else None
            if g is not None:
                g.start()
            try:
                rows.setdefault(f"loop/{mode}", []).append(
                    _loop_us(args.calls, small, group, device)
                )
                if steps:
                    rows.setdefault(f"step/{mode}", []).append(
                        _step_ms(steps, args.per_step, bucket, group, device)
                    )
                if g is not None:  # last: it stops the auditor's thread
                    main_us, thread_us = _wrapper_us(g.auditor)
                    rows.setdefault("wrapper", []).append(main_us)
                    rows.setdefault("background", []).append(thread_us)
            finally:
                if g is not None:
                    g.close()
    dist.barrier()
    if rank == 0:
        _report(rows, args, world, device)
    dist.destroy_process_group()


def _report(
    rows: dict[str, list[float]], args: argparse.Namespace, world: int, device: Any
) -> None:
    med = {k: statistics.median(v) for k, v in rows.items()}
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "cpu": _cpu_name(),
        "cpus": os.cpu_count(),
        "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else None,
        "backend": args.backend,
        "world": world,
        "args": vars(args),
        "median": med,
        "rounds": rows,
    }
    plain = med["loop/plain"]
    print(
        f"\nCollectiveAuditor overhead, {args.backend}, {world} ranks, torch {torch.__version__}"
        f", {result['gpu'] or result['cpu']}"
    )
    print(f"  auditor per call, calling thread (isolated): {med['wrapper']:.2f} us")
    print(f"  auditor per call, its background thread:     {med['background']:.2f} us")
    print(f"  all_reduce of {args.numel} float32, {args.calls} calls x {args.rounds} rounds:")
    print(f"    {'mode':10s} {'us/call':>9s} {'overhead':>10s}")
    for mode in ("plain", "audited", "detail"):
        v = med[f"loop/{mode}"]
        print(f"    {mode:10s} {v:9.1f} {v - plain:+9.1f}us ({(v / plain - 1) * 100:+.1f}%)")
    if "step/plain" in med:
        base = med["step/plain"]
        print(
            f"  step of {args.per_step} all_reduce x {args.bucket_numel} float32 + sync "
            f"(median of {args.steps or 20}):"
        )
        for mode in ("plain", "audited", "detail"):
            v = med[f"step/{mode}"]
            print(f"    {mode:10s} {v:9.3f} ms ({(v / base - 1) * 100:+.2f}%)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "audit_bench.json").write_text(json.dumps(result, indent=1))
    print(f"  -> {out / 'audit_bench.json'}")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", required=True, help="directory for audit_bench.json")
    p.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--calls", type=int, default=2000, help="all_reduces per round (loop)")
    p.add_argument("--numel", type=int, default=1, help="elements per loop all_reduce")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=0, help="steps per round (default: 20 on nccl)")
    p.add_argument("--per-step", type=int, default=20, help="all_reduces per step")
    p.add_argument("--bucket-numel", type=int, default=25 * 2**20 // 4, help="25 MB buckets")
    args = p.parse_args(argv)
    if args.backend == "nccl" and torch.cuda.device_count() < args.world:
        p.error(f"--backend nccl needs {args.world} GPUs, found {torch.cuda.device_count()}")
    mp.spawn(worker, args=(args.world, _free_port(), args), nprocs=args.world)


if __name__ == "__main__":
    main()
