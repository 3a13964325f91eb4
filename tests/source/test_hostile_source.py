"""Source that could crash a parser (deep nesting, NUL characters, text that is not Unicode) gives
``file:line: message``: ``rewrite_source`` returns it, ``@lora_convert`` raises it, ``loragen rewrite``
prints it and exits 1; nothing crashes and nothing raises a traceback."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from loragen import LoraConfig, rewrite_source
from loragen.source.decorator import LoraConvertError, lora_convert
from loragen.source.scan import MAX_NESTING

MODEL = (
    "from torch import nn\n\nclass A(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
    "        self.q = nn.Linear(2, 2)\n"
)
CONFIG = LoraConfig(target_modules=["q"])
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_two_thousand_nested_parentheses_are_an_error_not_a_crash():
    # libcst's native parser overflows its stack on this (the process dies with SIGSEGV): run it apart
    script = (
        "from loragen import LoraConfig, rewrite_source\n"
        f"code = {MODEL!r} + 'X = ' + '(' * 2000 + '1' + ')' * 2000 + '\\n'\n"
        "print(rewrite_source(code, LoraConfig(target_modules=['q']), filename='m.py').errors[0])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "m.py:7: too many nested parentheses\n"


@pytest.mark.parametrize(
    "expression",
    [
        "[" * (MAX_NESTING + 1) + "1" + "]" * (MAX_NESTING + 1),  # Python itself accepts up to 200
        "f(" * (MAX_NESTING + 1) + "1" + ")" * (MAX_NESTING + 1),
        " + ".join(["1"] * 400),  # no brackets: each operator nests the tree one level
        "-" * 300 + "1",
    ],
    ids=["list", "call", "operators", "unary"],
)
def test_nesting_beyond_the_limit_is_refused_at_its_line(expression: str):
    code = MODEL + "\n\ndef helper():\n    return " + expression + "\n"
    result = rewrite_source(code, CONFIG, filename="m.py")
    assert not result.changed and result.code == code
    (error,) = result.errors
    assert error.line == 10 and error.message.startswith(f"nesting deeper than {MAX_NESTING} (brackets")


def test_nesting_at_the_limit_is_rewritten():
    depth = MAX_NESTING - 12  # the module, class, method and assignment take the other levels
    code = MODEL + "        self.z = " + "[" * depth + "1" + "]" * depth + "\n"
    result = rewrite_source(code, CONFIG, filename="m.py")
    assert result.ok and "self.q = LoraLinear(2, 2, r=8, lora_alpha=8)" in result.code


def test_nul_characters_and_lone_surrogates_are_errors_with_their_line():
    result = rewrite_source(MODEL.replace("(2, 2)", "(2, 2)\0"), CONFIG, filename="m.py")
    assert [str(e) for e in result.errors] == ["m.py:6: the source holds a NUL character (a binary file?)"]
    result = rewrite_source(MODEL + "x = '\ud800'\n", CONFIG, filename="m.py")
    (error,) = result.errors
    assert error.line == 7 and error.message.startswith("the source is not valid Unicode text")


def test_a_very_long_line_is_rewritten():
    code = MODEL + "S = '" + "a" * 1_000_000 + "'\n"
    result = rewrite_source(code, CONFIG, filename="m.py")
    assert result.ok and result.code.endswith("a" * 1_000_000 + "'\n")
    assert "self.q = LoraLinear(" in result.code


def test_lora_convert_on_a_class_of_a_deeply_nested_file_raises_a_loragen_error(tmp_path: Path):
    depth = MAX_NESTING + 20
    path = tmp_path / "deep_model.py"
    path.write_text(MODEL + "\n\nTABLE = " + "[" * depth + "1" + "]" * depth + "\n")
    spec = importlib.util.spec_from_file_location("deep_model", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["deep_model"] = module
    try:
        spec.loader.exec_module(module)
        with pytest.raises(LoraConvertError, match=rf"deep_model.py:9: nesting deeper than {MAX_NESTING}"):
            lora_convert(CONFIG)(module.A)
    finally:
        del sys.modules["deep_model"]


def test_cli_reports_undecodable_bytes_at_their_line(tmp_path: Path, capsys):
    from loragen.cli import main

    path = tmp_path / "latin.py"
    path.write_bytes(MODEL.encode() + b"# caf\xe9\n")
    assert main(["rewrite", str(path), "--target-modules", "q", "--in-place"]) == 1
    err = capsys.readouterr().err
    assert f"{path}:7: not UTF-8 text: byte 0xe9 at column 6 (invalid continuation byte)\n" in err
    assert path.read_bytes().endswith(b"caf\xe9\n")
