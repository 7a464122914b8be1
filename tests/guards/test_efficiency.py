"""Efficiency: FLOPs per step against a hand count, MFU in the report, a counted step
that changes nothing, the fast-path advisor's rules and its silence, host syncs caught
and traced to the user's line (the warnings plumbing on CPU; the sync mode on a GPU)."""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import json
import shutil
import sys
import warnings
from pathlib import Path

import pytest
import torch
from conftest import assert_state_equal, events_path, read_events, train_loop
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import guardrails
from guardrails.guards.efficiency import advisor, flops
from guardrails.guards.efficiency.efficiency import Efficiency
from guardrails.guards.efficiency.syncs import SYNC_MESSAGE, SyncSampler

IN, HIDDEN, OUT, BATCH, MICRO = 8, 16, 4, 4, 2
#: The MLP's FLOPs a micro-batch (a multiply-add is 2 FLOPs): forward, both layers;
#: backward, each weight's gradient, and the input gradient of the second layer only
#: (the first layer's input, the batch, takes no gradient). Biases and ReLU are not
#: matmul FLOPs.
L1, L2 = 2 * BATCH * IN * HIDDEN, 2 * BATCH * HIDDEN * OUT
HAND_COUNT = MICRO * (L1 + L2 + L1 + 2 * L2)


def mlp(dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Dropout(dropout), nn.Linear(HIDDEN, OUT)
    )


def data(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, OUT, generator=g))
        for _ in range(n)
    ]


def accumulating_loop(g, model, opt) -> None:
    """MICRO micro-batches a step, the loss computed outside the model."""
    for i, (x, y) in enumerate(g):
        loss = nn.functional.mse_loss(model(x), y) / MICRO
        loss.backward()
        if i % MICRO == MICRO - 1:
            opt.step()
            opt.zero_grad()


def train(run_dir: Path, steps: int, *, dropout: float = 0.0, **efficiency) -> tuple:
    model = mlp(dropout)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    section = efficiency.pop("section", efficiency or True)
    with guardrails.guard(
        model, opt, data(steps * MICRO), run_dir=run_dir, progress=False, efficiency=section
    ) as g:
        accumulating_loop(g, model, opt)
    return model, opt, g


@pytest.fixture(scope="module")
def counted(tmp_path_factory):
    """A CPU run of 6 steps whose step 2 is counted, against a given peak."""
    run_dir = tmp_path_factory.mktemp("counted")
    _, _, g = train(run_dir, 6, peak_flops=1e12)
    return run_dir, g, read_events(run_dir)


def test_flops_of_a_small_mlp_are_the_hand_count(counted):
    _, g, events = counted
    [e] = [e for e in events if e["kind"] == "flops"]
    assert e["flops_per_step"] == HAND_COUNT  # exact: every micro-batch of step 2
    assert e["source"] == "counted" and e["step"] == 2
    assert e["peak_flops"] == 1e12 and e["peak_source"] == "given"
    assert e["dtype"] == "fp32" and e["device_name"] == "cpu"
    assert "FLOP per optimizer step" in e["message"] and "1 TFLOP/s" in e["message"]
    assert g.component("efficiency").flops_per_step_found == HAND_COUNT
    assert torch._C._len_torch_dispatch_stack() == 0  # the counter was left


def test_report_shows_mfu_from_the_median_step_time_and_the_peak(counted, capsys):
    from guardrails.cli import report

    run_dir, _, _ = counted
    args = argparse.Namespace(run_dir=run_dir, png=None, no_png=True, all=False, json=True)
    assert report.main(args) == 0
    s = json.loads(capsys.readouterr().out)
    m = s["mfu"]
    assert m["flops_per_step"] == HAND_COUNT and m["peak_flops"] == 1e12
    assert m["mfu"] == pytest.approx(HAND_COUNT / (s["step_time_median_s"] * 1e12), rel=1e-12)
    args.json = False
    assert report.main(args) == 0
    out = capsys.readouterr().out
    assert "  MFU          " in out and "a step in a median step of" in out, out
    assert "1 TFLOP/s fp32 peak" in out and "fast path" not in out


