"""A training loop written against HF accelerate and transformers, for tests/loops/test_hf.py:
accelerate's documented loop (everything ``accelerator.prepare()``d, gradient
accumulation through ``accelerator.accumulate()``) over a small GPT-2 built from a
config (nothing downloaded), guarded with the prepared objects as they are. It can
SIGTERM itself after a step (on one rank), and dumps its final state (weights,
optimizer and scheduler state, RNG) so a stopped-and-resumed run can be compared
bitwise with one that was never interrupted.

    python tests/hf_worker.py RUN_DIR OUT [--steps N] [--accumulate K]
        [--sigterm-at STEP] [--sigterm-rank R]

Under ``torchrun --nproc-per-node 2`` accelerate sets up the process group (gloo on
CPU) and each rank writes ``OUT.rank<R>.pt``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import guardrails


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("run_dir")
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--sigterm-at", type=int, default=-1)
    p.add_argument("--sigterm-rank", type=int, default=0)
    p.add_argument("--scale", type=float, default=0.0, help="a GradScaler's initial scale")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    acc = Accelerator(cpu=True, gradient_accumulation_steps=args.accumulate)
    if args.scale:
        # The GradScaler Accelerator(mixed_precision="fp16") makes on a GPU (it refuses
        # fp16 on a CPU), set where prepare() hands it to the AcceleratedOptimizer. A
        # huge initial scale overflows the first steps, as fp16 runs do at the start.
        acc.scaler = torch.amp.GradScaler("cpu", init_scale=args.scale)
    # Dropout stays on (GPT-2's default 0.1): the RNG streams must resume exactly too.
    config = GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    model = GPT2LMHeadModel(config)
    ids = torch.randint(0, 64, (48, 16), generator=torch.Generator().manual_seed(1))
    loader = DataLoader(TensorDataset(ids), batch_size=4, shuffle=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    # The ranks agree on a signal at every step (not about once a second), so the run
    # stops at the step after the signal however fast the steps are.
    agree = guardrails.SignalCheckpointer(agree_every_s=1e-6)
    with guardrails.guard(
        model, opt, loader, scheduler=sched, run_dir=args.run_dir, progress=False,
        components=[agree],
    ) as g:  # fmt: skip
        while g.step < args.steps:
            for (x,) in g:
                with acc.accumulate(model):
                    out = model(input_ids=x, labels=x)
                    acc.backward(out.loss)
                    opt.step()
                    sched.step()
                    opt.zero_grad()
                if g.step == args.sigterm_at and acc.process_index == args.sigterm_rank:
                    os.kill(os.getpid(), signal.SIGTERM)
                    args.sigterm_at = -1  # once
                if g.step == args.steps:
                    break
    state = {
        "model": acc.unwrap_model(model).state_dict(),
        "opt": opt.state_dict(),
        "sched": sched.state_dict(),
        "rng": torch.get_rng_state(),
        "step": g.step,
        "scaler": acc.scaler.state_dict() if acc.scaler is not None else None,
    }
    torch.save(state, f"{args.out}.rank{acc.process_index}.pt")
    acc.end_training()


if __name__ == "__main__":
    main()
