"""The step engine: loader kinds, step counting, loss pickup, hooks removed, misuse."""

from __future__ import annotations

import pytest
import torch
from conftest import Regressor, batches, guarded_run, read_events
from torch.utils.data import DataLoader, TensorDataset

import guardrails
from guardrails import Component, Guard


def train(g, model, opt):
    seen = []
    for batch in g:
        x, y = batch[0], batch[1]
        seen.append(batch)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    return seen


def make(depth=2, lr=0.1, **kw):
    torch.manual_seed(0)
    model = Regressor(depth=depth, **kw)
    return model, torch.optim.SGD(model.parameters(), lr=lr)


# ---------------------------------------------------------------------- loader kinds


def test_list_loader_yields_every_batch_and_counts_steps(tmp_path):
    model, opt = make()
    data = batches(5)
    with guardrails.guard(model, opt, data, run_dir=tmp_path) as g:
        seen = train(g, model, opt)
        assert g.step == 5
    assert all(a is b for a, b in zip(seen, data, strict=True))


def test_dataloader_is_reiterable_per_epoch(tmp_path):
    model, opt = make()
    ds = TensorDataset(torch.randn(24, 4), torch.randn(24))
    loader = DataLoader(ds, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(0))
    with guardrails.guard(model, opt, loader, run_dir=tmp_path) as g:
        for _epoch in range(3):
            train(g, model, opt)
        assert g.step == 9


def test_generator_with_state_like_nanochat(tmp_path):
    """nanochat's loader is a generator yielding (x, y, state); the guard passes the
    triple through untouched."""
    model, opt = make()

    def gen():
        for i, (x, y) in enumerate(batches(4)):
            yield x, y, {"pos": i}

    with guardrails.guard(model, opt, gen(), run_dir=tmp_path) as g:
        seen = train(g, model, opt)
    assert [s[2]["pos"] for s in seen] == [0, 1, 2, 3]
    assert g.step == 4


def test_guard_without_loader_still_observes_steps(tmp_path):
    model, opt = make()
    with guardrails.guard(model, opt, run_dir=tmp_path) as g:
        for x, y in batches(3):
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
        assert g.step == 3
        with pytest.raises(ValueError, match="no loader"):
            iter(g)


# ---------------------------------------------------------------------- steps and loss


def test_grad_accumulation_counts_optimizer_steps_and_averages_loss(tmp_path):
    model, opt = make()
    data = batches(12)
    micro_losses = []
    with guardrails.guard(model, opt, data, run_dir=tmp_path) as g:
        for i, (x, y) in enumerate(g):
            loss = model(x, y)
            micro_losses.append(loss.item())
            (loss / 4).backward()
            if (i + 1) % 4 == 0:
                opt.step()
                opt.zero_grad()
        assert g.step == 3
    rows = guardrails.read_metrics(tmp_path).to_pydict()
    assert rows["step"] == [1, 2, 3]
    expected = [sum(micro_losses[k : k + 4]) / 4 for k in (0, 4, 8)]
    assert rows["loss"] == pytest.approx(expected, rel=1e-6)


def test_observe_for_models_that_return_logits(tmp_path):
    model, opt = make(return_loss=False)
    data = batches(3)
    losses = []
    with guardrails.guard(model, opt, data, run_dir=tmp_path) as g:
        for x, y in g:
            loss = torch.nn.functional.l1_loss(model(x), y)
            g.observe(loss)
            losses.append(loss.item())
            loss.backward()
            opt.step()
            opt.zero_grad()
    assert guardrails.read_metrics(tmp_path).column("loss").to_pylist() == pytest.approx(losses)


def test_explicit_observe_wins_over_the_models_loss(tmp_path):
    model, opt = make()
    with guardrails.guard(model, opt, batches(2), run_dir=tmp_path) as g:
        for x, y in g:
            model(x, y).backward()
            g.observe(torch.tensor(42.0))
            opt.step()
            opt.zero_grad()
    assert guardrails.read_metrics(tmp_path).column("loss").to_pylist() == [42.0, 42.0]


def test_eval_forward_passes_are_not_training_losses(tmp_path):
    model, opt = make()
    with guardrails.guard(model, opt, batches(2), run_dir=tmp_path) as g:
        for x, y in g:
            loss = model(x, y)
            with torch.no_grad():
                model(x, y * 100)  # an eval pass between forward and step
            model.eval()
            model(x, y * 100)  # eval mode with grad enabled
            model.train()
            loss.backward()
            g_loss = loss.item()
            opt.step()
            opt.zero_grad()
    assert guardrails.read_metrics(tmp_path).column("loss").to_pylist()[-1] == pytest.approx(g_loss)


