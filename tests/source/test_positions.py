"""``SourcePositions`` gives every node the range libcst's ``PositionProvider`` gives it, on the module's own
nodes (the scanner and the rewriter key their findings by node)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import libcst as cst
import libcst.metadata as md
import pytest
from hypothesis import given
from hypothesis import strategies as st

from loragen.source.scan import SourcePositions, skeleton

SNIPPETS = [
    "x = 1\n",
    "import torch\r\nfrom torch import nn\r\n\r\nclass A(nn.Module):\r\n    def __init__(self):\r\n"
    "        self.q = nn.Linear(\r\n            2, 2)\r\n",
    "class A:\n\t'''doc\n\tstring'''\n\tdef f(self, x=(1,\n\t\t2)):  # comment\n\t\treturn [y for y in x]\n",
    "@decorator(1)\n@other\nclass B(Base, metaclass=M):\n    a: int = 3; b = 4\n    if a: c = 5\n"
    "    else:\n        d = {'é': 'ü'}  # non-ASCII columns count characters\n",
    "def f(a, /, b, *, c):\n    with open(a) as h, open(b) as g:\n        pass\n    try:\n        x\n"
    "    except (E, F) as e:\n        raise\n    finally:\n        y = lambda q: q\n",
    "match x:\n    case [1, *rest] if rest:\n        pass\n    case {'k': v}:\n        pass\n",
    "a = b if c else d\nx = f'{a!r:>{w}}'\nasync def g():\n    await h()\n    async for i in j:\n        yield i\n",
]


def _check(tree: cst.Module) -> None:
    expected = md.MetadataWrapper(tree, unsafe_skip_copy=True).resolve(md.PositionProvider)
    found = SourcePositions(tree)
    assert len(found) == len(expected)
    assert {node: found[node] for node in expected} == dict(expected)


@pytest.mark.parametrize("code", SNIPPETS)
def test_positions_are_position_providers(code: str):
    tree = cst.parse_module(code)
    _check(tree)
    _check(skeleton(tree)[0])


def test_positions_on_a_transformers_modeling_file():
    spec = importlib.util.find_spec("transformers")  # the file only: importing it would import torch
    assert spec is not None and spec.origin is not None
    llama = Path(spec.origin).parent / "models" / "llama" / "modeling_llama.py"
    tree = cst.parse_module(llama.read_text(encoding="utf-8"))
    _check(tree)
    _check(skeleton(tree)[0])


@given(
    st.lists(
        st.sampled_from(["x = 1", "y = (1,\n  2)", "if a:\n    b = 2", "# c", "", "def f():\n    return 3"]),
        max_size=8,
    ),
    st.sampled_from(["\n", "\r\n"]),
)
def test_positions_of_generated_modules(lines: list[str], newline: str):
    code = newline.join(line.replace("\n", newline) for line in lines) + newline
    _check(cst.parse_module(code))
