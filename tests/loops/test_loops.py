"""The guard follows the step as real loops run it: prefetching generator loaders,
criterion(model(x), y), gradient accumulation, optimizers that read every gradient or
hold a shard of the state per rank, GANs with two optimizers, seeded loaders.

Stop-and-resume tests run tests/loop_worker.py in real processes with a real SIGTERM
and compare, bitwise, the final state of a run that was stopped and resumed with one
that was never interrupted.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from _loops import train_loop_signalled
from _ranks import run_ranks, run_script
from conftest import Regressor, assert_state_equal, batches, free_port, guarded_run, read_events
from safetensors.torch import load_file
from torch import nn

import guardrails
from guardrails.checkpoint.manifest import _self_hash
from guardrails.checkpoint.read import verify_checkpoint

WORKER = Path(__file__).resolve().parents[1] / "loop_worker.py"
ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------- stop and resume


def _run(shape, run_dir, out, *args, world=1):
    """``world`` worker processes to their end: (exit code, output) per rank."""
    cmd = [sys.executable, WORKER, shape, run_dir, out, *args]
    if world > 1:
        cmd += ["--rank", "{rank}", "--world", "{world}", "--port", "{port}"]
    results = run_ranks(cmd, world, out=f"{out}.logs", timeout_s=240)
    return [(r.code, r.out) for r in results]


def _stop_and_resume(tmp_path, shape, steps, stop_at, world=1, stop_rank=0, extra=()):
    """A run of ``steps`` never interrupted vs one SIGTERMed (on ``stop_rank``) at
    ``stop_at`` and re-run with the same command: the final states, bitwise."""
    run_args = ("--steps", steps, *extra)
    straight = _run(shape, tmp_path / "a", tmp_path / "a", *run_args, world=world)
    assert all(rc == 0 for rc, _ in straight), straight
    args = (*run_args, "--sigterm-at", stop_at, "--sigterm-rank", stop_rank)
    stopped = _run(shape, tmp_path / "b", tmp_path / "b", *args, world=world)
    assert all(rc == 128 + signal.SIGTERM for rc, _ in stopped), stopped
    ckpts = sorted(p.name for p in (tmp_path / "b/checkpoints").iterdir())
    # Several ranks stop at the first check (the worker checks at every step) that no
    # rank had decided when the signalled rank wrote "stop": the next step, or the one
    # after when a faster rank had decided the next already. One rank stops at once.
    assert len(ckpts) == 1 and stop_at <= int(ckpts[0][5:]) <= stop_at + 2, ckpts
    stopped_at = tmp_path / "b/checkpoints" / ckpts[0]
    resumed = _run(shape, tmp_path / "b", tmp_path / "b", *run_args, world=world)
    assert all(rc == 0 for rc, _ in resumed), resumed
    for rank in range(world):
        a = torch.load(f"{tmp_path}/a.rank{rank}.pt", weights_only=False)
        b = torch.load(f"{tmp_path}/b.rank{rank}.pt", weights_only=False)
        assert_state_equal(a, b, f"rank{rank}")
    resumed = [e for e in read_events(tmp_path / "b") if e["kind"] == "resumed"]
    assert [e["path"] for e in resumed] == [str(stopped_at)] * world
    return stopped_at


@pytest.mark.slow(reason="3 runs: straight, stopped, resumed")
def test_prefetching_generator_loop_resumes_bitwise(tmp_path):
    # nanochat's shape: the loop has always fetched one batch more than it trained on,
    # so a position counted in batches fetched resumes one batch late.
    stopped_at = _stop_and_resume(tmp_path, "prefetch", steps=10, stop_at=4)
    assert stopped_at.name == "step_000000004"
    ckpt = json.loads((stopped_at / "rank00000.json").read_text())
    assert ckpt["data"]["batch_in_epoch"] == 8  # 4 steps x 2 micro-batches trained (9 fetched)


@pytest.mark.slow(reason="3 runs: straight, stopped, resumed")
def test_gan_with_two_optimizers_resumes_both_bitwise(tmp_path):
    # One checkpoint holds G, D, both optimizers and D's scheduler; crossing an epoch.
    stopped_at = _stop_and_resume(tmp_path, "gan", steps=14, stop_at=7)
    manifest = json.loads((stopped_at / "manifest.json").read_text())
    assert {"optimizer.G.json", "optimizer.D.json", "scheduler.D.json"} <= set(manifest["files"])


@pytest.mark.slow(reason="3 runs: straight, stopped, resumed")
def test_seeded_loader_resume_does_not_repeat_an_epoch(tmp_path):
    # DataLoader(generator=torch.Generator().manual_seed(7)): the next epoch's order
    # comes from the loader's own generator, which the checkpoint must carry.
    _stop_and_resume(tmp_path, "seeded", steps=14, stop_at=3)


@pytest.mark.slow(reason="3 runs of 2 ranks: straight, stopped, resumed")
def test_optimizer_that_reduces_inside_its_step_skips_together_and_resumes(tmp_path):
    # nanochat's shape: no DDP, so the ranks' gradients differ at step() and the NaN
    # flag is agreed (over guardrails' own group); the optimizer's state is per rank.
    ckpt = _stop_and_resume(
        tmp_path, "distopt", steps=10, stop_at=3, world=2, stop_rank=1, extra=("--nan-at", 2)
    )
    skips = [e for e in read_events(tmp_path / "b") if e["kind"] == "nonfinite"]
    assert {e["rank"]: (e["step"], e["cause"]) for e in skips} == {
        0: (2, "bad_data"),
        1: (2, "other_rank"),
    }
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["contents"]["optimizers"]["optimizer"]["per_rank"] is True


@pytest.mark.slow(reason="3 runs of 2 ranks: straight, stopped, resumed")
def test_zero_redundancy_optimizer_skips_and_saves_every_ranks_shard(tmp_path):
    # A NaN sample on rank 0 at step 2: ZeroRedundancyOptimizer.step() (which
    # broadcasts each rank's updated shard) is called on neither rank; then SIGTERM on
    # rank 1 at step 3, and the resume restores each rank's half of the AdamW state.
    ckpt = _stop_and_resume(
        tmp_path, "zero", steps=10, stop_at=3, world=2, stop_rank=1, extra=("--nan-at", 2)
    )
    skips = [e for e in read_events(tmp_path / "b") if e["kind"] == "nonfinite"]
    assert sorted((e["rank"], e["step"]) for e in skips) == [(0, 2), (1, 2)]
    assert {e["rank"]: e["cause"] for e in skips} == {0: "bad_data", 1: "other_rank"}
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["contents"]["optimizers"]["optimizer"]["per_rank"] is True
    assert {"rank00000.optimizer.json", "rank00001.optimizer.json"} <= set(manifest["files"])
    assert "optimizer.json" not in manifest["files"]
    # A copy that lost rank 1's part is invalid, and says whose part is missing.
    bad = tmp_path / "copy" / ckpt.name
    bad.parent.mkdir()
    subprocess.run(["cp", "-r", str(ckpt), str(bad)], check=True)
    manifest["files"] = {
        k: v for k, v in manifest["files"].items() if not k.startswith("rank00001.optimizer")
    }
    manifest["manifest_sha256"] = _self_hash(manifest)  # consistent
    (bad / "manifest.json").write_text(json.dumps(manifest))
    why = verify_checkpoint(bad)
    assert why is not None and "rank(s) [1]" in why and "optimizer" in why, why
    out = run_script(
        [sys.executable, "-m", "guardrails", "inspect", str(bad)], timeout_s=120, cwd=ROOT
    )
    assert out.returncode == 1 and "rank(s) [1]" in out.stdout, out.stdout


# ---------------------------------------------------------------------- skipping


class GradShapeSGD(torch.optim.Optimizer):
    """An optimizer that, like nanochat's Muon, reads ``p.grad.shape`` of every param
    (it stacks them): a skip that sets ``p.grad = None`` crashes it."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                assert p.grad.shape == p.shape  # AttributeError on a None grad
                state = self.state[p]
                buf = state.setdefault("momentum", torch.zeros_like(p))
                buf.mul_(0.9).add_(p.grad)
                p.add_(buf, alpha=-group["lr"])


