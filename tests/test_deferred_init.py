"""LoRA layers made before their weights exist (a model converted in its ``__init__``, which
``from_pretrained`` runs on the meta device) get peft's initialisation when the model is loaded, or a warning
says that nothing will initialise them. Never uninitialised factors used silently."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import loragen
from loragen.convert import find_lora_layers

transformers = pytest.importorskip("transformers")

TARGETS = ["q_proj", "v_proj"]


def _config() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
    )


class ConvertedInInit(transformers.LlamaForCausalLM):
    """A Llama that converts itself at the end of its ``__init__``."""

    def __init__(self, config: transformers.LlamaConfig) -> None:
        super().__init__(config)
        loragen.get_lora_model(self, loragen.LoraConfig(target_modules=TARGETS, r=4))


@pytest.fixture(scope="module")
def base_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("base")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(_config()).save_pretrained(folder)
    return folder


def test_a_model_converted_in_its_init_gets_peft_init_from_from_pretrained(base_folder: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "nothing will initialise them"
        model = ConvertedInInit.from_pretrained(base_folder).eval()
    base = transformers.LlamaForCausalLM.from_pretrained(base_folder).eval()
    layers = find_lora_layers(model)
    assert len(layers) == 4
    for path, layer in layers.items():
        factors = layer.lora_parameters()
        a, b = factors["lora_A"].detach(), factors["lora_B"].detach()
        bound = 1 / math.sqrt(a.shape[1])  # kaiming_uniform_(a=sqrt(5)) over fan_in
        assert torch.isfinite(a).all() and 0 < a.abs().max() <= bound, path
        assert torch.count_nonzero(b) == 0, path
    ids = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, base(ids).logits)


def test_each_sub_model_of_a_composite_model_initialises_its_lora_layers(base_folder: Path) -> None:
    """``LlamaForCausalLM`` holds a ``LlamaModel``, itself a ``PreTrainedModel`` whose ``_init_weights``
    transformers uses for the layers under it: the LoRA layers are initialised whichever one holds them."""
    model = ConvertedInInit.from_pretrained(base_folder)
    assert all(
        torch.count_nonzero(layer.lora_parameters()["lora_B"]) == 0
        for layer in find_lora_layers(model).values()
    )
    assert "_init_weights" in vars(model) and "_init_weights" in vars(model.model)


def test_factors_made_on_the_meta_device_with_nothing_to_initialise_them_warn() -> None:
    with torch.device("meta"):
        block = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    with pytest.warns(UserWarning, match="meta device .* nothing will initialise them"):
        loragen.get_lora_model(block, loragen.LoraConfig(target_modules=["0", "2"], r=2))


def test_a_model_converted_on_a_real_device_is_left_as_it_is() -> None:
    block = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loragen.get_lora_model(block, loragen.LoraConfig(target_modules=["0", "2"], r=2))
    model = loragen.get_lora_model(
        transformers.LlamaForCausalLM(_config()), loragen.LoraConfig(target_modules=TARGETS)
    )
    assert "_init_weights" not in vars(model)  # a loaded model's _init_weights is the class's, as before
