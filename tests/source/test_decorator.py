"""``@lora_convert``: generated conversion code equals the runtime path, on user and transformers classes."""

from __future__ import annotations

import copy
import importlib.util
import inspect
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import loragen
from loragen import LoraConfig, LoraConversionError, registry
from loragen.convert import find_lora_layers
from loragen.source.decorator import GENERATED_METHODS, LoraConvertError, expansion_source, lora_convert
from tests.source.toy_layers import ToyLinear, ToyLoraLinear

ROOT = Path(__file__).resolve().parents[2]
CONFIG = LoraConfig(
    r=4,
    lora_alpha=8,
    target_modules=["q_proj", "up", "0", "2", "proj", "emb", "fc"],
    rank_pattern={"mlp.up": 2},
    alpha_pattern={"blocks.2": 3.0},
)


@lora_convert
class MLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class Plain(nn.Module):  # not decorated: converted by the runtime path
    def __init__(self, d: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


@lora_convert(CONFIG)
class Net(nn.Module):
    def __init__(self, d: int = 8, n: int = 3, conv: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, d)
        self.q_proj = nn.Linear(d, d)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.blocks = nn.ModuleList([nn.Linear(d, d) for _ in range(n)])
        self.mlp = MLP(d)
        self.plain = Plain(d)
        self.conv = conv
        if conv:
            self.fc = nn.Conv1d(d, d, 1)
        else:
            self.fc = nn.Linear(d, d)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        x = self.q_proj(x) + self.v_proj(x)
        for block in self.blocks:
            x = block(x)
        x = self.plain(self.mlp(x))
        if self.conv:  # (B, T, d) -> (B, d, T) for the convolution
            return self.fc(x.transpose(1, 2)).transpose(1, 2)
        return self.fc(x)


def twin(seed: int = 0, **kwargs) -> tuple[Net, Net]:
    torch.manual_seed(seed)
    a = Net(**kwargs)
    torch.manual_seed(seed)
    return a, Net(**kwargs)


def randomise_lora(model: nn.Module, seed: int = 3) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in find_lora_layers(model).values():
            for p in layer.lora_parameters().values():
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("conv", [False, True])
def test_generated_conversion_equals_get_lora_model(conv: bool):
    generated, runtime = twin(conv=conv)
    torch.manual_seed(1)
    assert generated.get_lora_model() is generated  # the decorator's config is the default
    torch.manual_seed(1)
    loragen.get_lora_model(runtime, CONFIG)
    mine, theirs = generated.state_dict(), runtime.state_dict()
    assert list(mine) == list(theirs)
    for key in mine:  # the same seed gives identical parameters: same layers, same order of creation
        torch.testing.assert_close(mine[key], theirs[key], rtol=0, atol=0)
    assert [n for n, p in generated.named_parameters() if p.requires_grad] == [
        n for n, p in runtime.named_parameters() if p.requires_grad
    ]
    layers = find_lora_layers(generated)
    assert {p: (type(m).__name__, m.r, m.lora_alpha) for p, m in layers.items()} == {
        p: (type(m).__name__, m.r, m.lora_alpha) for p, m in find_lora_layers(runtime).items()
    }
    assert layers["mlp.up"].r == 2 and layers["blocks.2"].lora_alpha == 3.0  # per-path values at conversion
    assert generated.loragen_config == CONFIG
    randomise_lora(generated)
    randomise_lora(runtime)
    ids = torch.randint(0, 10, (2, 5))
    torch.testing.assert_close(generated(ids), runtime(ids))


def test_nested_decorated_modules_run_their_own_generated_code(monkeypatch):
    calls: list[str] = []
    original = MLP._lora_convert

    def spy(self, config, planned, prefix):
        calls.append(prefix)
        return original(self, config, planned, prefix)

    monkeypatch.setattr(MLP, "_lora_convert", spy)
    Net().get_lora_model()
    assert calls == ["mlp."]


def test_get_tensors_has_peft_keys_and_shapes():
    peft = pytest.importorskip("peft")
    model, base = twin()
    model.get_lora_model()
    randomise_lora(model)
    tensors = model.get_tensors()
    peft_config = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=list(CONFIG.target_modules),
        rank_pattern=dict(CONFIG.rank_pattern),
        alpha_pattern=dict(CONFIG.alpha_pattern),
    )
    peft_model = peft.get_peft_model(base, peft_config)
    expected = peft.get_peft_model_state_dict(peft_model)
    assert sorted(tensors) == sorted(expected)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == {k: tuple(v.shape) for k, v in expected.items()}
    peft.set_peft_model_state_dict(peft_model, tensors)
    ids = torch.randint(0, 10, (2, 5))
    torch.testing.assert_close(model(ids), peft_model(ids), atol=1e-5, rtol=1e-5)
    assert tensors["base_model.model.q_proj.lora_A.weight"].data_ptr() == model.q_proj.lora_A.data_ptr()
    assert not tensors["base_model.model.q_proj.lora_A.weight"].requires_grad


