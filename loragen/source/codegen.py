"""Rendering of generated Python from the Jinja templates in ``templates/``.

Templates only substitute values: every decision (which fields, which names, which keywords) is made in
Python by the caller, which passes plain strings and lists. ``StrictUndefined`` turns a missing value
into an error instead of an empty string, so a template can never silently produce wrong code.
"""

from __future__ import annotations

import functools
import keyword
from typing import Any

import jinja2

from loragen.resources import read_template

__all__ = ["environment", "is_identifier", "py_literal", "render"]


@functools.cache
def environment() -> jinja2.Environment:
    """The shared Jinja environment: templates from loragen's resources, ``StrictUndefined``, no autoescape."""
    return jinja2.Environment(
        loader=jinja2.FunctionLoader(lambda name: read_template(name)),
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


def py_literal(value: Any) -> str:
    """Python source for a config value: ``8``, ``16``, ``0.05``, ``True``, ``'gaussian'``.

    Floats with an integral value are written as integers (``lora_alpha=16``), as a person would.
    """
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return repr(value)


def is_identifier(name: str) -> bool:
    """Whether ``name`` can be written as a Python attribute name."""
    return name.isidentifier() and not keyword.iskeyword(name)