def test_report_lists_the_advice_in_one_line(counted, tmp_path, capsys):
    from guardrails.cli import report

    run_dir = tmp_path / "advised"
    shutil.copytree(counted[0], run_dir)
    events = events_path(run_dir).read_text().splitlines()
    base = json.loads(events[1])
    for kind in ("tf32_off", "loader_no_workers"):
        events.insert(2, json.dumps({**base, "kind": kind, "level": "info", "message": "fix"}))
    events_path(run_dir).write_text("\n".join(events) + "\n")
    args = argparse.Namespace(run_dir=run_dir, png=None, no_png=True, all=False, json=False)
    assert report.main(args) == 0
    out = capsys.readouterr().out
    assert "  fast path    TF32 off; DataLoader without workers (each with its fix" in out, out
    assert "tf32_off" not in out  # told in its line, not counted under "other events"


def test_a_healthy_cpu_run_hears_no_advice_and_samples_no_syncs(counted):
    _, g, events = counted
    kinds = {e["kind"] for e in events}
    advice = {"tf32_off", "bf16_available", "optimizer_not_fused", "loader_no_workers"}
    assert not kinds & (advice | {"loader_not_pinned", "bf16_on_cpu", "host_syncs"}), kinds
    assert g.component("efficiency").syncs is None  # CPU: the sync mode is never touched
    assert not [e for e in events if e.get("level") == "warning"], events


@pytest.mark.slow(reason="two guarded runs of 5 steps: ~3 s on the 2-core VM")
def test_counting_a_step_changes_nothing_in_the_run(tmp_path):
    """Dropout (RNG draws), AdamW state, two micro-batches a step: with the counted step
    and without the component, the weights, the optimizer state and the RNG after 5
    steps are bitwise the same."""
    runs = {}
    for name, section in (("counted", {"flops_at_step": 3}), ("off", False)):
        model, opt, _ = train(tmp_path / name, 5, dropout=0.5, section=section)
        runs[name] = (model.state_dict(), opt.state_dict(), torch.get_rng_state())
    assert any(e["kind"] == "flops" for e in read_events(tmp_path / "counted"))
    (w1, o1, r1), (w2, o2, r2) = runs["counted"], runs["off"]
    for k in w1:
        assert torch.equal(w1[k], w2[k]), k
    for i, state in o1["state"].items():
        for k, v in state.items():
            assert torch.equal(v, o2["state"][i][k]), (i, k)
    assert torch.equal(r1, r2)


class Ops(TorchDispatchMode):
    """The loop's own dispatch mode (a profiler, a test's counter)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def test_the_count_survives_the_loops_own_dispatch_mode_around_its_step(tmp_path):
    """The counted step's optimizer.step() (where its replay runs) runs inside the
    loop's own mode: the count is still the step's, the replay's fake ops are not the
    loop's mode's to see, and no mode is left on the stack."""
    counts = []
    for section in ({"count_flops": False}, True):
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        ops = Ops()
        with guardrails.guard(
            model,
            opt,
            data(8),
            run_dir=tmp_path / str(section),
            progress=False,
            efficiency=section,
        ) as g:
            for x, y in g:
                nn.functional.mse_loss(model(x), y).backward()
                with ops:
                    opt.step()
                    assert torch._C._len_torch_dispatch_stack() == 1
                opt.zero_grad()
                assert torch._C._len_torch_dispatch_stack() == 0
        counts.append(ops.n)
    [e] = [e for e in read_events(tmp_path / "True") if e["kind"] == "flops"]
    assert e["flops_per_step"] == HAND_COUNT // MICRO and e["step"] == 2
    assert counts[0] == counts[1] > 0 and torch._C._len_torch_dispatch_stack() == 0


def test_a_counted_step_whose_hooks_benchmark_mode_bypassed_counts_the_next(tmp_path):
    """Benchmark mode bypasses every per-step hook of step 30 (its after_step among
    them): step 31, the next step whose after_step runs, is replayed instead, its own
    forward only."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with guardrails.guard(
        model,
        opt,
        data(34),
        run_dir=tmp_path,
        progress=False,
        benchmark=True,
        efficiency={"flops_at_step": 30},
    ) as g:
        for x, y in g:
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    [e] = [e for e in read_events(tmp_path) if e["kind"] == "flops"]
    assert e["flops_per_step"] == HAND_COUNT // MICRO and e["step"] == 31
    assert torch._C._len_torch_dispatch_stack() == 0


