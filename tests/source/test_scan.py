"""The libcst scanner: layer fields by qualified name, containers, conditionals, and what it reports."""

from __future__ import annotations

import textwrap
from pathlib import Path

import libcst as cst
import pytest

from loragen.source.scan import ScanError, scan_source

HEADER = """\
import torch
from torch import nn
import torch.nn as tnn
from torch.nn import Linear as L
"""


def scan(body: str, **kwargs):
    return scan_source(HEADER + textwrap.dedent(body), filename="model.py", **kwargs)


def paths(result, cls: str = "M") -> list[tuple[str, str]]:
    return [(f.path, f.layer.rpartition(".")[2]) for f in result.get(cls).fields]


def test_every_import_spelling_is_the_same_layer_and_a_user_linear_is_not():
    result = scan(
        """
        class Linear(nn.Module):  # a user class that happens to be called Linear
            pass

        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.a = nn.Linear(2, 3)
                self.b = torch.nn.Linear(2, 3)
                self.c = tnn.Linear(2, 3)
                self.d = L(2, 3)
                self.e = Linear()
                self.f = nn.modules.linear.Linear(2, 3)
        """
    )
    assert paths(result) == [
        ("a", "Linear"),
        ("b", "Linear"),
        ("c", "Linear"),
        ("d", "Linear"),
        ("f", "Linear"),
    ]
    assert [s.path for s in result.get("M").submodules] == ["e"]


def test_layer_types_and_locations():
    result = scan(
        """
        class M(nn.Module):
            def __init__(self):
                self.emb = nn.Embedding(10, 4)
                self.c1 = nn.Conv1d(4, 4, 3)
                self.c2 = nn.Conv2d(4, 4, 3)
                self.norm = nn.LayerNorm(4)
        """
    )
    fields = result.get("M").fields
    assert [(f.path, f.lora_name) for f in fields] == [
        ("emb", "LoraEmbedding"),
        ("c1", "LoraConv1d"),
        ("c2", "LoraConv2d"),
    ]
    assert [f.location.line for f in fields] == [8, 9, 10]
    assert str(fields[0].location) == "model.py:8"


def test_containers_comprehensions_and_nesting():
    result = scan(
        """
        from collections import OrderedDict

        class M(nn.Module):
            def __init__(self, n):
                self.layers = nn.ModuleList([nn.Linear(2, 2) for _ in range(n)])
                self.pair = nn.ModuleList([nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)])
                self.seq = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
                self.named = nn.Sequential(OrderedDict([("fc1", nn.Linear(2, 2)), ("act", nn.ReLU())]))
                self.heads = nn.ModuleDict({"a": nn.Linear(2, 2), "b": nn.Embedding(3, 2)})
                self.experts = nn.ModuleDict({k: nn.Linear(2, 2) for k in "xy"})
                self.deep = nn.ModuleList([nn.Sequential(nn.Linear(2, 2), nn.GELU()) for _ in range(n)])
                self.grown = nn.ModuleList()
                for _ in range(n):
                    self.grown.append(nn.Linear(2, 2))
                self.add_module("added", nn.Linear(2, 2))
        """
    )
    fields = result.get("M").fields
    assert [f.path for f in fields] == [
        "layers.{i}",
        "pair.0",
        "pair.2",
        "seq.0",
        "seq.2",
        "named.fc1",
        "heads.a",
        "heads.b",
        "experts.{key}",
        "deep.{i}.0",
        "grown.{i}",
        "added",
    ]
    assert fields[0].pattern == "layers.*"
    assert fields[0].container == "ModuleList" and fields[3].container == "Sequential"
    assert fields[-2].conditional  # appended in a loop body
    assert not result.unresolved


def test_conditional_branches_locals_and_tuples():
    result = scan(
        """
        class M(nn.Module):
            def __init__(self, cross, d):
                if cross:
                    self.attn = nn.Linear(2 * d, d)
                else:
                    self.attn = nn.Linear(3 * d, d)
                self.maybe = nn.Linear(d, d) if cross else nn.Identity()
                proj = nn.Linear(d, d)
                self.proj = proj
                self.a, self.b = nn.Linear(d, d), nn.Conv1d(d, d, 1)
                self.typed: nn.Module = nn.Embedding(3, d)
        """
    )
    fields = result.get("M").fields
    assert [(f.path, f.conditional) for f in fields] == [
        ("attn", True),
        ("attn", True),
        ("maybe", True),
        ("proj", False),
        ("a", False),
        ("b", False),
        ("typed", False),
    ]
    assert list(dict.fromkeys(f.attribute for f in result.get("M").fields)) == [
        "attn",
        "maybe",
        "proj",
        "a",
        "b",
        "typed",
    ]


