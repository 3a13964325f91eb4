"""transformers models whose code modifies projection outputs in place (LED, Longformer, RoCBert, Swinv2,
Swin2SR) or feeds a projection an empty input (HiggsAudioV2's audio MLP on a text-only batch) run
forward and backward with every linear layer adapted, and equal peft with the same LoRA weights.

Before the fused op returned fresh outputs, the first five raised "Output 0 of LoraLinearFunction /
_GroupFunction is a view and is being modified inplace", and HiggsAudioV2 "cannot reshape tensor of 0
elements".
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn

import loragen
from loragen import LoraConfig

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def _led() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    config = transformers.LEDConfig(
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        vocab_size=50,
        max_encoder_position_embeddings=64,
        max_decoder_position_embeddings=64,
        attention_window=[4],
    )
    return transformers.LEDModel(config), {
        "input_ids": torch.randint(0, 50, (2, 8)),
        "decoder_input_ids": torch.randint(0, 50, (2, 5)),
    }


def _longformer() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    config = transformers.LongformerConfig(
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        vocab_size=50,
        max_position_embeddings=64,
        attention_window=[4],
    )
    return transformers.LongformerModel(config), {"input_ids": torch.randint(0, 50, (2, 8))}


def _rocbert() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    config = transformers.RoCBertConfig(
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        vocab_size=50,
        max_position_embeddings=64,
        pronunciation_vocab_size=20,
        shape_vocab_size=20,
    )
    return transformers.RoCBertModel(config), {"input_ids": torch.randint(0, 50, (2, 8))}


def _swinv2() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    config = transformers.Swinv2Config(
        image_size=16, patch_size=4, embed_dim=8, depths=[1], num_heads=[2], window_size=2
    )
    return transformers.Swinv2Model(config), {"pixel_values": torch.randn(1, 3, 16, 16)}


def _swin2sr() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    config = transformers.Swin2SRConfig(
        image_size=8,
        patch_size=1,
        embed_dim=8,
        depths=[1],
        num_heads=[2],
        window_size=2,
        upscale=1,
        upsampler="",
    )
    return transformers.Swin2SRModel(config), {"pixel_values": torch.randn(1, 3, 8, 8)}


def _higgs_audio_v2() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    config = transformers.HiggsAudioV2Config(
        vocab_size=200,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_codebooks=2,
        codebook_size=16,
        audio_token_id=150,
        audio_bos_token_id=151,
        audio_delay_token_id=152,
        audio_stream_bos_id=16,
        audio_stream_eos_id=17,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        max_position_embeddings=64,
    )
    # text only: the audio MLP gets an empty batch of tokens
    return transformers.HiggsAudioV2Model(config), {
        "input_ids": torch.randint(3, 100, (2, 6)),
        "use_cache": False,
    }


def _cvt() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    # a batch of one: a LoRA layer's input is a permuted view, and BatchNorm2d's eval backward further up
    # gave wrong input gradients when loragen returned that input's gradient contiguous (sweep: cvt)
    config = transformers.CvtConfig(
        embed_dim=[8, 16, 16], num_heads=[1, 2, 2], depth=[1, 2, 3], drop_path_rate=[0.0] * 3
    )
    # depth[i] > i: transformers indexes stage i's drop-path rates by i
    return transformers.CvtModel(config), {"pixel_values": torch.randn(1, 3, 32, 32)}


MODELS: dict[str, Callable[[], tuple[nn.Module, dict[str, torch.Tensor]]]] = {
    "led": _led,
    "longformer": _longformer,
    "rocbert": _rocbert,
    "swinv2": _swinv2,
    "swin2sr": _swin2sr,
    "higgs_audio_v2": _higgs_audio_v2,
    "cvt": _cvt,
}


def _build(kind: str) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, inputs = MODELS[kind]()
    return model.eval(), inputs


def _first_output(model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    output = model(**inputs)
    return output[0] if isinstance(output, tuple) else output.last_hidden_state


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_in_place_and_empty_uses_equal_peft(kind: str) -> None:
    config = LoraConfig(r=2, lora_alpha=4, target_modules="all-linear")
    ours, inputs = _build(kind)
    loragen.get_lora_model(ours, config)
    theirs, _ = _build(kind)
    # the same layers for both: loragen's resolution of "all-linear", as an explicit list for peft
    targets = sorted(loragen.convert.find_lora_layers(ours))
    peft_config = {**config.replace(target_modules=targets).to_peft(), "inference_mode": False}
    theirs = peft.get_peft_model(theirs, peft.LoraConfig(**peft_config))
    generator = torch.Generator().manual_seed(1)
    ours_params = dict(ours.named_parameters())
    copied = 0
    for name, p in theirs.named_parameters():
        if ".lora_A.default." in name or ".lora_B.default." in name:
            key = name.removeprefix("base_model.model.").replace(".default.weight", "")
            with torch.no_grad():  # B non-zero, so the LoRA terms show in the output
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
                ours_params[key].copy_(p)
            copied += 1
    assert copied == 2 * len(loragen.convert.find_lora_layers(ours)) > 0

    weights = None
    for model in (ours, theirs):
        y = _first_output(model, inputs)
        weights = torch.linspace(-1, 1, y.numel()).view(y.shape) if weights is None else weights
        (y * weights).sum().backward()
    torch.testing.assert_close(
        _first_output(ours, inputs), _first_output(theirs, inputs), rtol=1e-5, atol=1e-5
    )
    for name, p in theirs.named_parameters():
        if p.grad is not None:
            key = name.removeprefix("base_model.model.").replace(".default.weight", "")
            torch.testing.assert_close(ours_params[key].grad, p.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_outputs_may_be_modified_in_place_with_the_right_gradients() -> None:
    torch.manual_seed(0)
    model = nn.ModuleDict({"q": nn.Linear(6, 4), "k": nn.Linear(6, 4)})
    reference = {name: nn.Linear(6, 4) for name in model}
    for name, layer in reference.items():
        layer.load_state_dict(model[name].state_dict())
    loragen.get_lora_model(model, LoraConfig(r=2, target_modules=["q", "k"], init_lora_weights=False))
    x = torch.randn(3, 5, 6, requires_grad=True)
    for name in ("q", "k"):
        layer = model[name]
        y = layer(x)
        y /= 2.0  # what LED's attention does to its query
        y.mul_(3.0).sum().backward()
        expected = x.detach() @ layer.lora_A.t() @ layer.lora_B.t() * layer.scaling + reference[name](
            x.detach()
        )
        torch.testing.assert_close(y, expected * 1.5)
        torch.testing.assert_close(
            layer.lora_B.grad,
            1.5 * layer.scaling * (x.detach() @ layer.lora_A.t()).reshape(-1, 2).sum(0).expand(4, 2),
        )


def test_zero_rows_run_forward_and_backward_in_every_path() -> None:
    torch.manual_seed(0)
    for dropout in (0.0, 0.2):
        layer = loragen.LoraLinear(6, 4, r=2, lora_dropout=dropout, init_lora_weights=False)
        for x in (torch.randn(0, 6, requires_grad=True), torch.randn(2, 0, 6, requires_grad=True)):
            y = layer.train()(x)
            y.sum().backward()
            assert y.shape == (*x.shape[:-1], 4) and x.grad.shape == x.shape
            assert torch.count_nonzero(layer.lora_A.grad) == 0


@pytest.mark.parametrize("use_dora", [False, True])
def test_a_non_contiguous_input_gets_its_gradient_in_its_own_layout(use_dora: bool) -> None:
    # A (1, HW, C) view of a (1, C, H, W) map gets its gradient in that layout (channels-last when viewed
    # back). A contiguous one views back with a batch stride of C, for which BatchNorm2d's eval backward on
    # the CPU gives wrong input gradients (torch 2.13; torch's own linear trips it too at this shape):
    # CvT's key/value path (sweep: cvt).
    torch.manual_seed(0)
    # with DoRA the magnitude starts at the norm: the same merged weight (the norm is detached)
    layer = loragen.LoraLinear(64, 64, r=2, init_lora_weights=False, use_dora=use_dora)
    norm = nn.BatchNorm2d(64).eval()  # unit scale and variance: d norm(m) / dm = 1 / sqrt(1 + eps)
    maps = torch.randn(1, 64, 4, 4, requires_grad=True)
    x = norm(maps).view(1, 64, 16).permute(0, 2, 1)
    seen = []
    x.register_hook(seen.append)
    y = layer(x)
    weights = torch.linspace(-1, 1, y.numel()).view(y.shape)
    (y * weights).sum().backward()
    merged = (layer.weight + layer.scaling * layer.lora_B @ layer.lora_A).detach()
    expected = (weights @ merged).permute(0, 2, 1).reshape(1, 64, 4, 4) / (1 + norm.eps) ** 0.5
    # strides of size-1 dimensions carry no meaning (torch's own linear sets them freely)
    assert [st for st, n in zip(seen[0].stride(), x.shape) if n > 1] == [
        st for st, n in zip(x.stride(), x.shape) if n > 1
    ]
    torch.testing.assert_close(maps.grad, expected, rtol=1e-4, atol=1e-5)
