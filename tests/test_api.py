"""The public surface: names, the exception tree, logging hygiene, typing marker."""

from __future__ import annotations

import ast
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

import guardrails

EXPECTED_ALL = [
    "CheckpointError",
    "CollectiveAuditor",
    "CollectiveMismatchError",
    "Component",
    "ConfigMismatchError",
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
    "Preflight",
    "RankFailedError",
    "ResumeError",
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
        alias.name: node.module.rsplit(".", 1)[1]
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
    assert guardrails._checkpoint.verify_checkpoint  # private modules still read as attributes
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        guardrails.nope  # noqa: B018


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


def test_py_typed_marker_ships():
    assert (Path(guardrails.__file__).parent / "py.typed").is_file()


def test_version_has_one_source():
    # pyproject.toml reads it from guardrails/_version.py; the installed metadata agrees.
    from importlib.metadata import version

    assert version("torch-guardrails") == guardrails.__version__
