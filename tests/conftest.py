"""Shared helpers: small real models and loops. Nothing here mocks torch or the OS."""

from __future__ import annotations

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
