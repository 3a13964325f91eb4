"""LoRA layers: peft parity, merge exactness for every conv setting, dtypes, init, keys, errors."""

from __future__ import annotations

import copy
import math

import peft
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from transformers.pytorch_utils import Conv1D

from loragen import LoraConfigError, LoraConv1D, LoraConv1d, LoraConv2d, LoraConv3d, LoraEmbedding, LoraLinear
from loragen.layers import LoraMergeError, adapter_dtype_for

LORA_CLASSES = {
    nn.Linear: LoraLinear,
    nn.Embedding: LoraEmbedding,
    nn.Conv1d: LoraConv1d,
    nn.Conv2d: LoraConv2d,
    nn.Conv3d: LoraConv3d,
    Conv1D: LoraConv1D,
}


class Holder(nn.Module):
    """One layer under the name ``layer`` (peft needs a parent module to target)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


def _random_factors(layer, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.lora_parameters().values():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def _peft_pair(base: nn.Module, **cfg):
    """(peft model, loragen layer) over copies of ``base`` with identical A and B."""
    peft_model = peft.get_peft_model(
        Holder(copy.deepcopy(base)), peft.LoraConfig(target_modules=["layer"], **cfg)
    )
    ours = LORA_CLASSES[type(base)].from_module(
        copy.deepcopy(base),
        r=cfg.get("r", 8),
        lora_alpha=cfg.get("lora_alpha", 8),
        use_rslora=cfg.get("use_rslora", False),
    )
    theirs = peft_model.base_model.model.layer
    _random_factors(ours)
    with torch.no_grad():
        for name, p in ours.lora_parameters().items():
            target = getattr(theirs, name)["default"]
            (target.weight if hasattr(target, "weight") else target).copy_(p)
    return peft_model, ours


BASES = {
    "linear": (lambda: nn.Linear(6, 5), lambda: torch.randn(3, 4, 6)),
    "embedding": (lambda: nn.Embedding(11, 6, padding_idx=2), lambda: torch.randint(0, 11, (3, 4))),
    "conv1d": (lambda: nn.Conv1d(4, 5, 3, stride=2, padding=1), lambda: torch.randn(2, 4, 9)),
    "conv2d": (lambda: nn.Conv2d(4, 5, 3, padding=1), lambda: torch.randn(2, 4, 6, 7)),
    "conv3d": (
        lambda: nn.Conv3d(4, 5, (2, 3, 3), stride=(1, 2, 2), padding=1),
        lambda: torch.randn(2, 4, 3, 6, 7),
    ),
    "conv1D": (lambda: Conv1D(5, 6), lambda: torch.randn(3, 4, 6)),
}


@pytest.mark.parametrize("kind", sorted(BASES))
@pytest.mark.parametrize("use_rslora", [False, True])
def test_outputs_and_gradients_equal_peft(kind: str, use_rslora: bool) -> None:
    torch.manual_seed(0)
    make_base, make_input = BASES[kind]
    peft_model, ours = _peft_pair(make_base(), r=3, lora_alpha=5, use_rslora=use_rslora)
    x = make_input()
    theirs = peft_model.base_model.model.layer
    y_theirs, y_ours = peft_model(x), ours(x)
    torch.testing.assert_close(y_ours, y_theirs, atol=1e-5, rtol=1e-5)
    grad = torch.randn_like(y_ours)
    y_theirs.backward(grad)
    y_ours.backward(grad)
    for name, p in ours.lora_parameters().items():
        target = getattr(theirs, name)["default"]
        expected = target.weight.grad if hasattr(target, "weight") else target.grad
        torch.testing.assert_close(p.grad, expected, atol=1e-5, rtol=1e-5, msg=f"{kind}: grad of {name}")
    assert ours.scaling == pytest.approx(theirs.scaling["default"])


def test_base_keys_kept_and_base_checkpoint_loads() -> None:
    base = nn.Conv2d(3, 4, 3)
    layer = LoraConv2d.from_module(copy.deepcopy(base), r=2)
    keys = set(layer.state_dict())
    assert keys == {"weight", "bias", "lora_A", "lora_B"}
    result = layer.load_state_dict(base.state_dict(), strict=False)
    assert sorted(result.missing_keys) == ["lora_A", "lora_B"] and not result.unexpected_keys


def test_from_module_shares_parameters() -> None:
    base = nn.Linear(4, 3)
    layer = LoraLinear.from_module(base, r=2)
    assert layer.weight is base.weight and layer.bias is base.bias
    assert layer.lora_A.shape == (2, 4) and layer.lora_B.shape == (3, 2)


@pytest.mark.parametrize(
    ("layer", "a_shape", "b_shape"),
    [
        (lambda: LoraLinear(6, 5, r=3), (3, 6), (5, 3)),
        (lambda: LoraEmbedding(11, 6, r=3), (3, 11), (6, 3)),
        (lambda: LoraConv1d(4, 6, 5, groups=2, r=3), (3, 2, 5), (6, 3, 1)),
        (lambda: LoraConv2d(4, 6, (3, 2), r=3), (3, 4, 3, 2), (6, 3, 1, 1)),
        (lambda: LoraConv3d(4, 6, (2, 3, 2), groups=2, r=3), (3, 2, 2, 3, 2), (6, 3, 1, 1, 1)),
        (lambda: LoraConv1D(5, 6, r=3), (3, 6), (5, 3)),
    ],
)
def test_factor_shapes(layer, a_shape, b_shape) -> None:
    lora = layer()
    a, b = lora.lora_parameters().values()
    assert a.shape == a_shape and b.shape == b_shape
    assert lora.delta_weight().shape == lora.weight.shape


# ---- convolutions: merged == unmerged for every setting ------------------------------------------

conv_settings = st.fixed_dictionaries(
    {
        "dims": st.sampled_from([1, 2, 3]),
        "kernel": st.integers(1, 4),
        "stride": st.integers(1, 3),
        "dilation": st.integers(1, 3),
        "groups": st.sampled_from([1, 2, 4]),
        "padding": st.sampled_from([0, 1, 2, "same", "tuple"]),
        "padding_mode": st.sampled_from(["zeros", "reflect", "replicate", "circular"]),
        "r": st.integers(1, 5),
        "bias": st.booleans(),
    }
)


def _build_conv(s: dict) -> tuple[nn.Module, torch.Tensor]:
    dims, k = s["dims"], s["kernel"]
    stride = 1 if s["padding"] == "same" else s["stride"]  # torch forbids 'same' with stride > 1
    padding = (1, 2, 0)[:dims] if s["padding"] == "tuple" else s["padding"]
    cls = {1: LoraConv1d, 2: LoraConv2d, 3: LoraConv3d}[dims]
    layer = cls(
        4,
        8,
        k,
        stride=stride,
        padding=padding,
        dilation=s["dilation"],
        groups=s["groups"],
        bias=s["bias"],
        padding_mode=s["padding_mode"],
        r=s["r"],
        lora_alpha=3,
        dtype=torch.float64,
    )
    _random_factors(layer)
    layer.double()
    size = 4 + (k - 1) * s["dilation"] + 3  # large enough for reflect padding and the kernel span
    x = torch.randn(2, 4, *([size] * dims), dtype=torch.float64)
    return layer, x


@given(conv_settings)
def test_conv_merged_equals_unmerged_for_every_setting(s: dict) -> None:
    layer, x = _build_conv(s)
    unmerged = layer(x)
    # independent oracle: one convolution with W + scaling * B @ A, through the base layer's own path
    plain = layer.to_base()
    with torch.no_grad():
        expected = plain._conv_forward(x, layer.weight + layer.delta_weight().double(), layer.bias)
    torch.testing.assert_close(unmerged, expected, atol=1e-10, rtol=1e-10)
    layer.merge()
    torch.testing.assert_close(layer(x), unmerged, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("padding_mode", ["reflect", "replicate", "circular"])
def test_conv_lora_branch_uses_base_padding_mode(padding_mode: str) -> None:
    """peft's branch pads with zeros whatever the base does; at the borders it then disagrees with merge."""
    layer = LoraConv2d(3, 4, 3, padding=1, padding_mode=padding_mode, r=2, lora_alpha=2)
    _random_factors(layer)
    x = torch.randn(1, 3, 5, 5)
    y = layer(x)
    layer.merge()
    torch.testing.assert_close(layer(x), y, atol=1e-5, rtol=1e-5)