def test_merge_and_unmerge_weights():
    model = Net().get_lora_model()
    randomise_lora(model)
    ids = torch.randint(0, 10, (2, 5))
    before = model(ids)
    weight = model.q_proj.weight.detach().clone()
    model.merge_weights()
    model.merge_weights()  # safe to repeat
    assert all(layer.merged for layer in find_lora_layers(model).values())
    torch.testing.assert_close(model(ids), before, atol=1e-5, rtol=1e-5)
    model.unmerge_weights()
    assert not any(layer.merged for layer in find_lora_layers(model).values())
    torch.testing.assert_close(model.q_proj.weight, weight, atol=1e-6, rtol=0)


def test_fields_and_readable_source():
    assert [(f.pattern, f.lora_name, f.conditional) for f in Net.lora_fields] == [
        ("emb", "LoraEmbedding", False),
        ("q_proj", "LoraLinear", False),
        ("v_proj", "LoraLinear", False),
        ("blocks.*", "LoraLinear", False),
        ("fc", "LoraConv1d", True),
        ("fc", "LoraLinear", True),
    ]
    source = Net.__lora_source__
    assert source == expansion_source(Net, CONFIG)
    assert "self.q_proj = LoraLinear.from_module(child, **plan.entries[path].layer_kwargs())" in source
    assert 'elif name == "fc" and type(child) is nn.Conv1d:' in source
    compile(source, "<check>", "exec")
    assert Net.get_lora_model.__qualname__ == "Net.get_lora_model"
    assert "def get_lora_model(self, config=LORA_CONFIG):" in inspect.getsource(Net.get_lora_model)


def test_lora_source_is_the_code_that_runs_with_the_config_as_a_literal():
    source = Net.__lora_source__
    assert "DEFAULT_CONFIG" not in source and "LORA_CONFIG = LoraConfig(" in source
    namespace: dict = {"__name__": "check"}
    exec(compile(source, "<check>", "exec"), namespace)  # the literal alone rebuilds the config
    assert namespace["LORA_CONFIG"] == CONFIG
    assert Net.get_lora_model.__code__.co_filename == f"<loragen.lora_convert {Net.__module__}.Net>"
    assert inspect.getsource(Net.get_lora_model) in source
    # shorter: CONFIG does not target v_proj, so there is no branch for it
    assert 'name == "v_proj"' not in source and 'name == "q_proj"' in source
    (row,) = [line for line in source.splitlines() if line.startswith("#   v_proj ")]
    assert row.endswith("(not targeted by LORA_CONFIG)")
    assert (
        "LORA_CONFIG" not in MLP.__lora_source__
        and "def get_lora_model(self, config=None):" in MLP.__lora_source__
    )


def test_fields_without_a_branch_convert_through_the_runtime_path():
    other = CONFIG.replace(target_modules=["v_proj", "down"], rank_pattern={}, alpha_pattern={})
    generated, runtime = twin()
    torch.manual_seed(1)
    generated.get_lora_model(other)
    torch.manual_seed(1)
    loragen.get_lora_model(runtime, other)
    assert sorted(find_lora_layers(generated)) == ["mlp.down", "v_proj"]
    mine, theirs = generated.state_dict(), runtime.state_dict()
    assert list(mine) == list(theirs) and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_a_converted_model_knows_its_config():
    model = Net().get_lora_model()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    model.requires_grad_(True)
    loragen.mark_trainable(model)  # no config repeated
    assert [n for n, p in model.named_parameters() if p.requires_grad] == trainable
    with pytest.raises(
        LoraConversionError, match=r"Net carries no LoRA config .*mark_trainable\(model, config\)"
    ):
        loragen.mark_trainable(Net())


class ToyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = ToyLinear(4, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.proj(x))


@pytest.fixture
def toy_registered():
    spec = loragen.register_layer(ToyLinear, ToyLoraLinear)
    yield spec
    registry.unregister(spec.base_qualname)


