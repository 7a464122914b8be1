"""Exact structural counts of the guard's per-step host work on a tiny CPU loop: Python
calls into guardrails per step (a ``sys.setprofile`` counter) and torch ops the guard
dispatches per step (a ``TorchDispatchMode`` counter, guarded minus plain), with the
per-function / per-op breakdown. No clock: the same numbers on any machine.

    python benchmarks/step_counts.py [--steps 400] [--layers 2] [--detail]

The loop is ``overhead.py``'s tiny one (AdamW, not fused on CPU) with every default
component (``guardrails.guard(...)``, no bar); ``--layers`` sets how many Linear layers
the MLP has (2 layers: 4 parameter tensors), to show the counts do not grow with it.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import guardrails

PKG_DIR = str(Path(guardrails.__file__).parent)
WARMUP = 20  # untimed first steps: lazy optimizer state, GCScheduler's freeze, ...


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def model_and_data(layers: int) -> tuple[nn.Module, torch.optim.Optimizer, list]:
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for i in range(layers):
        mods.append(nn.Linear(16, 16 if i < layers - 1 else 1))
        if i < layers - 1:
            mods.append(nn.Tanh())
    net = nn.Sequential(*mods)

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return nn.functional.mse_loss(self.net(x).squeeze(-1), y)

    model = M()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = [(torch.randn(8, 16), torch.randn(8)) for _ in range(8)]
    return model, opt, data


def loop(it, model, opt, steps: int, on_start, on_end) -> None:
    for i, (x, y) in enumerate(it):
        if i == WARMUP:
            on_start()
        model(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    on_end()


def batches(data, n):
    return [data[i % len(data)] for i in range(n)]


@contextlib.contextmanager
def under_guard(model, opt, data, steps: int):
    """The guard both counts run under. Its metrics ring is longer than the window, so
    the ring's one copy per interval is not in it (amortised: one per 50 steps by
    default)."""
    with tempfile.TemporaryDirectory() as d:
        with guardrails.guard(
            model,
            opt,
            batches(data, WARMUP + steps),
            run_dir=d,
            progress=False,
            metrics={"every_n_steps": 10 * (WARMUP + steps)},
        ) as g:
            yield g


def count_ops(layers: int, steps: int, guarded: bool) -> Counter[str]:
    model, opt, data = model_and_data(layers)
    counter = OpCounter()
    start, end = counter.__enter__, lambda: counter.__exit__(None, None, None)
    if not guarded:
        loop(batches(data, WARMUP + steps), model, opt, steps, start, end)
        return counter.ops
    with under_guard(model, opt, data, steps) as g:
        loop(g, model, opt, steps, start, end)
    return counter.ops


def count_calls(layers: int, steps: int) -> Counter[str]:
    model, opt, data = model_and_data(layers)
    calls: Counter[str] = Counter()

    def ours(frame) -> bool:
        return frame is not None and frame.f_code.co_filename.startswith(PKG_DIR)

    def prof(frame, event, arg):
        if event == "call" and (ours(frame) or ours(frame.f_back)):
            calls[f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}"] += 1
        elif event == "c_call" and ours(frame):
            calls[f"c:{getattr(arg, '__qualname__', getattr(arg, '__name__', '?'))}"] += 1

    with under_guard(model, opt, data, steps) as g:
        loop(g, model, opt, steps, lambda: sys.setprofile(prof), lambda: sys.setprofile(None))
    return calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--detail", action="store_true")
    args = p.parse_args()
    logging.getLogger("guardrails").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    n = args.steps
    plain = count_ops(args.layers, n, False)
    guarded = count_ops(args.layers, n, True)
    extra = guarded.copy()
    extra.subtract(plain)
    extra = Counter({k: v for k, v in extra.items() if v})
    calls = count_calls(args.layers, n)
    n_params = 2 * args.layers
    print(f"guardrails {guardrails.__file__}, torch {torch.__version__}, {n_params} tensors")
    print(f"  Python calls into guardrails per step: {sum(calls.values()) / n:.2f}")
    print(f"  torch ops the guard dispatches per step: {sum(extra.values()) / n:.2f}")
    if args.detail:
        for k, v in sorted(extra.items(), key=lambda kv: -kv[1]):
            print(f"    op   {v / n:6.2f}  {k}")
        for k, v in sorted(calls.items(), key=lambda kv: -kv[1]):
            print(f"    call {v / n:6.2f}  {k}")


if __name__ == "__main__":
    main()
