"""Reading a forward's source (loragen.forward_calls): which ``self.<name>(<var>)`` calls share an input."""

from __future__ import annotations

import libcst
import pytest

from loragen.forward_calls import call_groups, groups_in_source


def test_llama_attention_and_mlp_sources_give_qkv_and_gate_up() -> None:
    from transformers.models.llama import modeling_llama

    attention = call_groups(modeling_llama.LlamaAttention.forward)
    mlp = call_groups(modeling_llama.LlamaMLP.forward)
    assert attention == (("q_proj", "k_proj", "v_proj"),)
    assert mlp == (("gate_proj", "up_proj"),)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("def f(self, x):\n    return self.a(x) + self.b(x) + self.c(x)\n", (("a", "b", "c"),)),
        # an assignment to x between two calls separates them
        ("def f(self, x):\n    y = self.a(x)\n    x = x + 1\n    return y + self.b(x)\n", ()),
        ("def f(self, x):\n    x = self.a(x)\n    return self.b(x)\n", ()),
        ("def f(self, x):\n    x += 1\n    y = self.a(x)\n    return y + self.b(x)\n", (("a", "b"),)),
        # calls in different branches never run together
        ("def f(self, x, c):\n    if c:\n        return self.a(x)\n    return self.b(x)\n", ()),
        # keyword arguments, expressions and nested attributes are not plain single-input calls
        ("def f(self, x):\n    return self.a(x=x) + self.b(x) + self.c(x + 1) + self.d.e(x)\n", ()),
        # other variables make other groups; a name called twice counts once
        (
            "def f(me, x, z):\n    return me.a(x) + me.b(z) + me.c(x) + me.d(z) + me.a(x)\n",
            (("a", "c"), ("b", "d")),
        ),
    ],
)
def test_call_groups_from_source(source: str, expected: tuple) -> None:
    assert groups_in_source(source) == expected


def test_unreadable_source_gives_no_groups() -> None:
    namespace: dict = {}
    exec(compile("def f(self, x):\n    return self.a(x) + self.b(x)\n", "<no file>", "exec"), namespace)
    assert call_groups(namespace["f"]) == ()


def test_an_indented_method_is_read_as_written_in_its_class() -> None:
    source = "    def f(self, x):\n        return self.a(x) + self.b(x)\n"
    assert groups_in_source(source) == (("a", "b"),)


def test_source_without_a_function_gives_no_groups() -> None:
    assert groups_in_source("x = self.a(y) + self.b(y)\n") == ()
    assert groups_in_source("") == ()


def test_invalid_source_raises_the_parser_error() -> None:
    with pytest.raises(libcst.ParserSyntaxError, match="Syntax Error"):
        groups_in_source("def f(self, x:\n")