def test_conv_dilation_forward_shape_matches_base() -> None:
    base = nn.Conv2d(3, 4, 3, dilation=2, padding=2)
    layer = LoraConv2d.from_module(copy.deepcopy(base), r=2)
    x = torch.randn(1, 3, 9, 9)
    assert layer(x).shape == base(x).shape


# ---- merge / unmerge ----------------------------------------------------------------------------


def _any_layer(kind: str, dtype: torch.dtype) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    make_base, make_input = BASES[kind]
    base = make_base().to(dtype)
    layer = LORA_CLASSES[type(base)].from_module(base, r=3, lora_alpha=6)
    _random_factors(layer)
    x = make_input()
    return layer, (x if not x.is_floating_point() else x.to(dtype))


@given(
    st.sampled_from(sorted(BASES)),
    st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
    st.integers(1, 4),
)
def test_merge_unmerge_restores_weights(kind: str, dtype: torch.dtype, times: int) -> None:
    layer, _ = _any_layer(kind, dtype)
    before = layer.weight.detach().clone()
    for _ in range(times):
        layer.merge()  # repeated merges are no-ops
    merged = layer.weight.detach().clone()
    assert layer.merged
    expected = (before.to(layer._merge_dtype()) + layer.delta_weight()).to(
        dtype
    )  # fp32 (fp64) math, rounded once
    assert torch.equal(merged, expected)
    for _ in range(times):
        layer.unmerge()
    assert not layer.merged
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 0.02}[dtype]
    torch.testing.assert_close(layer.weight.detach(), before, atol=tol, rtol=tol)


