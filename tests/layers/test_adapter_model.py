"""One adapter model: every adapter of a layer, the first included, is a ``LoraAdapter`` made, read and
removed the same way; its variant (plain LoRA or DoRA) is chosen once; every forward path computes
``base + term`` or a fused op that equals it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import loragen
from loragen.errors import LoraConversionError
from loragen.layers import LoraAdapter, LoraConv2d, LoraEmbedding, LoraLinear
from loragen.layers.adapter_set import adapter_factors, add_factors, records, remove_factors
from loragen.layers.variants import CONV_DORA, EMBEDDING_DORA, LINEAR_DORA, LORA
from loragen.layouts import EmbeddingLayout, Layout


def _randomise(layer: nn.Module) -> None:
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for adapter in records(layer).values():
            for p in adapter.lora_parameters().values():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if p.dim() == 1 else 0.0))


def test_every_adapter_is_made_and_read_the_same_way() -> None:
    layer = LoraLinear(6, 5, r=2)
    other = add_factors(layer, "other", r=3, lora_alpha=6)
    first = adapter_factors(layer, "default")
    assert isinstance(first, LoraAdapter) and isinstance(other, LoraAdapter)
    assert list(records(layer)) == ["default", "other"]
    assert (first.r, tuple(first.factor_a.shape)) == (2, (2, 6))
    assert (other.r, tuple(other.factor_a.shape), other.scaling) == (3, (3, 6), 2.0)
    # the keys a single-adapter model has always had, further adapters under lora_adapters.<name>
    assert sorted(layer.state_dict()) == [
        "bias",
        "lora_A",
        "lora_B",
        "lora_adapters.other.lora_A",
        "lora_adapters.other.lora_B",
        "weight",
    ]
    assert first.factor_a is layer.lora_A and layer.r == 2 and layer.scaling == 4.0


def test_deleting_the_first_adapter_makes_the_next_one_the_layers_own() -> None:
    layer = LoraLinear(6, 5, r=2, use_dora=True)
    other = add_factors(layer, "other", r=3, lora_alpha=3)
    a, b = other.factor_a, other.factor_b
    assert remove_factors(layer, "default")
    assert list(records(layer)) == ["other"] and layer.adapter_name == "other"
    assert layer.lora_A is a and layer.lora_B is b  # the same parameter objects, now <path>.lora_A
    assert sorted(layer.state_dict()) == [
        "bias",
        "lora_A",
        "lora_B",
        "weight",
    ]  # DoRA's magnitude went with it
    assert not remove_factors(layer, "other")  # the last adapter: the caller turns the layer back


def test_an_adapter_reads_its_parameters_where_they_are_registered() -> None:
    """``load_state_dict(assign=True)`` (and FSDP, ``to_empty``) put new parameter objects in place: the
    adapter computes with those, not with the ones it was made with."""
    layer = LoraLinear(6, 5, r=2)
    add_factors(layer, "other", r=2, lora_alpha=2)
    state = {k: torch.randn_like(v) for k, v in layer.state_dict().items()}
    layer.load_state_dict(state, assign=True)
    other = adapter_factors(layer, "other")
    assert torch.equal(layer.factor_a, state["lora_A"]) and torch.equal(
        other.factor_b, state["lora_adapters.other.lora_B"]
    )
    layer.active_adapter = "other"
    x = torch.randn(4, 6)
    expected = (
        x @ state["weight"].t()
        + state["bias"]
        + (x @ state["lora_adapters.other.lora_A"].t()) @ state["lora_adapters.other.lora_B"].t()
    )
    torch.testing.assert_close(layer(x), expected)


@pytest.mark.parametrize(
    ("make", "x", "dora"),
    [
        (lambda: LoraLinear(6, 5, r=2), torch.randn(3, 4, 6), LINEAR_DORA),
        (lambda: LoraEmbedding(11, 6, r=2), torch.randint(0, 11, (3, 4)), EMBEDDING_DORA),
        (lambda: LoraConv2d(3, 4, 3, padding=1, r=2), torch.randn(2, 3, 5, 5), CONV_DORA),
    ],
    ids=["linear", "embedding", "conv2d"],
)
def test_the_variant_is_chosen_once_and_every_path_agrees(make, x, dora) -> None:  # type: ignore[no-untyped-def]
    layer = make()
    add_factors(layer, "dora", r=3, lora_alpha=3, use_dora=True)
    add_factors(layer, "plain", r=3, lora_alpha=3)
    assert [a.variant for a in records(layer).values()] == [LORA, dora, LORA]
    _randomise(layer)
    base = layer._base_output(x)
    for name, adapter in records(layer).items():
        layer.active_adapter = name
        readable = adapter.variant.output(layer, x, adapter, layer._base_output(x))
        torch.testing.assert_close(
            layer(x), readable, rtol=1e-5, atol=1e-5
        )  # fused ops where the type has them
        layer.fused = False
        torch.testing.assert_close(layer(x), readable, rtol=0, atol=0)
        del layer.fused
        assert not torch.allclose(readable, base)  # the adapter does something
        layer.merge()  # the variant's merge: merged and unmerged outputs agree
        torch.testing.assert_close(layer(x), readable, rtol=1e-4, atol=1e-4)
        layer.unmerge()
    layer.active_adapter = None  # adapters off: the base output alone (after merges, up to their rounding)
    torch.testing.assert_close(layer(x), layer._base_output(x), rtol=0, atol=0)


def test_dora_where_the_type_has_no_dora_variant_is_refused() -> None:
    class Scaled(nn.Linear):
        pass

    class LoraScaled(loragen.LoraLayer, Scaled):
        def _factor_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
            return (self.r, self.in_features), (self.out_features, self.r)

        def _adapter_output(self, x: torch.Tensor, adapter: LoraAdapter) -> torch.Tensor:
            return (x @ adapter.factor_a.t()) @ adapter.factor_b.t() * adapter.scaling

    spec = loragen.register_layer(Scaled, LoraScaled)
    try:
        with pytest.raises(LoraConversionError, match="LoraScaled: this LoRA class does not implement DoRA"):
            LoraScaled.from_module(Scaled(4, 3), r=2, use_dora=True)
    finally:
        loragen.registry.unregister(spec.base_qualname)


def test_layouts_are_types_with_their_own_maths() -> None:
    with pytest.raises(TypeError, match="abstract"):
        Layout("toy", ("a", "b"), ("a.weight", "b.weight"))  # type: ignore[abstract]
    a, b = torch.empty(2, 7), torch.empty(5, 2)
    EmbeddingLayout("e", ("a", "b"), ("a", "b")).init_factors(a, b, 2, True)
    assert torch.equal(a, torch.zeros_like(a)) and b.std() > 0  # peft's embedding init: A zeros, B normal
