"""transformers' adapter methods on loragen models act on loragen's adapters with peft's semantics.

Each way in (``get_lora_model``, ``load_adapter``, ``@lora_convert``, a rewritten modeling file with
``mark_trainable``) on Llama, GPT-2 and Mixtral built from tiny configs: ``model.load_adapter`` adds a
loragen adapter (never a peft layer around loragen's), ``set_adapter`` / ``disable_adapters`` /
``enable_adapters`` / ``active_adapters`` switch it, ``get_adapter_state_dict`` and ``save_pretrained``
give peft's adapter, ``save_pretrained(full_model=True)`` transformers' full save.
"""

from __future__ import annotations

import copy
import importlib.util
import io
import json
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import loragen
from loragen.adapters.folder import PEFT_PREFIX
from loragen.adapters.save import adapter_state_dict

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

VOCAB = 64
_SMALL = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2)


def _llama() -> nn.Module:
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**_SMALL, intermediate_size=24, num_key_value_heads=1)
    )


def _gpt2() -> nn.Module:
    return transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=VOCAB, n_positions=32)
    )


def _mixtral() -> nn.Module:
    return transformers.MixtralForCausalLM(
        transformers.MixtralConfig(
            **_SMALL, intermediate_size=24, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2
        )
    )


MODELS: dict[str, tuple[Callable[[], nn.Module], list[str] | str]] = {
    "llama": (_llama, ["q_proj", "v_proj"]),
    "gpt2": (_gpt2, ["c_attn"]),
    # a further adapter cannot target parameters in loragen: linear modules only (all-linear: test_all_linear_moe)
    "mixtral": (_mixtral, ["q_proj", "o_proj"]),
}


class DecoratedLlama(transformers.LlamaForCausalLM):
    """A user's subclass, converted through ``@lora_convert``'s generated ``get_lora_model``."""


def _base(kind: str) -> nn.Module:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return MODELS[kind][0]().eval()


def _config(kind: str, **changes: object) -> loragen.LoraConfig:
    return loragen.LoraConfig(
        r=4, lora_alpha=8, target_modules=MODELS[kind][1], init_lora_weights=False, **changes
    )


def _adapter_folder(kind: str, seed: int, folder: Path) -> Path:
    torch.manual_seed(seed)
    loragen.save_adapter(loragen.get_lora_model(_base(kind), _config(kind)), folder)
    return folder


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(3))


def _logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(_tokens()).logits


def _converted(way: str, kind: str, folder_a: Path, tmp_path: Path) -> nn.Module:
    """The base model of ``kind`` holding adapter A (``folder_a``) as "default", made the ``way`` given."""
    if way == "load_adapter":
        return loragen.load_adapter(_base(kind), folder_a)
    if way == "get_lora_model":
        model = loragen.get_lora_model(_base(kind), _config(kind))
    elif way == "lora_convert":
        decorated = loragen.lora_convert(DecoratedLlama)
        torch.manual_seed(0)
        model = decorated(_base("llama").config).eval()
        model.load_state_dict(_base("llama").state_dict())
        model.get_lora_model(_config(kind))
    else:  # "rewrite": GPT-2's modeling file rewritten, then mark_trainable as a rewritten model needs
        source = Path(transformers.__file__).parent / "models" / "gpt2" / "modeling_gpt2.py"
        result = loragen.rewrite_source(
            source.read_text(), _config(kind), filename=str(source), package="transformers.models.gpt2"
        )
        assert result.ok, [str(e) for e in result.errors]
        target = tmp_path / "modeling_gpt2_lora.py"
        target.write_text(result.code)
        spec = importlib.util.spec_from_file_location("loragen_test_gpt2_lora", target)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        base = _base(kind)
        model = module.GPT2LMHeadModel(base.config).eval()
        model.load_state_dict(base.state_dict(), strict=False)
        loragen.mark_trainable(model)
    return loragen.load_adapter(model, folder_a)


