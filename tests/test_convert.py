"""get_lora_model on whole transformers models: same targets, trainable set, outputs and grads as peft."""

from __future__ import annotations

import copy
import io
import re

import peft
import pytest
import torch
from torch import nn

import loragen
from loragen import LoraConfig, LoraConversionError, LoraLayer
from loragen.convert import find_lora_layers
from tests.conftest import tiny_inputs

CASES = {
    "llama-list": ("llama", dict(target_modules=["q_proj", "v_proj"])),
    "llama-regex": ("llama", dict(target_modules=r".*layers\.1\.self_attn\.(q|k)_proj")),
    "llama-all-linear": ("llama", dict(target_modules="all-linear")),
    "llama-patterns-rslora": (
        "llama",
        dict(
            target_modules=["q_proj", "k_proj", "down_proj"],
            r=4,
            lora_alpha=16,
            rank_pattern={"q_proj": 2, r"layers\.1\.self_attn\.k_proj": 6},
            alpha_pattern={"down_proj": 3},
            use_rslora=True,
        ),
    ),
    "llama-layers": (
        "llama",
        dict(target_modules=["q_proj", "o_proj"], layers_to_transform=[1], layers_pattern="layers"),
    ),
    "llama-layers-nopattern": ("llama", dict(target_modules=["gate_proj"], layers_to_transform=0)),
    "llama-embedding": (
        "llama",
        dict(target_modules=["embed_tokens", "q_proj"], exclude_modules=["layers.0.self_attn.q_proj"]),
    ),
    "gpt2-conv1d": ("gpt2", dict(target_modules=["c_attn", "c_proj"], fan_in_fan_out=True)),
    "gpt2-all-linear": ("gpt2", dict(target_modules="all-linear", bias="lora_only")),
    "bert-hybrid": (
        "bert",
        dict(target_modules=["query", "value"], modules_to_save=["classifier"], bias="lora_only"),
    ),
    "bert-bias-all": ("bert", dict(target_modules=["key", "dense"], bias="all")),
    "t5": ("t5", dict(target_modules=["q", "v", "wo"], modules_to_save=["final_layer_norm"])),
    "t5-bias-all": ("t5", dict(target_modules=["q", "v"], bias="all")),
}


def _peft_trainable_names(peft_model: nn.Module) -> set[str]:
    names = set()
    for name, p in peft_model.named_parameters():
        if not p.requires_grad:
            continue
        key = name.removeprefix("base_model.model.")
        key = re.sub(r"\.(lora_\w+)\.default(\.weight)?$", r".\1", key)
        names.add(key.replace(".modules_to_save.default.", ".").replace(".base_layer.", "."))
    return names


def _copy_factors_into_peft(ours: nn.Module, peft_model: nn.Module, seed: int = 3) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for path, layer in find_lora_layers(ours).items():
            theirs = peft_model.base_model.model.get_submodule(path)
            for name, p in layer.lora_parameters().items():
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
                target = getattr(theirs, name)["default"]
                (target.weight if hasattr(target, "weight") else target).copy_(p)


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_peft(case: str, make_tiny_model) -> None:
    kind, cfg = CASES[case]
    base = make_tiny_model(kind)
    peft_model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(**cfg))
    ours = loragen.get_lora_model(copy.deepcopy(base), LoraConfig(**cfg))
    assert ours.loragen_config.target_modules == LoraConfig(**cfg).target_modules

    peft_paths = {
        name.removeprefix("base_model.model.")
        for name, m in peft_model.named_modules()
        if isinstance(m, peft.tuners.lora.LoraLayer)
    }
    assert set(find_lora_layers(ours)) == peft_paths
    for path, layer in find_lora_layers(ours).items():
        theirs = peft_model.base_model.model.get_submodule(path)
        assert layer.r == theirs.r["default"], path
        assert layer.scaling == pytest.approx(theirs.scaling["default"]), path

    ours_trainable = {n for n, p in ours.named_parameters() if p.requires_grad}
    assert ours_trainable == _peft_trainable_names(peft_model)

    _copy_factors_into_peft(ours, peft_model)
    inputs = tiny_inputs(kind)
    out_theirs = peft_model(**inputs).logits
    out_ours = ours(**inputs).logits
    torch.testing.assert_close(out_ours, out_theirs, atol=1e-5, rtol=1e-5)
    out_theirs.square().mean().backward()
    out_ours.square().mean().backward()
    theirs_params = dict(peft_model.named_parameters())
    for name, p in ours.named_parameters():
        if not p.requires_grad:
            continue
        candidates = [
            n
            for n in theirs_params
            if n.startswith("base_model.model.")
            and _peft_trainable_names_one(n) == name
            and theirs_params[n].requires_grad
        ]
        assert len(candidates) == 1, (name, candidates)
        torch.testing.assert_close(p.grad, theirs_params[candidates[0]].grad, atol=1e-5, rtol=1e-4, msg=name)


