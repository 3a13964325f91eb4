"""DoRA layers against peft: outputs and gradients (A, B, magnitude) on tiny Llama / GPT-2 / BERT and on
Embedding / Conv1d / Conv2d, dropout under the same mask, merge / unmerge / merge_and_unload, adapters
saved by one loaded by the other, and every refusal named."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import peft
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from loragen import (
    LoraConfig,
    get_lora_model,
    load_adapter,
    merge_adapter,
    merge_and_unload,
    save_adapter,
)
from loragen.adapters.folder import read_adapter
from loragen.cli import main
from loragen.convert import find_lora_layers
from loragen.errors import AdapterError, LoraConfigError, LoraConversionError
from loragen.layers import LoraConv2d, LoraLinear
from loragen.ops.masks import dropout_keep_bits, unpack_keep_mask
from loragen.philox import random_seed
from tests.adapters.helpers import WEIGHTS, make_model, model_inputs, perturb_trainable

CASES: dict[str, tuple[str, dict]] = {
    "llama": (
        "llama",
        dict(
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        ),
    ),
    "gpt2": (
        "gpt2",
        dict(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True),
    ),
    "bert": (
        "bert",
        dict(r=4, lora_alpha=16, target_modules=["query", "key", "value", "dense"], use_rslora=True),
    ),
    "convnet": ("convnet", dict(r=2, lora_alpha=4, target_modules=["emb", "conv1", "conv2", "head"])),
}


def _loragen_name(peft_name: str) -> str:
    """``base_model.model.<path>.lora_A.default.weight`` -> ``<path>.lora_A`` (and the magnitude alike)."""
    return peft_name.removeprefix("base_model.model.").replace(".default.weight", "").replace(".default", "")


def _pair(kind: str, kwargs: dict) -> tuple[nn.Module, nn.Module]:
    """A peft DoRA model with moved A, B and magnitudes, and a loragen DoRA model holding the same values."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = peft.get_peft_model(make_model(kind), peft.LoraConfig(**kwargs, use_dora=True))
    perturb_trainable(peft_model, seed=1)
    model = get_lora_model(make_model(kind), LoraConfig(**kwargs, use_dora=True))
    ours = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if p.requires_grad:
                ours[_loragen_name(name)].copy_(p)
    return peft_model, model


def _output(model: nn.Module, kind: str) -> torch.Tensor:
    out = model(**model_inputs(kind))
    return out if isinstance(out, torch.Tensor) else out.logits


@pytest.mark.parametrize("case", list(CASES))
def test_outputs_and_gradients_equal_peft(case: str) -> None:
    kind, kwargs = CASES[case]
    peft_model, model = _pair(kind, kwargs)
    theirs, ours = _output(peft_model, kind), _output(model, kind)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    theirs.square().sum().backward()
    ours.square().sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    compared = 0
    for name, p in peft_model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None
            scale = p.grad.abs().max().item()
            torch.testing.assert_close(
                grads[_loragen_name(name)], p.grad, rtol=1e-5, atol=1e-5 * scale, msg=name
            )
            compared += 1
    layers = find_lora_layers(model)
    assert compared == 3 * len(layers) and all(
        "lora_magnitude_vector" in layer.lora_parameters() for layer in layers.values()
    )


class _FixedDropout(nn.Module):
    """peft's dropout module replaced by a given keep-mask, with inverted scaling."""

    def __init__(self, keep: torch.Tensor, p: float) -> None:
        super().__init__()
        self.keep, self.p = keep, p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.keep.to(x.dtype) / (1 - self.p)