def test_no_loss_found_records_null_not_a_guess(tmp_path):
    model, opt = make(return_loss=False)
    with guardrails.guard(model, opt, batches(2), run_dir=tmp_path) as g:
        for x, y in g:
            # Not loss.backward(), which hands the guard the loss: nothing does here.
            torch.autograd.backward(torch.nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
    losses = guardrails.read_metrics(tmp_path).column("loss").to_pylist()
    assert len(losses) == 2 and all(v != v for v in losses)  # NaN: unknown


def test_clip_grad_norm_shares_the_norm(tmp_path):
    model, opt = make()
    norms = []
    with guardrails.guard(model, opt, batches(3), run_dir=tmp_path) as g:
        for x, y in g:
            model(x, y).backward()
            norms.append(g.clip_grad_norm_(0.01).item())
            opt.step()
            opt.zero_grad()
    # The recorded norm is the pre-clip norm clip_grad_norm_ returned, not the clipped one.
    assert guardrails.read_metrics(tmp_path).column("grad_norm").to_pylist() == pytest.approx(
        norms, rel=1e-6
    )
    assert min(norms) > 0.01


# ---------------------------------------------------------------------- components


class Recorder(Component):
    name = "recorder"

    def __init__(self, log):
        self.log = log

    def on_start(self, guard):
        self.log.append("start")

    def on_batch(self, guard, batch):
        self.log.append("batch")

    def before_step(self, guard):
        self.log.append(f"before{guard.step}")

    def after_step(self, guard):
        self.log.append(f"after{guard.step}")

    def on_end(self, guard, exc):
        self.log.append(f"end:{type(exc).__name__ if exc else None}")


def test_component_lifecycle_order(tmp_path):
    model, opt = make()
    log: list[str] = []
    with Guard(model, opt, batches(2), run_dir=tmp_path, components=[Recorder(log)]) as g:
        train(g, model, opt)
    assert log == ["start", "batch", "before0", "after1", "batch", "before1", "after2", "end:None"]


def test_components_end_in_reverse_order_and_see_the_exception(tmp_path):
    model, opt = make()
    a: list[str] = []
    b: list[str] = []
    order: list[str] = []

    class Tagged(Recorder):
        def __init__(self, log, tag):
            super().__init__(log)
            self.tag = self.name = tag  # two of one class: each its own name

        def on_end(self, guard, exc):
            order.append(self.tag)
            super().on_end(guard, exc)

    with pytest.raises(KeyError):
        with Guard(
            model, opt, batches(2), run_dir=tmp_path, components=[Tagged(a, "a"), Tagged(b, "b")]
        ):
            raise KeyError("boom")
    assert order == ["b", "a"]
    assert a[-1] == b[-1] == "end:KeyError"


def test_a_component_that_overrides_nothing_is_never_called(tmp_path):
    model, opt = make()

    class Inert(Component):
        pass

    g = Guard(model, opt, batches(1), run_dir=tmp_path, components=[Inert()])
    with g:
        assert all(not fns for fns in g._dispatch.values())


# ---------------------------------------------------------------------- leaving no trace


def hooks_installed(model, opt):
    """Hooks and patches the guard installs: the instance ``step`` and ``forward``
    wrappers (and no torch hooks: they would slow every call or could not skip)."""
    return (
        len(model._forward_hooks)
        + len(opt._optimizer_step_pre_hooks)
        + len(opt._optimizer_step_post_hooks)
        + ("forward" in model.__dict__)
        + ("step" in opt.__dict__)
    )


def test_hooks_removed_after_normal_exit(tmp_path):
    model, opt = make()
    with guardrails.guard(model, opt, batches(2), run_dir=tmp_path) as g:
        assert hooks_installed(model, opt) == 2
        train(g, model, opt)
    assert hooks_installed(model, opt) == 0
    model(*batches(1)[0]).backward()
    opt.step()  # no longer observed
    assert g.step == 2


def test_exception_propagates_unchanged_and_everything_is_cleaned_up(tmp_path):
    model, opt = make()
    boom = RuntimeError("user code failed")
    with pytest.raises(RuntimeError) as info:
        with guardrails.guard(
            model, opt, batches(10), run_dir=tmp_path, metrics={"every_n_steps": 4}
        ) as g:
            for i, (x, y) in enumerate(g):
                model(x, y).backward()
                opt.step()
                opt.zero_grad()
                if i == 5:
                    raise boom
    assert info.value is boom
    assert hooks_installed(model, opt) == 0
    # What was measured before the failure is on disk.
    assert guardrails.read_metrics(tmp_path).column("step").to_pylist() == [1, 2, 3, 4, 5, 6]
    events = read_events(tmp_path)
    assert events[-1]["kind"] == "end" and "user code failed" in events[-1]["error"]


def test_an_existing_instance_forward_is_restored_exactly(tmp_path):
    """A forward another tool set on the instance (torch.compile does) comes back."""
    model, opt = make()
    theirs = model.forward  # a bound method, stored on the instance
    model.forward = theirs
    with guardrails.guard(model, opt, batches(2), run_dir=tmp_path) as g:
        assert model.__dict__["forward"] is not theirs
        train(g, model, opt)
    assert model.__dict__["forward"] is theirs
    assert guardrails.read_metrics(tmp_path).column("loss").null_count == 0


def test_explicit_start_and_close(tmp_path):
    model, opt = make()
    g = guardrails.guard(model, opt, batches(3), run_dir=tmp_path)
    assert hooks_installed(model, opt) == 0  # building does not install anything
    g.start()
    train(g, model, opt)
    g.close()
    g.close()  # idempotent
    assert hooks_installed(model, opt) == 0
    assert g.step == 3


# ---------------------------------------------------------------------- misuse


def test_iterating_a_closed_guard(tmp_path):
    model, opt = make()
    with guardrails.guard(model, opt, batches(1), run_dir=tmp_path) as g:
        pass
    with pytest.raises(ValueError, match="closed.*new guard"):
        iter(g)


def test_iterating_before_start(tmp_path):
    model, opt = make()
    g = guardrails.guard(model, opt, batches(1), run_dir=tmp_path)
    with pytest.raises(ValueError, match="not started.*with guardrails.guard"):
        iter(g)


def test_starting_twice(tmp_path):
    model, opt = make()
    with guardrails.guard(model, opt, batches(1), run_dir=tmp_path) as g:
        with pytest.raises(ValueError, match="already started"):
            g.start()


def test_model_without_parameters():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(ValueError, match="no parameters"):
        guardrails.guard(torch.nn.ReLU(), opt)


def test_optimizer_for_another_model():
    model, _ = make()
    _other, opt = make()
    with pytest.raises(ValueError, match="owns none of the model's parameters"):
        guardrails.guard(model, opt)


def test_wrong_types():
    model, opt = make()
    with pytest.raises(TypeError, match="nn.Module"):
        guardrails.guard(lambda x: x, opt)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        guardrails.guard(model, "adam")
    with pytest.raises(TypeError, match="iterable of batches"):
        guardrails.guard(model, opt, 42)
    with pytest.raises(TypeError, match="Component"):
        guardrails.guard(model, opt, components=[object()])


def test_unknown_knob_suggests_the_right_one():
    model, opt = make()
    with pytest.raises(
        TypeError,
        match=r"unknown knob `metrcs`.*Did you mean `metrics`",
    ):
        guardrails.guard(model, opt, metrcs=True)


@pytest.mark.parametrize(
    "knobs, match",
    [
        ({"metrics": {"every_n_steps": 0}}, "every_n_steps must be a positive int"),
        ({"metrics": {"write_every_s": -1}}, "write_every_s must be >= 0"),
        ({"tokens_per_batch": 0}, "tokens_per_batch must be a positive int"),
    ],
)
def test_bad_knob_values(knobs, match):
    model, opt = make()
    with pytest.raises(ValueError, match=match):
        guardrails.guard(model, opt, **knobs)


def test_trainable_params_missing_from_optimizer_are_named(tmp_path):
    torch.manual_seed(0)
    model = Regressor(depth=2)
    opt = torch.optim.SGD(model.net[0].parameters(), lr=0.1)  # LoRA-style wiring bug
    with guardrails.guard(model, opt, run_dir=tmp_path):
        pass
    events = read_events(tmp_path)
    warn = [e for e in events if e["kind"] == "params_not_in_optimizer"]
    assert len(warn) == 1 and warn[0]["level"] == "warning"
    assert "net.2.weight" in warn[0]["params"] and "net.0.weight" not in warn[0]["params"]
    assert "never be updated" in warn[0]["message"]


def test_graph_grad_norm_is_a_real_no_op_off_cuda(tmp_path):
    """graph_grad_norm=True on a CPU model changes nothing: the same grad norms, bitwise,
    and no grad_norm_graph event (the graph path exists only on one CUDA device; its
    tests are in test_gpu.py)."""
    runs = {}
    for on in (False, True):
        guarded_run(tmp_path / str(on), n_steps=5, graph_grad_norm=on, progress=False)
        runs[on] = guardrails.read_metrics(tmp_path / str(on)).to_pydict()["grad_norm"]
        kinds = {e["kind"] for e in read_events(tmp_path / str(on))}
        assert "grad_norm_graph" not in kinds
    assert runs[True] == runs[False] and len(runs[True]) == 5
