"""GuardedDDP with two real gloo ranks: plain DDP's gradients bitwise, its bucket
all-reduces seen by the auditor, models that differ named at construction, unused
parameters named, and DDP's join() still working.

All cases run in one pair of processes (see test_preflight.py for why), each case in
order on both ranks."""

from __future__ import annotations

import os
import pickle
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    CountNorms,
    Regressor,
    batches,
    free_port,
    read_events,
    reference_grad_norm,
    spawn,
    train_loop,
)
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import guardrails

#: The tests that read the shared two-rank fixture (plain DDP and GuardedDDP, spawned).
two_ranks = pytest.mark.slow(reason="reads the shared two-rank fixture: 2 spawned ranks")


class TwoHeads(nn.Module):
    """``head_b`` is used only when asked: DDP without find_unused_parameters fails."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.head_a = nn.Linear(8, 1)
        self.head_b = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor, use_b: bool = False) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        pred = (self.head_b if use_b else self.head_a)(h).squeeze(-1)
        return nn.functional.mse_loss(pred, y)


def _steps(model, opt, data, n: int) -> list[list[torch.Tensor]]:
    grads = []
    for x, y in data[:n]:
        model(x, y).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
    return grads


def case_bitwise(rank):
    data = batches(4, seed=10 + rank)  # different data per rank: the all-reduce matters
    out = {}
    for name, cls in (("plain", DistributedDataParallel), ("guarded", guardrails.GuardedDDP)):
        torch.manual_seed(0)
        model = cls(Regressor(), bucket_cap_mb=1e-4)  # tiny buckets: several per step
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        out[name] = _steps(model, opt, data, 4)
        out[name + "_weights"] = [p.detach().clone() for p in model.parameters()]
    return out


def case_audited(rank):
    torch.manual_seed(0)
    model = guardrails.GuardedDDP(Regressor(), bucket_cap_mb=1e-4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run_dir = Path(os.environ["OUT"]) / "audited"
    with guardrails.guard(
        model,
        opt,
        batches(3, seed=rank),
        run_dir=run_dir,
        metrics=False,
        checkpoint={"save_on_signal": False},
    ) as g:
        train_loop(g, model, opt)
        auditor = g.auditor
        assert auditor is not None, "no CollectiveAuditor running"
        recent = [guardrails.guards.audit.calls.entry_dict(e) for e in auditor.recent]
    return {"entries": [(e["step"], str(e["site"]), e["op"]) for e in recent], "steps": g.step}


def _bucket_run(rank, name, *, nan_at=-1, scaler=False, dtype=torch.float32):
    """4 guarded GuardedDDP steps, no clipping; returns the gradients' norm before each
    step (computed here, per parameter), the guard's recorded norms and skips, the
    guard's _foreach_norm calls, its grad_norm_shared events, and whether the weights
    stayed bitwise the same over the step with a NaN."""
    torch.manual_seed(0)
    model = guardrails.GuardedDDP(Regressor(depth=3).to(dtype), bucket_cap_mb=1e-4)  # several
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-2)
    grad_scaler = torch.amp.GradScaler("cpu", init_scale=4.0) if scaler else None
    run_dir = Path(os.environ["OUT"]) / name
    counter = CountNorms()
    norms, unchanged = [], None
    with guardrails.guard(
        model,
        opt,
        batches(4, seed=10 + rank),
        run_dir=run_dir,
        scaler=grad_scaler,
        checkpoint={"save_on_signal": False},
    ) as g:
        for i, (x, y) in enumerate(g):
            loss = model(x.to(dtype), y.to(dtype))
            if i == nan_at and rank == 1:
                loss = loss * float("nan")  # one rank's NaN: both ranks' averaged grads
            with counter:
                (grad_scaler.scale(loss) if scaler else loss).backward()
            norms.append(reference_grad_norm(model))
            before = [p.detach().clone() for p in params]
            with counter:
                if scaler:
                    grad_scaler.step(opt)
                    grad_scaler.update()
                else:
                    opt.step()
            if i == nan_at:
                unchanged = all(torch.equal(a, b) for a, b in zip(before, params, strict=True))
            opt.zero_grad()
    rows = [r for r in guardrails.read_metrics(run_dir).to_pylist() if r["rank"] == rank]
    events = [
        e for e in read_events(run_dir) if e["kind"] == "grad_norm_shared" and e["rank"] == rank
    ]
    return {
        "norms": norms,
        "recorded": [r["grad_norm"] for r in rows],
        "skipped": [r["skipped"] for r in rows],
        "own_norm_calls": counter.calls,
        "shared": [(e.get("source"), e["steps"]) for e in events],
        "unchanged": unchanged,
    }


def case_bucket_norm(rank):
    return _bucket_run(rank, "bucket_norm")


def case_bucket_norm_nan(rank):
    return _bucket_run(rank, "bucket_norm_nan", nan_at=2)


def case_bucket_norm_float64(rank):
    return _bucket_run(rank, "bucket_norm_float64", dtype=torch.float64)


def case_bucket_norm_scaled(rank):
    return _bucket_run(rank, "bucket_scaler", scaler=True)


def case_structure(rank):
    torch.manual_seed(0)
    model = Regressor(depth=2 if rank == 0 else 3)
    guardrails.GuardedDDP(model)
    return {}


def case_seeds(rank):
    torch.manual_seed(rank)  # nanoGPT-style seed + rank: DDP broadcasts rank 0's weights
    model = guardrails.GuardedDDP(Regressor())
    return {"weights": [p.detach().clone() for p in model.parameters()]}


def case_unused(rank):
    torch.manual_seed(0)
    model = guardrails.GuardedDDP(TwoHeads())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in batches(2, seed=rank):
        model(x, y).backward()  # head_b gets no gradient; DDP fails at the next forward
        opt.step()
        opt.zero_grad()
    return {}


def case_join(rank):
    torch.manual_seed(0)
    model = guardrails.GuardedDDP(Regressor())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    n = 0
    with model.join():  # DDP's own answer to uneven inputs: 3 batches vs 5
        for x, y in batches(3 if rank == 0 else 5, seed=rank):
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
            n += 1
    return {"steps": n, "weights": [p.detach().clone() for p in model.parameters()]}


CASES = {name[5:]: fn for name, fn in globals().copy().items() if name.startswith("case_")}


def _worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OUT=out)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    try:
        for name, fn in CASES.items():
            t0 = time.perf_counter()
            try:
                results[name] = fn(rank)
            except guardrails.GuardrailsError as exc:
                results[name] = {
                    "error": type(exc).__name__,
                    "message": str(exc),
                    "fields": getattr(exc, "fields", None),
                    "unused": getattr(exc, "unused_parameters", None),
                    "cause": repr(exc.__cause__),
                    "rank": exc.rank,
                }
            results[name]["seconds"] = time.perf_counter() - t0
    finally:
        Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps(results))
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    spawn(_worker, (2, free_port(), str(out)))
    ranks = [pickle.loads((out / f"rank{r}.pkl").read_bytes()) for r in range(2)]
    return {name: (ranks[0][name], ranks[1][name]) for name in CASES}


@two_ranks
def test_gradients_and_weights_equal_plain_ddp_bitwise(outcomes):
    for res in outcomes["bitwise"]:
        assert "error" not in res, res
        for step, (a, b) in enumerate(zip(res["plain"], res["guarded"], strict=True)):
            for ga, gb in zip(a, b, strict=True):
                assert torch.equal(ga, gb), f"step {step}"
        for wa, wb in zip(res["plain_weights"], res["guarded_weights"], strict=True):
            assert torch.equal(wa, wb)
    # and the ranks agree, as DDP's averaging promises
    r0, r1 = outcomes["bitwise"]
    assert all(torch.equal(a, b) for a, b in zip(r0["guarded"][-1], r1["guarded"][-1], strict=True))


@two_ranks
def test_bucket_all_reduces_reach_the_auditor(outcomes):
    for res in outcomes["audited"]:
        assert "error" not in res, res
        buckets = [e for e in res["entries"] if e[1].startswith("DDP gradient all-reduce (b")]
        # Every step's backward reported its buckets (DDP rebuilds them after the first
        # step: 1 bucket, then 2), each once: nothing also came through the patched
        # dist.all_reduce from torch's own hook code.
        assert {step for step, _, _ in buckets} == {0, 1, 2}, res["entries"]
        assert {op for _, _, op in buckets} == {"all_reduce"}
        assert len(buckets) >= 4, res["entries"]
        assert not any("torch" in site for _, site, _ in res["entries"]), res["entries"]


@two_ranks
def test_the_step_norm_comes_from_the_reduced_buckets(outcomes):
    """No clipping: the guard's grad norm is the buckets' (taken in the comm hook after
    each all-reduce), equal to the gradients' norm, with no pass of its own."""
    for res in outcomes["bucket_norm"]:
        assert "error" not in res, res
        assert res["recorded"] == pytest.approx(res["norms"], rel=1e-5)
        assert res["own_norm_calls"] == 0
        assert res["shared"] == [("ddp_buckets", 4)]
    r0, r1 = outcomes["bucket_norm"]
    assert r0["recorded"] == r1["recorded"]  # the averaged gradients: the same everywhere


