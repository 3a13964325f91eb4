"""Rewrite a model's source so that its targeted layers are built as loragen LoRA layers.

:func:`rewrite_source` is the pure function behind ``loragen rewrite``: source in, :class:`RewriteResult`
out, never an exception for bad input (invalid Python, a config it cannot express, a name clash are
returned as errors with ``file:line``).

What changes, and nothing else:

* the constructor call of each targeted layer field: only the callee and added LoRA keywords,
  ``nn.Linear(a, b, bias=False)`` -> ``LoraLinear(a, b, bias=False, r=8, lora_alpha=16)``;
* the imports of the LoRA classes, from where the registry says they live
  (``from loragen.layers import LoraLinear``, or a user's module for a type registered with
  :func:`loragen.register_layer`);
* the config, as a literal after the imports (``LORA_CONFIG = LoraConfig(...)``), and
  ``loragen_config = LORA_CONFIG`` in each class that holds LoRA layers: the rewritten model knows its
  config, so ``loragen.mark_trainable(model)`` and ``loragen.save_adapter`` need none;
* with ``package`` given (a file inside an installed package, such as transformers'
  ``modeling_llama.py``): relative imports become absolute, so the output works from anywhere;
* in a transformers ``PreTrainedModel`` subclass: ``_init_weights`` also initialises LoRA factors (A
  random, B zero, as peft does). ``from_pretrained`` on a base checkpoint leaves them uninitialised
  otherwise: the model is built on the meta device and only ``_init_weights`` fills missing parameters.

Targets, ranks and alphas are decided by :func:`loragen.plan.resolve_candidates`, the rules the runtime
path applies, on module paths. A class's fields are matched under every path the class takes inside the
file's other classes (``LlamaAttention.q_proj`` as ``model.layers.{i}.self_attn.q_proj`` in
``LlamaForCausalLM``). A rewrite changes every instance of a class alike, so a config that picks only
some instances of one field inside one model (``layers_to_transform``, a regex naming layer indices, an
``exclude_modules`` entry for one layer, ``rank_pattern`` per layer) is reported as an error: use
:func:`loragen.get_lora_model` or :func:`loragen.lora_convert` for those.

Target entries that select no layer field of the file are listed in ``result.unmatched_targets``
(``loragen rewrite`` makes those that match nothing in any of its files an error). Rewriting is
idempotent: the output, rewritten again with the same config, is unchanged.

The work is split into :mod:`~loragen.source.planner` (what changes), :mod:`~loragen.source.codegen` (the
edits and what is returned) and :mod:`~loragen.source.targets` (the config's targets in a file).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
from collections.abc import Iterator
from pathlib import Path

from loragen.config import LoraConfig
from loragen.source.codegen import Diagnostic, RewriteResult, RewrittenCall
from loragen.source.planner import RewritePlanner
from loragen.source.scan import ScanError, scan_module, source_text

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
    text = source_text(code)  # the file's byte order mark, line ends and indentation are put back after
    try:
        with _collector_paused():
            scanned = scan_module(
                text.code, filename=name, module=_module_name(filename, package), package=package
            )
            planner = RewritePlanner(text.code, config, name, package if absolute_imports else None, scanned)
            result = planner.run()
        return dataclasses.replace(result, code=text.restore(result.code))
    except ScanError as exc:
        return failed(exc.line, exc.reason)
    except RecursionError:  # the parser's guard keeps far from this; a last line of defence
        return failed(1, "the source is nested too deeply to rewrite")
    except Exception as exc:  # a bug in loragen must not crash the caller with bad input
        return failed(1, f"internal error while rewriting ({type(exc).__name__}: {exc}); please report it")


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused for the duration (and resumed if it was running).

    A rewrite builds syntax trees of millions of small objects that hold no reference cycles; the collector's
    passes over them find nothing and grow with the tree (a third of the time of a 1 MB file). Memory freed by
    reference counting is unaffected.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
