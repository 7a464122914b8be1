"""Benchmark mode against an external A/B: does ``guard(..., benchmark=True)`` tell the
truth about what the guard costs?

The external A/B runs the same training script as separate processes, interleaved
(plain, guarded, guarded, plain, ...), each for ``--steps`` steps, and takes each run's
median step time after ``--warmup`` steps; the guard's cost is the median over rounds of
(guarded - plain) within a round, with a 95% bootstrap interval over rounds. Benchmark
mode runs the guarded script with ``benchmark=True`` ``--bench-runs`` times and reports
its own estimate and interval each time. They agree when benchmark mode's estimate lies
inside the external interval, or the two intervals overlap.

Subjects: ``example`` is ``examples/train_gpt.py``'s model, data, optimizer and schedule
(imported from the script, trained in this file's loop so the plain variant needs no
guard); ``refgpt`` is the README's reference GPT-2-shaped model on random tokens.

    python benchmarks/benchmark_ab.py --subject example --device cpu --rounds 8
    python benchmarks/benchmark_ab.py --subject refgpt --size gpt2 --batch 8 --seq 1024 \
        --device cuda --steps 300 --rounds 6 --out ab.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------- one run


def _subject(a: argparse.Namespace, device):  # -> (model, opt, sched, batches)
    import torch

    torch.manual_seed(0)
    if a.subject == "example":
        spec = importlib.util.spec_from_file_location("train_gpt", ROOT / "examples/train_gpt.py")
        ex = importlib.util.module_from_spec(spec)
        assert spec.loader is not None
        spec.loader.exec_module(ex)
        data = ex.CharWindows(ex.DATA.read_text(), 64)
        sampler = torch.utils.data.RandomSampler(
            data,
            replacement=True,
            num_samples=a.steps * a.batch,
            generator=torch.Generator().manual_seed(0),
        )
        loader = torch.utils.data.DataLoader(data, batch_size=a.batch, sampler=sampler)
        model = ex.GPT(len(data.chars), 64, 4, 4, 128).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, fused=True)
        warm = max(1, a.steps // 10)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))

        def step_fn(batch):
            x, y, w = (t.to(device, non_blocking=True) for t in batch)
            return model(x, y, w)

        return model, opt, sched, loader, step_fn
    from guardrails.cli.bench import SIZES, RefGPT

    n_layer, n_head, n_embd, vocab = SIZES[a.size]
    model = RefGPT(n_layer, n_head, n_embd, vocab, a.seq).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (16, a.batch, a.seq + 1), generator=g)
    loader = [tokens[i % 16] for i in range(a.steps)]

    def step_fn(t):
        t = t.to(device, non_blocking=True)
        return model(t[:, :-1], t[:, 1:])

    return model, opt, None, loader, step_fn


def run_once(a: argparse.Namespace) -> dict:
    import torch

    import guardrails

    device = torch.device(a.device)
    model, opt, sched, loader, step_fn = _subject(a, device)
    cuda = device.type == "cuda"
    marks: list = []

    def mark() -> None:
        if cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            marks.append(ev)
        else:
            marks.append(time.perf_counter())

    def train(batches) -> None:
        mark()
        for batch in batches:
            loss = step_fn(batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if sched is not None:
                sched.step()
            mark()

    table = None
    if a.run == "plain":
        train(loader)
    else:
        with tempfile.TemporaryDirectory() as run_dir:
            with guardrails.guard(
                model,
                opt,
                loader,
                scheduler=sched,
                run_dir=run_dir,
                progress=False,
                benchmark=a.run == "bench",
            ) as g:
                train(g)
            if a.run == "bench":
                table = json.loads((Path(run_dir) / "benchmark.json").read_text())
    if cuda:
        torch.cuda.synchronize()
        ms = [marks[i].elapsed_time(marks[i + 1]) for i in range(len(marks) - 1)]
    else:
        ms = [(marks[i + 1] - marks[i]) * 1e3 for i in range(len(marks) - 1)]
    steady = ms[a.warmup :]
    return {"run": a.run, "median_ms": float(np.median(steady)), "steps": len(ms), "table": table}


# ---------------------------------------------------------------------- the driver


def _child(a: argparse.Namespace, run: str) -> dict:
    args = [sys.executable, __file__, "--child", run]
    for k in ("subject", "device", "size", "batch", "seq", "steps", "warmup"):
        args += [f"--{k}", str(getattr(a, k))]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(args, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{run} run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _ci(x: np.ndarray, n: int = 5000) -> tuple[float, float]:
    rng = np.random.default_rng(0)
    boot = np.median(rng.choice(x, (n, len(x))), axis=1)
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return float(lo), float(hi)


def _external(rounds: list[dict]) -> dict:
    diff = np.array([x["guarded"] - x["plain"] for x in rounds])
    plain = float(np.median([x["plain"] for x in rounds]))
    lo, hi = _ci(diff)
    ext = {
        "overhead_ms": float(np.median(diff)),
        "ci_ms": [lo, hi],
        "plain_ms": plain,
        "overhead_pct": 100 * float(np.median(diff)) / plain,
        "rounds": rounds,
    }
    print(
        f"external A/B: {ext['overhead_ms'] * 1e3:+.0f} us ({ext['overhead_pct']:+.2f}%), "
        f"95% [{lo * 1e3:+.0f}, {hi * 1e3:+.0f}] us over {len(rounds)} rounds; plain step "
        f"{plain:.3f} ms",
        flush=True,
    )
    return ext


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--subject", choices=["example", "refgpt"], default="example")
    p.add_argument("--device", default="cpu")
    p.add_argument("--size", default="gpt2")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--bench-runs", type=int, default=3)
    p.add_argument("--out", help="write the results (JSON) here")
    p.add_argument(
        "--external-ci-us",
        type=float,
        nargs=2,
        help="with --rounds 0: compare with this external A/B interval (us) from an "
        "earlier call on the same machine instead of measuring it again",
    )
    p.add_argument("--child", dest="run", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.run:
        print(json.dumps(run_once(a)))
        return
    rounds = []
    for r in range(a.rounds):
        order = ("plain", "guarded") if r % 2 == 0 else ("guarded", "plain")
        res = {run: _child(a, run)["median_ms"] for run in order}
        rounds.append(res)
        print(
            f"round {r}: plain {res['plain']:.3f} ms, guarded {res['guarded']:.3f} ms", flush=True
        )
    if not rounds:
        lo, hi = (v / 1e3 for v in a.external_ci_us)
        external = {"ci_ms": [lo, hi], "given": True}
    else:
        external = _external(rounds)
        lo, hi = external["ci_ms"]
    bench = []
    for i in range(a.bench_runs):
        t = _child(a, "bench")["table"]
        b_lo, b_hi = t["overhead_ci_ms"]
        inside = lo <= t["overhead_ms"] <= hi
        overlap = b_lo <= hi and lo <= b_hi
        bench.append({**t, "estimate_inside_external_ci": inside, "intervals_overlap": overlap})
        print(
            f"benchmark mode run {i}: {t['overhead_ms'] * 1e3:+.0f} us "
            f"({t['overhead_pct']:+.2f}%), 95% [{b_lo * 1e3:+.0f}, {b_hi * 1e3:+.0f}] us, "
            f"resolved={t['resolved']}; inside external CI: {inside}; overlap: {overlap}",
            flush=True,
        )
    result = {
        "args": {k: v for k, v in vars(a).items() if k != "run"},
        "external": external,
        "benchmark_mode": bench,
    }
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1, default=str))
    if not all(b["intervals_overlap"] for b in bench):
        print("DISAGREE: benchmark mode's interval misses the external A/B's", flush=True)


if __name__ == "__main__":
    main()