def test_unresolvable_constructions_are_reported_with_file_and_line_not_guessed():
    result = scan(
        """
        def make_mlp(d):
            return nn.Sequential(nn.Linear(d, d), nn.ReLU())

        class M(nn.Module):
            def __init__(self, d, linear_cls):
                self.mlp = make_mlp(d)
                self.proj = linear_cls(d, d)
                self.dyn = getattr(nn, "Linear")(d, d)
                self.helper = self.build(d)
                setattr(self, f"layer{d}", nn.Linear(d, d))
                self.wrapped = Wrapper(nn.Linear(d, d))

            def build(self, d):
                return nn.Linear(d, d)
        """
    )
    assert result.get("M").fields == ()
    messages = [str(u) for u in result.unresolved]
    expected = [
        ("model.py:7:", "nn.Linear(...) in make_mlp()"),
        ("model.py:11:", "mlp is built by the helper make_mlp(...)"),
        ("model.py:12:", "proj is built by linear_cls(...), a parameter of __init__"),
        ("model.py:13:", "getattr"),
        ("model.py:14:", "helper is built by the helper self.build(...)"),
        ("model.py:15:", "attribute name computed at run time"),
        ("model.py:15:", "nn.Linear(...) in class M.__init__() is not assigned"),
        ("model.py:16:", "nn.Linear(...) in class M.__init__() is not assigned"),
        ("model.py:19:", "nn.Linear(...) in class M.build() is not assigned"),
    ]
    for prefix, text in expected:
        assert any(m.startswith(prefix) and text in m for m in messages), (prefix, text, messages)
    assert len(messages) == len(expected)


def test_local_class_aliases_are_followed_as_conditional_submodules():
    result = scan(
        """
        class SelfAttn(nn.Module):
            def __init__(self):
                self.q = nn.Linear(2, 2)

        class CrossAttn(SelfAttn):
            pass

        class Block(nn.Module):
            def __init__(self, cross):
                attention_class = CrossAttn if cross else SelfAttn
                self.attn = attention_class()

        class Model(nn.Module):
            def __init__(self):
                self.blocks = nn.ModuleList([Block(i % 2) for i in range(4)])
        """
    )
    assert [(s.path, s.local_class, s.conditional) for s in result.get("Block").submodules] == [
        ("attn", "CrossAttn", True),
        ("attn", "SelfAttn", True),
    ]
    assert result.contexts("SelfAttn") == [
        ("SelfAttn", ""),
        ("CrossAttn", ""),
        ("Block", "attn."),
        ("Model", "blocks.{i}.attn."),
    ]
    assert not result.unresolved


def test_relative_imports_resolve_with_the_package_only():
    code = (
        "from ...pytorch_utils import Conv1D\nfrom torch import nn\n\nclass A(nn.Module):\n"
        "    def __init__(self):\n        self.c = Conv1D(4, 2)\n"
    )
    inside = scan_source(
        code, module="transformers.models.gpt2.modeling_gpt2", package="transformers.models.gpt2"
    )
    assert [(f.path, f.layer, f.lora_name) for f in inside.get("A").fields] == [
        ("c", "transformers.pytorch_utils.Conv1D", "LoraConv1D")
    ]
    outside = scan_source(code, filename="copy.py")
    assert outside.get("A").fields == ()
    assert any("relative import" in u.reason and u.location.line == 6 for u in outside.unresolved)
    too_high = scan_source(code, module="pkg.mod", package="pkg")  # ... above a one-level package
    assert too_high.get("A").fields == ()


def test_star_imports_are_reported():
    result = scan_source(
        "from torch.nn import *\n\nclass A(Module):\n    def __init__(self):\n        self.x = Linear(1, 2)\n"
    )
    assert result.get("A").fields == ()
    assert [u.location.line for u in result.unresolved] == [5]
    assert "star import" in result.unresolved[0].reason


def test_loragen_layers_are_recognised_as_already_converted():
    result = scan_source(
        "from loragen import LoraLinear\nimport loragen\nfrom torch import nn\n\nclass A(nn.Module):\n"
        "    def __init__(self):\n        self.x = LoraLinear(1, 2, r=4)\n        self.y = loragen.LoraEmbedding(3, 2)\n"
    )
    assert [(f.path, f.layer, f.is_lora) for f in result.get("A").fields] == [
        ("x", "torch.nn.Linear", True),
        ("y", "torch.nn.Embedding", True),
    ]


def test_line_numbers_survive_stubbed_method_bodies():
    """Only __init__ bodies get libcst's metadata pass; positions elsewhere must still be exact."""
    result = scan(
        '''
        class M(nn.Module):
            def forward(self, x):
                """A long docstring.

                over several lines
                """
                y = x + 1
                return y

            def __init__(self):
                self.a = nn.Linear(2, 2)

            def later(self):
                # a comment
                z = nn.Linear(2, 2)
                return z
        '''
    )
    assert result.get("M").fields[0].location.line == 16
    assert [u.location.line for u in result.unresolved] == [20]


