"""transformers' own peft-integration suite (``tests/peft_integration/test_peft_integration.py``), ported to
loragen models and run offline.

transformers runs its cases on hub checkpoints (a tiny random OPT and a LoRA adapter for it); here the same
tiny OPT is built from a config and saved to a local folder, and the adapter folders are written by peft
itself. transformers' methods on a plain model drive peft; the cases start from a loragen model instead
(``loragen.get_lora_model`` with a peft ``LoraConfig``, or ``loragen.load_adapter``), whose adapter methods
act on loragen's adapters. Every case of transformers' file is here, under its name, except those that need
the hub as such (``pipeline("text-generation", adapter_id)`` gets a loragen model and an in-memory tokenizer
instead). Cases loragen refuses on purpose (several active adapters at once, pickled adapters, adapters
given as state dicts, non-LoRA adapters, hotswapping, loads with missing or unexpected keys) are listed in
docs/coming-from-peft.md with the message each gives; ``test_the_documented_refusals_are_loragens`` runs
that list.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import loragen
from loragen.convert import find_lora_layers

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
DUMMY_INPUT = torch.LongTensor([[0, 1, 2, 3, 4, 5, 6, 7]])
TARGETS = ["q_proj", "v_proj"]  # peft's default targets for OPT
CLASSES = ("AutoModelForCausalLM", "OPTForCausalLM")  # transformers' transformers_test_model_classes


def _opt_config(width: int, **extra: object) -> object:
    return transformers.OPTConfig(
        vocab_size=64,
        hidden_size=width,
        num_hidden_layers=2,
        ffn_dim=2 * width,
        num_attention_heads=2,
        max_position_embeddings=64,
        word_embed_proj_dim=width,
        **extra,
    )


@pytest.fixture(scope="module")
def base_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random OPTForCausalLM saved as a local checkpoint (transformers' tiny-random-OPTForCausalLM)."""
    folder = tmp_path_factory.mktemp("tiny-random-OPTForCausalLM")
    torch.manual_seed(0)
    transformers.OPTForCausalLM(_opt_config(16)).save_pretrained(folder)
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


def _base(folder: Path, transformers_class: str = "OPTForCausalLM", **kwargs: object) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return getattr(transformers, transformers_class).from_pretrained(folder, **kwargs)


def _lora(base_folder: Path, **config: object) -> nn.Module:
    """The tiny OPT with a fresh loragen adapter from a peft config (``add_adapter``'s start); no
    ``target_modules``, as in transformers' cases: peft's default targets for OPT."""
    torch.manual_seed(2)
    settings: dict[str, object] = {"init_lora_weights": False, **config}
    return loragen.get_lora_model(_base(base_folder), peft.LoraConfig(**settings))


def _logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(DUMMY_INPUT).logits