def _peft_trainable_names_one(name: str) -> str:
    name = name.removeprefix("base_model.model.")
    name = re.sub(r"\.(lora_\w+)\.default(\.weight)?$", r".\1", name)
    return name.replace(".modules_to_save.default.", ".").replace(".base_layer.", ".")


def test_counts_match_peft(make_tiny_model) -> None:
    cfg = dict(target_modules=["query", "value"], modules_to_save=["classifier"])
    base = make_tiny_model("bert")
    peft_model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(**cfg))
    ours = loragen.get_lora_model(copy.deepcopy(base), LoraConfig(**cfg))
    buf = io.StringIO()
    trainable, total = loragen.print_trainable_parameters(ours, file=buf)
    peft_trainable, peft_total = peft_model.get_nb_trainable_parameters()
    assert trainable == peft_trainable
    # peft's total counts its extra copy of each module to save; ours trains the module in place
    classifier = sum(p.numel() for p in base.classifier.parameters())
    assert total == peft_total - classifier
    assert f"trainable params: {trainable:,d}" in buf.getvalue()


def test_returns_same_object_and_base_checkpoint_loads(make_tiny_model) -> None:
    base = make_tiny_model("llama")
    state = copy.deepcopy(base.state_dict())
    model = loragen.get_lora_model(base, LoraConfig(target_modules=["q_proj", "v_proj"]))
    assert model is base
    result = model.load_state_dict(state, strict=False)
    assert not result.unexpected_keys
    assert result.missing_keys and all(".lora_" in k for k in result.missing_keys)


def test_merge_adapter_unmerge_and_unload(make_tiny_model) -> None:
    model = loragen.get_lora_model(
        make_tiny_model("gpt2"), LoraConfig(target_modules="all-linear", init_lora_weights=False)
    )
    inputs = tiny_inputs("gpt2")
    with torch.no_grad():
        expected = model(**inputs).logits
        loragen.merge_adapter(model)
        loragen.merge_adapter(model)
        torch.testing.assert_close(model(**inputs).logits, expected, atol=1e-5, rtol=1e-5)
        loragen.unmerge_adapter(model)
        torch.testing.assert_close(model(**inputs).logits, expected, atol=1e-5, rtol=1e-5)
        plain = loragen.merge_and_unload(model)
        assert plain is model and not find_lora_layers(plain)
        assert not hasattr(plain, "loragen_config")
        torch.testing.assert_close(plain(**inputs).logits, expected, atol=1e-5, rtol=1e-5)


def test_merge_and_unload_matches_peft(make_tiny_model) -> None:
    cfg = dict(target_modules=["c_attn", "c_fc"], r=4, lora_alpha=12)
    base = make_tiny_model("gpt2")
    peft_model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(**cfg))
    ours = loragen.get_lora_model(copy.deepcopy(base), LoraConfig(**cfg))
    _copy_factors_into_peft(ours, peft_model)
    merged_theirs = peft_model.merge_and_unload().state_dict()
    merged_ours = loragen.merge_and_unload(ours).state_dict()
    assert merged_theirs.keys() == merged_ours.keys()
    for key in merged_ours:
        torch.testing.assert_close(merged_ours[key], merged_theirs[key], atol=1e-6, rtol=1e-6, msg=key)


