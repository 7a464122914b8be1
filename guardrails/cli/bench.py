"""``python -m guardrails bench``: what each guard costs on a reference model, against the
same loop unguarded and against the checks people write by hand, in one process.

    python -m guardrails bench                                  # GPT-2 small on CUDA, tiny on CPU
    python -m guardrails bench --size gpt2 --batch 2 --seq 1024 --compile
    torchrun --nproc-per-node 2 -m guardrails bench             # DDP over NCCL / gloo
    python -m guardrails bench --size tiny --steps 20 --json out.json   # CI-sized

The reference model is GPT-2-shaped (12 layers, 12 heads, 768 wide, 50304 tokens,
124M parameters; ``--size gpt2-mini``: 4 x 256; ``tiny``: 2 x 64, where the host cost
shows), trained with a fused AdamW (on CUDA) in bf16 autocast on random tokens.

Variants, each a separate timed run of the same loop:

* ``plain``: the loop, unguarded (the baseline);
* ``guarded``: ``guardrails.guard()`` with every default component;
* ``only:<Component>``: a ``Guard`` running that one default component (the per-component
  cost; the engine's own cost is in each);
* ``item``: the hand-written loss log, ``loss.item()`` every step;
* ``isfinite``: the hand-written NaN check, skip the step unless
  ``torch.isfinite(clip_grad_norm_(...)).item()``;
* ``anomaly``: ``torch.autograd.detect_anomaly()`` (timed over fewer steps: it is slow);

Under torchrun the model is wrapped in DDP. ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (torch's
collective checker) cannot be switched on for one variant: torch reads it when the
process group is made (and DDP over a group wrapped later crashes, torch 2.13), so run
the same command with it set and compare the ``plain`` rows; the header shows the level.

Method: the variants run in turn (plain, guarded, ..., plain, guarded, ...) ``--repeats``
times, ``--steps`` timed steps each after ``--warmup``, with a device synchronize only
at the ends of a run. Reported per variant: the median step time, the overhead over
``plain`` (difference of medians, and %), and a noise figure (half the interquartile
range of the paired differences); an overhead below the noise is below what the run
can resolve, and the table says so.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

SIZES = {"tiny": (2, 2, 64, 1024), "gpt2-mini": (4, 4, 256, 50304), "gpt2": (12, 12, 768, 50304)}


class RefGPT(nn.Module):
    """A GPT-2-shaped decoder from torch's own blocks (pre-norm, GELU, causal SDPA)."""

    def __init__(self, n_layer: int, n_head: int, n_embd: int, vocab: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, n_embd)
        self.pos = nn.Embedding(seq, n_embd)
        layer = nn.TransformerEncoderLayer(
            n_embd,
            n_head,
            4 * n_embd,
            dropout=0.0,
            activation="gelu",
            batch_first=True,
            norm_first=True,
        )
        self.blocks = nn.TransformerEncoder(layer, n_layer, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied, as in GPT-2

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = self.tok(x) + self.pos(torch.arange(t, device=x.device))
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=x.device)
        h = self.blocks(h, mask=mask, is_causal=True)
        logits = self.head(self.norm(h))
        return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cycle(data: list[Any], n: int) -> Iterator[Any]:
    for i in range(n):
        yield data[i % len(data)]


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
        cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
        if self.distributed and not dist.is_initialized():
            if cuda:
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group("nccl" if cuda else "gloo")
        self.device = torch.device(f"cuda:{torch.cuda.current_device()}" if cuda else "cpu")
        size = args.size or ("gpt2" if cuda else "tiny")
        self.size = size
        if args.seq is None:
            args.seq = 64 if size == "tiny" else 1024
        n_layer, n_head, n_embd, vocab = SIZES[size]
        torch.manual_seed(0)
        self.model = RefGPT(n_layer, n_head, n_embd, vocab, args.seq).to(self.device)
        self.step_model: nn.Module = self.model
        if self.distributed:
            from torch.nn.parallel import DistributedDataParallel as DDP

            ids = [self.device.index] if cuda else None
            self.step_model = DDP(self.model, device_ids=ids)
        if args.compile:
            self.step_model = torch.compile(self.step_model)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=cuda)
        g = torch.Generator().manual_seed(0)
        self.data = [
            (
                torch.randint(0, vocab, (args.batch, args.seq), generator=g).to(self.device),
                torch.randint(0, vocab, (args.batch, args.seq), generator=g).to(self.device),
            )
            for _ in range(4)
        ]
        self.amp = cuda and args.dtype == "bf16"
        self.params = list(self.model.parameters())

    # ------------------------------------------------------------------ one timed run

    def run(self, variant: str) -> float:
        """Seconds per step of one run of ``variant``."""
        a = self.args
        steps = max(2, a.steps // 10) if variant == "anomaly" else a.steps
        total = a.warmup + steps
        model, opt, params = self.step_model, self.opt, self.params
        clip = torch.nn.utils.clip_grad_norm_

        def loop(batches: Any, g: Any = None) -> float:
            t0 = time.perf_counter()
            for i, (x, y) in enumerate(batches):
                if i == a.warmup:
                    _sync(self.device)
                    t0 = time.perf_counter()
                ctx = (
                    torch.autocast("cuda", dtype=torch.bfloat16)
                    if self.amp
                    else contextlib.nullcontext()
                )
                with ctx:
                    loss = model(x, y)
                loss.backward()
                if variant == "isfinite":
                    norm = clip(params, 1.0 if a.clip else math.inf)
                    if torch.isfinite(norm).item():  # the host sync NanGuard avoids
                        opt.step()
                else:
                    if a.clip:
                        g.clip_grad_norm_(1.0) if g is not None else clip(params, 1.0)
                    opt.step()
                if variant == "item":
                    loss.item()  # the hand-written per-step loss log
                opt.zero_grad(set_to_none=True)
            _sync(self.device)
            return (time.perf_counter() - t0) / steps

        batches = _cycle(self.data, total)
        if variant == "anomaly":
            with warnings.catch_warnings():  # "Anomaly Detection has been enabled": we know
                warnings.simplefilter("ignore", UserWarning)
                with torch.autograd.detect_anomaly(check_nan=True):
                    return loop(batches)
        if variant not in ("guarded",) and not variant.startswith("only:"):
            return loop(batches)
        with tempfile.TemporaryDirectory() as d:
            guard = self._guard(variant, batches, d)
            with guard as g:
                return loop(g, g)

    def _guard(self, variant: str, batches: Any, run_dir: str) -> Any:
        from guardrails._factory import guard
        from guardrails.engine.guard import Guard

        knobs: dict[str, Any] = {"run_dir": run_dir, "progress": False, "resume": None}
        full = guard(self.step_model, self.opt, batches, **knobs)
        if variant == "guarded":
            return full
        wanted = variant.removeprefix("only:")
        mine = [c for c in full.components if type(c).__name__ == wanted]
        return Guard(self.step_model, self.opt, batches, run_dir=run_dir, components=mine)

    def component_names(self) -> list[str]:
        from guardrails._factory import guard

        with tempfile.TemporaryDirectory() as d:
            g = guard(self.step_model, self.opt, [], run_dir=d, resume=None)
            return [type(c).__name__ for c in g.components]


def measure(bench: Bench, variants: list[str], repeats: int) -> dict[str, list[float]]:
    for v in variants:  # compile, allocator, lazy optimizer state
        bench.run(v)
    times: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(repeats):
        for v in variants:
            times[v].append(bench.run(v))
    return times


def summarize(times: dict[str, list[float]]) -> list[dict[str, Any]]:
    plain = times["plain"]
    base = statistics.median(plain)
    rows = []
    for v, ts in times.items():
        med = statistics.median(ts)
        diffs = sorted(t - p for t, p in zip(ts, plain, strict=True))
        noise = 0.0
        if len(diffs) >= 2:
            q1, _, q3 = statistics.quantiles(diffs, n=4)
            noise = (q3 - q1) / 2
        over = med - base
        rows.append(
            {
                "variant": v,
                "step_ms": med * 1e3,
                "overhead_us": over * 1e6,
                "overhead_pct": 100 * over / base,
                "noise_us": noise * 1e6,
                "resolved": v == "plain" or abs(over) > noise,
            }
        )
    return rows


def render(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [
        f"guardrails bench: {meta['size']} ({meta['params'] / 1e6:.1f}M params) "
        f"batch {meta['batch']}x{meta['seq']} on {meta['device']}, {meta['world_size']} rank(s), "
        f"compile={meta['compile']}, dtype={meta['dtype']}, torch {meta['torch']}"
        + (
            f", TORCH_DISTRIBUTED_DEBUG={meta['distributed_debug']}"
            if meta["world_size"] > 1
            else ""
        ),
        f"{'variant':<24}{'ms/step':>10}{'overhead':>14}{'%':>9}{'noise':>12}",
    ]
    for r in rows:
        over = "" if r["variant"] == "plain" else f"{r['overhead_us']:+.0f} us"
        pct = "" if r["variant"] == "plain" else f"{r['overhead_pct']:+.2f}"
        noise = "" if r["variant"] == "plain" else f"+/-{r['noise_us']:.0f} us"
        flag = "" if r["resolved"] else "  (below noise)"
        lines.append(f"{r['variant']:<24}{r['step_ms']:>10.3f}{over:>14}{pct:>9}{noise:>12}{flag}")
    return "\n".join(lines)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "bench",
        help="per-step cost of each guard on a GPT-2-shaped model vs the unguarded loop",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--size", choices=list(SIZES), help="default: gpt2 on CUDA, tiny on CPU")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, help="default: 1024 (64 for --size tiny)")
    p.add_argument("--steps", type=int, default=30, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="CUDA autocast")
    p.add_argument("--clip", action="store_true", help="clip grad norms to 1.0 in every variant")
    p.add_argument(
        "--variants",
        help="comma-separated subset (default: plain, guarded, only:<each component>, item, "
        "isfinite, anomaly)",
    )
    p.add_argument("--json", type=Path, help="also write the result as JSON here")
    p.add_argument(
        "--checkpoint",
        action="store_true",
        help="instead: time a checkpoint save on --dir against the disk's own speed",
    )
    p.add_argument("--dir", type=Path, default=Path("."), help="with --checkpoint: the disk")
    p.add_argument("--checkpoint-gb", type=float, default=1.0, help="with --checkpoint: GB")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    if args.checkpoint:
        from guardrails.cli import bench_checkpoint

        cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
        device = torch.device("cuda" if cuda else "cpu")
        print(bench_checkpoint.main(args.dir, args.checkpoint_gb, device))
        return 0
    wanted = args.variants.split(",") if args.variants else None
    bench = Bench(args)
    if wanted is None:
        variants = ["plain", "guarded"]
        variants += [f"only:{n}" for n in bench.component_names()]
        variants += ["item", "isfinite", "anomaly"]
    else:
        variants = ["plain", *[v for v in wanted if v != "plain"]]
    if bench.device.type == "cpu":
        torch.set_num_threads(1)  # a steadier clock; the guards' cost is host work
    times = measure(bench, variants, args.repeats)
    rows = summarize(times)
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "host": platform.node(),
        "device": (
            torch.cuda.get_device_name(bench.device)
            if bench.device.type == "cuda"
            else platform.processor() or "cpu"
        ),
        "torch": torch.__version__,
        "size": bench.size,
        "params": sum(p.numel() for p in bench.model.parameters()),
        "batch": args.batch,
        "seq": args.seq,
        "compile": args.compile,
        "dtype": args.dtype if bench.amp else "fp32",
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "distributed_debug": os.environ.get("TORCH_DISTRIBUTED_DEBUG", "OFF"),
        "steps": args.steps,
        "repeats": args.repeats,
    }
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        print(render(meta, rows))
        if args.json:
            args.json.write_text(json.dumps({**meta, "rows": rows, "times_s": times}, indent=1))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0
