"""A DDP resume at more than 2 ranks continues bitwise (issue 50's note): the checkpoint
carries DDP's rebuilt gradient buckets and the resumed run reduces its first step in
them (``engine/ddp_buckets.py``). Without it the resumed run's first step reduced DDP's
construction bucket, and 4 gloo ranks summed the gradients in another order than the
uninterrupted run (``benchmarks/ddp_resume_bits.py``: 14 of 14 tensors differed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _ranks import free_port, patience, run_ranks
from conftest import read_events

from guardrails.checkpoint.schema import Bad, check_rank_state

WORKER = Path(__file__).resolve().parents[1] / "ddpbits_worker.py"
RANKS = 4


def _ranks(tmp_path: Path, name: str, *args: object) -> tuple[int | None, str]:
    """The worker's 4 ranks, each its own process (rank 0 hosts the store; forked from
    the fork server: torchrun's four fresh interpreters a job cost 15 CPU-s): 0 when
    every rank exited 0, else the first other exit code; their output."""
    out = tmp_path / f"{name}.pt"
    argv = [sys.executable, WORKER, tmp_path / f"{name}.run", out, *map(str, args)]
    ranks = run_ranks(argv, RANKS, out=tmp_path / f"{name}.logs", timeout_s=240)
    code = next((r.code for r in ranks if r.code != 0), 0)
    return code, "".join(f"--- rank {r.rank}\n{r.text[-2000:]}" for r in ranks)


def _differ(a: Path, b: Path) -> list[str]:
    x, y = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    assert x.keys() == y.keys()
    return [k for k in x if not torch.equal(x[k], y[k])]


@pytest.mark.slow(reason="4 gloo ranks, four times")
@pytest.mark.parametrize("flag", [None, "--hook", "--static-graph"])
def test_a_sigterm_resume_at_4_ranks_is_bitwise_the_uninterrupted_run(tmp_path, flag):
    """DDP with 3 buckets (bucket_cap_mb small), 4 ranks, a checkpoint every 4 steps;
    SIGTERM after step 6, then the same command again to step 12. The final weights
    equal, bitwise, an uninterrupted guarded run's and a plain loop's (no guardrails).
    ``--hook``: DDP's own allreduce_hook registered by the user, carried over to the
    reducer the resume builds; ``--static-graph``: DDP's static_graph=True (not a way
    out: its buckets are rebuilt too, ``benchmarks/ddp_resume_bits.py``)."""
    flags = ["--steps", 12, "--every", 4, *([flag] if flag else [])]
    code, text = _ranks(tmp_path, "plain", *flags, "--plain")
    assert code == 0, text[-3000:]
    code, text = _ranks(tmp_path, "straight", *flags)
    assert code == 0, text[-3000:]
    # A guarded step computes what the plain step computes.
    assert _differ(tmp_path / "plain.pt", tmp_path / "straight.pt") == []

    code, text = _ranks(tmp_path, "stopped", *flags, "--sigterm-at", 6)
    assert code == 143, text[-3000:]  # pre-empted: saved, and exited 128 + SIGTERM
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

    code, text = _ranks(tmp_path, "stopped", *flags)
    assert code == 0, text[-3000:]
    assert [e["step"] for e in read_events(run_dir) if e["kind"] == "resumed"] == [step] * RANKS
    assert _differ(tmp_path / "straight.pt", tmp_path / "stopped.pt") == []
    assert _differ(tmp_path / "plain.pt", tmp_path / "stopped.pt") == []


@pytest.mark.slow(reason="4 gloo ranks, three times, one of them a hang")
def test_a_hangs_failure_save_at_4_ranks_resumes_bitwise(tmp_path):
    """Issue 50's recovery at 4 ranks: the last rank stuck after step 7, the others
    blocked in DDP's all-reduce (inside its backward, holding the reducer's lock). Each
    rank's failure save, from the watchdog's thread, holds the buckets read ahead (not
    waited for: the lock is held); the same command again ends bitwise the uninterrupted
    run."""
    flags = ["--steps", 12, "--every", 100]  # no periodic save: the failure save alone
    code, text = _ranks(tmp_path, "straight", *flags)
    assert code == 0, text[-3000:]
    code, text = _ranks(tmp_path, "failed", *flags, "--hang-at", 7)
    assert code != 0
    run_dir = tmp_path / "failed.run"
    saved = [e for e in read_events(run_dir) if e["kind"] == "failure_saved"]
    assert len(saved) == RANKS and all(e["complete"] for e in saved), (saved, text[-3000:])
    assert {e["step"] for e in saved} == {7}
    # The layout read ahead is in every rank's record (a read from the watchdog's thread
    # would wait out its limit on the reducer's lock and save none).
    ckpt = run_dir / "checkpoints" / f"step_{7:09d}"
    ranks = [json.loads((ckpt / f"rank{r:05d}.json").read_text()) for r in range(RANKS)]
    layouts = [state.get("ddp_buckets") for state in ranks]
    assert layouts[0] is not None and layouts == [layouts[0]] * RANKS, layouts
    code, text = _ranks(tmp_path, "failed", *flags)
    assert code == 0, text[-3000:]
    assert _differ(tmp_path / "straight.pt", tmp_path / "failed.pt") == []


ONE_RANK = """
import logging, os, sys
import torch, torch.distributed as dist
from torch import nn
sys.path.insert(0, {root!r})
from ddpbits_worker import build
from guardrails.engine import ddp_buckets

