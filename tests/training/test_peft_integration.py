"""transformers' own peft-integration suite (``tests/peft_integration/test_peft_integration.py``), ported to
loragen models and run offline.

transformers runs its cases on hub checkpoints (a tiny random OPT and a LoRA adapter for it); here the same
tiny OPT is built from a config and saved to a local folder, and the adapter folders are written by peft
itself. transformers' methods on a plain model drive peft; the cases start from a loragen model instead
(``loragen.get_lora_model`` with a peft ``LoraConfig``, or ``loragen.load_adapter``), whose adapter methods
act on loragen's adapters. Cases loragen refuses on purpose (several active adapters at once, pickled
adapters, adapters given as state dicts, hotswapping) check the refusal and the loragen call it names.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import loragen
from loragen.convert import find_lora_layers

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

DUMMY_INPUT = torch.LongTensor([[0, 1, 2, 3, 4, 5, 6, 7]])
TARGETS = ["q_proj", "v_proj"]  # peft's default targets for OPT


@pytest.fixture(scope="module")
def base_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random OPTForCausalLM saved as a local checkpoint (transformers' tiny-random-OPTForCausalLM)."""
    folder = tmp_path_factory.mktemp("tiny-random-OPTForCausalLM")
    torch.manual_seed(0)
    config = transformers.OPTConfig(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=2,
        ffn_dim=32,
        num_attention_heads=2,
        max_position_embeddings=64,
        word_embed_proj_dim=16,
    )
    transformers.OPTForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def peft_adapter(base_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LoRA adapter folder for the tiny OPT written by peft (transformers' tiny-OPTForCausalLM-lora)."""
    folder = tmp_path_factory.mktemp("tiny-OPTForCausalLM-lora")
    torch.manual_seed(1)
    model = peft.get_peft_model(
        _base(base_folder), peft.LoraConfig(init_lora_weights=False, target_modules=TARGETS)
    )
    model.save_pretrained(folder)
    return folder


def _base(folder: Path) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.OPTForCausalLM.from_pretrained(folder)


def _lora(base_folder: Path, **config: object) -> nn.Module:
    """The tiny OPT with a fresh loragen adapter from a peft config (``add_adapter``'s start)."""
    torch.manual_seed(2)
    settings: dict[str, object] = {"init_lora_weights": False, "target_modules": TARGETS, **config}
    return loragen.get_lora_model(_base(base_folder), peft.LoraConfig(**settings))


def _logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(DUMMY_INPUT).logits


def test_peft_from_pretrained(base_folder: Path, peft_adapter: Path) -> None:
    model = loragen.load_adapter(_base(base_folder), peft_adapter)
    assert find_lora_layers(model)
    model.generate(input_ids=DUMMY_INPUT, max_new_tokens=2, do_sample=False)
    reference = peft.PeftModel.from_pretrained(_base(base_folder), str(peft_adapter))
    torch.testing.assert_close(_logits(model), _logits(reference))


def test_peft_state_dict(base_folder: Path, peft_adapter: Path) -> None:
    state_dict = loragen.load_adapter(_base(base_folder), peft_adapter).get_adapter_state_dict()
    assert state_dict and all("lora" in key for key in state_dict)


def test_peft_save_pretrained(base_folder: Path, peft_adapter: Path, tmp_path: Path) -> None:
    model = loragen.load_adapter(_base(base_folder), peft_adapter)
    model.save_pretrained(tmp_path)
    files = {p.name for p in tmp_path.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json"} <= files
    assert not files & {"config.json", "pytorch_model.bin", "model.safetensors"}
    # peft writes the base model's name_or_path: transformers finds the base from the adapter folder
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base_folder)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert any(isinstance(m, peft.tuners.tuners_utils.BaseTunerLayer) for m in again.modules())
    torch.testing.assert_close(_logits(again), _logits(model))
    # safe_serialization=False (a pickled adapter_model.bin) is refused: loragen writes safetensors only
    with pytest.raises(loragen.AdapterError, match="safe_serialization=False"):
        model.save_pretrained(tmp_path, safe_serialization=False)


def test_a_model_built_from_a_config_saves_no_base_name(base_folder: Path, tmp_path: Path) -> None:
    model = loragen.get_lora_model(
        transformers.OPTForCausalLM(_base(base_folder).config), loragen.LoraConfig(target_modules=TARGETS)
    )
    model.config._name_or_path = ""
    model.name_or_path = ""
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "adapter_config.json").read_text())["base_model_name_or_path"] is None


