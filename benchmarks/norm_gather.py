"""The host cost of the guard's eager grad norm (the CPU path: the gradients gathered,
then one flat copy or ``_foreach_norm``) against the number of parameter tensors, this
checkout's against another's, in one process.

    python benchmarks/norm_gather.py --base OTHER_CHECKOUT [--tensors 150 1500]

Both checkouts' ``engine/gradnorm.py`` are loaded side by side (it imports only torch)
and their ``GradNorm`` called alternately on the same gradients (overhead.py's stack
model: tensors/2 Linear(16, 16) layers, after one backward), ``--n`` calls a block,
``--repeats`` blocks each, interleaved so that the machine's load hits both alike.
Reported per call: the minimum block (the least disturbed) and the median. Also the
Python bytecode instructions one call runs (``sys.settrace`` opcode events): what
grows with the tensors in Python.
"""

from __future__ import annotations

import argparse
import importlib.util
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from overhead import Stack  # noqa: E402


def load(checkout: Path, name: str):
    spec = importlib.util.spec_from_file_location(
        name, checkout / "guardrails" / "engine" / "gradnorm.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bytecodes(fn) -> int:
    count = 0

    def local(frame, event, arg):
        nonlocal count
        if event == "opcode":
            count += 1
        return local

    def trace(frame, event, arg):
        frame.f_trace_opcodes = True
        frame.f_trace_lines = False
        return local

    sys.settrace(trace)
    try:
        fn()
    finally:
        sys.settrace(None)
    return count


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--base", required=True, help="the other checkout")
    p.add_argument("--tensors", type=int, nargs="+", default=[150, 1500])
    p.add_argument("--n", type=int, default=20)
    p.add_argument("--repeats", type=int, default=41)
    args = p.parse_args()
    torch.set_num_threads(1)
    versions = {"base": load(Path(args.base), "gradnorm_base"), "this": load(HERE.parent, "gn")}
    print(f"{platform.node()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M')}")
    for n_tensors in args.tensors:
        torch.manual_seed(0)
        model = Stack(n_tensors)
        model(torch.randn(8, 16), torch.randn(8)).backward()
        params = list(model.parameters())
        norms = {k: m.GradNorm(params, use_graph=False) for k, m in versions.items()}
        values = {k: float(norm(params)) for k, norm in norms.items()}
        assert values["base"] == values["this"], values
        times: dict[str, list[float]] = {k: [] for k in norms}
        for _ in range(args.repeats):
            for k, norm in norms.items():
                t0 = time.perf_counter()
                for _ in range(args.n):
                    norm(params)
                times[k].append((time.perf_counter() - t0) / args.n * 1e6)
        for k, norm in norms.items():
            ops = bytecodes(lambda norm=norm, params=params: norm(params))
            print(
                f"  {len(params):5d} tensors  {k:4s}  min {min(times[k]):8.1f} us  "
                f"median {statistics.median(times[k]):8.1f} us  bytecodes {ops}"
            )


if __name__ == "__main__":
    main()
