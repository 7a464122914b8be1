"""The public surface: names, the exception tree, logging hygiene, typing marker."""

from __future__ import annotations

import ast
import os
import pickle
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _ranks import run_script
from conftest import read_events

import guardrails

ROOT = Path(__file__).resolve().parents[1]

EXPECTED_ALL = [
    "CheckpointError",
    "CollectiveAuditor",
    "CollectiveMismatchError",
    "Component",
    "ConfigMismatchError",
    "Efficiency",
    "ErrorExplainer",
    "GCScheduler",
    "Guard",
    "GuardedDDP",
    "GuardrailsError",
    "HangError",
    "LaunchError",
    "MLflowSink",
    "MemoryGuard",
    "NanGuard",
    "NonFiniteError",
    "OutOfMemoryError",
    "Pace",
    "Preflight",
    "RankFailedError",
    "ResumeError",
    "Rewind",
    "SignalCheckpointer",
    "Sink",
    "Telemetry",
    "TensorBoardSink",
    "UnevenDataError",
    "WandbSink",
    "Watchdog",
    "__version__",
    "explain",
    "guard",
    "iter_metrics",
    "read_metrics",
    "record",
    "resume",
    "save_checkpoint",
]

ERRORS = [
    "CheckpointError",
    "CollectiveMismatchError",
    "ConfigMismatchError",
    "HangError",
    "LaunchError",
    "NonFiniteError",
    "OutOfMemoryError",
    "RankFailedError",
    "ResumeError",
    "UnevenDataError",
]


def test_all_is_pinned_and_sorted():
    # Adding a public name is a decision: update this list on purpose.
    assert guardrails.__all__ == EXPECTED_ALL
    assert guardrails.__all__ == sorted(guardrails.__all__)
    for name in guardrails.__all__:
        assert hasattr(guardrails, name), name


@pytest.mark.slow(reason="fresh interpreters importing each public name: ~2.2 CPU-s")
def test_names_load_on_first_use_and_type_checkers_see_the_same_ones():
    """``import guardrails`` imports no torch (the CLI's report and inspect start
    without it); the first use of a name imports its module. The TYPE_CHECKING imports
    (what IDEs and type checkers read) name the same modules as the lazy table."""
    code = (
        "import sys, guardrails; print('torch' in sys.modules); guardrails.guard; "
        "print('torch' in sys.modules, 'guardrails._factory' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True", "True"], out.stdout + out.stderr
    assert guardrails.__all__ == sorted([*guardrails._EXPORTS, "__version__"])
    tree = ast.parse(Path(guardrails.__file__).read_text())
    typed = {
        alias.name: node.module.removeprefix("guardrails.")
        for block in tree.body
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for node in block.body
        if isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names
    }
    assert typed == guardrails._EXPORTS
    for name, module in guardrails._EXPORTS.items():
        assert getattr(guardrails, name).__module__ == f"guardrails.{module}", name
    assert set(guardrails.__all__) <= set(dir(guardrails))
    assert guardrails.checkpoint.read.verify_checkpoint  # private modules still read as attributes
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        guardrails.nope  # noqa: B018


EXPECTED_USER_SURFACE = [
    "clip_grad_norm_",
    "close",
    "component",
    "components",
    "epoch",
    "observe",
    "pause_watchdog",
    "phase",
    "run_dir",
    "save_checkpoint",
    "start",
    "state",
    "step",
    "stopping",
]


def test_the_user_surface_of_g_is_pinned_apart_from_the_services(tmp_path):
    """What a loop calls on ``g`` is one declared, documented set, like ``__all__``:
    every public name of a started guard is in exactly one of the user's surface and
    the components' services, ``dir(g)`` offers the user's, and docs/usage.md lists
    exactly them. A new public name on Guard fails here until it joins one set."""
    import torch
    from conftest import Regressor, batches

    from guardrails.engine.surface import SERVICES, USER_SURFACE

    # Adding a name to the user's surface is a decision: update this list on purpose.
    assert list(USER_SURFACE) == EXPECTED_USER_SURFACE
    assert list(SERVICES) == sorted(SERVICES)
    assert not set(USER_SURFACE) & set(SERVICES)
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guardrails.guard(model, opt, batches(2), run_dir=tmp_path, progress=False) as g:
        public = {name for name in object.__dir__(g) if not name.startswith("_")}
        unplaced = public - set(USER_SURFACE) - set(SERVICES)
        assert not unplaced, f"put each in engine/surface.py's USER_SURFACE or SERVICES: {unplaced}"
        assert set(USER_SURFACE) | set(SERVICES) <= public  # no stale entry
        assert [n for n in dir(g) if not n.startswith("_")] == EXPECTED_USER_SURFACE
        for name in SERVICES:
            getattr(g, name)  # still reachable: components call them
    text = (ROOT / "docs" / "usage.md").read_text()
    table = text.split("## What `g` offers your loop", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in table.splitlines() if line.startswith("| `g.")]
    documented = sorted(n for row in rows for n in re.findall(r"`g\.(\w+)", row))
    assert documented == EXPECTED_USER_SURFACE


