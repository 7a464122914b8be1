"""Misuses of the public API, as a table: each raises where it was passed (``guard()``,
``save_checkpoint()``, ``resume()``..., before anything runs or is written), and its
message names the parameter, what was given and what is expected."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import Regressor, batches

import guardrails


def _model_opt():
    model = Regressor()
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _guard(**kw):
    model, opt = _model_opt()
    return guardrails.guard(model, opt, batches(2), **{"progress": False, **kw})


def _save(tmp, step=1, **kw):
    model, opt = _model_opt()
    return guardrails.save_checkpoint(tmp / "c", step, **{"model": model, "optimizer": opt, **kw})


def _meta_model(tmp):
    with torch.device("meta"):
        model = Regressor()
    return guardrails.guard(model, torch.optim.SGD(model.parameters(), lr=0.1), batches(2))


# (id, call(tmp_path), error type, words every message must hold: the parameter's name
# first, then what was given / what is expected)
MISUSES = [
    ("resume=123", lambda t: _guard(resume=123), TypeError, ["resume", "int 123", "a path"]),
    ("resume=True", lambda t: _guard(resume=True), TypeError, ["resume", "bool True"]),
    (
        "scheduler='x'",
        lambda t: _guard(scheduler="x"),
        TypeError,
        ["`scheduler`", "str", "state_dict()"],
    ),
    ("scaler='x'", lambda t: _guard(scaler="x"), TypeError, ["scaler", "str 'x'", "GradScaler"]),
    (
        "generators=5",
        lambda t: _guard(generators=5),
        TypeError,
        ["`generators`", "int", "torch.Generator"],
    ),
    ("components=5", lambda t: _guard(components=5), TypeError, ["components", "int 5", "list"]),
    ("benchmark='x'", lambda t: _guard(benchmark="x"), TypeError, ["benchmark", "True or False"]),
    (
        "graph_grad_norm='x'",
        lambda t: _guard(graph_grad_norm="yes"),
        TypeError,
        ["graph_grad_norm", "str 'yes'"],
    ),
    ("progress='yes'", lambda t: _guard(progress="yes"), TypeError, ["progress", "str 'yes'"]),
    ("config=5", lambda t: _guard(config=5), TypeError, ["guard(config=...)", "got int"]),
    ("run_dir=''", lambda t: _guard(run_dir=""), ValueError, ["run_dir", "empty"]),
    ("run_dir=5", lambda t: _guard(run_dir=5), TypeError, ["run_dir", "int 5", "path"]),
    (
        "loader='abc'",
        lambda t: guardrails.guard(*_model_opt(), "abc"),
        TypeError,
        ["`loader`", "str"],
    ),
    ("meta model", _meta_model, ValueError, ["`model`", "meta device", "to_empty"]),
    # Knobs named as the user wrote them (the section and the knob), never internally.
    (
        "metrics every_n_steps=0",
        lambda t: _guard(metrics={"every_n_steps": 0}),
        ValueError,
        ["guard(metrics=...)", "every_n_steps", "got 0"],
    ),
    (
        "0.1's metrics_every_n_steps=0",
        lambda t: _guard(metrics_every_n_steps=0),
        TypeError,
        ["guard(metrics_every_n_steps=...)", "release 0.1's", 'guard(metrics={"every_n_steps"'],
    ),
    (
        "checkpoint every_n_steps=-1",
        lambda t: _guard(checkpoint={"every_n_steps": -1}),
        ValueError,
        ["guard(checkpoint=...)", "every_n_steps", "got -1"],
    ),
    (
        "keep_last=2.5",
        lambda t: _guard(checkpoint={"keep_last": 2.5}),
        ValueError,
        ["guard(checkpoint=...)", "keep_last", "got 2.5"],
    ),
    (
        "every_s=-1",
        lambda t: _guard(checkpoint={"every_s": -1}),
        ValueError,
        ["guard(checkpoint=...)", "every_s", "got -1"],
    ),
    (
        "directory=5",
        lambda t: _guard(checkpoint={"directory": 5}),
        TypeError,
        ["guard(checkpoint=...)", "directory", "int 5"],
    ),
    (
        "signals='SIGTERM'",
        lambda t: _guard(checkpoint={"signals": "SIGTERM"}),
        TypeError,
        ["signals", "str 'SIGTERM'", "list of signal names"],
    ),
    (
        "allow_config_change=5",
        lambda t: _guard(checkpoint={"allow_config_change": 5}),
        TypeError,
        ["allow_config_change", "got 5"],
    ),
    (
        "background='no'",
        lambda t: _guard(checkpoint={"background": "no"}),
        TypeError,
        ["guard(checkpoint=...)", "background", "str 'no'"],
    ),
    (
        "explain_oom='x'",
        lambda t: _guard(memory={"explain_oom": "x"}),
        TypeError,
        ["guard(memory=...)", "explain_oom", "str 'x'"],
    ),
    (
        "even_batches='x'",
        lambda t: _guard(preflight={"even_batches": "x"}),
        TypeError,
        ["guard(preflight=...)", "even_batches", "str 'x'"],
    ),
    (
        "NanGuard(policy='x')",
        lambda t: guardrails.NanGuard(policy="x"),
        ValueError,
        ["NanGuard()", "policy", "'x'"],
    ),
    # save_checkpoint(): checked before anything is written.
    ("save step='5'", lambda t: _save(t, "5"), TypeError, ["step", "str '5'", "int >= 0"]),
    ("save step=5.5", lambda t: _save(t, 5.5), TypeError, ["step", "float 5.5"]),
    ("save step=True", lambda t: _save(t, True), TypeError, ["step", "bool True"]),
    ("save step=-1", lambda t: _save(t, -1), ValueError, ["step", "-1"]),
    (
        "save keep_last=2.5",
        lambda t: _save(t, keep_last=2.5),
        ValueError,
        ["keep_last", "2.5", "positive int"],
    ),
    (
        "save scheduler='x'",
        lambda t: _save(t, scheduler="x"),
        TypeError,
        ["`scheduler`", "str", "state_dict()"],
    ),
    ("save extras=5", lambda t: _save(t, extras=5), TypeError, ["extras", "got int", "dict"]),
    (
        "save root=5",
        lambda t: guardrails.save_checkpoint(5, 1, model=Regressor(), optimizer=None),
        TypeError,
        ["root", "int 5", "path"],
    ),
    # guard(rewind=...): off unless given
    (
        "rewind snapshot_every_steps=0",
        lambda t: _guard(rewind={"snapshot_every_steps": 0}),
        ValueError,
        ["snapshot_every_steps", "positive int", "got 0"],
    ),
    (
        "rewind lr_scale=2",
        lambda t: _guard(rewind={"lr_scale": 2, "lr_warmup_steps": 10}),
        ValueError,
        ["lr_scale", "(0, 1]", "got 2"],
    ),
    (
        "rewind lr_scale without lr_warmup_steps",
        lambda t: _guard(rewind={"lr_scale": 0.1, "lr_warmup_steps": 0}),
        ValueError,
        ["lr_scale=0.1", "lr_warmup_steps", "is 0"],
    ),
    (
        "rewind skip_batches=-1",
        lambda t: _guard(rewind={"skip_batches": -1}),
        ValueError,
        ["skip_batches", "int >= 0", "got -1"],
    ),
    (
        "rewind max_rewinds=0",
        lambda t: _guard(rewind={"max_rewinds": 0}),
        ValueError,
        ["max_rewinds", "positive int", "got 0"],
    ),
    (
        "rewind='yes'",
        lambda t: _guard(rewind="yes"),
        TypeError,
        ["guard(rewind=...)", "True", "got str"],
    ),
    # resume(), read_metrics(), explain(), record()
    ("resume path=5", lambda t: guardrails.resume(5, Regressor()), TypeError, ["path", "int 5"]),
    ("resume model=5", lambda t: guardrails.resume(t, 5), TypeError, ["`model`", "got int"]),
    (
        "resume strict='x'",
        lambda t: guardrails.resume(t, Regressor(), strict="x"),
        TypeError,
        ["strict", "str 'x'"],
    ),
    ("read_metrics(5)", lambda t: guardrails.read_metrics(5), TypeError, ["run_dir", "int 5"]),
    ("explain(5)", lambda t: guardrails.explain(5), TypeError, ["explain()", "exception", "int 5"]),
    ("record(5)", lambda t: guardrails.record(5), TypeError, ["record", "main function", "int 5"]),
]


@pytest.mark.parametrize(
    ("call", "kind", "words"), [m[1:] for m in MISUSES], ids=[m[0] for m in MISUSES]
)
def test_a_misuse_raises_where_it_is_passed_naming_the_parameter(tmp_path, call, kind, words):
    with pytest.raises(kind) as info:
        call(tmp_path)
    assert type(info.value) is kind  # not a subclass from deep inside (a KeyError...)
    message = str(info.value)
    for word in words:
        assert word in message, (word, message)
    # Nothing was written for it: no checkpoint, no run_dir.
    assert not (tmp_path / "c").exists()


def test_the_old_internal_knob_names_are_gone_from_the_messages():
    for knobs, internal in [
        ({"every_n_steps": 0}, "checkpoint_every_n_steps"),
        ({"keep_last": 0}, "keep_last_checkpoints"),
        ({"every_s": 0}, "checkpoint_every_s"),
    ]:
        with pytest.raises(ValueError) as info:
            _guard(checkpoint=knobs)
        assert internal not in str(info.value)


def test_the_healthy_spellings_of_the_same_knobs_are_accepted(tmp_path):
    # The checks refuse only the misuse: every value above's right form builds a guard.
    model, opt = _model_opt()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    g = guardrails.guard(
        model,
        opt,
        batches(2),
        scheduler=sched,
        run_dir=tmp_path,
        resume=None,
        progress=False,
        benchmark=False,
        components=[],
        generators=[torch.Generator()],
        checkpoint={
            "every_n_steps": 2,
            "keep_last": 2,
            "signals": ["SIGTERM"],
            "background": False,
            "allow_config_change": ["lr"],
            "directory": tmp_path / "ck",
        },
        memory={"explain_oom": False},
        metrics={"every_n_steps": 1},
    )
    assert g.scheduler is sched
    ck = _save(tmp_path, np.int64(3), keep_last=1, extras={"a": 1})
    assert ck.name == "step_000000003"
