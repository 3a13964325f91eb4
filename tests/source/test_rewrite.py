"""``rewrite_source`` and ``loragen rewrite``: before/after pairs, config semantics, errors, the CLI,
idempotence and locality (hypothesis), golden files, and equality with the runtime path."""

from __future__ import annotations

import argparse
import ast
import difflib
import importlib.util
import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import loragen
from loragen import LoraConfig, rewrite_source
from loragen.cli import rewrite as rewrite_command
from loragen.source.rewrite import module_name_for_path

ROOT = Path(__file__).resolve().parents[2]


def rewrite(code: str, **config) -> str:
    result = rewrite_source(textwrap.dedent(code), LoraConfig(**config), filename="m.py")
    assert result.ok, [str(e) for e in result.errors]
    return result.code


# ---- before / after ---------------------------------------------------------------------------------

PAIRS = [
    pytest.param(
        """\
        from torch import nn

        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.q = nn.Linear(4, 8, bias=False)  # keep this comment
                self.k = nn.Linear(4, 8)
        """,
        """\
        from torch import nn
        from loragen import LoraLinear

        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.q = LoraLinear(4, 8, bias=False, r=8, lora_alpha=16)  # keep this comment
                self.k = nn.Linear(4, 8)
        """,
        {"r": 8, "lora_alpha": 16, "target_modules": ["q"]},
        id="callee-and-keywords-only",
    ),
    pytest.param(
        """\
        import torch
        from torch.nn import Linear as L, Embedding

        class M(torch.nn.Module):
            def __init__(self, d):
                super().__init__()
                self.a = torch.nn.Linear(
                    d,
                    d,
                )
                self.b = L(
                    d, d
                )
                self.emb = Embedding(10, d, padding_idx=0)
        """,
        """\
        import torch
        from torch.nn import Linear as L, Embedding
        from loragen import LoraEmbedding, LoraLinear

        class M(torch.nn.Module):
            def __init__(self, d):
                super().__init__()
                self.a = LoraLinear(
                    d,
                    d,
                    r=4,
                    lora_alpha=8,
                    lora_dropout=0.1,
                )
                self.b = LoraLinear(
                    d, d, r=4, lora_alpha=8, lora_dropout=0.1
                )
                self.emb = LoraEmbedding(10, d, padding_idx=0, r=4, lora_alpha=8, lora_dropout=0.1)
        """,
        {"r": 4, "lora_alpha": 8, "lora_dropout": 0.1, "target_modules": ["a", "b", "emb"]},
        id="multiline-formatting-kept",
    ),
    pytest.param(
        """\
        '''Docstring.'''
        from torch import nn

        class Linear(nn.Module):
            pass

        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.proj = Linear()
                self.convs = nn.ModuleList([nn.Conv2d(3, 3, 3) for _ in range(2)])
        """,
        """\
        '''Docstring.'''
        from torch import nn
        from loragen import LoraConv2d

        class Linear(nn.Module):
            pass

        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.proj = Linear()
                self.convs = nn.ModuleList([LoraConv2d(3, 3, 3, r=8, lora_alpha=8) for _ in range(2)])
        """,
        {"target_modules": r".*(proj|convs\.\d+)"},
        id="user-linear-untouched-comprehension-rewritten",
    ),
    pytest.param(
        """\
        from loragen import LoraLinear
        from torch import nn

        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.q = LoraLinear(4, 4, r=8, lora_alpha=8, lora_dropout=0.1)
        """,
        """\
        from loragen import LoraLinear
        from torch import nn

        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.q = LoraLinear(4, 4, r=16, lora_alpha=32, lora_dropout=0)
        """,
        {"r": 16, "lora_alpha": 32, "target_modules": ["q"]},
        id="already-rewritten-keywords-updated",
    ),
]


@pytest.mark.parametrize(("before", "after", "config"), PAIRS)
def test_before_after(before: str, after: str, config: dict):
    assert rewrite(before, **config) == textwrap.dedent(after)
    assert rewrite(after, **config) == textwrap.dedent(after)  # idempotent


