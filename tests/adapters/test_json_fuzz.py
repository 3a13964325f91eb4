"""Fuzzing loragen's JSON reader and safetensors-header reader: every input, however hostile, either parses
as ``json.loads`` would or raises the documented ``LoraError`` naming the file, within a second for inputs up
to 1 MB: pathological strings (unterminated runs of escaped quotes, backslashes), huge numbers, deep
nesting, byte order marks, other encodings, random bytes."""

from __future__ import annotations

import json
import math
import re
import struct
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from loragen.adapters.files import MAX_DEPTH, parse_json, read_json_file, read_safetensors_header
from loragen.errors import AdapterError, LoraError

SOURCE = "input.json"
MAX_BYTES = 1_000_000
SECONDS = 1.0  # CPU time per input (a linear reader needs milliseconds; a quadratic one, minutes)

# what parse_json's errors say, after "SOURCE: " or "SOURCE:line:column: " (see loragen.adapters.files)
DOCUMENTED = re.compile(
    "|".join(
        [
            r"the file is UTF-16 \(or another wide encoding\); save it as UTF-8",
            r"not UTF-8 text \(byte \d+: .*\); save it as UTF-8",
            r"JSON nested \d+ levels deep \(at most \d+ are accepted\)",
            r"JSON nested too deeply to parse",
            r"JSON holds an integer of more than \d+ digits",
            r"invalid JSON: .*",
        ]
    )
)

# ---- inputs ------------------------------------------------------------------------------------------------

PIECES = [b'\\"', b'"', b"\\", b"[", b"]", b"{", b"}", b'{"a": ', b'"a": "', b",", b":", b"9", b"-", b"e9"]
PIECES += [b"0.", b"1e999999", b"Infinity", b"NaN", b" ", b"\n", b"\\u", b"\\ud800", b"\xc3\xa9", b"\xff"]


@st.composite
def pathological(draw: st.DrawFn) -> bytes:
    """A few pieces, each repeated up to a million bytes in all: what makes a reader backtrack or recurse."""
    runs = draw(st.lists(st.tuples(st.sampled_from(PIECES), st.integers(1, 200_000)), min_size=1, max_size=4))
    data = b"".join(piece * count for piece, count in runs)
    return data[:MAX_BYTES]


def json_values() -> st.SearchStrategy[Any]:
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.integers(min_value=-(10**4000), max_value=10**4000),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(),
    )
    return st.recursive(
        scalars,
        lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(), inner, max_size=4)),
        max_leaves=20,
    )


@st.composite
def documents(draw: st.DrawFn) -> bytes:
    """A JSON document (from a value, or a bare huge number, or deep nesting), in some encoding."""
    kind = draw(st.sampled_from(["value", "digits", "deep"]))
    if kind == "value":
        text = json.dumps(draw(json_values()), ensure_ascii=draw(st.booleans()))
    elif kind == "digits":
        text = '{"r": ' + "9" * draw(st.integers(1, 100_000)) + "}"
    else:
        depth = draw(st.integers(0, 300_000))
        opener = draw(st.sampled_from(["[", '{"a": ']))
        closer = "]" if opener == "[" else "}"
        text = opener * depth + "1" + closer * draw(st.integers(0, depth))
    encoding = draw(
        st.sampled_from(["utf-8", "utf-8", "utf-8-sig", "utf-16", "utf-16-le", "utf-32", "latin-1"])
    )
    return text.encode(encoding, errors="replace")[:MAX_BYTES]


ANY_INPUT = st.one_of(pathological(), documents(), st.binary(max_size=2_000))


# ---- the reference -----------------------------------------------------------------------------------------


def _reference(data: bytes) -> tuple[bool, Any]:
    """``(True, value)`` where ``json.loads`` reads ``data`` as UTF-8 (a leading mark allowed), else
    ``(False, None)``."""
    try:
        return True, json.loads(data.decode("utf-8-sig"))
    except (
        ValueError,
        RecursionError,
    ):  # JSONDecodeError, UnicodeDecodeError and the digit limit are ValueErrors
        return False, None


