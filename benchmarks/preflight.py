"""Preflight cost and GuardedDDP step time, under torchrun (2 ranks)::

    # GPUs (NCCL), what benchmarks/gpu_preflight.sh runs:
    torchrun --standalone --nproc-per-node 2 benchmarks/preflight.py --out OUT
    # CPU check (gloo):
    torchrun --standalone --nproc-per-node 2 benchmarks/preflight.py --device cpu --out OUT

Measures, on a GPT-2-small-shaped model (examples/train_gpt.py's GPT: 12 layers, 768
wide, 50257 tokens, 1024 positions, tied head: 124M parameters in 148 tensors):

1. ``param_table`` (the weights checksum) split into its parts: the float64 sums over
   every element and the 64-element strided samples;
2. the whole preflight at guard start (facts, launch checks, one exchange over the
   gloo side group, the comparison): ``Preflight.seconds`` of a guard running only
   the preflight, median of ``--repeats``;
3. the step time of plain ``DistributedDataParallel`` against ``GuardedDDP`` (no guard:
   the comm hook alone), interleaved in blocks so drift hits both alike, same data,
   same model. GPU: bf16 autocast, ``--batch`` x ``--seq`` tokens per rank.

Rank 0 writes ``preflight.json`` and ``preflight.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from train_gpt import GPT

import guardrails
from guardrails.engine.guard import Guard
from guardrails.guards.audit.calls import entry_dict
from guardrails.guards.preflight.facts import SAMPLE_PER_TENSOR, param_table
from guardrails.guards.preflight.preflight import Preflight


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn: Any, device: torch.device, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - t0)
    return out


def checksum_parts(model: torch.nn.Module, device: torch.device, repeats: int) -> dict[str, Any]:
    params = [p.detach() for p in model.parameters()]

    def sums() -> None:  # what param_table does: integer sums of the raw bits
        torch.stack([p.view(torch.int32).sum(dtype=torch.int64) for p in params]).cpu()

    def float_sums() -> None:  # the alternative: float64 sums (need a tolerance)
        torch.stack([torch.sum(p, dtype=torch.float64) for p in params]).cpu()

    def samples() -> None:
        torch.cat(
            [
                p.reshape(-1)[:: max(1, p.numel() // SAMPLE_PER_TENSOR)][
                    :SAMPLE_PER_TENSOR
                ].double()
                for p in params
            ]
        ).cpu()

    return {
        "sums_s": statistics.median(_time(sums, device, repeats)),
        "float64_sums_s": statistics.median(_time(float_sums, device, repeats)),
        "samples_s": statistics.median(_time(samples, device, repeats)),
        "param_table_s": statistics.median(_time(lambda: param_table(model), device, repeats)),
    }


def preflight_seconds(model: torch.nn.Module, run_dir: Path, repeats: int) -> list[float]:
    out = []
    loader = [(torch.zeros(8, 1024, dtype=torch.long),)] * 4
    for i in range(repeats):
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
        pre = Preflight(run_config={"lr": 3e-4, "run": "bench"})
        g = Guard(model, opt, loader, run_dir=run_dir / f"g{i}", components=[pre])
        g.start()
        g.close()
        out.append(pre.seconds)
    return out


def step_times(args: argparse.Namespace, device: torch.device, local_rank: int) -> dict[str, Any]:
    torch.manual_seed(0)
    vocab = args.vocab
    ids = torch.randint(0, vocab, (args.batch, args.seq + 1), device=device)
    x, y = ids[:, :-1], ids[:, 1:]
    ddp_kw: dict[str, Any] = {"device_ids": [local_rank]} if device.type == "cuda" else {}
    models = {}
    for name, cls in (("ddp", DistributedDataParallel), ("guarded_ddp", guardrails.GuardedDDP)):
        torch.manual_seed(0)
        base = GPT(vocab, args.seq, args.layers, args.heads, args.width).to(device)
        model = cls(base, **ddp_kw)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=device.type == "cuda")
        models[name] = (model, opt)
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def run(name: str, n: int) -> float:
        model, opt = models[name]
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(n):
            with amp:
                loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        _sync(device)
        return (time.perf_counter() - t0) / n

    for name in models:  # warm-up: allocator, bucket rebuild, kernels
        run(name, args.warmup)
    blocks: dict[str, list[float]] = {name: [] for name in models}
    for i in range(args.rounds):
        order = list(models) if i % 2 == 0 else list(reversed(models))
        for name in order:
            blocks[name].append(run(name, args.block))
    med = {name: statistics.median(v) for name, v in blocks.items()}
    return {
        "per_step_s": med,
        "blocks_s": blocks,
        "overhead_pct": 100 * (med["guarded_ddp"] / med["ddp"] - 1),
        "shape": f"{args.layers} layers x {args.width} wide, vocab {args.vocab}, "
        f"{args.seq} tokens x batch {args.batch} per rank",
    }


def integration(device: torch.device, local_rank: int, out: Path) -> dict[str, Any]:
    """On this backend, under guardrails.guard with its default components: GuardedDDP's
    buckets reach the auditor (on CUDA the hook runs on the autograd thread); then ranks
    with different seeds and data lengths get ConfigMismatchError on every rank."""
    rank = dist.get_rank()
    ddp_kw: dict[str, Any] = {"device_ids": [local_rank]} if device.type == "cuda" else {}
    res: dict[str, Any] = {}
    torch.manual_seed(0)
    model = guardrails.GuardedDDP(GPT(256, 64, 2, 4, 128).to(device), **ddp_kw)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    data = [torch.randint(0, 256, (4, 65), device=device) for _ in range(5)]
    with guardrails.guard(model, opt, data, run_dir=out / "guarded", metrics=False) as g:
        for ids in g:
            model(ids[:, :-1], ids[:, 1:]).backward()
            opt.step()
            opt.zero_grad()
        entries = list(g.auditor.recent) if g.auditor is not None else []
    sites = [str(entry_dict(e)["site"]) for e in entries]
    res["guarded_steps"] = g.step
    res["bucket_reports"] = sum(s.startswith("DDP gradient all-reduce") for s in sites)
    torch.manual_seed(rank)  # different seeds, and rank 1 gets fewer batches
    model2 = GPT(256, 64, 2, 4, 128).to(device)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=3e-4)
    try:
        with guardrails.guard(model2, opt2, data[: 5 - rank], run_dir=out / "mismatch") as g2:
            for _ in g2:
                pass
        res["mismatch"] = "not raised"
    except guardrails.ConfigMismatchError as exc:
        res["mismatch"] = {"fields": sorted(exc.fields or {}), "message": str(exc)}
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backend", default=None, help="default: nccl on cuda, gloo on cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--width", type=int, default=None)
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--block", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    gpu = args.device == "cuda"
    # CPU: a small step loop (2 layers, 128 wide, 1024 tokens) keeps the run near a
    # minute on 2 cores; the preflight is always measured on the full 124M model.
    args.layers = args.layers or (12 if gpu else 2)
    args.width = args.width or (768 if gpu else 128)
    args.heads = args.heads or (12 if gpu else 4)
    args.vocab = args.vocab or (50257 if gpu else 1024)
    args.seq = args.seq or (1024 if gpu else 64)
    args.batch = args.batch or (8 if gpu else 2)
    args.block = args.block or (10 if gpu else 3)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if gpu:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(args.backend or ("nccl" if gpu else "gloo"))
    rank = dist.get_rank()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        torch.manual_seed(0)
        model = GPT(50257, 1024, 12, 12, 768).to(device)
        n_params = sum(p.numel() for p in model.parameters())
        parts = checksum_parts(model, device, args.repeats)
        pre = preflight_seconds(model, out / f"runs_rank{rank}", args.repeats)
        del model
        steps = step_times(args, device, local_rank)
        checks = integration(device, local_rank, out / f"runs_rank{rank}")
        result = {
            "device": torch.cuda.get_device_name(device) if gpu else "cpu",
            "backend": dist.get_backend(),
            "world_size": dist.get_world_size(),
            "torch": torch.__version__,
            "cpu_threads": torch.get_num_threads(),
            "params": n_params,
            "tensors": 148,
            "checksum": parts,
            "preflight_s": pre,
            "preflight_median_s": statistics.median(pre),
            "step": steps,
            "integration": checks,
        }
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, result)
        if rank == 0:
            (out / "preflight.json").write_text(json.dumps(gathered, indent=2))
            (out / "preflight.md").write_text(_markdown(gathered))
            print(_markdown(gathered))
    finally:
        dist.destroy_process_group()


def _markdown(results: list[dict[str, Any]]) -> str:
    r = results[0]
    lines = [
        f"## Preflight and GuardedDDP ({r['device']}, {r['backend']}, "
        f"{r['world_size']} ranks, torch {r['torch']})",
        "",
        f"GPT-2-small-shaped model: {r['params'] / 1e6:.1f}M parameters.",
        "",
        "| rank | bit sums | (float64 sums) | samples | param_table | preflight at start "
        "(median) | DDP step | GuardedDDP step | overhead |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for rank, x in enumerate(results):
        c, s = x["checksum"], x["step"]
        lines.append(
            f"| {rank} | {c['sums_s'] * 1e3:.1f} ms | ({c['float64_sums_s'] * 1e3:.1f} ms) | "
            f"{c['samples_s'] * 1e3:.1f} ms | "
            f"{c['param_table_s'] * 1e3:.1f} ms | {x['preflight_median_s'] * 1e3:.1f} ms | "
            f"{s['per_step_s']['ddp'] * 1e3:.2f} ms | "
            f"{s['per_step_s']['guarded_ddp'] * 1e3:.2f} ms | {s['overhead_pct']:+.2f}% |"
        )
    lines += ["", f"Step loop: {r['step']['shape']}; medians of interleaved blocks.", ""]
    for rank, x in enumerate(results):
        c = x["integration"]
        m = c["mismatch"]
        lines.append(
            f"- rank {rank}: GuardedDDP under guard: {c['guarded_steps']} steps, "
            f"{c['bucket_reports']} bucket all-reduces reported to the auditor; "
            f"seed + data-length mismatch: "
            + (f"ConfigMismatchError naming {', '.join(m['fields'])}" if isinstance(m, dict) else m)
        )
    mm = r["integration"]["mismatch"]
    if isinstance(mm, dict):
        lines += ["", "```", mm["message"], "```", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
