"""safetensors headers: parsed and validated without reading tensor data; rows read on demand."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from loragen.adapters.files import SafetensorsReader, read_safetensors_header
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_reader_reads_tensors_and_row_ranges_from_disk(tmp_path: Path, dtype: torch.dtype) -> None:
    tensors = {
        "w": torch.arange(30).reshape(5, 3, 2).to(dtype),
        "scalar": torch.tensor(7).to(dtype),
        "empty": torch.zeros(0, 4, dtype=dtype),
    }
    save_file(tensors, tmp_path / "x.safetensors")
    reader = SafetensorsReader(read_safetensors_header(tmp_path / "x.safetensors"))

    assert sorted(reader) == ["empty", "scalar", "w"] and len(reader) == 3
    for name, value in tensors.items():
        assert reader[name].dtype == dtype and torch.equal(reader[name], value), name
    assert torch.equal(reader.rows("w", 1, 4), tensors["w"][1:4])
    assert reader.rows("w", 2, 2).shape == (0, 3, 2)

    cut = reader.header.tensors["w"].start + 4  # the file now ends inside "w"
    (tmp_path / "x.safetensors").write_bytes((tmp_path / "x.safetensors").read_bytes()[:cut])
    with pytest.raises(AdapterError, match=r"x\.safetensors: file ended while reading 'w'"):
        reader.rows("w", 0, 5)


def test_a_reader_keeps_reading_the_file_its_header_came_from(tmp_path: Path) -> None:
    """A save replaces the weights by a rename: a lazy reader made before it still reads the old tensors."""
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.zeros(3, 2)}, str(path))
    reader = SafetensorsReader(read_safetensors_header(path))
    replacement = tmp_path / "new.safetensors"
    save_file({"a": torch.ones(3, 2)}, str(replacement))
    replacement.replace(path)
    assert torch.equal(reader["a"], torch.zeros(3, 2))
    assert torch.equal(reader.rows("a", 1, 3), torch.zeros(2, 2))


def test_a_reader_refuses_a_file_replaced_after_its_header_was_read(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.zeros(3, 2)}, str(path))
    header = read_safetensors_header(path)
    replacement = tmp_path / "new.safetensors"
    save_file({"a": torch.ones(3, 2)}, str(replacement))
    replacement.replace(path)
    with pytest.raises(AdapterError, match="changed after its header was read"):
        SafetensorsReader(header)
