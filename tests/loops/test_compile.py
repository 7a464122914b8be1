"""The guard under ``torch.compile``: whichever module it is given and whatever the
wrapping order, dynamo compiles the same graphs as without it (the same number of
graphs, captured calls, graph breaks and recompiles: the guard's per-forward and
per-step bookkeeping runs outside the traced region), and that bookkeeping still
happens at run time (the step's loss, batches and forwards, the phase).

Dynamo's own counters (``torch._dynamo.utils.counters``) are read after a run with
and without the guard, from a reset; backends "eager" and "aot_eager" run on CPU.
"""

from __future__ import annotations

import os
import pickle
import tempfile
from pathlib import Path

import pytest
import torch._dynamo
from conftest import Regressor, batches, free_port, read_events, spawn, train_loop

import guardrails
from guardrails.engine.component import Component

STEPS = 6  # the old wrapper recompiled at every new batch_in_epoch: 6 steps show it


class _Seen(Component):
    """What the guard knew at each step's ``before_step``: the step's loss, how many
    batches and training forwards it recorded, the phase."""

    name = "seen"

    def __init__(self, log: list) -> None:
        self.log = log

    def before_step(self, guard) -> None:
        loss = guard.step_loss
        self.log.append(
            (
                None if loss is None else float(loss),
                len(guard.step_batches),
                len(guard.step_calls),
                guard.phase,
            )
        )


def _counts() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {
        "graphs": counters["stats"]["unique_graphs"],
        "captured calls": counters["stats"]["calls_captured"],
        "graph breaks": sum(counters["graph_break"].values()),
        "recompiles": sum(counters["recompiles"].values()),
        # CUDA graphs (mode "reduce-overhead" / "max-autotune"): a graph inductor chose
        # not to capture (a mutated input, a CPU tensor, ...) counts here.
        "cudagraph skips": counters["inductor"]["cudagraph_skips"],
    }


def train(
    order: str,
    backend: str,
    given: str | None,
    rank: int = 0,
    *,
    device: str = "cpu",
    mode: str | None = None,
) -> dict:
    """``STEPS`` steps of a Regressor wrapped in ``order``, under a guard given the
    ``given`` module (``None``: no guard); dynamo's counters and what the guard saw.
    ``mode``: torch.compile's mode (inductor on CUDA: "max-autotune", "reduce-overhead")."""
    from torch._dynamo.utils import counters
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = Regressor().to(device)
    mods = {"raw": model}
    compile_kw = {"backend": backend, **({"mode": mode} if mode else {})}
    if order == "compile(DDP(model))":
        mods["ddp"] = DDP(model)
        mods["compiled"] = step_model = torch.compile(mods["ddp"], **compile_kw)
    elif order == "DDP(compile(model))":
        mods["compiled"] = torch.compile(model, **compile_kw)
        mods["ddp"] = step_model = DDP(mods["compiled"])
    elif order == "compile(fully_shard(model))":
        from torch.distributed.fsdp import fully_shard

        mods["fsdp"] = fully_shard(model)  # in place: the same module, sharded
        mods["compiled"] = step_model = torch.compile(model, **compile_kw)
    else:
        mods["compiled"] = step_model = torch.compile(model, **compile_kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)  # after fully_shard: its DTensors

    # A compiled optimizer step: the function resolves opt.step when it runs (the
    # guard's, once the guard started), and dynamo compiles the optimizer's own step.
    def update() -> None:
        opt.step()  # looked up at each call: the guard's once the guard started

    if "step" in order:
        update = torch.compile(update, **compile_kw)
    data = [(x.to(device), y.to(device)) for x, y in batches(STEPS, seed=rank)]
    seen: list = []
    losses: list[float] = []
    phases: list[str] = []

    def loop(it, g=None) -> None:
        for x, y in it:
            if mode is not None:  # CUDA graphs: a new step's outputs may overwrite the last's
                torch.compiler.cudagraph_mark_step_begin()
            loss = step_model(x, y)
            losses.append(float(loss.detach()))
            if g is not None:
                phases.append(g.phase)
            loss.backward()
            update()
            opt.zero_grad()

    if given is None:
        loop(data)
        return {**_counts(), "losses": losses}
    with guardrails.guard(
        mods[given], opt, data, run_dir=tempfile.mkdtemp(), progress=False, components=[_Seen(seen)]
    ) as g:
        loop(g, g)
    flops = [e for e in read_events(g.run_dir) if e["kind"] == "flops"]
    return {
        **_counts(),
        "losses": losses,
        "seen": seen,
        "phases": phases,
        "step": g.step,
        "given": given,
        "forward_compiled": g.forward_compiled,
        "flops_counted": [e.get("flops_per_step") for e in flops],
    }


def check(base: dict, guarded: dict, *, exact: bool = True) -> None:
    """``exact=False``: the losses within rounding (on a GPU two unguarded runs may
    differ in the last bits already)."""
    counts = ("graphs", "captured calls", "graph breaks", "recompiles", "cudagraph skips")
    assert {k: guarded[k] for k in counts} == {k: base[k] for k in counts}
    if exact:
        assert guarded["losses"] == base["losses"]  # the guard changed nothing it computes
    else:
        assert guarded["losses"] == pytest.approx(base["losses"], rel=1e-4)
    assert guarded["step"] == STEPS
    # The bookkeeping ran at run time, each step: the model's loss picked up, one batch
    # and one training forward recorded, the phase set after the forward.
    assert [s[0] for s in guarded["seen"]] == pytest.approx(base["losses"])
    assert [s[1:] for s in guarded["seen"]] == [(1, 1, "optimizer")] * STEPS
    assert guarded["phases"] == ["backward"] * STEPS
    # A compiled model is not counted (an eager replay would count ops its compiled
    # kernels fuse; under a dispatch mode dynamo ran the step eagerly, with other
    # rounding: on inductor the guarded run's third loss was 1 ulp off the unguarded one's).
    # The guard's forward runs under the compiled wrapper, except given DDP over the
    # compiled module (DDP calls it): then the FLOP count learns it from the module.
    assert guarded["forward_compiled"] is (guarded["given"] != "ddp")
    assert guarded["flops_counted"] == [None]


