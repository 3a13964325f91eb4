"""Shared fixtures: tiny transformers models built from configs (nothing is downloaded)."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch
from hypothesis import HealthCheck, settings
from torch import nn

# Two cores are shared by everything in CI; one intra-op thread keeps tests predictable.
torch.set_num_threads(int(os.environ.get("LORAGEN_TEST_THREADS", "1")))

settings.register_profile(
    "ci", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.register_profile("dev", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else os.environ.get("HYPOTHESIS_PROFILE", "dev"))


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(
        LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=100,
            max_position_embeddings=64,
        )
    )


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=100, n_positions=64))


def _bert() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    return BertForSequenceClassification(
        BertConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            vocab_size=100,
            max_position_embeddings=64,
            num_labels=3,
        )
    )


def _t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(
        T5Config(
            d_model=32,
            d_ff=64,
            d_kv=8,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=4,
            vocab_size=100,
            decoder_start_token_id=0,
        )
    )


TINY_MODELS: dict[str, Callable[[], nn.Module]] = {"llama": _llama, "gpt2": _gpt2, "bert": _bert, "t5": _t5}


def tiny_inputs(kind: str, batch: int = 2, seq: int = 7, seed: int = 0) -> dict[str, torch.Tensor]:
    """Model inputs for a tiny model of ``kind``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 100, (batch, seq), generator=g)
    if kind == "t5":
        return {"input_ids": ids, "decoder_input_ids": torch.randint(0, 100, (batch, 5), generator=g)}
    return {"input_ids": ids}


@pytest.fixture
def make_tiny_model() -> Callable[[str, int], nn.Module]:
    """Factory: ``make_tiny_model(kind, seed)`` -> an eval-mode tiny transformers model."""

    def make(kind: str, seed: int = 0) -> nn.Module:
        torch.manual_seed(seed)
        return TINY_MODELS[kind]().eval()

    return make


def autograd_node_names(output: torch.Tensor) -> set[str]:
    """The class names of every autograd node ``output`` was made through (which ops ran as one node)."""
    seen, stack, names = set(), [output.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack.extend(next_fn for next_fn, _ in node.next_functions)
    return names
