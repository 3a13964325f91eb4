"""safetensors files read from their header: tensor names, dtypes, shapes and byte ranges, no data.

A safetensors file is an 8-byte little-endian header length, a JSON header (``{name: {"dtype", "shape",
"data_offsets"}, "__metadata__": {...}}``) and the data section. :func:`read_safetensors_header` parses
and validates the header alone; :class:`SafetensorsReader` reads tensors, or ranges of their rows, from
disk on access. Both serve adapters (read lazily) and checkpoints (merged a block of rows at a time).
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from loragen.adapters.json_file import parse_json
from loragen.errors import AdapterError

__all__ = ["TensorEntry", "SafetensorsHeader", "SafetensorsReader", "read_safetensors_header"]

# safetensors dtype string -> (bytes per element, torch dtype name or None where torch has none)
_ST_DTYPES: dict[str, tuple[int, str | None]] = {
    "BOOL": (1, "bool"),
    "U8": (1, "uint8"),
    "I8": (1, "int8"),
    "F8_E4M3": (1, "float8_e4m3fn"),
    "F8_E5M2": (1, "float8_e5m2"),
    "I16": (2, "int16"),
    "U16": (2, "uint16"),
    "F16": (2, "float16"),
    "BF16": (2, "bfloat16"),
    "I32": (4, "int32"),
    "U32": (4, "uint32"),
    "F32": (4, "float32"),
    "I64": (8, "int64"),
    "U64": (8, "uint64"),
    "F64": (8, "float64"),
    "C64": (8, "complex64"),
}
# A header larger than this is not a real safetensors header (the format's own limit is 100 MB).
_MAX_HEADER_BYTES = 100_000_000


# ---- safetensors headers ----------------------------------------------------------------------


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file: ``start``/``end`` are absolute byte offsets in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        """The tensor's size in bytes."""
        return self.end - self.start

    @property
    def numel(self) -> int:
        """The tensor's number of elements."""
        return math.prod(self.shape)

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """The matching torch dtype, or None where this torch build has none."""
        name = _ST_DTYPES[self.dtype][1]
        return getattr(torch, name, None) if name else None


@dataclass(frozen=True)
class SafetensorsHeader:
    """The parsed header of a safetensors file (no tensor data is read).

    ``header_bytes`` is the file's first ``data_start`` bytes verbatim (length prefix + JSON), so a
    file with the same tensors can be rewritten byte for byte.
    """

    path: Path
    header_bytes: bytes
    data_start: int
    file_size: int
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str] = field(default_factory=dict)


def read_safetensors_header(path: str | os.PathLike[str]) -> SafetensorsHeader:
    """Read and validate the header of the safetensors file at ``path`` (tensor data is not read).

    Checks that the header is complete JSON, every dtype is known, every shape matches its byte range,
    and the byte ranges tile the data section exactly (as the safetensors library requires).

    Raises:
        AdapterError: the file is truncated or corrupt (a header that is not UTF-8 JSON, nests too deeply,
            or whose ``__metadata__`` is not a string-to-string object); the message names the file and
            what is wrong.
        OSError: the file cannot be opened.
    """
    path = Path(path)
    file_size = path.stat().st_size
    with open(path, "rb") as fh:
        prefix = fh.read(8)
        if len(prefix) < 8:
            raise AdapterError(f"{path}: truncated safetensors file ({file_size} bytes, no header)")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > min(_MAX_HEADER_BYTES, file_size - 8):
            raise AdapterError(
                f"{path}: truncated or corrupt safetensors file (header says {header_len} bytes, "
                f"the file has {file_size - 8} after the length prefix)"
            )
        raw = fh.read(header_len)
    header = parse_json(raw, str(path), AdapterError, bom=False, label="corrupt safetensors header")
    if not isinstance(header, dict):
        raise AdapterError(f"{path}: corrupt safetensors header (expected a JSON object)")

    data_start = 8 + header_len
    data_len = file_size - data_start
    metadata = header.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise AdapterError(
            f"{path}: corrupt safetensors header: __metadata__ must map strings to strings, got {metadata!r:.200}"
        )
    tensors: dict[str, TensorEntry] = {}
    for name, info in header.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            itemsize = _ST_DTYPES[dtype][0]
            ok = (
                all(isinstance(d, int) and d >= 0 for d in shape)
                and isinstance(begin, int)
                and isinstance(end, int)
            )
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise AdapterError(f"{path}: corrupt safetensors header entry for {name!r}: {info!r}")
        if end - begin != math.prod(shape) * itemsize or begin < 0:
            raise AdapterError(
                f"{path}: corrupt safetensors header: {name!r} has shape {list(shape)} ({dtype}) "
                f"but byte range [{begin}, {end})"
            )
        tensors[name] = TensorEntry(name, dtype, shape, data_start + begin, data_start + end)

    position = data_start
    for entry in sorted(tensors.values(), key=lambda e: (e.start, e.end)):
        if entry.start != position:
            raise AdapterError(
                f"{path}: corrupt safetensors file: byte ranges overlap or leave a gap at {entry.name!r}"
            )
        position = entry.end
    if position > file_size:
        raise AdapterError(
            f"{path}: truncated safetensors file: the tensors need {position - data_start} data bytes, "
            f"the file has {data_len}"
        )
    if position < file_size:
        raise AdapterError(
            f"{path}: corrupt safetensors file: {file_size - position} trailing bytes after the tensors"
        )
    return SafetensorsHeader(path, prefix + raw, data_start, file_size, tensors, dict(metadata))


class SafetensorsReader(Mapping[str, torch.Tensor]):
    """The tensors of a safetensors file, read from disk on access (nothing is cached or mapped).

    ``reader[name]`` reads a whole tensor; :meth:`rows` reads a range of its leading dimension, so a
    caller can stream a large tensor block by block with bounded memory.
    """

    def __init__(self, header: SafetensorsHeader) -> None:
        self.header = header

    def __getitem__(self, name: str) -> torch.Tensor:
        entry = self.header.tensors[name]
        return self.rows(name, 0, entry.shape[0] if entry.shape else 1)

    def __iter__(self) -> Iterator[str]:
        return iter(self.header.tensors)

    def __len__(self) -> int:
        return len(self.header.tensors)

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of tensor ``name`` (a 0-d tensor has one row), shape ``(stop - start, ...)``.

        Raises:
            AdapterError: the file is shorter than its header says (changed since it was read).
        """
        entry = self.header.tensors[name]
        dtype = entry.torch_dtype
        if dtype is None:
            raise AdapterError(
                f"{self.header.path}: {name!r} has dtype {entry.dtype}, which this torch cannot read"
            )
        row_shape = entry.shape[1:]
        row_bytes = math.prod(row_shape) * _ST_DTYPES[entry.dtype][0]
        buffer = bytearray((stop - start) * row_bytes)
        with open(self.header.path, "rb") as fh:
            fh.seek(entry.start + start * row_bytes)
            if fh.readinto(buffer) != len(buffer):
                raise AdapterError(f"{self.header.path}: file ended while reading {name!r} (was it changed?)")
        shape = (stop - start, *row_shape) if entry.shape else ()
        if not buffer:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(buffer, dtype=dtype).reshape(shape)
