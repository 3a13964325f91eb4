"""Source files Python reads are rewritten, whatever their form: a UTF-8 byte order mark, ``\\r\\n``, ``\\r``
or mixed line ends, indentation mixing tabs and spaces as Python allows. The output keeps the file's mark,
line ends and indentation; indentation Python refuses is reported at its line."""

from __future__ import annotations

import re
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from loragen import LoraConfig
from loragen.cli import main
from loragen.source.rewriter import rewrite_source

CONFIG = LoraConfig(target_modules=["q"])
LINES = [
    "import torch.nn as nn",
    "",
    "class M(nn.Module):",
    "    def __init__(self):",
    "        super().__init__()",
    "        self.q = nn.Linear(4, 4)",
]
REWRITTEN = "self.q = LoraLinear(4, 4, r=8, lora_alpha=8)"


def _rewrite(code: str) -> str:
    result = rewrite_source(code, CONFIG, filename="model.py")
    assert not result.errors, result.errors
    assert result.changed
    return result.code


def _python_accepts(code: str) -> bool:
    try:
        compile(code.removeprefix("\ufeff"), "model.py", "exec")
    except SyntaxError:
        return False
    return True


def test_cr_line_ends_are_rewritten_and_kept() -> None:
    plain = _rewrite("\n".join(LINES) + "\n")
    out = _rewrite("\r".join(LINES) + "\r")
    assert "\n" not in out
    assert out == plain.replace("\n", "\r")


def test_crlf_line_ends_are_kept() -> None:
    plain = _rewrite("\n".join(LINES) + "\n")
    assert _rewrite("\r\n".join(LINES) + "\r\n") == plain.replace("\n", "\r\n")


def test_mixed_line_ends_keep_each_kept_line_as_it_was() -> None:
    ends = ["\r\n", "\n", "\r", "\n", "\r\n", "\r"]
    code = "".join(line + end for line, end in zip(LINES, ends))
    out = _rewrite(code)
    for line, end in zip(LINES[:5], ends):
        assert line + end in out
    assert REWRITTEN + "\r" in out  # the changed line keeps its own end
    assert _python_accepts(out)
    assert rewrite_source(out, CONFIG, filename="model.py").code == out  # idempotent


def test_a_byte_order_mark_is_read_and_kept() -> None:
    code = "\n".join(LINES) + "\n"
    out = _rewrite("\ufeff" + code)
    assert out == "\ufeff" + _rewrite(code)


def test_the_cli_keeps_the_byte_order_mark_and_line_ends(tmp_path: Path) -> None:
    source = tmp_path / "model.py"
    source.write_bytes(b"\xef\xbb\xbf" + "\r".join(LINES).encode() + b"\r")
    assert main(["rewrite", str(source), "--in-place", "--target-modules", "q", "-q"]) == 0
    data = source.read_bytes()
    assert data.startswith(b"\xef\xbb\xbf")
    assert b"\n" not in data
    assert REWRITTEN.encode() in data
    compile(data, str(source), "exec")  # Python reads the file as written


def test_tabs_under_spaces_that_python_accepts_are_rewritten_keeping_the_indentation() -> None:
    lines = [
        "import torch.nn as nn",
        "class M(nn.Module):",
        "\tdef __init__(self):",  # column 8
        "        \tsuper().__init__()",  # column 16: Python accepts it; it does not start with the tab
        "        \tself.q = nn.Linear(4, 4)",
        "\tdef forward(self, x):",
        "\t\treturn self.q(x)",
    ]
    code = "\n".join(lines) + "\n"
    assert _python_accepts(code)
    out = _rewrite(code)
    for line in lines[:5] + lines[6:]:
        if "nn.Linear" not in line:
            assert line + "\n" in out
    assert "        \t" + REWRITTEN + "\n" in out
    assert "\tloragen_config = LORA_CONFIG" in out  # a new line in the class body is indented like its lines
    assert _python_accepts(out)
    assert rewrite_source(out, CONFIG, filename="model.py").code == out


def test_indentation_python_refuses_is_reported_at_its_line() -> None:
    code = "\n".join(LINES) + "\n    def f(self):\n\treturn 1\n"
    assert not _python_accepts(code)
    result = rewrite_source(code, CONFIG, filename="model.py")
    assert [(e.line, e.message) for e in result.errors] == [
        (8, "inconsistent use of tabs and spaces in indentation")
    ]
    assert result.code == code


INDENTS = [
    " ",
    "  ",
    "    ",
    "\t",
    " \t",
    "\t ",
    "    \t",
    "\t    ",
    "        ",
    "\t\t",
    "\t        ",
    "        \t",
]


@settings(deadline=None)
@given(
    indents=st.lists(st.sampled_from(INDENTS), min_size=3, max_size=3),
    comment=st.one_of(st.none(), st.tuples(st.integers(2, 5), st.sampled_from(["", *INDENTS]))),
    newline=st.sampled_from(["\n", "\r\n", "\r"]),
    bom=st.booleans(),
)
def test_every_indentation_python_accepts_is_rewritten_and_kept(indents, comment, newline, bom) -> None:
    lines = [
        "import torch.nn as nn",
        "class M(nn.Module):",
        indents[0] + "def __init__(self):",
        indents[1] + "super().__init__()",
        indents[1] + "self.q = nn.Linear(4, 4)",
        indents[2] + "# the end",
    ]
    if comment is not None:
        lines.insert(comment[0], comment[1] + "# a comment")
    code = ("\ufeff" if bom else "") + newline.join(lines) + newline
    result = rewrite_source(code, CONFIG, filename="model.py")
    if not _python_accepts(code):
        assert result.errors and result.errors[0].line > 1  # Python's own message, at the offending line
        return
    assert not result.errors, result.errors
    out = result.code
    assert out.startswith("\ufeff") == bom
    assert set(re.findall(r"\r\n?|\n", out)) == {newline}
    for line in lines:
        if "nn.Linear" not in line:
            assert line + newline in out, (line, out)
    assert _python_accepts(out)
    assert rewrite_source(out, CONFIG, filename="model.py").code == out
