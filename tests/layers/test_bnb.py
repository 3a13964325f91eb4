"""LoRA on bitsandbytes' 4-bit and 8-bit linears against peft: a tiny Llama saved with save_pretrained and
loaded back through transformers' BitsAndBytesConfig on the CPU; the same A/B values give equal outputs
and LoRA gradients, adapters load both ways, merges re-quantize as peft's do (with a warning) and unmerges
restore the original quantized weight."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

import loragen  # noqa: E402
from loragen.convert import find_lora_layers  # noqa: E402
from loragen.errors import RequantizationWarning  # noqa: E402

# (kind, quant_type, double quantization, compute dtype)
FORMATS = [
    ("4bit", "nf4", False, torch.float32),
    ("4bit", "nf4", True, torch.bfloat16),
    ("4bit", "fp4", False, torch.bfloat16),
    ("4bit", "fp4", True, torch.float32),
    ("8bit", None, False, None),
]
FORMAT_IDS = ["nf4-fp32", "nf4-dq-bf16", "fp4-bf16", "fp4-dq-fp32", "int8"]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama saved with save_pretrained (every linear's out_features a multiple of 32, as
    bitsandbytes' AVX512-BF16 CPU layout needs)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=96,
        max_position_embeddings=64,
    )
    path = tmp_path_factory.mktemp("tiny_llama")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def load_quantized(path: Path, fmt: tuple, dtype: torch.dtype = torch.float32) -> nn.Module:
    kind, quant_type, double, compute = fmt
    if kind == "8bit":
        quantization = transformers.BitsAndBytesConfig(load_in_8bit=True)
    else:
        quantization = transformers.BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=quant_type,
            bnb_4bit_use_double_quant=double,
            bnb_4bit_compute_dtype=compute,
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_pretrained(
            path, quantization_config=quantization, device_map="cpu", dtype=dtype
        )


def peft_and_loragen(path: Path, fmt: tuple, dtype: torch.dtype = torch.float32, **lora: object):
    """The same quantized model twice: with peft's LoRA (random A and B) and with loragen's, A/B copied."""
    options = dict(r=4, lora_alpha=8, target_modules="all-linear", **lora)
    torch.manual_seed(1)
    peft_model = peft.get_peft_model(
        load_quantized(path, fmt, dtype), peft.LoraConfig(init_lora_weights=False, **options)
    )
    ours = loragen.get_lora_model(load_quantized(path, fmt, dtype), loragen.LoraConfig(**options))
    layers = find_lora_layers(ours)
    with torch.no_grad():
        for name, layer in layers.items():
            theirs = peft_model.base_model.model.get_submodule(name)
            layer.lora_A.copy_(theirs.lora_A["default"].weight)
            layer.lora_B.copy_(theirs.lora_B["default"].weight)
    return peft_model, ours, layers


def tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_conversion_makes_quantized_lora_layers(llama_dir: Path, fmt: tuple) -> None:
    import bitsandbytes as bnb

    model = loragen.get_lora_model(
        load_quantized(llama_dir, fmt), loragen.LoraConfig(r=4, target_modules="all-linear")
    )
    layers = find_lora_layers(model)
    base_type = bnb.nn.Linear8bitLt if fmt[0] == "8bit" else bnb.nn.Linear4bit
    assert len(layers) == 14 and all(isinstance(layer, base_type) for layer in layers.values())
    layer = layers["model.layers.0.mlp.down_proj"]
    assert type(layer).__name__ == ("LoraLinear8bitLt" if fmt[0] == "8bit" else "LoraLinear4bit")
    assert layer.lora_A.dtype == torch.float32 and layer.lora_A.shape == (4, 128)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_outputs_and_gradients_match_peft(llama_dir: Path, fmt: tuple) -> None:
    peft_model, ours, layers = peft_and_loragen(llama_dir, fmt)
    peft_model.train()
    ours.train()
    x = tokens()
    expected, actual = peft_model(x).logits, ours(x).logits
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    expected.square().mean().backward()
    actual.square().mean().backward()
    for name, layer in layers.items():
        theirs = peft_model.base_model.model.get_submodule(name)
        torch.testing.assert_close(
            layer.lora_A.grad, theirs.lora_A["default"].weight.grad, rtol=1e-5, atol=1e-6
        )
        torch.testing.assert_close(
            layer.lora_B.grad, theirs.lora_B["default"].weight.grad, rtol=1e-5, atol=1e-6
        )


@pytest.mark.parametrize("fmt", FORMATS[:2] + FORMATS[4:], ids=["nf4-fp32", "nf4-dq-bf16", "int8"])
def test_base_output_is_bitsandbytes_own(llama_dir: Path, fmt: tuple) -> None:
    """With B = 0 (peft's init) the model computes exactly what the quantized model computes alone."""
    plain = load_quantized(llama_dir, fmt)
    ours = loragen.get_lora_model(
        load_quantized(llama_dir, fmt), loragen.LoraConfig(r=4, target_modules="all-linear")
    )
    plain.train()
    ours.train()
    x = tokens(3)
    assert torch.equal(ours(x).logits, plain(x).logits)


def test_bfloat16_model_matches_peft_bit_for_bit(llama_dir: Path) -> None:
    """A bfloat16 model: the float32 LoRA term is cast, scaled and added in bfloat16 in peft's order."""
    peft_model, ours, _ = peft_and_loragen(llama_dir, FORMATS[1], dtype=torch.bfloat16)
    x = tokens(4)
    with torch.no_grad():
        peft_model.train()
        ours.train()
        assert torch.equal(ours(x).logits, peft_model(x).logits)


def test_dropout_mask_follows_torch_seed(llama_dir: Path) -> None:
    """With dropout the fused branch draws its mask from torch's generator: one seed, one mask."""
    model = loragen.get_lora_model(
        load_quantized(llama_dir, FORMATS[0]),
        loragen.LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.3),
    )
    with torch.no_grad():
        for layer in find_lora_layers(model).values():
            layer.lora_B.normal_()
    model.train()
    x = tokens(5)
    torch.manual_seed(7)
    first = model(x).logits
    torch.manual_seed(7)
    second = model(x).logits
    assert torch.equal(first, second)
    for layer in find_lora_layers(model).values():
        layer.lora_dropout_p = 0.0
    with torch.no_grad():  # training mode: bitsandbytes' AVX512-BF16 inference layout stays out of it
        assert not torch.allclose(model(x).logits, first)  # dropout did something


