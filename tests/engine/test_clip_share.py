"""The loop's own ``torch.nn.utils.clip_grad_norm_`` supplies the step's grad norm: one
pass over the gradients instead of two, and only when it is provably the same number."""

from __future__ import annotations

import pytest
import torch
from conftest import CountNorms, Regressor, batches, read_events, reference_grad_norm
from torch.nn.utils import clip_grad
from torch.nn.utils import clip_grad_norm_ as imported_before_the_guard

import guardrails


def make(seed=0):
    torch.manual_seed(seed)
    model = Regressor(depth=3)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def run(tmp_path, clip, *, steps=4, micro=1, clip_at=-1, opt_params=None):
    """A guarded loop whose body clips with ``clip(model, opt)`` after the last backward;
    returns (the norms the clip returned, the gradients' norm before the last clip, the
    norm of the gradients the step applied, _foreach_norm calls)."""
    model, opt = make()
    if opt_params is not None:
        opt = torch.optim.AdamW(opt_params(model), lr=1e-2)
    returned, pre, applied = [], [], []
    counter = CountNorms()
    data = batches(steps * micro)
    with guardrails.guard(model, opt, data, run_dir=tmp_path) as g:
        it = iter(g)
        with counter:
            for _ in range(steps):
                for m in range(micro):
                    x, y = next(it)
                    (model(x, y) / micro).backward()
                    if m == micro - 1:
                        pre.append(reference_grad_norm(model))
                    if m == clip_at % micro:
                        out = clip(model, opt)
                        if out is not None:
                            returned.append(out.item())
                applied.append(reference_grad_norm(model))
                opt.step()
                opt.zero_grad()
    return returned, pre, applied, counter.calls


def by_attribute(model, opt):
    return torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)


def by_early_import(model, opt):
    return imported_before_the_guard(model.parameters(), 0.05)


def by_parts(model, opt):  # what torchtitan and others do by hand
    grads = [p.grad for p in model.parameters()]
    total = torch.nn.utils.get_total_norm(grads)
    torch.nn.utils.clip_grads_with_norm_(list(model.parameters()), 0.05, total)
    return total


def recorded(tmp_path):
    return guardrails.read_metrics(tmp_path).column("grad_norm").to_pylist()


def shared_steps(tmp_path):
    events = [e for e in read_events(tmp_path) if e["kind"] == "grad_norm_shared"]
    return events[0]["steps"] if events else 0


# reference_grad_norm costs one _foreach_norm-free pass (per-parameter norms) per step.


@pytest.mark.parametrize("clip", [by_attribute, by_early_import, by_parts])
def test_the_loops_clip_norm_is_the_steps_norm_and_gradients_are_read_once(tmp_path, clip):
    returned, pre, applied, calls = run(tmp_path, clip)
    # The pre-clip norm the loop got back is what the guard recorded, bit for bit (its
    # own norm, computed at optimizer.step(), would be the clipped gradients' 0.05).
    assert recorded(tmp_path) == returned
    assert returned == pytest.approx(pre, rel=1e-5)
    assert applied == pytest.approx([0.05] * 4, rel=1e-4)
    assert calls == 4  # one pass per step: the clip's; the guard computed none
    assert shared_steps(tmp_path) == 4


def test_parameters_in_another_order_than_the_optimizers_are_still_recognised(tmp_path):
    # nanoGPT: the optimizer's groups are (decayed, not decayed), not model order.
    def groups(model):
        ps = list(model.parameters())
        return [{"params": ps[1::2]}, {"params": ps[0::2], "weight_decay": 0.0}]

    returned, _, _, calls = run(tmp_path, by_attribute, opt_params=groups)
    assert recorded(tmp_path) == returned and calls == 4


def subset(model, opt):
    return torch.nn.utils.clip_grad_norm_(list(model.parameters())[:2], 0.05)


def max_norm(model, opt):
    return torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05, norm_type="inf")


@pytest.mark.parametrize("clip", [subset, max_norm])
def test_a_norm_over_other_parameters_or_of_another_order_is_not_taken(tmp_path, clip):
    returned, _, applied, calls = run(tmp_path, clip)
    assert recorded(tmp_path) == pytest.approx(applied, rel=1e-5)
    assert recorded(tmp_path) != pytest.approx(returned, rel=1e-3)
    assert calls == 8  # the clip's pass and the guard's own
    assert shared_steps(tmp_path) == 0


def test_a_clip_before_the_steps_last_forward_is_not_taken(tmp_path):
    """Clipping after the first micro-batch (then accumulating another) leaves a norm of
    gradients the step does not apply: the guard computes its own."""
    _, _, applied, calls = run(tmp_path, by_attribute, steps=3, micro=2, clip_at=0)
    assert recorded(tmp_path) == pytest.approx(applied, rel=1e-5)
    assert shared_steps(tmp_path) == 0 and calls == 3 + 3


def test_a_clip_after_the_step_is_not_the_next_steps_norm(tmp_path):
    model, opt = make()
    applied = []
    with guardrails.guard(model, opt, batches(4), run_dir=tmp_path) as g:
        for i, (x, y) in enumerate(g):
            model(x, y).backward()
            applied.append(reference_grad_norm(model))
            opt.step()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)  # late: not shared
            if i % 2:
                opt.zero_grad()
    assert recorded(tmp_path) == pytest.approx(applied, rel=1e-5)
    assert shared_steps(tmp_path) == 0


def test_a_nan_gradient_is_still_caught_with_a_shared_norm(tmp_path):
    model, opt = make()
    before = None
    with guardrails.guard(model, opt, batches(4), run_dir=tmp_path) as g:
        for i, (x, y) in enumerate(g):
            model(x, y).backward()
            if i == 2:
                next(model.parameters()).grad[0, 0] = float("nan")
                before = {k: v.clone() for k, v in model.state_dict().items()}
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            opt.step()
            if i == 2:
                after = model.state_dict()
                assert all(torch.equal(before[k], after[k]) for k in before)
            opt.zero_grad()
    rows = guardrails.read_metrics(tmp_path).to_pylist()
    assert [r["skipped"] for r in rows] == [False, False, True, False]
    assert shared_steps(tmp_path) == 4


def test_scaled_gradients_are_not_taken_until_unscaled(tmp_path):
    """A clip before ``scaler.unscale_`` measures gradients times the loss scale."""
    for unscale_first in (False, True):
        model, opt = make()
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        run_dir = tmp_path / str(unscale_first)
        with guardrails.guard(model, opt, batches(3), run_dir=run_dir, scaler=scaler) as g:
            for x, y in g:
                scaler.scale(model(x, y)).backward()
                if unscale_first:
                    scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
        assert shared_steps(run_dir) == (3 if unscale_first else 0)


def test_torchs_functions_are_put_back_exactly(tmp_path):
    names = ("_get_total_norm", "_clip_grads_with_norm_")
    before = [getattr(clip_grad, n) for n in names]
    public = (torch.nn.utils.get_total_norm, torch.nn.utils.clip_grads_with_norm_)
    model, opt = make()
    with pytest.raises(RuntimeError, match="boom"):
        with guardrails.guard(model, opt, batches(2), run_dir=tmp_path) as g:
            assert clip_grad._get_total_norm is not before[0]
            for x, y in g:
                model(x, y).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                raise RuntimeError("boom")
    assert [getattr(clip_grad, n) for n in names] == before
    assert (torch.nn.utils.get_total_norm, torch.nn.utils.clip_grads_with_norm_) == public
