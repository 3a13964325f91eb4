"""Rendering of generated Python: the Jinja templates in ``templates/`` and Python literals for values.

Templates only substitute values: every decision (which fields, which names, which keywords) is made in
Python by the caller, which passes plain strings and lists. ``StrictUndefined`` turns a missing value
into an error instead of an empty string, so a template can never silently produce wrong code.
Literals are written as a person would write them (``16`` for ``16.0``, ``"q_proj"`` in double quotes,
``r"..."`` for a regex with backslashes), and :func:`config_literal` writes a
:class:`~loragen.config.LoraConfig` with only the fields that differ from the defaults.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import keyword
from collections.abc import Mapping
from typing import Any

import jinja2

from loragen.config import LoraConfig
from loragen.resources import read_template

__all__ = ["config_literal", "environment", "importable", "is_identifier", "py_literal", "render"]

_WIDTH = 100  # a generated line longer than this is split, one argument per line


@functools.cache
def environment() -> jinja2.Environment:
    """The shared Jinja environment: templates from loragen's resources, ``StrictUndefined``, no autoescape."""
    return jinja2.Environment(
        loader=jinja2.FunctionLoader(read_template),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )


def render(template: str, **values: Any) -> str:
    """Render the template named ``template`` (e.g. ``"decorator.py.j2"``) with ``values``.

    Raises:
        jinja2.UndefinedError: the template uses a value that was not passed.
        FileNotFoundError: no such template.
    """
    return environment().get_template(template).render(**values)


def _string_literal(text: str) -> str:
    if "\\" in text and '"' not in text and not text.endswith("\\") and text.isprintable():
        raw = f'r"{text}"'  # a regex reads best as a raw string
        if ast.literal_eval(raw) == text:
            return raw
    quoted = repr(text)
    if quoted.startswith("'") and '"' not in text and "'" not in text:
        return f'"{quoted[1:-1]}"'
    return quoted


def py_literal(value: Any) -> str:
    """Python source for a config value: ``8``, ``16``, ``0.05``, ``True``, ``"gaussian"``,
    ``["q_proj", "v_proj"]``, ``{"fc1": 4}``, ``r"(.*\\.)?q_proj"``.

    Floats with an integral value are written as integers (``lora_alpha=16``), as a person would;
    tuples as lists (peft's configs hold lists).

    Raises:
        TypeError: a value that has no literal (an object).
    """
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return _string_literal(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(py_literal(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{py_literal(k)}: {py_literal(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"no Python literal for {type(value).__name__} {value!r}")


def config_literal(config: LoraConfig, *, indent: str = "", column: int = 0) -> str:
    """``LoraConfig(r=16, target_modules=["q_proj", "v_proj"])``: the call that builds ``config``, with
    the fields that differ from their defaults, in the dataclass's order.

    The call is on one line when it fits in 100 columns after ``column`` characters, else one field per
    line indented by ``indent`` plus four spaces. Evaluated with ``LoraConfig`` in scope it gives a config
    equal to ``config``.
    """
    default = LoraConfig()
    arguments = [
        f"{f.name}={py_literal(getattr(config, f.name))}"
        for f in dataclasses.fields(config)
        if getattr(config, f.name) != getattr(default, f.name)
    ]
    one_line = f"LoraConfig({', '.join(arguments)})"
    if column + len(one_line) <= _WIDTH:
        return one_line
    inner = indent + "    "
    return "LoraConfig(\n" + "".join(f"{inner}{a},\n" for a in arguments) + f"{indent})"


def is_identifier(name: str) -> bool:
    """Whether ``name`` can be written as a Python attribute name."""
    return name.isidentifier() and not keyword.iskeyword(name)


def importable(qualname: str, obj: object) -> bool:
    """Whether ``from <module> import <name>`` of ``qualname`` gives ``obj`` (generated code can name it)."""
    module_name, _, name = qualname.rpartition(".")
    if not module_name or "<locals>" in qualname or obj is None:
        return False
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return False
    return getattr(module, name, None) is obj
