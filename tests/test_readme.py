"""The README's test command is the one CI runs, and it runs every tier of the suite that tests/conftest.py
defines, each a marker registered in pyproject.toml. (The README's Python blocks run in
tests/test_snippets.py, as every page's do.)
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from tests.conftest import TIERS

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
SHELL_BLOCK = re.compile(r"^```bash\n(.*?)^```", re.DOTALL | re.MULTILINE)


def _blocks() -> list[str]:
    return BLOCK.findall(README.read_text(encoding="utf-8"))


def _test_command() -> str:
    """The README's one shell line that runs pytest."""
    lines = [
        line
        for block in SHELL_BLOCK.findall(README.read_text(encoding="utf-8"))
        for line in block.splitlines()
        if "pytest" in line
    ]
    assert len(lines) == 1, lines
    return lines[0]


def test_ci_runs_exactly_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert _test_command() in ci
    assert ci[0] == "#!/usr/bin/env bash" and "set -euo pipefail" in ci  # any failure fails the run


def test_the_test_command_runs_every_tier_on_two_workers() -> None:
    pytest_call = shlex.split(_test_command().split("&&")[-1])
    assert pytest_call[:3] == ["python", "-m", "pytest"]
    options = pytest_call[3:]
    assert options[options.index("-m") + 1] == ""  # lifts the default selection of the unit tier
    assert options[options.index("-n") + 1] == "2" and options[options.index("--dist") + 1] == "loadgroup"


def test_every_tier_is_a_registered_marker_the_readme_names(pytestconfig: pytest.Config) -> None:
    registered = {line.split(":")[0] for line in pytestconfig.getini("markers")}
    assert {"unit", *TIERS} <= registered
    text = README.read_text(encoding="utf-8")
    assert all(f"`{tier}`" in text for tier in TIERS)


def test_the_readme_has_python_blocks() -> None:
    assert len(_blocks()) >= 3