def test_attention_counts_on_a_cpu_as_torch_counts_it_on_a_gpu(tmp_path):
    """A small GPT (the example's): every matmul 6 x tokens x its weights (forward,
    input and weight gradients), and scaled_dot_product_attention as torch's formulas
    count its GPU kernels (4 x B x T^2 x d forward, 10 x backward with the scores
    recomputed; not halved for the causal mask), which torch leaves out on a CPU."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    from train_gpt import GPT

    b, t, layers, d, vocab = 2, 16, 2, 32, 65
    torch.manual_seed(0)
    model = GPT(vocab=vocab, block_size=t, n_layer=layers, n_head=4, n_embd=d)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g0 = torch.Generator().manual_seed(0)
    batches = [
        (
            torch.randint(0, vocab, (b, t), generator=g0),
            torch.randint(0, vocab, (b, t), generator=g0),
        )
        for _ in range(3)
    ]
    with guardrails.guard(model, opt, batches, run_dir=tmp_path, progress=False) as g:
        train_loop(g, model, opt)
    [e] = [e for e in read_events(tmp_path) if e["kind"] == "flops"]
    matmuls = 6 * b * t * (12 * layers * d * d + d * vocab)  # the head is tied to tok
    attention = 14 * layers * b * t * t * d
    assert e["flops_per_step"] == matmuls + attention


def test_a_given_figure_is_used_and_nothing_is_counted(tmp_path):
    train(tmp_path, 3, flops_per_step=1.5e9)
    [e] = [e for e in read_events(tmp_path) if e["kind"] == "flops"]
    assert e["flops_per_step"] == 1.5e9 and e["source"] == "given" and e["step"] == 1
    # No peak for a CPU: the report can show the FLOPs, and says what to pass for MFU.
    assert e["peak_flops"] is None and "peak_flops" in e["message"]


@pytest.mark.slow(reason="imports torch._dynamo: ~2 s on the 2-core VM")
def test_a_compiled_model_is_recognised_without_compiling_it():
    m = nn.Linear(2, 2)
    assert not flops.compiled([m])
    assert flops.compiled([torch.compile(m)])  # compiles lazily: nothing runs here
    other = nn.Linear(2, 2)
    other.compile()  # in place
    assert flops.compiled([other])


def test_the_peak_table_matches_the_names_torch_reports():
    cases = {
        ("NVIDIA H100 80GB HBM3", "bf16"): (989e12, "H100 SXM"),
        ("NVIDIA H100 PCIe", "bf16"): (756e12, "H100 PCIe"),
        ("NVIDIA H200", "tf32"): (495e12, "H200 SXM"),
        ("NVIDIA A100-SXM4-80GB", "fp32"): (19.5e12, "A100"),
        ("NVIDIA L40S", "fp16"): (362e12, "L40S"),
        ("NVIDIA L4", "bf16"): (121e12, "L4"),
        ("NVIDIA A10G", "bf16"): (70e12, "A10G"),
        ("Tesla V100-SXM2-16GB", "bf16"): (None, "V100 SXM2"),
        ("NVIDIA GeForce RTX 4090", "bf16"): (165e12, "RTX 4090"),
        ("NVIDIA GeForce RTX 3090", "tf32"): (35.6e12, "RTX 3090"),
        ("cpu", "fp32"): (None, None),
    }
    for (name, dtype), (peak, known) in cases.items():
        got = flops.peak_flops(name, dtype)
        assert got[1] == known and (got[0] == pytest.approx(peak) if peak else got[0] is None), (
            name,
            got,
        )


@pytest.mark.parametrize(
    "knob, value, error, words",
    [
        ("flops_at_step", 1, ValueError, ">= 2"),
        ("host_syncs_at_step", 0, ValueError, "positive int"),
        ("peak_flops", -1.0, ValueError, "> 0"),
        ("flops_per_step", 0, ValueError, "> 0"),
        ("count_flops", "yes", TypeError, "True or False"),
    ],
)
def test_bad_knobs_are_refused_naming_the_knob(knob, value, error, words):
    with pytest.raises(error, match=knob) as info:
        Efficiency(**{knob: value})
    assert words in str(info.value) and repr(value) in str(info.value)


def test_with_every_feature_off_guard_leaves_it_out(tmp_path):
    off = {"advise": False, "count_flops": False, "host_syncs": False}
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert guardrails.guard(model, opt, efficiency=off).component("efficiency") is None
    on = guardrails.guard(model, opt, efficiency={**off, "advise": True})
    assert on.component("efficiency") is not None


# ---------------------------------------------------------------------- the advisor

GPU = dict(device_type="cuda", device_name="NVIDIA H100 80GB HBM3", capability=(9, 0))


def kinds(**facts) -> list[str]:
    return [a.kind for a in advisor.advice(advisor.Facts(**facts))]


def test_advisor_rules_each_fire_on_their_setup_and_a_fast_one_is_silent():
    fast = dict(
        GPU,
        bf16_native=True,
        compute="bf16",
        optimizers=[("0", "AdamW", None, None)],
        loader_workers=4,
        loader_pinned=True,
    )
    assert kinds(**fast) == []
    assert kinds(**{**fast, "compute": "fp32"}) == ["tf32_off", "bf16_available"]
    assert kinds(**{**fast, "compute": "tf32"}) == ["bf16_available"]
    assert kinds(**{**fast, "optimizers": [("0", "AdamW", False, None)]}) == ["optimizer_not_fused"]
    assert kinds(**{**fast, "optimizers": [("0", "AdamW", False, True)]}) == []
    assert kinds(**{**fast, "optimizers": [("0", "LBFGS", "n/a", "n/a")]}) == []
    assert kinds(**{**fast, "loader_workers": 0, "loader_pinned": False}) == [
        "loader_no_workers",
        "loader_not_pinned",
    ]
    # Batches made on the GPU need neither workers nor pinning.
    on_gpu = {**fast, "loader_workers": 0, "loader_pinned": False, "batches_on_device": True}
    assert kinds(**on_gpu) == []
    # Before Ampere: no TF32, no bf16 (a V100): nothing to switch on.
    v100 = {**fast, "capability": (7, 0), "bf16_native": False, "compute": "fp32"}
    assert kinds(**v100) == []
    # On a CPU, only bf16 emulated matters (once: the preflight tells it at start).
    cpu = dict(device_type="cpu", compute="bf16", bf16_native=False)
    assert kinds(**cpu) == ["bf16_on_cpu"]
    assert kinds(**{**cpu, "bf16_told_at_start": True}) == []
    assert kinds(**{**cpu, "bf16_native": True}) == []
    assert kinds(device_type="cpu", compute="fp32", bf16_native=False, loader_workers=0) == []
    [a] = advisor.advice(advisor.Facts(**{**fast, "compute": "fp32"}))[:1]
    assert a.level == "info" and "set_float32_matmul_precision('high')" in a.message
    assert "H100" in a.message


def test_bf16_autocast_in_the_forward_on_a_cpu_without_it_is_a_warning(tmp_path):
    """Autocast entered inside the loop: the preflight's start check cannot see it,
    the advisor does after the first step."""
    from guardrails.util.probes import cpu_info

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guardrails.guard(model, opt, data(2), run_dir=tmp_path, progress=False) as g:
        for x, y in g:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.mse_loss(model(x).float(), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
    assert g.bf16_autocast and not g.fp16_autocast
    warned = [e for e in read_events(tmp_path) if e["kind"] == "bf16_on_cpu"]
    # This machine's own CPU decides (read from /proc/cpuinfo, as doctor does).
    assert len(warned) == (cpu_info()["bf16_native"] is False)
    if warned:
        assert warned[0]["level"] == "warning" and warned[0]["step"] == 1
        assert "float32" in warned[0]["message"]
    flops_event = next(e for e in read_events(tmp_path) if e["kind"] == "flops")
    assert flops_event["dtype"] == "bf16"


# ---------------------------------------------------------------------- host syncs


def _sync_here() -> int:
    line = sys._getframe().f_lineno + 1
    warnings.warn(SYNC_MESSAGE, UserWarning, stacklevel=1)
    return line


def test_sync_warnings_are_caught_by_line_and_the_warnings_state_comes_back():
    """The plumbing of the sampled steps, on any machine: torch's sync warnings are
    caught (not shown) and counted by the user's line and step; every other warning
    goes on as before; afterwards showwarning and the filters are exactly as they were
    (a filter added meanwhile stays)."""
    shown = []
    before_show = warnings.showwarning
    before_filters = list(warnings.filters)

    def show(message, category, filename, lineno, file=None, line=None):
        shown.append(str(message))

    warnings.showwarning = show
    try:
        s = SyncSampler()
        s.catch_warnings()
        line = _sync_here()
        _sync_here()
        warnings.warn("something else", RuntimeWarning, stacklevel=1)
        s.next_step()
        _sync_here()
        warnings.filterwarnings("ignore", message="the loop's own")
        s.release_warnings()
        assert warnings.showwarning is show
        _sync_here()  # after the sample: not caught any more
    finally:
        warnings.showwarning = before_show
        added = warnings.filters[0]
        warnings.filters.remove(added)
        warnings._filters_mutated()
    assert added[1].pattern == "the loop's own"
    assert warnings.filters == before_filters
    site = f"test_efficiency.py:{line} (_sync_here)"
    assert s.sites == {site: [2, 1]} and s.steps == 2 and s.own == {}
    assert "warnings.warn(SYNC_MESSAGE" in s.lines[site]
    assert shown == ["something else", SYNC_MESSAGE]
    assert s.every_step() == {site: [2, 1]}
    msg = s.message(21)
    assert "1.5 host-device sync(s) per step" in msg and "steps 21-22" in msg
    assert f"{site} `warnings.warn(SYNC_MESSAGE" in msg and "1.5 per step" in msg


class WarnedSyncs(Efficiency):
    """Efficiency with its sampling schedule on a CPU run: the sampler catches the sync
    warnings (the loop below raises torch's warning text itself, standing in for a
    GPU's sync) without the CUDA-only sync mode. Everything else is the component's."""

    def _can_sample(self, guard):
        return True

    def _new_sampler(self):
        sampler = SyncSampler()
        sampler.catch_warnings()
        return sampler


SYNC_LINE = "warnings.warn(SYNC_MESSAGE, UserWarning, stacklevel=1)  # a step's sync"


def sync_loop(g, model, opt, *, every: int | None) -> None:
    for i, (x, y) in enumerate(g):
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if every is not None and i % every == 0:
            warnings.warn(SYNC_MESSAGE, UserWarning, stacklevel=1)  # a step's sync


@pytest.fixture(scope="module")
def sampled(tmp_path_factory):
    """Three CPU runs of 26 steps (steps 21-23 sampled): a sync every step, one every
    10 steps (logging), none."""
    out = {}
    for name, every in (("each", 1), ("tenth", 10), ("clean", None)):
        run_dir = tmp_path_factory.mktemp(name)
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        with (
            warnings.catch_warnings(),
            guardrails.guard(
                model,
                opt,
                data(26),
                run_dir=run_dir,
                progress=False,
                efficiency=False,
                components=[WarnedSyncs()],
            ) as g,
        ):
            # Outside the sampled steps the stand-in syncs are only noise in the output.
            warnings.filterwarnings("ignore", message=SYNC_MESSAGE)
            sync_loop(g, model, opt, every=every)
        out[name] = (g, [e for e in read_events(run_dir) if e["kind"] == "host_syncs"])
    return out


def test_sampled_steps_report_each_sync_line_once_with_its_count(sampled):
    g, [e] = sampled["each"]
    line = next(
        i
        for i, text in enumerate(Path(__file__).read_text().splitlines(), 1)
        if text.strip() == SYNC_LINE
    )
    site = f"test_efficiency.py:{line} (sync_loop)"
    assert e["level"] == "warning" and e["step"] == 23, e
    assert e["sampled_steps"] == [21, 23]
    assert e["sites"] == {site: {"per_step": 1.0, "steps": [1, 1, 1], "source": SYNC_LINE}}
    assert e["message"].startswith("1 host-device sync(s) per step in your loop (steps 21-23")
    assert f"  {site} `{SYNC_LINE}`: 1 per step;" in e["message"]
    assert g.component("efficiency").syncs.active is False  # released after step 23


def test_a_sync_every_n_steps_is_information_and_a_clean_loop_is_silent(sampled):
    _, [e] = sampled["tenth"]
    assert e["level"] == "info" and "in 1 of 3 steps" in e["message"], e
    assert "not in every one" in e["message"]
    g, events = sampled["clean"]
    assert events == [] and g.component("efficiency").syncs.steps == 3


def test_a_sync_under_the_engines_pass_through_wrappers_is_the_loops(tmp_path):
    """A sync in the loader's next() (here a C call straight from the guard's batch
    generator: no frame of the loader's own) is told at the loop's `for` line, not
    taken for one of guardrails' own."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    warn = functools.partial(warnings.warn, SYNC_MESSAGE, UserWarning)
    loader = zip(data(4), map(warn, range(4)), strict=True)  # each next() "syncs"
    eff = WarnedSyncs(host_syncs_at_step=2, host_syncs_steps=2)
    with (
        warnings.catch_warnings(),
        guardrails.guard(
            model, opt, loader, run_dir=tmp_path, progress=False, efficiency=False, components=[eff]
        ) as g,
    ):
        warnings.filterwarnings("ignore", message=SYNC_MESSAGE)
        for (x, y), _ in g:  # the loop's for line
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    line = next(
        i
        for i, text in enumerate(Path(__file__).read_text().splitlines(), 1)
        if text.strip() == "for (x, y), _ in g:  # the loop's for line"
    )
    function = "test_a_sync_under_the_engines_pass_through_wrappers_is_the_loops"
    site = f"test_efficiency.py:{line} ({function})"
    assert eff.syncs.sites == {site: [1, 1]} and eff.syncs.own == {}, eff.syncs.sites


def test_the_advice_for_a_sync_follows_its_source_line():
    from guardrails.guards.efficiency.syncs import advice

    assert "keep it on the device" in advice("print(loss.item())")
    assert "print every N steps" in advice("print(loss)")
    assert "torch.where" in advice("if (x > 0).any():")
    assert "every N steps" in advice("something_else(x)")
    assert "fp16 loss scaling" in advice("scaler.step(opt)")
    assert "fused=True" in advice("opt.step()")


# ---------------------------------------------------------------------- on a GPU

cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU (CI has none); run on an H100/H200, see benchmarks/RESULTS.md",
)

