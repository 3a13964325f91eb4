"""Adapters with LoRA on MoE expert parameters: interchangeable with peft both ways; loragen merge refuses."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import safetensors.torch
import torch

import loragen
from loragen.adapters.offline_merge import MergeError, merge_checkpoint
from loragen.cli import main
from loragen.errors import AdapterError
from tests.layers.experts_models import make, peft, tokens

CONFIG = {
    "r": 2,
    "lora_alpha": 6,
    "target_modules": ["q_proj"],
    "init_lora_weights": False,
    "target_parameters": ["experts.gate_up_proj", "experts.down_proj"],
    "rank_pattern": {"down_proj": 3},
}


def _loragen_model(kind: str, seed: int = 5) -> torch.nn.Module:
    torch.manual_seed(seed)
    return loragen.get_lora_model(make(kind), loragen.LoraConfig(**CONFIG))  # type: ignore[arg-type]


def _peft_model(kind: str, seed: int = 5) -> torch.nn.Module:
    torch.manual_seed(seed)
    return peft.get_peft_model(make(kind), peft.LoraConfig(**CONFIG))


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_peft_loads_what_loragen_saves(kind: str, tmp_path: Path) -> None:
    model = _loragen_model(kind)
    loragen.save_adapter(model, tmp_path / "adapter")
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert sorted(saved["target_parameters"]) == sorted(CONFIG["target_parameters"])
    loaded = peft.PeftModel.from_pretrained(make(kind), tmp_path / "adapter")
    expected = peft.get_peft_model_state_dict(loaded)
    written = safetensors.torch.load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert set(written) == set(expected)  # no missing, no unexpected key
    for key, value in written.items():
        torch.testing.assert_close(expected[key], value, rtol=0, atol=0, msg=key)
    ids = tokens()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_loragen_loads_what_peft_saves(kind: str, tmp_path: Path) -> None:
    reference = _peft_model(kind)
    reference.save_pretrained(tmp_path / "adapter")
    plain = loragen.load_adapter(make(kind), tmp_path / "adapter")  # strict: no missing, no unexpected key
    converted = loragen.load_adapter(
        _loragen_model(kind, seed=9), tmp_path / "adapter"
    )  # into existing factors
    ids = tokens()
    with torch.no_grad():
        want = reference(ids).logits
        torch.testing.assert_close(plain(ids).logits, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(converted(ids).logits, want, rtol=1e-5, atol=1e-5)
    experts = plain.model.layers[1].mlp.experts
    assert experts.lora_targets.down_proj.lora_A.shape[0] == 3 * 4  # rank_pattern per parameter: r * experts
    loragen.save_adapter(plain, tmp_path / "again")
    first = safetensors.torch.load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    second = safetensors.torch.load_file(tmp_path / "again" / "adapter_model.safetensors")
    assert set(first) == set(second)
    for key in first:
        torch.testing.assert_close(second[key], first[key], rtol=0, atol=0, msg=key)


def test_a_wrong_rank_is_reported_and_nothing_changes(tmp_path: Path) -> None:
    _peft_model("mixtral").save_pretrained(tmp_path / "adapter")
    model = loragen.get_lora_model(make("mixtral"), loragen.LoraConfig(**{**CONFIG, "rank_pattern": {}}))  # type: ignore[arg-type]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(
        AdapterError, match=r"experts.lora_B.weight: expected shape \(16, 8\), found \(16, 12\)"
    ):
        loragen.load_adapter(model, tmp_path / "adapter")
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_merged_model_matches_peft_merge(tmp_path: Path) -> None:
    reference = _peft_model("mixtral")
    reference.save_pretrained(tmp_path / "adapter")
    model = loragen.merge_and_unload(loragen.load_adapter(make("mixtral"), tmp_path / "adapter"))
    merged = reference.merge_and_unload()
    assert set(model.state_dict()) == set(merged.state_dict())
    for key, value in merged.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value, rtol=1e-6, atol=1e-6, msg=key)


def test_loragen_merge_refuses_expert_adapters_by_key_and_writes_nothing(tmp_path: Path) -> None:
    base = make("mixtral")
    safetensors.torch.save_file(
        {k: v.contiguous() for k, v in base.state_dict().items()}, tmp_path / "base.safetensors"
    )
    _peft_model("mixtral").save_pretrained(tmp_path / "adapter")
    out = tmp_path / "out.safetensors"
    with pytest.raises(
        MergeError, match=r"target_parameters=.*model\.layers\.0\.mlp\.experts\.base_layer\.lora_A\.weight"
    ):
        merge_checkpoint(tmp_path / "base.safetensors", tmp_path / "adapter", out)
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "base.safetensors"]


def test_the_merge_command_refuses_them_too(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = make("olmoe")
    safetensors.torch.save_file(
        {k: v.contiguous() for k, v in base.state_dict().items()}, tmp_path / "base.safetensors"
    )
    loragen.save_adapter(_loragen_model("olmoe"), tmp_path / "adapter")
    argv = [
        "merge",
        "--base",
        str(tmp_path / "base.safetensors"),
        "--adapter",
        str(tmp_path / "adapter"),
        "-o",
        str(tmp_path / "out.safetensors"),
    ]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "loragen merge: error: the adapter adapts parameters directly" in err
    assert (
        "model.layers.0.mlp.experts.lora_B.weight" in err
        and "(2 more)" in err
        and "nothing was written" in err
    )
    assert not (tmp_path / "out.safetensors").exists()


def test_save_without_a_config_is_refused() -> None:
    model = _loragen_model("mixtral")
    del model.loragen_config
    with pytest.raises(AdapterError, match=r"model.layers.0.mlp.experts.*LoRA on parameters"):
        loragen.save_adapter(model, "/nonexistent/never-written")


def test_a_copy_of_a_converted_model_still_trains() -> None:
    model = copy.deepcopy(_loragen_model("olmoe"))
    loss = model(tokens()).logits.square().mean()
    loss.backward()
    grads = [p.grad for name, p in model.named_parameters() if "lora_targets" in name]
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)
