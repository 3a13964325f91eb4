"""Rewrite a model's source so that its targeted layers are built as loragen LoRA layers.

:func:`rewrite_source` is the pure function behind ``loragen rewrite`` (docs/ways-in.md): source in,
:class:`RewriteResult` out; bad input (invalid Python, a config it cannot express, a name clash) comes back
as errors with ``file:line``, never as an exception. :mod:`~loragen.source.planner` decides what changes,
:mod:`~loragen.source.codegen` makes the edits, :mod:`~loragen.source.targets` matches the config's targets.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator
from pathlib import Path

from loragen.config import LoraConfig
from loragen.source.codegen import Diagnostic, RewriteResult, RewrittenCall
from loragen.source.planner import RewritePlanner
from loragen.source.scan import ScanError, scan_module

__all__ = ["Diagnostic", "RewriteResult", "RewrittenCall", "module_name_for_path", "rewrite_source"]


def module_name_for_path(path: str | os.PathLike[str]) -> tuple[str | None, str | None]:
    """``(module, package)`` of a source file found by walking up its ``__init__.py`` folders.

    ``.../site-packages/transformers/models/llama/modeling_llama.py`` gives
    ``("transformers.models.llama.modeling_llama", "transformers.models.llama")``; a file outside any
    package gives ``(None, None)``.
    """
    file = Path(path).resolve()
    parts: list[str] = []
    folder = file.parent
    while (folder / "__init__.py").is_file() and folder.name.isidentifier():
        parts.append(folder.name)
        folder = folder.parent
    if not parts:
        return None, None
    package = ".".join(reversed(parts))
    return (package if file.stem == "__init__" else f"{package}.{file.stem}"), package


def _module_name(filename: str | None, package: str | None) -> str | None:
    """The module's dotted name: ``package.stem`` inside a package, ``stem`` for a top-level file."""
    stem = Path(filename).stem if filename else None
    if package:
        stem = stem or "__rewritten__"
        return package if stem == "__init__" else f"{package}.{stem}"
    return stem if stem and stem.isidentifier() else None


def rewrite_source(
    code: str,
    config: LoraConfig,
    *,
    filename: str | None = None,
    package: str | None = None,
    absolute_imports: bool = True,
) -> RewriteResult:
    """Rewrite the constructor calls of ``config``'s target layers in ``code`` into loragen layers.

    Only these change: each targeted call's callee and added LoRA keywords (``nn.Linear(a, b)`` ->
    ``LoraLinear(a, b, r=8, lora_alpha=16)``), the imports they need, the config as a literal
    (``LORA_CONFIG = LoraConfig(...)``, recorded as ``loragen_config`` in each class holding LoRA layers), a
    ``PreTrainedModel``'s ``_init_weights`` (which ``from_pretrained`` uses to initialise the LoRA factors)
    and, with ``package``, relative imports. A rewrite changes every instance of a class alike, so a config
    that picks only some instances of a field (``layers_to_transform``, per-layer ``rank_pattern``) is an
    error. Rewriting is idempotent.

    Args:
        code: Python source of a module.
        config: which fields to target and their ``r`` / ``lora_alpha`` / ``lora_dropout`` / ...
        filename: used in messages, and for the module's name (``model.py``: ``model``, so a layer type
            defined in the file and registered from ``model`` is recognised).
        package: the package the file belongs to (``"transformers.models.llama"``); resolves relative
            imports for matching (``from ...pytorch_utils import Conv1D``) and, with
            ``absolute_imports``, rewrites them as absolute imports so the output is standalone.
        absolute_imports: make relative imports absolute (needs ``package``); ``False`` for a file
            rewritten in place, where its relative imports still work.

    Returns:
        a :class:`RewriteResult`; never raises for bad input: errors are in ``result.errors``.
    """
    name = filename or "<string>"
    if not isinstance(code, str):
        return RewriteResult(
            str(code), False, name, errors=(Diagnostic(name, 1, "the source must be a str"),)
        )

    def failed(line: int, message: str) -> RewriteResult:
        return RewriteResult(code, False, name, errors=(Diagnostic(name, line, message),))

    if not isinstance(config, LoraConfig):
        return failed(1, f"config must be a loragen.LoraConfig, got {type(config).__name__}")
    if config.target_modules is None:
        return failed(
            1,
            "LoraConfig.target_modules is None: name the modules to adapt (e.g. --target-modules q_proj,v_proj)",
        )
    try:
        with _collector_paused():
            scanned = scan_module(
                code, filename=name, module=_module_name(filename, package), package=package
            )
            return RewritePlanner(code, config, name, package if absolute_imports else None, scanned).run()
    except ScanError as exc:
        return failed(exc.line, exc.reason)
    except RecursionError:  # the parser's guard keeps far from this; a last line of defence
        return failed(1, "the source is nested too deeply to rewrite")
    except Exception as exc:  # a bug in loragen must not crash the caller with bad input
        return failed(1, f"internal error while rewriting ({type(exc).__name__}: {exc}); please report it")


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused: a syntax tree's millions of objects hold no cycles, and
    the collector's passes over them took a third of the time of a large file."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