logging.basicConfig(level=logging.DEBUG, format="%(message)s")
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT={port!r})
dist.init_process_group("gloo", rank=0, world_size=1)

def layout(ddp):
    params = ddp._build_params_for_reducer()[0]
    index = {{id(p): i for i, p in enumerate(params)}}
    buckets = ddp.reducer._get_zeros_like_grad_buckets()
    return [[index[id(p)] for p in b.parameters()] for b in buckets]

def step(ddp):
    ddp(torch.ones(8, 64)).sum().backward()

_, ddp, _ = build(hook=False)
assert ddp_buckets.saved_layout(ddp) is None  # not rebuilt yet
for _ in range(3):
    step(ddp)
saved = ddp_buckets.saved_layout(ddp)
assert saved == layout(ddp) and len(saved) == 3, saved
print("read", saved)

_, fresh, _ = build(hook=True)
assert len(layout(fresh)) == 1  # construction's one bucket
assert not ddp_buckets.restore_layout(fresh, [[0, 1], [1]])  # an index twice: refused
assert ddp_buckets.restore_layout(fresh, saved)
assert layout(fresh) == saved and ddp_buckets.saved_layout(fresh) == saved
assert fresh._get_ddp_logging_data()["comm_hook"] == "allreduce_hook"
step(fresh)
step(fresh)  # the new reducer rebuilt into the same buckets; the hook still reduces
assert layout(fresh) == saved
print("restored")

_, builtin, _ = build(hook=False)
builtin._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
assert not ddp_buckets.restore_layout(builtin, saved)
print("builtin left alone")
dist.destroy_process_group()
"""


def test_the_buckets_read_and_given_back_on_one_rank(tmp_path):
    """A real 1-rank gloo DDP: its rebuilt buckets read once its third forward logged
    them; a fresh DDP given them reduces in them from its first step, keeps its comm
    hook, and rebuilds into the same; a layout naming an index twice, or a DDP with a
    built-in comm hook (a new reducer would drop it), is left alone, with a debug line."""
    code = ONE_RANK.format(root=str(WORKER.parent), port=str(free_port()))
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=patience(120)
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "restored" in run.stdout and "builtin left alone" in run.stdout, run.stdout
    assert "does not cover this DDP's 14 parameters once each" in run.stderr, run.stderr
    assert "a built-in comm hook" in run.stderr, run.stderr


def test_the_schema_refuses_a_parameter_in_two_buckets():
    """``ddp_buckets`` in a rank's JSON: lists of parameter indices, each index once."""
    check_rank_state({"rng": {}, "ddp_buckets": [[2, 1], [0]]}, 0, None)
    check_rank_state({"rng": {}, "ddp_buckets": None}, 0, None)
    with pytest.raises(Bad, match=r"ddp_buckets\[1\]\[0\].*in an earlier bucket too"):
        check_rank_state({"rng": {}, "ddp_buckets": [[0, 1], [1]]}, 0, None)
    with pytest.raises(Bad, match=r"ddp_buckets\[0\]\[0\].*not an integer"):
        check_rank_state({"rng": {}, "ddp_buckets": [["0"]]}, 0, None)
