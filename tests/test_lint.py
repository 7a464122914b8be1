"""Repository hygiene that CI can only see through the test command: ruff (check and
format) and the README's quick start matching .ci/run."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_VENV_RUFF = Path(sys.executable).parent / "ruff"
RUFF = str(_VENV_RUFF) if _VENV_RUFF.exists() else shutil.which("ruff")


@pytest.mark.parametrize(
    "args", [["check", "."], ["format", "--check", "."]], ids=["check", "format"]
)
def test_ruff(args):
    if RUFF is None:
        pytest.skip("ruff is not installed (pip install -e '.[dev]')")
    proc = subprocess.run([RUFF, *args], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


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
