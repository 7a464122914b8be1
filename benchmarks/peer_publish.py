"""What publishing a rank's part at every step boundary costs (``guards/checkpointer/
peer.py``): the time of one ``PeerSlot.publish`` and the system calls it makes.

    python benchmarks/peer_publish.py [--n 20000]

A real guard (one process, a CPU model) trained a few steps, then its boundary's part
published ``--n`` times into a copy in ``/dev/shm``: per call, for a loop that draws from
python's or numpy's stream every step (they are copied at every boundary then) and for
one that does not (only torch's generators: the common case). Then the same under
``strace -f -c``, twice as many publishes against as many: the system calls per publish.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import timeit
from pathlib import Path

import torch


def measure(n: int) -> dict[str, float]:
    import guardrails
    from guardrails.guards.checkpointer.peer import PeerSlot

    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [torch.randn(4, 8) for _ in range(8)]
    with tempfile.TemporaryDirectory() as run_dir:
        with guardrails.guard(model, opt, data, run_dir=run_dir, progress=False) as g:
            for x in g:
                model(x).sum().backward()
                opt.step()
                opt.zero_grad()
            slot = PeerSlot(Path("/dev/shm"), "bench", 0)
            cap = g.boundary_capture
            try:
                slot.publish(g)  # the cold part, once
                cap.captured_at = cap.count - 1  # not drawing: torch's generators only
                quiet = timeit.timeit(lambda: slot.publish(g), number=n) / n
                cap.captured_at = cap.count  # drawing: python's and numpy's too
                drawing = timeit.timeit(lambda: slot.publish(g), number=n) / n
            finally:
                slot.close()
    return {"us_per_publish": quiet * 1e6, "us_per_publish_drawing": drawing * 1e6}


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
    a = p.parse_args()
    if a.child is not None:
        measure(a.child)
        return
    result = measure(a.n)
    result["syscalls_per_publish"] = syscalls(a.n)
    print(json.dumps({k: round(v, 3) for k, v in result.items()}))


if __name__ == "__main__":
    main()