def _same(a: Any, b: Any) -> bool:
    """Equal, with NaN equal to NaN."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _depth(value: Any) -> int:
    stack, deepest = [(value, 0)], 0
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, dict)):
            depth += 1
            deepest = max(deepest, depth)
            stack.extend((child, depth) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def _timed(read, *args) -> tuple[Any, LoraError | None]:
    started = time.process_time()
    try:
        value, error = read(*args), None
    except LoraError as exc:
        value, error = None, exc
    spent = time.process_time() - started
    assert spent < SECONDS, f"{spent:.2f} s of CPU time"
    return value, error


# ---- the JSON reader ---------------------------------------------------------------------------------------

FUZZ = settings(  # as many examples as the test profile asks (tests/conftest.py)
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)


@FUZZ
@given(data=ANY_INPUT)
def test_json_reader_parses_as_json_loads_or_raises_the_documented_error(data: bytes) -> None:
    value, error = _timed(parse_json, data, SOURCE, AdapterError)
    ok, expected = _reference(data)
    if error is None:
        assert ok, "parse_json accepted what json.loads refuses"
        assert _same(value, expected)
        assert _depth(value) <= MAX_DEPTH
        return
    assert isinstance(error, AdapterError)
    message = str(error)
    assert message.startswith(SOURCE + ":")
    assert DOCUMENTED.search(message), message
    if ok:  # json.loads reads it: refused only for the documented limits
        assert "nested" in message or "UTF-16" in message, message


@FUZZ
@given(data=ANY_INPUT)
def test_json_file_reader_names_the_file(tmp_path_factory: pytest.TempPathFactory, data: bytes) -> None:
    path = tmp_path_factory.mktemp("json") / "adapter_config.json"
    path.write_bytes(data)
    _, error = _timed(read_json_file, path, AdapterError)
    if error is not None:
        assert str(error).startswith(str(path) + ":")


@pytest.mark.parametrize(
    "data",
    [
        b'{"a": "' + b'\\"' * 400_000,  # the unterminated run of escaped quotes
        b'"' + b"\\" * (MAX_BYTES - 1),
        b"[" * MAX_BYTES,
        b'{"a": ' * (MAX_BYTES // 6),
        b'"' * MAX_BYTES,
        b'{"r": ' + b"9" * (MAX_BYTES - 7) + b"}",
        b"\xef\xbb\xbf" + b'{"a": "\\"' * 100_000,
    ],
    ids=["escaped-quotes", "backslashes", "brackets", "objects", "quotes", "digits", "bom-escapes"],
)
def test_the_worst_megabytes_are_read_within_the_bound(data: bytes) -> None:
    _, error = _timed(parse_json, data, SOURCE, AdapterError)
    assert error is not None and DOCUMENTED.search(str(error))


# ---- the safetensors-header reader -------------------------------------------------------------------------


def _safetensors_file(folder: Path, header: bytes, data: bytes = b"") -> Path:
    path = folder / "adapter_model.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


@FUZZ
@given(header=ANY_INPUT, data=st.binary(max_size=64))
def test_header_reader_reads_or_raises_an_adapter_error_naming_the_file(
    tmp_path_factory: pytest.TempPathFactory, header: bytes, data: bytes
) -> None:
    path = _safetensors_file(tmp_path_factory.mktemp("st"), header, data)
    parsed, error = _timed(read_safetensors_header, path)
    if error is None:
        assert parsed.data_start == 8 + len(header)
        return
    assert isinstance(error, AdapterError)
    assert str(error).startswith(f"{path}: ")


tensors = st.dictionaries(
    st.text(min_size=1, max_size=20).filter(lambda name: name != "__metadata__"),
    st.tuples(
        st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8, torch.bool]),
        st.lists(st.integers(0, 4), max_size=3),
    ),
    max_size=5,
)


@FUZZ
@given(specs=tensors, metadata=st.dictionaries(st.text(max_size=10), st.text(max_size=30), max_size=3))
def test_header_reader_reads_every_file_safetensors_writes(
    tmp_path_factory: pytest.TempPathFactory, specs: dict, metadata: dict[str, str]
) -> None:
    made = {name: torch.zeros(shape, dtype=dtype) for name, (dtype, shape) in specs.items()}
    path = tmp_path_factory.mktemp("st") / "adapter_model.safetensors"
    save_file(made, path, metadata=metadata or None)
    header, error = _timed(read_safetensors_header, path)
    assert error is None, error
    assert header.metadata == metadata
    assert {name: (entry.torch_dtype, entry.shape) for name, entry in header.tensors.items()} == {
        name: (tensor.dtype, tuple(tensor.shape)) for name, tensor in made.items()
    }


@pytest.mark.parametrize(
    "header",
    [
        b'{"a": "' + b'\\"' * 400_000,
        b"[" * MAX_BYTES,
        b'{"a": {"dtype": "F32", "shape": [' + b"9" * 5_000 + b'], "data_offsets": [0, 4]}}',
        b'{"a": {"dtype": "F32", "shape": [1e999], "data_offsets": [0, 4]}}',
        b"\xef\xbb\xbf{}",  # a header may not start with a byte order mark
        '{"__metadata__": {}}'.encode("utf-16"),
    ],
    ids=["escaped-quotes", "brackets", "digits", "float-shape", "bom", "utf16"],
)
def test_hostile_headers_are_refused_within_the_bound(tmp_path: Path, header: bytes) -> None:
    path = _safetensors_file(tmp_path, header, b"\0" * 4)
    _, error = _timed(read_safetensors_header, path)
    assert isinstance(error, AdapterError)
    assert str(error).startswith(f"{path}: corrupt safetensors header")