ITEM_LINE = "loss_value = loss.item()  # the user's sync"


def gpu_loop(g, model, opt, *, item: bool, every: int | None = None) -> None:
    for i, (x, y) in enumerate(g):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if item:
            loss_value = loss.item()  # the user's sync
            del loss_value
        if every is not None and i % every == 0:
            print(f"step {i} loss {loss.item():.3f}")


def gpu_run(run_dir, **kw):
    device = torch.device("cuda")
    model = mlp().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    batches = [(x.to(device), y.to(device)) for x, y in data(30)]
    with guardrails.guard(model, opt, batches, run_dir=run_dir, progress=False) as g:
        gpu_loop(g, model, opt, **kw)
    assert torch.cuda.get_sync_debug_mode() == 0  # restored
    return g, read_events(run_dir)


@cuda
def test_gpu_an_item_per_step_is_reported_with_its_line(tmp_path):
    _, events = gpu_run(tmp_path, item=True)
    [e] = [e for e in events if e["kind"] == "host_syncs"]
    line = next(
        i
        for i, text in enumerate(Path(__file__).read_text().splitlines(), 1)
        if text.strip() == ITEM_LINE
    )
    site = f"test_efficiency.py:{line} (gpu_loop)"
    assert e["level"] == "warning" and site in e["sites"], e
    # One .item() is one sync warning (one stream sync) as torch counts today.
    assert e["sites"][site]["per_step"] >= 1 and all(e["sites"][site]["steps"])
    assert e["sampled_steps"] == [21, 23]
    assert "loss.item()" in e["message"] and "keep it on the device" in e["message"]


