"""How fast a failure save's committer other than rank 0 gets 10 GB of replicated state
off its GPU into host memory it can write from (issue 50). A rank that stages no
weights for periodic saves has no pinned staging, and it may not pin memory at failure
time (a page-locked allocation waits for all the work queued on the device, which may
be stuck). On the 2x H200 recovery run the stuck rank's save of the replicated state
took 11.8 s where a periodic save of the same state writes in 4.5 s.

    python benchmarks/stage_plain.py [--gb 10] [--dir /tmp/stage_plain] [--torch-threads 1]

``--torch-threads``: torch's intra-op threads (1: as torchrun sets ``OMP_NUM_THREADS``
for each of several workers per node).

Prints one JSON line per way (seconds, GB/s), each from the same GPU tensors:
- ``zeros``: the plain buffer alone (``torch.zeros``: pages faulted in by torch's threads)
- ``plain``: ``stage.Part(plain=True).ready()``, as a failure save stages (its memory
  faulted in by ``stage.fresh_memory``'s threads)
- ``serial``: zeros, then one synchronous pageable copy per tensor (the way before)
- ``threads4``: zeros, then the copies from 4 threads, a stream each
- ``bounced``: through 4 pinned buffers of 64 MB made ahead, into plain memory
- ``write``: writing the staged part (hashed, fsynced) into ``--dir``
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from guardrails.checkpoint import stage


def tensors(gb: float, device: torch.device) -> dict[str, torch.Tensor]:
    """About ``gb`` GB as a 0.835B GPT's model and AdamW state are: fp32, two large
    (embedding, head: 50304 x 1536) and many 1536-wide matrices."""
    out: dict[str, torch.Tensor] = {}
    total = 0
    shapes = [(50304, 1536)] * 2 + [(1536, 1536 * 4), (1536 * 4, 1536), (1536 * 3, 1536)] * 400
    for shape in shapes:
        if total >= gb * 1e9:
            break
        out[f"t{len(out)}"] = torch.randn(shape, device=device)
        total += out[f"t{len(out) - 1}"].nbytes
    return out


def into_zeros(src: list[torch.Tensor], threads: int) -> list[torch.Tensor]:
    sizes = [-(-t.nbytes // 64) * 64 for t in src]
    plain = torch.zeros(sum(sizes), dtype=torch.uint8)
    dst, offset = [], 0
    for t, size in zip(src, sizes, strict=True):
        dst.append(plain[offset : offset + t.nbytes].view(t.dtype).view(t.shape))
        offset += size
    if threads == 1:
        for d, s in zip(dst, src, strict=True):
            d.copy_(s)
        return dst
    streams = [torch.cuda.Stream() for _ in range(threads)]

    def run(i: int) -> None:
        with torch.cuda.stream(streams[i]):
            for d, s in list(zip(dst, src, strict=True))[i::threads]:
                d.copy_(s)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(run, range(threads)))
    return dst


def into_bounced(src: list[torch.Tensor], bufs: list[torch.Tensor]) -> torch.Tensor:
    """Through pinned buffers made ahead: each piece copied off the GPU at full speed,
    then into plain memory by a thread while the next piece comes."""
    total = sum(t.nbytes for t in src)
    plain = torch.empty(total, dtype=torch.uint8)
    stream = torch.cuda.Stream()
    events = [torch.cuda.Event() for _ in bufs]
    pending: list = [None] * len(bufs)
    chunk = bufs[0].numel()
    i = offset = 0

    def land(k: int, at: int, n: int) -> None:
        events[k].synchronize()
        plain[at : at + n].copy_(bufs[k][:n])

    with ThreadPoolExecutor(len(bufs)) as pool:
        for t in src:
            flat = t.reshape(-1).view(torch.uint8)
            for o in range(0, flat.numel(), chunk):
                n = min(chunk, flat.numel() - o)
                k = i % len(bufs)
                if pending[k] is not None:
                    pending[k].result()
                with torch.cuda.stream(stream):
                    bufs[k][:n].copy_(flat[o : o + n], non_blocking=True)
                    events[k].record(stream)
                pending[k] = pool.submit(land, k, offset, n)
                offset += n
                i += 1
        for f in pending:
            if f is not None:
                f.result()
    return plain


def timed(name: str, gb: float, fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    got = fn()
    torch.cuda.synchronize()
    s = time.perf_counter() - t0
    print(json.dumps({"way": name, "seconds": round(s, 3), "GB_per_s": round(gb / s, 2)}))
    return got


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gb", type=float, default=10.0)
    p.add_argument("--dir", type=Path, default=Path("/tmp/stage_plain"))
    p.add_argument("--torch-threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.torch_threads)
    src = tensors(a.gb, torch.device("cuda"))
    gb = sum(t.nbytes for t in src.values()) / 1e9
    name = torch.cuda.get_device_name()
    print(
        json.dumps(
            {
                "tensors": len(src),
                "GB": round(gb, 2),
                "device": name,
                "torch_threads": a.torch_threads,
            }
        )
    )
    timed("zeros", gb, lambda: torch.zeros(int(gb * 1e9), dtype=torch.uint8))
    for way, threads in (("serial", 1), ("threads4", 4)):
        got = timed(way, gb, lambda threads=threads: into_zeros(list(src.values()), threads))
        assert all(torch.equal(s.cpu(), g) for s, g in zip(src.values(), got, strict=True))
        del got
    bufs = [torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True) for _ in range(4)]
    got = timed("bounced", gb, lambda: into_bounced(list(src.values()), bufs))
    assert torch.equal(got[: src["t0"].nbytes], src["t0"].reshape(-1).view(torch.uint8).cpu())
    del got
    part = stage.Part(plain=True)
    part.add_tensors("model.safetensors", src, copy=False)
    timed("plain", gb, part.ready)
    shutil.rmtree(a.dir, ignore_errors=True)
    a.dir.mkdir(parents=True)
    timed("write", gb, lambda: part.write(a.dir, {}))
    shutil.rmtree(a.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