@pytest.mark.parametrize("name", ERRORS)
def test_every_error_is_a_guardrails_error_with_fields(name):
    cls = getattr(guardrails, name)
    assert issubclass(cls, guardrails.GuardrailsError)
    err = cls("something broke", rank=3, step=17, hint="do the thing")
    assert (err.rank, err.step, err.hint) == (3, 17, "do the thing")
    text = str(err)
    assert "rank 3" in text and "step 17" in text and "something broke" in text
    assert "fix: do the thing" in text


def test_errors_pickle_with_their_fields():
    err = guardrails.NonFiniteError("loss is nan", rank=1, step=5, cause="bad_data")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is guardrails.NonFiniteError
    assert (back.rank, back.step, back.cause, str(back)) == (1, 5, "bad_data", str(err))
    err2 = guardrails.ConfigMismatchError("differ", fields={"lr": {0: 1e-3, 1: 1e-4}})
    assert pickle.loads(pickle.dumps(err2)).fields == {"lr": {0: 1e-3, 1: 1e-4}}


def test_import_adds_no_logging_handler():
    code = (
        "import logging, guardrails; "
        "lg = logging.getLogger('guardrails'); "
        "print(len(lg.handlers), len(logging.getLogger().handlers))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["0", "0"]


PARTS = textwrap.dedent(
    """
    import logging, math, sys, torch
    import guardrails
    from conftest import Regressor, batches, train_loop

    run_dir, quiet = sys.argv[1], sys.argv[2]
    if quiet != "none":
        logging.getLogger(quiet).setLevel(logging.ERROR)  # what a user does to quiet a part
    torch.manual_seed(0)
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = batches(6)
    data[2][0][0, 0] = math.nan  # a bad sample: NanGuard skips step 3 (guardrails.nan)
    # A save slower than 80% of grace_s warns about pre-emption (guardrails.checkpoint).
    ckpt = {"every_n_steps": 2, "grace_s": 1e-6}
    with guardrails.guard(model, opt, data, run_dir=run_dir, progress=False, checkpoint=ckpt) as g:
        train_loop(g, model, opt)
    named = [n for n in logging.Logger.manager.loggerDict if n.startswith("guardrails")]
    bad = [n for n in named if logging.getLogger(n).handlers or not logging.getLogger(n).propagate]
    print(sorted(named), bad)
    """
)


@pytest.mark.slow(reason="3 training processes")
def test_each_part_logs_to_its_own_logger_so_one_can_be_quieted(tmp_path):
    """A user quiets one part by its logger (``guardrails.nan``) and still sees another's
    warning (``guardrails.checkpoint``), and the other way round; the events file keeps
    both either way. No guardrails logger has a handler or stops propagating."""
    script = tmp_path / "parts.py"
    script.write_text(PARTS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    nan_says, ckpt_says = "nonfinite: non-finite", "checkpoint_slow: saving a checkpoint took"
    seen = {}
    for i, quiet in enumerate(("none", "guardrails.nan", "guardrails.checkpoint")):
        run_dir = tmp_path / f"run{i}"
        proc = run_script(
            [sys.executable, str(script), str(run_dir), quiet], timeout_s=120, env=env, cwd=ROOT
        )
        assert proc.returncode == 0, proc.stderr
        seen[quiet] = (nan_says in proc.stderr, ckpt_says in proc.stderr)
        kinds = {e["kind"] for e in read_events(run_dir)}
        assert {"nonfinite", "checkpoint_slow"} <= kinds  # the file keeps both
        named, bad = proc.stdout.strip().rsplit("] ", 1)
        assert bad == "[]", proc.stdout
        assert "'guardrails.nan'" in named and "'guardrails.checkpoint'" in named
    assert seen == {
        "none": (True, True),
        "guardrails.nan": (False, True),
        "guardrails.checkpoint": (True, False),
    }


def test_every_logger_is_a_documented_part_and_every_event_emitter_has_one():
    """Each module logs as ``guardrails.<part>``, a part listed in the package
    docstring (where users look it up); a module that emits events has a module-level
    logger, which is the one its events are logged to."""
    documented = set(re.findall(r"``(guardrails\.[a-z_]+)``", guardrails.__doc__ or ""))
    pkg = Path(guardrails.__file__).parent
    for path in sorted(pkg.glob("*.py")):
        text = path.read_text()
        names = re.findall(r"^(?:logger|log) = logging\.getLogger\(\"([^\"]+)\"\)", text, re.M)
        assert len(names) <= 1, path.name
        assert all(n in documented for n in names), (path.name, names)
        if re.search(r"\bguard\.event\(|self\._guard\.event\(|self\.event\(", text):
            assert names, f"{path.name} emits events but has no guardrails.<part> logger"
    assert 'logging.getLogger("guardrails")' not in "".join(p.read_text() for p in pkg.glob("*.py"))


def test_py_typed_marker_ships():
    assert (Path(guardrails.__file__).parent / "py.typed").is_file()


def test_version_has_one_source():
    # pyproject.toml reads it from guardrails/_version.py; the installed metadata agrees.
    from importlib.metadata import version

    assert version("torch-guardrails") == guardrails.__version__