@cuda
def test_gpu_a_clean_loop_is_silent_and_guardrails_itself_does_not_sync(tmp_path):
    g, events = gpu_run(tmp_path, item=False)
    assert not [e for e in events if e["kind"] == "host_syncs"]
    syncs = g.component("efficiency").syncs
    assert syncs is not None and syncs.steps == 3 and syncs.sites == {}
    assert syncs.own == {}, f"guardrails synced on the fast path: {syncs.own}"
    # A fast setup (bf16 autocast, fused AdamW, batches on the GPU) hears no advice.
    assert not [e for e in events if e.get("level") == "warning"], events


@cuda
def test_gpu_logging_every_n_steps_is_information_not_a_warning(tmp_path):
    _, events = gpu_run(tmp_path, item=False, every=10)
    [e] = [e for e in events if e["kind"] == "host_syncs"]
    assert e["level"] == "info" and "in 1 of 3 steps" in e["message"], e


@cuda
def test_gpu_flops_event_has_the_peak_of_this_gpu(tmp_path):
    _, events = gpu_run(tmp_path, item=False)
    [e] = [e for e in events if e["kind"] == "flops"]
    assert e["flops_per_step"] == HAND_COUNT // MICRO and e["dtype"] == "bf16"
    name = torch.cuda.get_device_name()
    assert e["peak_flops"] == flops.peak_flops(name, "bf16")[0], e


