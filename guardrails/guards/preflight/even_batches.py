"""even_batches over loaders without ``len()``: read in chunks of :data:`EVEN_CHUNK`
batches, each cut to the smallest count any rank could fetch, agreed with one MIN
all_reduce over the guard's gloo side group per chunk (one ~0.2 ms round trip per 16
batches, never per step). It holds up to 16 batches in memory ahead of the loop.
Loaders with ``len()`` need none of this: every rank stops after the shortest rank's
number of batches (an ``islice`` in ``Preflight``).
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import islice
from typing import Any

import torch
import torch.distributed as dist

#: Batches per agreement for even_batches over loaders without len().
EVEN_CHUNK = 16


def _agreed_chunks(it: Iterator[Any], group: Any) -> Iterator[Any]:
    """Yield batches in chunks of EVEN_CHUNK, each chunk cut to the smallest count any
    rank could fetch: one MIN all_reduce over the side group per chunk."""
    count = torch.zeros(1, dtype=torch.int64)
    while True:
        chunk = list(islice(it, EVEN_CHUNK))
        count.fill_(len(chunk))
        dist.all_reduce(count, op=dist.ReduceOp.MIN, group=group)
        n = int(count.item())  # a CPU tensor on the gloo group: no device sync
        yield from chunk[:n]
        if n < EVEN_CHUNK:
            return
