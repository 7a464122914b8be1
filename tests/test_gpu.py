"""GPU truth: the guarded loop adds no host-device synchronisation.

CI has no GPU, so these skip there; they run on an H100/H200 through the device tool,
and the result is recorded in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import guardrails

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU (CI has none); run on an H100/H200, see benchmarks/RESULTS.md",
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))


def gpt(device):
    from train_gpt import GPT

    torch.manual_seed(0)
    return GPT(vocab=65, block_size=64, n_layer=2, n_head=4, n_embd=128).to(device)


def data(device, n):
    g = torch.Generator(device=device).manual_seed(0)
    return [
        (
            torch.randint(0, 65, (16, 64), device=device, generator=g),
            torch.randint(0, 65, (16, 64), device=device, generator=g),
        )
        for _ in range(n)
    ]


def loop(model, opt, batches):
    for x, y in batches:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_guarded_loop_never_syncs(tmp_path, compiled):
    device = torch.device("cuda")
    model = gpt(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    step_model = torch.compile(model) if compiled else model
    batches = data(device, 4)
    loop(step_model, opt, batches * 2)  # warm-up: compile, lazy optimizer state, allocator

    losses = []
    steps = 35  # three full metric intervals of 10 and a partial one flushed at close
    torch.cuda.set_sync_debug_mode("error")
    try:
        # The mode is live: an .item() raises here.
        with pytest.raises(RuntimeError, match="synchroniz"):
            batches[0][0].sum().item()
        loop(step_model, opt, batches)  # the unguarded loop is sync-free on its own
        with guardrails.guard(
            step_model, opt, batches * 9, run_dir=tmp_path, metrics_every_n_steps=10, progress=False
        ) as g:
            for i, (x, y) in enumerate(g):
                if i == steps:
                    break
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = step_model(x, y)
                loss.backward()
                losses.append(loss.detach())
                opt.step()
                opt.zero_grad(set_to_none=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    rows = guardrails.read_metrics(tmp_path).to_pydict()
    assert rows["step"] == list(range(1, steps + 1))
    assert rows["loss"] == pytest.approx([v.item() for v in losses], rel=1e-6)
    assert all(v > 0 for v in rows["grad_norm"])
    assert all(m > 0 for m in rows["mem_peak_bytes"])
    assert rows["tokens"] == [16 * 64] * steps
