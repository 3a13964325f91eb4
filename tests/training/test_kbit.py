"""prepare_model_for_kbit_training: peft's preparation (frozen base, half-precision parameters in float32,
input gradients and gradient checkpointing) on a tiny Llama loaded in 4 and 8 bits, and a checkpointed
QLoRA step that matches peft's."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

bnb = pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

import loragen  # noqa: E402
from loragen.convert import find_lora_layers  # noqa: E402
from loragen.errors import TrainingSetupError  # noqa: E402
from loragen.training.checkpointing import is_quantized, prepare_model_for_kbit_training  # noqa: E402


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
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
    path = tmp_path_factory.mktemp("tiny_llama_kbit")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def load(path: Path, bits: int = 4, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    if bits == 8:
        quantization = transformers.BitsAndBytesConfig(load_in_8bit=True)
    else:
        quantization = transformers.BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.float32,
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_pretrained(
            path, quantization_config=quantization, device_map="cpu", dtype=dtype
        )


@pytest.mark.parametrize("bits", [4, 8])
def test_preparation_matches_peft(llama_dir: Path, bits: int) -> None:
    ours = prepare_model_for_kbit_training(load(llama_dir, bits))
    theirs = peft.prepare_model_for_kbit_training(load(llama_dir, bits))
    assert is_quantized(ours)
    mine, reference = dict(ours.named_parameters()), dict(theirs.named_parameters())
    assert mine.keys() == reference.keys()
    for name, param in mine.items():
        assert not param.requires_grad
        assert param.dtype == reference[name].dtype, name
        assert type(param) is type(reference[name])
    assert mine["model.norm.weight"].dtype == torch.float32
    assert mine["model.embed_tokens.weight"].dtype == torch.float32
    assert mine["model.layers.0.self_attn.q_proj.weight"].dtype == (torch.uint8 if bits == 4 else torch.int8)
    assert ours.is_activation_checkpointing
    embedded = ours.get_input_embeddings()(torch.tensor([[1, 2]]))
    assert embedded.requires_grad  # the input-gradient hook of reentrant checkpointing


def test_checkpointing_options_reach_torch(llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[dict] = []
    real = torch.utils.checkpoint.checkpoint

    def spy(function, *args, **kwargs):
        seen.append(kwargs)
        return real(function, *args, **kwargs)

    monkeypatch.setattr(transformers.modeling_utils, "checkpoint", spy)
    model = prepare_model_for_kbit_training(
        load(llama_dir), gradient_checkpointing_kwargs={"use_reentrant": False}
    )
    model.train()
    model(input_ids=torch.tensor([[1, 2, 3]])).logits.sum().backward()
    assert seen and all(kwargs.get("use_reentrant") is False for kwargs in seen)


def test_checkpointed_qlora_step_matches_peft(llama_dir: Path) -> None:
    options = dict(r=4, lora_alpha=8, target_modules="all-linear")
    theirs = peft.get_peft_model(
        peft.prepare_model_for_kbit_training(load(llama_dir)),
        peft.LoraConfig(init_lora_weights=False, **options),
    )
    ours = loragen.get_lora_model(
        prepare_model_for_kbit_training(load(llama_dir)), loragen.LoraConfig(**options)
    )
    layers = find_lora_layers(ours)
    with torch.no_grad():
        for name, layer in layers.items():
            layer.lora_A.copy_(theirs.base_model.model.get_submodule(name).lora_A["default"].weight)
            layer.lora_B.copy_(theirs.base_model.model.get_submodule(name).lora_B["default"].weight)
    x = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    losses = []
    for model in (theirs, ours):
        model.train()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    for name, layer in layers.items():
        reference = theirs.base_model.model.get_submodule(name)
        torch.testing.assert_close(
            layer.lora_A.grad, reference.lora_A["default"].weight.grad, rtol=1e-5, atol=1e-6
        )
        torch.testing.assert_close(
            layer.lora_B.grad, reference.lora_B["default"].weight.grad, rtol=1e-5, atol=1e-6
        )


def test_checkpointing_recomputes_the_same_dropout_mask(llama_dir: Path) -> None:
    """With dropout, a checkpointed step gives the gradients of the same step without checkpointing."""
    config = loragen.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.2)
    grads = []
    for checkpointing in (True, False):
        model = loragen.get_lora_model(
            prepare_model_for_kbit_training(load(llama_dir), use_gradient_checkpointing=checkpointing), config
        )
        torch.manual_seed(3)
        with torch.no_grad():
            for layer in find_lora_layers(model).values():
                layer.lora_A.normal_(std=0.1)
                layer.lora_B.normal_()
        model.train()
        x = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(1))
        torch.manual_seed(5)
        model(input_ids=x, labels=x).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys()
    for name, grad in grads[0].items():
        torch.testing.assert_close(grad, grads[1][name], rtol=1e-5, atol=1e-6)


def test_preparing_a_lora_model_keeps_its_adapter_trainable(llama_dir: Path) -> None:
    model = loragen.get_lora_model(load(llama_dir), loragen.LoraConfig(r=2, target_modules=["q_proj"]))
    prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)


def test_plain_module_cannot_checkpoint() -> None:
    layer = bnb.nn.Linear4bit(64, 32, quant_type="nf4").to("cpu")
    model = nn.Sequential(layer, nn.LayerNorm(32, dtype=torch.bfloat16))
    with pytest.raises(TrainingSetupError, match="gradient_checkpointing_enable"):
        prepare_model_for_kbit_training(model)
    prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    assert model[1].weight.dtype == torch.float32 and layer.weight.dtype == torch.uint8
