"""The files loragen reads, read defensively: JSON (adapter configs, shard indexes, safetensors headers) and
safetensors files, parsed and validated from their header with tensor data read lazily.

Every failure is a :class:`~loragen.errors.LoraError` naming the file: bytes that are not UTF-8, invalid JSON
(``file:line:column``), nesting deeper than :data:`MAX_DEPTH` (checked in linear time before parsing), an
integer longer than Python converts, a header that does not describe the file's data.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import sys
import threading
import weakref
from array import array
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loragen.errors import AdapterError, LoraError

if TYPE_CHECKING:  # torch is imported where tensors are read: reading JSON (``loragen rewrite``) needs none
    import torch

__all__ = [
    "MAX_DEPTH",
    "SafetensorsHeader",
    "SafetensorsReader",
    "TensorEntry",
    "parse_json",
    "read_json_file",
    "read_safetensors_header",
]

# Real configs, indexes and headers nest a few levels; anything this deep is not one of them.
MAX_DEPTH = 64
# A string, or an unterminated one to the end of the data: one way to match each byte, so the scan is linear
# (an unterminated run of escaped quotes, ``"\"\"\"...``, must not be retried from every quote).
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"?', re.DOTALL)
_NOT_BRACKET = re.compile(rb"[^\[\]{}]")
_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # an opening bracket is +1, a closing one -1 (int8)


def _depth(data: bytes) -> int:
    """The deepest nesting of arrays and objects in ``data`` (brackets inside strings do not count)."""
    brackets = _NOT_BRACKET.sub(b"", _STRING.sub(b"", data))
    return max(accumulate(array("b", brackets.translate(_STEPS))), default=0)


def parse_json(data: bytes, source: str, error: type[LoraError], *, bom: bool = True, label: str = "") -> Any:
    """Parse the JSON document ``data`` read from ``source`` (a file name, for messages); ``bom``: accept a
    UTF-8 byte order mark; ``label``: what the document is, for messages (``source: label: ...``).

    Raises:
        error: the bytes are not UTF-8, nest deeper than :data:`MAX_DEPTH`, or are not valid JSON; the
            message starts with ``source`` (and the line and column for a syntax error).
    """
    head = f"{source}: {label}: " if label else f"{source}: "
    if data[:2] in (b"\xff\xfe", b"\xfe\xff") or (len(data) > 1 and (data[0] == 0 or data[1] == 0)):
        raise error(f"{head}the file is UTF-16 (or another wide encoding); save it as UTF-8")
    try:
        text = data.decode("utf-8-sig" if bom else "utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{head}not UTF-8 text (byte {exc.start}: {exc.reason}); save it as UTF-8") from None
    depth = _depth(data)
    if depth > MAX_DEPTH:
        raise error(f"{head}JSON nested {depth} levels deep (at most {MAX_DEPTH} are accepted)")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        if label:
            raise error(f"{head}invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
        raise error(f"{source}:{exc.lineno}:{exc.colno}: invalid JSON: {exc.msg}") from None
    except ValueError:  # Python's limit on the digits of an integer it converts from text
        raise error(
            f"{head}JSON holds an integer of more than {sys.get_int_max_str_digits()} digits "
            "(no config, index or header needs one)"
        ) from None
    except RecursionError:  # the depth check makes this unreachable in practice; never a traceback
        raise error(f"{head}JSON nested too deeply to parse") from None


def read_json_file(path: str | os.PathLike[str], error: type[LoraError]) -> Any:
    """Read and parse the JSON file at ``path`` (see :func:`parse_json`).

    Raises:
        error: the file cannot be read, or :func:`parse_json` refuses it.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise error(f"{path}: cannot be read ({exc.strerror or exc})") from None
    return parse_json(data, str(path), error)


