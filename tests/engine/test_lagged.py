"""The lagged device-to-host copy (guardrails.engine.lagged) that Telemetry and NanGuard
share, on a CPU ring (the CUDA path, pinned memory and events, runs in test_gpu.py)."""

from __future__ import annotations

import math

import torch

from guardrails.engine.lagged import LaggedCopy, StepRing


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


# ---------------------------------------------------------------------- the step ring


def test_host_rows_hold_what_the_device_stack_writes_bitwise():
    """A CPU ring is written through host memory (Tensor.tolist() and float32 stores),
    not by a kernel: the same float32 bits as the device path's torch.stack, for every
    loss dtype (a float64 loss is rounded the same way), a missing loss, NaN and Inf."""
    g = torch.Generator().manual_seed(0)
    host = StepRing(torch.device("cpu"), host=True)
    device = StepRing(torch.device("cpu"), host=False)
    host.reader(8)
    device.reader(8)
    cases = []
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        for scale in (1e-30, 1.0, 3e4, 1e38):
            loss = (torch.randn((), generator=g, dtype=torch.float64) * scale).to(dtype)
            cases.append((loss, torch.rand((), generator=g) * scale))
    cases += [(None, torch.tensor(2.5)), (torch.tensor(math.nan), torch.tensor(math.inf))]
    cases.append((torch.tensor(1e39, dtype=torch.float64), torch.tensor(-math.inf)))
    for loss, norm in cases:
        c = host.write(loss, norm)
        assert device.write(loss, norm) == c
        a, b = host.rows[host.i], device.rows[device.i]
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), (loss, norm, a, b)
        # The values the host path hands NanGuard are the row's float32 values.
        assert [host.loss, host.norm] == a[:2].tolist() or math.isnan(host.loss)


def test_a_reader_gets_its_own_rows_across_gaps_and_the_ring_end():
    """Two components read the ring at their own intervals; where one wrote rows the
    other did not see (benchmark mode bypassed its hooks on a step), each reader's copy
    holds only its rows, in order, also when they wrap past the ring's end."""
    ring = StepRing(torch.device("cpu"))
    often, rarely = ring.reader(3), ring.reader(5)
    assert ring.length == 10
    mine: dict[str, list[int]] = {"often": [], "rarely": []}
    read: dict[str, list[float]] = {"often": [], "rarely": []}
    for step in range(1, 38):
        c = ring.write(torch.tensor(float(step)), torch.tensor(0.5))
        for name, reader, every in (("often", often, 3), ("rarely", rarely, 5)):
            if step % 7 == (0 if name == "often" else 3):
                continue  # this reader's hooks bypassed on this step
            mine[name].append(c)
            if len(mine[name]) == every:
                reader.start(mine[name], meta=list(mine[name]))
                copy = reader.take()
                assert copy is not None and copy.meta == mine[name]
                read[name] += copy.read()[:, 0].tolist()
                mine[name] = []
    for name, skip in (("often", 0), ("rarely", 3)):
        expect = [float(s) for s in range(1, 38) if s % 7 != skip]
        assert read[name] == expect[: len(read[name])] and len(read[name]) >= len(expect) - 5


def test_rows_overwritten_before_their_reader_copied_them_read_as_nan():
    ring = StepRing(torch.device("cpu"))
    reader = ring.reader(2)  # a ring of 4 rows
    first = ring.write(torch.tensor(1.0), torch.tensor(1.0))
    for v in range(2, 7):  # another component writes 5 rows this reader does not see
        ring.write(torch.tensor(float(v)), torch.tensor(1.0))
    last = ring.write(torch.tensor(7.0), torch.tensor(1.0))
    reader.start([first, last])
    rows = reader.take().read()
    assert math.isnan(rows[0, 0]) and rows[1, 0] == 7.0
