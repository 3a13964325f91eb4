"""Every Python snippet of the README and docs/ runs as written, top to bottom, in a fresh interpreter.

A page's ```python blocks are written, in order, into one script that runs in a new interpreter in an
empty temporary folder (they write adapters and checkpoints into the current folder, and ``@lora_convert``
reads its class's source from the script file, as it would from a user's). Nothing is downloaded: the
snippets build tiny models from configs.

A block that cannot run here (it needs a GPU, or it is an excerpt of generated code) is marked in the
Markdown with ``<!-- snippet: skip REASON -->`` on the line before it; the reason may not be empty, and a
skipped block must still compile. Pages whose snippets import an optional package (bitsandbytes, peft) are
skipped where it is not installed.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.DOTALL | re.MULTILINE)
SKIP = re.compile(r"<!--\s*snippet:\s*skip\b(.*?)-->\s*$")
SKIPS_AT_MOST = 4  # a skipped snippet is a snippet nobody checks runs: keep them few

# after a page's snippets, what they promise (run in the same script)
CHECKS = {
    "docs/adapters.md": """
assert restored is base_model  # a plain model is converted in place
assert sorted(loragen.convert.find_lora_layers(restored)) == ["0", "2"]
assert [n for n, p in tuned.named_parameters() if p.requires_grad] == ["0.lora_A", "0.lora_B"]
assert sorted(p.name for p in Path("out").iterdir() if p.is_dir()) == ["french", "other"]
""",
    "docs/qlora-and-moe.md": """
import json

saved = json.loads(Path("moe-adapter/adapter_config.json").read_text())
assert sorted(saved["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"], saved  # as the page says
assert {"experts.gate_up_proj", "experts.down_proj"} <= set(saved["target_parameters"]), saved
""",
    "README.md": """
assert Path("my-adapter/adapter_model.safetensors").is_file()
assert Path("out/adapter/adapter_config.json").is_file()
assert Path("out/checkpoint-2/adapter_model.safetensors").is_file()
""",
}


@dataclass(frozen=True)
class Snippet:
    page: Path
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    skip_reason: str | None  # None: runs

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def snippets(page: Path) -> list[Snippet]:
    """The fenced code blocks of ``page``, in order, each with the skip marker on the line before it."""
    text = page.read_text(encoding="utf-8")
    found = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = SKIP.search(before)
        found.append(
            Snippet(
                page=page,
                line=text.count("\n", 0, match.start()) + 1,
                language=match.group(1),
                code=match.group(2),
                skip_reason=marker.group(1).strip() if marker else None,
            )
        )
    return found


def _python(page: Path) -> list[Snippet]:
    return [s for s in snippets(page) if s.language == "python"]


PYTHON_PAGES = [page for page in PAGES if _python(page)]


def _page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def test_every_marker_belongs_to_a_python_block_and_gives_a_reason() -> None:
    markers = 0
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        markers += len(re.findall(r"<!--\s*snippet:", text))
    marked = [s for page in PAGES for s in _python(page) if s.skip_reason is not None]
    assert markers == len(marked), "a <!-- snippet: ... --> marker that is not right before a ```python block"
    assert all(s.skip_reason for s in marked), [s.where for s in marked if not s.skip_reason]
    assert len(marked) <= SKIPS_AT_MOST, [s.where for s in marked]


@pytest.mark.parametrize("page", PYTHON_PAGES, ids=_page_id)
def test_every_python_snippet_compiles(page: Path) -> None:
    for snippet in _python(page):
        compile(snippet.code, snippet.where, "exec")  # a SyntaxError names the page and line


def _script(page: Path) -> str:
    """The page's runnable blocks, in order, as one script (each block headed by its page and line)."""
    parts = [f"# {s.where}\n{s.code}" for s in _python(page) if s.skip_reason is None]
    check = CHECKS.get(_page_id(page))
    if check:
        parts.append(f"# what the snippets promise\nfrom pathlib import Path\n{check}")
    return "\n".join(parts)


def _imported_packages(script: str) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(script)):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_the_checks_name_pages_that_exist() -> None:
    assert {_page_id(page) for page in PYTHON_PAGES} >= set(CHECKS)


@pytest.mark.slow
@pytest.mark.parametrize("page", PYTHON_PAGES, ids=_page_id)
def test_the_python_snippets_run_in_order(page: Path, tmp_path: Path) -> None:
    script = _script(page)
    for package in sorted(_imported_packages(script)):
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"{_page_id(page)} needs {package}, which is not installed")
    path = tmp_path / "snippets.py"
    path.write_text(script, encoding="utf-8")
    work = tmp_path / "work"
    work.mkdir()
    result = subprocess.run(
        [sys.executable, str(path)],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**_environment(), "PYTHONPATH": ""},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]


def _environment() -> dict[str, str]:
    # one thread each (the suite shares two cores), no network, no progress bars
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    return {
        **keep,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    }


# ---- shell snippets: every `loragen ...` command line the pages show is one loragen's parser accepts -----


def _loragen_command_lines() -> list[tuple[str, list[str]]]:
    """``(where, argv)`` for each ``loragen`` command in the pages' ```bash blocks (after ``&&`` too)."""
    import shlex

    found = []
    for page in PAGES:
        for snippet in snippets(page):
            if snippet.language != "bash":
                continue
            for offset, line in enumerate(snippet.code.splitlines(), start=1):
                for command in line.split("&&"):
                    tokens = shlex.split(command, comments=True)
                    if tokens[:1] == ["loragen"]:
                        found.append((f"{_page_id(page)}:{snippet.line + offset}", tokens[1:]))
    return found


def test_the_pages_show_loragen_commands() -> None:
    commands = {argv[0] for _, argv in _loragen_command_lines()}
    assert {"rewrite", "merge", "inspect", "bench", "demo"} <= commands


@pytest.mark.parametrize(
    ("where", "argv"), _loragen_command_lines(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_every_loragen_command_line_parses(
    where: str, argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    from loragen.cli import build_parser

    parser = build_parser([argv[0]])
    try:
        args, extras = parser.parse_known_args(argv)
    except SystemExit:
        pytest.fail(f"{where}: loragen {' '.join(argv)}: {capsys.readouterr().err.strip()}")
    assert not extras, f"{where}: loragen {' '.join(argv)}: unrecognized arguments {extras}"
    assert getattr(args, "func", None) is not None, f"{where}: loragen {' '.join(argv)} runs no command"
