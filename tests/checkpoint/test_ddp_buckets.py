"""A DDP resume at more than 2 ranks continues bitwise (issue 50's note): the checkpoint
carries DDP's rebuilt gradient buckets and the resumed run reduces its first step in
them (``engine/ddp_buckets.py``). Without it the resumed run's first step reduced DDP's
construction bucket, and 4 gloo ranks summed the gradients in another order than the
uninterrupted run (``benchmarks/ddp_resume_bits.py``: 14 of 14 tensors differed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _ranks import launch_torchrun
from conftest import read_events

WORKER = Path(__file__).resolve().parents[1] / "ddpbits_worker.py"
RANKS = 4


def _torchrun(tmp_path: Path, name: str, *args: object) -> tuple[int | None, str]:
    """The worker under torchrun at 4 ranks; its output (the exit code is the caller's)."""
    out = tmp_path / f"{name}.pt"
    cmd = [WORKER, tmp_path / f"{name}.run", out, *args]
    with launch_torchrun(cmd, RANKS, out=tmp_path / f"{name}.logs") as job:
        [result] = job.wait(240)
    return result.code, result.text


def _differ(a: Path, b: Path) -> list[str]:
    x, y = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    assert x.keys() == y.keys()
    return [k for k in x if not torch.equal(x[k], y[k])]


@pytest.mark.slow(reason="4 gloo ranks under torchrun, four times")
@pytest.mark.parametrize("hook", [False, True], ids=["reducer", "comm_hook"])
def test_a_sigterm_resume_at_4_ranks_is_bitwise_the_uninterrupted_run(tmp_path, hook):
    """DDP with 3 buckets (bucket_cap_mb small), 4 ranks, a checkpoint every 4 steps;
    SIGTERM after step 6, then the same command again to step 12. The final weights
    equal, bitwise, an uninterrupted guarded run's and a plain loop's (no guardrails).
    ``comm_hook``: DDP's own allreduce_hook registered by the user, carried over to the
    reducer the resume builds."""
    flags = ["--steps", 12, "--every", 4, *(["--hook"] if hook else [])]
    code, text = _torchrun(tmp_path, "plain", *flags, "--plain")
    assert code == 0, text[-3000:]
    code, text = _torchrun(tmp_path, "straight", *flags)
    assert code == 0, text[-3000:]
    # A guarded step computes what the plain step computes.
    assert _differ(tmp_path / "plain.pt", tmp_path / "straight.pt") == []

    code, text = _torchrun(tmp_path, "stopped", *flags, "--sigterm-at", 6)
    assert code != 0  # torchrun reports its ranks' 143 (pre-empted) as a failure
    run_dir = tmp_path / "stopped.run"
    stopped = [e for e in read_events(run_dir) if e["kind"] == "stopped"]
    assert len(stopped) == RANKS and all(e["saved"] for e in stopped), (stopped, text[-3000:])
    [step] = {e["step"] for e in stopped}
    assert 6 <= step < 12, step
    ckpt = run_dir / "checkpoints" / f"step_{step:09d}"
    ranks = [json.loads((ckpt / f"rank{r:05d}.json").read_text()) for r in range(RANKS)]
    layouts = [state["ddp_buckets"] for state in ranks]
    # Rebuilt in gradient-ready order (last layer first), 14 gradients in 3 buckets.
    assert all(layout == layouts[0] for layout in layouts), layouts
    assert len(layouts[0]) == 3 and sorted(i for b in layouts[0] for i in b) == list(range(14))
    assert layouts[0][0][0] == 13, layouts

    code, text = _torchrun(tmp_path, "stopped", *flags)
    assert code == 0, text[-3000:]
    assert [e["step"] for e in read_events(run_dir) if e["kind"] == "resumed"] == [step] * RANKS
    assert _differ(tmp_path / "straight.pt", tmp_path / "stopped.pt") == []
    assert _differ(tmp_path / "plain.pt", tmp_path / "stopped.pt") == []
