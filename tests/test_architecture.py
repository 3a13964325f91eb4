"""The layout holds: imports point down the layer order (import-linter), no import cycles, no two modules
with one name, no module named like a stdlib module, and ruff (lint and format) and mypy pass. Modules are
split by concept, never by size: there is no line limit.

These run the project's own configuration (pyproject.toml), so what CI checks is what a developer runs:
``lint-imports``, ``ruff check .``, ``ruff format --check .`` and ``mypy``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "loragen"


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False, timeout=600)


def test_no_two_modules_share_a_name() -> None:
    # one name, one concern: `dora.py` in two packages leaves a reader guessing which one an import means
    by_name: dict[str, list[str]] = {}
    for p in _modules():
        if p.name != "__init__.py":
            by_name.setdefault(p.stem, []).append(str(p.relative_to(ROOT)))
    shared = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert not shared, f"module names used more than once (name each by its purpose): {shared}"


def test_no_module_is_named_like_a_stdlib_module() -> None:
    clashes = [str(p.relative_to(ROOT)) for p in _modules() if p.stem in sys.stdlib_module_names]
    assert not clashes, f"modules named like stdlib modules: {clashes}"


def test_imports_have_no_cycles() -> None:
    grimp = pytest.importorskip("grimp")
    graph = grimp.build_graph("loragen", include_external_packages=False)
    modules = sorted(graph.modules)
    edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in modules}
    # the package's own __init__ re-exports its public API from every layer: it is the top, not a layer
    edges.pop("loragen", None)
    cycles: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for target in edges.get(module, ()):
            if target == "loragen":
                continue
            if state.get(target) == 1:
                cycles.append([*stack[stack.index(target) :], target])
            elif target not in state:
                visit(target)
        stack.pop()
        state[module] = 2

    for module in edges:
        if module not in state:
            visit(module)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


@pytest.mark.skipif(shutil.which("lint-imports") is None, reason="import-linter is a dev dependency")
def test_imports_follow_the_layer_order() -> None:
    result = _run("lint-imports")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_passes() -> None:
    result = _run(sys.executable, "-m", "ruff", "check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format_is_clean() -> None:
    result = _run(sys.executable, "-m", "ruff", "format", "--check", ".")
    assert result.returncode == 0, "run `ruff format .`:\n" + result.stdout + result.stderr


def test_mypy_passes() -> None:
    result = _run(sys.executable, "-m", "mypy")
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr
