"""The non-Python files loragen ships (Jinja templates, CUDA kernel templates, C and C++ sources), as the
packages ``loragen._templates`` and ``loragen._kernels`` (``templates/`` and ``kernels/`` in a checkout),
and :func:`build_library`, which compiles a C or C++ source into the kernel cache.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
from collections.abc import Sequence
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

__all__ = [
    "build_library",
    "kernel_cache_dir",
    "kernels_dir",
    "list_kernels",
    "read_kernel",
    "read_template",
    "templates_dir",
]


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


def kernel_cache_dir() -> Path:
    """Where compiled kernels are cached: ``$LORAGEN_CACHE_DIR``, else ``$XDG_CACHE_HOME/loragen/kernels``,
    else ``~/.cache/loragen/kernels``. Not created here."""
    explicit = os.environ.get("LORAGEN_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "loragen" / "kernels"


def build_library(
    folder: Path,
    stem: str,
    source_name: str,
    source: str,
    command: Sequence[str],
    libraries: Sequence[str] = (),
    key: Sequence[str] = (),
) -> Path:
    """``source`` compiled into ``folder/<stem>.<hash>.so`` with ``command`` (the compiler and its flags),
    or the cached build of the same source, command, compiler version and ``key``; written atomically.

    Raises:
        RuntimeError: the compiler failed (its messages' tail in the text).
        OSError, subprocess.SubprocessError: the compiler could not be run.
    """
    compiler = command[0]
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=60, check=False
    ).stdout
    digest = hashlib.sha256("\0".join([source, *command, *libraries, version, *key]).encode()).hexdigest()
    target = folder / f"{stem}.{digest[:16]}.so"
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as work:
        src = Path(work) / source_name
        src.write_text(source, encoding="utf-8")
        built = Path(work) / target.name
        done = subprocess.run(
            [*command, "-o", str(built), str(src), *libraries],
            capture_output=True,
            text=True,
            check=False,
            timeout=600,
        )
        if done.returncode != 0:
            flags = " ".join(command[1:])
            raise RuntimeError(f"{compiler} {flags} {source_name} failed:\n{done.stderr.strip()[-4000:]}")
        os.replace(built, target)
    return target