def _snapshot(model, opt):
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    return weights, state


def test_skip_never_calls_an_optimizer_that_reads_every_grad(tmp_path):
    torch.manual_seed(0)
    model = Regressor()
    opt = GradShapeSGD(model.parameters())
    data = batches(8)
    data[5][0][3, 1] = float("nan")  # sample row 3 of step 6's batch
    with guardrails.guard(model, opt, data, run_dir=tmp_path, progress=False) as g:
        for x, y in g:
            model(x, y).backward()
            if g.step == 5:
                before = _snapshot(model, opt)
            opt.step()
            if g.step == 6:
                after = _snapshot(model, opt)
            opt.zero_grad()
    assert g.step == 8
    assert_state_equal(before[0], after[0])  # weights bitwise
    assert before[1].keys() == after[1].keys()
    for k in before[1]:
        assert_state_equal(before[1][k], after[1][k])
    (ev,) = [e for e in read_events(tmp_path) if e["kind"] == "nonfinite"]
    assert (ev["step"], ev["cause"], ev["samples"]) == (6, "bad_data", [3])


def test_gan_nan_in_discriminator_never_reaches_its_weights(tmp_path):
    torch.manual_seed(0)
    gen, disc = nn.Linear(2, 4), nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt_g, opt_d = (torch.optim.Adam(m.parameters(), lr=1e-2) for m in (gen, disc))
    bce = nn.functional.binary_cross_entropy_with_logits
    real = torch.randn(10, 8, 4)
    real[4, 2] = float("inf")  # one real sample of iteration 5
    with guardrails.guard([gen, disc], [opt_g, opt_d], real, run_dir=tmp_path) as g:
        for i, x in enumerate(g):
            fake = gen(torch.randn(8, 2))
            d_loss = bce(disc(x).squeeze(1), torch.ones(8))
            d_loss = d_loss + bce(disc(fake.detach()).squeeze(1), torch.zeros(8))
            opt_d.zero_grad()
            d_loss.backward()
            d_before = [p.clone() for p in disc.parameters()]
            opt_d.step()
            if i == 4:  # D's update skipped, bitwise
                after = list(disc.parameters())
                assert all(torch.equal(a, b) for a, b in zip(d_before, after, strict=True))
            opt_g.zero_grad()
            bce(disc(fake).squeeze(1), torch.ones(8)).backward()
            opt_g.step()
    assert g.step == 10  # G's steps count; D's belong to them
    assert all(torch.isfinite(p).all() for p in disc.parameters())
    (ev,) = [e for e in read_events(tmp_path) if e["kind"] == "nonfinite"]
    assert (ev["optimizer"], ev["step"], ev["cause"], ev["samples"]) == ("1", 5, "bad_data", [2])
    assert "forward call" in ev["message"]


def test_two_guards_in_one_process_fail_fast(tmp_path):
    model, other = Regressor(), Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt2 = torch.optim.SGD(other.parameters(), lr=0.1)
    with guardrails.guard(model, opt, run_dir=tmp_path / "a"):
        with pytest.raises(ValueError, match="another guard is already running") as err:
            guardrails.guard(other, opt2, run_dir=tmp_path / "b").start()
        assert "guardrails.guard([gen, disc], [opt_g, opt_d]" in str(err.value)
    with guardrails.guard(other, opt2, run_dir=tmp_path / "b"):  # after close: fine
        pass


def test_one_parameter_in_two_optimizers_is_refused(tmp_path):
    model = Regressor()
    a = torch.optim.SGD(model.parameters(), lr=0.1)
    b = torch.optim.SGD(model.net[0].parameters(), lr=0.1)
    with pytest.raises(ValueError, match="both own a parameter"):
        guardrails.guard(model, {"a": a, "b": b}, run_dir=tmp_path)
    with pytest.raises(TypeError, match="optimizer 'x' is a str"):
        guardrails.guard(model, {"a": a, "x": "sgd"}, run_dir=tmp_path)


# ---------------------------------------------------------------------- what the step saw


class LogOfLarge(nn.Module):
    """A numerics bug: takes the log of its input when a value is large (log of the
    negative entries: NaN, from finite inputs)."""

    def forward(self, x):
        return x.log() if (x.abs() > 1e3).any() else x


