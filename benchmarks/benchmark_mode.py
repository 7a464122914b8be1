"""guard(..., benchmark=True) on the reference GPT-2-shaped model: the in-loop
benchmark's own table, for RESULTS.md.

    python benchmarks/benchmark_mode.py --batch 8 --seq 1024 --steps 620
    python benchmarks/benchmark_mode.py --device cpu --size tiny --seq 64 --steps 420
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
from pathlib import Path

import torch

import guardrails
from guardrails.cli.bench import SIZES, RefGPT
from guardrails.engine.benchmark_mode import render


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--size", default="gpt2", choices=list(SIZES))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=620)
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--out", help="write the table (JSON) here")
    a = p.parse_args()
    device = torch.device(a.device)
    torch.manual_seed(0)
    n_layer, n_head, n_embd, vocab = SIZES[a.size]
    model = RefGPT(n_layer, n_head, n_embd, vocab, a.seq).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    if a.compile:
        model = torch.compile(model)
    g = torch.Generator().manual_seed(0)
    data = [
        tuple(torch.randint(0, vocab, (a.batch, a.seq), generator=g).to(device) for _ in range(2))
        for _ in range(4)
    ]
    amp = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if device.type == "cuda"
        else contextlib.nullcontext()
    )
    with tempfile.TemporaryDirectory() as d:
        with guardrails.guard(
            model, opt, data * (a.steps // 4 + 1), run_dir=d, progress=False, benchmark=True
        ) as gd:
            for x, y in gd:
                with amp:
                    loss = model(x, y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if gd.step >= a.steps:
                    break
        table = json.loads((Path(d) / "benchmark.json").read_text())
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"{name}, torch {torch.__version__}, {a.size} {a.batch}x{a.seq}, {a.steps} steps, "
        f"compile={a.compile}"
    )
    print(render(table))
    if a.out:
        Path(a.out).write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
