"""GPU truth: the guarded loop adds no host-device synchronisation.

CI has no GPU, so these skip there; they run on an H100/H200 through the device tool,
and the result is recorded in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import read_events, train_loop

import guardrails
from guardrails.engine.gradnorm import MAX_MISSES, total_norm

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU (CI has none); run on an H100/H200, see benchmarks/RESULTS.md",
)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))


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


def step(model, opt, x, y):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def loop(model, opt, batches):
    for x, y in batches:
        step(model, opt, x, y)


@pytest.mark.parametrize("clip", [False, True], ids=["noclip", "torchclip"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_guarded_loop_never_syncs(tmp_path, compiled, clip):
    """With clip: the loop clips with torch.nn.utils.clip_grad_norm_, whose norm the
    guard takes as the step's (no second pass, and still no sync)."""
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
            step_model,
            opt,
            batches * 9,
            run_dir=tmp_path,
            metrics={"every_n_steps": 10},
            progress=False,
        ) as g:
            for i, (x, y) in enumerate(g):
                if i == steps:
                    break
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = step_model(x, y)
                loss.backward()
                losses.append(loss.detach())
                if clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    shared = [e["steps"] for e in read_events(tmp_path) if e["kind"] == "grad_norm_shared"]
    assert shared == ([steps] if clip else [])
    # Without a clip to share, every step's norm was the kernel's (no eager fallback).
    assert g._norm.kernel_steps == (0 if clip else steps)
    rows = guardrails.read_metrics(tmp_path).to_pydict()
    assert rows["step"] == list(range(1, steps + 1))
    assert rows["loss"] == pytest.approx([v.item() for v in losses], rel=1e-6)
    assert all(v > 0 for v in rows["grad_norm"])
    assert all(m > 0 for m in rows["mem_peak_bytes"])
    assert rows["tokens"] == [16 * 64] * steps


def test_kernel_grad_norm_is_a_float64_norm_within_rounding_and_nan_when_a_gradient_is():
    """The default norm on one CUDA device (one Triton kernel over the gradients'
    addresses): float32 and bfloat16 parameters of sizes around its chunk edge, some
    without a gradient, give a float64 norm's value within float32 rounding; one NaN or
    Inf in any gradient makes it non-finite; a gradient that is not contiguous is left
    to the eager norm (same value); and the tensors a call creates do not grow with the
    number of gradients (the eager norm creates one per gradient)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from guardrails.engine.gradnorm import GradNorm
    from guardrails.engine.gradnorm_kernel import CHUNK

    device = torch.device("cuda")
    torch.manual_seed(0)
    sizes = [1, 7, 1000, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5]
    params = [
        torch.nn.Parameter(torch.randn(n, device=device, dtype=dtype))
        for n in sizes
        for dtype in (torch.float32, torch.bfloat16)
    ]
    for i, p in enumerate(params):
        p.grad = None if i % 5 == 3 else torch.randn_like(p) * (i + 1)

    def exact() -> float:
        grads = [p.grad.double() for p in params if p.grad is not None]
        return torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item()

    norm = GradNorm(params, use_graph=False)
    assert norm.kernel is not None
    assert norm(params).item() == pytest.approx(exact(), rel=1e-5)
    assert norm.kernel_steps == 1
    # fp32 of 1 element, bf16 of CHUNK - 1 and CHUNK + 1, fp32 of 3 chunks + 5
    for i in (0, 7, 11, 12):
        grad = params[i].grad
        for bad in (float("nan"), float("inf")):
            kept = grad[-1].clone()
            grad[-1] = bad
            assert not torch.isfinite(norm(params)).item(), (i, bad)
            grad[-1] = kept
    assert norm(params).item() == pytest.approx(exact(), rel=1e-5)
    # The last program sums the partials in one fixed order: the same bits every call,
    # and its count of finished programs is back at 0 after each.
    assert len({norm(params).item() for _ in range(50)}) == 1
    assert norm.kernel.finished.tolist() == [0]

    # A gradient assigned by hand as a transposed (strided) view: the eager norm.
    square = torch.nn.Parameter(torch.randn(64, 32, device=device))
    square.grad = torch.randn(32, 64, device=device).t()
    params.append(square)
    norm = GradNorm(params, use_graph=False)
    # Within bfloat16 rounding: the eager norm rounds each bf16 gradient's norm to bf16
    # (measured 1.2e-4 off here; the kernel sums every square in float32).
    assert norm(params).item() == pytest.approx(exact(), rel=2**-8)
    assert norm.kernel_steps == 0

    class Created(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.n += len(out) if isinstance(out, (list, tuple)) else 1
            return out

    created = {}
    for n_params in (15, 1500):
        many = [torch.nn.Parameter(torch.randn(100, device=device)) for _ in range(n_params)]
        for p in many:
            p.grad = torch.randn_like(p)
        norm = GradNorm(many, use_graph=False)
        norm(many)  # builds it
        for kernel in (True, False):
            if not kernel:
                norm.kernel = None
            with Created() as count:
                norm(many)
            created[n_params, kernel] = count.n
    # The pinned address table, its copy and the norm's output.
    assert created[15, True] == created[1500, True] <= 4, created
    assert created[1500, False] >= 1500, created


def test_a_lazy_module_gets_the_kernel_norm_from_its_first_step(tmp_path):
    """A lazy module's parameters have no size until its first forward, after the
    guard started: the kernel's plan is built at the first step, and every step's
    recorded norm is the gradients' norm."""
    torch.manual_seed(0)
    device = torch.device("cuda")
    model = torch.nn.Sequential(
        torch.nn.LazyLinear(64), torch.nn.ReLU(), torch.nn.LazyLinear(1)
    ).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    batches = [(torch.randn(32, 20, device=device), torch.randn(32, 1, device=device))] * 6
    expected = []
    with guardrails.guard(model, opt, batches, run_dir=tmp_path, progress=False) as g:
        for x, y in g:
            torch.nn.functional.mse_loss(model(x), y).backward()
            grads = [p.grad.double() for p in model.parameters()]
            expected.append(torch.stack([d.norm() for d in grads]).norm())
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert g._norm.kernel_gave_up is None
    assert g._norm.kernel_steps == 6
    rows = guardrails.read_metrics(tmp_path).to_pydict()
    assert rows["grad_norm"] == pytest.approx([e.item() for e in expected], rel=1e-5)


def test_sparse_embedding_gradients_leave_the_kernel_for_the_eager_norm(tmp_path):
    """A sparse gradient has no address for the kernel: the norm goes eager for the
    run (coalesced values), each step's recorded, a NaN in it skips that step."""
    from test_gradnorm import Tagger, exact

    torch.manual_seed(0)
    device = torch.device("cuda")
    model = Tagger().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g0 = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(0, 10, (32,), device=device, generator=g0)
    data = [(ids, torch.randn(32, device=device, generator=g0))] * 4
    expected = []
    with guardrails.guard(model, opt, data, run_dir=tmp_path, progress=False) as g:
        for step, (x, y) in enumerate(g, 1):
            torch.nn.functional.mse_loss(model(x), y).backward()
            if step == 3:
                model.emb.weight.grad._values()[0, 0] = float("nan")
            else:
                expected.append(exact(list(model.parameters())))
            opt.step()
            opt.zero_grad()
    assert g._norm.sparse and g._norm.kernel is None and g._norm.kernel_steps == 0
    rows = guardrails.read_metrics(tmp_path).to_pydict()
    assert rows["skipped"] == [False, False, True, False]
    finite = [v for s, v in zip(rows["step"], rows["grad_norm"], strict=True) if s != 3]
    assert finite == pytest.approx(expected, rel=1e-5)