def test_syntax_errors_raise_with_file_and_line():
    with pytest.raises(ScanError, match=r"^bad\.py:3: ") as info:
        scan_source("import torch\n\ndef f(:\n    pass\n", filename="bad.py")
    assert info.value.line == 3


def test_transformers_modeling_files(hf_files: dict[str, Path]):
    """The scanner on transformers' own Llama, GPT-2 (Conv1D via a relative import) and T5 files."""
    llama = scan_source(
        hf_files["llama"].read_text(),
        filename="modeling_llama.py",
        module="transformers.models.llama.modeling_llama",
        package="transformers.models.llama",
    )
    assert [f.path for f in llama.get("LlamaAttention").fields] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert [f.path for f in llama.get("LlamaMLP").fields] == ["gate_proj", "up_proj", "down_proj"]
    assert ("LlamaForCausalLM", "model.layers.{i}.self_attn.") in llama.contexts("LlamaAttention")
    assert llama.unresolved == ()

    gpt2 = scan_source(
        hf_files["gpt2"].read_text(),
        filename="modeling_gpt2.py",
        module="transformers.models.gpt2.modeling_gpt2",
        package="transformers.models.gpt2",
    )
    attn = gpt2.get("GPT2Attention")
    assert [(f.path, f.conditional) for f in attn.fields] == [
        ("c_attn", True),
        ("q_attn", True),
        ("c_attn", True),
        ("c_proj", False),
    ]
    assert {f.lora_name for f in attn.fields} == {"LoraConv1D"}

    t5 = scan_source(
        hf_files["t5"].read_text(),
        filename="modeling_t5.py",
        module="transformers.models.t5.modeling_t5",
        package="transformers.models.t5",
    )
    assert [f.path for f in t5.get("T5Attention").fields][:4] == ["q", "k", "v", "o"]
    assert ("T5Block", "layer.{i}.SelfAttention.") in t5.contexts("T5Attention")


@pytest.fixture(scope="module")
def hf_files() -> dict[str, Path]:
    transformers = pytest.importorskip("transformers")
    root = Path(transformers.__file__).parent / "models"
    return {name: root / name / f"modeling_{name}.py" for name in ("llama", "gpt2", "t5")}


def test_classes_inside_functions_keep_exact_lines():
    result = scan(
        """
        def factory(d):
            x = 1

            class Inner(nn.Module):
                def __init__(self):
                    self.a = nn.Linear(d, d)

                def helper(self):
                    return nn.Linear(d, d)

            return Inner
        """
    )
    inner = result.get("factory.<locals>.Inner")
    assert [(f.path, f.location.line) for f in inner.fields] == [("a", 11)]
    assert [u.location.line for u in result.unresolved] == [14]


def test_layers_built_in_unread_bodies_are_reported_under_every_name_the_module_gives_them():
    # function bodies other than __init__ are skipped unless their source names a layer type: an alias
    # (L, lin.Linear), the module's own layer subclass and a relative import are names too
    result = scan_source(
        "from torch import nn\nfrom torch.nn import Linear as L\nimport torch.nn.modules.linear as lin\n"
        "from .layers import Conv1D as C\n\n"
        "class MyLinear(nn.Linear):\n    pass\n\n"
        "def a():\n    return L(1, 2)\n\n"
        "def b():\n    return lin.Linear(1, 2)\n\n"
        "def c():\n    return MyLinear(1, 2)\n\n"
        "def d():\n    return C(1, 2)\n\n"
        "def e():\n    return nn.functional.relu(1)\n",
        filename="model.py",
    )
    assert [(u.location.line, u.reason.split(" ")[0]) for u in result.unresolved] == [
        (10, "L(...)"),
        (13, "lin.Linear(...)"),
        (16, "MyLinear(...)"),
        (19, "C"),
    ]


def test_scan_positions_are_keyed_by_the_full_trees_own_nodes():
    # the rewriter edits calls by node identity: the metadata must describe the tree it edits, not a copy
    from loragen.source.scan import scan_module

    scanned = scan_module(HEADER + "class M(nn.Module):\n    def __init__(self):\n        self.q = L(1, 2)\n")
    (node,) = scanned.calls
    assert scanned.positions[node].start.line == 7
    found = []

    class Calls(cst.CSTVisitor):
        def visit_Call(self, call: cst.Call) -> None:
            found.append(call)

    scanned.tree.visit(Calls())
    assert any(call is node for call in found)
