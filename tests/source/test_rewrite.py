"""``rewrite_source`` and ``loragen rewrite``: before/after pairs, config semantics, errors, the CLI,
idempotence and locality (hypothesis), golden files, and equality with the runtime path."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import loragen
from loragen import LoraConfig, rewrite_source
from loragen.source.rewriter import module_name_for_path

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

        from loragen import LoraConfig
        from loragen.layers import LoraLinear

        # Added by loragen rewrite: the LoRA config this file's LoRA layers were written with.
        # Classes holding them carry it as `loragen_config` (read by loragen.mark_trainable).
        LORA_CONFIG = LoraConfig(lora_alpha=16, target_modules=["q"])

        class M(nn.Module):
            loragen_config = LORA_CONFIG  # added by loragen rewrite

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

        from loragen import LoraConfig
        from loragen.layers import LoraEmbedding, LoraLinear

        # Added by loragen rewrite: the LoRA config this file's LoRA layers were written with.
        # Classes holding them carry it as `loragen_config` (read by loragen.mark_trainable).
        LORA_CONFIG = LoraConfig(r=4, lora_dropout=0.1, target_modules=["a", "b", "emb"])

        class M(torch.nn.Module):
            loragen_config = LORA_CONFIG  # added by loragen rewrite

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
                self.emb = LoraEmbedding(
                    10, d, padding_idx=0, r=4, lora_alpha=8, lora_dropout=0.1
                )
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

        from loragen import LoraConfig
        from loragen.layers import LoraConv2d

        # Added by loragen rewrite: the LoRA config this file's LoRA layers were written with.
        # Classes holding them carry it as `loragen_config` (read by loragen.mark_trainable).
        LORA_CONFIG = LoraConfig(target_modules=r".*(proj|convs\\.\\d+)")

        class Linear(nn.Module):
            pass

        class M(nn.Module):
            loragen_config = LORA_CONFIG  # added by loragen rewrite

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
        from loragen import LoraConfig, LoraLinear
        from torch import nn

        # Added by loragen rewrite: the LoRA config this file's LoRA layers were written with.
        # Classes holding them carry it as `loragen_config` (read by loragen.mark_trainable).
        LORA_CONFIG = LoraConfig(r=16, lora_alpha=32, target_modules=["q"])

        class M(nn.Module):
            loragen_config = LORA_CONFIG  # added by loragen rewrite

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
    assert out == (
        "from torch import nn\r\n\r\nfrom loragen import LoraConfig\r\nfrom loragen.layers import LoraLinear\r\n\r\n"
        "# Added by loragen rewrite: the LoRA config this file's LoRA layers were written with.\r\n"
        "# Classes holding them carry it as `loragen_config` (read by loragen.mark_trainable).\r\n"
        'LORA_CONFIG = LoraConfig(target_modules=["q"])\r\n\r\n'
        "class M(nn.Module):\r\n\tloragen_config = LORA_CONFIG  # added by loragen rewrite\r\n\r\n"
        "\tdef __init__(self):\r\n\t\tself.q = LoraLinear(1, 2, r=8, lora_alpha=8)\r\n"
    )


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
            "clash.py:1: the name LoraLinear is already bound in this module to something other than "
            "loragen.layers.LoraLinear; rename it first"
        )
    ]


def test_unresolvable_layers_are_warned_about_and_unmatched_targets_listed():
    code = (
        "from torch import nn\n\ndef mlp():\n    return nn.Linear(2, 2)\n\nclass M(nn.Module):\n"
        "    def __init__(self):\n        self.q = nn.Linear(2, 2)\n"
    )
    result = rewrite_source(
        code, LoraConfig(target_modules=["k", "q"], exclude_modules=["q"]), filename="w.py"
    )
    assert result.ok and not result.changed and result.code == code
    assert [str(w) for w in result.warnings] == [
        "w.py:4: nn.Linear(...) in mlp() is not assigned to a module field the scanner can follow; not converted",
    ]
    assert result.unmatched_targets == ("k", "q")  # q is excluded: it selects nothing either
    assert result.summary() == "w.py: no targeted layers, 1 warning"
    regex = rewrite_source(code, LoraConfig(target_modules=r".*\.k"), filename="w.py")
    assert regex.unmatched_targets == (r".*\.k",)
    assert rewrite_source(code, LoraConfig(target_modules=["q", "k"]), filename="w.py").unmatched_targets == (
        "k",
    )
    empty = rewrite_source("", LoraConfig(target_modules=["q"]), filename="__init__.py")
    assert empty.ok and not empty.warnings and empty.summary() == "__init__.py: no layer fields"


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
    assert "from loragen import LoraConfig\nfrom loragen.layers import LoraLayer, LoraLinear\n" in out
    assert out.count("module.reset_lora_parameters(True)") == 2
    assert (
        "    base_model_prefix = 'model'\n\n    def _init_weights(self, module):\n        super()._init_weights(module)\n"
        "        if isinstance(module, LoraLayer):\n" in out
    )
    assert "        super()._init_weights(module)\n        if isinstance(module, LoraLayer):\n" in out
    assert rewrite_source(out, LoraConfig(target_modules=["fc"]), filename="hf.py").code == out


def test_init_hook_gives_a_model_without_targeted_layers_the_hook_and_the_config():
    """``init_hook``: the file's models build LoRA layers of another file of the same rewrite."""
    model = (
        "from torch import nn\nfrom transformers import PreTrainedModel\n\nfrom pkg.blocks import Block\n\n\n"
        "class BasePreTrainedModel(PreTrainedModel):\n    base_model_prefix = 'model'\n\n\n"
        "class Net(BasePreTrainedModel):\n    def __init__(self, config):\n        super().__init__(config)\n"
        "        self.block = Block()\n        self.head = nn.Linear(2, 2)\n"
    )
    config = LoraConfig(r=4, target_modules=["q_proj"])
    alone = rewrite_source(model, config, filename="modeling.py")
    assert alone.ok and not alone.changed and alone.init_hooks == ()
    hooked = rewrite_source(model, config, filename="modeling.py", init_hook=True)
    assert hooked.ok and hooked.changed and hooked.init_hooks == ("BasePreTrainedModel",)
    assert (
        "from pkg.blocks import Block\n\nfrom loragen import LoraConfig\nfrom loragen.layers import LoraLayer\n"
        in (hooked.code)
    )
    assert 'LORA_CONFIG = LoraConfig(r=4, target_modules=["q_proj"])' in hooked.code
    assert (
        "    loragen_config = LORA_CONFIG  # added by loragen rewrite\n    base_model_prefix" in hooked.code
    )
    assert hooked.code.count("module.reset_lora_parameters(True)") == 1 and "LoraLinear" not in hooked.code
    assert hooked.summary() == (
        "modeling.py: no targeted layers; BasePreTrainedModel._init_weights initialises the LoRA layers of other files"
    )
    again = rewrite_source(hooked.code, config, filename="modeling.py", init_hook=True)
    assert (
        again.code == hooked.code and not again.changed and again.summary().endswith(", already up to date")
    )
    plain = "from torch import nn\n\n\nclass Block(nn.Module):\n    def __init__(self):\n        self.k = nn.Linear(2, 2)\n"
    untouched = rewrite_source(plain, config, filename="other.py", init_hook=True)
    assert untouched.ok and untouched.code == plain and untouched.init_hooks == ()


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
    # the rewritten model knows its config: mark_trainable needs none
    assert model.loragen_config == config == rewritten.LORA_CONFIG
    loragen.mark_trainable(model)
    assert [n for n, p in model.named_parameters() if p.requires_grad] == [
        n for n, p in runtime.named_parameters() if p.requires_grad
    ]
    loragen.merge_and_unload(model)  # the class's config stays with the class
    assert not loragen.convert.find_lora_layers(model) and rewritten.Block.loragen_config == config


