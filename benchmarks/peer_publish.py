"""What publishing a rank's part at every step boundary costs (``guards/checkpointer/
peer.py``): the time of one ``PeerSlot.publish`` and the system calls it makes.

    python benchmarks/peer_publish.py [--n 20000]
    python benchmarks/peer_publish.py --partner [--n 5000]

A real guard (one process, a CPU model) trained a few steps, then its boundary's part
published ``--n`` times into a copy in ``/dev/shm``: per call, for a loop that draws from
python's or numpy's stream every step (they are copied at every boundary then) and for
one that does not (only torch's generators: the common case). Then the same under
``strace -f -c``, twice as many publishes against as many: the system calls per publish.
``us_per_publish_update``: the copy published after each update too (the boundary to
come's part, read with its own ``get_state()`` calls), when nothing draws.
``us_per_fetch_states``: a loop that prefetches through a fast-forwarded loader, per
fetch of its held batch: torch's generators' states before and after the fetch
(``boundary.FetchStates``); ``us_per_refetch_check``: the boundary's check of them.

``--partner``: the copy also sent to a partner on another node (``partner.py``; here two
links in this process over loopback, through a real TCPStore): the main thread's time
per publish with and without the link's wake, back to back (the sender thread takes the
GIL for its copy), at steps of 0 and 1 ms (a step's compute releases the GIL), and how
many boundaries' copies reached the partner's mirror.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import subprocess
import sys
import tempfile
import timeit
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch


@contextlib.contextmanager
def trained_guard() -> Iterator[Any]:
    """A real guard (one process, a CPU model) after 8 steps, still open: its boundary
    is what a publish copies."""
    import guardrails

    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [torch.randn(4, 8) for _ in range(8)]
    with tempfile.TemporaryDirectory() as run_dir:
        with guardrails.guard(model, opt, data, run_dir=run_dir, progress=False) as g:
            for x in g:
                model(x).sum().backward()
                opt.step()
                opt.zero_grad()
            yield g


def measure(n: int) -> dict[str, float]:
    from guardrails.guards.checkpointer.peer import PeerSlot

    with trained_guard() as g:
        slot = PeerSlot(Path("/dev/shm"), "bench", 0)
        cap = g.boundary_capture
        try:
            slot.publish(g)  # the cold part, once
            cap.captured_at = cap.count - 1  # not drawing: torch's generators only
            cap.drawing = False
            quiet = timeit.timeit(lambda: slot.publish(g), number=n) / n
            # After the update, the part of the boundary to come (its own get_state()s).
            update = timeit.timeit(lambda: slot.publish_update(g), number=n) / n
            assert slot.exact
            from guardrails.engine.boundary import FetchStates

            fetches = FetchStates(cap)
            around = timeit.timeit(lambda: (fetches.before(cap.count), fetches.after()), number=n)
            fetches.before(cap.count - 1)
            fetches.after()
            states = tuple(gen.get_state() for gen in cap.generators)
            check = timeit.timeit(lambda: fetches.refetch(cap.count, states), number=n)
            assert fetches.refetch(cap.count, states) is not None
            cap.captured_at = cap.count  # drawing: python's and numpy's too
            cap.drawing = True  # (into the boundary's half only: each has its own)
            drawing = timeit.timeit(lambda: slot.publish(g), number=n) / n
        finally:
            slot.close()
    return {
        "us_per_publish": quiet * 1e6,
        "us_per_publish_update": update * 1e6,
        "us_per_publish_drawing": drawing * 1e6,
        "us_per_fetch_states": around / n * 1e6,
        "us_per_refetch_check": check / n * 1e6,
    }


def measure_partner(n: int) -> dict[str, float]:
    import time

    from guardrails.guards.checkpointer.partner import PartnerLink
    from guardrails.guards.checkpointer.peer import PeerSlot

    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as other:
        with trained_guard() as g:
            slot = PeerSlot(Path("/dev/shm"), "bench", 0)
            theirs = PeerSlot(Path(other), "bench", 1)
            sender = PartnerLink(store, slot, Path("/dev/shm"), "bench", 0, (1, 1))
            keeper = PartnerLink(store, theirs, Path(other), "bench", 1, (0, 0))
            try:
                slot.publish(g)
                sender.sent()
                time.sleep(0.5)  # connected
                for step_s in (0.0, 0.001):
                    alone = lambda: slot.publish(g)  # noqa: E731
                    linked = lambda: (slot.publish(g), sender.sent())  # noqa: E731
                    for name, fn in (("alone", alone), ("linked", linked)):
                        took = 0.0
                        kept0 = keeper.frames_kept
                        for _ in range(n):
                            t0 = time.perf_counter()
                            fn()
                            took += time.perf_counter() - t0
                            if step_s:
                                time.sleep(step_s)
                        time.sleep(0.2)
                        key = f"us_per_publish_{name}_{int(step_s * 1000)}ms"
                        out[key] = took / n * 1e6
                        if name == "linked":
                            out[f"kept_share_{int(step_s * 1000)}ms"] = (
                                keeper.frames_kept - kept0
                            ) / n
            finally:
                sender.close()
                keeper.close()
                slot.close()
                theirs.close()
    return out


def syscalls(n: int) -> float:
    """System calls a publish makes: ``strace -c`` of a run of ``2n`` publishes against
    one of ``n`` (each run's two timings publish ``n`` times each)."""

    def count(k: int) -> int:
        out = subprocess.run(
            ["strace", "-f", "-c", sys.executable, __file__, "--child", str(k)],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
        total = re.search(r"^\s*100\.00\s+\S+\s+\S+\s+\S+\s+(\d+)", out, re.M)
        assert total, out
        return int(total.group(1))

    return (count(2 * n) - count(n)) / (2 * n)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=20000)
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--partner", action="store_true", help="the copy sent to a partner too")
    a = p.parse_args()
    if a.partner:
        print(json.dumps({k: round(v, 3) for k, v in measure_partner(a.n).items()}))
        return
    if a.child is not None:
        measure(a.child)
        return
    result = measure(a.n)
    result["syscalls_per_publish"] = syscalls(a.n)
    print(json.dumps({k: round(v, 3) for k, v in result.items()}))


if __name__ == "__main__":
    main()