class _Holder(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


class _OwnForwardLinear(nn.Linear):
    """An nn.Linear subclass with its own forward (as Falcon's FalconLinear): DoRA on the base's output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight) + self.bias


def _conv1d() -> nn.Module:
    from transformers.pytorch_utils import Conv1D

    return Conv1D(10, 12)  # nf = out 10, nx = in 12


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "composition"])
@pytest.mark.parametrize(
    "make_base",
    [lambda: nn.Linear(12, 10), _conv1d, lambda: _OwnForwardLinear(12, 10)],
    ids=["linear", "conv1d", "own-forward"],
)
def test_dropout_under_the_same_mask_equals_peft(make_base, fused: bool) -> None:
    torch.manual_seed(0)
    base, p = make_base(), 0.3
    kwargs = dict(r=3, lora_alpha=6, lora_dropout=p, target_modules=["layer"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = peft.get_peft_model(
            _Holder(copy.deepcopy(base)), peft.LoraConfig(**kwargs, use_dora=True)
        )
    perturb_trainable(peft_model, seed=3)
    model = get_lora_model(_Holder(copy.deepcopy(base)), LoraConfig(**kwargs, use_dora=True))
    ours = dict(model.named_parameters())
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if param.requires_grad:
                ours[_loragen_name(name)].copy_(param)
    find_lora_layers(model)["layer"].fused = fused
    x = torch.randn(2, 5, 12, generator=torch.Generator().manual_seed(4))
    peft_model.train()
    model.train()

    torch.manual_seed(7)  # the fused op draws its mask seed from torch's generator: the same draw here
    keep = unpack_keep_mask(dropout_keep_bits(x.numel(), p, random_seed()), x.numel()).view(x.shape)
    if not fused or isinstance(
        base, _OwnForwardLinear
    ):  # the composition draws with torch's F.dropout: take its mask
        torch.manual_seed(7)
        keep = torch.nn.functional.dropout(torch.ones_like(x), p, True) != 0
    peft_model.base_model.model.layer.lora_dropout["default"] = _FixedDropout(keep, p)
    torch.manual_seed(7)
    ours_y = model(x)
    theirs_y = peft_model(x)
    torch.testing.assert_close(ours_y, theirs_y, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(theirs_y)
    ours_y.backward(g)
    theirs_y.backward(g)
    for name, param in peft_model.named_parameters():
        if param.requires_grad:
            torch.testing.assert_close(
                ours[_loragen_name(name)].grad, param.grad, rtol=1e-5, atol=1e-5, msg=name
            )


@pytest.mark.parametrize("case", list(CASES))
def test_merge_unmerge_and_unload_are_exact(case: str) -> None:
    kind, kwargs = CASES[case]
    peft_model, model = _pair(kind, kwargs)
    weights = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("weight")}
    with torch.no_grad():
        before = _output(model, kind)
        merge_adapter(model)
        merge_adapter(model)  # safe to repeat
        torch.testing.assert_close(_output(model, kind), before, rtol=1e-5, atol=1e-5)
        for layer in find_lora_layers(model).values():
            layer.unmerge()
        for name, p in model.named_parameters():
            if name in weights:
                torch.testing.assert_close(p, weights[name], rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(_output(model, kind), before, rtol=1e-5, atol=1e-5)

        unloaded = merge_and_unload(model)
        assert not find_lora_layers(unloaded)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            theirs = peft_model.merge_and_unload()
        torch.testing.assert_close(_output(unloaded, kind), before, rtol=1e-5, atol=1e-5)
        ours_state, their_state = unloaded.state_dict(), theirs.state_dict()
        assert ours_state.keys() == their_state.keys()
        for key, value in their_state.items():
            torch.testing.assert_close(ours_state[key], value, rtol=1e-5, atol=1e-5, msg=key)


@pytest.mark.parametrize("case", list(CASES))
def test_loragen_adapter_loads_in_peft(case: str, tmp_path: Path) -> None:
    kind, kwargs = CASES[case]
    _, model = _pair(kind, kwargs)
    save_adapter(model, tmp_path)
    tensors = load_file(tmp_path / WEIGHTS)
    magnitudes = [k for k in tensors if k.endswith(".lora_magnitude_vector")]
    assert len(magnitudes) == len(find_lora_layers(model))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = peft.LoraConfig.from_pretrained(str(tmp_path))
        assert config.use_dora is True
        peft_model = peft.get_peft_model(make_model(kind), config)
        result = peft.set_peft_model_state_dict(peft_model, tensors)
    assert result.unexpected_keys == []
    assert [k for k in result.missing_keys if "lora_" in k] == []
    with torch.no_grad():
        torch.testing.assert_close(_output(peft_model, kind), _output(model, kind), rtol=1e-5, atol=1e-5)
        loaded = peft.PeftModel.from_pretrained(make_model(kind), str(tmp_path))
        torch.testing.assert_close(_output(loaded, kind), _output(model, kind), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", list(CASES))
def test_peft_adapter_loads_in_loragen(case: str, tmp_path: Path) -> None:
    kind, kwargs = CASES[case]
    peft_model, _ = _pair(kind, kwargs)
    peft_model.save_pretrained(str(tmp_path))
    model = load_adapter(make_model(kind), tmp_path)
    assert model.loragen_config.use_dora
    with torch.no_grad():
        torch.testing.assert_close(_output(model, kind), _output(peft_model, kind), rtol=1e-5, atol=1e-5)
    # and into an already converted DoRA model
    converted = get_lora_model(make_model(kind), LoraConfig(**kwargs, use_dora=True))
    load_adapter(converted, tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(_output(converted, kind), _output(peft_model, kind), rtol=1e-5, atol=1e-5)


def test_new_adapter_is_a_no_op_with_peft_shapes() -> None:
    for kind, kwargs in CASES.values():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            peft_model = peft.get_peft_model(make_model(kind), peft.LoraConfig(**kwargs, use_dora=True))
        model = get_lora_model(make_model(kind), LoraConfig(**kwargs, use_dora=True))
        with torch.no_grad():
            torch.testing.assert_close(
                _output(model, kind), _output(make_model(kind), kind), rtol=1e-5, atol=1e-5
            )
        theirs = {_loragen_name(n): p for n, p in peft_model.named_parameters() if "magnitude" in n}
        ours = {n: p for n, p in model.named_parameters() if "magnitude" in n}
        assert ours.keys() == theirs.keys()
        for name, value in theirs.items():  # the initial magnitude is ||W|| as in peft, in peft's shape
            torch.testing.assert_close(ours[name], value, msg=name)


def test_config_round_trip() -> None:
    config = LoraConfig(target_modules=["q"], use_dora=True)
    assert config.to_peft()["use_dora"] is True
    assert LoraConfig.from_peft(config.to_peft()).use_dora is True
    assert LoraConfig(target_modules=["q"]).to_peft()["use_dora"] is False
    with pytest.raises(LoraConfigError, match=r"use_dora='yes': expected True or False"):
        LoraConfig(target_modules=["q"], use_dora="yes")  # type: ignore[arg-type]


def test_refusals_are_named(tmp_path: Path) -> None:
    grouped = nn.Sequential(nn.Conv2d(4, 4, 3, groups=2))
    with pytest.raises(
        LoraConversionError, match=r"0: use_dora=True on LoraConv2d with groups=2: DoRA on grouped"
    ):
        get_lora_model(grouped, LoraConfig(target_modules=["0"], use_dora=True))
    assert LoraConv2d(3, 4, 3, use_dora=True).lora_magnitude_vector.shape == (1, 4, 1, 1)
    with pytest.raises(LoraConfigError, match=r"use_dora=1: expected True or False"):
        LoraLinear(3, 4, use_dora=1)  # type: ignore[arg-type]


def test_stray_magnitudes_and_streaming_merge_are_refused(tmp_path: Path, capsys) -> None:
    _, model = _pair(*CASES["llama"])
    save_adapter(model, tmp_path / "dora")
    save_file({"model.embed_tokens.weight": torch.zeros(1)}, tmp_path / "base.safetensors")
    status = main(
        [
            "merge",
            "--base",
            str(tmp_path / "base.safetensors"),
            "--adapter",
            str(tmp_path / "dora"),
            "-o",
            str(tmp_path / "out"),
        ]
    )
    assert (
        status == 1
        and "a DoRA adapter (use_dora=true) cannot be merged by streaming" in capsys.readouterr().err
    )
    assert not (tmp_path / "out").exists()

    plain = tmp_path / "plain"
    save_adapter(get_lora_model(make_model("llama"), LoraConfig(r=4, target_modules=["q_proj"])), plain)
    tensors = load_file(plain / WEIGHTS)
    tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"] = torch.ones(32)
    save_file(tensors, plain / WEIGHTS)
    with pytest.raises(
        AdapterError, match=r"q_proj\.lora_magnitude_vector: a DoRA magnitude .* use_dora=false"
    ):
        read_adapter(plain)


def test_a_rewritten_dora_model_saves_use_dora(tmp_path: Path) -> None:
    """A model built from LoRA layers by hand (as ``loragen rewrite`` writes it) carries no config: the saved
    one is derived from the layers, use_dora included; mixing DoRA and plain layers is refused by name."""
    torch.manual_seed(0)
    model = nn.Sequential(
        LoraLinear(6, 5, r=2, use_dora=True), nn.ReLU(), LoraLinear(5, 3, r=2, use_dora=True)
    )
    save_adapter(model, tmp_path / "a")
    assert read_adapter(tmp_path / "a").config.use_dora
    model[2] = LoraLinear(5, 3, r=2)
    with pytest.raises(AdapterError, match=r"the model mixes DoRA layers \(0\) and plain LoRA layers"):
        save_adapter(model, tmp_path / "b")


def test_several_dora_adapters_equal_peft(tmp_path: Path) -> None:
    """Named adapters: a second DoRA adapter keeps its own magnitude (``lora_adapters.<name>.``), and
    switching, disabling, merging and saving give peft's results."""
    import loragen

    kind, kwargs = CASES["llama"]
    second = {**kwargs, "r": 2, "target_modules": ["q_proj", "v_proj", "down_proj"]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = peft.get_peft_model(make_model(kind), peft.LoraConfig(**kwargs, use_dora=True))
        peft_model.add_adapter("other", peft.LoraConfig(**second, use_dora=True))
    perturb_trainable(peft_model, seed=1)
    with torch.no_grad():  # every adapter off its initial values (perturb moves only the trainable ones)
        for name, p in peft_model.named_parameters():
            if ".other" in name:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    model = get_lora_model(make_model(kind), LoraConfig(**kwargs, use_dora=True))
    loragen.add_adapter(model, LoraConfig(**second, use_dora=True), "other")
    ours = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if ".default" in name and "lora_" in name:
                ours[_loragen_name(name)].copy_(p)
            elif ".other" in name:
                path, _, rest = name.removeprefix("base_model.model.").partition(".lora_")
                attr = "lora_" + rest.split(".")[0]
                ours[f"{path}.lora_adapters.other.{attr}"].copy_(p)
    assert "model.layers.0.self_attn.q_proj.lora_adapters.other.lora_magnitude_vector" in ours
    with torch.no_grad():
        torch.testing.assert_close(_output(model, kind), _output(peft_model, kind), rtol=1e-5, atol=1e-5)
        loragen.set_adapter(model, "other")
        peft_model.set_adapter("other")
        expected = _output(peft_model, kind)
        torch.testing.assert_close(_output(model, kind), expected, rtol=1e-5, atol=1e-5)
        with loragen.disable_adapter(model):
            torch.testing.assert_close(
                _output(model, kind), _output(make_model(kind), kind), rtol=1e-5, atol=1e-5
            )
        merge_adapter(model)
        torch.testing.assert_close(_output(model, kind), expected, rtol=1e-5, atol=1e-5)
        loragen.unmerge_adapter(model)
        torch.testing.assert_close(_output(model, kind), expected, rtol=1e-5, atol=1e-5)

    with pytest.raises(loragen.MixedBatchError, match=r"adapter\(s\) 'other' use DoRA"):
        with loragen.mixed_batch(model, ["other", "__base__"]):
            pass
    with pytest.raises(loragen.AdapterMixError, match=r"use DoRA; a weighted sum"):
        loragen.add_weighted_adapter(model, ["default", "other"], [1.0, 1.0], "mix", combination_type="cat")

    save_adapter(model, tmp_path / "both")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = peft.PeftModel.from_pretrained(
            make_model(kind), str(tmp_path / "both" / "other"), adapter_name="other"
        )
    with torch.no_grad():
        torch.testing.assert_close(_output(loaded, kind), expected, rtol=1e-5, atol=1e-5)
