"""The documentation holds together: the README stays short, every relative link points at a file that
exists, install instructions work from a checkout (loragen is not installed from an index), and every
``loragen.x.y`` the pages name exists. (The pages' Python snippets run in tests/test_snippets.py.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", ROOT / "BENCHMARKS.md", *(ROOT / "docs").glob("*.md")])
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


def test_the_readme_is_at_most_10_kb() -> None:
    assert (ROOT / "README.md").stat().st_size <= 10 * 1024


@pytest.mark.parametrize("page", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    broken = [
        target
        for target, _ in LINK.findall(page.read_text(encoding="utf-8"))
        if "://" not in target and not (page.parent / target).exists()
    ]
    assert not broken, f"{page.name}: links to missing files: {broken}"


def test_install_instructions_work_from_a_checkout() -> None:
    wrong = re.compile(r"pip install ['\"]?loragen\[")
    files = [*DOCS, *ROOT.joinpath("loragen").rglob("*.py")]
    offenders = [str(f.relative_to(ROOT)) for f in files if wrong.search(f.read_text(encoding="utf-8"))]
    assert not offenders, (
        f"`pip install loragen[...]` cannot work from a checkout; use pip install -e: {offenders}"
    )


def test_every_guide_the_readme_promises_exists() -> None:
    for guide in ("ways-in", "adapters", "layers", "qlora-and-moe", "training", "cli", "cuda", "extending"):
        assert (ROOT / "docs" / f"{guide}.md").is_file(), guide
    assert (ROOT / "docs" / "coming-from-peft.md").is_file()


def _resolves(dotted: str) -> bool:
    """Whether ``loragen.a.b.c`` names something: the longest importable module prefix, then attributes."""
    import importlib

    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            if not hasattr(target, attribute):
                return False
            target = getattr(target, attribute)
        return True
    return False


def test_every_loragen_name_the_docs_use_exists() -> None:
    """Every ``loragen.x.y`` in the docs resolves: no stale import paths (one import path per public name)."""
    mentioned = set()
    for page in DOCS:
        text = page.read_text(encoding="utf-8")
        mentioned |= set(re.findall(r"\bloragen(?:\.[A-Za-z_][A-Za-z0-9_]*)+", text))
    missing = sorted(name for name in mentioned if not _resolves(name))
    assert not missing, f"the docs name {missing}, which loragen does not have"
