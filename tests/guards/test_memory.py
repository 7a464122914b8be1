"""MemoryGuard against real loops: planted leaks named with their cause, cyclic garbage
kept bounded by the GCScheduler, real out-of-memory errors explained, a slow loader
reported (and a fast one not), and nothing left behind."""

from __future__ import annotations

import gc
import json
import pickle
import sys
import time
import weakref
from pathlib import Path

import pytest
import torch
from conftest import Regressor, batches, read_events, spawn, train_loop

import guardrails
from guardrails import GCScheduler, Guard, MemoryGuard
from guardrails.guards.memory import starvation
from guardrails.util.probes import usable_cpus

FAKE_CUDA_OOM = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
    "79.10 GiB of which 1.25 GiB is free."
)


def make(**kw):
    torch.manual_seed(0)
    model = Regressor(**kw)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def leak_guard(**kw):
    kw.setdefault("leak_check_every_n_steps", 5)
    kw.setdefault("leak_window_checks", 3)
    kw.setdefault("data_starvation_window_steps", None)
    return MemoryGuard(**kw)


def events(run_dir, kind):
    return [e for e in read_events(run_dir) if e["kind"] == kind]


# ---------------------------------------------------------------------- leaks


@pytest.mark.parametrize("scheduler", [True, False], ids=["gc-scheduler", "python-gc"])
def test_planted_leak_of_losses_with_graphs_is_named(tmp_path, scheduler):
    model, opt = make()
    memory = leak_guard()
    components = [GCScheduler(every_n_steps=5), memory] if scheduler else [memory]
    losses = []
    with Guard(model, opt, batches(40), run_dir=tmp_path, components=components) as g:
        for x, y in g:
            loss = model(x, y)
            loss.backward()
            losses.append(loss)  # the bug: keeps every step's graph
            opt.step()
            opt.zero_grad()
    [leak] = events(tmp_path, "leak")
    assert leak["level"] == "warning"
    assert leak["cause"] == "tensors_holding_graphs"
    assert leak["graph_tensors_per_step"] == pytest.approx(1.0)
    assert "grad_fn=MseLossBackward0" in leak["tensor"]
    assert leak["held_by"].startswith("`losses` (a list of")
    assert "test_planted_leak_of_losses_with_graphs_is_named" in leak["held_by"]
    assert "losses.append(loss)" in leak["message"]
    assert "loss.detach()" in leak["fix"] and "loss.item()" in leak["fix"]
    # How a run whose growth is meant tells it apart, and the knob that turns it off.
    assert "mem_peak_bytes in metrics.parquet level off" in leak["message"]
    assert "memory={'leak_check_every_n_steps': None}" in leak["message"]
    # Checks at 5, 10, 15, 20 (growing at each), a census at 20 and one at 25: reported
    # once, at 25, and never again.
    assert leak["step"] == 25 and leak["window_steps"] == [5, 25]
    assert [s for s, _ in memory.censuses] == [20, 25]
    assert memory.leak is not None and memory.leak["cause"] == leak["cause"]


def test_a_leak_of_plain_tensors_names_the_attribute_that_holds_them(tmp_path):
    class Trainer:
        def __init__(self):
            self.kept = []

    trainer = Trainer()
    model, opt = make()
    with Guard(model, opt, batches(30), run_dir=tmp_path, components=[leak_guard()]) as g:
        for x, y in g:
            model(x, y).backward()
            # 256 KiB a step, no graph: e.g. activations kept "for later".
            trainer.kept.append(torch.randn(64, 1024))
            opt.step()
            opt.zero_grad()
    [leak] = events(tmp_path, "leak")
    assert leak["cause"] == "tensors"
    # The census counts the kept tensors exactly; RSS (what "memory" is on CPU) grows by
    # less when the allocator reuses pages an earlier test freed, so it is only bounded.
    assert leak["tensor_bytes_per_step"] == pytest.approx(256 * 1024, rel=0.05)
    # (0 seen in a fresh-clone CI run: every page came back from earlier tests' frees.)
    assert 0 <= leak["memory_bytes_per_step"] < 8 * 256 * 1024
    assert leak["held_by"].startswith("`trainer.kept` (a list of")
    assert "64x1024 float32 cpu tensor" in leak["tensor"]
    assert "grad_fn" not in leak["tensor"]