class Classifier(nn.Module):
    """Returns logits; the loop computes the loss (``criterion(model(x), y)``)."""

    def __init__(self, poison_layer: bool = False) -> None:
        super().__init__()
        layers = [LogOfLarge()] if poison_layer else []
        self.body = nn.Sequential(*layers, nn.Linear(4, 8), nn.Tanh())
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.body(x))


def _criterion_run(tmp_path, x_bad=None, y_weight_bad=False, poison_layer=False, accum=1):
    torch.manual_seed(0)
    model = Classifier(poison_layer)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    crit = nn.CrossEntropyLoss(reduction="none")
    g_ = torch.Generator().manual_seed(0)
    data = [
        (torch.randn(8, 4, generator=g_), torch.randint(0, 3, (8,), generator=g_), torch.ones(8))
        for _ in range(12)
    ]
    if x_bad is not None:
        data[x_bad[0]][0][x_bad[1], 2] = float("nan") if not poison_layer else 1e4
    if y_weight_bad:
        data[5][2][6] = float("nan")  # a per-sample loss weight the model never sees
    with guardrails.guard(model, opt, data, run_dir=tmp_path, progress=False) as g:
        for i, (x, y, w) in enumerate(g):
            loss = (crit(model(x), y) * w).mean() / accum
            g.observe(loss)
            loss.backward()
            if (i + 1) % accum == 0:
                opt.step()
                opt.zero_grad()
    return [e for e in read_events(tmp_path) if e["kind"] == "nonfinite"]


def test_criterion_loop_bad_input_is_named_by_its_argument(tmp_path):
    (ev,) = _criterion_run(tmp_path, x_bad=(5, 3))
    assert (ev["step"], ev["cause"], ev["samples"]) == (6, "bad_data", [3])
    assert "argument `x`" in ev["message"]


def test_criterion_loop_numerics_names_the_module(tmp_path):
    (ev,) = _criterion_run(tmp_path, x_bad=(5, 1), poison_layer=True)
    assert ev["cause"] == "numerics" and ev["module"] == "body.0", ev
    assert "LogOfLarge" in ev["message"] and "its input was finite" in ev["message"]


def test_criterion_loop_bad_loss_weight_is_found_in_the_batch(tmp_path):
    (ev,) = _criterion_run(tmp_path, y_weight_bad=True)
    assert (ev["step"], ev["cause"], ev["samples"]) == (6, "bad_data", [6])
    assert "batch" in ev["message"] and "entry `2`" in ev["message"]


def test_gradient_accumulation_names_the_micro_batch(tmp_path):
    (ev,) = _criterion_run(tmp_path, x_bad=(5, 3), accum=4)
    # Batches 4-7 are step 2; batch 5 is its second forward call.
    assert (ev["step"], ev["cause"], ev["samples"]) == (2, "bad_data", [3])
    assert "forward call 2 of 4" in ev["message"], ev["message"]


def test_loss_outside_the_model_is_said_plainly(tmp_path):
    # The fault is in the loss: replaying the forward is finite and returns no loss.
    torch.manual_seed(0)
    model = Classifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guardrails.guard(model, opt, batches(8), run_dir=tmp_path, progress=False) as g:
        for x, y in g:
            logits = model(x)
            loss = logits.mean() * (float("nan") if g.step == 3 else 1.0) + 0 * y.sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
    (ev,) = [e for e in read_events(tmp_path) if e["kind"] == "nonfinite"]
    assert ev["cause"] == "outside_model", ev
    assert "computes itself" in ev["message"] and "replay_fn" in ev["hint"]


def test_loop_iterating_its_loader_still_stops_at_the_next_step(tmp_path):
    # The guard got the loader but the loop iterates the loader itself: warned once,
    # and a signal is still acted on at the next step (at the next training forward).
    model, loader = Regressor(), batches(30)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = guardrails.guard(model, opt, loader, run_dir=tmp_path)
    with pytest.raises(SystemExit) as stop, g:
        # Not train_loop: it iterates the loader, not the guard, and SIGTERMs at step 10.
        for x, y in loader:
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
            if g.step == 10:
                signal.raise_signal(signal.SIGTERM)
    assert stop.value.code == 128 + signal.SIGTERM
    assert g.step == 10
    kinds = [e["kind"] for e in read_events(tmp_path)]
    assert kinds.count("loader_not_iterated") == 1 and "stopped" in kinds
    assert (tmp_path / "checkpoints/step_000000010").is_dir()


# ---------------------------------------------------------------------- in-process resume


class CountingLoader:
    """A loader with its own ``state_dict()`` (like torchdata's StatefulDataLoader): its
    state counts the batches it handed out, so it is past a prefetched one."""

    def __init__(self, n: int = 40) -> None:
        self.data = batches(n, seed=3)
        self.pos = 0

    def __iter__(self):
        while self.pos < len(self.data):
            self.pos += 1
            yield self.data[self.pos - 1]

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        self.pos = state["pos"]


def _prefetch_train(run_dir, steps, stop_at=None, loader_cls=CountingLoader):
    """A prefetching loop over a CountingLoader; SIGTERM after step ``stop_at``."""
    torch.manual_seed(0)
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with guardrails.guard(model, opt, loader_cls(), run_dir=run_dir, progress=False) as g:
        it = iter(g)
        x, y = next(it)
        while g.step < steps:
            model(x, y).backward()
            x, y = next(it)  # the next batch, fetched before the step
            opt.step()
            opt.zero_grad()
            if g.step == stop_at:
                signal.raise_signal(signal.SIGTERM)
    return model.state_dict(), opt.state_dict()


def test_stateful_loader_in_a_prefetching_loop_resumes_bitwise(tmp_path):
    want = _prefetch_train(tmp_path / "a", steps=12)
    with pytest.raises(SystemExit):
        _prefetch_train(tmp_path / "b", steps=12, stop_at=5)
    rank = json.loads((tmp_path / "b/checkpoints/step_000000005/rank00000.json").read_text())
    assert rank["data"]["loader"] == {"pos": 6}  # the loader's own state: 6 handed out
    assert len(rank["data"]["held"]) == 1  # the prefetched batch, handed out first
    got = _prefetch_train(tmp_path / "b", steps=12)
    assert_state_equal(want, got)


