"""safetensors headers: parsed and validated without reading tensor data; rows read on demand."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from loragen.adapters.safetensors_file import read_safetensors_header
from loragen.errors import AdapterError


def test_header_reader_checks_offsets(tmp_path: Path) -> None:
    save_file({"a": torch.zeros(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}, tmp_path / "x.safetensors")
    header = read_safetensors_header(tmp_path / "x.safetensors")
    assert header.tensors["a"].shape == (2, 3) and header.tensors["b"].dtype == "BF16"
    assert header.file_size == (tmp_path / "x.safetensors").stat().st_size

    data = bytearray((tmp_path / "x.safetensors").read_bytes())
    (tmp_path / "y.safetensors").write_bytes(bytes(data) + b"junk")
    with pytest.raises(AdapterError, match=r"y\.safetensors: corrupt safetensors file: 4 trailing bytes"):
        read_safetensors_header(tmp_path / "y.safetensors")
