"""Hostile or broken inputs get a ``LoraError`` naming the file and what is wrong, never a traceback and
never partial output: safetensors headers, shard indexes and adapter configs (bad metadata, deep nesting,
wrong encodings, wrong types, paths out of the folder), non-float or non-finite adapter tensors, and a
``fan_in_fan_out`` flag that ``load_adapter`` would ignore. What ``load_adapter`` refuses (non-finite alphas, a
layout the layer does not have, no tensors, a config its weights contradict), the merge refuses too."""

from __future__ import annotations

import json
import re
import struct
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from loragen import AdapterError, LoraConfigError, LoraError, load_adapter, merge_and_unload, save_adapter
from loragen.adapters.offline_merge import merge_checkpoint
from loragen.cli import main
from tests.adapters.helpers import (
    TinyNet,
    loragen_adapter,
    make_model,
    save_checkpoint,
    tiny_lora,
    tree_snapshot,
)

DEEP = 100_000  # far past Python's recursion limit
# ``{"a": "\"\"\"...`` unterminated: a reader that retries a string from every quote takes minutes on it
ESCAPED_QUOTES = 100_000


def _write_raw(path: Path, header: bytes, data: bytes = b"") -> None:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path]:
    """A sharded checkpoint of TinyNet (``base/``, two shards and an index) and an adapter (``adapter/``)."""
    base = tmp_path / "base"
    base.mkdir()
    state = {k: v.contiguous() for k, v in TinyNet().state_dict().items()}
    shards = {"model-1.safetensors": ["q.weight", "q.bias"], "model-2.safetensors": ["v.weight", "v.bias"]}
    weight_map = {}
    for shard, names in shards.items():
        save_file({n: state[n] for n in names}, base / shard)
        weight_map.update(dict.fromkeys(names, shard))
    (base / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    save_adapter(tiny_lora(), tmp_path / "adapter")
    return base, tmp_path / "adapter"


def _merge_fails(base: Path, adapter: Path, out: Path, capsys, match: str, *flags: str) -> None:
    """``loragen merge`` exits 1 with ``match`` on stderr, no traceback, and writes nothing."""
    before = tree_snapshot(out.parent)
    assert main(["merge", "--base", str(base), "--adapter", str(adapter), "-o", str(out), *flags]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert match in err, err
    assert tree_snapshot(out.parent) == before


# ---- safetensors headers ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "match"),
    [
        (b'{"__metadata__": ["format", "pt"]}', "__metadata__ must map strings to strings"),
        (b'{"__metadata__": {"format": 1}}', "__metadata__ must map strings to strings"),
        (b"[" * DEEP + b"]" * DEEP, "JSON nested 100000 levels deep"),
        ('{"__metadata__": {"a": "é"}}'.encode("utf-16"), "the file is UTF-16"),
        (b'{"__metadata__": {"a": "\xff"}}', "not UTF-8"),
        (b'{"a": ' + b"9" * 5000 + b"}", "JSON holds an integer of more than 4300 digits"),
        (b'{"a": "' + b'\\"' * ESCAPED_QUOTES, "invalid JSON at line 1, column 7: Unterminated string"),
    ],
    ids=["metadata-list", "metadata-int", "deep", "utf16", "latin1", "huge-int", "escaped-quotes"],
)
def test_bad_adapter_headers_are_named_by_load_inspect_and_merge(
    files, tmp_path, capsys, header, match
) -> None:
    base, adapter = files
    _write_raw(adapter / "adapter_model.safetensors", header)
    with pytest.raises(AdapterError, match="adapter_model.safetensors: corrupt safetensors header: " + match):
        load_adapter(TinyNet(), adapter)
    assert main(["inspect", str(adapter)]) == 1
    assert match in capsys.readouterr().err
    _merge_fails(base, adapter, tmp_path / "out", capsys, match)


def test_bad_checkpoint_header_is_named(files, tmp_path, capsys) -> None:
    base, adapter = files
    _write_raw(base / "model-2.safetensors", b'{"__metadata__": ["x"]}')
    _merge_fails(base, adapter, tmp_path / "out", capsys, "model-2.safetensors: corrupt safetensors header")


# ---- adapter_config.json ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"[" * DEEP + b"]" * DEEP, "JSON nested 100000 levels deep"),
        ('{"peft_type": "LORA"}'.encode("utf-16"), "the file is UTF-16"),
        (b"[1, 2]", "expected a JSON object of peft's fields, got a list"),
        (b'{"r": ' + b"9" * 5000 + b"}", "JSON holds an integer of more than 4300 digits"),
    ],
    ids=["deep", "utf16", "list", "huge-int"],
)
def test_bad_adapter_configs_are_named(files, tmp_path, capsys, content, match) -> None:
    base, adapter = files
    (adapter / "adapter_config.json").write_bytes(content)
    with pytest.raises(AdapterError, match="adapter_config.json: " + match):
        load_adapter(TinyNet(), adapter)
    _merge_fails(base, adapter, tmp_path / "out", capsys, match)