@two_ranks
def test_float64_buckets_give_the_step_norm_too(outcomes):
    """A float64 model's buckets (vector_norm refuses to narrow them to float32 in one
    call: the hook raised inside backward before this was fixed)."""
    for res in outcomes["bucket_norm_float64"]:
        assert "error" not in res, res
        assert res["recorded"] == pytest.approx(res["norms"], rel=1e-6)
        assert res["shared"] == [("ddp_buckets", 4)]


@two_ranks
def test_a_nan_on_one_rank_is_caught_from_the_buckets_on_both(outcomes):
    for res in outcomes["bucket_norm_nan"]:
        assert "error" not in res, res
        assert res["skipped"] == [False, False, True, False]
        assert res["unchanged"] is True
        assert res["shared"] == [("ddp_buckets", 4)]  # the NaN was seen in the buckets


@two_ranks
def test_buckets_of_gradients_a_scaler_unscales_later_are_not_used(outcomes):
    """Under a GradScaler the buckets hold scaled gradients (unscaled after the
    all-reduce): the guard computes its own norm, of the unscaled ones, as before."""
    for res in outcomes["bucket_norm_scaled"]:
        assert "error" not in res, res
        assert res["shared"] == [] and res["own_norm_calls"] >= 4
        # Measured after unscaling (loss scale 4): not the buckets' scaled gradients.
        assert res["recorded"] == pytest.approx([n / 4 for n in res["norms"]], rel=1e-5)