WAYS = [
    ("get_lora_model", "llama"),
    ("get_lora_model", "gpt2"),
    ("get_lora_model", "mixtral"),
    ("load_adapter", "llama"),
    ("load_adapter", "gpt2"),
    ("load_adapter", "mixtral"),
    ("lora_convert", "llama"),
    ("rewrite", "gpt2"),
]


@pytest.mark.parametrize(("way", "kind"), WAYS, ids=[f"{w}-{k}" for w, k in WAYS])
def test_transformers_adapter_methods_act_on_loragen_adapters(way: str, kind: str, tmp_path: Path) -> None:
    folder_a = _adapter_folder(kind, 1, tmp_path / "a")
    folder_b = _adapter_folder(kind, 2, tmp_path / "b")
    base_out = _logits(_base(kind))
    only_a = _logits(loragen.load_adapter(_base(kind), folder_a))
    only_b = _logits(loragen.load_adapter(_base(kind), folder_b))

    model = _converted(way, kind, folder_a, tmp_path)
    layers_before = set(loragen.convert.find_lora_layers(model))
    model.load_adapter(str(folder_b), "B")
    # a loragen adapter beside "default": no peft layer anywhere, no new wrapping
    assert not any(type(m).__module__.startswith("peft") for m in model.modules())
    assert set(loragen.convert.find_lora_layers(model)) == layers_before
    assert loragen.list_adapters(model) == ["default", "B"]
    assert model.active_adapters() == ["default"]  # loading does not activate, as in transformers
    torch.testing.assert_close(_logits(model), only_a)

    model.set_adapter("B")
    assert model.active_adapters() == ["B"] == [loragen.active_adapter(model)]
    torch.testing.assert_close(_logits(model), only_b)
    model.disable_adapters()
    torch.testing.assert_close(_logits(model), base_out)
    model.enable_adapters()
    torch.testing.assert_close(_logits(model), only_b)

    # get_adapter_state_dict: peft's file keys without base_model.model., the active adapter by default
    expected = adapter_state_dict(
        model, loragen.adapters.save.adapter_config_for(model, "B"), adapter_name="B"
    )
    got = model.get_adapter_state_dict()
    assert set(got) == {k.removeprefix(PEFT_PREFIX) for k in expected}
    for key, value in expected.items():
        torch.testing.assert_close(got[key.removeprefix(PEFT_PREFIX)], value)

    # save_pretrained: the active adapter B at the root (as transformers), "default" in its subfolder (as
    # PeftModel.save_pretrained); peft loads both
    out = tmp_path / "saved"
    model.save_pretrained(out)
    assert (out / "adapter_config.json").is_file() and (
        out / "default" / "adapter_model.safetensors"
    ).is_file()
    assert not (out / "config.json").exists() and not (out / "model.safetensors").exists()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        twin = peft.PeftModel.from_pretrained(_base(kind), str(out))
        twin_a = peft.PeftModel.from_pretrained(_base(kind), str(out / "default"))
    torch.testing.assert_close(_logits(twin), only_b)
    torch.testing.assert_close(_logits(twin_a), only_a)


def test_set_adapter_while_disabled_takes_effect_once_enabled(tmp_path: Path) -> None:
    model = loragen.load_adapter(_base("llama"), _adapter_folder("llama", 1, tmp_path / "a"))
    model.load_adapter(str(_adapter_folder("llama", 2, tmp_path / "b")), "B")
    only_b = _logits(loragen.load_adapter(_base("llama"), tmp_path / "b"))
    model.disable_adapters()
    model.set_adapter("B")
    torch.testing.assert_close(_logits(model), _logits(_base("llama")))  # still disabled
    model.enable_adapters()
    assert model.active_adapters() == ["B"]
    torch.testing.assert_close(_logits(model), only_b)


def test_save_pretrained_full_model_keeps_transformers_save(tmp_path: Path) -> None:
    model = loragen.get_lora_model(_base("llama"), _config("llama"))
    model.save_pretrained(tmp_path, full_model=True)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert (tmp_path / "model.safetensors").is_file() and not (tmp_path / "adapter_config.json").exists()