def test_escaped_quotes_are_refused_at_once_by_every_reader(files, tmp_path, capsys) -> None:
    _, adapter = files
    (adapter / "adapter_config.json").write_bytes(b'{"a": "' + b'\\"' * ESCAPED_QUOTES)
    started = time.perf_counter()
    with pytest.raises(AdapterError, match=r"adapter_config\.json:1:7: invalid JSON: Unterminated string"):
        load_adapter(TinyNet(), adapter)
    assert main(["inspect", str(adapter)]) == 1
    assert "Unterminated string" in capsys.readouterr().err
    assert time.perf_counter() - started < 10  # linear: milliseconds; quadratic: minutes


@pytest.mark.parametrize(
    ("field", "value", "shown"),
    [
        ("r", 10**30, "r=1000000000000000000000000000000"),
        ("r", 2**40, "r=1099511627776"),
        ("r", 10**4000, "r=an integer of 4001 digits"),
        ("rank_pattern", {"q": 2**62}, "rank_pattern['q']=4611686018427387904"),
    ],
    ids=["r-1e30", "r-2^40", "r-4001-digits", "rank-pattern"],
)
def test_a_rank_no_layer_can_have_is_refused_naming_file_and_field(
    files, tmp_path, capsys, field, value, shown
):
    base, adapter = files
    config = adapter / "adapter_config.json"
    data = json.loads(config.read_text())
    data[field] = value
    config.write_text(json.dumps(data))
    with pytest.raises(
        LoraConfigError, match=re.escape(f"adapter_config.json: {shown} is not a usable LoRA rank")
    ):
        load_adapter(TinyNet(), adapter)
    _merge_fails(base, adapter, tmp_path / "out", capsys, f"{shown} is not a usable LoRA rank")


def test_a_utf8_bom_in_adapter_config_is_accepted(files) -> None:
    _, adapter = files
    config = adapter / "adapter_config.json"
    config.write_bytes(b"\xef\xbb\xbf" + config.read_bytes())
    load_adapter(TinyNet(), adapter)


# ---- shard indexes ---------------------------------------------------------------------------------


def _edit_index(base: Path, **changes: object) -> None:
    index = base / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"].update(changes)
    index.write_text(json.dumps(data))


@pytest.mark.parametrize(
    "shard",
    ["../outside.safetensors", "/abs/model-2.safetensors", "a/model-2.safetensors", 7, "..", "model-2.bin"],
    ids=["parent", "absolute", "subfolder", "int", "dotdot", "not-safetensors"],
)
def test_index_entries_must_be_plain_shard_names(files, tmp_path, capsys, shard) -> None:
    base, adapter = files
    # a real shard where the entry points, so only the name's form is wrong
    (tmp_path / "outside.safetensors").write_bytes((base / "model-2.safetensors").read_bytes())
    _edit_index(base, **{"v.weight": shard})
    _merge_fails(base, adapter, tmp_path / "out", capsys, "weight_map values must be shard file names")


def test_index_that_is_too_deep_or_not_an_object_is_named(files, tmp_path, capsys) -> None:
    base, adapter = files
    index = base / "model.safetensors.index.json"
    index.write_bytes(b'{"weight_map": ' + b"[" * DEEP + b"]" * DEEP + b"}")
    _merge_fails(base, adapter, tmp_path / "out", capsys, "index.json: JSON nested")
    index.write_text('{"weight_map": ["model-1.safetensors"]}')
    _merge_fails(base, adapter, tmp_path / "out", capsys, "not a safetensors index")


# ---- adapter values --------------------------------------------------------------------------------


