"""peft adapter keys: every factor suffix and name comes from the registry; unknown LoRA tensors are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from loragen import LoraConfig, get_lora_model
from loragen.adapters.folder import (
    AdapterKey,
    group_lora_keys,
    inspect_adapter,
    parse_adapter_key,
    read_adapter,
)
from loragen.adapters.save import adapter_config_for
from loragen.errors import AdapterError
from loragen.layouts import EMBEDDING, LAYOUTS, PLAIN, TRANSPOSED, Layout, PlainLayout, factor_suffixes
from tests.adapters.helpers import CASES, main, make_model


@pytest.mark.parametrize(("suffix", "layout", "index"), list(factor_suffixes()), ids=str)
def test_factor_keys_follow_the_registry(suffix: str, layout: Layout, index: int) -> None:
    info = parse_adapter_key(f"base_model.model.model.layers.0.q_proj.{suffix}")
    assert info == AdapterKey(
        f"base_model.model.model.layers.0.q_proj.{suffix}",
        "model.layers.0.q_proj",
        layout.factor_names[index],
        True,
    )


def test_a_new_layout_is_read_with_no_other_change(monkeypatch) -> None:
    toy = PlainLayout("toy", ("lora_down", "lora_up"), ("lora_down.weight", "lora_up.weight"))
    monkeypatch.setitem(LAYOUTS, "toy", toy)
    keys = [parse_adapter_key(f"base_model.model.net.{name}.weight") for name in ("lora_down", "lora_up")]
    assert all(k is not None and k.is_lora and k.module == "net" for k in keys)
    factors = group_lora_keys([k for k in keys if k is not None], "file")["net"]
    assert factors.layouts == (toy,)
    assert (factors.key_a, factors.key_b) == (
        "base_model.model.net.lora_down.weight",
        "base_model.model.net.lora_up.weight",
    )


def test_full_tensor_keys_drop_peft_infixes() -> None:
    assert parse_adapter_key("base_model.model.model.layers.0.q_proj.base_layer.bias") == AdapterKey(
        "base_model.model.model.layers.0.q_proj.base_layer.bias", "model.layers.0.q_proj", "bias", False
    )
    assert (
        parse_adapter_key("base_model.model.classifier.modules_to_save.weight").model_key
        == "classifier.weight"
    )
    assert parse_adapter_key("base_model.model.classifier.original_module.weight") is None


def test_factor_names_pick_their_layouts() -> None:
    keys = [
        parse_adapter_key(f"base_model.model.{m}.{s}")
        for m, s in [("a", "lora_A.weight"), ("e", "lora_embedding_B")]
    ]
    groups = group_lora_keys([k for k in keys if k is not None], "file")
    assert groups["a"].layouts == (PLAIN, TRANSPOSED) and groups["a"].key_b is None
    assert groups["e"].layouts == (EMBEDDING,) and groups["e"].key_a is None


def _adapter(folder: Path, tensors: dict[str, torch.Tensor]) -> Path:
    folder.mkdir()
    save_file(tensors, folder / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q"]}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


LORA = {
    "base_model.model.q.lora_A.weight": torch.zeros(2, 8),
    "base_model.model.q.lora_B.weight": torch.zeros(8, 2),
}


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"base_model.model.q.lora_B.bias": torch.ones(8)},
            r"q\.lora_B\.bias: unsupported adapter tensor.*LoRA biases",
        ),
    ],
    ids=["lora-bias"],
)
def test_unsupported_lora_variants_are_refused_by_every_reader(
    tmp_path: Path, extra, message, capsys
) -> None:
    folder = _adapter(tmp_path / "adapter", {**LORA, **extra})
    with pytest.raises(AdapterError, match=message):
        read_adapter(folder)
    with pytest.raises(AdapterError, match=message):
        inspect_adapter(folder)
    save_file({"q.weight": torch.zeros(8, 8)}, tmp_path / "base.safetensors")
    status = main(
        [
            "merge",
            "--base",
            str(tmp_path / "base.safetensors"),
            "--adapter",
            str(folder),
            "-o",
            str(tmp_path / "o"),
        ]
    )
    assert status == 1 and "unsupported adapter tensor" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        (
            {
                "base_model.model.q.lora_A.weight": torch.zeros(2, 8),
                "base_model.model.q.lora_embedding_B": torch.zeros(8, 2),
            },
            r"q: has factors of different layer types \(lora_A, lora_embedding_B\)",
        ),
        (
            {
                "base_model.model.q.lora_A.weight": torch.zeros(2, 8),
                "base_model.model.q.lora_B.weight": torch.zeros(8, 3),
            },
            r"q: lora_A \(2, 8\) and lora_B \(8, 3\) are not a LoRA pair",
        ),
        (
            {
                "base_model.model.q.lora_A.weight": torch.zeros(2, 3, 3, 3),
                "base_model.model.q.lora_B.weight": torch.zeros(8, 2, 3, 3),
            },
            r"q: lora_A \(2, 3, 3, 3\) and lora_B \(8, 2, 3, 3\) are not a LoRA pair",
        ),
    ],
    ids=["mixed-layouts", "ranks-differ", "conv-b-not-1x1"],
)
def test_inconsistent_factors_are_refused(tmp_path: Path, tensors, message: str) -> None:
    folder = _adapter(tmp_path / "adapter", tensors)
    with pytest.raises(
        AdapterError, match=r"adapter_model\.safetensors: inconsistent LoRA tensors:\n  " + message
    ):
        read_adapter(folder)


@pytest.mark.parametrize(
    ("case", "transposed"), [("gpt2-conv1d-bias", True), ("llama-patterns-rslora", False)]
)
def test_conv1d_models_save_fan_in_fan_out(case: str, transposed: bool) -> None:
    kind, kwargs = CASES[case]
    model = get_lora_model(make_model(kind), LoraConfig(**kwargs))
    assert adapter_config_for(model).fan_in_fan_out is transposed