def _healthy_child(rank: int, keep: str, run_dir: str, out: str) -> None:
    model, opt = make()
    memory = leak_guard()
    history = []
    with Guard(model, opt, batches(60), run_dir=run_dir, components=[memory]) as g:
        for x, y in g:
            loss = model(x, y)
            loss.backward()
            if keep == "detach":
                history.append(loss.detach())
            elif keep == "item":
                history.append(loss.item())
            opt.step()
            opt.zero_grad()
    result = {"leak": memory.leak is not None, "censuses": len(memory.censuses)}
    Path(out).write_text(json.dumps(result))


@pytest.mark.parametrize("keep", ["detach", "item", "nothing"])
def test_healthy_loops_report_no_leak(tmp_path, keep):
    """Keeping detached losses or floats is history, not a leak worth a warning; a
    census that finds nothing doubles the window so censuses stay rare. In a process of
    its own: after some orders of earlier guards in one process (one that raised out of
    optimizer.step(), then a planted leak) the census sees new storage wrappers each
    step of the data list's tensors, a false leak still open (docs/failures.md, leaks)."""
    out = tmp_path / "result.json"
    spawn(_healthy_child, (keep, str(tmp_path / "run"), str(out)), nprocs=1)
    assert events(tmp_path / "run", "leak") == []
    result = json.loads(out.read_text())
    assert result["leak"] is False
    assert result["censuses"] <= 4


class Node:
    """Cyclic garbage with a payload: only the cyclic GC frees it."""

    live = 0

    def __init__(self):
        self.me = self
        self.payload = bytearray(1024)
        Node.live += 1

    def __del__(self):
        Node.live -= 1


def garbage_loop(tmp_path, n_steps, per_step, components):
    model, opt = make()
    live = []
    with Guard(model, opt, batches(n_steps), run_dir=tmp_path, components=components) as g:
        # Not train_loop: objects made every step, the live count read after each.
        for x, y in g:
            for _ in range(per_step):
                Node()
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
            live.append(Node.live)
    return live


def test_cyclic_garbage_stays_bounded_under_the_scheduler(tmp_path):
    Node.live = 0
    live = garbage_loop(
        tmp_path, 120, 200, [GCScheduler(every_n_steps=10), leak_guard(leak_check_every_n_steps=10)]
    )
    # At most one interval's garbage is alive: 10 steps x 200 nodes, then it is freed.
    assert max(live) <= 10 * 200
    assert live[9] == 0 and live[-1] == 0  # collected at steps 10 and 120
    assert events(tmp_path, "leak") == []

    # The same loop without any collection grows without bound: the check above can fail.
    gc.collect()
    Node.live = 0
    enabled = gc.isenabled()
    gc.disable()
    try:
        unbounded = garbage_loop(tmp_path / "off", 30, 200, [leak_guard()])
    finally:
        if enabled:
            gc.enable()
        gc.collect()
    assert unbounded[-1] == 30 * 200
    [leak] = events(tmp_path / "off", "leak")
    assert leak["cause"] == "python_objects"
    assert ["test_memory.Node", 5 * 200] in leak["growing_types"]


# ---------------------------------------------------------------------- out of memory


class Exploding(Regressor):
    """Raises ``error`` (a real exception object) from inside its forward at a step."""

    def __init__(self, error, at_call):
        super().__init__()
        self.error, self.at_call, self.calls = error, at_call, 0
        # A parameter as large as the activation below: it outranks whatever small
        # tensors earlier tests left alive in this process (a list of the 10 largest).
        self.wide = torch.nn.Parameter(torch.zeros(512, 512))

    def forward(self, x, y=None):
        self.calls += 1
        if self.calls == self.at_call:
            big = torch.ones(256, 1024)  # a live activation in the failing frame
            assert big.sum() > 0
            raise self.error() if callable(self.error) else self.error
        return super().forward(x, y)


def run_until(tmp_path, model, n=6, components=None, loader=None, opt=None):
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.01)
    components = components if components is not None else [MemoryGuard()]
    with Guard(model, opt, loader or batches(n), run_dir=tmp_path, components=components) as g:
        train_loop(g, model, opt)
    return g


