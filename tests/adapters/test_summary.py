"""``loragen inspect``: what an adapter holds, as a table and as JSON."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from loragen.adapters.folder import format_summary, inspect_adapter
from loragen.errors import AdapterError
from tests.adapters.helpers import CASES, loragen_adapter, peft_adapter


def main(argv: list[str]) -> int:
    """``loragen ARGV`` through the real entry point."""
    from loragen import cli

    return cli.main(argv)


def test_json_report_for_peft_adapter_with_patterns(tmp_path: Path, capsys) -> None:
    kind, kwargs = CASES["llama-patterns-rslora"]
    peft_adapter(kind, kwargs, tmp_path)

    assert main(["inspect", str(tmp_path), "--json"]) == 0

    report = json.loads(capsys.readouterr().out)
    modules = {m["module"]: m for m in report["modules"]}
    assert sorted(modules) == [
        f"model.layers.{i}.self_attn.{p}" for i in (0, 1) for p in ("q_proj", "v_proj")
    ]
    q0, q1, v1 = (
        modules[f"model.layers.{n}"]
        for n in ("0.self_attn.q_proj", "1.self_attn.q_proj", "1.self_attn.v_proj")
    )
    assert (q0["r"], q0["alpha"], q0["scale"]) == (
        2,
        8,
        pytest.approx(8 / math.sqrt(2)),
    )  # rank_pattern, rsLoRA
    assert (q1["r"], q1["alpha"], q1["scale"]) == (4, 8, pytest.approx(4.0))
    assert (v1["r"], v1["alpha"], v1["scale"]) == (4, 3, pytest.approx(1.5))  # alpha_pattern
    assert (v1["in_features"], v1["out_features"], v1["kind"], v1["dtype"]) == (32, 16, "linear", "float32")
    tensors = load_file(tmp_path / "adapter_model.safetensors")
    assert report["totals"]["params"] == sum(t.numel() for t in tensors.values())
    assert report["file_size"] == (tmp_path / "adapter_model.safetensors").stat().st_size
    assert report["config"]["use_rslora"] is True


def test_table_shows_every_module_and_full_tensors(tmp_path: Path, capsys) -> None:
    kind, kwargs = CASES["llama-embedding-modules-to-save"]
    loragen_adapter(kind, kwargs, tmp_path)

    assert main(["inspect", str(tmp_path)]) == 0

    table = capsys.readouterr().out
    header = next(line for line in table.splitlines() if line.startswith("module"))
    assert header.split() == ["module", "type", "r", "alpha", "scale", "in->out", "params", "dtype"]
    assert re.search(
        r"^model\.embed_tokens\s+embedding\s+4\s+8\s+2\s+100->32\s+528\s+float32$", table, re.MULTILINE
    )
    assert "base_model.model.lm_head.weight" in table  # a module to save
    assert "3 LoRA modules, 1,040 LoRA parameters + 6,400 saved in full; dtype float32" in table


def test_kinds_and_dtypes(tmp_path: Path) -> None:
    kind, kwargs = CASES["convnet"]
    peft_adapter(kind, kwargs, tmp_path)

    summary = inspect_adapter(tmp_path)

    assert {m.module: m.kind for m in summary.modules} == {
        "emb": "embedding",
        "conv1": "conv1d",
        "conv2": "conv2d",
        "head": "linear",
    }
    assert {m.module: (m.in_features, m.out_features) for m in summary.modules}["conv2"] == (27, 6)
    assert summary.dtypes == ("float32",)
    assert re.search(
        r"^conv2\s+conv2d\s+2\s+4\s+2\s+27->6\s+66\s+float32$", format_summary(summary), re.MULTILINE
    )


def test_errors(tmp_path: Path, capsys) -> None:
    assert main(["inspect", str(tmp_path / "missing")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("loragen inspect: error:") and "missing does not exist" in err

    peft_adapter("gpt2", CASES["gpt2-conv1d-bias"][1], tmp_path / "pickled")
    tensors = load_file(tmp_path / "pickled" / "adapter_model.safetensors")
    torch.save(tensors, tmp_path / "pickled" / "adapter_model.bin")
    (tmp_path / "pickled" / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterError, match="refusing to load a pickle"):
        inspect_adapter(tmp_path / "pickled")
    summary = inspect_adapter(tmp_path / "pickled", allow_pickle=True)
    assert len(summary.modules) == 8 and summary.weights_file.endswith("adapter_model.bin")