def test_bucket_norms_sum_squares_by_kernel_in_fixed_slots_and_fall_back_per_bucket():
    """GuardedDDP's per-bucket norms on CUDA (no process group needed: the buckets are
    recorded as the comm hook does): float32 and bfloat16 buckets of different sizes
    by the kernel, a float64 one by vector_norm in the same slots, a bucket that shrinks
    at DDP's rebuild leaves no stale partial sum, and a NaN in any bucket makes the
    total NaN."""
    from guardrails.engine.gradnorm import BucketNorms

    device = torch.device("cuda")
    torch.manual_seed(0)
    norms = BucketNorms(device)
    assert norms._flat is not None and norms._width > 1

    def record_all(buckets, step):
        for i, b in enumerate(buckets):
            norms.record(i, b, i == len(buckets) - 1, step)
        return norms.total(step)

    def exact(buckets):
        return torch.stack([b.double().norm() for b in buckets]).norm().item()

    buckets = [
        torch.randn(3_000_001, device=device),
        torch.randn(70_000, device=device, dtype=torch.bfloat16),
        torch.randn(5, device=device, dtype=torch.float64),
        torch.randn(1, device=device),
    ]
    assert record_all(buckets, 0).item() == pytest.approx(exact(buckets), rel=1e-5)
    assert norms.total(1) is None  # no complete set during step 1 yet
    buckets[0] = torch.randn(10, device=device)  # a rebuild made bucket 0 small
    assert record_all(buckets, 1).item() == pytest.approx(exact(buckets), rel=1e-5)
    buckets[1][7] = float("nan")
    assert torch.isnan(record_all(buckets, 2)).item()


def _poison_loop(g, model, opt, bad_step, n_steps, before):
    """Train under ``g``; at ``bad_step`` plant a NaN in one gradient (a device op, no
    sync) and keep a device copy of the weights before the update."""
    for i, (x, y) in enumerate(g):
        if i == n_steps:
            break
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        if i + 1 == bad_step:
            next(model.parameters()).grad.mul_(float("nan"))
            before.extend(p.detach().clone() for p in model.parameters())
        opt.step()
        if i + 1 == bad_step:
            before.append([p.detach().clone() for p in model.parameters()])
        opt.zero_grad(set_to_none=True)


def test_step_ring_rows_reach_the_host_lagged_without_a_sync():
    """The step ring NanGuard and telemetry share, on CUDA: one stack per row, a
    reader's copies (across the ring's end, and past a row another component wrote
    while this one's hooks were bypassed) read an interval later, with no sync."""
    from guardrails.engine.lagged import StepRing

    ring = StepRing(torch.device("cuda"))
    reader = ring.reader(3)  # a ring of 6 rows
    assert not ring.host
    mine: list[int] = []
    read: list[float] = []
    expect: list[float] = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(1, 21):
            loss = torch.full((), float(step), device="cuda")
            c = ring.write(loss, loss * 2)
            if step % 5 == 0:
                continue  # this reader did not see the step
            mine.append(c)
            expect.append(float(step))
            if len(mine) == 3:
                previous = reader.start(mine, list(mine))  # read now, as its users do
                if previous is not None:
                    read += previous.read()[:, 0].tolist()  # host memory: no sync
                mine = []
        read += reader.take().read()[:, 0].tolist()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert read == expect[: len(read)] and len(read) == 15


