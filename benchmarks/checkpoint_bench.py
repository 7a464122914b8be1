"""Checkpoint cost: time from SIGTERM to a committed checkpoint, the training time a
periodic (background) save blocks, and plain ``torch.save`` of the same state, in one
process.

    python benchmarks/checkpoint_bench.py --device cpu --model example
    python benchmarks/checkpoint_bench.py --device cuda --model gpt2 --out OUT_DIR

For each model (the example's 0.8M-param char GPT, or a GPT-2-small-shaped 124M one
with AdamW state, 1.5 GB in fp32):

* ``sigterm``: a guarded loop sends itself a real SIGTERM after a step; reported: the
  wall time from the signal to the process being ready to exit (the step in flight,
  the agreement, staging, writing, fsync, commit), and the save alone (staging to
  commit). This is what must fit the launcher's 30 s grace period.
* ``periodic``: ``checkpoint_every_n_steps`` (every ``--steps``/2 steps) with the
  background writer: the time each save blocks the training loop (copying the state off
  the GPU into pinned memory), and the step time while the writer thread runs vs when
  it does not (steps that took a save excluded).
* ``torch.save``: ``torch.save({"model": ..., "optimizer": ...})`` of the same state to
  the same disk, with and without ``os.fsync`` (without is what most scripts do, and
  what a power loss or a SIGKILL mid-write turns into a truncated file).

Each figure is the median of ``--repeats`` runs. The checkpoint directory is under
``--dir`` (default: a temp dir; pass a path on the disk you train on).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from train_gpt import GPT

import guardrails


def build(name: str, device: torch.device, seq: int):
    torch.manual_seed(0)
    cfg = {"example": (65, 64, 4, 4, 128), "gpt2": (50304, seq, 12, 12, 768)}[name]
    model = GPT(*cfg).to(device)
    batch = 8 if name == "example" else 2
    n_ctx = cfg[1]
    data = [
        (
            torch.randint(0, cfg[0], (batch, n_ctx), device=device),
            torch.randint(0, cfg[0], (batch, n_ctx), device=device),
        )
        for _ in range(4)
    ]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    return model, opt, data


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(model, opt, x, y, amp: bool) -> None:
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=amp):
        loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def sigterm_run(model, opt, data, root: Path, amp: bool, device) -> dict[str, float]:
    """One guarded loop stopped by a real SIGTERM after step 3."""
    run_dir = root / f"sig-{time.time_ns()}"
    ck = guardrails.SignalCheckpointer(resume=None, keep_last=1)
    t_signal = 0.0
    try:
        with guardrails.guard(
            model,
            opt,
            data * 100,
            run_dir=run_dir,
            progress=False,
            metrics=False,
            components=[ck],
        ) as g:
            for x, y in g:
                train(model, opt, x, y, amp)
                if g.step == 3:
                    sync(device)
                    t_signal = time.perf_counter()
                    os.kill(os.getpid(), signal.SIGTERM)
    except SystemExit as e:
        assert e.code == 128 + signal.SIGTERM, e.code
    t_done = time.perf_counter()
    assert ck.last_path is not None and (ck.last_path / "manifest.json").is_file()
    size = sum(f.stat().st_size for f in ck.last_path.iterdir())
    return {"signal_to_exit_s": t_done - t_signal, "save_s": ck.save_times_s[-1], "bytes": size}


def periodic_run(model, opt, data, root: Path, amp: bool, device, steps: int) -> dict[str, float]:
    """Saves every ``steps // 2`` steps with the background writer; each step is timed
    and marked by whether the writer thread was still busy when it ended."""
    run_dir = root / f"per-{time.time_ns()}"
    every = max(1, steps // 2)
    ck = guardrails.SignalCheckpointer(every_n_steps=every, resume=None, keep_last=1)
    busy, idle = [], []
    with guardrails.guard(
        model,
        opt,
        data * (steps // len(data) + 2),
        run_dir=run_dir,
        progress=False,
        metrics=False,
        components=[ck],
    ) as g:
        t = time.perf_counter()
        for x, y in g:
            train(model, opt, x, y, amp)
            sync(device)
            now = time.perf_counter()
            writer = ck._writer
            saving = g.step % every == 1 and g.step > 1  # this step's fetch took the save
            if not saving:
                (busy if writer is not None and writer.is_alive() else idle).append(now - t)
            t = now
            if g.step >= steps:
                break
    return {
        "blocking_s": statistics.median(ck.blocking_times_s[:-1] or ck.blocking_times_s),
        "background_save_s": statistics.median(ck.save_times_s),
        "step_s_while_writing": statistics.median(busy) if busy else float("nan"),
        "step_s_otherwise": statistics.median(idle) if idle else float("nan"),
    }


def torch_save_run(model, opt, root: Path, fsync: bool) -> float:
    path = root / f"plain-{time.time_ns()}.pt"
    t0 = time.perf_counter()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    if fsync:
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
    took = time.perf_counter() - t0
    path.unlink()
    return took


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", default="example", choices=["example", "gpt2"])
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--steps",
        type=int,
        default=300,
        help="steps of the periodic run (a save every steps/2: leave the writer time to finish)",
    )
    p.add_argument("--dir", help="where checkpoints are written (default: a temp dir)")
    p.add_argument("--out", help="directory for checkpoint_bench.json / .md")
    args = p.parse_args()
    device = torch.device(args.device)
    amp = device.type == "cuda"
    model, opt, data = build(args.model, device, args.seq)
    for x, y in data[:2]:  # AdamW state exists before the first save
        train(model, opt, x, y, amp)
    sync(device)
    n_params = sum(p.numel() for p in model.parameters())
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        sig = [sigterm_run(model, opt, data, root, amp, device) for _ in range(args.repeats)]
        per = [
            periodic_run(model, opt, data, root, amp, device, args.steps)
            for _ in range(args.repeats)
        ]
        plain = [torch_save_run(model, opt, root, False) for _ in range(args.repeats)]
        plain_sync = [torch_save_run(model, opt, root, True) for _ in range(args.repeats)]

    def med(rows, key):
        return statistics.median(r[key] for r in rows)

    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": platform.node(),
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "model": args.model,
        "params": n_params,
        "checkpoint_bytes": sig[0]["bytes"],
        "sigterm_to_exit_s": med(sig, "signal_to_exit_s"),
        "sigterm_save_s": med(sig, "save_s"),
        "periodic_blocking_s": med(per, "blocking_s"),
        "periodic_background_save_s": med(per, "background_save_s"),
        "step_s_while_writing": med(per, "step_s_while_writing"),
        "step_s_otherwise": med(per, "step_s_otherwise"),
        "torch_save_s": statistics.median(plain),
        "torch_save_fsync_s": statistics.median(plain_sync),
        "repeats": args.repeats,
    }
    lines = [
        f"checkpoint bench: {args.model} ({n_params / 1e6:.1f}M params, "
        f"{result['checkpoint_bytes'] / 1e6:.0f} MB on disk) on {result['device']}, "
        f"torch {torch.__version__}",
        f"  SIGTERM -> ready to exit      {result['sigterm_to_exit_s']:.3f} s "
        f"(the save itself {result['sigterm_save_s']:.3f} s)",
        f"  periodic save, blocking       {result['periodic_blocking_s'] * 1e3:.1f} ms "
        f"(written in the background in {result['periodic_background_save_s']:.3f} s)",
        f"  step time while writing       {result['step_s_while_writing'] * 1e3:.1f} ms "
        f"vs {result['step_s_otherwise'] * 1e3:.1f} ms otherwise",
        f"  torch.save (no fsync)         {result['torch_save_s']:.3f} s",
        f"  torch.save + fsync            {result['torch_save_fsync_s']:.3f} s",
    ]
    print("\n".join(lines))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "checkpoint_bench.jsonl", "a") as f:
            f.write(json.dumps(result) + "\n")
        with open(out / "checkpoint_bench.txt", "a") as f:
            f.write("\n".join(lines) + "\n\n")


if __name__ == "__main__":
    main()
