"""Per-step cost of guardrails.guard() against the same loop unguarded, in one process.

    python benchmarks/overhead.py --device cpu --model tiny          # host overhead
    python benchmarks/overhead.py --device cuda --model gpt2 --batch 8 --seq 1024
    python benchmarks/overhead.py --device cuda --model gpt2 --batch 2 --seq 1024 --compile
    python benchmarks/overhead.py --device cuda --model gpt2 --torch-clip   # the loop clips
    torchrun --nproc-per-node 2 benchmarks/overhead.py --device cuda --model gpt2 --ddp

Method: the plain loop and the guarded loop run alternately (plain, guarded, plain, ...)
`--repeats` times each, `--steps` timed steps per run after `--warmup` untimed ones, so
drift (clocks, caches, other load) hits both alike. A run's time is wall time over its
steps with a device synchronize only at the ends (so no sync inside the timed steps).
Reported: the median per-step time of each variant, the overhead (difference of
medians) in microseconds and percent, and the spread across repeats as the half-width
of the interquartile range of the paired differences, a noise figure: an overhead
smaller than it is below what this run can resolve.

The guarded run uses the default components (GCScheduler, NanGuard, Telemetry), no
tqdm bar. `--item` adds the hand-written NanGuard alternative (skip the step unless
`isfinite(grad_norm).item()`), `--clip` clips the grad norm in every variant (the guarded
one through `g.clip_grad_norm_`), `--torch-clip` clips in every variant with
`torch.nn.utils.clip_grad_norm_` (as most loops do). `--ddp` (under torchrun, NCCL):
plain is `DistributedDataParallel`, guarded is `GuardedDDP` under the guard, each its
own copy of the model with the same seed; figures are rank 0's.
`--clock cpu` times the process's CPU time instead of wall time (less of the other
processes' load on a shared machine shows). `--clock kernels` (CUDA) reports the GPU's
kernel time per step instead, from the profiler (CUPTI), NCCL's kernels left out (they
include the wait for the other ranks): the device work the guard adds, which host
noise does not move (in-process DDP A/Bs by wall time spread 25-30% run to run on
shared H200 hosts; benchmarks/RESULTS.md, "Session 11").
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from train_gpt import GPT

import guardrails
from guardrails.engine import gradnorm


class Tiny(nn.Module):
    """Where step time is tiny, so the guard's host cost shows."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.net(x).squeeze(-1), y)


