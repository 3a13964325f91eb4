"""The README's Python code runs as written: its ``python`` blocks, in order, in one namespace.

A user's first contact with loragen is the quick start; a block that raises (a renamed function, a missing
import, a variable never defined) fails here. The blocks are written, in order, into one script that runs
in a fresh interpreter in a temporary folder (they write adapters and Trainer checkpoints into the current
directory, and ``@lora_convert`` reads its class's source from the script file, as it would from a user's).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def _blocks() -> list[str]:
    return BLOCK.findall(README.read_text(encoding="utf-8"))


def test_the_readme_has_python_blocks() -> None:
    assert len(_blocks()) >= 3


@pytest.mark.slow
def test_the_readme_python_blocks_run_in_order(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    script = tmp_path / "readme_blocks.py"
    script.write_text(
        "\n".join(f"# README.md python block {n}\n{code}" for n, code in enumerate(_blocks(), start=1)),
        encoding="utf-8",
    )
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    assert (tmp_path / "my-adapter" / "adapter_model.safetensors").is_file()
    assert (tmp_path / "out" / "adapter" / "adapter_config.json").is_file()
    assert (tmp_path / "out" / "checkpoint-2" / "adapter_model.safetensors").is_file()