def test_a_layer_type_registered_from_a_user_module(toy_registered, decorate):
    config = LoraConfig(r=2, target_modules=["proj", "out"])
    decorate(ToyNet, config=config)
    source = ToyNet.__lora_source__
    assert "from tests.source.toy_layers import ToyLinear, ToyLoraLinear\n" in source
    assert 'if name == "proj" and type(child) is ToyLinear:' in source
    torch.manual_seed(0)
    generated = ToyNet()
    runtime = copy.deepcopy(generated)
    torch.manual_seed(1)
    generated.get_lora_model()
    torch.manual_seed(1)
    loragen.get_lora_model(runtime, config)
    assert type(generated.proj) is ToyLoraLinear and generated.proj.r == 2
    mine, theirs = generated.state_dict(), runtime.state_dict()
    assert list(mine) == list(theirs) and all(torch.equal(mine[k], theirs[k]) for k in mine)
    randomise_lora(generated)
    randomise_lora(runtime)
    x = torch.randn(3, 4)
    torch.testing.assert_close(generated.eval()(x), runtime.eval()(x))
    assert sorted(generated.get_tensors()) == [
        "base_model.model.out.lora_A.weight",
        "base_model.model.out.lora_B.weight",
        "base_model.model.proj.lora_A.weight",
        "base_model.model.proj.lora_B.weight",
    ]


def test_a_second_conversion_is_refused_like_the_runtime():
    model = Net().get_lora_model()
    with pytest.raises(LoraConversionError, match="already has LoRA layers"):
        model.get_lora_model()


def test_missing_or_wrong_config():
    with pytest.raises(LoraConvertError, match=r"MLP\.get_lora_model\(\) needs a LoraConfig"):
        MLP(4).get_lora_model()
    with pytest.raises(LoraConvertError, match=r"config must be a loragen\.LoraConfig, got dict"):
        MLP(4).get_lora_model({"r": 8})
    with pytest.raises(LoraConversionError, match="matched no module"):
        MLP(4).get_lora_model(LoraConfig(target_modules=["nothing"]))
    with pytest.raises(LoraConvertError, match="expects a class or a LoraConfig, got int"):
        lora_convert(3)
    with pytest.raises(LoraConvertError, match=r"config must be a loragen\.LoraConfig, got dict"):
        lora_convert(MLP, {"r": 8})  # type: ignore[arg-type]
    assert issubclass(LoraConvertError, loragen.LoraError) and issubclass(LoraConvertError, TypeError)


def test_classes_without_source_are_refused_with_a_pointer_to_the_runtime_path():
    namespace: dict = {"nn": nn}
    exec(
        "class Made(nn.Module):\n    def __init__(self):\n        super().__init__()\n        self.q = nn.Linear(1, 1)\n",
        namespace,
    )
    with pytest.raises(
        LoraConvertError, match=r"cannot read the source of .*Made.*loragen\.get_lora_model\(model, config\)"
    ):
        lora_convert(namespace["Made"])


def test_refusals():
    with pytest.raises(LoraConvertError, match=r"applies to nn\.Module subclasses"):
        lora_convert(int)

    class Clashing(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q = nn.Linear(1, 1)

        def get_tensors(self):
            return {}

    with pytest.raises(LoraConvertError, match=r"Clashing defines get_tensors\(\) itself"):
        lora_convert(Clashing)


def test_classes_defined_in_functions_and_redecoration():
    class Local(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))

    lora_convert(Local)
    lora_convert(Local, LoraConfig(target_modules=["0"]))  # decorating again regenerates, new default
    assert [f.path for f in Local.lora_fields] == ["layers.0", "layers.2"]
    model = Local().get_lora_model()
    assert list(find_lora_layers(model)) == ["layers.0"]


# ---- transformers classes ---------------------------------------------------------------------------


@pytest.fixture
def decorate():
    """Decorate classes of other packages for one test, then remove what was added."""
    added: list[type] = []

    def apply(*classes: type, config: LoraConfig | None = None) -> None:
        for cls in classes:
            lora_convert(cls, config)
            added.append(cls)

    yield apply
    for cls in added:
        for name in (*GENERATED_METHODS, "lora_fields", "lora_unresolved", "__lora_source__"):
            if name in vars(cls):
                delattr(cls, name)


