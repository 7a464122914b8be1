"""Can a thread copy a rank's state off a GPU whose NCCL all-reduce is stuck? (issue 50)

Two ranks over NCCL, a GPU each. Rank 1 never joins the second all-reduce; rank 0 is
left with that all-reduce's kernel spinning on its NCCL stream and an update (``add_``
on every tensor) queued behind it on the default stream, as a DDP rank whose peer hung.
A thread of rank 0 then copies ``--gb`` GB of tensors to host memory the way a failure
save does (``stage.Part`` with ``plain`` memory, on a stream of ``stage.SideStreams``),
or a raw way (``--how``), and says how long each part took; after ``--limit-s`` it
prints the Python stacks and, where ``gdb`` exists, the native stack of every thread.

    python benchmarks/gpu_stuck_copy.py --gb 10 --how part     # 2 GPUs
    CUDA_MODULE_LOADING=EAGER python benchmarks/gpu_stuck_copy.py --gb 10
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def say(rank: int, what: str, t0: float) -> None:
    os.write(1, f"[rank {rank} +{time.perf_counter() - t0:7.3f} s] {what}\n".encode())


def dump_stacks(out: Any = None) -> None:
    """Every thread of this process: its Python stack, its kernel stack and wait channel
    (``/proc``, as root), and its native stack where ``gdb`` exists."""
    out = out or sys.stdout
    out.flush()
    faulthandler.dump_traceback(file=out, all_threads=True)
    for task in sorted(Path("/proc/self/task").iterdir()):
        parts = []
        for name in ("comm", "wchan", "stack"):
            try:
                parts.append((task / name).read_text().strip())
            except OSError as e:
                parts.append(f"({name}: {e.strerror})")
        print(f"--- task {task.name}: " + " | ".join(parts), file=out, flush=True)
    gdb = shutil.which("gdb")
    if gdb is None:
        print("no gdb here: native stacks not taken", file=out, flush=True)
        return
    got = subprocess.run(
        [gdb, "-p", str(os.getpid()), "-batch", "-ex", "thread apply all bt 30"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    print(got.stdout[-30000:], file=out, flush=True)


def watch(limit_s: float, progress: Callable[[], object], out: Any = None) -> None:
    """Dump the stacks once (:func:`dump_stacks`) when ``progress()`` has not changed
    for ``limit_s``: a daemon thread."""

    def run() -> None:
        last, since = progress(), time.monotonic()
        while True:
            time.sleep(0.5)
            now = progress()
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since > limit_s:
                print(f"STACKS: no progress for {limit_s} s", file=out or sys.stdout, flush=True)
                dump_stacks(out)
                return

    threading.Thread(target=run, name="stack-watch", daemon=True).start()


def worker(rank: int, a: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port))
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=dev)
    from guardrails.checkpoint import stage

    t0 = time.perf_counter()
    # About a GPT's state: many tensors, a mix of bf16 and fp32, up to 200 MB each.
    n_tensors = max(1, int(a.gb * 1e9 // 100e6))
    each = int(a.gb * 1e9 / n_tensors)
    tensors = {
        f"t{i}": torch.randn(each // (2 if i % 2 else 4), device=dev).to(
            torch.bfloat16 if i % 2 else torch.float32
        )
        for i in range(n_tensors)
    }
    side = stage.SideStreams(dev)  # made ahead, as the failure save makes them
    x = torch.ones(1 << 20, device=dev)
    dist.all_reduce(x)
    torch.cuda.synchronize()
    say(rank, f"{n_tensors} tensors, {a.gb} GB, warm all-reduce done", t0)
    if rank == 1:
        time.sleep(a.limit_s + 60)  # never joins the next all-reduce
        os._exit(0)
    go, done = threading.Event(), threading.Event()
    launched = [0]
    watch(a.limit_s, lambda: (launched[0], done.is_set()))

    def copy() -> None:
        go.wait(3.0)  # the main thread's launches, or 3 s when they block
        t1 = time.perf_counter()
        say(rank, f"copying from a thread, {launched[0]} kernels launched", t0)
        stream = side.pick()
        found = f"picked a stream: {stream is not None}, {side.blocked} of {side.count} stuck"
        say(rank, found, t1)
        if stream is None:
            return
        with stage.own_stream(stream):
            if a.how == "part":
                part = stage.Part(plain=True)
                part.add_tensors("model.safetensors", tensors, copy=True)
                part.ready()
            elif a.how == "pinned":
                host = [t.to("cpu", non_blocking=True) for t in tensors.values()]
                torch.cuda.current_stream().synchronize()
                del host
            else:  # "one": a single tensor, the smallest case
                next(iter(tensors.values())).cpu()
        say(rank, f"COPIED {a.gb} GB ({a.how}) in {time.perf_counter() - t1:.3f} s", t0)
        done.set()

    threading.Thread(target=copy, daemon=True).start()
    dist.all_reduce(x)  # stuck: rank 1 never comes
    say(rank, "the stuck all-reduce is queued", t0)
    for t in tensors.values():  # the update, queued behind it
        t.add_(1)
        launched[0] += 1
    # Then a step's worth of kernels and more (a 27-layer GPT's forward and backward
    # launch thousands): a hardware queue holds about so many before a launch blocks.
    small = torch.ones(16, device=dev)
    for _ in range(a.queue):
        small.mul_(1.0001)
        launched[0] += 1
    say(rank, f"{launched[0]} kernels queued behind it", t0)
    go.set()
    done.wait(a.limit_s + 5)
    time.sleep(1.0)
    os._exit(0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, default=10.0)
    p.add_argument("--how", choices=("part", "pinned", "one"), default="part")
    p.add_argument("--limit-s", type=float, default=30.0)
    p.add_argument("--queue", type=int, default=0, help="kernels queued after the update")
    p.add_argument("--port", type=int, default=29611)
    a = p.parse_args()
    env = {
        k: os.environ.get(k, "(default)")
        for k in ("CUDA_MODULE_LOADING", "CUDA_DEVICE_MAX_CONNECTIONS")
    }
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, {env}", flush=True)
    mp.start_processes(worker, args=(a,), nprocs=2, start_method="spawn", join=True)


if __name__ == "__main__":
    main()