def test_oom_in_forward_is_explained(tmp_path):
    torch.manual_seed(0)
    original = torch.OutOfMemoryError(FAKE_CUDA_OOM)
    model = Exploding(original, at_call=3)
    with pytest.raises(guardrails.OutOfMemoryError) as info:
        run_until(tmp_path, model)
    err = info.value
    assert isinstance(err, torch.OutOfMemoryError) and isinstance(err, guardrails.GuardrailsError)
    assert err.__cause__ is original
    assert (err.phase, err.step, err.rank) == ("forward", 3, 0)
    text = str(err)
    assert "out of memory" in text and "in the model's forward" in text
    assert "during step 3 (2 completed)" in text and "tried to allocate 2.00 GiB" in text
    assert err.memory["requested"] == 2 * 2**30 and err.memory["rss"] > 0
    # The parameters are named (frozen or not, they are found through the model), and
    # the failing frame's activation is among the largest live tensors. (Which small
    # parameters make the short list depends on what else is alive in this process:
    # under xdist, earlier tests' leftovers outrank net.0.weight's 128 bytes; the 1 MB
    # one is always there, by name.)
    names = {t["name"] for t in err.largest_tensors}
    assert "wide" in names, names
    assert {"shape": [256, 1024], "bytes": 2**20} in [
        {"shape": t["shape"], "bytes": t["bytes"]} for t in err.largest_tensors
    ]
    assert err.remedies[0] == "smaller_micro_batch"
    assert {"activation_checkpointing", "bf16"} <= set(err.remedies)
    assert "gradient" in text and "fix: remedies, most likely first" in text
    assert "accumulate gradients" in err.hint
    [oom] = events(tmp_path, "oom")
    assert oom["level"] == "error" and oom["phase"] == "forward" and oom["in_step"] == 3
    assert oom["remedies"] == err.remedies
    end = read_events(tmp_path)[-1]
    # The run ends with the error the user sees: the explained one, not torch's.
    assert end["kind"] == "end" and end["error"].startswith("OutOfMemoryError: [rank 0, step 3]")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is guardrails.OutOfMemoryError
    assert (back.phase, back.step, back.remedies, str(back)) == (
        "forward",
        3,
        err.remedies,
        str(err),
    )


def test_a_real_cpu_allocator_failure_is_explained_and_still_a_runtime_error(tmp_path):
    def allocate():
        return torch.empty(2**60, dtype=torch.uint8)  # the CPU allocator refuses it

    class Greedy(Regressor):
        def forward(self, x, y=None):
            allocate()

    with pytest.raises(RuntimeError) as info:
        run_until(tmp_path, Greedy())
    err = info.value
    assert isinstance(err, guardrails.OutOfMemoryError)
    assert "DefaultCPUAllocator" in str(err.__cause__)
    assert err.memory["device"] == "cpu" and err.memory["requested"] == 2**60
    assert err.phase == "forward" and err.step == 1


