"""MFU of GPT-2 small under the guard, against a hand count of its FLOPs.

    python benchmarks/mfu_gpt2.py --out /tmp/mfu [--steps 30] [--batch 8] [--seq 1024]
        [--item] [--tiny] [--fp32]

Trains the example's GPT (GPT-2 small: 12 layers, 12 heads, 768 wide, vocab 50257,
tied head) on random tokens with bf16 autocast and fused AdamW for ``--steps`` steps
under ``guardrails.guard`` (the efficiency section at its defaults), then prints:

* the FLOPs the guard counted at step 2 and the hand count (every matmul 6 x tokens x
  weights; attention as torch's formulas count its kernels: 14 x layers x B x T^2 x d),
  which must be equal;
* the report's MFU line (FLOPs / (median step time x the device's bf16 peak));
* with ``--item`` (a ``loss.item()`` every step), the ``host_syncs`` event; without,
  that there is none;
* the advice events (none expected for this setup; ``--fp32`` drops autocast: then
  ``bf16_available`` / ``tf32_off`` are expected).

``--tiny`` is a 2-layer, 128-wide model for a CPU smoke run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from train_gpt import GPT  # noqa: E402

import guardrails  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--item", action="store_true", help="a loss.item() every step")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model (CPU smoke run)")
    p.add_argument("--fp32", action="store_true", help="no autocast")
    a = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    layers, heads, d, vocab = (2, 4, 128, 65) if a.tiny else (12, 12, 768, 50257)
    b, t = a.batch, a.seq
    torch.manual_seed(0)
    model = GPT(vocab=vocab, block_size=t, n_layer=layers, n_head=heads, n_embd=d).to(device)
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=fused)
    g = torch.Generator(device=device).manual_seed(0)
    batches = [
        (
            torch.randint(0, vocab, (b, t), device=device, generator=g),
            torch.randint(0, vocab, (b, t), device=device, generator=g),
        )
        for _ in range(a.steps)
    ]
    autocast = not a.fp32
    a.out.mkdir(parents=True, exist_ok=True)
    with guardrails.guard(model, opt, batches, run_dir=a.out, progress=False) as guard:
        for x, y in guard:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if a.item:
                loss.item()  # the sync the sampling should report
    from guardrails.metrics.events import read_events

    events = read_events(a.out)
    hand = 6 * b * t * (12 * layers * d * d + d * vocab) + 14 * layers * b * t * t * d
    counted = next((e for e in events if e["kind"] == "flops"), {})
    print(f"device {torch.cuda.get_device_name() if fused else 'cpu'}, torch {torch.__version__}")
    print(
        f"FLOPs per step: counted {counted.get('flops_per_step')}, hand count {hand}, "
        f"equal: {counted.get('flops_per_step') == hand}; dtype {counted.get('dtype')}, "
        f"peak {counted.get('peak_flops')} ({counted.get('peak_source')})"
    )
    syncs = [e for e in events if e["kind"] == "host_syncs"]
    print("host_syncs:", json.dumps(syncs[0]["sites"]) if syncs else "none")
    advice = [e["kind"] for e in events if e["kind"] in _ADVICE]
    print("advice:", advice or "none")
    report = subprocess.run(
        [sys.executable, "-m", "guardrails", "report", str(a.out), "--no-png"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    print(
        "\n".join(
            line for line in report.stdout.splitlines() if "MFU" in line or "step time" in line
        )
    )
    return 0


_ADVICE = {
    "tf32_off",
    "bf16_available",
    "optimizer_not_fused",
    "loader_no_workers",
    "loader_not_pinned",
    "bf16_on_cpu",
}

if __name__ == "__main__":
    raise SystemExit(main())
