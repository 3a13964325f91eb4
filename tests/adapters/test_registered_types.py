"""A layer type registered by the user saves, loads and merges offline with no other change."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import loragen
from loragen import LoraConfig, get_lora_model, load_adapter, merge_and_unload, save_adapter
from loragen.adapters.offline_merge import merge_checkpoint
from loragen.registry import unregister
from tests.adapters.helpers import perturb_trainable


class ToyLinear(nn.Module):
    """A user's layer that behaves like a Linear: weight (out, in)."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in))

    bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t()


class ToyConv1D(nn.Module):
    """A user's layer with its weight stored (in, out), like transformers' Conv1D."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_in, d_out))
        self.bias = nn.Parameter(torch.randn(d_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight + self.bias


class ToyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = ToyLinear(6, 10)
        self.mix = ToyConv1D(10, 7)
        self.down = nn.Linear(7, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.mix(torch.relu(self.up(x)))))


@pytest.fixture
def toy_types():
    specs = [loragen.register_layer(ToyLinear), loragen.register_layer(ToyConv1D, layout="transposed")]
    yield
    for spec in specs:
        unregister(spec.base_qualname)


def toy_net() -> ToyNet:
    torch.manual_seed(0)
    return ToyNet().eval()


def test_registered_types_save_load_and_merge(toy_types, tmp_path: Path) -> None:
    config = LoraConfig(r=3, lora_alpha=6, target_modules=["up", "mix", "down"])
    model = get_lora_model(toy_net(), config)
    perturb_trainable(model, seed=9)
    x = torch.randn(4, 6)
    with torch.no_grad():
        expected = model(x)
    save_adapter(model, tmp_path / "adapter")
    save_file(toy_net().state_dict(), tmp_path / "base.safetensors")

    assert set(load_file(tmp_path / "adapter" / "adapter_model.safetensors")) == {
        f"base_model.model.{m}.lora_{f}.weight" for m in ("up", "mix", "down") for f in "AB"
    }
    loaded = load_adapter(toy_net(), tmp_path / "adapter")
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), expected)

    report = merge_checkpoint(
        tmp_path / "base.safetensors", tmp_path / "adapter", tmp_path / "out.safetensors"
    )

    assert set(report.merged) == {"up.weight", "mix.weight", "down.weight"}
    reference = merge_and_unload(model).state_dict()
    merged = load_file(tmp_path / "out.safetensors")
    for key, value in reference.items():
        torch.testing.assert_close(merged[key], value, rtol=1e-6, atol=1e-6, msg=key)