class Stack(nn.Module):
    """``tensors`` parameter tensors (weights and biases of tensors/2 small layers): the
    guard's host cost against the number of tensors, everything else tiny."""

    def __init__(self, tensors: int) -> None:
        super().__init__()
        self.net = nn.Sequential(*[nn.Linear(16, 16) for _ in range(tensors // 2)])

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.net(x).mean(-1), y)


def build(args: argparse.Namespace, device: torch.device, wrap=None):
    torch.manual_seed(0)
    if args.model == "stack":
        model = Stack(args.tensors).to(device)
        data = [
            (torch.randn(8, 16, device=device), torch.randn(8, device=device)) for _ in range(8)
        ]
    elif args.model == "tiny":
        model: nn.Module = Tiny().to(device)
        data = [
            (torch.randn(8, 16, device=device), torch.randn(8, device=device)) for _ in range(8)
        ]
    else:
        cfg = {"gpt2": (12, 12, 768), "gpt2-mini": (4, 4, 256)}[args.model]
        model = GPT(50304, args.seq, *cfg).to(device)
        data = [
            (
                torch.randint(0, 50304, (args.batch, args.seq), device=device),
                torch.randint(0, 50304, (args.batch, args.seq), device=device),
            )
            for _ in range(4)
        ]
    fused = device.type == "cuda"
    if wrap is not None:  # --ddp: the wrapper is the model the loop trains
        model = wrap(model, device_ids=[device.index])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
    step_model = torch.compile(model) if args.compile else model
    return model, step_model, opt, data


def cycle(data, n):
    for i in range(n):
        yield data[i % len(data)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def kernel_seconds(
    prof: torch.profiler.profile, device_type: str = "cuda", by_name: dict | None = None
) -> float:
    """The busy time of ``device_type``'s kernels a profile recorded, NCCL's left out,
    in seconds (overlapping kernels count each). ``by_name`` (optional) gets each
    kernel name's microseconds and launches added to it."""
    from torch.autograd import DeviceType

    kind = DeviceType.CUDA if device_type == "cuda" else DeviceType.CPU
    total = 0.0
    for e in prof.events():
        if e.device_type == kind and "nccl" not in e.name.lower():
            us = e.time_range.elapsed_us()
            total += us
            if by_name is not None:
                spent, n = by_name.get(e.name, (0.0, 0))
                by_name[e.name] = (spent + us, n + 1)
    return 1e-6 * total


#: --clock kernels: per variant, each kernel name's (microseconds, launches) summed over
#: the timed runs, and the number of timed steps they cover.
KERNELS: dict[str, dict[str, tuple[float, int]]] = {}
KERNEL_STEPS: dict[str, int] = {}


VARIANTS = ("plain", "guarded", "graph_norm", "eager_norm", "item", "without")
# --ddp-split's extra variants (see main): plain DDP under the guard, GuardedDDP alone,
# plain DDP with torch's Python hook and with DDP's C++ hook, plain DDP built last.
SPLIT = ("ddp_guard", "gddp_alone", "torch_hook", "ddp_cpp", "plain_late")
GRAPH_RUNS: list[dict[str, int]] = []  # the grad norm graph's counters, per guarded run
SHARED: list[tuple[str, int]] = []  # (source, steps) of grad_norm_shared events
KERNEL_NORM_STEPS: dict[str, int] = {}  # variant -> steps whose norm the kernel took


def one_run(args, device, model, step_model, opt, data, variant: str) -> float:
    """Seconds per step over `args.steps` timed steps.

    plain: the bare loop. guarded: the same loop under guardrails.guard() (defaults).
    item: the hand-written alternative to NanGuard, skip the step when
    ``torch.isfinite(grad_norm).item()`` is false (one host sync per step).
    graph_norm: guarded, with ``graph_grad_norm=True`` (the grad norm replayed as a
    CUDA graph when the gradients are where a captured graph expects them).
    eager_norm: guarded, with the guard's own norm taken eagerly (``_foreach_norm``)
    instead of by its kernel over the gradients' addresses (the CUDA default).
    With --clip, every variant clips the grad norm to 1.0 (guarded: through
    g.clip_grad_norm_, which shares its norm with the guard).
    """
    amp = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if (device.type == "cuda" and args.bf16)
        else None
    )
    total = args.warmup + args.steps

    params = list(model.parameters())
    clip = torch.nn.utils.clip_grad_norm_  # looked up at import, as many loops do
    clock = time.process_time if args.clock == "cpu" else time.perf_counter

    def loop(batches, g=None):
        t0 = None
        prof = None
        for i, (x, y) in enumerate(batches):
            if i == args.warmup:
                sync(device)
                if args.clock == "kernels":
                    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
                    prof.__enter__()
                t0 = clock()
            if amp is not None:
                with amp:
                    loss = step_model(x, y)
            else:
                loss = step_model(x, y)
            loss.backward()
            if variant == "item":
                norm = clip(params, 1.0 if args.clip else math.inf)
                if torch.isfinite(norm).item():  # the host sync NanGuard avoids
                    opt.step()
            else:
                if args.torch_clip:
                    clip(params, 1.0)
                elif args.clip:
                    g.clip_grad_norm_(1.0) if g is not None else clip(params, 1.0)
                opt.step()
            opt.zero_grad(set_to_none=True)
        sync(device)
        if prof is not None:
            prof.__exit__(None, None, None)
            KERNEL_STEPS[variant] = KERNEL_STEPS.get(variant, 0) + args.steps
            return kernel_seconds(prof, by_name=KERNELS.setdefault(variant, {})) / args.steps
        return (clock() - t0) / args.steps

    if variant not in ("guarded", "graph_norm", "eager_norm", "ddp_guard", "without"):
        return loop(cycle(data, total))
    gradnorm.USE_KERNEL = variant != "eager_norm"
    # --without: the default guard less these sections, so each one's share shows.
    off = dict.fromkeys(args.without.split(","), False) if variant == "without" else {}
    with tempfile.TemporaryDirectory() as d:
        with guardrails.guard(
            step_model,
            opt,
            cycle(data, total),
            run_dir=d,
            progress=False,
            graph_grad_norm=variant == "graph_norm",
            **off,
        ) as g:
            per_step = loop(g, g)
            KERNEL_NORM_STEPS[variant] = KERNEL_NORM_STEPS.get(variant, 0) + g._norm.kernel_steps
        gradnorm.USE_KERNEL = True
        from guardrails.metrics.events import read_events

        for event in read_events(Path(d)):
            if event["kind"] == "grad_norm_graph":  # replays/eager/captures of this run
                GRAPH_RUNS.append({k: event[k] for k in ("replays", "eager", "captures")})
            if event["kind"] == "grad_norm_shared":  # the norm came from a clip / buckets
                SHARED.append((event.get("source", "?"), event["steps"]))
    return per_step


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", default="tiny", choices=["tiny", "gpt2", "gpt2-mini", "stack"])
    p.add_argument("--tensors", type=int, default=150, help="--model stack: parameter tensors")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--repeats", type=int, default=11)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--no-bf16", dest="bf16", action="store_false")
    p.add_argument("--clip", action="store_true", help="clip the grad norm to 1.0 in every variant")
    p.add_argument(
        "--torch-clip",
        action="store_true",
        help="clip with torch.nn.utils.clip_grad_norm_ in every variant",
    )
    p.add_argument("--ddp", action="store_true", help="DDP vs GuardedDDP, under torchrun")
    p.add_argument(
        "--ddp-split",
        action="store_true",
        help="with --ddp: also DDP+guard, GuardedDDP alone, DDP with torch's Python "
        "allreduce_hook and with DDP's C++ one, plain DDP built last",
    )
    p.add_argument(
        "--only",
        choices=["plain", "guarded"],
        help="time one variant in this process (an A/B across processes: run each in turn)",
    )
    p.add_argument("--item", action="store_true", help="also time the per-step .item() check")
    p.add_argument(
        "--graph-norm", action="store_true", help="also time the guard with graph_grad_norm=True"
    )
    p.add_argument(
        "--eager-norm",
        action="store_true",
        help="also time the guard with its norm taken eagerly, not by its kernel (CUDA)",
    )
    p.add_argument(
        "--clock",
        choices=["wall", "cpu", "kernels"],
        default="wall",
        help="wall: time.perf_counter; cpu: the process's CPU time (time.process_time), "
        "which leaves out the time other processes hold the core (a loaded CPU machine); "
        "kernels (CUDA): the GPU's kernel time per step, NCCL's left out",
    )
    p.add_argument("--variants", help="with --ddp-split: only these extra variants (a,b,...)")
    p.add_argument(
        "--shuffle", action="store_true", help="a new (seeded) order of the variants each repeat"
    )
    p.add_argument(
        "--without",
        help="also time the guard with these sections off (a,b,...: e.g. nan), each "
        "section's share of the overhead",
    )
    p.add_argument("--out", help="append a JSON line with the result here")
    args = p.parse_args()
    device = torch.device(args.device)
    if args.clock == "kernels" and device.type != "cuda":
        p.error("--clock kernels times CUDA kernels: use --device cuda")
    if device.type == "cpu":
        torch.set_num_threads(1)  # a steadier clock; the guard's cost is single-threaded host work
    if args.ddp:
        import os

        from torch.nn.parallel import DistributedDataParallel

        torch.distributed.init_process_group("nccl")
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        # --only: one model in the process, as a real job has.
        plain_setup = (
            build(args, device, DistributedDataParallel) if args.only != "guarded" else None
        )
        guarded_setup = build(args, device, guardrails.GuardedDDP) if args.only != "plain" else None
        setups = {"plain": plain_setup, "guarded": guarded_setup}
        # --ddp-split: where a DDP overhead comes from: plain DDP under the guard
        # (guard, no GuardedDDP), and GuardedDDP without a guard.
        setups["ddp_guard"], setups["gddp_alone"] = plain_setup, guarded_setup
        if args.ddp_split:
            # What a comm hook alone costs DDP (GuardedDDP registers one): plain DDP
            # with torch's own Python all-reduce hook (default_hooks.allreduce_hook),
            # and with DDP's C++ one.
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            setups["torch_hook"] = build(args, device, DistributedDataParallel)
            setups["torch_hook"][0].register_comm_hook(None, default_hooks.allreduce_hook)
            setups["ddp_cpp"] = build(args, device, DistributedDataParallel)
            setups["ddp_cpp"][0]._register_builtin_comm_hook(
                torch.distributed.BuiltinCommHookType.ALLREDUCE
            )
            # Plain DDP again, built last: in-process A/Bs compare distinct model
            # instances, and the first-built one may be faster for its own reasons.
            setups["plain_late"] = build(args, device, DistributedDataParallel)
    else:
        setup = build(args, device)
        setups = {v: setup for v in VARIANTS}
    variants = (
        ["plain", "guarded"]
        + (["graph_norm"] if args.graph_norm else [])
        + (["eager_norm"] if args.eager_norm else [])
        + (["item"] if args.item else [])
        + (["without"] if args.without else [])
        + ([*SPLIT] if args.ddp_split else [])
    )
    if args.variants:  # a subset (plain and guarded stay: the result compares them)
        keep = {"plain", "guarded", *args.variants.split(",")}
        variants = [v for v in variants if v in keep]
    if args.only:
        variants = [args.only]
    for v in variants:  # compile / allocator / lazy optimizer state warm-up
        one_run(args, device, *setups[v], v)
    KERNELS.clear()  # --clock kernels: the timed runs only
    KERNEL_STEPS.clear()
    times: dict[str, list[float]] = {v: [] for v in variants}
    order = list(variants)
    shuffle = random.Random(0).shuffle  # the same order on every rank (DDP)
    for _ in range(args.repeats):
        if args.shuffle:  # no variant always runs first, or after the same one
            shuffle(order)
        for v in order:
            times[v].append(one_run(args, device, *setups[v], v))
    if args.only:
        med = statistics.median(times[args.only])
        rank = torch.distributed.get_rank() if args.ddp else 0
        print(f"ONLY {args.only} rank {rank}: {med * 1e6:.1f} us/step, runs {times[args.only]}")
        if args.ddp:
            torch.distributed.destroy_process_group()
        return
    plain, guarded = times["plain"], times["guarded"]
    diffs = sorted(g - q for g, q in zip(guarded, plain, strict=True))
    q1, _, q3 = statistics.quantiles(diffs, n=4)
    med_plain, med_guarded = statistics.median(plain), statistics.median(guarded)
    result = {
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "model": args.model,
        "batch": args.batch if args.model not in ("tiny", "stack") else 8,
        "seq": args.seq if args.model not in ("tiny", "stack") else None,
        "tensors": sum(1 for _ in setups["guarded"][0].parameters()),
        "compile": args.compile,
        "bf16": bool(args.bf16 and device.type == "cuda"),
        "steps": args.steps,
        "repeats": args.repeats,
        "plain_step_us": med_plain * 1e6,
        "guarded_step_us": med_guarded * 1e6,
        "overhead_us": (med_guarded - med_plain) * 1e6,
        "overhead_pct": 100 * (med_guarded - med_plain) / med_plain,
        "paired_diff_median_us": statistics.median(diffs) * 1e6,
        "noise_us": (q3 - q1) / 2 * 1e6,
        "clip": "torch" if args.torch_clip else ("guard" if args.clip else None),
        "ddp_world": torch.distributed.get_world_size() if args.ddp else None,
        "clock": args.clock,
        "runs_us": {v: [round(t * 1e6, 1) for t in ts] for v, ts in times.items()},
    }
    for v in SPLIT:
        if v in times:
            med = statistics.median(times[v])
            result[f"{v}_step_us"] = med * 1e6
            result[f"{v}_overhead_pct"] = 100 * (med - med_plain) / med_plain
            print(f"  {v:10s} {med * 1e6:10.1f} us/step ({result[f'{v}_overhead_pct']:+.2f}%)")
    if args.ddp and torch.distributed.get_rank() != 0:
        torch.distributed.destroy_process_group()
        return
    result["norm_shared"] = sorted({src for src, _ in SHARED})
    result["norm_shared_steps"] = sum(n for _, n in SHARED)
    if GRAPH_RUNS:
        result["graph_replays"] = sum(r["replays"] for r in GRAPH_RUNS)
        result["graph_eager"] = sum(r["eager"] for r in GRAPH_RUNS)
        result["graph_captures"] = sum(r["captures"] for r in GRAPH_RUNS)
    result["kernel_norm_steps"] = dict(KERNEL_NORM_STEPS)
    if args.without:
        result["without"] = args.without
    for extra in ("graph_norm", "eager_norm", "without"):
        if extra not in times:
            continue
        other = times[extra]
        g_diffs = sorted(e - q for e, q in zip(other, plain, strict=True))
        g1, _, g3 = statistics.quantiles(g_diffs, n=4)
        result[f"{extra}_step_us"] = statistics.median(other) * 1e6
        result[f"{extra}_overhead_us"] = (statistics.median(other) - med_plain) * 1e6
        result[f"{extra}_overhead_pct"] = 100 * (statistics.median(other) - med_plain) / med_plain
        result[f"{extra}_noise_us"] = (g3 - g1) / 2 * 1e6
    if args.item:
        med_item = statistics.median(times["item"])
        result["item_step_us"] = med_item * 1e6
        result["item_overhead_pct"] = 100 * (med_item - med_plain) / med_plain
    print(
        f"{result['device']} torch {result['torch']} model={args.model} "
        f"compile={args.compile} bf16={result['bf16']}\n"
        f"  plain   {result['plain_step_us']:10.1f} us/step\n"
        f"  guarded {result['guarded_step_us']:10.1f} us/step\n"
        f"  overhead {result['overhead_us']:+.1f} us/step ({result['overhead_pct']:+.2f}%), "
        f"paired median {result['paired_diff_median_us']:+.1f} us, "
        f"noise +/-{result['noise_us']:.1f} us\n"
        f"  tensors {result['tensors']}, grad norm shared by {result['norm_shared']} "
        f"at {result['norm_shared_steps']} steps"
    )
    if GRAPH_RUNS:
        print(
            f"  grad norm graph: {result['graph_replays']} steps replayed, "
            f"{result['graph_eager']} eager, {result['graph_captures']} captures"
        )
    for extra, label in (
        ("graph_norm", "graph_grad_norm"),
        ("eager_norm", "eager norm"),
        ("without", f"without {args.without}"),
    ):
        if extra in times:
            print(
                f"  guarded, {label} {result[f'{extra}_step_us']:10.1f} us/step "
                f"({result[f'{extra}_overhead_us']:+.1f} us, "
                f"{result[f'{extra}_overhead_pct']:+.2f}%, "
                f"noise +/-{result[f'{extra}_noise_us']:.1f})"
            )
    print(f"  steps whose norm the kernel took: {result['kernel_norm_steps']}")
    if args.item:
        print(
            f"  isfinite(norm).item() per step: {result['item_step_us']:10.1f} us/step "
            f"({result['item_overhead_pct']:+.2f}%)"
        )
    if KERNELS:
        result["kernels_added"] = added_kernels()
        print("  kernels the guarded loop adds, per step (us, launches):")
        for name, us, n in result["kernels_added"][:12]:
            print(f"    {us:+9.1f} us {n:+6.1f}  {name[:110]}")
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(result) + "\n")
    if args.ddp:
        torch.distributed.destroy_process_group()


def added_kernels() -> list[tuple[str, float, float]]:
    """--clock kernels: (kernel name, microseconds, launches) per step that the guarded
    runs have over the plain ones, largest first."""
    per_step = {
        v: {k: (us / KERNEL_STEPS[v], n / KERNEL_STEPS[v]) for k, (us, n) in table.items()}
        for v, table in KERNELS.items()
    }
    plain, guarded = per_step.get("plain", {}), per_step.get("guarded", {})
    rows = []
    for name in set(plain) | set(guarded):
        gu, gn = guarded.get(name, (0.0, 0.0))
        pu, pn = plain.get(name, (0.0, 0.0))
        rows.append((name, round(gu - pu, 2), round(gn - pn, 2)))
    return sorted(rows, key=lambda r: -abs(r[1]))


if __name__ == "__main__":
    main()
