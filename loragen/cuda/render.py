"""Render the CUDA kernel templates in ``kernels/`` with Jinja.

Templates hold only ``{{ value }}`` substitutions; every decision is made in Python
(:mod:`loragen.cuda.specs`). Rendering is strict both ways: a variable the template uses but the
caller did not pass is an error (``StrictUndefined``), and so is a passed value the template never
uses (usually a typo). Python values become C++ literals here: ``True`` -> ``true``, ints as written.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass

import jinja2
import jinja2.meta

from loragen import resources

__all__ = ["COMMON_HEADER", "KernelRenderError", "RenderedKernel", "render_common_header", "render_kernel"]

# The header every kernel includes; NVRTC receives it in memory under this name.
COMMON_HEADER = "lora_common.cuh"


class KernelRenderError(ValueError):
    """A kernel template could not be rendered with the given parameters."""


@dataclass(frozen=True)
class RenderedKernel:
    """CUDA C source ready for NVRTC: one ``extern "C"`` kernel plus the headers it includes."""

    name: str  # the kernel function's name
    template: str
    params: tuple[tuple[str, str], ...]  # the substituted values, as C++ text, sorted by name
    source: str
    headers: tuple[tuple[str, str], ...]  # (include name, text)

    @property
    def description(self) -> str:
        """``lora_down(aligned=true, rank_bucket=16, ...)``: names the kernel in errors and logs."""
        shown = ", ".join(f"{k}={v}" for k, v in self.params if k != "variant")
        return f"{self.name}({shown})"


def _cpp_literal(name: str, value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, str)):
        return str(value)
    raise KernelRenderError(
        f"loragen.cuda.render: parameter {name}={value!r} ({type(value).__name__}); expected a bool, int or str"
    )


@functools.lru_cache(maxsize=8)
def _environment(search_path: str | None) -> jinja2.Environment:
    shipped = jinja2.FunctionLoader(resources.read_kernel)
    loader = (
        shipped
        if search_path is None
        else jinja2.ChoiceLoader([jinja2.FileSystemLoader(search_path), shipped])
    )
    return jinja2.Environment(
        loader=loader, undefined=jinja2.StrictUndefined, keep_trailing_newline=True, autoescape=False
    )


def _template_variables(env: jinja2.Environment, template: str) -> frozenset[str]:
    assert env.loader is not None
    source = env.loader.get_source(env, template)[0]
    return frozenset(jinja2.meta.find_undeclared_variables(env.parse(source)))


def _render(
    template: str, name: str, params: Mapping[str, object], search_path: str | None = None
) -> tuple[tuple[tuple[str, str], ...], str]:
    values = {key: _cpp_literal(key, value) for key, value in params.items()}
    env = _environment(search_path)
    try:
        used = _template_variables(env, template)
        unused = sorted(set(values) - used)
        if unused:
            raise KernelRenderError(
                f"loragen.cuda.render: kernel {name} (kernels/{template}) does not use parameter(s) "
                f"{', '.join(unused)}; it uses {', '.join(sorted(used)) or 'none'}"
            )
        source = env.get_template(template).render(values)
    except jinja2.UndefinedError as exc:
        raise KernelRenderError(
            f"loragen.cuda.render: kernel {name} (kernels/{template}): {exc.message}; "
            f"parameters given: {', '.join(sorted(values)) or 'none'}"
        ) from exc
    except jinja2.TemplateError as exc:
        where = f"kernels/{template}:{getattr(exc, 'lineno', '?')}"
        raise KernelRenderError(f"loragen.cuda.render: kernel {name} ({where}): {exc}") from exc
    return tuple(sorted(values.items())), source


def render_common_header() -> str:
    """The text of ``lora_common.cuh`` (its template takes no parameters)."""
    return _render(f"{COMMON_HEADER}.j2", COMMON_HEADER, {})[1]


def render_kernel(
    name: str,
    params: Mapping[str, object],
    *,
    template: str | None = None,
    search_path: str | os.PathLike[str] | None = None,
) -> RenderedKernel:
    """Render kernel ``name`` from ``kernels/<name>.cu.j2`` (or ``template``) with ``params``.

    Args:
        name: the ``extern "C"`` function the template defines.
        params: template variables; bools, ints and strings (C++ type names) only.
        template: the template file name, default ``<name>.cu.j2``.
        search_path: a folder searched for the template before loragen's own ``kernels/``
            (experiments and tests).

    Returns:
        The source and the headers NVRTC needs, with the parameters recorded for error messages.

    Raises:
        KernelRenderError: a variable is missing, a parameter is unused or has an unsupported type,
            or the template is malformed.
        FileNotFoundError: no such template.
    """
    template = template or f"{name}.cu.j2"
    values, source = _render(template, name, params, None if search_path is None else os.fspath(search_path))
    return RenderedKernel(name, template, values, source, ((COMMON_HEADER, render_common_header()),))
