"""LoRA classes for subclasses of nn.Linear and for registered layer types: conversion keeps the module's
state, the subclass's own forward computes the base output, merges are exact or refused, and the classes
pickle."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

import loragen
from loragen import LoraConfig
from loragen.errors import LoraConversionError, LoraMergeError
from loragen.layers import LoraLinear, lora_class_for
from loragen.registry import unregister


class ScaledLinear(nn.Linear):
    """A subclass whose forward is not x W^T + b: merging into its weight would be wrong."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2.0


class TransposedMatmul(nn.Linear):
    """A subclass whose forward computes x W^T + b another way (as Falcon's FalconLinear does)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x @ self.weight.T
        return out if self.bias is None else out + self.bias


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = TransposedMatmul(6, 5)
        self.scaled = ScaledLinear(5, 4)
        self.proj.note = "kept"  # an attribute of the instance survives conversion

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scaled(self.proj(x))


def _lora_block(seed: int = 0) -> Block:
    torch.manual_seed(seed)
    block = Block()
    config = LoraConfig(r=2, lora_alpha=4, target_modules=["proj", "scaled"], init_lora_weights=False)
    return loragen.get_lora_model(block, config)


def _reference(block: Block, x: torch.Tensor) -> torch.Tensor:
    """base forward + scaling * B A x for every LoRA layer, computed by hand."""

    def branch(layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
        return h @ layer.lora_A.t() @ layer.lora_B.t() * layer.scaling

    h = x @ block.proj.weight.t() + block.proj.bias + branch(block.proj, x)
    return (h @ block.scaled.weight.t() + block.scaled.bias) * 2.0 + branch(block.scaled, h)


def test_subclasses_convert_with_their_own_forward_and_keep_their_state() -> None:
    block = _lora_block()
    assert isinstance(block.proj, LoraLinear) and isinstance(block.proj, TransposedMatmul)
    assert type(block.proj).__name__ == "LoraTransposedMatmul"
    assert block.proj.note == "kept"
    assert set(block.state_dict()) == {
        "proj.weight",
        "proj.bias",
        "proj.lora_A",
        "proj.lora_B",
        "scaled.weight",
        "scaled.bias",
        "scaled.lora_A",
        "scaled.lora_B",
    }
    x = torch.randn(3, 6)
    torch.testing.assert_close(block(x), _reference(block, x))


def test_merge_is_exact_when_the_subclass_forward_is_linear_and_refused_otherwise() -> None:
    block = _lora_block()
    x = torch.randn(3, 6)
    before = block.proj(x)
    block.proj.merge()
    torch.testing.assert_close(block.proj(x), before, rtol=1e-5, atol=1e-5)
    with pytest.raises(
        LoraMergeError, match=r"scaled: cannot merge into LoraScaledLinear: its forward does not"
    ):
        loragen.merge_adapter(block)
    block.proj.unmerge()
    with pytest.raises(LoraMergeError, match=r"scaled: .*forward does not compute x W\^T \+ b"):
        loragen.merge_and_unload(block)
    assert not block.proj.merged  # a refusal changes nothing


def test_merge_and_unload_gives_the_subclass_back() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(TransposedMatmul(4, 4))
    loragen.get_lora_model(model, LoraConfig(r=2, target_modules=["0"], init_lora_weights=False))
    x = torch.randn(2, 4)
    expected = model(x)
    loragen.merge_and_unload(model)
    assert type(model[0]) is TransposedMatmul
    assert set(model.state_dict()) == {"0.weight", "0.bias"}
    torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)


def test_derived_classes_pickle_deepcopy_and_construct_like_the_base() -> None:
    block = _lora_block()
    x = torch.randn(3, 6)
    expected = block(x)
    for clone in (pickle.loads(pickle.dumps(block)), copy.deepcopy(block)):
        assert type(clone.proj) is type(block.proj)
        torch.testing.assert_close(clone(x), expected)
    cls = lora_class_for(TransposedMatmul)
    layer = cls(6, 3, bias=False, r=4, lora_alpha=8)
    assert layer.lora_A.shape == (4, 6) and layer.lora_B.shape == (3, 4) and layer.bias is None
    assert layer.scaling == 2.0 and cls is lora_class_for(TransposedMatmul)


def test_hooks_on_the_base_module_stay_with_the_lora_layer() -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    seen = []
    handle = model[0].register_forward_hook(lambda module, args, out: seen.append(type(module).__name__))
    loragen.get_lora_model(model, LoraConfig(target_modules=["0"]))
    model(torch.randn(1, 4))
    assert seen == ["LoraLinear"]
    handle.remove()
    model(torch.randn(1, 4))
    assert seen == ["LoraLinear"]


def test_multihead_attention_out_proj_is_refused_with_the_reason() -> None:
    model = nn.ModuleDict({"attn": nn.MultiheadAttention(8, 2)})
    with pytest.raises(LoraConversionError, match=r"attn\.out_proj .*never calls its forward"):
        loragen.get_lora_model(model, LoraConfig(target_modules=["out_proj"]))
    # all-linear leaves it out (peft would wrap a layer whose forward never runs)
    with pytest.raises(LoraConversionError, match="matched no module"):
        loragen.get_lora_model(model, LoraConfig(target_modules="all-linear"))


class ToyLinear(nn.Module):
    """A user's own layer that behaves like a Linear (weight (out, in), no bias)."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in))

    bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t()