def test_after_merge_and_unload_save_pretrained_writes_the_merged_model(tmp_path: Path) -> None:
    model = loragen.get_lora_model(_base("llama"), _config("llama"))
    merged_out = _logits(model)
    loragen.merge_and_unload(model)
    model.save_pretrained(tmp_path)  # as peft's merge_and_unload gives the plain model back
    assert not (tmp_path / "adapter_config.json").exists()
    reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    torch.testing.assert_close(_logits(reloaded), merged_out, rtol=1e-5, atol=1e-5)


def test_loading_over_an_existing_name_is_refused_naming_the_loragen_call(tmp_path: Path) -> None:
    folder = _adapter_folder("llama", 1, tmp_path / "a")
    model = loragen.load_adapter(_base("llama"), folder)
    with pytest.raises(
        loragen.AdapterNameError, match=r"holds an adapter 'default' already.*loragen\.load_adapter"
    ):
        model.load_adapter(str(folder))
    with pytest.raises(loragen.AdapterError, match="not a local adapter folder"):
        model.load_adapter("some-user/some-adapter", "hub")
    with pytest.raises(loragen.AdapterError, match=r"hotswap=True.*loragen\.load_adapter"):
        model.load_adapter(str(folder), "default", hotswap=True)


def test_several_active_adapters_are_refused_naming_the_loragen_calls() -> None:
    model = loragen.get_lora_model(_base("llama"), _config("llama"))
    model.add_adapter(peft.LoraConfig(r=2, target_modules=["k_proj"]), "other")
    assert model.active_adapters() == ["other"]  # transformers' add_adapter activates the new adapter
    with pytest.raises(
        loragen.AdapterError, match=r"several active adapters.*add_weighted_adapter.*mixed_batch"
    ):
        model.set_adapter(["default", "other"])
    with pytest.raises(loragen.AdapterNameError, match="unknown adapter 'nope'"):
        model.set_adapter("nope")
    model.delete_adapter("other")
    assert loragen.list_adapters(model) == ["default"]


def test_save_pretrained_refuses_full_model_keywords_without_full_model(tmp_path: Path) -> None:
    model = loragen.get_lora_model(_base("llama"), _config("llama"))
    with pytest.raises(loragen.AdapterError, match=r"push_to_hub.*full_model=True"):
        model.save_pretrained(tmp_path, push_to_hub=True)
    assert not any(tmp_path.iterdir())


def test_the_class_keeps_its_name_and_survives_pickle_and_deepcopy() -> None:
    model = loragen.get_lora_model(_base("llama"), _config("llama"))
    assert isinstance(model, transformers.LlamaForCausalLM) and type(model).__name__ == "LlamaForCausalLM"
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    again = torch.load(buffer, weights_only=False)
    assert type(again) is type(model) is type(copy.deepcopy(model))
    torch.testing.assert_close(_logits(again), _logits(model))


def test_a_plain_module_is_left_alone() -> None:
    model = loragen.get_lora_model(nn.Sequential(nn.Linear(4, 4)), loragen.LoraConfig(target_modules=["0"]))
    assert type(model) is nn.Sequential


@pytest.mark.slow
def test_methods_come_whatever_the_import_order() -> None:
    # ``loragen.convert`` imported before torch: the package loads lazily and nothing imported the hook
    # module; the first conversion must still give the model loragen's adapter methods
    script = (
        "import loragen.convert as convert\n"
        "import torch\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "from loragen.config import LoraConfig\n"
        "config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,\n"
        "    num_attention_heads=2, num_key_value_heads=2, vocab_size=64)\n"
        "model = convert.get_lora_model(LlamaForCausalLM(config), LoraConfig(r=2, target_modules=['q_proj']))\n"
        "print(type(model) is not LlamaForCausalLM and isinstance(model, LlamaForCausalLM))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "True"