def test_windows_line_endings_and_tabs_are_kept():
    code = "from torch import nn\r\n\r\nclass M(nn.Module):\r\n\tdef __init__(self):\r\n\t\tself.q = nn.Linear(1, 2)\r\n"
    out = rewrite_source(code, LoraConfig(target_modules=["q"])).code
    assert out == code.replace(
        "from torch import nn\r\n", "from torch import nn\r\nfrom loragen import LoraLinear\r\n"
    ).replace("nn.Linear(1, 2)", "LoraLinear(1, 2, r=8, lora_alpha=8)")


# ---- config semantics ----------------------------------------------------------------------------------

NESTED = """\
from torch import nn

class Attention(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.q_proj = nn.Linear(d, d)
        self.v_proj = nn.Linear(d, d)

class Layer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.self_attn = Attention(d)
        self.fc = nn.Linear(d, d)

class Model(nn.Module):
    def __init__(self, d, n):
        super().__init__()
        self.layers = nn.ModuleList([Layer(d) for _ in range(n)])
        self.lm_head = nn.Linear(d, 10)
"""


def rewritten_names(code: str, **config) -> list[str]:
    result = rewrite_source(code, LoraConfig(**config), filename="nested.py")
    assert result.ok, [str(e) for e in result.errors]
    return [f"{c.field.owner}.{c.field.path}:{c.r}" for c in result.rewritten]


def test_regex_targets_match_full_paths_through_the_files_containment():
    assert rewritten_names(NESTED, target_modules=r"layers\.\d+\.self_attn\.q_proj") == ["Attention.q_proj:8"]
    assert rewritten_names(NESTED, target_modules=r".*\.(fc|v_proj)") == ["Attention.v_proj:8", "Layer.fc:8"]


def test_list_targets_exclusions_and_rank_pattern():
    assert rewritten_names(NESTED, target_modules=["q_proj", "lm_head"], exclude_modules=["lm_head"]) == [
        "Attention.q_proj:8"
    ]
    assert rewritten_names(NESTED, target_modules=["self_attn.v_proj", "fc"], rank_pattern={"fc": 2}) == [
        "Attention.v_proj:8",
        "Layer.fc:2",
    ]


def test_all_linear_leaves_out_the_output_head_as_the_runtime_does():
    # a plain nn.Module has no output head: the runtime converts lm_head too, and so does the rewrite
    assert "Model.lm_head:8" in rewritten_names(NESTED, target_modules="all-linear")
    hf = (
        "from torch import nn\nfrom transformers import PreTrainedModel\n\n"
        "class Net(PreTrainedModel):\n    def __init__(self, config):\n        super().__init__(config)\n"
        "        self.fc = nn.Linear(2, 2)\n        self.lm_head = nn.Linear(2, 2)\n\n"
        "class Tagger(PreTrainedModel):\n    def __init__(self, config):\n        super().__init__(config)\n"
        "        self.fc = nn.Linear(2, 2)\n        self.cls = Head()\n\n    def get_output_embeddings(self):\n"
        "        return self.cls.decoder\n\nclass Head(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.decoder = nn.Linear(2, 2)\n"
    )
    assert rewritten_names(hf, target_modules="all-linear") == ["Net.fc:8", "Tagger.fc:8"]


@pytest.mark.parametrize(
    ("config", "match"),
    [
        (
            {"target_modules": ["q_proj"], "layers_to_transform": [0], "layers_pattern": "layers"},
            r"Attention\.q_proj: the config selects only some",
        ),
        (
            {"target_modules": r"layers\.0\.self_attn\.q_proj"},
            r"e\.g\. layers\.0\.self_attn\.q_proj but not layers\.1",
        ),
        (
            {"target_modules": ["q_proj"], "exclude_modules": ["layers.1.self_attn.q_proj"]},
            r"only some instances",
        ),
        (
            {"target_modules": ["q_proj"], "rank_pattern": {r"layers\.0\.self_attn\.q_proj": 2}},
            r"rank_pattern/alpha",
        ),
    ],
)
def test_per_layer_configs_cannot_be_expressed_in_source_and_say_so(config: dict, match: str):
    result = rewrite_source(NESTED, LoraConfig(**config), filename="nested.py")
    assert not result.ok and result.code == NESTED and not result.changed
    assert len(result.errors) == 1
    assert str(result.errors[0]).startswith("nested.py:6: ")
    assert "get_lora_model" in str(result.errors[0])
    with pytest.raises(AssertionError, match=match):
        assert result.ok, str(result.errors[0])


