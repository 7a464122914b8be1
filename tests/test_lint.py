"""Repository hygiene that CI can only see through the test command: ruff (check and
format) and the README's quick start matching .ci/run."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_VENV_RUFF = Path(sys.executable).parent / "ruff"
RUFF = str(_VENV_RUFF) if _VENV_RUFF.exists() else shutil.which("ruff")


def lint_targets(root: Path) -> list[str]:
    """What ruff checks under ``root``: the Python files git tracks there, so a scratch
    script or a notebook export a user keeps in the checkout does not fail the suite;
    ``["."]`` (everything, ruff's own excludes applied) where ``root`` is not a git
    checkout (an unpacked sdist) or git is missing."""
    git = shutil.which("git")
    if git is None:
        return ["."]
    proc = subprocess.run(
        [git, "ls-files", "-z", "--", "*.py", "*.pyi", "*.ipynb"],
        cwd=root,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:  # not a checkout (or git refuses it): check the tree
        return ["."]
    # Tracked but deleted in the working tree: nothing to check, and ruff would fail
    # on the missing path.
    return sorted(p for p in proc.stdout.split("\0") if p and (root / p).is_file())


def ruff(args: list[str], root: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """``ruff ARGS`` over :func:`lint_targets` (``--force-exclude``: ruff's configured
    excludes hold for files named on the command line too)."""
    assert RUFF is not None
    targets = lint_targets(root)
    if not targets:  # a checkout tracking no Python file: nothing to lint
        return subprocess.CompletedProcess([RUFF, *args], 0, "", "")
    return subprocess.run(
        [RUFF, *args, "--force-exclude", *targets], cwd=root, capture_output=True, text=True
    )


@pytest.mark.parametrize("args", [["check"], ["format", "--check"]], ids=["check", "format"])
def test_ruff(args):
    if RUFF is None:
        pytest.skip("ruff is not installed (pip install -e '.[dev]')")
    proc = ruff(args)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ruff_checks_tracked_files_only(tmp_path):
    """A file the user keeps untracked in the checkout fails neither check; outside a git
    checkout everything is checked, as before."""
    if RUFF is None:
        pytest.skip("ruff is not installed (pip install -e '.[dev]')")
    git = shutil.which("git")
    if git is None:
        pytest.skip("git is not installed")
    bad = "import os,sys\nx=1\n"  # an unused import, and unformatted
    (tmp_path / "tracked.py").write_text("x = 1\n")
    (tmp_path / "scratch.py").write_text(bad)
    # Outside a checkout: the scratch file is checked, and fails.
    assert lint_targets(tmp_path) == ["."]
    assert ruff(["check"], tmp_path).returncode != 0
    env = {"GIT_CONFIG_GLOBAL": "/dev/null", "GIT_CONFIG_NOSYSTEM": "1"}
    for cmd in (["init", "-q"], ["add", "tracked.py"]):
        subprocess.run([git, *cmd], cwd=tmp_path, check=True, env={**os.environ, **env})
    assert lint_targets(tmp_path) == ["tracked.py"]
    for args in (["check"], ["format", "--check"]):
        proc = ruff(args, tmp_path)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    (tmp_path / "tracked.py").unlink()  # deleted, not yet committed: nothing to check
    assert lint_targets(tmp_path) == []


def test_ci_runs_the_readme_test_command_verbatim():
    readme = (ROOT / "README.md").read_text()
    quick = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```bash\n(.+?)\n```", quick)
    assert len(commands) == 2, commands  # one runs the example, one runs the tests
    assert "examples/train_gpt.py" in commands[0] and "pytest" in commands[1]
    ci_lines = [
        ln
        for ln in (ROOT / ".ci" / "run").read_text().splitlines()
        if ln and not ln.startswith("#")
    ]
    assert commands[1] in ci_lines
