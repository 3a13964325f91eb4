"""scripts/first_gpu_run.sh on the CPU: it parses, its --help is its whole header, bad arguments are refused
before anything runs. (What it measures needs a GPU.)"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "first_gpu_run.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="the script is a bash script")


def _run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, check=False, cwd=cwd, timeout=60
    )


def test_the_script_parses():
    checked = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, check=False)
    assert checked.returncode == 0, checked.stderr


def test_help_prints_the_whole_header():
    """The header (every comment line after the shebang) documents the options and each output file; a
    header that grew past --help's line range would be cut off."""
    lines = SCRIPT.read_text().splitlines()[1:]
    header = lines[: next(i for i, line in enumerate(lines) if not line.startswith("#"))]
    shown = _run("--help")
    assert shown.returncode == 0
    assert shown.stdout.splitlines() == header
    assert header[-1].startswith("#   run.log")


def test_an_unknown_argument_or_another_folder_is_refused(tmp_path):
    refused = _run("--fast")
    assert refused.returncode == 2 and "unknown argument --fast" in refused.stderr
    elsewhere = _run("--steps", "system", "--out", str(tmp_path / "results"), cwd=tmp_path)
    assert elsewhere.returncode == 2 and "run it from loragen's repository root" in elsewhere.stderr
    assert not (tmp_path / "results").exists()  # nothing was written