def test_user_errors_are_returned_never_raised():
    bad_syntax = rewrite_source("class A(:\n    pass\n", LoraConfig(target_modules=["q"]), filename="bad.py")
    assert [str(e) for e in bad_syntax.errors] == ["bad.py:1: invalid syntax"]
    assert bad_syntax.code == "class A(:\n    pass\n" and not bad_syntax.changed
    assert "must be a loragen.LoraConfig" in str(rewrite_source("x = 1\n", {"r": 8}).errors[0])  # type: ignore[arg-type]
    assert "target_modules is None" in str(rewrite_source("x = 1\n", LoraConfig()).errors[0])
    clash = rewrite_source(
        "from torch import nn\nfrom mylib import LoraLinear\n\nclass M(nn.Module):\n    def __init__(self):\n"
        "        self.q = nn.Linear(1, 1)\n",
        LoraConfig(target_modules=["q"]),
        filename="clash.py",
    )
    assert [str(e) for e in clash.errors] == [
        (
            "clash.py:1: the name LoraLinear is already bound in this module to something other than loragen's; "
            "rename it first"
        )
    ]


def test_warnings_for_unresolvable_layers_and_no_match():
    code = (
        "from torch import nn\n\ndef mlp():\n    return nn.Linear(2, 2)\n\nclass M(nn.Module):\n"
        "    def __init__(self):\n        self.q = nn.Linear(2, 2)\n"
    )
    result = rewrite_source(code, LoraConfig(target_modules=["k"]), filename="w.py")
    assert result.ok and not result.changed and result.code == code
    assert [str(w) for w in result.warnings] == [
        "w.py:1: no layer field matches target_modules=('k',)",
        "w.py:4: nn.Linear(...) in mlp() is not assigned to a module field the scanner can follow; not converted",
    ]
    assert result.summary() == "w.py: no targeted layers, 2 warnings"


def test_relative_imports_become_absolute_only_for_standalone_output():
    code = (
        "from torch import nn\nfrom ..utils import helper\nfrom . import sibling\n\nclass M(nn.Module):\n"
        "    def __init__(self):\n        self.q = nn.Linear(1, 1)\n"
    )
    config = LoraConfig(target_modules=["q"])
    standalone = rewrite_source(code, config, filename="mod.py", package="pkg.sub").code
    assert "from pkg.utils import helper\nfrom pkg.sub import sibling\n" in standalone
    in_place = rewrite_source(code, config, filename="mod.py", package="pkg.sub", absolute_imports=False).code
    assert "from ..utils import helper\nfrom . import sibling\n" in in_place


def test_transformers_models_get_the_lora_init_hook_once():
    code = (
        "import torch\nfrom torch import nn\nfrom transformers import PreTrainedModel\n\n"
        "class BasePreTrainedModel(PreTrainedModel):\n    base_model_prefix = 'model'\n\n"
        "class OtherPreTrainedModel(PreTrainedModel):\n    def _init_weights(self, module):\n"
        "        super()._init_weights(module)\n\n"
        "class Net(BasePreTrainedModel):\n    def __init__(self, config):\n        super().__init__(config)\n"
        "        self.fc = nn.Linear(2, 2)\n"
    )
    out = rewrite_source(code, LoraConfig(target_modules=["fc"]), filename="hf.py").code
    assert "from loragen import LoraLayer, LoraLinear\n" in out
    assert out.count("module.reset_lora_parameters(True)") == 2
    assert (
        "    base_model_prefix = 'model'\n\n    def _init_weights(self, module):\n        super()._init_weights(module)\n"
        "        if isinstance(module, LoraLayer):\n" in out
    )
    assert "        super()._init_weights(module)\n        if isinstance(module, LoraLayer):\n" in out
    assert rewrite_source(out, LoraConfig(target_modules=["fc"]), filename="hf.py").code == out


def test_module_name_for_path(tmp_path: Path):
    package = tmp_path / "pkg" / "sub"
    package.mkdir(parents=True)
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "mod.py").write_text("")
    assert module_name_for_path(package / "mod.py") == ("pkg.sub.mod", "pkg.sub")
    assert module_name_for_path(package / "__init__.py") == ("pkg.sub", "pkg.sub")
    (tmp_path / "loose.py").write_text("")
    assert module_name_for_path(tmp_path / "loose.py") == (None, None)


