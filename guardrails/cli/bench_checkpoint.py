"""``guardrails bench --checkpoint``: how fast a checkpoint saves on *your* disk, against
what the disk itself does with the same bytes.

    guardrails bench --checkpoint --dir /path/where/checkpoints/go --checkpoint-gb 4

A launcher's SIGKILL comes 30 s after its SIGTERM (torchrun, SLURM, Kubernetes): the
signal save must fit. This writes a synthetic state of ``--checkpoint-gb`` GB (on the GPU
when there is one, so the device-to-host copy is part of it) through the same path the
guard's saves take, and reports staging, writing (hashed on the way), fsync and the
total, beside the **disk floor**: the same number of bytes written from one buffer by 1
and by 8 threads, then fsynced. Rough rule: a save takes ~1.1-1.3x the floor plus the
device-to-host copy (measured on H100 and H200 hosts).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

#: The floor writes from one buffer of this size, like the saves' pieces.
_BUF = 64 << 20


def disk_floor(directory: Path, nbytes: int, threads: int) -> dict[str, float]:
    """Seconds to write ``nbytes`` into a new file under ``directory`` with ``threads``
    threads (pwrite of disjoint 64 MiB ranges from one buffer), then to fsync it."""
    buf = os.urandom(_BUF)
    path = directory / f".guardrails-floor-{threads}.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    offsets = list(range(0, nbytes, _BUF))
    try:
        t0 = time.perf_counter()

        def work(i: int) -> None:
            for off in offsets[i::threads]:
                os.pwrite(fd, buf[: min(_BUF, nbytes - off)], off)

        pool = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        t1 = time.perf_counter()
        os.fsync(fd)
        t2 = time.perf_counter()
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    total = t2 - t0
    return {"write_s": t1 - t0, "fsync_s": t2 - t1, "total_s": total, "GBps": nbytes / total / 1e9}


def save_throughput(directory: Path, nbytes: int, device: Any) -> dict[str, float]:
    """Stage and write ``nbytes`` of tensors on ``device`` the way a guard's save does
    (pinned staging on a GPU, files hashed as written, fsynced)."""
    import torch

    from guardrails.checkpoint import stage

    n_tensors = 16
    per = max(1, nbytes // n_tensors // 4)
    tensors = {f"t{i}": torch.randn(per, device=device) for i in range(n_tensors)}
    tmp = Path(tempfile.mkdtemp(prefix=".guardrails-bench-", dir=directory))
    try:
        t0 = time.perf_counter()
        part = stage.Part(stage.Staging() if device.type == "cuda" else None)
        part.add_tensors("state.safetensors", tensors, copy=True)
        part.ready()
        stage_s = time.perf_counter() - t0
        files: dict[str, Any] = {}
        part.write(tmp, files)
        total = time.perf_counter() - t0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    size = files["state.safetensors"]["bytes"]
    return {
        "bytes": size,
        "stage_s": stage_s,
        "write_s": part.write_s,
        "fsync_s": part.fsync_s,
        "total_s": total,
        "GBps": size / total / 1e9,
    }


def main(directory: Path, gigabytes: float, device: Any) -> str:
    """The report ``guardrails bench --checkpoint`` prints."""
    nbytes = int(gigabytes * 1e9)
    directory.mkdir(parents=True, exist_ok=True)
    one = disk_floor(directory, nbytes, 1)
    eight = disk_floor(directory, nbytes, 8)
    save = save_throughput(directory, nbytes, device)
    floor = min(one["total_s"], eight["total_s"])
    return "\n".join(
        [
            f"checkpoint save on {directory} ({save['bytes'] / 1e9:.2f} GB from {device}):",
            f"  disk floor, 1 thread   {one['total_s']:7.2f} s  ({one['GBps']:.2f} GB/s; "
            f"fsync {one['fsync_s']:.2f} s)",
            f"  disk floor, 8 threads  {eight['total_s']:7.2f} s  ({eight['GBps']:.2f} GB/s)",
            f"  guardrails save        {save['total_s']:7.2f} s  ({save['GBps']:.2f} GB/s: "
            f"stage {save['stage_s']:.2f}, write+hash {save['write_s']:.2f}, "
            f"fsync {save['fsync_s']:.2f}) = {save['total_s'] / floor:.2f}x the floor",
            f"  a state of N GB saves in about {save['total_s'] / (save['bytes'] / 1e9):.2f} "
            "x N s here: keep it under ~80% of the launcher's grace period (30 s for "
            "torchrun and SLURM), or checkpoint to a faster disk.",
        ]
    )
