"""The lagged device-to-host copy (guardrails._lagged) that Telemetry and NanGuard
share, on a CPU ring (the CUDA path, pinned memory and events, runs in test_gpu.py)."""

from __future__ import annotations

import torch

from guardrails._lagged import LaggedCopy


def test_start_hands_back_the_previous_copy_and_take_the_newest():
    ring = torch.zeros(4, 2)
    copies = LaggedCopy(ring)
    ring.fill_(1.0)
    assert copies.start(4, meta="first") is None  # nothing before it
    ring.fill_(2.0)  # the next interval overwrites the ring: the copy is unchanged
    first = copies.start(3, meta="second")
    assert first is not None and first.ready() and first.meta == "first"
    assert torch.equal(first.read(), torch.ones(4, 2))
    second = copies.take()
    assert second is not None and second.meta == "second"
    assert torch.equal(second.read(), torch.full((3, 2), 2.0))
    assert copies.take() is None and copies.pending is None


def test_two_slots_alternate():
    ring = torch.zeros(1, 1)
    copies = LaggedCopy(ring)
    seen = []
    for v in range(4):
        ring.fill_(float(v))
        previous = copies.start(1, meta=v)
        if previous is not None:
            seen.append((previous.meta, previous.read().item()))
    # Each copy kept its own values while the next one was made into the other slot.
    assert seen == [(0, 0.0), (1, 1.0), (2, 2.0)]