def _edit_adapter_tensor(adapter: Path, key: str, value: torch.Tensor) -> None:
    path = adapter / "adapter_model.safetensors"
    tensors = load_file(path)
    tensors[key] = value
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_adapter_values_are_refused_unless_allowed(files, tmp_path, capsys, bad: float) -> None:
    base, adapter = files
    key = "base_model.model.v.lora_B.weight"
    value = load_file(adapter / "adapter_model.safetensors")[key]
    value[1, 0] = bad
    _edit_adapter_tensor(adapter, key, value)
    _merge_fails(base, adapter, tmp_path / "out", capsys, f"{key} (1 NaN/inf values)")
    flags = ["-o", str(tmp_path / "out"), "-q", "--allow-nonfinite"]
    assert main(["merge", "--base", str(base), "--adapter", str(adapter), *flags]) == 0


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.complex64])
def test_non_float_adapter_tensors_are_refused_with_their_key(files, tmp_path, capsys, dtype) -> None:
    base, adapter = files
    key = "base_model.model.q.lora_A.weight"
    value = load_file(adapter / "adapter_model.safetensors")[key]
    _edit_adapter_tensor(adapter, key, value.to(dtype))
    _merge_fails(base, adapter, tmp_path / "out", capsys, f"{key}: dtype")


# ---- fan_in_fan_out --------------------------------------------------------------------------------


def _set_fan_in_fan_out(adapter: Path) -> None:
    config = adapter / "adapter_config.json"
    data = json.loads(config.read_text())
    data["fan_in_fan_out"] = True
    config.write_text(json.dumps(data))