@pytest.fixture
def toy_registered():
    spec = loragen.register_layer(ToyLinear)
    yield spec
    unregister(spec.base_qualname)


def test_register_layer_makes_a_linear_like_type_convertible(toy_registered) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(ToyLinear(5, 3))
    loragen.get_lora_model(model, LoraConfig(r=2, target_modules="all-linear", init_lora_weights=False))
    layer = model[0]
    assert isinstance(layer, loragen.LoraLayer) and isinstance(layer, ToyLinear)
    assert layer.lora_A.shape == (2, 5) and layer.lora_B.shape == (3, 2)
    x = torch.randn(4, 5)
    expected = x @ layer.weight.t() + x @ layer.lora_A.t() @ layer.lora_B.t() * layer.scaling
    torch.testing.assert_close(model(x), expected)
    loragen.merge_and_unload(model)
    assert type(model[0]) is ToyLinear
    torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)


def test_register_layer_errors_name_the_problem() -> None:
    with pytest.raises(TypeError, match=r"is not an nn\.Module subclass"):
        loragen.register_layer(int)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="layout='sideways'"):
        loragen.register_layer(ToyLinear, layout="sideways")
    with pytest.raises(TypeError, match=r"must derive from both loragen\.LoraLayer and ToyLinear"):
        loragen.register_layer(ToyLinear, LoraLinear)
    with pytest.raises(ValueError, match=r"torch\.nn\.Linear is registered already"):
        loragen.register_layer(nn.Linear)


class ScoringRouter(nn.Linear):
    """A linear router that returns (scores, logits), as transformers' Llama-4 and PhiMoE routers do."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        logits = super().forward(x)
        return logits.softmax(-1), logits


class Routed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = ScoringRouter(6, 4)
        self.proj = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores, _ = self.router(x)
        return self.proj(x) * scores.sum(-1, keepdim=True)


def test_a_linear_subclass_returning_several_values_says_so_at_its_first_forward() -> None:
    model = loragen.get_lora_model(Routed(), LoraConfig(target_modules="all-linear", init_lora_weights=False))
    with pytest.raises(
        LoraConversionError, match=r"LoraScoringRouter: .* returns a tuple, not a tensor.*exclude"
    ):
        model(torch.randn(2, 6))
    excluded = loragen.get_lora_model(
        Routed(), LoraConfig(target_modules="all-linear", exclude_modules=["router"], init_lora_weights=False)
    )
    assert excluded(torch.randn(2, 6)).shape == (2, 6)