def _random_batches():
    """nanoGPT's ``get_batch``: every batch drawn from torch's global RNG, no loader
    state (a callable iterator, as a user would wrap it)."""
    data = torch.randn(64, 5, generator=torch.Generator().manual_seed(3))
    ix = torch.randint(len(data), (8,))
    return data[ix, :4], data[ix, 4]


class DropoutRegressor(Regressor):
    """Draws from the global RNG in its forward too (nanoGPT's dropout)."""

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(nn.functional.dropout(x, 0.2), y)


def _global_rng_train(run_dir, steps, stop_at=None):
    """nanoGPT's loop: the step's micro-batches each fetch the next batch right after
    their forward (so the next step's first batch is fetched before opt.step()); the
    sampler and dropout draw from the same global RNG."""
    torch.manual_seed(0)
    model = DropoutRegressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = iter(_random_batches, None)
    with guardrails.guard(model, opt, loader, run_dir=run_dir, progress=False) as g:
        it = iter(g)
        x, y = next(it)
        while g.step < steps:
            for _ in range(2):
                model(x, y).backward()
                x, y = next(it)
            opt.step()
            opt.zero_grad()
            if g.step == stop_at:
                signal.raise_signal(signal.SIGTERM)
    return model.state_dict(), opt.state_dict()