# ---- errors -------------------------------------------------------------------------------------


class WithUnsupported(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.attn = nn.MultiheadAttention(4, 2)


def test_unsupported_target_names_path_type_and_supported_types() -> None:
    with pytest.raises(
        LoraConversionError,
        match=r"norm \(torch\.nn\.modules\.normalization\.LayerNorm\).*"
        r"Supported layer types(?=.*torch\.nn\.Linear)(?=.*torch\.nn\.Conv2d)",
    ):
        loragen.get_lora_model(WithUnsupported(), LoraConfig(target_modules=["proj", "norm"]))


def test_subclass_of_linear_is_refused_not_silently_converted() -> None:
    model = WithUnsupported()
    with pytest.raises(
        LoraConversionError,
        match=r"attn\.out_proj \(torch\.nn\.modules\.linear\.NonDynamicallyQuantizableLinear\)",
    ):
        loragen.get_lora_model(model, LoraConfig(target_modules=["out_proj"]))
    assert not find_lora_layers(model)


def test_no_match_repeats_patterns_and_shows_module_names(make_tiny_model) -> None:
    with pytest.raises(
        LoraConversionError,
        match=r"target_modules=\['query_proj'\] matched no module of "
        r"LlamaForCausalLM\. Its modules include: .*self_attn\.q_proj",
    ):
        loragen.get_lora_model(make_tiny_model("llama"), LoraConfig(target_modules=["query_proj"]))


def test_no_match_with_layers_to_transform_says_so(make_tiny_model) -> None:
    with pytest.raises(LoraConversionError, match=r"layers_to_transform=\(7,\)"):
        loragen.get_lora_model(
            make_tiny_model("llama"), LoraConfig(target_modules=["q_proj"], layers_to_transform=[7])
        )


def test_converting_twice_is_refused(make_tiny_model) -> None:
    model = loragen.get_lora_model(make_tiny_model("llama"), LoraConfig(target_modules=["q_proj"]))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(
        LoraConversionError, match=r"already has LoRA layers \(model\.layers\.0\.self_attn\.q_proj"
    ):
        loragen.get_lora_model(model, LoraConfig(target_modules=["v_proj"]))
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_missing_target_modules_is_explained() -> None:
    with pytest.raises(LoraConversionError, match=r"target_modules is None"):
        loragen.get_lora_model(nn.Sequential(nn.Linear(2, 2)), LoraConfig())


def test_config_is_a_loraconfig_or_a_peft_one() -> None:
    model = loragen.get_lora_model(nn.Sequential(nn.Linear(2, 2)), peft.LoraConfig(r=2, target_modules=["0"]))
    assert model.loragen_config == LoraConfig.from_peft(peft.LoraConfig(r=2, target_modules=["0"]).to_dict())
    with pytest.raises(TypeError, match=r"config must be a loragen\.LoraConfig, got dict.*from_peft"):
        loragen.get_lora_model(nn.Sequential(nn.Linear(2, 2)), {"r": 2})  # type: ignore[arg-type]


def test_merge_without_lora_layers_is_an_error() -> None:
    with pytest.raises(LoraConversionError, match=r"cannot merge: Sequential has no LoRA layers"):
        loragen.merge_adapter(nn.Sequential(nn.Linear(2, 2)))


def test_mark_trainable_on_constructed_lora_model() -> None:
    model = nn.Sequential(loragen.LoraLinear(4, 4, r=2), nn.LayerNorm(4), nn.Linear(4, 2))
    loragen.mark_trainable(model, LoraConfig(modules_to_save=["2"], bias="lora_only"))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {"0.lora_A", "0.lora_B", "0.bias", "2.weight", "2.bias"}
    assert isinstance(model[0], LoraLayer)
