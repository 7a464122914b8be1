"""Memory numbers that are cheap to read: host-side counters, never a device sync.

Leak checks read one of them every ``leak_check_every_n_steps`` steps, and an
out-of-memory report reads them all once, at the error, so each is a host counter:
CUDA's caching allocator keeps ``memory_allocated`` on the host, and on CPU the
resident set comes from ``/proc/self/statm`` (RSS; 0 off Linux) and the peak from
``getrusage``. Tensors are measured per storage (:func:`storages`), so views of one
buffer count once.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def memory_bytes(device: torch.device) -> int:
    """Device memory in use: CUDA's allocated bytes (a host-side counter, no sync), or
    this process's RSS on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    return rss_bytes()


def rss_bytes() -> int:
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):  # not Linux
        return 0


def peak_rss_bytes() -> int | None:
    try:
        import resource
    except ImportError:  # pragma: no cover
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("MemTotal", "MemAvailable"):
                    out[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError):
        pass
    return out


def storage(t: Tensor) -> tuple[tuple[str, int], int] | None:
    """(key, bytes) of the memory behind ``t``; views of one storage share the key."""
    # Only plain tensors and parameters own real memory we can key: a subclass may be
    # a FakeTensor (torch.compile's tracing leftovers), whose data_ptr() warns and will
    # raise, or a wrapper (DTensor) whose storage is not where its bytes are.
    if type(t) not in (Tensor, torch.nn.Parameter) or t.is_meta:
        return None
    try:
        s = t.untyped_storage()
        return (str(s.device), s.data_ptr()), int(s.nbytes())
    except Exception:  # sparse, meta, fake or other storage-less tensors
        return None


def storages(tensors: list[Tensor]) -> dict[tuple[str, int], int]:
    """Bytes per distinct storage, so views are counted once."""
    out: dict[tuple[str, int], int] = {}
    for t in tensors:
        found = storage(t)
        if found is not None:
            out[found[0]] = found[1]
    return out


def same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    return a.type == "cpu" or (a.index or 0) == (b.index or 0)


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "?"
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    return f"{sign}{n:.2f} GiB"  # pragma: no cover