def test_prefetched_batch_of_a_global_rng_sampler_is_saved_and_resumes_bitwise(tmp_path):
    # The prefetched batch was drawn before the checkpoint's RNG state: fetched again on
    # resume it came from the RNG as it was after that draw, a different batch (the
    # resumed run trained on another batch from there on, silently).
    want = _global_rng_train(tmp_path / "a", steps=8)
    with pytest.raises(SystemExit):
        _global_rng_train(tmp_path / "b", steps=8, stop_at=3)
    rank = json.loads((tmp_path / "b/checkpoints/step_000000003/rank00000.json").read_text())
    assert rank["data"]["kind"] == "fast_forward" and rank["data"]["batch_in_epoch"] == 6
    assert len(rank["data"]["held"]) == 1  # the prefetched batch, handed out first
    got = _global_rng_train(tmp_path / "b", steps=8)
    assert_state_equal(want, got)
    (ff,) = [e for e in read_events(tmp_path / "b") if e["kind"] == "data_fast_forward"]
    assert ff["batches"] == 6  # the batches trained on, not the held one


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="needs a machine where the checkpoint's cuda:0 does not exist"
)
def test_held_batch_saved_from_a_gpu_resumes_on_the_guards_device(tmp_path):
    # A checkpoint a GPU run wrote (nanoGPT's batches are on its device): the held
    # batch's tensors are recorded with their device. Resumed where that device does
    # not exist (this CPU), they go to the guard's device, and the run is the same.
    import hashlib

    want = _global_rng_train(tmp_path / "a", steps=8)
    with pytest.raises(SystemExit):
        _global_rng_train(tmp_path / "b", steps=8, stop_at=3)
    ckpt = tmp_path / "b/checkpoints/step_000000003"
    rank_file = ckpt / "rank00000.json"
    doc = json.loads(rank_file.read_text())
    doc["data"]["held_devices"] = {"held.0.0": "cuda:0", "held.0.1": "cuda:0"}
    rank_file.write_text(json.dumps(doc))
    manifest = json.loads((ckpt / "manifest.json").read_text())
    data = rank_file.read_bytes()
    manifest["files"]["rank00000.json"] = {
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    manifest["manifest_sha256"] = _self_hash(manifest)
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    assert verify_checkpoint(ckpt) is None
    got = _global_rng_train(tmp_path / "b", steps=8)
    assert_state_equal(want, got)


class XY(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


class NamedTupleLoader:
    """A plain iterable (fast-forwarded) of NamedTuple batches, which a checkpoint would
    give back as plain tuples."""

    def __iter__(self):
        return (XY(x, y) for x, y in batches(40, seed=3))


def _named_train(run_dir, steps, stop_at=None):
    """A prefetching loop that reads its batches' fields by name."""
    torch.manual_seed(0)
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with guardrails.guard(model, opt, NamedTupleLoader(), run_dir=run_dir, progress=False) as g:
        it = iter(g)
        batch = next(it)
        while g.step < steps:
            model(batch.x, batch.y).backward()
            batch = next(it)
            opt.step()
            opt.zero_grad()
            if g.step == stop_at:
                signal.raise_signal(signal.SIGTERM)
    return model.state_dict(), opt.state_dict()


def test_held_batch_that_would_change_type_is_fetched_again(tmp_path):
    # Saved, the NamedTuple would come back a plain tuple: `batch.x` would fail.
    want = _named_train(tmp_path / "a", steps=12)
    with pytest.raises(SystemExit):
        _named_train(tmp_path / "b", steps=12, stop_at=5)
    rank = json.loads((tmp_path / "b/checkpoints/step_000000005/rank00000.json").read_text())
    assert rank["data"]["kind"] == "fast_forward" and "held" not in rank["data"]
    got = _named_train(tmp_path / "b", steps=12)
    assert_state_equal(want, got)


@pytest.mark.parametrize("shape", ["stateful", "global_rng"])
def test_save_before_iterating_a_resumed_run_keeps_the_held_batch(tmp_path, shape):
    # g.save_checkpoint() between the resume and the first batch saves the resumed
    # position, whose prefetched batch is still to be handed out: it must be saved
    # again (it was dropped, and the next resume trained one batch late).
    train = _prefetch_train if shape == "stateful" else _global_rng_train
    want = train(tmp_path / "a", steps=10)
    with pytest.raises(SystemExit):
        train(tmp_path / "b", steps=10, stop_at=4)
    torch.manual_seed(0)
    model = Regressor() if shape == "stateful" else DropoutRegressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = CountingLoader() if shape == "stateful" else iter(_random_batches, None)
    with guardrails.guard(model, opt, loader, run_dir=tmp_path / "b", progress=False) as g:
        assert g.step == 4
        g.save_checkpoint()
    rank = json.loads((tmp_path / "b/checkpoints/step_000000004/rank00000.json").read_text())
    assert len(rank["data"]["held"]) == 1
    got = train(tmp_path / "b", steps=10)
    assert_state_equal(want, got)


class BrokenStateLoader(CountingLoader):
    """``state_dict()`` raises, as accelerate's prepared loader over a plain DataLoader
    does."""

    def state_dict(self):
        raise AttributeError("'DataLoader' object has no attribute 'dl_state_dict'")


class UnstorableStateLoader(CountingLoader):
    """``state_dict()`` returns what a checkpoint cannot store (a set)."""

    def state_dict(self):
        return {"seen": {self.pos}}


@pytest.mark.parametrize(
    ("loader_cls", "error"),
    [(BrokenStateLoader, "AttributeError"), (UnstorableStateLoader, "TypeError")],
)
def test_loader_whose_state_dict_fails_resumes_by_a_counted_fast_forward(
    tmp_path, loader_cls, error
):
    # The save does not fail on the data position (it used to, and saved nothing): it
    # keeps a count instead, says so once, and the resume fetches and drops the batches.
    want = _prefetch_train(tmp_path / "a", steps=12, loader_cls=loader_cls)
    with pytest.raises(SystemExit):
        _prefetch_train(tmp_path / "b", steps=12, stop_at=5, loader_cls=loader_cls)
    rank = json.loads((tmp_path / "b/checkpoints/step_000000005/rank00000.json").read_text())
    assert rank["data"]["kind"] == "fast_forward" and rank["data"]["batch_in_epoch"] == 5
    assert "loader" not in rank["data"]
    assert len(rank["data"]["held"]) == 1  # the prefetched batch, kept all the same
    (warned,) = [e for e in read_events(tmp_path / "b") if e["kind"] == "loader_state_unavailable"]
    assert warned["level"] == "warning" and warned["loader"] == loader_cls.__name__
    assert warned["error"].startswith(error) and warned["resume"] == "fast_forward"
    assert f"{loader_cls.__name__}.state_dict() failed" in warned["message"]
    got = _prefetch_train(tmp_path / "b", steps=12, loader_cls=loader_cls)
    assert_state_equal(want, got)
    (ff,) = [e for e in read_events(tmp_path / "b") if e["kind"] == "data_fast_forward"]
    assert ff["batches"] == 5


class StackedMomentum(torch.optim.Optimizer):
    """Muon-like: one momentum buffer per param group, stacking its parameters, kept
    under the group's first parameter (its shape is not that parameter's)."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = group["params"]
            grads = torch.stack([p.grad for p in params])
            buf = self.state[params[0]].setdefault("momentum_buffer", torch.zeros_like(grads))
            buf.mul_(0.9).add_(grads)
            for p, b in zip(params, buf, strict=True):
                p.add_(b, alpha=-group["lr"])


def test_optimizer_state_of_another_shape_resumes_and_a_real_mismatch_is_named(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    opt = StackedMomentum([model[0].weight, model[1].weight])
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    guardrails.save_checkpoint(tmp_path, 1, model=model, optimizer=opt)
    fresh = StackedMomentum([model[0].weight, model[1].weight])
    guardrails.resume(tmp_path, model, fresh)  # (2, 4, 4) state for a (4, 4) param
    assert_state_equal(opt.state_dict(), fresh.state_dict())
    # Built over other parameters (a bias where a weight was): named, nothing loaded.
    other = StackedMomentum([model[0].weight, model[1].bias])
    with pytest.raises(guardrails.ResumeError, match=r"param 1 \(`1.bias`\): saved for shape"):
        guardrails.resume(tmp_path, model, other)
    assert other.state_dict()["state"] == {}


# ---------------------------------------------------------------------- nanochat's data


class TokenModel(nn.Module):
    """Token ids in, a loss out; token 99 embeds to NaN (a poisoned embedding row: a
    fault that travels with the sample, though ids cannot hold a NaN themselves)."""

    class PoisonedEmbedding(nn.Embedding):
        def forward(self, ids):
            out = super().forward(ids)
            return torch.where((ids == 99).unsqueeze(-1), float("nan"), out)

    def __init__(self) -> None:
        super().__init__()
        self.wte = self.PoisonedEmbedding(100, 8)
        self.head = nn.Linear(8, 100)

    def forward(self, x, y):
        logits = self.head(self.wte(x))
        return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def refilling_loader(n: int, poison_at: int):
    """nanochat's loader in miniature: every batch is a view of one buffer, refilled
    in place by the next ``next()``. Batch ``poison_at`` has token 99 in row 3."""
    g = torch.Generator().manual_seed(0)
    buf = torch.zeros(2, 8, 6, dtype=torch.long)
    for i in range(n):
        buf.copy_(torch.randint(0, 99, (2, 8, 6), generator=g))
        if i == poison_at:
            buf[0, 3, 2] = 99
        yield buf[0], buf[1], {"batch": i}


def test_refilled_buffer_and_token_ids_report_the_sample_the_step_trained_on(tmp_path):
    torch.manual_seed(0)
    model = TokenModel()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = refilling_loader(12, poison_at=6)
    with guardrails.guard(model, opt, loader, run_dir=tmp_path, progress=False) as g:
        it = iter(g)
        x, y, _ = next(it)
        while g.step < 10:
            model(x, y).backward()
            x, y, _ = next(it)  # prefetch: refills the buffer x and y view
            opt.step()
            opt.zero_grad()
    events = read_events(tmp_path)
    assert [e["kind"] for e in events].count("inputs_refilled") == 1
    (ev,) = [e for e in events if e["kind"] == "nonfinite"]
    # Batch 6 (the 7th) was trained on by step 7, and its row 3 is the culprit.
    assert (ev["step"], ev["cause"], ev["module"], ev["samples"]) == (7, "numerics", "wte", [3])
    assert "sample row(s) [3]" in ev["message"], ev["message"]
    saved = load_file(Path(ev["path"]) / "batch.safetensors")
    assert int(saved["call0.x"][3, 2]) == 99  # the data the step saw, not the refill


FLAT_SCRIPT = """
import os, signal, sys, torch
sys.path.insert(0, {tests!r})
from conftest import Regressor, batches
import guardrails

torch.manual_seed(0)
model = Regressor()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = batches(40)
if sys.argv[2] == "nan":
    data[12][0][3, 1] = float("nan")
g = guardrails.guard(model, opt, data, run_dir=sys.argv[1], nan={{"policy": "raise"}}).start()
for x, y in g:  # no `with`, no main(): nanochat's shape
    model(x, y).backward()
    opt.step()
    opt.zero_grad()
    if sys.argv[2] == "sigterm" and g.step == 5:
        os.kill(os.getpid(), signal.SIGTERM)
g.close()
"""


@pytest.mark.parametrize("fault", ["sigterm", "nan"])
@pytest.mark.slow(reason="a training process per fault")
def test_a_flat_script_that_never_reaches_close_is_closed_at_exit(tmp_path, fault):
    # The loop ends by the guard's own SystemExit (a signal save) or an uncaught
    # NonFiniteError, so `g.close()` never runs: the guard closes itself at the
    # interpreter's exit, flushing metrics and writing its end event.
    script = tmp_path / "train.py"
    script.write_text(FLAT_SCRIPT.format(tests=str(Path(__file__).resolve().parents[1])))
    proc = run_script([sys.executable, script, tmp_path / "run", fault], timeout_s=120)
    assert proc.returncode == (143 if fault == "sigterm" else 1), proc.stderr
    (end,) = [e for e in read_events(tmp_path / "run") if e["kind"] == "end"]
    assert end["error"].startswith("SystemExit: 143" if fault == "sigterm" else "NonFiniteError")
    rows = guardrails.read_metrics(tmp_path / "run").num_rows
    # NanGuard raises inside step 13 (its batch holds the NaN): that row is kept too.
    assert rows == (5 if fault == "sigterm" else 13), rows


def test_a_signal_stop_reports_the_skips_the_lagged_read_had_not_reached(tmp_path, monkeypatch):
    # On a GPU the host reads NanGuard's flags ~10-20 steps late; a SIGTERM stop before
    # that read must still report the skipped step (the CPU runs the GPU's lagged path).
    monkeypatch.setattr(guardrails.NanGuard, "_lagged_on_cpu", True)
    torch.manual_seed(0)
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = batches(20)
    data[1][0][2, 1] = float("nan")  # step 2
    with pytest.raises(SystemExit), guardrails.guard(model, opt, data, run_dir=tmp_path) as g:
        train_loop_signalled(g, model, opt, after_step=4)
    (ev,) = [e for e in read_events(tmp_path) if e["kind"] == "nonfinite"]
    assert (ev["step"], ev["cause"], ev["samples"]) == (2, "bad_data", [2])


# ---------------------------------------------------------------------- wrapping orders


class NoLen(nn.Module):
    """A model that cannot be tested for truth: ``bool(module)`` calls its ``__len__``,
    which raises, as nanoGPT's did under ``DDP(torch.compile(model))`` at guard start
    ("TypeError: MLP does not support len()"). A guard must never test a module so."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)

    def __len__(self) -> int:
        raise TypeError(f"{type(self).__name__} does not support len()")


def _wrapping_orders_rank(rank: int, port: int, out: str) -> None:
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    results = {}
    try:
        for order in ("ddp", "ddp(compile)", "compile(ddp)", "compile", "fsdp2", "compile(fsdp2)"):
            torch.manual_seed(0)
            bare = NoLen()
            keys = sorted(bare.state_dict())
            if "fsdp2" in order:
                fully_shard(bare, mesh=init_device_mesh("cpu", (2,)))
            model = {
                "ddp": lambda m: DDP(m),
                "ddp(compile)": lambda m: DDP(torch.compile(m)),
                "compile(ddp)": lambda m: torch.compile(DDP(m)),
                "compile": torch.compile,
                "fsdp2": lambda m: m,
                "compile(fsdp2)": torch.compile,
            }[order](bare)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            run = Path(out, order)
            with guardrails.guard(model, opt, run_dir=run, progress=False) as g:
                nan = next(c for c in g.components if isinstance(c, guardrails.NanGuard))
                saved = g.save_checkpoint()
            files = json.loads((saved / "manifest.json").read_text())["files"]
            if "fsdp2" in order:
                results[order] = {"reduce": nan._reduce, "sharded": "dcp/.metadata" in files}
            else:
                stored = sorted(load_file(saved / "model.safetensors"))
                results[order] = {"reduce": nan._reduce, "bare_keys": stored == keys}
    except Exception as exc:
        results["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        Path(out, f"rank{rank}.json").write_text(json.dumps(results))
        dist.destroy_process_group()


@pytest.mark.slow(reason="2 ranks importing torch.compile")
def test_every_wrapping_order_of_ddp_fsdp2_and_compile_starts_and_saves_bare_keys(tmp_path):
    # Guard start (preflight), NanGuard's choice and a checkpoint, for each order. The
    # forward is never run, so nothing compiles: the wrappers alone are what is tested.
    from conftest import spawn

    spawn(_wrapping_orders_rank, (free_port(), str(tmp_path)))
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert "error" not in got, got
        for order in ("ddp", "ddp(compile)", "compile(ddp)"):
            assert got[order] == {"reduce": False, "bare_keys": True}, (order, got)
        # No DDP: the ranks' gradients may differ, so the flag is agreed.
        assert got["compile"] == {"reduce": True, "bare_keys": True}
        for order in ("fsdp2", "compile(fsdp2)"):  # the grad norm is global: no agreement
            assert got[order] == {"reduce": False, "sharded": True}, (order, got)


# ---------------------------------------------------------------------- fixes that work


class WithHead(Regressor):
    """The Regressor with one more parameter: a checkpoint's keys are a subset."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Linear(1, 1)


def test_every_fix_a_resume_error_suggests_works_with_guard(tmp_path):
    # guard() has no strict=: a resume that does not fit says what to do with the API
    # that raised it, and each suggestion is carried out here.
    guarded_run(tmp_path, n_steps=3, checkpoint={"every_n_steps": 3})
    ckpt = tmp_path / "checkpoints" / "step_000000003"
    model = WithHead()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(guardrails.ResumeError) as err:
        guardrails.guard(model, opt, run_dir=tmp_path).start()
    text = str(err.value)
    assert "guardrails.resume(" in text and "strict=False" in text and "resume=None" in text
    assert "guard(..., strict" not in text
    guardrails.resume(ckpt, model, strict=False)  # the suggestion, as written
    with guardrails.guard(model, opt, run_dir=tmp_path, resume=None) as g:
        assert g.step == 0

    # A scheduler the checkpoint does not hold: leave it out, or resume(..., strict=False).
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    with pytest.raises(guardrails.ResumeError) as err:
        guardrails.guard(model, opt, scheduler=sched, run_dir=tmp_path).start()
    assert "leave scheduler= out of guard(...)" in str(err.value)
    with guardrails.guard(model, opt, run_dir=tmp_path) as g:
        assert g.step == 3
    guardrails.resume(ckpt, model, opt, scheduler=sched, strict=False)


def _forever(delay_s: float = 0.0):
    """An endless generator of batches (no length: resumed by fast-forwarding)."""
    g = torch.Generator().manual_seed(0)
    while True:
        if delay_s:
            time.sleep(delay_s)
        yield torch.randn(8, 4, generator=g), torch.randn(8, generator=g)


def _train_forever(run_dir, steps: int, delay_s: float = 0.0) -> None:
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with guardrails.guard(model, opt, _forever(delay_s), run_dir=run_dir, progress=False) as g:
        # Not train_loop: it saves and breaks at step `steps` of an endless loader.
        for x, y in g:
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
            if g.step == steps:
                g.save_checkpoint()
                break


@pytest.mark.slow(reason="fast-forwards a loader through many batches: ~2.2 CPU-s")
def test_a_long_fast_forward_says_how_far_it_is_and_how_long_is_left(tmp_path, monkeypatch):
    # A loader without a length is fast-forwarded batch by batch at resume, and the
    # start is blocked meanwhile: past PROGRESS_EVERY_S it says how far it is, the
    # rate and the time left (a position the loader cannot reach in reasonable time
    # shows as days), at each interval, and the usual data_fast_forward at the end.
    import guardrails.engine.data

    _train_forever(tmp_path, 40)
    monkeypatch.setattr(guardrails.engine.data, "PROGRESS_EVERY_S", 0.05)
    _train_forever(tmp_path, 41, delay_s=0.01)  # 40 batches at >= 10 ms: ~8 notes
    events = read_events(tmp_path)
    notes = [e for e in events if e["kind"] == "data_fast_forward_progress"]
    assert len(notes) >= 3, notes
    assert all(e["of"] == 40 and e["level"] == "warning" for e in notes)
    assert [e["batches"] for e in notes] == sorted(e["batches"] for e in notes)
    assert 0 < notes[0]["batches"] < 40 and "of 40 after" in notes[0]["message"]
    assert "left)" in notes[0]["message"] and "resume=None" in notes[0]["message"]
    (ff,) = [e for e in events if e["kind"] == "data_fast_forward"]
    assert ff["batches"] == 40 and ff["level"] == "warning"  # it cost the restart time
    # A quick fast-forward (well under the interval) says nothing more than that, as
    # information: a healthy resume of nanoGPT's loop shows no warning.
    monkeypatch.setattr(guardrails.engine.data, "PROGRESS_EVERY_S", 60.0)
    _train_forever(tmp_path / "quick", 40)
    _train_forever(tmp_path / "quick", 41)
    quick = read_events(tmp_path / "quick")
    assert "data_fast_forward_progress" not in [e["kind"] for e in quick]
    (ff,) = [e for e in quick if e["kind"] == "data_fast_forward"]
    assert ff["level"] == "info" and ff["batches"] == 40 and ff["seconds"] < 60


# ---------------------------------------------------------------------- closure optimizers


def _closure_run(run_dir, *, guarded, nan_at=None, make_opt=None, keyword=False, steps=6):
    """Train with ``opt.step(closure)`` (LBFGS by default), the loss computed outside
    the model; a NaN sample in step ``nan_at``'s batch. Returns (model, weights before
    step ``nan_at``, after it)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = (make_opt or (lambda p: torch.optim.LBFGS(p, lr=0.5, max_iter=5)))(model.parameters())
    g_ = torch.Generator().manual_seed(0)
    data = [
        (torch.randn(16, 4, generator=g_), torch.randn(16, 1, generator=g_)) for _ in range(steps)
    ]
    if nan_at is not None:
        data[nan_at - 1][0][1, 1] = float("nan")
    seen = {}

    def loop(it):
        for i, (x, y) in enumerate(it):

            def closure(x=x, y=y):
                opt.zero_grad()
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                return loss

            if i + 1 == nan_at:
                seen["before"] = [p.detach().clone() for p in model.parameters()]
            opt.step(closure=closure) if keyword else opt.step(closure)
            if i + 1 == nan_at:
                seen["after"] = [p.detach().clone() for p in model.parameters()]

    if guarded:
        with guardrails.guard(model, opt, data, run_dir=run_dir, progress=False) as g:
            loop(g)
    else:
        loop(data)
    return model, seen


@pytest.mark.parametrize(
    ("make_opt", "keyword"),
    [(None, False), (None, True), (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), False)],
    ids=["lbfgs", "lbfgs_keyword", "sgd_closure"],
)
def test_closure_optimizer_is_bitwise_plain_and_silent(tmp_path, make_opt, keyword):
    plain, _ = _closure_run(tmp_path / "a", guarded=False, make_opt=make_opt, keyword=keyword)
    guarded, _ = _closure_run(tmp_path / "b", guarded=True, make_opt=make_opt, keyword=keyword)
    for a, b in zip(plain.parameters(), guarded.parameters(), strict=True):
        assert torch.equal(a, b)
    events = read_events(tmp_path / "b")
    assert [e for e in events if e["level"] == "warning"] == []  # no zero_grads at start


def test_closure_optimizer_nan_is_skipped_before_the_update(tmp_path):
    # The closure computes the gradients inside step(): judged after it ran, before
    # the update, so the NaN never reaches the weights and the run goes on.
    model, seen = _closure_run(tmp_path, guarded=True, nan_at=3)
    for a, b in zip(seen["before"], seen["after"], strict=True):
        assert torch.equal(a, b)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    events = read_events(tmp_path)
    (ev,) = [e for e in events if e["kind"] == "nonfinite"]
    assert (ev["step"], ev["cause"], ev["samples"]) == (3, "bad_data", [1]), ev
    assert [e["step"] for e in events if e["kind"] == "nonfinite_recovered"] == [4]
    assert events[-1]["kind"] == "end" and events[-1]["error"] is None


# ---------------------------------------------------------------------- the loss


def _outside_loss_run(run_dir, *, accum=1, backward=None, scaler=None, steps=4):
    """``loss = criterion(model(x), y)`` (the model returns predictions), backpropagated
    by ``backward(loss)`` (default ``loss.backward()``); returns each micro-batch's loss."""
    torch.manual_seed(0)
    model = Classifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    crit = nn.CrossEntropyLoss()
    g_ = torch.Generator().manual_seed(0)
    data = [
        (torch.randn(8, 4, generator=g_), torch.randint(0, 3, (8,), generator=g_))
        for _ in range(steps * accum)
    ]
    losses = []
    with guardrails.guard(model, opt, data, run_dir=run_dir, progress=False, scaler=scaler) as g:
        for i, (x, y) in enumerate(g):
            loss = crit(model(x), y)
            losses.append(loss.detach().clone())
            if scaler is not None:
                scaler.scale(loss / accum).backward()
            else:
                (backward or torch.Tensor.backward)(loss / accum)
            if (i + 1) % accum == 0:
                if scaler is not None:
                    scaler.step(opt)
                    scaler.update()
                else:
                    opt.step()
                opt.zero_grad()
    return torch.stack(losses)


@pytest.mark.parametrize("accum", [1, 3])
def test_loss_computed_outside_the_model_is_recorded(tmp_path, accum):
    original = torch.Tensor.__dict__["backward"]
    losses = _outside_loss_run(tmp_path, accum=accum)
    assert torch.Tensor.__dict__["backward"] is original  # put back exactly at close
    recorded = guardrails.read_metrics(tmp_path).column("loss").to_pylist()
    # With (loss / accum).backward() per micro-batch, the step's loss is their mean.
    expected = losses.view(-1, accum).mean(1).tolist()
    assert recorded == pytest.approx(expected, rel=1e-6)
    warnings = [e for e in read_events(tmp_path) if e["level"] == "warning"]
    assert warnings == [], warnings


def test_loss_scaled_by_a_grad_scaler_is_recorded_unscaled(tmp_path):
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    losses = _outside_loss_run(tmp_path, scaler=scaler)
    recorded = guardrails.read_metrics(tmp_path).column("loss").to_pylist()
    assert recorded == pytest.approx(losses.tolist(), rel=1e-6)


def test_loss_the_guard_cannot_see_is_named_once_with_the_fix(tmp_path):
    _outside_loss_run(tmp_path, backward=torch.autograd.backward)
    (ev,) = [e for e in read_events(tmp_path) if e["level"] == "warning"]
    assert ev["kind"] == "no_loss" and ev["step"] == 1, ev
    assert "g.observe(loss)" in ev["message"]


# ---------------------------------------------------------------------- Lightning Fabric


def _fabric_run(run_dir, *, guarded, nan_at=None, steps=6):
    """A Fabric loop on what ``fabric.setup()`` returned: a BatchNorm model, fused
    AdamW, ``loss = mse(model(x), y)``, ``fabric.backward(loss)``."""
    lightning = pytest.importorskip(
        "lightning", reason="Lightning Fabric is an optional integration, not in every CI"
    )
    fabric = lightning.Fabric(accelerator="cpu", devices=1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    model, opt = fabric.setup(model, opt)
    g_ = torch.Generator().manual_seed(0)
    data = [
        (torch.randn(16, 4, generator=g_), torch.randn(16, 1, generator=g_)) for _ in range(steps)
    ]
    if nan_at is not None:
        data[nan_at - 1][0][2, 1] = float("nan")
    loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(data, batch_size=None))

    def loop(it):
        for x, y in it:
            fabric.backward(nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()

    if guarded:
        with guardrails.guard(model, opt, loader, run_dir=run_dir, progress=False) as g:
            loop(g)
        assert "forward" not in vars(model) and "forward" not in vars(model.module)
    else:
        loop(loader)
    return model.module


def test_fabric_setup_objects_train_as_given_bitwise_and_silent(tmp_path):
    plain = _fabric_run(tmp_path / "a", guarded=False)
    guarded = _fabric_run(tmp_path / "b", guarded=True)
    for (k, a), (_, b) in zip(
        plain.state_dict().items(), guarded.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), k
    assert [e for e in read_events(tmp_path / "b") if e["level"] == "warning"] == []
    losses = guardrails.read_metrics(tmp_path / "b").column("loss").to_pylist()
    assert len(losses) == 6 and all(v == v for v in losses)  # fabric.backward(loss): recorded


def test_fabric_nan_is_skipped_in_the_wrapped_fused_optimizer(tmp_path):
    # The skip flag must reach the torch optimizer under Fabric's wrapper (a fused
    # step reads found_inf from itself), and the BatchNorm statistics are put back.
    model = _fabric_run(tmp_path, guarded=True, nan_at=3)
    assert all(torch.isfinite(t).all() for t in model.state_dict().values())
    events = read_events(tmp_path)
    (ev,) = [e for e in events if e["kind"] == "nonfinite"]
    assert ev["step"] == 3 and ev["cause"] == "bad_data", ev
    assert [e["step"] for e in events if e["kind"] == "nonfinite_recovered"] == [4]


def test_a_non_scalar_backward_keeps_torchs_own_error(tmp_path):
    # The guard watches loss.backward() for the step's loss: a mistaken backward of a
    # non-scalar output must still fail with torch's message, not the guard's.
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guardrails.guard(model, opt, run_dir=tmp_path, progress=False):
        with pytest.raises(RuntimeError, match="only for scalar outputs"):
            model(torch.randn(3, 4)).backward()