# ---- the rewritten user model equals the runtime path --------------------------------------------------


def _import_file(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_rewritten_user_model_is_a_drop_in_equal_to_the_runtime_path(tmp_path: Path):
    golden = _regen()
    config = golden.user_model_config()
    original = golden.load_user_model()
    out = tmp_path / "user_model_lora.py"
    out.write_text(rewrite_source((ROOT / "tests/golden/user_model.py").read_text(), config).code)
    rewritten = _import_file(out, "user_model_lora")

    torch.manual_seed(0)
    base = original.Block(50, 16, 4).eval()
    runtime = loragen.get_lora_model(original.Block(50, 16, 4).eval(), config)
    runtime.load_state_dict(base.state_dict(), strict=False)
    model = rewritten.Block(50, 16, 4).eval()
    missing, unexpected = model.load_state_dict(base.state_dict(), strict=False)
    assert unexpected == [] and missing and all(".lora_" in k for k in missing)
    assert sorted(model.state_dict()) == sorted(runtime.state_dict())
    with torch.no_grad():
        for key, value in runtime.state_dict().items():
            if ".lora_" in key:
                value.normal_()
                model.state_dict()[key].copy_(value)
    ids = torch.randint(0, 50, (2, 5))
    torch.testing.assert_close(model(ids), runtime(ids))
    assert not torch.allclose(model(ids), base(ids))
    layers = loragen.convert.find_lora_layers(model)
    assert {p: (m.r, m.lora_alpha, m.lora_dropout_p) for p, m in layers.items()} == {
        p: (m.r, m.lora_alpha, m.lora_dropout_p) for p, m in loragen.convert.find_lora_layers(runtime).items()
    }


# ---- hypothesis: idempotent, and nothing outside targeted calls changes -------------------------------

NAMES = ["q_proj", "k_proj", "dense", "fc1", "emb", "conv", "head", "norm"]
CTORS = {
    "nn.Linear": ("(4, 8{kw})", True),
    "torch.nn.Linear": ("(4, 8{kw})", True),
    "Dense": ("(4, 8{kw})", True),
    "nn.Embedding": ("(10, 4{kw})", True),
    "nn.Conv1d": ("(4, 4, 3{kw})", True),
    "Linear": ("({kw0})", False),  # the user's own class
    "nn.LayerNorm": ("(4{kw})", False),
}
STYLES = ["flat", "spaced", "multiline", "trailing-comma"]


def _call_text(ctor: str, style: str, kw: bool) -> str:
    args, _ = CTORS[ctor]
    flat = args.format(kw=", bias=False" if kw and "Linear" in ctor else "", kw0="")
    inner = flat[1:-1]
    if style == "spaced":
        return f"{ctor}( {inner} )"
    if style == "multiline":
        return f"{ctor}(\n            {inner}\n        )"
    if style == "trailing-comma" and inner:
        parts = [p.strip() for p in inner.split(",")]
        return f"{ctor}(\n" + "".join(f"            {p},\n" for p in parts) + "        )"
    return f"{ctor}{flat}"


@st.composite
def model_sources(draw):
    fields = draw(
        st.lists(
            st.tuples(
                st.sampled_from(NAMES),
                st.sampled_from(sorted(CTORS)),
                st.sampled_from(STYLES),
                st.booleans(),
                st.booleans(),
            ),
            min_size=1,
            max_size=6,
            unique_by=lambda f: f[0],
        )
    )
    targets = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=4, unique=True))
    lines = [
        "import torch",
        "from torch import nn",
        "from torch.nn import Linear as Dense",
        "",
        "",
        "class Linear(nn.Module):",
        "    pass",
        "",
        "",
        "class M(nn.Module):",
        "    def __init__(self):",
        "        super().__init__()",
    ]
    spans: list[tuple[int, int, bool]] = []  # (first line, last line, should change), 1-based
    for name, ctor, style, kw, comment in fields:
        text = f"        self.{name} = {_call_text(ctor, style, kw)}" + ("  # note" if comment else "")
        start = len(lines) + 1
        lines.extend(text.split("\n"))
        spans.append((start, len(lines), name in targets and CTORS[ctor][1]))
    lines += ["", "    def forward(self, x):", "        return x  # nn.Linear(1, 2) in a comment", ""]
    return "\n".join(lines), targets, spans


