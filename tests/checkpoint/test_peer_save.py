"""A dead rank's part of a failure save, written by a live rank from the copy the dead
rank published at every step boundary (``guards/checkpointer/peer.py``; issue 50: a peer's
death under DDP must not cost the steps since the last checkpoint). Real torchrun jobs
(``--nnodes 1``, gloo, DDP), a real SIGKILL mid-run with periodic saves every 50 steps:
the survivors' save is whole, ``resume="auto"`` continues from it, redoing no step, and
every rank ends bitwise the uninterrupted run: weights, optimizer state, RNG streams, and
the batch of every step trained after the resume."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch
from _ranks import TESTS, run_ranks, torchrun
from safetensors.torch import load_file

from guardrails.checkpoint.manifest import list_checkpoints, problem

WORKER = TESTS / "failsave_worker.py"
STEPS, EVERY, AT = 80, 50, 67


def args(run_dir: Path, *more: object) -> list[str]:
    return [str(WORKER), "--run-dir", str(run_dir), "--steps", str(STEPS)] + [str(a) for a in more]


def final(run_dir: Path, rank: int) -> dict:
    return torch.load(run_dir / f"final{rank}.pt", weights_only=False)


def assert_same_checkpoint(a: Path, b: Path, world: int) -> None:
    """Two checkpoints of the same step hold bitwise the same weights and optimizer
    state, and every rank's RNG streams and data position."""
    for name in ("model.safetensors", "optimizer.safetensors"):
        x, y = load_file(a / name), load_file(b / name)
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), name
    for rank in range(world):
        x, y = (json.loads((c / f"rank{rank:05d}.json").read_text()) for c in (a, b))
        assert (x["rng"], x["data"], x["step"]) == (y["rng"], y["data"], y["step"]), rank
        x, y = (load_file(c / f"rank{rank:05d}.safetensors") for c in (a, b))
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), rank


def assert_same_end(run: Path, clean: Path, world: int, *, since: int) -> None:
    """Every rank of ``run`` ended as ``clean``'s did: torch's and python's RNG streams
    bitwise, the same batch at every step after ``since`` (the data position each rank
    resumed at), and the same weights and optimizer state: bitwise with 2 ranks; with 4,
    within float rounding (a DDP built at the resume all-reduces its first step in
    buckets laid out in parameter order, the uninterrupted one in the order the
    gradients came: gloo's ring then sums an element's 4 values in another order. Two
    uninterrupted 4-rank runs are bitwise equal; the resumed checkpoint is compared
    bitwise by ``assert_same_checkpoint``)."""
    for rank in range(world):
        x, y = final(run, rank), final(clean, rank)
        assert x["step"] == y["step"] == STEPS
        same = torch.equal if world == 2 else lambda a, b: torch.allclose(a, b, atol=1e-6)
        for k in x["model"]:
            assert same(x["model"][k], y["model"][k]), (rank, k)
        for i, s in x["opt"]["state"].items():
            for k, v in s.items():
                assert same(v, y["opt"]["state"][i][k]), (rank, i, k)
        assert torch.equal(x["rng"][0], y["rng"][0]) and x["rng"][1] == y["rng"][1], rank
        assert (x["rng"][2] == y["rng"][2]).all(), rank
        assert sorted(x["seen"]) == list(range(since + 1, STEPS + 1)), rank
        assert x["seen"] == {s: y["seen"][s] for s in x["seen"]}, rank


def published(out: Path) -> list[Path]:
    """The copies a job's ranks published (each rank prints its path at start)."""
    text = "".join(f.read_text() for f in out.glob("*.out"))
    return [Path(p) for p in re.findall(r"published part at (\S+)", text)]


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> dict[int, Path]:
    """The uninterrupted runs, 2 and 4 ranks, with a periodic save at step 67."""
    runs = {}
    for world in (2, 4):
        run_dir = tmp_path_factory.mktemp(f"clean{world}")
        argv = [sys.executable, *args(run_dir, "--every", AT)]
        ranks = run_ranks(argv, world, out=run_dir / "out", timeout_s=120)
        assert all(r.code == 0 for r in ranks), [r.out[-2000:] for r in ranks]
        # A run that ends leaves no copy behind.
        assert len(published(run_dir / "out")) == world
        assert not any(p.exists() for p in published(run_dir / "out"))
        runs[world] = run_dir
    return runs


@pytest.mark.parametrize(("world", "killed"), [(2, 1), (4, 2), (4, 0)])
def test_a_killed_rank_costs_no_step(tmp_path, clean, world, killed):
    """Rank ``killed`` SIGKILLed in the step after step 67 (the last periodic save: step
    50): a live rank writes its part from its published copy, and the failure save of
    step 67 is whole, bitwise the uninterrupted run's save of step 67; the same command
    again resumes it and redoes no step. Rank 0 killed: torchrun's agent hosts the
    store, so rank 1, the lowest live rank, commits (with the replicated state, its own
    copy, and rank 0's part from its published copy). No copy is left behind."""
    more = ("--fault", "kill", "--at", AT, "--rank", killed, "--every", EVERY)
    done = torchrun(args(tmp_path, *more, "--hang-timeout-s", 3), world, out=tmp_path / "a")
    assert done.code != 0
    found = dict(list_checkpoints(tmp_path / "checkpoints"))
    assert sorted(found) == [EVERY, AT], done.out[-4000:]
    m = json.loads((found[AT] / "manifest.json").read_text())
    assert m["failure"]["missing"] == [] and m["ranks"] == list(range(world)), m["failure"]
    assert m["failure"]["from_peers"] == [killed]
    assert m["failure"].get("committed_by", 0) == (1 if killed == 0 else 0)
    assert problem(found[AT]) is None
    assert_same_checkpoint(found[AT], clean[world] / "checkpoints" / f"step_{AT:09d}", world)
    assert not any(p.exists() for p in published(tmp_path / "a"))
    again = torchrun(args(tmp_path), world, out=tmp_path / "b")
    assert again.code == 0, again.out[-4000:]
    said = (tmp_path / "b" / "rank0.err").read_text()
    assert f"resumed from {found[AT]} (step {AT}," in said  # no step redone
    assert_same_end(tmp_path, clean[world], world, since=AT)
