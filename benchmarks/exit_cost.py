"""Where a process's last seconds go once a 10 GB signal save is written: the time
from the interpreter's exit to the process's end, with the pinned staging memory
held, freed first, or skipped by ``os._exit``; and the rates behind staging (pinning,
a device-to-host copy into pinned and into plain memory).

    python benchmarks/exit_cost.py --pinned-gb 10 --device-gb 40

Each mode runs in a child process that holds ``--device-gb`` of device memory (the
model, its optimizer and the allocator's cache) and, but for ``nopin``,
``--pinned-gb`` of pinned host memory in 1 GiB blocks (the checkpointer's staging):

* ``keep``: exits with the blocks held (what a stopped run does today);
* ``free``: frees the blocks first (``empty_host_cache``), timed, then exits;
* ``os_exit``: ``os._exit(0)`` with the blocks held (no interpreter finalization);
* ``nopin``: no pinned memory at all.

The parent times each child from its ``EXIT`` line (wall clock) to its end.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

GB = 1 << 30


def child(mode: str, pinned_gb: int, device_gb: int) -> None:
    import torch

    out: dict[str, float] = {}
    dev = torch.empty(device_gb * GB, dtype=torch.uint8, device="cuda")
    dev.fill_(1)
    torch.cuda.synchronize()
    blocks = []
    if mode != "nopin":
        t = time.perf_counter()
        blocks = [torch.empty(GB, dtype=torch.uint8, pin_memory=True) for _ in range(pinned_gb)]
        out["pin_s"] = time.perf_counter() - t
        t = time.perf_counter()
        for i, b in enumerate(blocks):
            b.copy_(dev[i * GB : (i + 1) * GB], non_blocking=True)
        torch.cuda.synchronize()
        out["d2h_pinned_s"] = time.perf_counter() - t
    if mode == "keep":  # the rates of the other ways to stage, once
        n = min(4, device_gb)
        t = time.perf_counter()
        fresh = torch.empty(n * GB, dtype=torch.uint8)
        fresh.copy_(dev[: n * GB])
        out[f"d2h_plain_fresh_{n}gb_s"] = time.perf_counter() - t
        t = time.perf_counter()
        fresh.copy_(dev[: n * GB])
        out[f"d2h_plain_touched_{n}gb_s"] = time.perf_counter() - t
        t = time.perf_counter()
        zeroed = torch.zeros(n * GB, dtype=torch.uint8)  # pages faulted by torch's threads
        zeroed.copy_(dev[: n * GB])
        out[f"d2h_plain_zeroed_{n}gb_s"] = time.perf_counter() - t
        del zeroed
        t = time.perf_counter()
        del fresh
        out[f"free_plain_{n}gb_s"] = time.perf_counter() - t
    if mode == "free":
        t = time.perf_counter()
        del blocks[:]
        empty = getattr(torch._C, "_host_emptyCache", None)
        if empty is None:
            torch.accelerator.empty_host_cache()
        else:
            empty()
        out["free_pinned_s"] = time.perf_counter() - t
    print("RESULT " + json.dumps(out), flush=True)
    print(f"EXIT {time.time():.6f}", flush=True)
    if mode == "os_exit":
        os._exit(0)
    sys.exit(0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pinned-gb", type=int, default=10)
    p.add_argument("--device-gb", type=int, default=40)
    p.add_argument("--modes", default="keep,free,os_exit,nopin")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        child(a.child, a.pinned_gb, a.device_gb)
        return
    for mode in a.modes.split(","):
        cmd = [sys.executable, __file__, "--child", mode]
        cmd += ["--pinned-gb", str(a.pinned_gb), "--device-gb", str(a.device_gb)]
        started = time.time()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        result, exit_at = {}, None
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("RESULT "):
                result = json.loads(line.split(" ", 1)[1])
            elif line.startswith("EXIT "):
                exit_at = float(line.split()[1])
        proc.wait()
        ended = time.time()
        result = {k: round(v, 3) for k, v in result.items()}
        to_end = None if exit_at is None else round(ended - exit_at, 3)
        print(
            f"exit_cost {mode}: exit -> end {to_end} s, whole child {ended - started:.1f} s, "
            f"{result}",
            flush=True,
        )


if __name__ == "__main__":
    main()