def _normalise(code: str) -> str:
    """The AST with loragen's additions undone: LoRA callees back to a marker, LoRA keywords removed."""
    tree = ast.parse(code)
    tree.body = [s for s in tree.body if not (isinstance(s, ast.ImportFrom) and s.module == "loragen")]
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            callee = ast.unparse(node.func)
            if callee.startswith("Lora") or callee in (
                "nn.Linear",
                "torch.nn.Linear",
                "Dense",
                "nn.Embedding",
                "nn.Conv1d",
            ):
                node.func = ast.Name("LAYER")
                node.keywords = [k for k in node.keywords if k.arg not in ("r", "lora_alpha", "lora_dropout")]
    return ast.dump(tree)


@given(model_sources(), st.integers(1, 16), st.sampled_from([4, 8, 16.0, 0.5]))
def test_rewrite_is_idempotent_and_changes_only_targeted_calls(source, r, alpha):
    code, targets, spans = source
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets)
    first = rewrite_source(code, config, filename="gen.py")
    assert first.ok, [str(e) for e in first.errors]
    second = rewrite_source(first.code, config, filename="gen.py")
    assert second.code == first.code and not second.changed
    assert _normalise(first.code) == _normalise(code)

    expected = [span for span in spans if span[2]]
    assert len(first.rewritten) == len(expected)
    old_lines, new_lines = code.split("\n"), first.code.split("\n")
    import_line = f"from loragen import {', '.join(sorted({c.lora_name for c in first.rewritten}))}"
    changed_spans = [(s, e) for s, e, changed in spans if changed]
    touched: set[int] = set()  # 1-based lines of the input that were edited
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(
        a=old_lines, b=new_lines, autojunk=False
    ).get_opcodes():
        if tag == "equal":
            continue
        if tag == "insert":
            if new_lines[j1:j2] == [import_line]:
                continue
            assert any(s <= i1 < e for s, e in changed_spans), new_lines[j1:j2]  # keywords on their own lines
            touched.add(i1)
        else:
            touched.update(range(i1 + 1, i2 + 1))
    for start, end, changed in spans:
        assert bool(touched & set(range(start, end + 1))) == changed, (start, end, changed)
    assert touched <= {line for s, e in changed_spans for line in range(s, e + 1)}


# ---- the CLI -------------------------------------------------------------------------------------------


def run_cli(*args: str) -> int:
    parser = argparse.ArgumentParser(prog="loragen")
    rewrite_command.register(parser.add_subparsers())
    parsed = parser.parse_args(["rewrite", *args])
    return parsed.func(parsed)


@pytest.fixture
def sources(tmp_path: Path) -> Path:
    folder = tmp_path / "src"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.py").write_text(
        "from torch import nn\n\nclass A(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.q = nn.Linear(2, 2)\n"
    )
    (folder / "sub" / "b.py").write_text(
        "from torch import nn\n\nclass B(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.v = nn.Linear(2, 2)\n        self.k = nn.Linear(2, 2)\n"
    )
    return folder


def test_cli_single_file_to_stdout_with_summary(sources: Path, capsys):
    assert run_cli(str(sources / "a.py"), "--target-modules", "q", "--r", "4", "--lora-alpha", "8") == 0
    out, err = capsys.readouterr()
    assert "self.q = LoraLinear(2, 2, r=4, lora_alpha=8)" in out
    assert err == f"{sources / 'a.py'}: 1 layer -> LoRA (q)\n"


def test_cli_folder_to_output_folder_and_in_place(sources: Path, tmp_path: Path, capsys):
    out = tmp_path / "out"
    assert run_cli(str(sources), "-o", str(out), "--target-modules", "q,v", "-q") == 0
    assert capsys.readouterr() == ("", "")
    assert "LoraLinear(2, 2, r=8, lora_alpha=8)" in (out / "a.py").read_text()
    assert (out / "sub" / "b.py").read_text().count("LoraLinear(") == 1
    before = (sources / "sub" / "b.py").read_text()
    assert run_cli(str(sources), "--in-place", "--target-modules", "k") == 0
    after = (sources / "sub" / "b.py").read_text()
    assert after != before and "self.k = LoraLinear(2, 2, r=8, lora_alpha=8)" in after
    assert not any(p.name.endswith(".tmp") for p in sources.rglob("*"))


