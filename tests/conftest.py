"""Shared helpers: small real models and loops. Nothing here mocks torch or the OS."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import torch
from torch import nn


class Regressor(nn.Module):
    """An MLP with ``depth`` hidden layers that returns its MSE loss (so the guard
    picks the loss up from the output) or, with ``return_loss=False``, predictions."""

    def __init__(self, depth: int = 2, width: int = 8, return_loss: bool = True) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(4, width), nn.Tanh()]
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.Tanh()]
        layers.append(nn.Linear(width, 1))
        self.net = nn.Sequential(*layers)
        self.return_loss = return_loss

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        pred = self.net(x).squeeze(-1)
        if y is None or not self.return_loss:
            return pred
        return nn.functional.mse_loss(pred, y)


def batches(n: int, batch: int = 8, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 4, generator=g), torch.randn(batch, generator=g)) for _ in range(n)]


def reference_grad_norm(model: nn.Module) -> float:
    """Total L2 grad norm computed the plain way, one tensor at a time."""
    norms = [p.grad.double().norm() for p in model.parameters() if p.grad is not None]
    return float(torch.stack(norms).norm())


def guarded_run(run_dir, n_steps: int = 2, inside=None, **knobs):
    """Train a fresh seeded Regressor with SGD for ``n_steps`` under
    ``guardrails.guard(..., run_dir=run_dir, **knobs)``; ``inside(g)`` runs before the
    block closes. Returns the (closed) guard."""
    import guardrails

    torch.manual_seed(0)
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guardrails.guard(model, opt, batches(n_steps), run_dir=run_dir, **knobs) as g:
        for x, y in g:
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
        if inside is not None:
            inside(g)
    return g


def read_events(run_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "events.jsonl").read_text().splitlines()]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now, for a test's MASTER_PORT."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn, args: tuple, nprocs: int = 2, deadline_s: float = 120.0) -> None:
    """mp.spawn with a deadline: a hang fails the test instead of blocking the suite."""
    import pytest
    import torch.multiprocessing as mp

    ctx = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    end = time.monotonic() + deadline_s
    while not ctx.join(timeout=1.0):
        if time.monotonic() > end:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"ranks still running after {deadline_s:.0f} s: a hang")


def assert_state_equal(a, b, path="state") -> None:
    """Nested state (dicts, lists, tensors, plain values) bitwise equal, naming the first
    path that differs: resumed runs against uninterrupted ones."""
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_state_equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_state_equal(x, y, f"{path}[{i}]")
    else:
        assert a == b, (path, a, b)
