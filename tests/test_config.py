"""guard()'s sections, the components' Config dataclasses, the alias table of 0.1's
knobs, and the protocol checks a guard makes when it is built."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from conftest import Regressor, batches, guarded_run

import guardrails
from guardrails._factory import SECTIONS
from guardrails.engine.config import ALIASES


def _guard(tmp_path, **knobs):
    torch.manual_seed(0)
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return guardrails.guard(model, opt, batches(4), run_dir=tmp_path, progress=False, **knobs)


def _names(g):
    return [c.name for c in g.components]


def _other_value(field):
    """A value for the knob that differs from its default and passes validation."""
    if field.name in ("policy",):
        return "raise"
    if field.name == "signals":
        return ("SIGTERM",)
    if field.name in ("resume", "directory"):
        return None if field.name == "resume" else "ckpts"
    if field.name in ("replay_fn",):
        return lambda model, batch: model(*batch)
    if field.name == "run_config":
        return {"lr": 0.1}
    if field.name == "generation":
        return 2
    if field.name == "progress":
        return False
    if field.name == "sinks":
        return (print,)  # a function of the rows
    if field.name in ("spike_factor", "loss_spike_factor"):
        return 8.0
    default = field.default
    if isinstance(default, bool):
        return not default
    if isinstance(default, int) or field.name.endswith("_steps"):
        return 7
    if field.name in ("data_starvation_fraction", "straggler_min_share", "comm_share", "lr_scale"):
        return 0.25
    return 3.0  # seconds


def test_every_component_knob_is_reachable_from_guard(tmp_path):
    """Each section's every knob, given as a dict, reaches the component (23 of them
    could not be set through guard() before sections)."""
    for section, cls in SECTIONS.items():
        if section in ("watchdog", "audit"):  # single process: not installed
            continue
        for field in dataclasses.fields(cls.Config):
            value = _other_value(field)
            g = _guard(tmp_path, **{section: {field.name: value}})
            comp = g.component(cls.name)
            if (section, field.name) == ("preflight", "check"):
                assert comp is None  # nothing left to do in one process: left out
                continue
            assert comp is not None, (section, field.name)
            got = getattr(comp.config, field.name)
            if field.name == "directory":
                assert str(got) == value
            else:
                assert got == value or callable(value), (section, field.name, got)
            assert getattr(comp, field.name) == got  # mirrored for the hooks


def test_a_section_takes_true_false_a_config_or_a_dict(tmp_path):
    full = _names(_guard(tmp_path))
    assert full == [
        "explain",
        "gc",
        "memory",
        "nan",
        "telemetry",
        "pace",
        "preflight",
        "checkpoint",
        "efficiency",
    ]
    assert "nan" not in _names(_guard(tmp_path, nan=False))
    assert "gc" not in _names(_guard(tmp_path, gc=None))
    g = _guard(tmp_path, nan=guardrails.NanGuard.Config(policy="raise"))
    assert g.component("nan").policy == "raise"
    g = _guard(tmp_path, nan={"max_consecutive_skips": 3})
    assert g.component("nan").max_consecutive_skips == 3
    with pytest.raises(TypeError, match=r"guard\(nan=\.\.\.\) takes True"):
        _guard(tmp_path, nan="raise")
    with pytest.raises(TypeError, match="Did you mean `every_n_steps`"):
        _guard(tmp_path, checkpoint={"evry_n_steps": 5})
    with pytest.raises(ValueError, match="policy must be one of"):
        _guard(tmp_path, nan={"policy": "explode"})
    # A section with nothing to do is left out, as before.
    assert "checkpoint" not in _names(
        _guard(tmp_path, resume=None, checkpoint={"save_on_signal": False})
    )
    assert "memory" not in _names(
        _guard(
            tmp_path,
            memory={
                "leak_check_every_n_steps": None,
                "data_starvation_window_steps": None,
                "explain_oom": False,
            },
        )
    )


def test_top_level_conveniences_set_their_sections_field_once(tmp_path):
    g = _guard(tmp_path, resume=None, config={"lr": 0.1})
    assert g.component("checkpoint").resume is None
    assert g.component("preflight").run_config == {"lr": 0.1}
    g = _guard(tmp_path, checkpoint={"resume": None})
    assert g.component("checkpoint").resume is None
    with pytest.raises(TypeError, match="given resume twice"):
        _guard(tmp_path, resume="a", checkpoint={"resume": "b"})


@pytest.mark.parametrize("old", sorted(ALIASES["guard"]))
def test_every_0_1_knob_still_works_with_a_deprecation_warning(tmp_path, old):
    where, field, how = ALIASES["guard"][old]
    if how == "switch":
        value, new = False, {where: False}
    else:
        knob = next(f for f in dataclasses.fields(SECTIONS[where].Config) if f.name == field)
        value = _other_value(knob)
        new = {where: {field: value}}
    with pytest.warns(DeprecationWarning, match=rf"guard\({old}=\.\.\.\) is deprecated") as rec:
        g_old = _guard(tmp_path, **{old: value})
    assert rec[0].filename == __file__  # points at the caller's line
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        g_new = _guard(tmp_path, **new)
    assert _names(g_old) == _names(g_new)
    for a, b in zip(g_old.components, g_new.components, strict=True):
        if a.config is not None and dataclasses.is_dataclass(a.config):
            assert a.config == b.config, (old, a.name)


def test_none_in_an_old_switch_knob_turns_the_section_off(tmp_path):
    with pytest.warns(DeprecationWarning):
        g = _guard(tmp_path, nan_policy=None, gc_every_n_steps=None)
    assert "nan" not in _names(g) and "gc" not in _names(g)
    with (
        pytest.warns(DeprecationWarning),
        pytest.raises(TypeError, match="turns that component off"),
    ):
        _guard(tmp_path, checkpoint=False, checkpoint_every_n_steps=5)


def test_component_takes_its_config_or_knobs_and_renamed_knobs_warn():
    a = guardrails.NanGuard(policy="raise", spike_factor=9)
    b = guardrails.NanGuard(guardrails.NanGuard.Config(policy="raise", spike_factor=9))
    assert a.config == b.config and a.spike_factor == 9.0
    with pytest.raises(TypeError, match="not both"):
        guardrails.NanGuard(guardrails.NanGuard.Config(), policy="raise")
    with pytest.raises(TypeError, match="takes a NanGuard.Config"):
        guardrails.NanGuard(guardrails.Telemetry.Config())
    with pytest.warns(DeprecationWarning, match="abort_after_s"):
        w = guardrails.Watchdog(fail_grace_s=3)
    assert w.abort_after_s == 3.0
    with pytest.warns(DeprecationWarning, match="abort_after_s"):
        a = guardrails.CollectiveAuditor(grace_s=2)
    assert a.abort_after_s == 2.0
    with pytest.warns(DeprecationWarning, match="run_config"):
        p = guardrails.Preflight(config={"x": 1})
    assert p.run_config == {"x": 1} and isinstance(p.config, guardrails.Preflight.Config)


class _Counter(guardrails.Component):
    name = "counter"

    def __init__(self):
        self.n = 0

    def after_step(self, guard):
        self.n += 1

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]


def test_duplicate_names_and_wrong_order_are_refused_when_built(tmp_path):
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="two components are named 'counter'"):
        guardrails.Guard(model, opt, run_dir=tmp_path, components=[_Counter(), _Counter()])

    class AfterCounter(guardrails.Component):
        name = "after_counter"
        after = ("counter",)

    with pytest.raises(
        ValueError, match=r"AfterCounter \('after_counter'\) must run after _Counter"
    ):
        guardrails.Guard(model, opt, run_dir=tmp_path, components=[AfterCounter(), _Counter()])
    guardrails.Guard(model, opt, run_dir=tmp_path, components=[_Counter(), AfterCounter()])
    # A constraint on a component that is not there is no constraint.
    guardrails.Guard(model, opt, run_dir=tmp_path, components=[AfterCounter()])


def test_a_custom_components_state_survives_a_resume_under_its_name(tmp_path):
    counter, saved = _Counter(), []
    # inside: a save asked of the component that declares it saves checkpoints.
    guarded_run(
        tmp_path,
        3,
        inside=lambda g: saved.append(g.save_checkpoint()),
        components=[counter],
        progress=False,
    )
    assert (saved[0] / "manifest.json").exists() and counter.n == 3
    again = _Counter()
    g = guarded_run(tmp_path, 0, components=[again], progress=False)
    assert g.step == 3 and again.n == 3  # restored under its name, "counter"


def test_save_checkpoint_without_a_saver_says_how(tmp_path):
    g = _guard(tmp_path, checkpoint=False)
    with g, pytest.raises(ValueError, match="checkpoint=False"):
        g.save_checkpoint()


def test_a_component_that_refuses_its_state_leaves_model_and_optimizer_as_they_were(tmp_path):
    """A custom component whose load_state_dict raises on its own well-formed saved
    state: a ResumeError naming it, raised before the model and RNG are restored
    (they stay bitwise what they were; before, the model was already loaded)."""
    guarded_run(tmp_path, 3, inside=lambda g: g.save_checkpoint(), components=[_Counter()])

    class Picky(_Counter):
        def load_state_dict(self, state):
            raise ValueError(f"cannot take n={state['n']}")

    torch.manual_seed(123)
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # the saved run's optimizer
    before = [t.clone() for t in model.state_dict().values()]
    rng = torch.get_rng_state()
    with pytest.raises(guardrails.ResumeError) as err:
        with guardrails.guard(model, opt, batches(2), run_dir=tmp_path, components=[Picky()]):
            pass
    msg = str(err.value)
    assert "component 'counter' (Picky)" in msg and "ValueError: cannot take n=3" in msg
    assert "nothing else was restored" in msg and "Picky.load_state_dict" in err.value.hint
    after = list(model.state_dict().values())
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert torch.equal(rng, torch.get_rng_state())