def test_cli_diff_and_config_file(sources: Path, tmp_path: Path, capsys):
    config = tmp_path / "adapter_config.json"
    config.write_text(
        '{"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q"], "task_type": null}'
    )
    assert run_cli(str(sources / "a.py"), "--diff", "--config", str(config), "--lora-alpha", "6") == 0
    out, _ = capsys.readouterr()
    assert "-        self.q = nn.Linear(2, 2)\n+        self.q = LoraLinear(2, 2, r=2, lora_alpha=6)\n" in out
    assert (sources / "a.py").read_text().count("nn.Linear(2, 2)") == 1  # --diff writes nothing


def test_cli_invalid_python_exits_nonzero_with_file_line_and_writes_nothing(
    sources: Path, tmp_path: Path, capsys
):
    (sources / "broken.py").write_text("import torch\n\nclass A(:\n    pass\n")
    originals = {p: p.read_bytes() for p in sources.rglob("*.py")}
    assert run_cli(str(sources), "--in-place", "--target-modules", "q") == rewrite_command.EXIT_FILE_ERRORS
    err = capsys.readouterr().err
    assert f"{sources / 'broken.py'}:3: invalid syntax\n" in err
    assert "nothing was written" in err
    assert {p: p.read_bytes() for p in sources.rglob("*.py")} == originals
    assert run_cli(str(sources), "-o", str(tmp_path / "o"), "--target-modules", "q") == 1
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["missing.py", "--target-modules", "q"], "missing.py: no such file or folder"),
        (["{src}/a.py"], "no target modules"),
        (["{src}", "--target-modules", "q"], "2 files to rewrite: use -o FOLDER, --in-place or --diff"),
        (["{src}/a.py", "--target-modules", "q", "--lora-dropout", "2"], "lora_dropout=2.0"),
        (["{src}/a.py", "--config", "{src}/a.py"], "not valid JSON"),
    ],
)
def test_cli_usage_errors(sources: Path, capsys, args: list[str], message: str):
    assert run_cli(*[a.format(src=sources) for a in args]) == rewrite_command.EXIT_USAGE
    assert message in capsys.readouterr().err


def test_in_place_never_damages_the_input_when_the_write_fails(sources: Path, monkeypatch):
    target = sources / "a.py"
    before = target.read_bytes()

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        run_cli(str(target), "--in-place", "--target-modules", "q")
    assert target.read_bytes() == before
    assert [p.name for p in sources.iterdir() if p.is_file()] == ["a.py"]


# ---- golden files --------------------------------------------------------------------------------------


def _regen():
    if "regen_golden" not in sys.modules:
        _import_file(ROOT / "scripts" / "regen_golden.py", "regen_golden")
    return sys.modules["regen_golden"]


@pytest.mark.parametrize(
    "case", [c for c in _regen().cases() if "rewrite" in c.name], ids=lambda c: c.path.name
)
def test_golden_rewrites(case):
    reason = case.skip_reason()
    if reason:
        pytest.skip(reason)
    assert case.generate() == case.path.read_text(), (
        f"{case.path.name} is stale; if the change is intended run: python scripts/regen_golden.py"
    )


def test_targets_naming_containers_or_submodules_are_warned_about():
    result = rewrite_source(
        NESTED, LoraConfig(target_modules=["layers", "self_attn", "q_proj"]), filename="n.py"
    )
    assert result.ok and [c.field.path for c in result.rewritten] == ["q_proj"]
    assert [str(w) for w in result.warnings] == [
        (
            "n.py:12: target_modules matches self_attn: Layer.self_attn is a module of class Attention, not a "
            "layer; it is left as it is (loragen.get_lora_model would refuse it): name the layers inside it instead"
        ),
        (
            "n.py:18: target_modules matches layers: Model.layers is a module container, not a layer; it is left "
            "as it is (loragen.get_lora_model would refuse it): name the layers inside it instead"
        ),
    ]