@two_ranks
def test_different_models_are_named_at_construction_on_every_rank(outcomes):
    r0, r1 = outcomes["structure"]
    for r, res in enumerate((r0, r1)):
        assert res.get("error") == "ConfigMismatchError", res
        assert res["rank"] == r
    assert r0["fields"] == r1["fields"]
    assert "params.names" in r0["fields"]
    assert "net.6.weight" in r0["message"]  # the extra layer, by name


@two_ranks
def test_different_seeds_are_fine_under_ddp(outcomes):
    r0, r1 = outcomes["seeds"]
    assert "error" not in r0 and "error" not in r1, (r0, r1)
    assert all(torch.equal(a, b) for a, b in zip(r0["weights"], r1["weights"], strict=True))


@two_ranks
def test_unused_parameters_are_named_with_the_fix(outcomes):
    for r, res in enumerate(outcomes["unused"]):
        assert res.get("error") == "GuardrailsError", res
        assert res["unused"] == ["head_b.weight", "head_b.bias"]
        assert "head_b.weight" in res["message"]
        assert "find_unused_parameters=True" in res["message"]
        assert "Expected to have finished reduction" in res["cause"]  # chained
        assert res["rank"] == r


@two_ranks
def test_join_still_handles_uneven_inputs(outcomes):
    r0, r1 = outcomes["join"]
    assert "error" not in r0 and "error" not in r1, (r0, r1)
    assert (r0["steps"], r1["steps"]) == (3, 5)
    assert all(torch.equal(a, b) for a, b in zip(r0["weights"], r1["weights"], strict=True))


def test_bucket_norms_recorded_from_many_threads_at_once_keep_every_bucket():
    """gloo completes each bucket's all-reduce on a thread of its own, so the comm
    hook's callbacks record at once, while the slots grow (DDP rebuilds its buckets
    after the first step). Every bucket's norm must land, whatever the interleaving:
    a slot written into a tensor another callback just replaced was lost, and two
    growths raced into a shape error (1 run in 4 of the DDP tests above)."""
    import threading

    from guardrails.engine.gradnorm import BucketNorms

    buckets = [torch.full((64,), float(i + 1)) for i in range(8)]
    for trial in range(200):
        norms = BucketNorms(torch.device("cpu"))
        start = threading.Barrier(len(buckets))
        errors = []

        def reduced(i, norms=norms, start=start, errors=errors, trial=trial):
            start.wait()
            try:
                norms.record(i, buckets[i], i == len(buckets) - 1, trial)
            except Exception as e:  # a real thread's error, reported below
                errors.append(e)

        threads = [threading.Thread(target=reduced, args=(i,)) for i in range(len(buckets))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        expected = torch.linalg.vector_norm(torch.stack([b.norm() for b in buckets]))
        assert torch.equal(norms.total(trial), expected), trial
