"""The documentation holds together: the README stays short, every relative link points at a file that
exists, install instructions work from a checkout (loragen is not installed from an index), and the
adapter guide's save/load snippet runs as written."""

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


def _python_snippets(page: Path) -> list[str]:
    """The ```python blocks of ``page``, in order."""
    return re.findall(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), flags=re.S)


def test_the_adapter_guides_save_load_snippet_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/adapters.md's first snippet, on models of its names: a plain model is converted by the load, a
    converted one loads into its layers, and peft's folder loads into another plain model."""
    import copy

    import peft
    import torch
    from torch import nn

    import loragen

    def plain() -> nn.Module:
        return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))

    torch.manual_seed(0)
    monkeypatch.chdir(tmp_path)
    config = loragen.LoraConfig(target_modules=["0", "2"], init_lora_weights=False)
    base = plain()
    model = loragen.get_lora_model(copy.deepcopy(base), config)
    peft.get_peft_model(plain(), peft.LoraConfig(target_modules=["0"], r=4)).save_pretrained("peft-adapter")
    names = {
        "loragen": loragen,
        "model": model,
        "base_model": copy.deepcopy(base),
        "other_base_model": plain(),
    }
    exec(_python_snippets(ROOT / "docs" / "adapters.md")[0], names)

    x = torch.randn(3, 8)
    assert names["restored"] is names["base_model"]  # converted in place
    torch.testing.assert_close(names["restored"](x), model(x))
    assert [n for n, p in names["tuned"].named_parameters() if p.requires_grad] == ["0.lora_A", "0.lora_B"]