def test_nonfinite_step_is_skipped_on_device_without_a_sync(tmp_path):
    device = torch.device("cuda")
    model = gpt(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    batches = data(device, 4)
    loop(model, opt, batches)  # lazy optimizer state, allocator
    before: list = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        with guardrails.guard(model, opt, batches * 10, run_dir=tmp_path, progress=False) as g:
            _poison_loop(g, model, opt, bad_step=7, n_steps=30, before=before)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    *params_before, params_after = before
    assert all(torch.equal(a, b) for a, b in zip(params_before, params_after, strict=True))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    nan = next(c for c in g.components if isinstance(c, guardrails.NanGuard))
    assert nan.nonfinite_steps == [7]
    # The NaN was planted in the gradients, not made by the batch: replay is finite.
    assert nan.diagnoses[0]["cause"] == "not_reproducible"
    skipped = guardrails.read_metrics(tmp_path).to_pydict()["skipped"]
    assert [i + 1 for i, s in enumerate(skipped) if s] == [7]


def test_raise_policy_raises_within_two_check_intervals(tmp_path):
    device = torch.device("cuda")
    model = gpt(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    batches = data(device, 4)
    with pytest.raises(guardrails.NonFiniteError) as info:
        with guardrails.guard(
            model, opt, batches * 10, run_dir=tmp_path, progress=False, nan={"policy": "raise"}
        ) as g:
            _poison_loop(g, model, opt, bad_step=13, n_steps=40, before=[])
    assert info.value.step == 13
    # The flags reach the host in one copy per 10 steps, read one interval later: the
    # error comes at the same (deterministic) step on every rank, at most 20 steps late.
    assert 13 <= g.step <= 13 + 2 * 10


def _rewind_run(run_dir, bad: range, n_steps: int, *, sync_debug: bool):
    """A GPT under fused AdamW with rewind on (a snapshot every 25 steps); the batches
    whose fetch index is in ``bad`` get a NaN gradient (a device op). With
    ``sync_debug``, the whole loop runs under ``set_sync_debug_mode("error")``."""
    device = torch.device("cuda")
    model = gpt(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    batches = data(device, 4)
    loop(model, opt, batches)  # lazy optimizer state, allocator
    knobs = {"snapshot_every_steps": 25, "skip_batches": 2}
    torch.cuda.set_sync_debug_mode("error" if sync_debug else 0)
    try:
        with guardrails.guard(
            model, opt, batches * 40, run_dir=run_dir, progress=False, rewind=knobs
        ) as g:
            rw = next(c for c in g.components if isinstance(c, guardrails.Rewind))
            slots: list = []
            for i, (x, y) in enumerate(g):
                if i == n_steps:
                    # The snapshots as the loop ends (the guard's end lets go of them).
                    slots = list(rw._slots)
                    break
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(x, y)
                loss.backward()
                if i in bad:
                    next(model.parameters()).grad.mul_(float("nan"))
                opt.step()
                opt.zero_grad(set_to_none=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return g, model, slots


def test_rewind_snapshots_keep_the_loop_sync_free(tmp_path):
    """Snapshots every 25 steps (device to pinned memory, non-blocking) on the fused,
    lagged path: 50 steps under sync debug mode "error" raise nothing."""
    from guardrails.guards.rewind.snapshot import _drop

    _, model, slots = _rewind_run(tmp_path, range(0), 50, sync_debug=True)
    assert sorted(s.step for s in slots) == [25, 50]
    assert all(s.staging.pinned and s.staging.nbytes for s in slots)
    # Through a device buffer and the side stream (the device has room for it).
    assert all(s.through_device for s in slots)
    assert _kinds(tmp_path, "rewind") == []
    # Taken at the boundary after step 50, the last step: it holds these weights.
    torch.cuda.synchronize()
    snap = max(slots, key=lambda s: s.step)
    held = _drop(snap._layout["model"], snap._copies, fresh=False)
    for k, v in model.state_dict().items():
        assert torch.equal(held[k], v.cpu()), k


def test_a_snapshot_with_a_grad_scaler_takes_no_host_sync_and_restores_it(tmp_path):
    """A GradScaler's state_dict() reads its scale on the host: a snapshot keeps the
    scaler's own device tensors instead (no sync, under sync debug mode "error"), and a
    restore gives back the state the scaler had."""
    device = torch.device("cuda")
    model = gpt(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10, growth_interval=2)
    batches = data(device, 4)
    with guardrails.guard(
        model, opt, batches * 4, run_dir=tmp_path, progress=False, scaler=scaler, rewind=True
    ) as g:
        for i, (x, y) in enumerate(g):
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(x, y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            if i == 5:
                break
        slot = min(g.component("rewind")._slots, key=lambda s: s.step)
        torch.cuda.synchronize()
        held = scaler.state_dict()
        torch.cuda.set_sync_debug_mode("error")
        try:
            slot.take(g, (0, 0))
        finally:
            torch.cuda.set_sync_debug_mode(0)
        scaler.update(new_scale=3.0)
        slot.restore(g)
        assert scaler.state_dict() == held


def test_rewind_on_the_lagged_cuda_path_goes_back_before_the_streak(tmp_path):
    # 12 NaN gradients from fetch 30 (step 31): the flags reach the host up to 20 steps
    # late; the streak of 10 asks for a rewind, to the snapshot of step 25.
    g, model, _ = _rewind_run(tmp_path / "a", range(30, 42), 120, sync_debug=False)
    (e,) = _kinds(tmp_path / "a", "rewind")
    assert (e["cause"], e["start"], e["to_step"]) == ("nonfinite", 31, 25), e
    assert 40 <= e["from_step"] <= 40 + 2 * 10
    assert e["batches_skipped"]["dropped"] == 2
    assert all(torch.isfinite(p).all() for p in model.parameters())
    # The same faults again: the same rewind and, bitwise, the same weights.
    g2, model2, _ = _rewind_run(tmp_path / "b", range(30, 42), 120, sync_debug=False)
    (e2,) = _kinds(tmp_path / "b", "rewind")
    assert (e2["from_step"], e2["to_step"]) == (e["from_step"], e["to_step"])
    assert g2.step == g.step
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)


def _kinds(run_dir, kind):
    return [e for e in read_events(run_dir) if e["kind"] == kind]


def test_an_lr_jump_on_cuda_names_the_lr_and_the_sampled_update(tmp_path):
    """The LR set to 1e4 after step 30 (the example's nan_lr): the diagnosis, read
    lagged, names the jump at step 31 and the weights' move measured from the update
    sample's snapshot before the first non-finite step (the fast path of the sampler is
    sync-free: test_guarded_loop_never_syncs runs three samples under the sync check)."""
    device = torch.device("cuda")
    model = gpt(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    batches = data(device, 4)
    with pytest.raises(guardrails.NonFiniteError) as info:
        with guardrails.guard(model, opt, batches * 20, run_dir=tmp_path, progress=False) as g:
            for x, y in g:
                if g.step == 30:
                    opt.param_groups[0]["lr"] = 1e4  # the fault
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(x, y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
    err = info.value
    assert err.cause == "optimization_blowup", str(err)
    assert "the learning rate jumped from 0.001 to 1e+04 at step 31" in str(err)
    assert "check the LR schedule" in err.hint
    nan = next(c for c in g.components if isinstance(c, guardrails.NanGuard))
    evidence = nan.diagnoses[0]["evidence"]
    assert evidence["lr_jump"]["step"] == 31
    assert [s for s, _ in nan._updates.samples][:3] == [10, 20, 30]
    update = evidence["update"]
    assert update["from_step"] < err.step and update["ratio"] > 100 * update["median"]


def test_a_non_fused_optimizer_pays_one_sync_per_step(tmp_path):
    device = torch.device("cuda")
    model = gpt(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    batches = data(device, 2)
    loop(model, opt, batches)
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="synchroniz"):
            with guardrails.guard(model, opt, batches, run_dir=tmp_path, progress=False):
                loop(model, opt, batches)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    events = json.dumps(read_events(tmp_path))
    assert "nan_guard_syncs" in events and "fused=True" in events
    # The guard's own cost, with its fix: advice, never a warning of a healthy run.
    (told,) = [e for e in read_events(tmp_path) if e["kind"] == "nan_guard_syncs"]
    assert told["level"] == "info"


def test_real_cuda_oom_is_explained(tmp_path):
    """A micro-batch far too big for the card: a real CUDA OOM partway through the
    forward comes out explained, and is still a torch.OutOfMemoryError."""
    import gc

    device = torch.device("cuda")
    model = gpt(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    total = torch.cuda.get_device_properties(device).total_memory
    # (B, 64) tokens whose 128-wide fp32 embeddings alone take a quarter of the card;
    # the first block's activations (x + pos, layer norm, qkv) run past the rest.
    huge = total // (4 * 64 * 128 * 4)
    big = torch.zeros(huge, 64, dtype=torch.long, device=device)
    batches = [*data(device, 2), (big, big)]
    with pytest.raises(guardrails.OutOfMemoryError) as info:
        with guardrails.guard(model, opt, batches, run_dir=tmp_path, progress=False) as g:
            train_loop(g, model, opt)  # fp32 activations
    err = info.value
    print(str(err))  # the message, for benchmarks/RESULTS.md
    assert isinstance(err, torch.OutOfMemoryError)
    assert isinstance(err.__cause__, torch.OutOfMemoryError)
    assert "CUDA out of memory" in str(err.__cause__)
    assert (err.phase, err.step, err.rank) == ("forward", 3, 0)
    mem = err.memory
    assert mem["device"] == "cuda:0" and mem["total"] == total
    assert 0 < mem["allocated"] <= mem["reserved"] and mem["peak"] >= mem["allocated"]
    assert mem["fragmentation"] == mem["reserved"] - mem["allocated"]
    assert mem["requested"] > 0 and mem["by_kind"]["parameters"] > 0
    # The activation the forward was holding is the largest live tensor; it is on the
    # card and is a quarter of it (the embedding output, or a same-size successor).
    top = err.largest_tensors[0]
    assert top["device"] == "cuda:0" and top["bytes"] >= total // 5
    assert {"activation_checkpointing", "smaller_micro_batch"} & set(err.remedies[:2])
    assert "activation checkpointing" in err.hint
    assert [e for e in read_events(tmp_path) if e["kind"] == "oom"]
    assert g.step == 2
    del err, info, big, batches
    gc.collect()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_allocated(device) < total // 10  # nothing kept alive


def test_checkpoints_on_cuda_sync_only_at_saves_and_resume_bitwise(tmp_path):
    """Periodic background saves of a CUDA model: the steps between saves stay sync-free
    (the save itself is a declared sync: one wait for the device-to-host copies), and a
    run resumed from step 10 ends bitwise equal to one that was never interrupted."""
    device = torch.device("cuda")
    batches = data(device, 4)

    def run(run_dir, n_steps, every=None, sync_debug=False):
        model = gpt(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        syncs = []
        with guardrails.guard(
            model,
            opt,
            batches * 10,
            run_dir=run_dir,
            progress=False,
            checkpoint={"every_n_steps": every},
        ) as g:
            for x, y in g:
                torch.cuda.set_sync_debug_mode("error" if sync_debug else 0)
                try:
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        loss = model(x, y)
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                except RuntimeError as e:  # pragma: no cover - the assertion says which
                    syncs.append((g.step, str(e)[:80]))
                finally:
                    torch.cuda.set_sync_debug_mode(0)
                if g.step >= n_steps:
                    break
        return model, opt, syncs

    straight, opt_a, _ = run(tmp_path / "a", 20)
    _, _, syncs = run(tmp_path / "b", 10, every=5, sync_debug=True)
    assert syncs == []  # the steps (boundaries excluded) never synced
    names = sorted(p.name for p in (tmp_path / "b" / "checkpoints").glob("step_*"))
    assert names == ["step_000000005", "step_000000010"]
    resumed, opt_b, _ = run(tmp_path / "b", 20)
    for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
    for sa, sb in zip(opt_a.state.values(), opt_b.state.values(), strict=True):
        assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_periodic_saves_stage_into_pinned_memory_allocated_once_ahead_of_the_first(tmp_path):
    """The first periodic save used to pin its whole state (5.9 s of stall at 10 GB):
    the staging blocks are allocated in a thread after step 1 and every save reuses
    them (the same addresses), and the checkpoint holds exactly the device's values."""
    device = torch.device("cuda")
    batches = data(device, 4)
    model = gpt(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    seen = []
    with guardrails.guard(
        model,
        opt,
        batches * 5,
        run_dir=tmp_path,
        progress=False,
        checkpoint={"every_n_steps": 3, "strict_cadence": True},
    ) as g:
        ck = g.component("checkpoint")
        for x, y in g:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if g.step == 2:  # planned at the boundary after step 1, before any save
                assert ck.writer.staging._thread is not None
            if g.step % 3 == 1 and g.step > 1:  # just after a save's staging
                seen.append([b.data_ptr() for b in ck.writer.staging._blocks])
    assert len(seen) >= 3 and all(ptrs == seen[0] for ptrs in seen) and seen[0]
    assert all(b.is_pinned() for b in ck.writer.staging._blocks)
    expected = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert ck.writer.staging.nbytes >= expected
    fresh = gpt(device)
    assert guardrails.resume(tmp_path / "checkpoints", fresh)["step"] == 20
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)


def test_staging_blocks_are_locked_in_place_and_unlocked_at_release():
    """The staging's pinned blocks are plain memory locked in place (cudaHostRegister:
    torch's pin_memory=True held the driver's lock the training thread's launches wait
    for, 3.5-8.1 s at 10 GB): pinned, a non-blocking copy into them lands whole, and
    release() unlocks them (a block still referenced is plain memory, its bytes kept)."""
    from guardrails.checkpoint import stage

    staging = stage.Staging(pinned=True)
    src = [torch.randn(3 << 18, device="cuda"), torch.randn(5 << 18, device="cuda")]
    device = torch.device("cuda", torch.cuda.current_device())  # the grow thread sets it
    staging.prepare([t.numel() * t.element_size() for t in src], device)
    staging.wait()
    blocks = staging.blocks
    assert blocks and all(b.is_pinned() for b in blocks)
    places = staging.place(src)
    for dst, t in zip(places, src, strict=True):
        dst.copy_(t, non_blocking=True)
    torch.cuda.synchronize()
    assert all(torch.equal(dst, t.cpu()) for dst, t in zip(places, src, strict=True))
    staging.release()
    assert not any(b.is_pinned() for b in blocks)
    assert all(torch.equal(dst, t.cpu()) for dst, t in zip(places, src, strict=True))


def test_a_signal_save_without_periodic_saves_stages_into_pinned_memory_pinned_at_start(
    tmp_path,
):
    """A SIGTERM early in a run that takes no periodic saves used to stage into fresh
    pinned memory (4.1-4.6 s of 12.4-12.9 s to exit at 10 GB, H100): the staging is
    pinned in a thread from start (grown after step 1) whenever saves on signals are
    on, so the signal's save at step 10 allocates nothing, and holds the device's
    values."""
    import os
    import signal

    device = torch.device("cuda")
    batches = data(device, 4)
    model = gpt(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    with guardrails.guard(
        model,
        opt,
        batches * 5,
        run_dir=tmp_path,
        progress=False,
        checkpoint={"exit_on_signal": False},
    ) as g:
        ck = g.component("checkpoint")
        assert ck.writer.staging.pinned and ck.writer.staging._thread is not None  # before any step
        for x, y in g:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if g.step == 10:
                os.kill(os.getpid(), signal.SIGTERM)
    [saved] = [e for e in read_events(tmp_path) if e["kind"] == "checkpoint"]
    assert saved["step"] == 10 and saved["stage_fresh_bytes"] == 0, saved
    fresh = gpt(device)
    assert guardrails.resume(tmp_path / "checkpoints", fresh)["step"] == 10
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)


def _linear_model(device):
    # 4 MiB gradients: the allocator's large pool, where a warm loop's gradients can
    # come back to the same blocks (small ones share blocks with every small tensor
    # the loop keeps, like a list of per-step losses).
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(1024, 1024, bias=False),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 1024, bias=False),
    ).to(device)


def _graph_norm_loop(tmp_path, n_steps, before_norm):
    """Train the linear model with graph_grad_norm=True under sync-debug "error";
    ``before_norm(i, params)`` may move the gradients. Returns, per step, the norm
    the guard gave (kept past the step: a replay must not overwrite it) and the eager
    norm of the same gradients, and the run's grad_norm_graph event."""
    device = torch.device("cuda")
    model = _linear_model(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    params = list(model.parameters())
    batches = [torch.randn(64, 1024, device=device) for _ in range(4)]
    pairs = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        with guardrails.guard(
            model,
            opt,
            batches * (n_steps // 4 + 1),
            run_dir=tmp_path,
            progress=False,
            graph_grad_norm=True,
        ) as g:
            for i, x in enumerate(g):
                if i == n_steps:
                    break
                model(x).square().mean().backward()
                before_norm(i, params)
                norm = g.grad_norm()
                pairs.append((norm, total_norm([p.grad for p in params], device, False)))
                opt.step()
                opt.zero_grad(set_to_none=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for step, (graph, eager) in enumerate(pairs, 1):
        # A stale read (another step's gradients) would give another step's norm.
        torch.testing.assert_close(graph, eager, rtol=1e-6, atol=0, msg=f"step {step}")
    assert len({v.item() for v, _ in pairs}) == n_steps  # every step its own value
    [ev] = [e for e in read_events(tmp_path) if e["kind"] == "grad_norm_graph"]
    return ev


def test_graph_grad_norm_equals_the_eager_norm_and_never_reads_moved_gradients(tmp_path):
    """Replays give the eager norm without a sync; once the gradients start moving (the
    loop keeps old ones alive, so the allocator cannot hand their blocks back) every
    step is computed eagerly (still equal), and after MAX_MISSES such steps the guard
    gives the graph up."""
    move_from = 12
    kept = []

    def move(i, params):
        if i >= move_from:
            kept.append([p.grad for p in params])  # held: new grads land elsewhere
            for p in params:
                p.grad = p.grad.clone()

    ev = _graph_norm_loop(tmp_path, move_from + MAX_MISSES + 5, move)
    assert ev["captures"] >= 1 and ev["replays"] >= move_from - 4, ev
    assert ev["eager"] >= MAX_MISSES + 1 and "new addresses" in ev["gave_up"], ev


def test_graph_grad_norm_keeps_one_graph_per_layout_the_gradients_cycle_through(tmp_path):
    """Gradients that alternate between two sets of buffers (an allocator cycling
    through two layouts) get two graphs, and every later step replays the right one."""
    bufs: list[list[torch.Tensor]] = []

    def alternate(i, params):
        if not bufs:
            bufs.extend([[torch.empty_like(p) for p in params] for _ in range(2)])
        for p, buf in zip(params, bufs[i % 2], strict=True):
            buf.copy_(p.grad)
            p.grad = buf

    n_steps = 24
    ev = _graph_norm_loop(tmp_path, n_steps, alternate)
    assert ev["captures"] == 2 and ev["replays"] == n_steps - 4 and ev["gave_up"] is None, ev


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)")
@pytest.mark.parametrize("shape", ["zero", "distopt"])
def test_sharded_optimizers_skip_together_and_resume_bitwise_on_nccl(tmp_path, shape):
    """tests/loops/test_loops.py's ZeroRedundancyOptimizer and reduce-inside-step loops on 2
    GPUs over NCCL: a NaN sample on rank 0 at step 2 is skipped on both ranks (the flag
    agreed over guardrails' gloo group where the gradients differ), SIGTERM on rank 1
    at step 3 saves every rank's optimizer part, the resume ends bitwise equal."""
    from test_loops import _stop_and_resume

    extra = ("--nan-at", 2, "--device", "cuda")
    _stop_and_resume(tmp_path, shape, steps=10, stop_at=3, world=2, stop_rank=1, extra=extra)
    skips = [e for e in read_events(tmp_path / "b") if e["kind"] == "nonfinite"]
    assert sorted((e["rank"], e["step"]) for e in skips) == [(0, 2), (1, 2)]


# How both 2-GPU worker scripts start: one GPU per rank over NCCL, the example GPT.
NCCL_WORKER_START = """
import os, sys, json, torch, torch.distributed as dist
sys.path.insert(0, os.environ["EXAMPLES"])
from train_gpt import GPT
import guardrails
dist.init_process_group("nccl")
rank = dist.get_rank()
device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
torch.cuda.set_device(device)
torch.manual_seed(0)
"""


def _run_nccl_worker(tmp_path: Path, source: str) -> Path:
    """Run ``source`` under torchrun on 2 GPUs; its run_dir once it exited 0."""
    from _ranks import torchrun

    script = tmp_path / "worker.py"
    script.write_text(source)
    env = {"EXAMPLES": str(Path(__file__).resolve().parents[2] / "examples")}
    run_dir = tmp_path / "run"
    res = torchrun([script], 2, out=tmp_path, timeout_s=300, env={**env, "RUN_DIR": str(run_dir)})
    assert res.code == 0, (res.out[-2000:], res.err[-4000:])
    return run_dir


DDP_WORKER = (
    NCCL_WORKER_START
    + """
model = guardrails.GuardedDDP(GPT(65, 64, 2, 4, 128).to(device), device_ids=[device.index],
                              bucket_cap_mb=1)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
g = torch.Generator(device=device).manual_seed(rank)
data = [(torch.randint(0, 65, (8, 64), device=device, generator=g),) * 2 for _ in range(30)]
pairs = []  # (the guard's norm from the buckets, a float64 norm of the gradients)
def step(x, y, nan=False, gd=None):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(x, y)
    (loss * float("nan") if nan else loss).backward()
    if gd is not None and not nan:
        exact = torch.stack([p.grad.double().norm() for p in model.parameters()]).norm()
        pairs.append((gd.grad_norm(), exact))
    opt.step()
    opt.zero_grad(set_to_none=True)
for x, y in data[:3]:
    step(x, y)  # warm-up: DDP rebuilds its buckets, lazy optimizer state
torch.cuda.set_sync_debug_mode("error")
for x, y in data[:2]:
    step(x, y)  # plain DDP is sync-free on its own here
torch.cuda.set_sync_debug_mode(0)  # the guard's start checks read weights (once)
with guardrails.guard(model, opt, data[3:], run_dir=os.environ["RUN_DIR"], progress=False) as gd:
    for i, (x, y) in enumerate(gd):
        if i == 2:
            torch.cuda.set_sync_debug_mode("error")
        step(x, y, nan=(i == 10 and rank == 1), gd=gd)
    torch.cuda.set_sync_debug_mode(0)
errors = [abs(a.double() - b).item() / b.item() for a, b in pairs if torch.isfinite(a)]
with open(os.path.join(os.environ["RUN_DIR"], f"norms{rank}.json"), "w") as f:
    json.dump({"n": len(pairs), "finite": len(errors), "max_rel_err": max(errors)}, f)
dist.destroy_process_group()
"""
)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)")
def test_ddp_bucket_norms_on_nccl_are_sync_free_and_catch_one_ranks_nan(tmp_path):
    """GuardedDDP on 2 GPUs: the step's grad norm comes from the reduced buckets (taken
    in the comm hook's callback, on the stream that waits for NCCL) for every step,
    with no host sync, equals a float64 norm of the gradients, and rank 1's NaN at step
    11 is skipped on both ranks."""
    run_dir = _run_nccl_worker(tmp_path, DDP_WORKER)
    events = read_events(run_dir)
    shared = sorted((e["rank"], e["steps"]) for e in events if e["kind"] == "grad_norm_shared")
    assert shared == [(0, 27), (1, 27)], shared
    skips = sorted((e["rank"], e["step"]) for e in events if e["kind"] == "nonfinite")
    assert skips == [(0, 11), (1, 11)], skips
    # The buckets' norm is the reduced gradients' (float32 partial sums, on CUDA by the
    # guard's kernel): within float32 rounding of a float64 norm, at every finite step.
    for rank in (0, 1):
        norms = json.loads((run_dir / f"norms{rank}.json").read_text())
        # 27 steps; the NaN one (rank 1's gradients, averaged into rank 0's) left out.
        assert (norms["n"], norms["finite"]) == ((27, 26) if rank == 0 else (26, 26)), norms
        assert norms["max_rel_err"] < 1e-5, norms


DDP_SAME_WORKER = (
    NCCL_WORKER_START
    + """
from torch.nn.parallel import DistributedDataParallel as DDP
def train(model, guarded):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    g = torch.Generator(device=device).manual_seed(rank)
    data = [(torch.randint(0, 65, (8, 64), device=device, generator=g),) * 2 for _ in range(12)]
    def steps(batches):
        for x, y in batches:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    if guarded:
        run_dir = os.environ["RUN_DIR"]
        with guardrails.guard(model, opt, data, run_dir=run_dir, progress=False) as gd:
            steps(gd)
    else:
        steps(data)
    return [p.detach().clone() for p in model.parameters()]
torch.manual_seed(0)
plain = train(DDP(GPT(65, 64, 2, 4, 128).to(device), device_ids=[device.index]), False)
torch.manual_seed(0)
ours = guardrails.GuardedDDP(GPT(65, 64, 2, 4, 128).to(device), device_ids=[device.index])
guarded = train(ours, True)
same = [torch.equal(a, b) for a, b in zip(plain, guarded, strict=True)]
with open(os.path.join(os.environ["RUN_DIR"], f"same{rank}.json"), "w") as f:
    json.dump({"same": same, "average": ours._guardrails_average}, f)
dist.destroy_process_group()
"""
)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)")
def test_guarded_ddp_on_nccl_averages_in_the_all_reduce_bitwise_as_plain_ddp(tmp_path):
    """GuardedDDP's hook averages with NCCL's AVG all-reduce (no division pass of its
    own over each bucket), and 12 guarded steps leave every parameter bitwise equal to
    plain DDP's on both ranks."""
    run_dir = _run_nccl_worker(tmp_path, DDP_SAME_WORKER)
    for rank in (0, 1):
        got = json.loads((run_dir / f"same{rank}.json").read_text())
        assert got["average"] is True, got
        assert len(got["same"]) > 10 and all(got["same"]), got


FSDP_WORKER = (
    NCCL_WORKER_START
    + """
from torch.distributed.fsdp import fully_shard
model = GPT(65, 64, 2, 4, 128).to(device)
for block in model.blocks:
    fully_shard(block)
fully_shard(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
g = torch.Generator(device=device).manual_seed(rank)
data = [(torch.randint(0, 65, (8, 64), device=device, generator=g),) * 2 for _ in range(10)]
run_dir = os.environ["RUN_DIR"]
ckpt = {"every_n_steps": 4, "keep_last": 5}
with guardrails.guard(model, opt, data, run_dir=run_dir, progress=False, checkpoint=ckpt) as gd:
    for x, y in gd:
        if gd.step == 8:  # what step 8's background save holds
            full = {k: v.full_tensor().cpu() for k, v in model.state_dict().items()}
            if rank == 0:
                torch.save(full, os.path.join(run_dir, "at8.pt"))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
# The staging memory a background save copies the shards into: host memory, pinned,
# every tensor (a copy on the GPU would be written out by the writer threads with a
# device-to-host copy per item, against training's kernel launches).
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.tensor import DTensor
from guardrails.checkpoint.sharded import _empty_pinned
def leaves(o):
    if isinstance(o, dict):
        return [x for v in o.values() for x in leaves(v)]
    return [x for v in o for x in leaves(v)] if isinstance(o, (list, tuple)) else [o]
msd, osd = get_state_dict(model, opt)
staged = leaves(_empty_pinned({"model": msd, "optim": osd}))
tensors = [t for t in staged if isinstance(t, torch.Tensor) and t.dim() > 0]
off_host = [
    (str(t.device), str(t._local_tensor.device) if isinstance(t, DTensor) else "")
    for t in tensors
    if t.device.type != "cpu"
    or not (t._local_tensor if isinstance(t, DTensor) else t).is_pinned()
]
with open(os.path.join(run_dir, f"staging{rank}.json"), "w") as f:
    json.dump({"tensors": len(tensors), "off_host": off_host}, f)
dist.destroy_process_group()
"""
)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)")
def test_fsdp2_background_saves_on_nccl_hold_the_weights_and_stock_dcp_reads_them(tmp_path):
    """FSDP2 on 2 GPUs over NCCL, periodic saves in the background (guardrails'
    ShardWriter: pinned staging, then DCP's format from the writer thread): step 8's
    checkpoint, converted by stock DCP to one torch.save file, holds exactly the
    weights the model had at step 8, and the optimizer's moments; the staging memory
    is pinned host memory (once, a second copy of every shard on the GPU)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    run_dir = _run_nccl_worker(tmp_path, FSDP_WORKER)
    saves = [e for e in read_events(run_dir) if e["kind"] == "checkpoint" and e["step"] == 8]
    assert len(saves) == 2 and all(e["background"] and e["sharded"] for e in saves), saves
    dcp_to_torch_save(run_dir / "checkpoints" / "step_000000008" / "dcp", tmp_path / "s8.pt")
    saved = torch.load(tmp_path / "s8.pt", weights_only=True)
    live = torch.load(run_dir / "at8.pt", weights_only=True)
    assert live and set(live) == set(saved["model"]), (sorted(live), sorted(saved["model"]))
    for k, v in live.items():
        assert torch.equal(saved["model"][k], v), k
    moments = [s["exp_avg"] for s in saved["optim"]["state"].values()]
    assert moments and all(m.abs().sum() > 0 for m in moments)
    for rank in (0, 1):  # the staging is host memory: no second copy on the GPU
        staging = json.loads((run_dir / f"staging{rank}.json").read_text())
        assert staging["tensors"] > 10 and staging["off_host"] == [], staging


def test_fp16_gradscaler_skips_are_skipped_rows_not_warnings(tmp_path):
    """fp16 autocast with a GradScaler and a non-fused optimizer on CUDA: the scaler's
    calibration at its initial scale skips real steps (the overflows are the model's
    own, not planted). Each is a skipped row and an info event of its own; nothing
    warns; the weights equal an unguarded run's."""

    def run(guarded: bool):
        device = torch.device("cuda")
        model = gpt(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # not fused: scaler skips
        scaler = torch.amp.GradScaler("cuda", init_scale=2.0**24)
        scales = []

        def train(batches):
            for x, y in batches:
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = model(x, y)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
                scales.append(scaler.get_scale())

        if not guarded:
            train(data(device, 30))
            return model, scales, None
        with guardrails.guard(
            model,
            opt,
            data(device, 30),
            run_dir=tmp_path,
            scaler=scaler,
            progress=False,
            # This loop reads the scale every step (scales.append below): a real host
            # sync, which the efficiency section rightly reports; not this test's point.
            efficiency={"host_syncs": False},
        ) as g:
            train(g)
        return model, scales, g

    plain, scales0, _ = run(False)
    model, scales, g = run(True)
    assert scales == scales0
    skipped_by_scaler = [i + 1 for i in range(1, 30) if scales[i] < scales[i - 1]]
    if scales[0] < 2.0**24:
        skipped_by_scaler.insert(0, 1)
    assert skipped_by_scaler, "no overflow at 2**24: raise init_scale"
    assert g.step == 30
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b)
    rows = guardrails.read_metrics(tmp_path).to_pylist()
    assert sorted(r["step"] for r in rows if r["skipped"]) == skipped_by_scaler
    events = read_events(tmp_path)
    assert [e["step"] for e in events if e["kind"] == "scaler_skip"] == skipped_by_scaler
    assert [e for e in events if e["level"] != "info" and e["kind"] != "nan_guard_syncs"] == []


def test_a_lagged_nonfinite_error_keeps_the_raising_steps_row_on_cuda(tmp_path):
    """Steps 13 on are non-finite; NanGuard (fused AdamW: no sync) learns it when a
    lagged copy comes back and raises from that step's after_step, before telemetry
    recorded it. Every step's row is on disk, that one's too, once, with its skipped
    flag and step time."""
    device = torch.device("cuda")
    model = gpt(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    batches = data(device, 4)
    with pytest.raises(guardrails.NonFiniteError) as info:
        with guardrails.guard(
            model,
            opt,
            batches * 10,
            run_dir=tmp_path,
            progress=False,
            nan={"max_consecutive_skips": 3},
        ) as g:
            for i, (x, y) in enumerate(g):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(x, y)
                loss.backward()
                if i + 1 >= 13:
                    next(model.parameters()).grad.mul_(float("nan"))
                opt.step()
                opt.zero_grad(set_to_none=True)
    assert info.value.step == 13
    last = g.step
    assert 15 <= last <= 13 + 2 * 10
    rows = guardrails.read_metrics(tmp_path).to_pydict()
    assert rows["step"] == list(range(1, last + 1))
    assert rows["skipped"] == [False] * 12 + [True] * (last - 12)
    assert all(t > 0 for t in rows["step_time_s"])
    assert all(v == v for v in rows["loss"])  # every device column read back


def test_a_cuda_error_at_the_end_keeps_the_rows_the_host_holds(tmp_path):
    """A device-side assert in step 24 (sticky: every later CUDA call fails) ends the
    run. The rows already read back (steps 1-15 at least) keep their values; the rest
    keep their host columns (step, time, lr...) with NaN device columns; a warning says
    so. Before, the failed read at close lost every row not yet in a part: here all."""
    import subprocess
    import textwrap

    script = textwrap.dedent(
        f"""
        import sys, torch
        sys.path[:0] = {[str(p) for p in Path(__file__).resolve().parents[:2]]!r}
        from test_gpu import gpt, data
        import guardrails
        device = torch.device("cuda")
        model = gpt(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        with guardrails.guard(model, opt, data(device, 4) * 10, run_dir={str(tmp_path)!r},
                              progress=False, metrics={{"every_n_steps": 5}}) as g:
            for x, y in g:
                loss = model(x, y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if g.step == 23:
                    bad = torch.tensor([10**6], device=device)
                    torch.zeros(2, device=device)[bad].sum().item()  # device-side assert
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode != 0
    assert "device-side assert" in proc.stderr or "CUDA error" in proc.stderr, proc.stderr[-3000:]
    assert "could not be read at the end" in proc.stderr, proc.stderr[-3000:]
    rows = guardrails.read_metrics(tmp_path).to_pydict()
    assert rows["step"] == list(range(1, 24)), proc.stderr[-3000:]
    assert all(v == v for v in rows["loss"][:15])
    assert all(t > 0 for t in rows["step_time_s"]) and rows["lr"] == [1e-3] * 23


PACE_WORKER = (
    NCCL_WORKER_START
    + """
import threading, time
model = torch.nn.parallel.DistributedDataParallel(
    GPT(65, 256, 4, 8, 512).to(device), device_ids=[device.index])
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
g = torch.Generator(device=device).manual_seed(rank)
data = [(torch.randint(0, 65, (16, 256), device=device, generator=g),) * 2 for _ in range(200)]
hog = threading.Event()
def side_kernels():  # rank 1's GPU also runs someone else's matmuls, on its own stream
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    s = torch.cuda.Stream(device=device)
    hog.wait()
    with torch.cuda.stream(s):
        while hog.is_set():
            for _ in range(8):
                a @ a
            s.synchronize()
if rank == 1:
    threading.Thread(target=side_kernels, daemon=True).start()
with guardrails.guard(model, opt, data, run_dir=os.environ["RUN_DIR"], progress=False,
                      pace={"window_steps": 30, "compare_every_s": 0.0}) as gd:
    for x, y in gd:
        if gd.step == 60 and rank == 1:
            hog.set()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    hog.clear()
    pace = next(c for c in gd.components if c.name == "pace")
    with open(os.path.join(os.environ["RUN_DIR"], f"pace{rank}.json"), "w") as f:
        json.dump({"windows": [w.to_json() for w in pace.windows],
                   "device_phases": gd.device_phases}, f)
dist.destroy_process_group()
"""
)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)")
def test_a_gpu_straggler_is_named_from_the_devices_own_phase_times(tmp_path):
    """Rank 1's GPU runs another stream's matmuls from step 60: its kernels slow down,
    rank 0 waits for its gradients in NCCL. The host's phases cannot show it (the host
    launches ahead); the sampled CUDA events can: rank 1 names itself, in a phase where
    no rank waits (forward or optimizer, not the backward's all-reduce)."""
    run_dir = _run_nccl_worker(tmp_path, PACE_WORKER)
    events = [e for e in read_events(run_dir) if e["kind"] in ("straggler", "slowdown")]
    stragglers = [e for e in events if e["kind"] == "straggler"]
    windows = {r: json.loads((run_dir / f"pace{r}.json").read_text())["windows"] for r in (0, 1)}
    assert [e["rank"] for e in stragglers] == [1], (events, windows)
    assert stragglers[0]["phase"] in ("forward", "optimizer"), (events, windows)
    assert stragglers[0]["since_step"] >= 60, (events, windows)
    for rank in (0, 1):
        pace = json.loads((run_dir / f"pace{rank}.json").read_text())
        assert pace["device_phases"] is not None
        assert all(w["device"] for w in pace["windows"][1:]), pace["windows"]


def test_the_live_view_shows_the_gpu_and_adds_no_sync(tmp_path):
    """What ``guardrails top`` shows of a running job on a GPU: the allocator's memory
    and NVML's utilisation, read by the watchdog's thread while the loop runs under
    CUDA's sync debug mode set to raise (a sync there, or in the loop, fails the run)."""
    import importlib.util
    import subprocess
    import time

    device = torch.device("cuda")
    model = gpt(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    batches = data(device, 4)
    loop(model, opt, batches * 2)  # warm-up
    seen: list[dict] = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        with guardrails.guard(model, opt, batches * 100_000, run_dir=tmp_path, progress=False) as g:
            end = time.monotonic() + 3.5  # the live record is written at most once a second
            asked = False
            for x, y in g:
                step(model, opt, x, y)
                if not asked and time.monotonic() > end - 1.0:
                    asked = True  # `top` from another process, the job still running
                    cmd = [sys.executable, "-m", "guardrails", "top", "--once", "--json"]
                    out = subprocess.run(
                        [*cmd, str(tmp_path)], capture_output=True, text=True, timeout=60
                    )
                    assert out.returncode == 0, out.stderr
                    seen.append(json.loads(out.stdout))
                if time.monotonic() > end:
                    break
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert g.step > 10
    [row] = seen[0]["ranks"]
    assert row["state"] == "running" and row["step"] > 0, row
    gpu = row["gpu"]
    assert gpu["memory_gb"] > 0 and gpu["reserved_gb"] >= gpu["memory_gb"], gpu
    assert gpu["total_gb"] > 10, gpu
    if importlib.util.find_spec("pynvml") is not None:  # torch reads utilisation through it
        assert 0.0 <= gpu["util"] <= 1.0, gpu
    print("LIVE_GPU_ROW", json.dumps(row))


def test_a_failure_saves_copy_does_not_wait_for_a_stuck_training_stream():
    """The watchdog's thread saves while the training stream is stuck (behind an
    all-reduce whose peer is gone: here a spin kernel of ~10 s): it picks one of its own
    streams whose hardware queue moves (a probe on each: a stream sharing the training
    stream's queue waits behind it), copies on it into plain memory and waits for that
    stream alone, so the weights reach the host while the training stream is still busy."""
    import threading

    from guardrails.checkpoint import stage

    w = torch.randn(1024, 1024, device="cuda")
    expected = w.cpu()
    side = stage.SideStreams(w.device)  # made ahead, as the failure save does
    assert stage.device_idle(side.training)
    torch.cuda._sleep(20_000_000_000)  # ~10 s of spinning on the default stream
    # What a failure save from a thread asks when it has no marks (several optimizers):
    # a busy device may hold an older step's weights, with updates queued.
    assert not stage.device_idle(side.training, within_s=0.2)
    got: dict[str, object] = {}

    def save() -> None:
        stream = side.pick()
        got["stream"], got["blocked"] = stream, side.blocked
        part = stage.Part(plain=True)
        with stage.own_stream(stream):
            part.add_tensors("model.safetensors", {"w": w}, copy=True)
            part.ready()
        got["part"] = part

    thread = threading.Thread(target=save)
    thread.start()
    thread.join(timeout=60)
    busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert busy, "the spin kernel ended before the copy: the test proves nothing"
    assert got["stream"] is not None and got["blocked"] < side.count, got
    print("COPY_STREAMS", side.count, "blocked", got["blocked"])
    [host] = got["part"].tensors["model.safetensors"][0].values()
    assert host.device.type == "cpu" and torch.equal(host, expected)


# DDP over NCCL, a GPU per rank, the example GPT with a scheduler. MODE=reference: a
# periodic save at step 5. MODE=fault: rank 1 stuck at the top of step 6; rank 0's GPU
# waits in step 6's all-reduce with the update queued behind it while its host goes on.
BEHIND_WORKER = (
    NCCL_WORKER_START
    + """
import time
model = torch.nn.parallel.DistributedDataParallel(GPT(65, 64, 2, 4, 128).to(device),
                                                  device_ids=[device.index])
fused = os.environ["FUSED"] == "1"
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused, foreach=not fused)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
gen = torch.Generator(device=device).manual_seed(rank)
data = [(torch.randint(0, 65, (8, 64), device=device, generator=gen),) * 2 for _ in range(12)]
fault = os.environ["MODE"] == "fault"
wedge = os.environ.get("WEDGE") == "1"
spare = torch.ones(16, device=device)
ckpt = {"failure_save_timeout_s": 60} if fault else {"every_n_steps": 5, "keep_last": 5}
with guardrails.guard(model, opt, data, scheduler=sched, run_dir=os.environ["RUN_DIR"],
                      progress=False, checkpoint=ckpt, watchdog={"hang_timeout_s": 5}) as g:
    for x, y in g:
        if fault and g.step == 5 and rank == 1:
            time.sleep(3600)
        if fault and wedge and g.step == 6 and rank == 0:
            # A deep model's step of launches behind the stuck all-reduce, and more: the
            # GPU's queues fill and the next push blocks (a 27-layer GPT's backward did).
            for _ in range(200_000):
                spare.mul_(1.0)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
dist.destroy_process_group()
"""
)


def _behind_run(tmp_path: Path, mode: str, fused: bool, *, wedge: bool = False) -> Path:
    from _ranks import torchrun

    script = tmp_path / "behind_worker.py"
    script.write_text(BEHIND_WORKER)
    run_dir = tmp_path / f"{mode}-{int(fused)}{'-wedge' if wedge else ''}"
    env = {
        "EXAMPLES": str(Path(__file__).resolve().parents[2] / "examples"),
        "RUN_DIR": str(run_dir),
        "MODE": mode,
        "FUSED": str(int(fused)),
        "WEDGE": str(int(wedge)),
    }
    res = torchrun([script], 2, out=run_dir / "out", timeout_s=240, env=env)
    assert res.code is not None and (res.code == 0) == (mode == "reference"), (
        res.code,
        res.err[-4000:],
    )
    return run_dir


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)")
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
def test_a_gpu_a_step_behind_its_stuck_host_saves_the_step_it_holds(tmp_path, fused):
    """Rank 1 stuck at the top of step 6: rank 0's GPU waits in step 6's all-reduce with
    the update queued behind it, and with a fused AdamW its host goes on past that
    update (no sync per step) until it stops in step 7. The watchdog's thread saves step
    5, the step the GPU holds, equal bitwise to a periodic save of step 5 of the same
    run (weights, optimizer state, the scheduler and hyperparameters as they were before
    the host's step-6 update, each rank's RNG streams and data position). A non-fused
    AdamW's step reads the host's flag (one sync a step): its host never gets ahead,
    and the save is the same step 5."""
    ref = _behind_run(tmp_path, "reference", fused) / "checkpoints" / "step_000000005"
    run = _behind_run(tmp_path, "fault", fused)
    saved = {e["rank"]: e for e in read_events(run) if e["kind"] == "failure_saved"}
    assert set(saved) == {0, 1}, saved
    assert saved[0]["step"] == 5 and saved[0]["complete"], saved[0]
    behind = "its GPU a step behind at step 5" in saved[0]["message"]
    assert behind == fused, saved[0]["message"]
    got = Path(saved[0]["path"])
    assert got.name == "step_000000005", got
    for name in sorted(p.name for p in ref.glob("*.safetensors")):
        want, have = _tensors(ref / name), _tensors(got / name)
        # A rank's file also holds the batches fetched past the step (the failure save's
        # data position): the state both hold is the same.
        common = want.keys() & have.keys()
        assert name.startswith("rank") or common == want.keys() == have.keys(), name
        assert {"torch.cpu", "torch.cuda.0"} <= common or not name.startswith("rank"), common
        for k in common:
            assert torch.equal(want[k], have[k]), (name, k)
    for name in ["optimizer.json", "scheduler.json"]:
        want, have = json.loads((ref / name).read_text()), json.loads((got / name).read_text())
        assert want == have, name
    assert json.loads((ref / "scheduler.json").read_text())["last_epoch"] == 5
    for r in (0, 1):
        want = json.loads((ref / f"rank{r:05d}.json").read_text())["data"]
        have = json.loads((got / f"rank{r:05d}.json").read_text())["data"]
        assert (want["epoch"], want["batch_in_epoch"]) == (have["epoch"], have["batch_in_epoch"])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)")
def test_a_wedged_gpu_stands_down_and_the_stuck_rank_commits_its_save(tmp_path):
    """As above, but rank 0's host queues so much behind the stuck all-reduce that its
    GPU takes no more work from any thread (every push blocks: a 27-layer GPT at 0.835B
    did this and its save never finished). Rank 0 stands down; rank 1, stuck with its
    GPU idle at the same step, commits: the replicated state from its own GPU, rank 0's
    part from rank 0's published copy. Whole, step 5, equal bitwise to a periodic save."""
    ref = _behind_run(tmp_path, "reference", True) / "checkpoints" / "step_000000005"
    run = _behind_run(tmp_path, "fault", True, wedge=True)
    saved = {e["rank"]: e for e in read_events(run) if e["kind"] == "failure_saved"}
    assert set(saved) == {0, 1}, saved
    assert saved[0]["copy_streams_blocked"] == 8, saved[0]
    for r in (0, 1):
        assert saved[r]["step"] == 5 and saved[r]["complete"], saved[r]
    got = Path(saved[1]["path"])
    failure = json.loads((got / "manifest.json").read_text())["failure"]
    assert failure["committed_by"] == 1 and failure["from_peers"] == [0], failure
    for name in sorted(p.name for p in ref.glob("*.safetensors")):
        want, have = _tensors(ref / name), _tensors(got / name)
        common = want.keys() & have.keys()
        assert name.startswith("rank") or common == want.keys() == have.keys(), name
        for k in common:
            assert torch.equal(want[k], have[k]), (name, k)
    for name in ["optimizer.json", "scheduler.json"]:
        want, have = json.loads((ref / name).read_text()), json.loads((got / name).read_text())
        assert want == have, name
