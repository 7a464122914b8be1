"""Guarded loops written the way users write them, for tests/loops/test_user_loops.py: an
epoch loop of their own around the guard, an EMA of the model, batches drawn from the
loop's own ``torch.Generator`` without a loader. It can SIGTERM itself after a step and
dumps its final state so a stopped-and-resumed run can be compared bitwise with one that
was never interrupted.

    python tests/user_loop_worker.py RUN_DIR OUT [--loop range|g_epoch|generator]
        [--ema none|passed|kept] [--generators none|passed] [--epochs N] [--steps N]
        [--sigterm-at STEP] [--every N] [--model mlp|diffusion]

--loop range      ``for epoch in range(N): for x, y in g:`` (counts from 0 on resume)
--loop g_epoch    ``for epoch in range(g.epoch, N): for x, y in g:``
--loop generator  no loader: ``while g.step < steps:`` with batches drawn from the
                  loop's own ``torch.Generator``
--ema passed      an ``AveragedModel`` of the model, updated each step, passed as
                  ``guard([model, ema], ...)``
--ema kept        the same, kept by the loop but not passed
--generators passed  the loop's generator passed as ``guard(..., generators=...)``
--model diffusion  a denoiser (a timestep embedding concatenated to the noisy input, a
                  SiLU MLP, Adam) trained on noise and timesteps from the loop's own
                  generator (with ``--loop generator``)
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import guardrails


class Denoiser(nn.Module):
    """A diffusion model's shape: a timestep embedding, ``torch.cat``, a SiLU MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 8))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.cat([x, self.emb(t)], -1))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("run_dir")
    p.add_argument("out")
    p.add_argument("--loop", default="g_epoch", choices=["range", "g_epoch", "generator"])
    p.add_argument("--ema", default="none", choices=["none", "passed", "kept"])
    p.add_argument("--generators", default="none", choices=["none", "passed"])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--sigterm-at", type=int, default=-1)
    p.add_argument("--every", type=int, default=None)
    p.add_argument("--model", default="mlp", choices=["mlp", "diffusion"])
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)

    if args.model == "diffusion":
        model: nn.Module = Denoiser()
        opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    else:
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 1))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ema = None
    models: nn.Module | list[nn.Module] = model
    if args.ema != "none":
        ema = torch.optim.swa_utils.AveragedModel(
            model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9)
        )
        if args.ema == "passed":
            models = [model, ema]
    gen = torch.Generator().manual_seed(3)  # the loop's own batches (--loop generator)
    loader = None
    if args.loop != "generator":
        data = torch.Generator().manual_seed(1)
        dataset = TensorDataset(torch.randn(64, 8, generator=data), torch.randn(64, generator=data))
        loader = DataLoader(
            dataset, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(2)
        )
    knobs: dict = {"run_dir": args.run_dir, "progress": False}
    if args.every:
        knobs["checkpoint"] = {"every_n_steps": args.every}
    if args.generators == "passed":
        knobs["generators"] = {"batches": gen}

    def train(x: torch.Tensor, y: torch.Tensor, t: torch.Tensor | None = None) -> None:
        if t is not None:  # the denoiser: y is the noise added to x, t the timesteps
            loss = nn.functional.mse_loss(model(x + y, t), y)
        else:
            loss = nn.functional.mse_loss(model(x).squeeze(-1), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if ema is not None:
            ema.update_parameters(model)
        if g.step == args.sigterm_at:
            os.kill(os.getpid(), signal.SIGTERM)

    with guardrails.guard(models, opt, loader, **knobs) as g:
        if args.loop == "range":
            for epoch in range(args.epochs):  # noqa: B007 (as users write it)
                for x, y in g:
                    train(x, y)
        elif args.loop == "g_epoch":
            for epoch in range(g.epoch, args.epochs):  # noqa: B007
                for x, y in g:
                    train(x, y)
        else:
            while g.step < args.steps:
                x = torch.randn(8, 8, generator=gen)
                if args.model == "diffusion":
                    noise = torch.randn(8, 8, generator=gen)
                    train(x, noise, torch.randint(0, 10, (8,), generator=gen))
                else:
                    train(x, x.sum(-1))
    torch.save(
        {
            "model": model.state_dict(),
            "opt": opt.state_dict(),
            "ema": ema.state_dict() if ema is not None else None,
            "step": g.step,
            "epoch": g.epoch,
            "gen": gen.get_state(),
        },
        args.out,
    )


if __name__ == "__main__":
    main()
