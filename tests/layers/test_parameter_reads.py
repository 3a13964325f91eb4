"""loragen.layers.parameter_reads.parameter: what ``getattr`` returns, read from ``_parameters`` where that is
where the attribute lookup ends, and the plain lookup everywhere else."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

import loragen
from loragen import LoraConfig
from loragen.layers.parameter_reads import parameter
from loragen.reference import lora_linear_reference


class _Doubled(nn.Module):
    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return 2 * weight


class _WeightProperty(nn.Module):
    """A module whose class computes ``weight`` from a parameter of another name."""

    def __init__(self) -> None:
        super().__init__()
        self.raw = nn.Parameter(torch.ones(3, 3))

    @property
    def weight(self) -> torch.Tensor:
        return self.raw * 3


def test_registered_parameters_and_none_come_from_the_registry() -> None:
    layer = nn.Linear(4, 3)
    assert parameter(layer, "weight") is layer.weight
    assert parameter(layer, "bias") is layer.bias
    unbiased = nn.Linear(4, 3, bias=False)
    assert parameter(unbiased, "bias") is None


def test_everything_else_is_the_plain_lookup() -> None:
    module = _WeightProperty()
    torch.testing.assert_close(parameter(module, "weight"), torch.full((3, 3), 3.0))  # the class's property
    module._parameters["weight"] = nn.Parameter(torch.zeros(3, 3))  # shadowed by the class's property
    torch.testing.assert_close(parameter(module, "weight"), module.weight)
    torch.testing.assert_close(parameter(module, "weight"), torch.full((3, 3), 3.0))
    module.register_buffer("scale", torch.tensor(2.0))
    assert parameter(module, "scale") is module.scale  # a buffer
    with pytest.raises(AttributeError, match="missing"):
        parameter(module, "missing")


def test_a_parametrized_weight_is_what_the_fused_forward_reads() -> None:
    torch.manual_seed(0)
    model = loragen.get_lora_model(
        nn.Sequential(nn.Linear(8, 6)), LoraConfig(r=2, lora_alpha=4, target_modules=["0"])
    )
    layer = model[0]
    with torch.no_grad():
        layer.lora_B.normal_()
    x = torch.randn(5, 8)
    parametrize.register_parametrization(layer, "weight", _Doubled())
    assert parameter(layer, "weight") is not layer.parametrizations.weight.original
    torch.testing.assert_close(parameter(layer, "weight"), 2 * layer.parametrizations.weight.original)
    expected = lora_linear_reference(
        x, layer.weight, layer.bias, layer.lora_A, layer.lora_B, layer.scaling, 0.0, False
    )
    torch.testing.assert_close(model(x), expected)
