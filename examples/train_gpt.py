"""Train a small character-level GPT on Shakespeare, guarded by guardrails.

    python examples/train_gpt.py                         # CPU (or CUDA when present)
    torchrun --nproc-per-node 2 examples/train_gpt.py    # DDP (gloo on CPU, NCCL on GPU)

The text (examples/data/shakespeare.txt, ~370 KB: Macbeth, The Tempest and Hamlet from
Project Gutenberg, public domain) is split into fixed 64-character windows; the model
is ~0.8M parameters (4 layers, 128 wide). The default 500 steps take 90 s on 2 AMD EPYC
cores (131 CPU-s; longer on a loaded machine) and take the loss from ~4.2 (uniform over
65 characters) to ~1.9.

The only guardrails lines are the `with guardrails.guard(...)`, iterating `g` instead
of the loader and clipping through `g.clip_grad_norm_` (so clipping and NaN detection
share one pass over the gradients); the rest is an ordinary PyTorch loop. Metrics land
in RUN_DIR/metrics.parquet and events in RUN_DIR/events.jsonl.

Planted faults, to see what the guard does with them (the two commonest NaNs first).
Each gets its own --run-dir: a run directory holds one run, and the same command in it
resumes that run (a checkpoint written by one process does not resume under torchrun).

    python examples/train_gpt.py --inject bad_sample --run-dir runs/bad_sample
        # one sample's loss weight is NaN: the step is skipped, the run goes on;
        # RUN_DIR/nonfinite/ holds the batch and events.jsonl names the sample
    python examples/train_gpt.py --inject nan_lr --run-dir runs/nan_lr
        # the LR is set to 1e4 mid-run: steps are skipped, then NonFiniteError (cause
        # optimization_blowup) stops it
    python examples/train_gpt.py --inject sigterm --run-dir runs/sigterm
        # SIGTERM at half way (what a pre-emption sends): every rank stops at one
        # step, saves RUN_DIR/checkpoints/step_<N> and exits 143; the same command
        # again resumes and finishes the run, bitwise as if never interrupted
    torchrun --nproc-per-node 2 examples/train_gpt.py --inject stuck --hang-timeout-s 10 \\
        --run-dir runs/stuck
        # the last rank sleeps in Python at half way: within ~10 s every rank ends with
        # HangError naming it, its line and every rank's stack (exit code 83)
    torchrun --nproc-per-node 2 examples/train_gpt.py --inject desync --run-dir runs/desync
        # at half way rank 0 alone enters a barrier (the classic desync: "only rank 0
        # does something that includes a collective") before every rank's loss
        # all-reduce: seen in ~0.5 s, and within ~6 s (ranks stuck in the collective get
        # 5 s) every rank ends with
        # CollectiveMismatchError naming both ranks' calls and lines (exit code 82)
        # instead of gloo's 30-minute (NCCL: 10-minute) hang
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, RandomSampler

import guardrails

DATA = Path(__file__).parent / "data" / "shakespeare.txt"


# ---------------------------------------------------------------------- data


class CharWindows(Dataset):
    """Fixed windows of ``block_size + 1`` characters: input, next-char target and a
    per-sample loss weight (1.0; real pipelines weight or mask samples this way)."""

    def __init__(self, text: str, block_size: int) -> None:
        self.chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        self.data = torch.tensor([self.stoi[c] for c in text], dtype=torch.long)
        self.block_size = block_size
        #: ``--inject bad_sample``: the n-th item fetched gets a NaN weight.
        self.poison_at: int | None = None
        self._fetched = 0

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        chunk = self.data[i * self.block_size : (i + 1) * self.block_size + 1]
        self._fetched += 1
        weight = math.nan if self._fetched == self.poison_at else 1.0
        return chunk[:-1], chunk[1:], torch.tensor(weight)

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)


# ---------------------------------------------------------------------- model


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(n_embd)
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Returns the mean cross-entropy when given targets (guardrails picks it up from
    the output), the logits otherwise."""

    def __init__(self, vocab: int, block_size: int, n_layer: int, n_head: int, n_embd: int) -> None:
        super().__init__()
        self.block_size = block_size
        self.tok = nn.Embedding(vocab, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied, as in GPT-2
        # GPT-2's init: with PyTorch's default N(0, 1) embedding the tied head starts
        # with logits of size ~sqrt(n_embd) and a loss of ~60 instead of ln(65) = 4.2.
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        if weights is None:
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        per_token = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
        return (per_token.view_as(targets).mean(1) * weights).mean()

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, n: int) -> torch.Tensor:
        for _ in range(n):
            logits = self(idx[:, -self.block_size :])[:, -1]
            idx = torch.cat([idx, torch.multinomial(F.softmax(logits, dim=-1), 1)], dim=1)
        return idx


# ---------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=500, help="optimizer steps (default 500)")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per micro-batch per rank")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu or cuda")
    p.add_argument("--run-dir", default="runs/train_gpt")
    p.add_argument(
        "--sample", type=int, default=200, help="characters to sample at the end (0: none)"
    )
    p.add_argument(
        "--inject",
        choices=["bad_sample", "nan_lr", "sigterm", "stuck", "desync"],
        help="plant a fault at --inject-step: a NaN sample weight on rank 0, LR 1e4, or "
        "SIGTERM to rank 0 (a pre-emption: run the same command again to resume)",
    )
    p.add_argument("--inject-step", type=int, help="default: half way")
    p.add_argument(
        "--hang-timeout-s",
        type=float,
        help="watchdog timeout (default: automatic, 60-300 s); --inject stuck makes the "
        "last rank sleep at --inject-step",
    )
    return p.parse_args(argv)


