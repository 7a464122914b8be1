"""Host memory for saves: plain memory whose pages several threads fault in at once, and
pinned memory made of it, locked in place. Both exist because the obvious way stalls:
torch's own threads fault pages in (one, under torchrun), and torch's pinned allocator
holds the CUDA driver's lock that the training thread's launches wait for."""

from __future__ import annotations

import contextlib
import logging
import threading

import torch
from torch import Tensor

from guardrails.checkpoint import digest

log = logging.getLogger("guardrails.checkpoint")

#: Below this, fresh memory is zeroed by the calling thread alone.
_FAULT_IN_ALONE_BYTES = 256 << 20


def fresh_memory(nbytes: int) -> Tensor:
    """``nbytes`` of plain host memory, zeroed: its pages faulted in by ``digest.THREADS``
    threads at once. Written page by page by the copies instead, fresh memory took 0.67
    s a GB (H200 host); ``torch.zeros`` faults them in from torch's own threads, and
    torchrun runs each worker with ``OMP_NUM_THREADS=1``: 10 GB took 4.8 s there, 1.4 s
    this way (2x H200 host, ``benchmarks/stage_plain.py``)."""
    buf = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes < _FAULT_IN_ALONE_BYTES or digest.THREADS == 1:
        return buf.zero_()
    piece = -(-nbytes // digest.THREADS)
    # zero_() lets go of the GIL: the threads fault their pages in at once.
    run = [threading.Thread(target=buf[i : i + piece].zero_) for i in range(0, nbytes, piece)]
    for t in run:
        t.start()
    for t in run:
        t.join()
    return buf


def page_locked(nbytes: int) -> tuple[Tensor, bool]:
    """``nbytes`` of pinned host memory, and whether it is locked in place (else it is
    torch's pinned memory: the driver refused to lock this memory).

    :func:`fresh_memory`'s pages, locked in place (``cudaHostRegister``; :func:`unlock`
    unlocks them). Not torch's ``pin_memory=True`` (``cudaHostAlloc``): it holds the
    CUDA driver's lock while it pins, and every kernel launch of the training thread
    waits for it. Pinning a 10 GB state's staging that way took 3.5-8.1 s, during which
    the training thread made 35-128 launches (H200 host, ``benchmarks/pin_stall.py``):
    a stall that fell on the first step after a resume (5.9 s against 2.4 s for a run's
    first step). Locked in place: 1.5 s, the training thread launching meanwhile (its
    longest wait 6-28 ms)."""
    block = fresh_memory(nbytes)
    try:
        err = int(torch.cuda.cudart().cudaHostRegister(block.data_ptr(), nbytes, 0))
    except Exception as e:  # a build without the binding (ROCm's may lack it)
        err = -1
        log.debug("guardrails: cudaHostRegister unavailable: %r", e)
    if err == 0:  # cudaSuccess
        return block, True
    log.debug("guardrails: cudaHostRegister of %d bytes failed (error %d)", nbytes, err)
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), False


def unlock(addresses: list[int]) -> None:
    """Unlock the pages :func:`page_locked` locked at ``addresses`` (the list emptied):
    memory still in use stays valid, as plain memory."""
    while addresses:
        with contextlib.suppress(Exception):  # at exit CUDA may be gone, and its locks
            torch.cuda.cudart().cudaHostUnregister(addresses.pop())