# ---------------------------------------------------------------- the count never runs the step


class Denoiser(nn.Module):
    """A diffusion model's shape: a timestep embedding concatenated to the noisy input,
    a SiLU MLP (SiLU's backward is the op torch's FlopCounterMode decomposed)."""

    def __init__(self, d: int = 8, hidden: int = 32, steps: int = 10) -> None:
        super().__init__()
        self.emb = nn.Embedding(steps, d)
        self.mlp = nn.Sequential(nn.Linear(2 * d, hidden), nn.SiLU(), nn.Linear(hidden, d))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.cat([x, self.emb(t)], -1))


def denoising(run_dir: Path | None, steps: int = 4, device: str = "cpu") -> tuple[list, dict]:
    """A diffusion-style loop, plain (``run_dir`` None) or guarded with every default:
    noise and timesteps from the loop's own generator, Adam, an EMA of the model. The
    weights, Adam's state and the EMA after each step, and the losses."""
    torch.manual_seed(0)
    model = Denoiser().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ema = torch.optim.swa_utils.AveragedModel(
        model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.99)
    )
    gen = torch.Generator(device).manual_seed(1)
    after: list = []

    def step() -> None:
        x = torch.randn(4, 8, generator=gen, device=device)
        t = torch.randint(0, 10, (4,), generator=gen, device=device)
        noise = torch.randn(4, 8, generator=gen, device=device)
        loss = nn.functional.mse_loss(model(x + noise, t), noise)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ema.update_parameters(model)
        after.append(
            {
                "loss": loss.detach().clone(),
                "model": {k: v.clone() for k, v in model.state_dict().items()},
                "ema": {k: v.clone() for k, v in ema.state_dict().items()},
                "opt": copy.deepcopy(opt.state_dict()),
            }
        )

    if run_dir is None:
        for _ in range(steps):
            step()
        return after, {}
    with guardrails.guard([model, ema], opt, run_dir=run_dir, progress=False) as g:
        while g.step < steps:
            step()
    return after, {"gen": gen.get_state(), "rng": torch.get_rng_state()}