@guardrails.record  # our error as torchrun's root cause, a clean summary, exit codes
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if args.inject == "stuck" and not distributed:  # one process has nobody to hang
        raise SystemExit("--inject stuck needs 2+ ranks: torchrun --nproc-per-node 2 ...")
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if distributed:
        local_rank = int(os.environ["LOCAL_RANK"])
        if use_cuda:
            torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl" if use_cuda else "gloo")
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if use_cuda else "cpu")

    torch.manual_seed(args.seed)  # same init on every rank
    data = CharWindows(DATA.read_text(), args.block_size)
    sampler = (
        DistributedSampler(data, num_replicas=world, rank=rank, seed=args.seed, drop_last=True)
        if distributed
        else RandomSampler(data, generator=torch.Generator().manual_seed(args.seed))
    )
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    model: nn.Module = GPT(
        len(data.chars), args.block_size, args.n_layer, args.n_head, args.n_embd
    ).to(device)
    raw_model = model
    if distributed:
        model = DDP(model, device_ids=[device.index] if use_cuda else None)
    # fused=True: one kernel per step, and it takes NanGuard's on-device skip flag.
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, fused=True)
    # Linear warmup over 10% of the steps, then cosine to 10% of the peak.
    warmup = max(1, args.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: (
            min(1.0, (s + 1) / warmup)
            * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps))))
        ),
    )
    if rank == 0:
        n_params = sum(p.numel() for p in raw_model.parameters())
        print(
            f"GPT: {n_params / 1e6:.2f}M params, {len(data)} windows of {args.block_size} chars, "
            f"{world} rank(s) on {device}, {args.steps} steps"
        )

    inject_step = args.inject_step or args.steps // 2
    if args.inject == "bad_sample" and rank == 0:
        # The 4th sample of the first micro-batch of step `inject_step` (num_workers=0,
        # so items are fetched in order).
        data.poison_at = (inject_step - 1) * args.grad_accum * args.batch_size + 4

    t0 = time.perf_counter()
    micro = 0
    with guardrails.guard(
        model,
        opt,
        loader,
        scheduler=sched,
        run_dir=args.run_dir,
        watchdog={"hang_timeout_s": args.hang_timeout_s},
    ) as g:
        # resume="auto" (the default) has already restored the newest checkpoint in
        # RUN_DIR/checkpoints if there is one: g.step and g.epoch continue from it.
        start_step = g.step
        while g.step < args.steps:
            if distributed:
                sampler.set_epoch(g.epoch)
            for batch in g:
                x, y, w = (t.to(device, non_blocking=True) for t in batch)
                if args.inject == "stuck" and g.step == inject_step and rank == world - 1:
                    print(
                        f"inject: rank {rank} stuck at step {g.step} at {time.time():.3f}",
                        flush=True,
                    )
                    time.sleep(3600)  # the fault: a rank that never reaches the all-reduce
                if args.inject == "nan_lr" and g.step + 1 == inject_step:
                    sched.base_lrs = [1e4 for _ in sched.base_lrs]  # the fault
                loss = model(x, y, w)  # a scalar: the guard records it, no .item() needed
                (loss / args.grad_accum).backward()
                if args.inject == "desync" and g.step == inject_step and distributed:
                    print(
                        f"inject: rank {rank} desync at step {g.step} at {time.time():.3f}",
                        flush=True,
                    )
                    if rank == 0:
                        dist.barrier()  # the fault: a collective in a rank-0-only branch
                    dist.all_reduce(loss.detach().clone())  # every rank: loss for the log
                micro += 1
                if micro % args.grad_accum:
                    continue
                g.clip_grad_norm_(1.0)  # shares its norm with the guard's NaN check
                opt.step()
                opt.zero_grad(set_to_none=True)
                sched.step()
                if args.inject == "sigterm" and g.step == inject_step and rank == 0:
                    os.kill(os.getpid(), signal.SIGTERM)  # what a scheduler's pre-emption sends
                if g.step >= args.steps:
                    break
    elapsed = time.perf_counter() - t0
    end_step = g.step

    if rank == 0 and start_step >= args.steps:
        print(
            f"nothing to do: {args.run_dir} holds a run that already reached step "
            f"{start_step} (resumed from its checkpoint); pass a new --run-dir or more --steps"
        )
    elif rank == 0:
        # Read back what the guard recorded: rank 0's rows of this run (a run_dir can
        # hold earlier runs too; `started_at` tells them apart).
        rows = guardrails.read_metrics(args.run_dir).to_pylist()
        newest = max(r["started_at"] for r in rows if r["rank"] == 0)
        losses = [r["loss"] for r in rows if r["rank"] == 0 and r["started_at"] == newest]
        first = sum(losses[:10]) / len(losses[:10])
        last = sum(losses[-10:]) / len(losses[-10:])
        # A resumed run did not run the steps before its checkpoint: say which it did.
        done = (
            f"steps {start_step + 1}-{end_step} ({end_step - start_step} this run; resumed "
            f"at {start_step})"
            if start_step
            else f"{end_step} steps"
        )
        print(
            f"done: {done} in {elapsed:.1f}s; loss {first:.3f} (first 10 steps) -> "
            f"{last:.3f} (last 10); metrics in {Path(args.run_dir) / 'metrics.parquet'}"
        )
        if args.sample:
            raw_model.eval()
            start = torch.tensor([[data.stoi["\n"]]], device=device)
            print("sample:\n" + data.decode(raw_model.generate(start, args.sample)[0].tolist()))
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