def test_output_may_be_modified_in_place(llama_dir: Path) -> None:
    model = loragen.get_lora_model(
        load_quantized(llama_dir, FORMATS[0]), loragen.LoraConfig(r=4, target_modules=["q_proj"])
    )
    model.train()  # (an empty input in eval mode crashes bitsandbytes' AVX512-BF16 CPU kernel itself)
    layer = model.model.layers[0].self_attn.q_proj
    x = torch.randn(3, 5, 64, requires_grad=True)
    y = layer(x)
    y.mul_(2.0)
    y.sum().backward()
    assert x.grad is not None and layer.lora_B.grad is not None
    assert layer(torch.randn(0, 64)).shape == (0, 64)


@pytest.mark.parametrize("fmt", [FORMATS[1], FORMATS[4]], ids=["nf4-dq-bf16", "int8"])
def test_adapters_load_both_ways(llama_dir: Path, fmt: tuple, tmp_path: Path) -> None:
    from safetensors import safe_open

    peft_model, ours, _ = peft_and_loragen(llama_dir, fmt)
    x = tokens(6)
    with torch.no_grad():
        peft_model.train()
        ours.train()
        expected = ours(x).logits
    loragen.save_adapter(ours, tmp_path / "ours")
    peft_model.save_pretrained(tmp_path / "peft")
    key_sets = []
    for folder in ("ours", "peft"):
        with safe_open(str(tmp_path / folder / "adapter_model.safetensors"), "pt") as f:
            key_sets.append(set(f.keys()))
    assert key_sets[0] == key_sets[1]

    into_peft = peft.PeftModel.from_pretrained(load_quantized(llama_dir, fmt), tmp_path / "ours")
    into_ours = loragen.load_adapter(load_quantized(llama_dir, fmt), tmp_path / "peft")
    with torch.no_grad():
        for model in (into_peft, into_ours):
            model.train()
            torch.testing.assert_close(model(x).logits, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", [FORMATS[0], FORMATS[3], FORMATS[4]], ids=["nf4-fp32", "fp4-dq-fp32", "int8"])
def test_merge_requantizes_as_peft_and_unmerge_restores(llama_dir: Path, fmt: tuple) -> None:
    peft_model, ours, layers = peft_and_loragen(llama_dir, fmt)
    peft_model.train()
    ours.train()
    x = tokens(7)
    with torch.no_grad():
        unmerged = ours(x).logits
        originals = {name: layer.weight.data.clone() for name, layer in layers.items()}
        with pytest.warns(RequantizationWarning, match=r"max abs error") as record:
            loragen.merge_adapter(ours)
        assert len(record) == len(layers)
        peft_model.merge_adapter()
        merged = ours(x).logits
        assert torch.equal(merged, peft_model(x).logits)  # the same re-quantized weights as peft's
        for name, layer in layers.items():
            base = peft_model.base_model.model.get_submodule(name).base_layer
            assert torch.equal(layer.weight.data, base.weight.data)
        assert not torch.allclose(merged, unmerged, atol=1e-4)  # re-quantizing rounds: not exact

        loragen.merge_adapter(ours)  # a second merge is a no-op
        loragen.unmerge_adapter(ours)
        assert torch.equal(ours(x).logits, unmerged)
        assert all(torch.equal(layer.weight.data, originals[name]) for name, layer in layers.items())


def test_merge_warning_reports_the_rounding(llama_dir: Path) -> None:
    model = loragen.get_lora_model(
        load_quantized(llama_dir, FORMATS[0]), loragen.LoraConfig(r=4, target_modules=["q_proj"])
    )
    layer = model.model.layers[0].self_attn.q_proj
    with torch.no_grad():
        layer.lora_B.normal_()
        exact = layer.dequantized_weight() + layer.delta_weight()
    with pytest.warns(RequantizationWarning) as record:
        layer.merge()
    error = (layer.dequantized_weight() - exact).abs().max().item()
    assert error > 0 and f"up to {error:.3g}" in str(record[0].message)
    assert "64x64, nf4" in str(record[0].message)


@pytest.mark.parametrize("fmt", [FORMATS[1], FORMATS[4]], ids=["nf4-dq-bf16", "int8"])
def test_merge_and_unload_gives_plain_quantized_layers(llama_dir: Path, fmt: tuple) -> None:
    import bitsandbytes as bnb

    _, ours, layers = peft_and_loragen(llama_dir, fmt)
    ours.train()
    x = tokens(8)
    with pytest.warns(RequantizationWarning):
        loragen.merge_adapter(ours)
    with torch.no_grad():
        merged = ours(x).logits
        model = loragen.merge_and_unload(ours)
        assert torch.equal(model(x).logits, merged)
    base_type = bnb.nn.Linear8bitLt if fmt[0] == "8bit" else bnb.nn.Linear4bit
    for name in layers:
        module = model.get_submodule(name)
        assert type(module) is base_type
        assert not any("lora" in key for key in module.state_dict())


@pytest.mark.slow
def test_loragen_imports_without_bitsandbytes() -> None:
    code = (
        "import sys; sys.modules['bitsandbytes'] = None\n"
        "import loragen, loragen.layers, loragen.training.checkpointing\n"
        "from loragen.registry import spec_for_qualname\n"
        "assert spec_for_qualname('bitsandbytes.nn.Linear4bit').base_type() is None\n"
        "model = loragen.get_lora_model(__import__('torch').nn.Sequential(__import__('torch').nn.Linear(4, 4)),\n"
        "                               loragen.LoraConfig(r=2, target_modules=['0']))\n"
        "try:\n"
        "    import loragen.layers.bnb\n"
        "except ImportError:\n"
        "    print('refused')\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "refused"


def test_constructors_are_the_bitsandbytes_ones_plus_lora_keywords() -> None:
    from loragen.layers.bnb import LoraLinear4bit, LoraLinear8bitLt

    torch.manual_seed(0)
    layer4 = LoraLinear4bit(64, 32, quant_type="nf4", compute_dtype=torch.float32, r=4, lora_alpha=8).to(
        "cpu"
    )
    layer8 = LoraLinear8bitLt(64, 32, has_fp16_weights=False, r=4).to("cpu")
    x = torch.randn(5, 64)
    for layer in (layer4, layer8):
        layer.train()
        assert layer.lora_A.shape == (4, 64) and layer.lora_B.shape == (32, 4) and layer.scaling == 2.0
        assert layer(x).shape == (5, 32)
    assert layer4.weight.dtype == torch.uint8 and layer8.weight.dtype == torch.int8


def test_named_adapters_on_a_quantized_model(llama_dir: Path) -> None:
    """disable_adapter gives bitsandbytes' own output; a second adapter merges (re-quantized) and unmerges
    exactly; switching back gives the first adapter's output again."""
    plain = load_quantized(llama_dir, FORMATS[0]).train()
    model = loragen.get_lora_model(
        load_quantized(llama_dir, FORMATS[0]),
        loragen.LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False),
    ).train()
    x = tokens(9)
    with torch.no_grad():
        first = model(x).logits
        with loragen.disable_adapter(model):
            assert torch.equal(model(x).logits, plain(x).logits)
        loragen.add_adapter(
            model, loragen.LoraConfig(r=2, target_modules="all-linear", init_lora_weights=False), "two"
        )
        loragen.set_adapter(model, "two")
        second = model(x).logits
        assert not torch.allclose(second, first)
    with pytest.warns(RequantizationWarning):
        loragen.merge_adapter(model)
    with torch.no_grad():
        loragen.unmerge_adapter(model)
        assert torch.equal(model(x).logits, second)
        loragen.set_adapter(model, "default")
        assert torch.equal(model(x).logits, first)
