"""guard()'s sections and their typed keywords, the components' Config dataclasses,
0.1's removed knobs, and the protocol checks a guard makes when it is built."""

from __future__ import annotations

import dataclasses
import inspect
import typing
import warnings
from pathlib import Path

import pytest
import torch
from conftest import Regressor, batches, guarded_run

import guardrails
from guardrails._factory import SECTIONS
from guardrails.engine.config import REMOVED


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
    if field.name in ("resume", "directory", "local_directory"):
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
        if section == "audit":  # single process: not installed
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
            if field.name in ("directory", "local_directory"):
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
        "watchdog",  # a single process: its thread publishes the live view only
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
    # A section with nothing to do is left out, as before (saving on a failure is
    # something to do: on by default).
    assert "checkpoint" in _names(
        _guard(tmp_path, resume=None, checkpoint={"save_on_signal": False})
    )
    assert "checkpoint" not in _names(
        _guard(
            tmp_path,
            resume=None,
            checkpoint={"save_on_signal": False, "save_on_failure": False},
        )
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


@pytest.mark.parametrize("old", sorted(REMOVED["guard"]))
def test_a_0_1_knob_is_refused_with_its_new_spelling(tmp_path, old):
    """Release 0.1's flat knobs are gone (nothing real used them): each is a TypeError
    that says how to write it now, and the spelling it gives works."""
    where, field = REMOVED["guard"][old]
    with pytest.raises(
        TypeError, match=rf"guard\({old}=\.\.\.\) is release 0\.1's spelling"
    ) as err:
        _guard(tmp_path, **{old: 1})
    if field is None:
        assert f"guard({where}=True) or guard({where}=False)" in str(err.value)
        new = {where: False}
    else:
        assert f'guard({where}={{"{field}": ...}})' in str(err.value), str(err.value)
        knob = next(f for f in dataclasses.fields(SECTIONS[where].Config) if f.name == field)
        new = {where: {field: _other_value(knob)}}
    assert "Migrating from 0.1" in str(err.value)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _guard(tmp_path, **new)


def test_component_takes_its_config_or_knobs_and_renamed_knobs_say_the_new_name():
    a = guardrails.NanGuard(policy="raise", spike_factor=9)
    b = guardrails.NanGuard(guardrails.NanGuard.Config(policy="raise", spike_factor=9))
    assert a.config == b.config and a.spike_factor == 9.0
    with pytest.raises(TypeError, match="not both"):
        guardrails.NanGuard(guardrails.NanGuard.Config(), policy="raise")
    with pytest.raises(TypeError, match="takes a NanGuard.Config"):
        guardrails.NanGuard(guardrails.Telemetry.Config())
    with pytest.raises(TypeError, match=r"write Watchdog\(abort_after_s=\.\.\.\)"):
        guardrails.Watchdog(fail_grace_s=3)
    with pytest.raises(TypeError, match=r"write CollectiveAuditor\(abort_after_s=\.\.\.\)"):
        guardrails.CollectiveAuditor(grace_s=2)
    with pytest.raises(TypeError, match=r"write Preflight\(run_config=\.\.\.\)"):
        guardrails.Preflight(config={"x": 1})
    assert guardrails.Watchdog(abort_after_s=3).abort_after_s == 3.0


def test_guard_signature_names_every_section_with_its_typed_knobs():
    """Each section is a keyword of guard() typed with its knobs (what an editor
    completes: nan=, then the keys inside nan={...}), in SECTIONS' order, defaulting to
    its section_default; each TypedDict has exactly its Config's fields and types. A
    section added to SECTIONS alone fails here until its keyword and TypedDict exist."""
    params = inspect.signature(guardrails.guard, eval_str=True).parameters
    typed = [name for name, p in params.items() if name in SECTIONS]
    assert typed == list(SECTIONS), "guard()'s section keywords and SECTIONS disagree"
    for name, cls in SECTIONS.items():
        p = params[name]
        assert p.kind is inspect.Parameter.KEYWORD_ONLY
        assert p.default is getattr(cls, "section_default", True), name
        (knobs,) = [t for t in typing.get_args(p.annotation) if typing.is_typeddict(t)]
        assert set(typing.get_args(p.annotation)) == {bool, cls.Config, knobs, type(None)}
        fields = {f.name: f.type for f in dataclasses.fields(cls.Config)}
        declared = {k: v.__forward_arg__ for k, v in knobs.__annotations__.items()}
        assert declared == fields, f"{knobs.__name__} differs from {cls.__name__}.Config"
        assert not knobs.__required_keys__, name  # every knob has its default
        typing.get_type_hints(knobs)  # every type resolves
    assert list(params)[-1] == "more_sections"  # SECTIONS' entry without a keyword yet


def test_the_sections_page_has_each_section_once_with_its_default():
    """docs/sections.md (which sections are on, their cost, what they caught) has a row
    per section of SECTIONS, in order, whose "on by default" is the code's."""
    page = Path(__file__).resolve().parents[2] / "docs" / "sections.md"
    rows = [
        line.split("|")[1:3] for line in page.read_text().splitlines() if line.startswith("| `")
    ]
    assert [name.strip().strip("`") for name, _ in rows] == list(SECTIONS)
    for (name, on), cls in zip(rows, SECTIONS.values(), strict=True):
        if not getattr(cls, "section_default", True):
            want = "no"
        else:
            want = "distributed runs" if cls.distributed_only else "yes"
        assert on.strip() == want, name


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