SINGLE = [
    ("compile(model)", "raw"),  # opt_model = torch.compile(model); guard(model): nanochat's
    ("compile(model)", "compiled"),
    ("compile(model), compiled step", "raw"),
]


@pytest.mark.parametrize(
    "backend", ["eager", pytest.param("aot_eager", marks=pytest.mark.slow(reason="AOT autograd"))]
)
@pytest.mark.parametrize(("order", "given"), SINGLE, ids=[f"{o} guard({g})" for o, g in SINGLE])
def test_the_guard_compiles_nothing_of_its_own(order, given, backend):
    check(train(order, backend, None), train(order, backend, given))


DDP_CASES = [
    ("compile(DDP(model))", "raw"),
    ("compile(DDP(model))", "compiled"),
    ("DDP(compile(model))", "raw"),
    ("DDP(compile(model))", "ddp"),
]


def _ddp_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    try:
        for order, given in DDP_CASES:
            results[order, given] = (
                train(order, "aot_eager", None, rank),
                train(order, "aot_eager", given, rank),
            )
    finally:
        Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps(results))
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("compile_ddp")
    spawn(_ddp_worker, (2, free_port(), str(out)), deadline_s=240)
    return [pickle.loads((out / f"rank{r}.pkl").read_bytes()) for r in range(2)]


@pytest.mark.slow(reason="two gloo ranks compile 8 times each (~15 s on 2 cores)")
@pytest.mark.parametrize(
    ("order", "given"), DDP_CASES, ids=[f"{o} guard({g})" for o, g in DDP_CASES]
)
def test_the_guard_compiles_nothing_of_its_own_under_ddp(ddp_runs, order, given):
    # "aot_eager": AOT autograd's graphs too, as inductor gets them ("eager" checked by
    # hand: the same counts with and without the guard in every case).
    for rank in ddp_runs:
        check(*rank[order, given])


# On a GPU: inductor itself, with CUDA graphs ("reduce-overhead", and "max-autotune",
# which captures them too), and FSDP2 + compile on two GPUs over NCCL. CI has no GPU.
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="inductor's CUDA modes need a CUDA GPU (CI has none); run on an H100/H200",
)
CUDA_CASES = [
    (order, given, mode) for mode in ("default", "reduce-overhead") for order, given in SINGLE
] + [("compile(model)", "raw", "max-autotune")]


@needs_cuda
@pytest.mark.parametrize(
    ("order", "given", "mode"), CUDA_CASES, ids=[f"{o} guard({g}) {m}" for o, g, m in CUDA_CASES]
)
def test_the_guard_compiles_nothing_of_its_own_under_inductor_on_cuda(order, given, mode):
    mode_ = None if mode == "default" else mode
    base = train(order, "inductor", None, device="cuda", mode=mode_)
    guarded = train(order, "inductor", given, device="cuda", mode=mode_)
    # Bitwise where two unguarded runs agree bitwise; on a GPU they may not (cuBLAS
    # picks its kernels per call; max-autotune times its choices), and then within rounding.
    again = train(order, "inductor", None, device="cuda", mode=mode_)
    assert again["losses"] == pytest.approx(base["losses"], rel=1e-4)
    check(base, guarded, exact=base["losses"] == again["losses"])


FSDP_CASES = [("compile(fully_shard(model))", "raw"), ("compile(fully_shard(model))", "compiled")]


def _fsdp_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank)
    )
    results = {}
    try:
        for order, given in FSDP_CASES:
            results[order, given] = (
                train(order, "inductor", None, rank, device="cuda"),
                train(order, "inductor", given, rank, device="cuda"),
                train(order, "inductor", None, rank, device="cuda"),
            )
    finally:
        Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps(results))
        dist.destroy_process_group()


@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="FSDP2 over NCCL needs 2 CUDA GPUs (CI has none)"
)
@pytest.mark.slow(reason="two NCCL ranks compile with inductor 4 times each")
def test_the_guard_compiles_nothing_of_its_own_under_fsdp2(tmp_path):
    spawn(_fsdp_worker, (2, free_port(), str(tmp_path)), deadline_s=600)
    for r in range(2):
        runs = pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes())
        for case in FSDP_CASES:
            base, guarded, again = runs[case]
            assert again["losses"] == pytest.approx(base["losses"], rel=1e-4)
            check(base, guarded, exact=base["losses"] == again["losses"])


def test_an_uncompiled_model_is_known_as_such_and_its_flops_are_counted(tmp_path):
    torch.manual_seed(0)
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with guardrails.guard(model, opt, batches(3), run_dir=tmp_path, progress=False) as g:
        train_loop(g, model, opt)
    assert g.forward_compiled is False
    flops = [e for e in read_events(tmp_path) if e["kind"] == "flops"]
    assert [e["flops_per_step"] > 0 for e in flops] == [True]