def test_fan_in_fan_out_on_a_linear_adapter_merges_as_load_adapter_does(files, tmp_path) -> None:
    base, adapter = files
    _set_fan_in_fan_out(adapter)
    (base / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    merge_checkpoint(base, adapter, tmp_path / "out")

    model = TinyNet()
    model.load_state_dict(
        {**load_file(base / "model-1.safetensors"), **load_file(base / "model-2.safetensors")}
    )
    expected = merge_and_unload(load_adapter(model, adapter)).state_dict()
    merged = {
        **load_file(tmp_path / "out" / "model-1.safetensors"),
        **load_file(tmp_path / "out" / "model-2.safetensors"),
    }
    for key, value in expected.items():
        torch.testing.assert_close(merged[key], value, msg=key)


def test_fan_in_fan_out_on_a_square_weight_of_unknown_type_is_refused(files, tmp_path, capsys) -> None:
    base, adapter = files
    _set_fan_in_fan_out(adapter)
    _merge_fails(base, adapter, tmp_path / "out", capsys, "a square weight [4, 4] with fan_in_fan_out=true")
    with pytest.raises(LoraError, match=r"shows whether (q|v) is an nn\.Linear") as caught:
        merge_checkpoint(base, adapter, tmp_path / "out")
    assert "{" not in str(caught.value)


def test_every_refusal_is_a_lora_error(files, tmp_path) -> None:
    base, adapter = files
    _set_fan_in_fan_out(adapter)
    with pytest.raises(LoraError):
        merge_checkpoint(base, adapter, tmp_path / "out")


# ---- what load_adapter refuses, the merge refuses ------------------------------------------------------


def _edit_config(adapter: Path, **changes: object) -> None:
    config = adapter / "adapter_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), **changes}))


@pytest.mark.parametrize(
    "value", ["Infinity", "-Infinity", "NaN", "1" + "0" * 400], ids=["inf", "-inf", "nan", "401-digits"]
)
def test_a_non_finite_alpha_pattern_value_is_refused_by_merge_as_by_load(
    files, tmp_path, capsys, value
) -> None:
    base, adapter = files
    _edit_config(adapter, alpha_pattern={"q": "VALUE"})
    config = adapter / "adapter_config.json"
    config.write_text(config.read_text().replace('"VALUE"', value))
    shown = "an integer of 401 digits" if value.startswith("1") else repr(float(value))
    match = f"alpha_pattern['q']={shown}: expected a finite number"
    with pytest.raises(LoraConfigError, match=re.escape(match)):
        load_adapter(TinyNet(), adapter)
    _merge_fails(base, adapter, tmp_path / "out", capsys, match)
    _merge_fails(base, adapter, tmp_path / "out", capsys, match, "--allow-nonfinite")


class _ValueProjection(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.v_proj = nn.Linear(16, 24)  # weight (24, 16)


def test_an_adapter_with_swapped_factors_is_refused_by_merge_as_by_load(tmp_path, capsys) -> None:
    """The factors of an nn.Linear(16, 24) swapped: they fit its (24, 16) weight only as a Conv1D's (in, out)."""
    base = tmp_path / "base"
    base.mkdir()
    save_file(
        {k: v.contiguous() for k, v in _ValueProjection().state_dict().items()}, base / "model.safetensors"
    )
    (base / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    factors = {"lora_A": torch.randn(4, 24), "lora_B": torch.randn(16, 4)}  # B @ A is (16, 24): (in, out)
    save_file(
        {f"base_model.model.v_proj.{k}.weight": v for k, v in factors.items()},
        adapter / "adapter_model.safetensors",
    )
    config = {
        "peft_type": "LORA",
        "r": 4,
        "lora_alpha": 8,
        "target_modules": ["v_proj"],
        "fan_in_fan_out": False,
    }
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(AdapterError, match="shape mismatch"):
        load_adapter(_ValueProjection(), adapter)
    _merge_fails(
        base,
        adapter,
        tmp_path / "out",
        capsys,
        "v_proj.weight: the checkpoint tensor has shape [24, 16], which the adapter's v_proj (lora_A (4, 24), "
        "lora_B (16, 4)) fits only as a transformers Conv1D weight",
    )


def test_an_adapter_without_tensors_is_refused_by_merge_as_by_load(files, tmp_path, capsys) -> None:
    base, adapter = files
    save_file({}, adapter / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match="missing keys"):
        load_adapter(TinyNet(), adapter)
    _merge_fails(base, adapter, tmp_path / "out", capsys, "the adapter holds no tensors")


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        (
            {"layers_to_transform": [99]},
            "which target_modules=['q_proj', 'v_proj'], layers_to_transform=[99] does",
        ),
        ({"target_modules": ["k_proj"]}, "which target_modules=['k_proj'] does not select (unexpected keys)"),
        (
            {"target_modules": ["q_proj", "v_proj", "o_proj"]},
            "model.layers.0.self_attn.o_proj: target_modules=['q_proj', 'v_proj', 'o_proj'] selects it",
        ),
        ({"exclude_modules": ["v_proj"]}, "exclude_modules=['v_proj'] does not select"),
        (
            {"target_modules": "all-linear", "exclude_modules": ["v_proj"]},
            "which target_modules='all-linear', exclude_modules=['v_proj'] does not select",
        ),
        (
            {"target_modules": None, "layers_to_transform": [99]},
            "which layers_to_transform=[99] does not select",
        ),
    ],
    ids=[
        "layers-to-transform",
        "other-targets",
        "more-targets",
        "excluded",
        "all-linear-layers",
        "default-layers",
    ],
)
def test_an_adapter_whose_config_contradicts_its_weights_is_refused_by_merge_as_by_load(
    tmp_path, capsys, changes, match
) -> None:
    base = save_checkpoint(make_model("llama"), tmp_path / "base", sharded=True)
    adapter = tmp_path / "adapter"
    loragen_adapter("llama", {"r": 4, "target_modules": ["q_proj", "v_proj"]}, adapter)
    assert (
        main(["merge", "--base", str(base), "--adapter", str(adapter), "-o", str(tmp_path / "ok"), "-q"]) == 0
    )
    _edit_config(adapter, **changes)
    with pytest.raises(LoraError):
        load_adapter(make_model("llama"), adapter)
    _merge_fails(base, adapter, tmp_path / "out", capsys, match)


# ---- loragen rewrite --config: the same reader -----------------------------------------------------

_MODEL_SOURCE = (
    "from torch import nn\n\nclass A(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
    "        self.q = nn.Linear(2, 2)\n        self.v = nn.Linear(2, 2)\n"
)


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"[" * DEEP + b"]" * DEEP, "adapter_config.json: JSON nested 100000 levels deep"),
        (
            b'{"r": ' + b"9" * 5000 + b"}",
            "adapter_config.json: JSON holds an integer of more than 4300 digits",
        ),
        (b'{"a": "' + b'\\"' * ESCAPED_QUOTES, "adapter_config.json:1:7: invalid JSON: Unterminated string"),
        ('{"r": 4}'.encode("utf-16"), "adapter_config.json: the file is UTF-16"),
    ],
    ids=["deep", "huge-int", "escaped-quotes", "utf16"],
)
def test_rewrite_config_is_read_like_an_adapter_config(tmp_path, capsys, content, match) -> None:
    source = tmp_path / "model.py"
    source.write_text(_MODEL_SOURCE)
    (tmp_path / "adapter_config.json").write_bytes(content)
    assert (
        main(["rewrite", str(source), "--config", str(tmp_path / "adapter_config.json")]) == 1
    )  # an input error (docs/cli.md)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert match in err, err


def test_rewrite_config_accepts_a_utf8_bom_as_load_adapter_does(files, tmp_path, capsys) -> None:
    _, adapter = files
    config = adapter / "adapter_config.json"
    config.write_bytes(b"\xef\xbb\xbf" + config.read_bytes())
    source = tmp_path / "model.py"
    source.write_text(_MODEL_SOURCE)
    assert main(["rewrite", str(source), "--config", str(adapter), "-q"]) == 0
    assert "self.q = LoraLinear(2, 2, r=2, lora_alpha=4" in capsys.readouterr().out
