"""``mixed_batch``: each row uses its own adapter, on every layer type, against peft and against running
the model once per adapter; and the errors it names."""

from __future__ import annotations

import warnings

import peft
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import loragen
from loragen import LoraConfig
from tests.adapters.helpers import ConvNet

NAMES = ["default", "a", "b"]


class Block(nn.Module):
    """q/k/v projections reading one input and an output projection."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.o = nn.Linear(8, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(self.q(x) * self.k(x) + self.v(x))


def _block_model() -> nn.Module:
    torch.manual_seed(0)
    model = loragen.get_lora_model(
        Block(), LoraConfig(r=4, target_modules=["q", "k", "v"], init_lora_weights=False)
    )
    loragen.add_adapter(
        model, LoraConfig(r=2, lora_alpha=5, target_modules=["q", "o"], init_lora_weights=False), "a"
    )
    loragen.add_adapter(model, LoraConfig(r=3, target_modules=["k", "v", "o"], init_lora_weights=False), "b")
    return model.eval()


def _row_by_row(model: nn.Module, x: torch.Tensor, rows: list[str]) -> torch.Tensor:
    """Row i of the model's output with adapter rows[i] active (``__base__``: adapters off)."""
    out = []
    active = loragen.active_adapter(model)
    for i, name in enumerate(rows):
        if name == "__base__":
            with loragen.disable_adapter(model):
                out.append(model(x[i : i + 1]))
        else:
            loragen.set_adapter(model, name)
            out.append(model(x[i : i + 1]))
    if active is not None:
        loragen.set_adapter(model, active)
    return torch.cat(out)


@given(st.lists(st.sampled_from([*NAMES, "__base__"]), min_size=1, max_size=7), st.integers(1, 4))
def test_mixed_batch_is_the_model_row_by_row(rows: list[str], seq: int) -> None:
    model = _block_model()
    x = torch.randn(len(rows), seq, 8, generator=torch.Generator().manual_seed(len(rows)))
    with torch.no_grad(), loragen.mixed_batch(model, rows):
        mixed = model(x)
    with torch.no_grad():
        expected = _row_by_row(model, x, rows)
    torch.testing.assert_close(mixed, expected, atol=1e-5, rtol=1e-5)


def test_mixed_batch_restores_the_routing_after_the_block() -> None:
    model = _block_model()
    x = torch.randn(3, 8)
    before = model(x)
    with loragen.mixed_batch(model, ["a", "b", "a"]):
        with loragen.mixed_batch(model, ["b", "b", "__base__"]):  # nested: the inner names win
            inner = model(x)
        outer = model(x)
    torch.testing.assert_close(model(x), before, atol=0, rtol=0)
    torch.testing.assert_close(inner, _row_by_row(model, x, ["b", "b", "__base__"]), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(outer, _row_by_row(model, x, ["a", "b", "a"]), atol=1e-6, rtol=1e-6)


def test_embedding_and_conv_layers_equal_peft() -> None:
    rows = ["default", "__base__", "other", "other"]
    g = torch.Generator().manual_seed(0)
    ids, image = torch.randint(0, 20, (4, 5), generator=g), torch.randn(4, 3, 9, 9, generator=g)
    first = dict(r=2, lora_alpha=4, target_modules=["emb", "conv1", "conv2", "head"], init_lora_weights=False)
    second = dict(r=3, lora_alpha=3, target_modules=["emb", "conv2"], init_lora_weights=False)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = peft.get_peft_model(ConvNet(), peft.LoraConfig(**first))
        theirs.add_adapter("other", peft.LoraConfig(**second))
    theirs.eval()
    torch.manual_seed(0)
    ours = loragen.get_lora_model(ConvNet(), LoraConfig(**first))
    loragen.add_adapter(ours, LoraConfig(**second), "other")
    ours.eval()
    with torch.no_grad():  # the same factors on both sides
        for name, layer in loragen.convert.find_lora_layers(ours).items():
            peft_layer = theirs.base_model.model.get_submodule(name)
            for adapter in loragen.layers.adapter_set.adapter_names(layer):
                factors = loragen.layers.adapter_set.adapter_factors(layer, adapter)
                if name == "emb":
                    pa, pb = peft_layer.lora_embedding_A[adapter], peft_layer.lora_embedding_B[adapter]
                else:
                    pa, pb = peft_layer.lora_A[adapter].weight, peft_layer.lora_B[adapter].weight
                torch.nn.init.normal_(factors.factor_b, std=0.3)
                pa.copy_(factors.factor_a)
                pb.copy_(factors.factor_b)
        expected = theirs(ids, image, adapter_names=rows)
        with loragen.mixed_batch(ours, rows):
            actual = ours(ids, image)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_wrong_batch_length_names_the_layer() -> None:
    model = _block_model()
    with (
        loragen.mixed_batch(model, ["a", "b"]),
        pytest.raises(
            loragen.MixedBatchError,
            match=r"^q: mixed_batch was given 2 adapter names but the batch has 3 rows",
        ),
    ):
        model(torch.randn(3, 8))


def test_unknown_name_lists_the_known_ones() -> None:
    model = _block_model()
    with pytest.raises(loragen.MixedBatchError, match=r"unknown adapter name\(s\) 'c'.*'default', 'a', 'b'"):
        with loragen.mixed_batch(model, ["a", "c"]):
            pass  # pragma: no cover


def test_training_mode_and_merged_layers_are_refused() -> None:
    model = _block_model()
    model.train()
    with pytest.raises(loragen.MixedBatchError, match=r"model\.eval"):
        with loragen.mixed_batch(model, ["a"]):
            pass  # pragma: no cover
    model.eval()
    loragen.merge_adapter(model)
    with pytest.raises(loragen.MixedBatchError, match="unmerge_adapter"):
        with loragen.mixed_batch(model, ["a"]):
            pass  # pragma: no cover
    with pytest.raises(loragen.MixedBatchError, match="list of adapter names"):
        with loragen.mixed_batch(model, "a"):
            pass  # pragma: no cover


def test_the_fused_op_gives_the_composition_s_outputs_whatever_adapter_each_layer_runs() -> None:
    model = _block_model()
    x = torch.randn(3, 4, 8, requires_grad=True)
    for name in [*NAMES, None]:
        outputs = []
        for fused in (True, False):
            with loragen.switches.fused.using(fused), torch.no_grad():
                if name is None:
                    with loragen.disable_adapter(model):
                        outputs.append(model(x))
                else:
                    loragen.set_adapter(model, name)
                    outputs.append(model(x))
        torch.testing.assert_close(outputs[0], outputs[1], atol=1e-5, rtol=1e-5)


def test_disable_adapter_wins_over_a_mixed_batch() -> None:
    model = _block_model()
    x = torch.randn(2, 8)
    with loragen.disable_adapter(model):
        base = model(x)
    with loragen.mixed_batch(model, ["a", "b"]), loragen.disable_adapter(model):
        torch.testing.assert_close(model(x), base, atol=0, rtol=0)