def test_transformers_llama_classes(decorate):
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama import modeling_llama as m

    decorate(m.LlamaAttention, m.LlamaMLP, m.LlamaForCausalLM)
    assert [f.path for f in m.LlamaAttention.lora_fields] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", rank_pattern={"o_proj": 2})
    hf_config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
    )
    torch.manual_seed(0)
    generated = transformers.LlamaForCausalLM(hf_config).eval()
    runtime = copy.deepcopy(generated)
    torch.manual_seed(1)
    generated.get_lora_model(config)
    torch.manual_seed(1)
    loragen.get_lora_model(runtime, config)
    mine, theirs = generated.state_dict(), runtime.state_dict()
    assert list(mine) == list(theirs) and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert "lm_head" not in find_lora_layers(generated)
    randomise_lora(generated)
    randomise_lora(runtime)
    ids = torch.randint(0, 100, (2, 6))
    with torch.no_grad():
        torch.testing.assert_close(generated(ids).logits, runtime(ids).logits)
    assert len(generated.get_tensors()) == 2 * 7 * 2


def test_transformers_gpt2_conv1d(decorate):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from transformers.models.gpt2 import modeling_gpt2 as m

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"])
    decorate(m.GPT2Attention, m.GPT2MLP, m.GPT2LMHeadModel, config=config)
    hf_config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=100, n_positions=64)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(hf_config).eval()
    base = copy.deepcopy(model)
    model.get_lora_model()
    randomise_lora(model)
    peft_model = peft.get_peft_model(
        base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True)
    ).eval()
    tensors = model.get_tensors()
    assert sorted(tensors) == sorted(peft.get_peft_model_state_dict(peft_model))
    peft.set_peft_model_state_dict(peft_model, tensors)
    ids = torch.randint(0, 100, (2, 6))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, peft_model(ids).logits, atol=2e-5, rtol=1e-4)


# ---- golden expansions --------------------------------------------------------------------------------


def _regen():
    if "regen_golden" not in sys.modules:
        spec = importlib.util.spec_from_file_location("regen_golden", ROOT / "scripts" / "regen_golden.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["regen_golden"] = module
        spec.loader.exec_module(module)
    return sys.modules["regen_golden"]


@pytest.mark.parametrize(
    "case", [c for c in _regen().cases() if "lora_convert" in c.name], ids=lambda c: c.path.name
)
def test_golden_expansions(case):
    reason = case.skip_reason()
    if reason:
        pytest.skip(reason)
    assert case.generate() == case.path.read_text(), (
        f"{case.path.name} is stale; if the change is intended run: python scripts/regen_golden.py"
    )


def test_a_decorated_block_in_an_undecorated_pretrained_model_loaded_with_from_pretrained(tmp_path: Path):
    """``from_pretrained`` builds the model with plain layers (the decorator converts nothing at construction);
    converting after loading gives the LoRA factors peft's initialisation on the loaded weights."""
    transformers = pytest.importorskip("transformers")
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])

    @lora_convert(config)
    class Attention(nn.Module):
        def __init__(self, hidden: int) -> None:
            super().__init__()
            self.q_proj = nn.Linear(hidden, hidden)
            self.v_proj = nn.Linear(hidden, hidden)
            self.o_proj = nn.Linear(hidden, hidden)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.o_proj(torch.tanh(self.q_proj(x)) * self.v_proj(x))

    class TinyConfig(transformers.PretrainedConfig):
        model_type = "loragen-tiny-decorated"

        def __init__(self, hidden: int = 16, **kwargs) -> None:
            self.hidden = hidden
            super().__init__(**kwargs)

    class TinyModel(transformers.PreTrainedModel):
        config_class = TinyConfig

        def __init__(self, config: TinyConfig) -> None:
            super().__init__(config)
            self.blocks = nn.ModuleList([Attention(config.hidden) for _ in range(2)])
            self.post_init()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = x + block(x)
            return x

    torch.manual_seed(0)
    base = TinyModel(TinyConfig()).eval()
    base.save_pretrained(tmp_path)
    model = TinyModel.from_pretrained(tmp_path).eval()
    for block in model.blocks:
        block.get_lora_model()
    layers = find_lora_layers(model)
    assert sorted(layers) == [f"blocks.{i}.{p}" for i in range(2) for p in ("q_proj", "v_proj")]
    for name, layer in layers.items():
        a, b = layer.lora_A, layer.lora_B
        assert torch.isfinite(a).all() and 0 < a.abs().max() <= 1 / a.shape[1] ** 0.5, name  # kaiming-uniform
        assert torch.equal(b, torch.zeros_like(b)), name
    x = torch.randn(3, 16)
    with torch.no_grad():
        torch.testing.assert_close(model(x), base(x))