@pytest.mark.parametrize("kind", sorted(BASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merged_output_equals_unmerged(kind: str, dtype: torch.dtype) -> None:
    layer, x = _any_layer(kind, dtype)
    layer.eval()
    y = layer(x)
    assert y.dtype == dtype
    layer.merge()
    tol = 1e-5 if dtype == torch.float32 else 0.05
    torch.testing.assert_close(layer(x), y, atol=tol, rtol=tol)


def test_train_and_eval_never_merge() -> None:
    layer = LoraLinear(4, 3, r=2)
    w = layer.weight.detach().clone()
    layer.eval()
    layer.train()
    assert not layer.merged and torch.equal(layer.weight, w)


def test_embedding_with_max_norm_refuses_to_merge() -> None:
    layer = LoraEmbedding(10, 4, max_norm=1.0, r=2)
    with pytest.raises(LoraMergeError, match=r"max_norm=1\.0"):
        layer.merge()
    assert not layer.merged


def test_to_base_returns_plain_layers_sharing_weights() -> None:
    for kind in BASES:
        layer, x = _any_layer(kind, torch.float32)
        layer.eval()
        y = layer(x)
        layer.merge()
        plain = layer.to_base()
        assert type(plain) in LORA_CLASSES and plain.weight is layer.weight
        torch.testing.assert_close(plain(x), y, atol=1e-5, rtol=1e-5)


# ---- dtypes -------------------------------------------------------------------------------------


def test_adapter_dtype_for_half_bases_is_float32() -> None:
    assert adapter_dtype_for(torch.bfloat16) == torch.float32
    assert adapter_dtype_for(torch.float16) == torch.float32
    assert adapter_dtype_for(torch.float64) == torch.float64


def test_bf16_base_with_fp32_adapters_matches_fp32_math() -> None:
    base = nn.Linear(16, 8).to(torch.bfloat16)
    layer = LoraLinear.from_module(base, r=4, lora_alpha=8)
    _random_factors(layer)
    assert layer.lora_A.dtype == torch.float32
    x = torch.randn(5, 16).to(torch.bfloat16)
    y = layer(x)
    assert y.dtype == torch.bfloat16
    expected = F.linear(x.float(), base.weight.float(), base.bias.float())
    expected = expected.to(torch.bfloat16).float() + layer.scaling * (
        x.float() @ layer.lora_A.T @ layer.lora_B.T
    )
    torch.testing.assert_close(y.float(), expected, atol=0.05, rtol=0.02)


# ---- init ---------------------------------------------------------------------------------------


def test_init_modes() -> None:
    torch.manual_seed(0)
    default = LoraLinear(256, 64, r=16)
    bound = 1 / math.sqrt(256)  # kaiming-uniform(a=sqrt(5)) bound for fan_in 256
    assert torch.count_nonzero(default.lora_B) == 0
    assert default.lora_A.abs().max() <= bound and default.lora_A.abs().max() > 0.9 * bound
    gaussian = LoraLinear(256, 64, r=16, init_lora_weights="gaussian")
    assert torch.count_nonzero(gaussian.lora_B) == 0
    assert gaussian.lora_A.std().item() == pytest.approx(1 / 16, rel=0.1)
    random_b = LoraLinear(256, 64, r=16, init_lora_weights=False)
    assert torch.count_nonzero(random_b.lora_B) > 0
    emb = LoraEmbedding(50, 8, r=4)
    assert torch.count_nonzero(emb.lora_embedding_A) == 0 and emb.lora_embedding_B.std() > 0.5


def test_default_init_is_a_no_op() -> None:
    base = nn.Linear(8, 4)
    layer = LoraLinear.from_module(copy.deepcopy(base), r=2, lora_alpha=4)
    x = torch.randn(3, 8)
    torch.testing.assert_close(layer(x), base(x))


# ---- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"r": 0}, r"r=0: the rank must be a positive integer"),
        ({"r": 2.5}, r"r=2.5"),
        ({"lora_dropout": 1.0}, r"lora_dropout=1.0: expected a probability"),
        ({"lora_alpha": float("nan")}, r"lora_alpha=nan"),
        ({"init_lora_weights": "pissa"}, r"init_lora_weights='pissa'"),
    ],
)
def test_invalid_layer_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(LoraConfigError, match=message):
        LoraLinear(4, 3, **kwargs)
