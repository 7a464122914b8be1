"""The public surface: names, the exception tree, logging hygiene, typing marker."""

from __future__ import annotations

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