def test_a_model_built_around_a_rewritten_class_finds_its_config(tmp_path: Path):
    config = LoraConfig(target_modules=["q_proj"], bias="lora_only")
    out = tmp_path / "attention_lora.py"
    out.write_text(rewrite_source(NESTED, config, filename="attention.py").code)
    rewritten = _import_file(out, "attention_lora")
    model = torch.nn.Sequential(rewritten.Attention(4), torch.nn.Linear(4, 4))
    loragen.mark_trainable(model)
    assert [n for n, p in model.named_parameters() if p.requires_grad] == [
        "0.q_proj.bias",
        "0.q_proj.lora_A",
        "0.q_proj.lora_B",
    ]
    converted = loragen.get_lora_model(
        torch.nn.Sequential(torch.nn.Linear(2, 2)), LoraConfig(target_modules=["0"])
    )
    other = torch.nn.Sequential(model, converted)
    with pytest.raises(loragen.LoraConversionError, match=r"carry different LoRA configs \(at 0\.0, 1\)"):
        loragen.mark_trainable(other)


TOY_SOURCE = """\
from torch import nn
from tests.source.toy_layers import ToyLinear


class ToyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = ToyLinear(4, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        return self.out(self.proj(x))
"""


@pytest.fixture
def toy_registered():
    from tests.source.toy_layers import ToyLinear, ToyLoraLinear

    spec = loragen.register_layer(ToyLinear, ToyLoraLinear)
    yield spec
    loragen.registry.unregister(spec.base_qualname)


