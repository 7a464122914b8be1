"""Instructions per call of ways to take the CPU grad norm as a host float, on the
tiny loop's 4 gradients (overhead.py's ``Tiny``), counted by callgrind: the levers
left for the guard's CPU host cost once the norm was one flat copy (session 17).

    python benchmarks/cpu_norm_ir.py [--calls 1000]

Each variant runs in its own process under callgrind with its cache simulation
(``callgrind_step.callgrind``), collected only inside the C iterator that drives the
``--calls`` calls (after 200 warm-up calls):

- ``flat``: what the guard does (``_gradnorm.flat_norm``, then ``tolist()`` as the
  step ring's host write does);
- ``flat_numpy``: the same flat copy, its norm by ``numpy.dot`` on a view of it;
- ``numpy``: no copy, one ``numpy.dot`` per gradient on its ``Tensor.numpy()`` view;
- ``foreach``: the per-tensor path (``_gradnorm.total_norm``, ``_foreach_norm``).

Needs valgrind on PATH; ~1 minute a variant.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import math
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
VARIANTS = ("flat", "flat_numpy", "numpy", "foreach")
WARMUP = 200


def child(variant: str, calls: int) -> None:
    import numpy as np
    import torch

    from guardrails.engine.gradnorm import flat_norm, total_norm

    sys.path.insert(0, str(HERE))
    from overhead import Tiny

    torch.manual_seed(0)
    model = Tiny()
    model(torch.randn(8, 16), torch.randn(8)).backward()
    params = list(model.parameters())
    cpu = torch.device("cpu")

    def flat() -> float:
        return flat_norm([g for p in params if (g := p.grad) is not None]).tolist()

    def flat_numpy() -> float:
        grads = [g for p in params if (g := p.grad) is not None]
        x = torch._C._nn.flatten_dense_tensors(grads).numpy()
        return math.sqrt(float(np.dot(x, x)))

    def numpy() -> float:
        total = 0.0
        for p in params:
            if (g := p.grad) is not None:
                x = g.numpy().reshape(-1)
                total += float(np.dot(x, x))
        return math.sqrt(total)

    def foreach() -> float:
        grads = [g for p in params if (g := p.grad) is not None]
        return total_norm(grads, cpu, False).tolist()

    fn = locals()[variant]
    for _ in range(WARMUP):
        fn()
    collections.deque(itertools.starmap(fn, itertools.repeat((), calls)), 0)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--calls", type=int, default=1000)
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child, args.calls)
        return
    from callgrind_step import callgrind, est

    print(f"per call, {args.calls} calls after {WARMUP} warm-up (callgrind, cache simulation)")
    with tempfile.TemporaryDirectory() as d:
        for v in VARIANTS:
            argv = [__file__, "--child", v, "--calls", str(args.calls)]
            t = callgrind(argv, Path(d) / f"{v}.out", str(HERE.parent))
            n = args.calls
            print(f"  {v:11s} Ir {t['Ir'] / n:8.0f}  est. cycles {est(t) / n:8.0f}")


if __name__ == "__main__":
    main()