def test_peft_enable_disable_adapters(base_folder: Path) -> None:
    model = _lora(base_folder)
    peft_logits = _logits(model)
    model.disable_adapters()
    disabled = _logits(model)
    model.enable_adapters()
    enabled = _logits(model)
    torch.testing.assert_close(peft_logits, enabled, rtol=0, atol=0)
    assert not torch.allclose(enabled, disabled, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(disabled, _logits(_base(base_folder)), rtol=0, atol=0)


def test_get_lora_model_takes_a_peft_config_as_add_adapter_does(base_folder: Path, tmp_path: Path) -> None:
    model = _lora(base_folder, r=4, lora_alpha=8)
    assert find_lora_layers(model) and model.loragen_config.r == 4
    model.generate(input_ids=DUMMY_INPUT, max_new_tokens=2, do_sample=False)
    # a model saved after add_adapter loads back through transformers' from_pretrained
    model.save_pretrained(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again = transformers.OPTForCausalLM.from_pretrained(tmp_path)
    torch.testing.assert_close(_logits(again), _logits(model))


def test_peft_add_adapter_modules_to_save(base_folder: Path) -> None:
    model = _lora(base_folder, modules_to_save=["lm_head"])
    assert model.lm_head.weight.requires_grad
    assert "lm_head.weight" in model.get_adapter_state_dict()
    model(DUMMY_INPUT).logits.mean().backward()
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(p.grad is not None for _, p in trainable)


def test_peft_add_adapter_training_gradient_checkpointing(base_folder: Path) -> None:
    model = _lora(base_folder)
    model.train()
    assert model.get_input_embeddings()(DUMMY_INPUT).requires_grad is False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable()
    assert model.get_input_embeddings()(DUMMY_INPUT).requires_grad is True
    assert all(p.requires_grad for name, p in model.named_parameters() if "lora" in name.lower())
    model(DUMMY_INPUT).logits.mean().backward()
    for name, param in model.named_parameters():
        if param.requires_grad:
            assert "lora" in name.lower() and param.grad is not None


def test_peft_add_multi_adapter(base_folder: Path, tmp_path: Path) -> None:
    model = _lora(base_folder)
    original = _logits(_base(base_folder))
    adapter_1 = _logits(model)
    torch.manual_seed(3)
    model.add_adapter(
        peft.LoraConfig(init_lora_weights=False, target_modules=TARGETS), adapter_name="adapter-2"
    )
    adapter_2 = _logits(model)  # transformers' add_adapter on a loragen model activates the new adapter
    model.generate(input_ids=DUMMY_INPUT, max_new_tokens=2, do_sample=False)
    model.set_adapter("default")
    assert model.active_adapters() == ["default"]
    model.set_adapter("adapter-2")
    assert model.active_adapters() == ["adapter-2"]
    assert not torch.allclose(adapter_1, adapter_2, atol=1e-6, rtol=1e-6)
    assert not torch.allclose(original, adapter_2, atol=1e-6, rtol=1e-6)
    # several active adapters: refused, naming loragen's ways to combine adapters
    with pytest.raises(loragen.AdapterError, match=r"several active adapters.*add_weighted_adapter"):
        model.set_adapter(["adapter-2", "default"])


def test_save_pretrained_puts_the_active_adapter_at_the_root(base_folder: Path, tmp_path: Path) -> None:
    model = _lora(base_folder)
    torch.manual_seed(4)
    model.add_adapter(peft.LoraConfig(init_lora_weights=False, target_modules=TARGETS), "adapter_2")
    model.save_pretrained(tmp_path / "saved")
    # transformers writes the active adapter at the root; the others go in <name>/ as peft writes them
    root = loragen.load_adapter(_base(base_folder), tmp_path / "saved")
    torch.testing.assert_close(_logits(root), _logits(model))
    model.set_adapter("default")
    other = loragen.load_adapter(_base(base_folder), tmp_path / "saved" / "default")
    torch.testing.assert_close(_logits(other), _logits(model))
    assert not (tmp_path / "saved" / "adapter_2").exists()


def test_delete_adapter(base_folder: Path) -> None:
    model = _lora(base_folder)
    config = peft.LoraConfig(init_lora_weights=False, target_modules=TARGETS)
    model.add_adapter(config, adapter_name="adapter_1")
    model.add_adapter(config, adapter_name="adapter_2")
    assert loragen.list_adapters(model) == ["default", "adapter_1", "adapter_2"]

    model.delete_adapter("adapter_1")
    assert loragen.list_adapters(model) == ["default", "adapter_2"]
    model.delete_adapter("adapter_2")
    assert loragen.list_adapters(model) == ["default"]

    model.add_adapter(config, adapter_name="adapter_1")
    model.add_adapter(config, adapter_name="adapter_2")
    model.delete_adapter(["adapter_1", "adapter_2"])
    assert loragen.list_adapters(model) == ["default"]

    with pytest.raises(loragen.AdapterNameError, match="nonexistent_adapter"):
        model.delete_adapter("nonexistent_adapter")
    model.add_adapter(config, adapter_name="adapter_1")
    with pytest.raises(loragen.AdapterNameError, match="nonexistent_adapter"):
        model.delete_adapter(["adapter_1", "nonexistent_adapter"])
    assert "adapter_1" in loragen.list_adapters(model)  # nothing deleted

    model.add_adapter(config, adapter_name="adapter_2")
    model.delete_adapter([])
    model.delete_adapter(None)
    assert loragen.list_adapters(model) == ["default", "adapter_1", "adapter_2"]
    model.delete_adapter(["adapter_1", "adapter_1"])  # each name once
    assert loragen.list_adapters(model) == ["default", "adapter_2"]


def test_deleting_the_adapter_that_brought_modules_to_save_stops_them_training(base_folder: Path) -> None:
    model = _lora(base_folder, modules_to_save=["lm_head"])
    model.add_adapter(peft.LoraConfig(target_modules=TARGETS), "other")
    model.delete_adapter("default")
    assert not model.lm_head.weight.requires_grad
    model.delete_adapter("other")
    # no adapter left: nothing trains (peft's rule)
    assert not any(p.requires_grad for p in model.parameters())


def test_peft_load_adapter_training_inference_mode_true(base_folder: Path, peft_adapter: Path) -> None:
    model = _lora(base_folder)
    model.train()
    model.load_adapter(str(peft_adapter), "loaded")
    assert not any(p.requires_grad for p in model.parameters())
    assert not any(m.training for m in model.modules())


def test_peft_load_adapter_training_inference_mode_false(base_folder: Path, peft_adapter: Path) -> None:
    model = loragen.load_adapter(_base(base_folder), peft_adapter)  # eval, frozen
    model.load_adapter(str(peft_adapter), "trained", is_trainable=True)
    layers = find_lora_layers(model)
    assert layers
    for path, module in model.named_modules():
        if any(path == p or path.startswith(p + ".") for p in layers):
            assert module.training  # the LoRA layers and their factors' modules
        elif not list(module.children()):
            assert not module.training and not any(p.requires_grad for p in module.parameters())
    trained = [p for name, p in model.named_parameters() if ".lora_adapters.trained." in name]
    assert trained and all(p.requires_grad for p in trained)


def test_load_adapter_reads_adapter_kwargs_subfolder(
    base_folder: Path, peft_adapter: Path, tmp_path: Path
) -> None:
    outer = tmp_path / "repo"
    (outer / "test_subfolder").mkdir(parents=True)
    for item in peft_adapter.iterdir():
        (outer / "test_subfolder" / item.name).write_bytes(item.read_bytes())
    model = _lora(base_folder)
    model.load_adapter(str(outer), "sub", adapter_kwargs={"revision": "main", "subfolder": "test_subfolder"})
    model.set_adapter("sub")
    reference = peft.PeftModel.from_pretrained(_base(base_folder), str(peft_adapter))
    torch.testing.assert_close(_logits(model), _logits(reference))
    with pytest.raises(loragen.AdapterError, match="not an adapter folder"):
        model.load_adapter(str(outer), "nope")  # the root holds no adapter
    with pytest.raises(loragen.AdapterError, match=r"adapter_kwargs \['colour'\]"):
        model.load_adapter(str(outer), "nope", adapter_kwargs={"subfolder": "test_subfolder", "colour": 1})


def test_enable_peft_hotswap_after_an_adapter_is_refused(base_folder: Path) -> None:
    model = _lora(base_folder)
    with pytest.raises(loragen.AdapterError, match=r"before the first adapter.*loragen\.load_adapter"):
        model.enable_peft_hotswap(target_rank=16)


def test_peft_add_adapter_with_state_dict_is_refused(base_folder: Path, peft_adapter: Path) -> None:
    model = _lora(base_folder)
    with pytest.raises(loragen.AdapterError, match="not a local adapter folder"):
        model.load_adapter(peft_model_id=None, adapter_name="x")
    with pytest.raises(loragen.AdapterError, match="save it as an adapter folder"):
        model.load_adapter(
            adapter_state_dict={}, peft_config=peft.LoraConfig(target_modules=TARGETS), adapter_name="x"
        )