def test_a_guarded_diffusion_loop_trains_bitwise_as_the_plain_one_and_is_counted(tmp_path):
    """Every default (the count at step 2): each step's weights, Adam's state, the EMA
    and the loss are the plain loop's, bitwise; the FLOPs are the MLP's matmuls by hand
    (forward, each weight's gradient and each input's: the embedding needs one)."""
    plain, _ = denoising(None)
    rng_plain = torch.get_rng_state()
    guarded, rngs = denoising(tmp_path)
    assert torch.equal(rngs["rng"], rng_plain)
    assert_state_equal(guarded, plain)
    [e] = [e for e in read_events(tmp_path) if e["kind"] == "flops"]
    assert e["step"] == 2 and e["source"] == "counted"
    assert e["flops_per_step"] == 3 * 2 * 4 * (16 * 32 + 32 * 8)


class Normed(nn.Module):
    """BatchNorm (running stats, ``num_batches_tracked``), dropout (RNG draws) and a
    Python attribute its forward sets."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(IN, HIDDEN), nn.BatchNorm1d(HIDDEN), nn.SiLU(), nn.Dropout(0.5)
        )
        self.head = nn.Linear(HIDDEN, OUT)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.head(self.net(x))


def test_the_count_leaves_batchnorm_stats_dropouts_rng_and_attributes_as_the_plain_run(tmp_path):
    """After the counted step (2) and after the run: the running stats, the batch
    count, the forward's attribute and torch's RNG are the plain run's, exactly."""
    runs = {}
    for name in ("plain", "guarded"):
        torch.manual_seed(0)
        model = Normed()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        states = []
        batches = data(4)
        # A user's hooks (an activation logger, a gradient probe) see the real step
        # alone: the replay's copy runs none of them.
        seen: list[torch.Tensor] = []
        model.register_forward_pre_hook(lambda m, args, seen=seen: seen.append(args[0]))
        model.register_forward_hook(lambda m, args, out, seen=seen: seen.append(out))
        model.register_full_backward_hook(lambda m, gi, go, seen=seen: seen.append(go[0]))
        if name == "guarded":
            guard = guardrails.guard(model, opt, batches, run_dir=tmp_path, progress=False)
        else:
            guard = contextlib.nullcontext(batches)
        with guard as g:
            for x, y in g:
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
                states.append(
                    (copy.deepcopy(model.state_dict()), model.calls, torch.get_rng_state())
                )
        assert len(seen) == 3 * 4, len(seen)
        states.append([t.detach().clone() for t in seen])  # real tensors, the step's own
        runs[name] = states
    assert_state_equal(runs["guarded"], runs["plain"])
    [e] = [e for e in read_events(tmp_path) if e["kind"] == "flops"]
    assert e["step"] == 2 and e["flops_per_step"] > 0