@pytest.mark.parametrize("transformers_class", CLASSES)
def test_peft_from_pretrained(
    base_folder: Path, peft_adapter: Path, transformers_class: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        model = loragen.load_adapter(_base(base_folder, transformers_class), peft_adapter)
    assert "unexpected keys" not in caplog.text and "missing keys" not in caplog.text
    assert find_lora_layers(model)
    assert model._hf_peft_config_loaded
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


def test_peft_add_adapter(base_folder: Path) -> None:
    model = _lora(base_folder)  # peft.LoraConfig(init_lora_weights=False): peft's default targets
    assert {path.rpartition(".")[2] for path in find_lora_layers(model)} == set(TARGETS)
    assert set(model.peft_config["default"].target_modules) == set(TARGETS)
    model.generate(input_ids=DUMMY_INPUT, max_new_tokens=2, do_sample=False)


def test_peft_add_adapter_from_pretrained(base_folder: Path, tmp_path: Path) -> None:
    model = _lora(base_folder, r=4, lora_alpha=8)  # loragen.get_lora_model takes a peft config
    assert find_lora_layers(model) and model.loragen_config.r == 4
    # a model saved after add_adapter loads back through transformers' from_pretrained
    model.save_pretrained(tmp_path)
    for transformers_class in CLASSES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            again = getattr(transformers, transformers_class).from_pretrained(tmp_path)
        assert any(isinstance(m, peft.tuners.tuners_utils.BaseTunerLayer) for m in again.modules())
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
    with pytest.warns(FutureWarning, match="active_adapters"):  # transformers 4's deprecated form
        assert model.active_adapter() == "default"
    model.set_adapter("adapter-2")
    assert model.active_adapters() == ["adapter-2"]
    with pytest.warns(FutureWarning):
        assert model.active_adapter() == "adapter-2"
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
    config = peft.LoraConfig(init_lora_weights=False, target_modules=TARGETS)
    model = _lora(base_folder)
    model.add_adapter(config, adapter_name="adapter_1")
    model.add_adapter(config, adapter_name="adapter_2")
    model.delete_adapter("default")  # transformers' case starts from a model holding adapter_1 and adapter_2
    assert "adapter_1" in model.peft_config and "adapter_2" in model.peft_config
    assert model.peft_config["adapter_1"].r == config.r

    model.delete_adapter("adapter_1")
    assert "adapter_1" not in model.peft_config and "adapter_2" in model.peft_config
    model.delete_adapter("adapter_2")
    assert not hasattr(model, "peft_config")
    assert not model._hf_peft_config_loaded

    model.add_adapter(config, adapter_name="adapter_1")
    model.add_adapter(config, adapter_name="adapter_2")
    assert model._hf_peft_config_loaded
    model.delete_adapter(["adapter_1", "adapter_2"])
    assert not hasattr(model, "peft_config")
    assert not model._hf_peft_config_loaded

    with pytest.raises(ValueError, match=re.escape("No adapter loaded. Please load an adapter first.")):
        model.delete_adapter("nonexistent_adapter")
    model.add_adapter(config, adapter_name="adapter_1")
    with pytest.raises(loragen.AdapterNameError, match=r"The following adapter\(s\) are not present"):
        model.delete_adapter("nonexistent_adapter")
    with pytest.raises(ValueError, match=r"The following adapter\(s\) are not present.*nonexistent_adapter"):
        model.delete_adapter(["adapter_1", "nonexistent_adapter"])
    assert "adapter_1" in model.peft_config  # nothing deleted

    model.add_adapter(config, adapter_name="adapter_2")
    model.delete_adapter([])
    model.delete_adapter(None)
    assert list(model.peft_config) == ["adapter_1", "adapter_2"]
    model.delete_adapter(["adapter_1", "adapter_1"])  # each name once
    assert "adapter_1" not in model.peft_config and "adapter_2" in model.peft_config


def test_adapter_methods_without_an_adapter_raise_transformers_error(base_folder: Path) -> None:
    model = _lora(base_folder)
    model.delete_adapter("default")
    for call in (
        model.active_adapters,
        model.disable_adapters,
        model.enable_adapters,
        model.get_adapter_state_dict,
        lambda: model.set_adapter("default"),
    ):
        with pytest.raises(loragen.AdapterError, match=re.escape("No adapter loaded")):
            call()


def test_hf_peft_config_loaded_follows_the_adapters_and_takes_an_assignment(
    base_folder: Path, tmp_path: Path
) -> None:
    """Some transformers models switch the flag off around a full save (Granite Speech's save_pretrained)."""
    model = _lora(base_folder)
    assert model._hf_peft_config_loaded
    model._hf_peft_config_loaded = False
    assert not model._hf_peft_config_loaded
    model.save_pretrained(tmp_path, full_model=True)  # transformers' full save, whatever the flag says
    assert (tmp_path / "model.safetensors").is_file() and not model._hf_peft_config_loaded
    model._hf_peft_config_loaded = True
    assert model._hf_peft_config_loaded


def test_delete_adapter_with_modules_to_save(base_folder: Path) -> None:
    model = loragen.get_lora_model(
        _base(base_folder),
        peft.LoraConfig(init_lora_weights=False, target_modules=TARGETS, modules_to_save=["lm_head"]),
    )
    assert "default" in model.peft_config
    assert model.peft_config["default"].modules_to_save == ("lm_head",)
    assert model.lm_head.weight.requires_grad
    model.delete_adapter("default")
    assert not hasattr(model, "peft_config")
    assert not model.lm_head.weight.requires_grad  # modules_to_save went with the adapter


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


# ---- the rest of transformers' file: quantized bases, pipelines, Trainer, adapters written by peft --------


@pytest.fixture(scope="module")
def wide_base_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny OPT at width 64: bitsandbytes' CPU 4-bit kernels need widths that are multiples of 32."""
    folder = tmp_path_factory.mktemp("tiny-random-OPTForCausalLM-64")
    torch.manual_seed(0)
    transformers.OPTForCausalLM(_opt_config(64)).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def wide_peft_adapter(wide_base_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-OPTForCausalLM-64-lora")
    torch.manual_seed(1)
    model = peft.get_peft_model(
        _base(wide_base_folder), peft.LoraConfig(init_lora_weights=False, target_modules=TARGETS)
    )
    model.save_pretrained(folder)
    return folder


def _quantized(folder: Path, bits: int) -> nn.Module:
    pytest.importorskip("bitsandbytes")
    config = (
        transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
        if bits == 4
        else transformers.BitsAndBytesConfig(load_in_8bit=True)
    )
    return _base(folder, "AutoModelForCausalLM", quantization_config=config, device_map="cpu")


def test_peft_from_pretrained_kwargs(wide_base_folder: Path, wide_peft_adapter: Path) -> None:
    import bitsandbytes as bnb

    model = loragen.load_adapter(_quantized(wide_base_folder, 8), wide_peft_adapter)
    assert isinstance(model.model.decoder.layers[0].self_attn.v_proj, bnb.nn.Linear8bitLt)
    assert find_lora_layers(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bitsandbytes: inputs cast to float16
        model.generate(input_ids=DUMMY_INPUT, max_new_tokens=2, do_sample=False)


@pytest.mark.parametrize("bits", [4, 8])
def test_peft_save_quantized(
    wide_base_folder: Path, wide_peft_adapter: Path, bits: int, tmp_path: Path
) -> None:
    import bitsandbytes as bnb

    model = loragen.load_adapter(_quantized(wide_base_folder, bits), wide_peft_adapter)
    kind = bnb.nn.Linear4bit if bits == 4 else bnb.nn.Linear8bitLt
    assert isinstance(model.model.decoder.layers[0].self_attn.v_proj, kind)
    model.save_pretrained(tmp_path)
    files = {p.name for p in tmp_path.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json"} <= files
    assert not files & {"pytorch_model.bin", "model.safetensors"}
    # the adapter is peft's: the float adapter back, equal to what peft wrote
    saved = loragen.load_adapter(_base(wide_base_folder), tmp_path).get_adapter_state_dict()
    original = loragen.load_adapter(_base(wide_base_folder), wide_peft_adapter).get_adapter_state_dict()
    assert saved.keys() == original.keys()
    for key, value in saved.items():
        torch.testing.assert_close(value, original[key], rtol=0, atol=0)


def test_peft_save_quantized_regression(
    wide_base_folder: Path, wide_peft_adapter: Path, tmp_path: Path
) -> None:
    """A quantized model's adapter saved and loaded into another quantized base gives the same logits."""
    model = loragen.load_adapter(_quantized(wide_base_folder, 8), wide_peft_adapter)
    model.save_pretrained(tmp_path)
    assert not (tmp_path / "model.safetensors").exists()
    again = loragen.load_adapter(_quantized(wide_base_folder, 8), tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bitsandbytes: inputs cast to float16
        torch.testing.assert_close(_logits(again), _logits(model), rtol=0, atol=0)


def test_trainer_fine_tunes_a_quantized_loragen_model(
    wide_base_folder: Path, wide_peft_adapter: Path, tmp_path: Path
) -> None:
    """Trainer refuses a quantized model unless ``_hf_peft_config_loaded`` says it holds adapters."""
    model = loragen.load_adapter(_quantized(wide_base_folder, 4), wide_peft_adapter, trainable=True)
    assert model._hf_peft_config_loaded
    before = {k: v.clone() for k, v in model.get_adapter_state_dict().items()}
    data = [{"input_ids": torch.arange(8), "labels": torch.arange(8)}] * 2
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, report_to=[], use_cpu=True
    )
    transformers.Trainer(model=model, args=args, train_dataset=data).train()
    after = model.get_adapter_state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def _tokenizer() -> object:
    """A word-level tokenizer over the tiny OPT's 64 ids, built in memory (no hub)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(61)} | {"[UNK]": 61, "Hello": 62, "Who": 63}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="w1", eos_token="w2"
    )


def test_peft_pipeline(base_folder: Path, peft_adapter: Path) -> None:
    model = loragen.load_adapter(_base(base_folder), peft_adapter)
    lora_pipe = transformers.pipeline("text-generation", model=model, tokenizer=_tokenizer())
    base_pipe = transformers.pipeline("text-generation", model=_base(base_folder), tokenizer=_tokenizer())
    assert len(list(lora_pipe.model.parameters())) != len(list(base_pipe.model.parameters()))
    generated = lora_pipe("Hello", max_new_tokens=3, do_sample=False)
    assert generated[0]["generated_text"].startswith("Hello")


def test_peft_pipeline_no_warning(
    base_folder: Path, peft_adapter: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = loragen.load_adapter(_base(base_folder), peft_adapter)
    with caplog.at_level(logging.ERROR, logger="transformers.pipelines.base"):
        generator = transformers.pipeline(
            "text-generation", model=model, tokenizer=_tokenizer(), max_length=10
        )
        generator("Who w3 w4", max_new_tokens=3, do_sample=False)
    assert "is not supported for text-generation" not in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_peft_from_pretrained_hub_kwargs(base_folder: Path, peft_adapter: Path, tmp_path: Path) -> None:
    """transformers' hub repo with the adapter in a subfolder and a revision: a local folder here; the hub
    keywords are ignored for it, as transformers ignores them for a local folder."""
    outer = tmp_path / "tiny-opt-lora-revision"
    shutil.copytree(peft_adapter, outer / "test_subfolder")
    for transformers_class in CLASSES:
        model = loragen.load_adapter(_base(base_folder, transformers_class), peft_adapter)
        model.load_adapter(
            str(outer), "sub", adapter_kwargs={"revision": "main", "subfolder": "test_subfolder"}
        )
        model.set_adapter("sub")
        torch.testing.assert_close(
            _logits(model), _logits(loragen.load_adapter(_base(base_folder), peft_adapter))
        )


def test_prefix_tuning_trainer_load_best_model_at_end_error(base_folder: Path, tmp_path: Path) -> None:
    """The LoRA half of transformers' case: a sequence classifier (peft's SEQ_CLS task type: the head trains)
    trained by Trainer with an evaluation per epoch and ``load_best_model_at_end=True``."""
    torch.manual_seed(0)
    model = loragen.get_lora_model(
        transformers.OPTForSequenceClassification(_opt_config(16, num_labels=2, pad_token_id=1)),
        peft.LoraConfig(task_type=peft.TaskType.SEQ_CLS, target_modules=TARGETS),
    )
    assert model.score.weight.requires_grad
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(2, 64, (12,), generator=g), "labels": i % 2} for i in range(16)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        num_train_epochs=3,
        eval_strategy="epoch",
        save_strategy="epoch",
        load_best_model_at_end=True,
        per_device_train_batch_size=8,
        learning_rate=1e-2,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(
        model=model,
        args=args,
        train_dataset=data,
        eval_dataset=data,
        callbacks=[loragen.LoraTrainerCallback()],
    )
    trainer.train()
    best = Path(trainer.state.best_model_checkpoint)
    assert (best / "adapter_model.safetensors").is_file()
    reloaded = loragen.load_adapter(
        transformers.OPTForSequenceClassification(_opt_config(16, num_labels=2, pad_token_id=1)), best
    )
    for key, value in reloaded.get_adapter_state_dict().items():
        torch.testing.assert_close(value, model.get_adapter_state_dict()[key])


# ---- what loragen refuses on purpose (docs/coming-from-peft.md lists each with its message) ---------------


def _corrupted(peft_adapter: Path, folder: Path, change: str) -> Path:
    """A copy of peft's adapter folder with a key added (``"extra"``) or one removed (``"missing"``)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(peft_adapter, folder)
    tensors = load_file(folder / "adapter_model.safetensors")
    first = next(iter(tensors))
    if change == "extra":
        tensors["foobar"] = tensors[first].clone()
    else:
        del tensors[first]
    save_file(tensors, folder / "adapter_model.safetensors")
    return folder


def _peft_folder(base_folder: Path, folder: Path, config: object) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft.get_peft_model(_base(base_folder), config).save_pretrained(folder)
    return folder


def _ranked(base_folder: Path, folder: Path, r: int) -> nn.Module:
    """transformers' hotswap start: adapters of ranks 13 and 7 saved in ``folder``, and a model holding the
    one of rank ``r`` as "adapter_1"."""
    for rank, seed in ((13, 3), (7, 4)):
        torch.manual_seed(seed)
        config = peft.LoraConfig(r=rank, init_lora_weights=False)
        loragen.get_lora_model(_base(base_folder), config).save_pretrained(folder / f"r{rank}")
    return loragen.load_adapter(_base(base_folder), folder / f"r{r}", adapter_name="adapter_1")


REFUSALS: dict[str, Callable[[Path, Path, Path], object]] = {
    "test_peft_save_pretrained": lambda base, adapter, tmp: _lora(base).save_pretrained(
        tmp, safe_serialization=False
    ),
    "test_peft_add_multi_adapter": lambda base, adapter, tmp: _lora(base).set_adapter(
        ["adapter-2", "default"]
    ),
    "test_peft_add_adapter_with_state_dict": lambda base, adapter, tmp: _lora(base).load_adapter(
        adapter_state_dict={}, peft_config=peft.LoraConfig(target_modules=TARGETS), adapter_name="x"
    ),
    "test_peft_add_adapter_with_state_dict_low_cpu_mem_usage": lambda base, adapter, tmp: _lora(
        base
    ).load_adapter(
        adapter_state_dict={},
        peft_config=peft.LoraConfig(),
        adapter_name="other",
        low_cpu_mem_usage=True,
    ),
    "test_peft_from_pretrained_hub_kwargs": lambda base, adapter, tmp: _lora(base).load_adapter(
        str(tmp / "peft-internal-testing" / "tiny-opt-lora-revision"),
        "hub",
        adapter_kwargs={"revision": "test"},
    ),
    "test_peft_from_pretrained_unexpected_keys_warning": lambda base, adapter, tmp: _lora(base).load_adapter(
        str(_corrupted(adapter, tmp / "extra", "extra")), "other"
    ),
    "test_peft_from_pretrained_missing_keys_warning": lambda base, adapter, tmp: _lora(base).load_adapter(
        str(_corrupted(adapter, tmp / "missing", "missing")), "other"
    ),
    "test_prefix_tuning_trainer_load_best_model_at_end_error": lambda base, adapter, tmp: (
        loragen.get_lora_model(
            _base(base), peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=10)
        )
    ),
    "test_non_lora_load_adapter": lambda base, adapter, tmp: _lora(base).load_adapter(
        str(_peft_folder(base, tmp / "lokr", peft.LoKrConfig(init_weights=False, target_modules=TARGETS))),
        "lokr",
    ),
    "test_non_lora_add_adapter": lambda base, adapter, tmp: _lora(base).add_adapter(
        peft.LoKrConfig(init_weights=False), "lokr"
    ),
    "test_hotswap_wrong_peft_type_raises": lambda base, adapter, tmp: _lora(base).add_adapter(
        peft.IA3Config(feedforward_modules=[]), "ia3"
    ),
    "test_hotswap_without_existing_adapter_raises": lambda base, adapter, tmp: _lora(base).load_adapter(
        str(adapter), "adapter_1", hotswap=True
    ),
    "test_hotswap_different_adapter_name_raises": lambda base, adapter, tmp: _lora(base).load_adapter(
        str(adapter), "does_not_exist_yet", hotswap=True
    ),
    "test_hotswap_without_compile_and_with_lower_rank_works": lambda base, adapter, tmp: loragen.load_adapter(
        _ranked(base, tmp, 13), tmp / "r7", adapter_name="adapter_1"
    ),
    "test_hotswap_without_compile_and_with_higher_rank_works": lambda base, adapter, tmp: (
        loragen.load_adapter(_ranked(base, tmp, 7), tmp / "r13", adapter_name="adapter_1")
    ),
    "test_hotswap_with_compile_and_same_ranks_works": lambda base, adapter, tmp: _lora(
        base
    ).enable_peft_hotswap(target_rank=8),
    "test_hotswap_with_compile_and_lower_rank_works": lambda base, adapter, tmp: _lora(
        base
    ).enable_peft_hotswap(target_rank=13),
    "test_hotswap_with_compile_and_higher_rank_works": lambda base, adapter, tmp: _lora(
        base
    ).enable_peft_hotswap(target_rank=13),
    "test_enable_peft_hotswap_called_after_adapter_added_raises": lambda base, adapter, tmp: _lora(
        base
    ).enable_peft_hotswap(target_rank=32),
    "test_enable_peft_hotswap_called_after_adapter_added_warns": lambda base, adapter, tmp: _lora(
        base
    ).enable_peft_hotswap(target_rank=32, check_compiled="warn"),
    "test_enable_peft_hotswap_called_after_adapter_added_ignored": lambda base, adapter, tmp: _lora(
        base
    ).enable_peft_hotswap(target_rank=32, check_compiled="ignore"),
}


def _documented_refusals() -> dict[str, str]:
    """docs/coming-from-peft.md's table of refused cases: transformers' test name -> loragen's message."""
    text = (ROOT / "docs" / "coming-from-peft.md").read_text(encoding="utf-8")
    section = text.split("## transformers' adapter methods: what loragen refuses", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `test_")]
    documented = {}
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        documented[cells[0].strip("`")] = re.findall(r"`([^`]+)`", cells[-1])[0]
    return documented


def test_every_refusal_is_documented() -> None:
    assert sorted(_documented_refusals()) == sorted(REFUSALS)


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_the_documented_refusals_are_loragens(
    case: str, base_folder: Path, peft_adapter: Path, tmp_path: Path
) -> None:
    message = _documented_refusals()[case]
    with pytest.raises(loragen.LoraError) as refused:
        REFUSALS[case](base_folder, peft_adapter, tmp_path)
    assert message in str(refused.value)


def test_hotswap_without_compile_and_same_ranks_works(base_folder: Path, tmp_path: Path) -> None:
    """transformers' hotswap check, with loragen's way to put new weights into an adapter: ``load_adapter``
    into the adapter of that name (same ranks; hotswapping itself is refused, above)."""
    torch.manual_seed(0)
    model = _lora(base_folder)
    lora_1 = _logits(model)
    model.save_pretrained(tmp_path / "adapter_1")
    torch.manual_seed(5)
    other = loragen.get_lora_model(
        _base(base_folder), peft.LoraConfig(init_lora_weights=False, target_modules=TARGETS)
    )
    lora_2 = _logits(other)
    other.save_pretrained(tmp_path / "adapter_2")
    assert not torch.allclose(lora_1, lora_2, atol=1e-6, rtol=1e-6)

    fresh = loragen.load_adapter(_base(base_folder), tmp_path / "adapter_1", adapter_name="adapter_1")
    torch.testing.assert_close(_logits(fresh), lora_1)
    loragen.load_adapter(fresh, tmp_path / "adapter_2", adapter_name="adapter_1")
    assert loragen.list_adapters(fresh) == ["adapter_1"]
    torch.testing.assert_close(_logits(fresh), lora_2)
