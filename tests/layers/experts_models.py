"""Tiny MoE models whose experts are 3-D parameters (transformers 5), and peft twins with the same factors."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import loragen
from loragen.adapters.folder import PEFT_PREFIX
from loragen.adapters.save import adapter_state_dict
from loragen.convert import find_lora_layers

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

VOCAB = 64


def mixtral() -> nn.Module:
    """Mixtral, 2 layers, 4 experts (``gate_up_proj (4, 48, 16)``, ``down_proj (4, 16, 24)``)."""
    config = transformers.MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=32,
    )
    return transformers.MixtralForCausalLM(config)


def qwen3_moe() -> nn.Module:
    """Qwen3-MoE, 2 sparse layers, 4 experts."""
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        moe_intermediate_size=20,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=32,
    )
    return transformers.Qwen3MoeForCausalLM(config)


def olmoe() -> nn.Module:
    """OLMoE, 2 layers, 4 experts."""
    config = transformers.OlmoeConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=20,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=32,
    )
    return transformers.OlmoeForCausalLM(config)


MODELS = {"mixtral": mixtral, "qwen3_moe": qwen3_moe, "olmoe": olmoe}


def make(kind: str, seed: int = 0) -> nn.Module:
    """A fresh tiny model of ``kind``, the same weights for the same seed."""
    torch.manual_seed(seed)
    return MODELS[kind]().eval()


def tokens(seed: int = 1, shape: tuple[int, int] = (2, 9)) -> torch.Tensor:
    """Token ids for the tiny models."""
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def peft_twin(base: nn.Module, lora_model: nn.Module, config: loragen.LoraConfig) -> nn.Module:
    """peft's model of ``config`` on a copy of ``base``, holding ``lora_model``'s factor values."""
    peft_config = peft.LoraConfig(
        **{k: v for k, v in config.to_peft().items() if k not in ("peft_type", "inference_mode")}
    )
    twin = peft.get_peft_model(copy.deepcopy(base), peft_config)
    tensors = adapter_state_dict(lora_model, config)
    result = peft.set_peft_model_state_dict(twin, tensors)
    assert not result.unexpected_keys, result.unexpected_keys
    return twin


def lora_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """The LoRA gradients of a loragen model under peft's file keys."""
    named = dict(model.named_parameters())
    out = {}
    for path, layer in find_lora_layers(model).items():
        for attr, suffix in layer.peft_key_suffixes().items():
            grad = named[f"{path}.{attr}"].grad
            assert grad is not None, f"{path}.{attr} has no gradient"
            out[f"{PEFT_PREFIX}{path}.{suffix}"] = grad
    return out


def peft_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """peft's LoRA gradients under its file keys (the adapter name dropped)."""
    out = {}
    for name, p in model.named_parameters():
        if "lora_" in name and p.grad is not None:
            out[name.replace(".default", "")] = p.grad
    return out
