"""What pinning a periodic save's staging memory costs the training thread (issue 50):
after a resume at 0.835B the first step took 5.9 s against 2.4 s for a run's first step
(2x H200), while the staging of the whole 10 GB state was pinned in the background.
``cudaHostAlloc`` (torch's ``pin_memory=True``) takes the CUDA driver's lock, which the
training thread's kernel launches wait for.

    python benchmarks/pin_stall.py [--gb 10] [--block-mb 300]

The main thread launches small kernels (a sync every 256) for as long as a background
thread prepares ``--gb`` GB in ``--block-mb`` MB blocks, one way at a time; printed per
way: the background's seconds, and the launches the main thread made in that time
against the same time with nothing in the background (``kept``: their ratio), and its
longest wait for one launch:
- ``pinned``: ``torch.empty(..., pin_memory=True)`` (the staging's way)
- ``registered``: plain memory faulted in by 8 threads, then ``cudaHostRegister``
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import torch


def launch_until(stop: threading.Event, x: torch.Tensor) -> tuple[int, float]:
    n, longest, last = 0, 0.0, time.perf_counter()
    while not stop.is_set():
        x.add_(1)
        n += 1
        if n % 256 == 0:
            torch.cuda.synchronize()
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
    return n, longest


def pinned(nbytes: int, block: int) -> list[torch.Tensor]:
    return [
        torch.empty(min(block, nbytes - o), dtype=torch.uint8, pin_memory=True)
        for o in range(0, nbytes, block)
    ]


def registered(nbytes: int, block: int) -> list[torch.Tensor]:
    out = []
    cudart = torch.cuda.cudart()
    for o in range(0, nbytes, block):
        n = min(block, nbytes - o)
        t = torch.empty(n, dtype=torch.uint8)
        pieces = [t[i : i + n // 8 + 1] for i in range(0, n, n // 8 + 1)]
        run = [threading.Thread(target=p.zero_) for p in pieces]
        for r in run:
            r.start()
        for r in run:
            r.join()
        err = cudart.cudaHostRegister(t.data_ptr(), n, 0)
        assert int(err) == 0, err
        out.append(t)
    return out


def unregister(blocks: list[torch.Tensor]) -> None:
    for t in blocks:
        torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gb", type=float, default=10.0)
    p.add_argument("--block-mb", type=int, default=300)
    a = p.parse_args()
    torch.set_num_threads(1)  # as torchrun sets it for several workers a node
    nbytes, block = int(a.gb * 1e9), a.block_mb << 20
    x = torch.zeros(1 << 18, device="cuda")
    for way, fn in (("pinned", pinned), ("registered", registered)):
        got: list = []
        stop = threading.Event()

        def background(fn=fn, got=got, stop=stop) -> None:
            t0 = time.perf_counter()
            got.append(fn(nbytes, block))
            got.append(time.perf_counter() - t0)
            stop.set()

        worker = threading.Thread(target=background)
        worker.start()
        n, longest = launch_until(stop, x)
        worker.join()
        seconds = got[1]
        base_stop = threading.Event()
        threading.Timer(seconds, base_stop.set).start()
        base, base_longest = launch_until(base_stop, x)
        print(
            json.dumps(
                {
                    "way": way,
                    "GB": round(nbytes / 1e9, 2),
                    "seconds": round(seconds, 3),
                    "launches": n,
                    "launches_alone": base,
                    "kept": round(n / base, 3),
                    "longest_wait_s": round(longest, 3),
                    "longest_wait_alone_s": round(base_longest, 4),
                }
            )
        )
        if way == "registered":
            unregister(got[0])
        del got


if __name__ == "__main__":
    main()