# safetensors dtype string -> (bytes per element, torch dtype name; a torch build may lack it)
_ST_DTYPES: dict[str, tuple[int, str]] = {
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
    def torch_dtype(self) -> torch.dtype | None:
        """The matching torch dtype, or None where this torch build has none."""
        import torch

        return getattr(torch, _ST_DTYPES[self.dtype][1], None)


@dataclass(frozen=True)
class SafetensorsHeader:
    """The parsed header of a safetensors file; ``header_bytes``: its first ``data_start`` bytes verbatim."""

    path: Path
    header_bytes: bytes
    data_start: int
    file_size: int
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str] = field(default_factory=dict)
    identity: tuple[int, int, int] = (0, 0, 0)  # (device, inode, mtime_ns) of the file the header came from


def read_safetensors_header(path: str | os.PathLike[str]) -> SafetensorsHeader:
    """Read and validate the header of the safetensors file at ``path``: every dtype known, every shape
    matching its byte range, the byte ranges tiling the data section exactly.

    Raises:
        AdapterError: the file is truncated or corrupt; the message names the file and what is wrong.
        OSError: the file cannot be opened.
    """
    path = Path(path)
    with open(path, "rb") as fh:
        stat = os.fstat(fh.fileno())
        file_size = stat.st_size
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
    metadata = header.pop("__metadata__", None)  # optional
    if metadata is not None and (
        not isinstance(metadata, dict)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    ):
        raise AdapterError(
            f"{path}: corrupt safetensors header: __metadata__ must map strings to strings, got {metadata!r:.200}"
        )
    tensors: dict[str, TensorEntry] = {}
    for name, info in header.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            itemsize = _ST_DTYPES[dtype][0]
            ok = all(isinstance(x, int) for x in (*shape, begin, end)) and all(d >= 0 for d in shape)
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
            f"the file has {file_size - data_start}"
        )
    if position < file_size:
        raise AdapterError(
            f"{path}: corrupt safetensors file: {file_size - position} trailing bytes after the tensors"
        )
    identity = (stat.st_dev, stat.st_ino, stat.st_mtime_ns)
    return SafetensorsHeader(
        path, prefix + raw, data_start, file_size, tensors, dict(metadata or {}), identity
    )


class SafetensorsReader(Mapping[str, "torch.Tensor"]):
    """The tensors of a safetensors file, read from disk on access (nothing is cached or mapped);
    :meth:`rows` reads a range of a tensor's leading dimension, to stream it with bounded memory.

    The file is opened once, when the reader is made, and must be the file its header was read from: a
    save that replaces the path later (by a rename) does not change what the reader reads, so the tensors
    always belong to the header and the config read with it.

    Raises:
        AdapterError: the file at the path is no longer the one the header was read from.
        OSError: the file cannot be opened.
    """

    def __init__(self, header: SafetensorsHeader) -> None:
        self.header = header
        self._file = open(header.path, "rb", buffering=0)  # kept open for the reader's life
        stat = os.fstat(self._file.fileno())
        if (
            stat.st_dev,
            stat.st_ino,
            stat.st_mtime_ns,
        ) != header.identity or stat.st_size != header.file_size:
            self._file.close()
            raise AdapterError(f"{header.path}: the file changed after its header was read; read it again")
        self._lock = threading.Lock()
        weakref.finalize(self, self._file.close)

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
        import torch

        entry = self.header.tensors[name]
        dtype = entry.torch_dtype
        if dtype is None:
            raise AdapterError(
                f"{self.header.path}: {name!r} has dtype {entry.dtype}, which this torch cannot read"
            )
        row_shape = entry.shape[1:]
        row_bytes = math.prod(row_shape) * _ST_DTYPES[entry.dtype][0]
        buffer = bytearray((stop - start) * row_bytes)
        with self._lock:  # threads may read one reader at once
            self._file.seek(entry.start + start * row_bytes)
            view = memoryview(buffer)
            while view:  # unbuffered: every read sees the file as it is now
                count = self._file.readinto(view)
                if not count:
                    raise AdapterError(
                        f"{self.header.path}: file ended while reading {name!r} (was it changed?)"
                    )
                view = view[count:]
        shape = (stop - start, *row_shape) if entry.shape else ()
        if not buffer:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(buffer, dtype=dtype).reshape(shape)
