"""Access to the non-Python files loragen ships: Jinja templates and CUDA kernel templates.

In the repository they live in the top-level ``templates/`` and ``kernels/`` folders; in a wheel (and an
editable install) they are the resource packages ``loragen._templates`` and ``loragen._kernels``. Always
read them through this module so that code works the same from a checkout and from an installed wheel.
"""

from __future__ import annotations

from importlib import resources
from importlib.resources.abc import Traversable

__all__ = ["templates_dir", "kernels_dir", "read_template", "read_kernel", "list_kernels"]


def templates_dir() -> Traversable:
    """The folder holding the Jinja templates for generated Python code."""
    return resources.files("loragen._templates")


def kernels_dir() -> Traversable:
    """The folder holding the Jinja templates of CUDA C kernels (``*.cu.j2``)."""
    return resources.files("loragen._kernels")


def _read(folder: Traversable, name: str, what: str) -> str:
    entry = folder.joinpath(name)
    if not entry.is_file():
        available = sorted(p.name for p in folder.iterdir() if p.name.endswith(".j2"))
        raise FileNotFoundError(f"no {what} named {name!r}; available: {', '.join(available) or 'none'}")
    return entry.read_text(encoding="utf-8")


def read_template(name: str) -> str:
    """Return the text of the Python-code template ``name`` (e.g. ``"decorator.py.j2"``).

    Raises:
        FileNotFoundError: no such template; the message lists the available ones.
    """
    return _read(templates_dir(), name, "template")


def read_kernel(name: str) -> str:
    """Return the text of the CUDA kernel template ``name`` (e.g. ``"lora_forward.cu.j2"``).

    Raises:
        FileNotFoundError: no such kernel template; the message lists the available ones.
    """
    return _read(kernels_dir(), name, "kernel template")


def list_kernels() -> list[str]:
    """Names of all CUDA kernel templates shipped with loragen, sorted."""
    return sorted(p.name for p in kernels_dir().iterdir() if p.name.endswith(".cu.j2"))
