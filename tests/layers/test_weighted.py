"""``add_weighted_adapter`` properties (cat exact, svd exact at full rank, linear's formula) and the errors
of every named-adapter function."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import loragen
from loragen import LoraConfig
from loragen.convert import find_lora_layers


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(12, 6)
        self.conv = nn.Conv2d(6, 5, 3, padding=1)
        self.lin = nn.Linear(5, 7)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids).permute(0, 2, 1)[..., None]  # (N, 6, T, 1)
        return self.lin(self.conv(h).mean(dim=(2, 3)))


def _net(r_a: int = 2, r_b: int = 3, targets_b: list[str] | None = None) -> nn.Module:
    torch.manual_seed(0)
    model = loragen.get_lora_model(
        Net(), LoraConfig(r=r_a, lora_alpha=3, target_modules=["emb", "conv", "lin"])
    )
    loragen.add_adapter(
        model, LoraConfig(r=r_b, lora_alpha=2, target_modules=targets_b or ["emb", "conv", "lin"]), "b"
    )
    with torch.no_grad():  # move every factor off init (B starts at zero)
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(std=0.3)
    return model


@given(st.floats(-2, 2), st.floats(-2, 2))
def test_cat_adds_the_weighted_updates_exactly(w_a: float, w_b: float) -> None:
    model = _net()
    loragen.add_weighted_adapter(model, ["default", "b"], [w_a, w_b], "mix", combination_type="cat")
    for path, layer in find_lora_layers(model).items():
        expected = w_a * layer.delta_weight("default") + w_b * layer.delta_weight("b")
        torch.testing.assert_close(layer.delta_weight("mix"), expected, atol=1e-5, rtol=1e-5, msg=path)


def test_svd_at_full_rank_is_exact_and_truncates_below() -> None:
    model = _net()
    loragen.add_weighted_adapter(
        model, ["default", "b"], [1.0, -0.5], "full", combination_type="svd", svd_rank=5
    )
    loragen.add_weighted_adapter(
        model, ["default", "b"], [1.0, -0.5], "low", combination_type="svd", svd_rank=1
    )
    for layer in find_lora_layers(model).values():
        exact = layer.delta_weight("default") - 0.5 * layer.delta_weight("b")
        torch.testing.assert_close(layer.delta_weight("full"), exact, atol=1e-5, rtol=1e-4)
        flat = exact.flatten(1) if exact.shape[0] == layer.factor_b.shape[0] else exact.t()
        top = torch.linalg.svdvals(flat)[0]
        low = layer.delta_weight("low")
        low_flat = low.flatten(1) if low.shape[0] == layer.factor_b.shape[0] else low.t()
        assert torch.linalg.matrix_rank(low_flat) == 1
        torch.testing.assert_close(torch.linalg.svdvals(low_flat)[0], top, atol=1e-5, rtol=1e-4)


def test_linear_combines_the_factors_with_square_roots() -> None:
    model = _net(r_b=2)
    loragen.add_weighted_adapter(model, ["default", "b"], [0.5, -2.0], "lin", combination_type="linear")
    layer = find_lora_layers(model)["lin"]
    a_1, b_1, s_1 = layer.lora_A, layer.lora_B, layer.scaling
    other = loragen.layers.adapter_set.adapter_factors(layer, "b")
    c_1, c_2 = 0.5 * s_1, -2.0 * other.scaling
    mix = loragen.layers.adapter_set.adapter_factors(layer, "lin")
    torch.testing.assert_close(mix.factor_a, math.sqrt(c_1) * a_1 - math.sqrt(-c_2) * other.factor_a)
    torch.testing.assert_close(mix.factor_b, math.sqrt(c_1) * b_1 + math.sqrt(-c_2) * other.factor_b)
    assert mix.scaling == 1.0 and not mix.factor_a.requires_grad
    assert loragen.active_adapter(model) == "default"


def test_weighted_errors_name_the_adapters_and_what_differs() -> None:
    model = _net()
    with pytest.raises(loragen.AdapterMixError, match=r"linear.*'default' r=2, 'b' r=3.*'cat' or 'svd'"):
        loragen.add_weighted_adapter(model, ["default", "b"], [1.0, 1.0], "x", combination_type="linear")
    with pytest.raises(loragen.AdapterNameError, match=r"unknown adapter 'nope'; Net holds 'default', 'b'"):
        loragen.add_weighted_adapter(model, ["default", "nope"], [1.0, 1.0], "x")
    with pytest.raises(loragen.AdapterMixError, match=r"2 adapters \('default', 'b'\) but 1 weights"):
        loragen.add_weighted_adapter(model, ["default", "b"], [1.0], "x")
    with pytest.raises(loragen.AdapterMixError, match="finite numbers"):
        loragen.add_weighted_adapter(model, ["default", "b"], [1.0, float("nan")], "x")
    with pytest.raises(loragen.AdapterMixError, match=r"combination_type='ties'.*'cat', 'linear', 'svd'"):
        loragen.add_weighted_adapter(model, ["default", "b"], [1.0, 1.0], "x", combination_type="ties")
    with pytest.raises(loragen.AdapterNameError, match="'b' exists already"):
        loragen.add_weighted_adapter(model, ["default"], [1.0], "b")
    loragen.add_adapter(model, LoraConfig(r=2, target_modules=r".*lin"), "regex")
    with pytest.raises(loragen.AdapterMixError, match=r"mix a regex.*'regex': target_modules='\.\*lin'"):
        loragen.add_weighted_adapter(model, ["default", "regex"], [1.0, 1.0], "x", combination_type="cat")
    assert loragen.list_adapters(model) == ["default", "b", "regex"]  # nothing added by a refusal


def test_named_adapter_errors() -> None:
    model = _net()
    for call in (
        lambda: loragen.set_adapter(model, "c"),
        lambda: loragen.delete_adapter(model, "c"),
        lambda: loragen.save_adapter(model, "unused", selected_adapters=["c"]),
    ):
        with pytest.raises(loragen.AdapterNameError, match=r"unknown adapter 'c'; Net holds 'default', 'b'"):
            call()
    with pytest.raises(loragen.AdapterNameError, match="holds an adapter 'b' already"):
        loragen.add_adapter(model, LoraConfig(r=2, target_modules=["lin"]), "b")
    with pytest.raises(loragen.LoraConfigError, match=r"bias: adapters 'c'.*bias='none'"):
        loragen.add_adapter(model, LoraConfig(r=2, target_modules=["lin"], bias="all"), "c")
    with pytest.raises(loragen.LoraConfigError, match="modules_to_save"):
        loragen.add_adapter(model, LoraConfig(r=2, target_modules=["lin"], modules_to_save=["conv"]), "c")
    with pytest.raises(loragen.AdapterNameError, match=r"without '\.'"):
        loragen.add_adapter(model, LoraConfig(r=2, target_modules=["lin"]), "a.b")
    with pytest.raises(loragen.LoraConversionError, match="matched no module"):
        loragen.add_adapter(model, LoraConfig(r=2, target_modules=["nothing"]), "c")
    assert loragen.list_adapters(model) == ["default", "b"]


def test_adapter_on_a_new_layer_and_deleting_the_first_adapter_moves_the_next_in() -> None:
    model = _net(targets_b=["lin"])
    loragen.add_adapter(model, LoraConfig(r=2, target_modules=["conv"], init_lora_weights=False), "c")
    ids = torch.randint(0, 12, (2, 4))
    loragen.set_adapter(model, "b")
    with_b = model(ids)
    b_factor = loragen.layers.adapter_set.adapter_factors(model.lin, "b").factor_a
    loragen.delete_adapter(model, "default")
    assert model.lin.lora_A is b_factor and model.lin.adapter_name == "b"
    assert "lin.lora_A" in model.state_dict() and "emb.lora_embedding_A" not in model.state_dict()
    assert type(model.emb) is nn.Embedding  # its only adapter is gone: the base layer again
    torch.testing.assert_close(model(ids), with_b)
    assert b_factor.requires_grad and not model.conv.lora_A.requires_grad
