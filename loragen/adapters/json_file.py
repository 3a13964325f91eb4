"""Reading the JSON loragen is given (adapter configs, shard indexes, safetensors headers) defensively.

Every failure is a :class:`~loragen.errors.LoraError` naming the file: bytes that are not UTF-8 (a UTF-8
byte order mark is accepted in files, as editors write one; UTF-16 is named as such), invalid JSON
(``file:line:column``), and nesting deeper than :data:`MAX_DEPTH` (checked before parsing: Python's
parser recurses once per level and would raise ``RecursionError`` on a hostile file).
"""

from __future__ import annotations

import json
import os
import re
from itertools import accumulate
from pathlib import Path
from typing import Any

from loragen.errors import LoraError

__all__ = ["MAX_DEPTH", "parse_json", "read_json_file"]

# Real configs, indexes and headers nest a few levels; anything this deep is not one of them.
MAX_DEPTH = 64
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKET = re.compile(rb"[^\[\]{}]")


def _depth(data: bytes) -> int:
    """The deepest nesting of arrays and objects in ``data`` (brackets inside strings do not count)."""
    brackets = _NOT_BRACKET.sub(b"", _STRING.sub(b"", data))
    if not brackets:
        return 0
    return max(accumulate(1 if c in b"[{" else -1 for c in brackets))


def _decode(data: bytes, source: str, error: type[LoraError], bom: bool) -> str:
    if data[:2] in (b"\xff\xfe", b"\xfe\xff") or (len(data) > 1 and (data[0] == 0 or data[1] == 0)):
        raise error(f"{source}: the file is UTF-16 (or another wide encoding); save it as UTF-8")
    try:
        return data.decode("utf-8-sig" if bom else "utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{source}: not UTF-8 text (byte {exc.start}: {exc.reason}); save it as UTF-8") from None


def parse_json(data: bytes, source: str, error: type[LoraError], *, bom: bool = True, label: str = "") -> Any:
    """Parse the JSON document ``data`` read from ``source`` (a file name, for messages).

    ``bom``: accept a leading UTF-8 byte order mark (files people edit); safetensors headers may not have one.
    ``label``: what the document is, for messages (``"corrupt safetensors header"``: ``source: label: ...``).

    Raises:
        error: the bytes are not UTF-8, nest deeper than :data:`MAX_DEPTH`, or are not valid JSON; the
            message starts with ``source`` (and the line and column for a syntax error).
    """
    head = f"{source}: {label}: " if label else f"{source}: "
    try:
        text = _decode(data, source, error, bom)
    except LoraError as exc:
        raise error(head + str(exc).removeprefix(f"{source}: ")) from None
    depth = _depth(data)
    if depth > MAX_DEPTH:
        raise error(f"{head}JSON nested {depth} levels deep (at most {MAX_DEPTH} are accepted)")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        if label:
            raise error(f"{head}invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
        raise error(f"{source}:{exc.lineno}:{exc.colno}: invalid JSON: {exc.msg}") from None
    except RecursionError:  # the depth check makes this unreachable in practice; never a traceback
        raise error(f"{head}JSON nested too deeply to parse") from None


def read_json_file(path: str | os.PathLike[str], error: type[LoraError]) -> Any:
    """Read and parse the JSON file at ``path`` (see :func:`parse_json`).

    Raises:
        error: the file cannot be read, is not UTF-8, nests too deeply or is not valid JSON (names the file).
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise error(f"{path}: cannot be read ({exc.strerror or exc})") from None
    return parse_json(data, str(path), error)