def test_oom_in_eval_forward_ranks_no_grad_first(tmp_path):
    # Calls: training forward 1, eval forward 2, training forward 3, eval forward 4.
    model = Exploding(torch.OutOfMemoryError(FAKE_CUDA_OOM), at_call=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(guardrails.OutOfMemoryError) as info:
        with Guard(model, opt, batches(4), run_dir=tmp_path, components=[MemoryGuard()]) as g:
            # Not train_loop: an eval forward without no_grad after each step.
            for x, y in g:
                model(x, y).backward()
                opt.step()
                opt.zero_grad()
                model.eval()  # the eval forward, without torch.no_grad()
                model(x, y)
                model.train()
    err = info.value
    assert err.phase == "forward" and err.remedies[0] == "no_grad_eval"
    assert "eval() mode" in str(err) and "torch.no_grad()" in err.hint


class FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise torch.OutOfMemoryError(FAKE_CUDA_OOM)


class OOMInBackward(Regressor):
    def forward(self, x, y=None):
        return FailingBackward.apply(super().forward(x, y))


class OOMOptimizer(torch.optim.SGD):
    def step(self, closure=None):
        raise torch.OutOfMemoryError(FAKE_CUDA_OOM)


def oom_loader():
    yield from batches(2)
    raise torch.OutOfMemoryError(FAKE_CUDA_OOM)


@pytest.mark.parametrize("phase", ["backward", "optimizer", "data"])
def test_oom_says_where(tmp_path, phase):
    torch.manual_seed(0)
    model = OOMInBackward() if phase == "backward" else Regressor()
    opt = (OOMOptimizer if phase == "optimizer" else torch.optim.SGD)(model.parameters(), lr=0.1)
    loader = oom_loader() if phase == "data" else None
    with pytest.raises(guardrails.OutOfMemoryError) as info:
        run_until(tmp_path, model, opt=opt, loader=loader)
    err = info.value
    assert err.phase == phase
    assert err.step == (3 if phase == "data" else 1)
    first = {
        "backward": "smaller_micro_batch",
        "optimizer": "shard_optimizer_state",  # the first step allocates the state
        "data": "smaller_batch_in_loader",
    }[phase]
    assert err.remedies[0] == first


def test_other_errors_and_explain_oom_false_pass_through_unchanged(tmp_path):
    boom = RuntimeError("not memory")
    with pytest.raises(RuntimeError) as info:
        run_until(tmp_path / "a", Exploding(boom, at_call=2))
    assert info.value is boom

    original = torch.OutOfMemoryError(FAKE_CUDA_OOM)
    with pytest.raises(torch.OutOfMemoryError) as info:
        run_until(
            tmp_path / "b",
            Exploding(original, at_call=2),
            components=[MemoryGuard(explain_oom=False)],
        )
    assert info.value is original
    assert events(tmp_path / "b", "oom") == []


def test_other_ranks_memory_is_read_from_run_dir_without_a_collective(tmp_path, monkeypatch):
    """Two ranks of one run, played one after the other in this process (rank and world
    size from the environment, as under torchrun without a process group)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    model, _opt = make()
    run_until(tmp_path, model, n=6, components=[leak_guard(leak_check_every_n_steps=2)])
    rank1 = json.loads((tmp_path / "memory" / "rank-00001.json").read_text())
    assert rank1["rank"] == 1 and rank1["step"] == 6 and rank1["peak"] > 0

    monkeypatch.setenv("RANK", "0")
    with pytest.raises(guardrails.OutOfMemoryError) as info:
        run_until(tmp_path, Exploding(torch.OutOfMemoryError(FAKE_CUDA_OOM), at_call=4))
    err = info.value
    assert err.rank == 0 and sorted(err.per_rank) == [0, 1]
    assert err.per_rank[1]["step"] == 6 and err.per_rank[0]["step"] == 3
    assert "rank 1: peak" in str(err) and "(step 6)" in str(err)
    # Same process, same peak RSS: no imbalance to report.
    assert "rank_imbalance" not in err.remedies

    # Rank 1 as a rank that used a third of this one's memory would have written it.
    rank1["peak"] = err.per_rank[0]["peak"] // 3
    (tmp_path / "memory" / "rank-00001.json").write_text(json.dumps(rank1))
    with pytest.raises(guardrails.OutOfMemoryError) as info:
        run_until(tmp_path, Exploding(torch.OutOfMemoryError(FAKE_CUDA_OOM), at_call=2))
    assert info.value.remedies[0] == "rank_imbalance"
    assert "DistributedSampler" in info.value.hint


# ---------------------------------------------------------------------- data starvation


def slow(items, wait_s):
    for item in items:
        time.sleep(wait_s)
        yield item


class SlowDataset(torch.utils.data.Dataset):
    def __init__(self, n):
        self.items = batches(n)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        time.sleep(0.004)
        return self.items[i]


def starvation_run(tmp_path, loader, n_steps=23, **knobs):
    model, opt = make()
    memory = MemoryGuard(leak_check_every_n_steps=None, data_starvation_window_steps=10, **knobs)
    with Guard(model, opt, loader, run_dir=tmp_path, components=[memory]) as g:
        # Not train_loop: a DataLoader's extra batch dimension dropped first.
        for x, y in g:
            if x.ndim == 3:  # a DataLoader with batch_size=None keeps our batches as is
                x, y = x[0], y[0]
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
    return memory


def test_a_slow_loader_is_reported_once_with_numbers_and_remedies(tmp_path):
    memory = starvation_run(tmp_path, slow(batches(23), 0.004))
    [e] = events(tmp_path, "data_starvation")
    assert e["level"] == "warning" and e["step"] == 11 and e["window_steps"] == [2, 11]
    assert e["share"] > 0.5 and e["mean_wait_s"] >= 0.004
    assert e["mean_step_s"] >= e["mean_wait_s"]
    assert "num_workers" in e["message"] and "training waits" in e["message"]
    assert "the bar is guard(..., memory={'data_starvation_fraction': 0.3})" in e["message"]
    # On a CPU: no accelerator to idle, no copy to one that pinned memory would speed up.
    assert "pin_memory" not in e["message"]
    assert memory.starvation is not None and memory.starvation["share"] == e["share"]


def test_a_tiny_cpu_steps_own_next_is_not_starvation(tmp_path):
    """0.2 ms in next() of a sub-millisecond CPU step is a large share of the step and
    nothing to act on: silent under a floor, reported without it (the same loop, so the
    floor is what keeps it quiet). The quiet arm's floor is 50 ms, not the default 1 ms:
    a loaded 2-core machine stretched the 0.2 ms sleep to 1.1 ms (host-independent)."""
    assert MemoryGuard().data_starvation_min_wait_s == 0.001  # the default floor: 1 ms
    quiet = starvation_run(
        tmp_path / "floor",
        slow(batches(23), 0.0002),
        data_starvation_fraction=0.1,
        data_starvation_min_wait_s=0.05,
    )
    assert events(tmp_path / "floor", "data_starvation") == [] and quiet.starvation is None
    loud = starvation_run(
        tmp_path / "no_floor",
        slow(batches(23), 0.0002),
        data_starvation_fraction=0.1,
        data_starvation_min_wait_s=0.0,
    )
    [e] = events(tmp_path / "no_floor", "data_starvation")
    assert loud.starvation is not None and e["share"] >= 0.1


def test_a_dataloader_without_workers_is_told_so(tmp_path):
    loader = torch.utils.data.DataLoader(SlowDataset(23), batch_size=None)
    starvation_run(tmp_path, loader)
    [e] = events(tmp_path, "data_starvation")
    assert e["loader"]["num_workers"] == 0
    assert e["remedies"][0].startswith("num_workers=0 loads every batch in the training process")


def test_workers_sharing_every_core_with_a_cpu_step_are_advice_not_a_warning(tmp_path):
    """A CPU run whose loader workers and compute threads take every core: more workers
    cannot help (they take the training's own CPU), so the wait is a
    ``loader_shared_cores`` info event naming the cores, with the advice that fits
    (num_workers=0), not a data_starvation warning."""
    threads = torch.get_num_threads()
    torch.set_num_threads(usable_cpus())  # every core computing: any host
    try:
        loader = torch.utils.data.DataLoader(SlowDataset(23), batch_size=None, num_workers=1)
        memory = starvation_run(tmp_path, loader)
    finally:
        torch.set_num_threads(threads)
    assert events(tmp_path, "data_starvation") == [] and memory.starvation is None
    [e] = events(tmp_path, "loader_shared_cores")
    assert e["level"] == "info" and e["share"] > 0.3 and e["cores"] == usable_cpus()
    assert f"share this machine's {usable_cpus()} cores" in e["message"]
    assert e["remedies"][0].startswith("num_workers=0 when the per-sample work is light")
    assert not any("more workers" in r or "pin_memory" in r for r in e["remedies"])


def test_starvation_remedies_fit_the_device_and_the_cores():
    two = {"num_workers": 2, "prefetch_factor": 2, "pin_memory": False, "persistent_workers": True}
    # Spare cores: a starved loader's fault, with the loader's fixes (pinning on a GPU).
    assert not starvation.shares_cores(two, "cpu", cores=16, threads=4)
    gpu = starvation.starvation_remedies(two, "cuda", cores=16, threads=4)
    assert gpu[0].startswith("more workers than num_workers=2 (this machine has 16 cores)")
    assert any(r.startswith("pin_memory=True") for r in gpu)
    cpu = starvation.starvation_remedies(two, "cpu", cores=16, threads=4)
    assert cpu[0].startswith("more workers") and not any("pin_memory" in r for r in cpu)
    # Every core taken by the workers and the step's threads: on a CPU, not on a GPU.
    assert starvation.shares_cores(two, "cpu", cores=2, threads=1)
    assert not starvation.shares_cores(two, "cuda", cores=2, threads=1)
    assert not starvation.shares_cores({**two, "num_workers": 0}, "cpu", cores=2, threads=1)
    assert not starvation.shares_cores(None, "cpu", cores=1, threads=1)


def test_a_fast_loader_is_not_reported(tmp_path):
    memory = starvation_run(tmp_path, batches(23))
    assert events(tmp_path, "data_starvation") == [] and memory.starvation is None


# ---------------------------------------------------------------------- wiring, no trace


def test_guard_adds_it_after_the_gc_scheduler_and_not_when_all_off(tmp_path):
    model, opt = make()
    g = guardrails.guard(model, opt, run_dir=tmp_path)
    kinds = [type(c) for c in g.components]
    assert kinds.index(MemoryGuard) == kinds.index(GCScheduler) + 1
    g = guardrails.guard(
        model,
        opt,
        run_dir=tmp_path,
        memory={
            "leak_check_every_n_steps": None,
            "data_starvation_window_steps": None,
            "explain_oom": False,
        },
    )
    assert MemoryGuard not in [type(c) for c in g.components]


def test_knobs_pass_through_guard(tmp_path):
    model, opt = make()
    g = guardrails.guard(
        model,
        opt,
        run_dir=tmp_path,
        memory={"leak_check_every_n_steps": 7, "data_starvation_fraction": 0.5},
    )
    [memory] = [c for c in g.components if isinstance(c, MemoryGuard)]
    assert memory.leak_check_every_n_steps == 7 and memory.data_starvation_fraction == 0.5


def test_it_leaves_no_trace(tmp_path):
    gc_state = (gc.isenabled(), gc.get_threshold(), gc.get_freeze_count(), list(gc.callbacks))
    tracing = (sys.gettrace(), sys.getprofile())
    model, opt = make()
    forward_before = dict(model.__dict__).get("forward")
    memory = leak_guard(leak_check_every_n_steps=2, leak_window_checks=1)
    losses = []
    with Guard(model, opt, batches(12), run_dir=tmp_path, components=[memory]) as g:
        for x, y in g:
            loss = model(x, y)
            loss.backward()
            losses.append(loss)
            opt.step()
            opt.zero_grad()
    assert memory.censuses  # the costly path ran
    assert (gc.isenabled(), gc.get_threshold(), gc.get_freeze_count(), list(gc.callbacks)) == (
        gc_state
    )
    assert (sys.gettrace(), sys.getprofile()) == tracing
    assert dict(model.__dict__).get("forward") is forward_before
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    assert not (tmp_path / "memory").exists()  # single process: no rank files


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"leak_check_every_n_steps": 0}, "leak_check_every_n_steps"),
        ({"leak_window_checks": 0}, "leak_window_checks"),
        ({"data_starvation_window_steps": -1}, "data_starvation_window_steps"),
        ({"data_starvation_fraction": 0}, "data_starvation_fraction"),
        ({"data_starvation_fraction": 1.5}, "data_starvation_fraction"),
    ],
)
def test_bad_knobs(kw, match):
    with pytest.raises(ValueError, match=match):
        MemoryGuard(**kw)
    model, opt = make()
    with pytest.raises(ValueError, match=match):  # the same check through guard()
        guardrails.guard(model, opt, memory=kw)


def _deleting_loop(run_dir, *, keep_locals: bool) -> tuple[bool, dict | None]:
    """A loop that drops a big tensor once training started: whether the tensor is
    freed while the loop's frame still runs, and ``locals()`` when the loop keeps it."""
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    big = torch.zeros(1 << 20)
    ref = weakref.ref(big)
    scope = locals() if keep_locals else None  # a loop that keeps its own locals()
    with guardrails.guard(model, opt, batches(3), run_dir=run_dir, progress=False) as g:
        for x, y in g:  # iter(g) reads this frame's variables (the epoch counter)
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
            big = None
    gc.collect()
    return ref() is None, scope


def test_a_tensor_the_loop_drops_is_freed_though_the_guard_read_the_loops_variables(tmp_path):
    """On CPython 3.11/3.12 reading a frame's variables leaves a snapshot on the frame
    that holds them until its next read: a tensor the loop dropped stayed allocated (an
    OOM's activations, 71 GB on an H200, through a caught error the snapshot held)."""
    freed, _ = _deleting_loop(tmp_path, keep_locals=False)
    assert freed


def test_a_loop_that_keeps_its_locals_dict_keeps_it_whole(tmp_path):
    # There the snapshot is the loop's own dict (``locals()``): left as it is.
    _, scope = _deleting_loop(tmp_path, keep_locals=True)
    assert {"model", "opt", "ref"} <= set(scope)