def test_a_registered_layer_type_gets_its_own_lora_class_and_signature_defaults(
    toy_registered, tmp_path: Path
):
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["proj", "out"])
    result = rewrite_source(TOY_SOURCE, config, filename="toy_net.py")
    assert result.ok, [str(e) for e in result.errors]
    assert "from tests.source.toy_layers import ToyLinear, ToyLoraLinear\n" in result.code
    # ToyLoraLinear's own default dropout is 0.1, LoraLinear's 0: only the first needs the keyword
    assert "self.proj = ToyLoraLinear(4, 4, r=4, lora_alpha=8, lora_dropout=0)\n" in result.code
    assert "self.out = LoraLinear(4, 2, r=4, lora_alpha=8)\n" in result.code
    (tmp_path / "toy_net.py").write_text(TOY_SOURCE)
    (tmp_path / "toy_net_lora.py").write_text(result.code)
    torch.manual_seed(0)
    runtime = loragen.get_lora_model(_import_file(tmp_path / "toy_net.py", "toy_net").ToyNet(), config)
    torch.manual_seed(0)
    model = _import_file(tmp_path / "toy_net_lora.py", "toy_net_lora").ToyNet()
    assert sorted(model.state_dict()) == sorted(runtime.state_dict())
    model.load_state_dict(runtime.state_dict())
    assert {
        p: (type(m), m.r, m.lora_dropout_p) for p, m in loragen.convert.find_lora_layers(model).items()
    } == {p: (type(m), m.r, m.lora_dropout_p) for p, m in loragen.convert.find_lora_layers(runtime).items()}
    x = torch.randn(3, 4)
    torch.testing.assert_close(model.eval()(x), runtime.eval()(x))


def test_rewriting_again_with_another_config_replaces_the_recorded_config():
    first = rewrite_source(NESTED, LoraConfig(target_modules=["q_proj"]), filename="n.py").code
    second = rewrite_source(first, LoraConfig(r=16, target_modules=["q_proj"]), filename="n.py").code
    assert 'LORA_CONFIG = LoraConfig(r=16, target_modules=["q_proj"])\n' in second
    assert second.count("LORA_CONFIG = ") == 1 and second.count("loragen_config = LORA_CONFIG") == 1
    assert "self.q_proj = LoraLinear(d, d, r=16, lora_alpha=8)" in second


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("LORA_CONFIG = {}\n", "the name LORA_CONFIG is already bound"),
        (
            "from peft import LoraConfig\n",
            "the name LoraConfig is already bound in this module to something other",
        ),
    ],
)
def test_names_the_rewrite_adds_must_be_free(line: str, match: str):
    result = rewrite_source(NESTED + line, LoraConfig(target_modules=["q_proj"]), filename="n.py")
    assert not result.ok and result.code == NESTED + line
    assert match in str(result.errors[0])


def test_a_class_that_sets_loragen_config_itself_is_not_rewritten():
    code = NESTED.replace(
        "class Attention(nn.Module):\n", "class Attention(nn.Module):\n    loragen_config = None\n"
    )
    result = rewrite_source(code, LoraConfig(target_modules=["q_proj"]), filename="n.py")
    assert [str(e) for e in result.errors] == [
        "n.py:3: class Attention sets loragen_config = None itself; a rewrite records its config there "
        "(loragen_config = LORA_CONFIG): remove that line first"
    ]


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