class ReadsValues(nn.Module):
    """A forward that reads a value on the host (``.item()``): it cannot run on fake
    tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(IN, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x)
        return out * 2 if out.abs().max().item() > 100 else out


def test_a_forward_that_cannot_be_replayed_is_not_counted_quietly(tmp_path):
    """The count is given up with an info event naming the knob; no warning; the
    run trains as the plain one does."""
    states = []
    for run_dir in (None, tmp_path):
        torch.manual_seed(0)
        model = ReadsValues()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        batches = data(3)
        if run_dir is None:
            guard = contextlib.nullcontext(batches)
        else:
            guard = guardrails.guard(model, opt, batches, run_dir=run_dir, progress=False)
        with guard as g:
            for x, y in g:
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
        states.append(model.state_dict())
    assert_state_equal(states[0], states[1])
    events = read_events(tmp_path)
    [e] = [e for e in events if e["kind"] == "flops"]
    assert e["level"] == "info" and e["flops_per_step"] is None and e["step"] == 2
    assert "fake tensors" in e["message"] and "flops_per_step" in e["message"]
    assert not [e for e in events if e.get("level") in ("warning", "error")]


@cuda
def test_gpu_a_guarded_diffusion_loop_trains_bitwise_as_the_plain_one(tmp_path):
    """On CUDA (the fused kernels, the CUDA generators): every step's weights, Adam's
    state, the EMA, the loss and the loop's generator are the plain loop's, bitwise,
    and the FLOPs are counted."""
    plain, _ = denoising(None, steps=6, device="cuda")
    guarded, _ = denoising(tmp_path, steps=6, device="cuda")
    assert_state_equal(guarded, plain)
    [e] = [e for e in read_events(tmp_path) if e["kind"] == "flops"]
    assert e["flops_per_step"] == 3 * 2 * 4 * (16 * 32 + 32 * 8)
