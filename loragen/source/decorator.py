"""``@lora_convert``: generate explicit LoRA conversion code for a class from its source.

The decorator scans the class's module file (:mod:`loragen.source.scan`), renders its expansion
(:mod:`loragen.source.expansion`), compiles it and attaches ``get_lora_model``, ``get_tensors``,
``merge_weights`` and ``unmerge_weights`` to the class, with ``lora_fields``, ``lora_unresolved`` and
``__lora_source__`` (the generated code, exactly what runs). ``get_lora_model`` gives what
:func:`loragen.get_lora_model` gives on the same model (docs/ways-in.md).
"""

from __future__ import annotations

import functools
import inspect
import linecache
import sys
from collections.abc import Callable
from typing import Any, TypeVar, overload

from torch import nn

from loragen.config import LoraConfig
from loragen.errors import LoraConvertError
from loragen.registry import LayerSpec, specs
from loragen.source.expansion import CONFIG_NAME, render_expansion
from loragen.source.scan import ClassScan, ScanError, ScanResult, scan_source

__all__ = ["GENERATED_METHODS", "LoraConvertError", "expansion_source", "lora_convert"]

C = TypeVar("C", bound=type)

GENERATED_METHODS = (
    "get_lora_model",
    "_lora_convert",
    "_lora_layers",
    "get_tensors",
    "merge_weights",
    "unmerge_weights",
)


@overload
def lora_convert(target: C, config: LoraConfig | None = None) -> C: ...


@overload
def lora_convert(target: LoraConfig | None = None, config: None = None) -> Callable[[C], C]: ...


def lora_convert(target: Any = None, config: LoraConfig | None = None) -> Any:
    """Generate and attach explicit LoRA conversion code to an ``nn.Module`` subclass.

    Forms::

        @lora_convert                    # get_lora_model(config) needs a config
        class Block(nn.Module): ...

        @lora_convert(LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
        class Block(nn.Module): ...      # get_lora_model() uses that config by default

        lora_convert(LlamaAttention)     # a class of another package, in place
        lora_convert(LlamaAttention, config)

    Returns:
        the class itself (with the generated methods), or a decorator when called with a config only.

    Raises:
        LoraConvertError: the class's source cannot be read (made by ``exec``, in a REPL), it is not an
            ``nn.Module`` subclass, it defines one of the generated names itself, or ``config`` is not a
            :class:`~loragen.config.LoraConfig` (a ``TypeError`` too).
    """
    if isinstance(target, LoraConfig) or target is None:
        if config is not None:
            raise LoraConvertError(
                "lora_convert(config) takes one config; use lora_convert(cls, config) for a class"
            )
        default = target
        return lambda cls: _expand(cls, default)
    if not isinstance(target, type):
        raise LoraConvertError(
            f"lora_convert expects a class or a LoraConfig, got {type(target).__name__}; "
            "use @lora_convert, @lora_convert(config) or lora_convert(SomeModule)"
        )
    return _expand(target, config)


def expansion_source(cls: type, config: LoraConfig | None = None) -> str:
    """The generated Python for ``cls`` decorated with ``config`` (what ``cls.__lora_source__`` holds
    after ``lora_convert(cls, config)``).

    Raises:
        LoraConvertError: as :func:`lora_convert`.
    """
    scan, result = _scan_class(cls)
    return render_expansion(cls, scan, result, config)


def _expand(cls: C, config: LoraConfig | None) -> C:
    if not isinstance(cls, type) or not issubclass(cls, nn.Module):
        raise LoraConvertError(f"@lora_convert applies to nn.Module subclasses, not {cls!r}")
    if config is not None and not isinstance(config, LoraConfig):
        raise LoraConvertError(f"config must be a loragen.LoraConfig, got {type(config).__name__}")
    for name in GENERATED_METHODS:
        existing = vars(cls).get(name)
        if existing is not None and not getattr(existing, "__lora_generated__", False):
            raise LoraConvertError(
                f"{cls.__qualname__} defines {name}() itself; @lora_convert would replace it. Rename it, or "
                "use loragen.get_lora_model(model, config) instead of the decorator"
            )
    scan, result = _scan_class(cls)
    source = render_expansion(cls, scan, result, config)
    filename = f"<loragen.lora_convert {cls.__module__}.{cls.__qualname__}>"
    # registered with linecache so tracebacks and inspect.getsource() show the generated lines
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    namespace: dict[str, Any] = {"__name__": cls.__module__}
    exec(compile(source, filename, "exec"), namespace)  # our own rendered template, nothing else
    if namespace.get(CONFIG_NAME) != config:  # the literal must rebuild the config exactly
        raise LoraConvertError(
            f"internal error: the generated {CONFIG_NAME} of {cls.__qualname__} differs from the config given "
            "to @lora_convert; please report it"
        )
    for name in GENERATED_METHODS:
        function = namespace[name]
        function.__qualname__ = f"{cls.__qualname__}.{name}"
        function.__lora_generated__ = True
        setattr(cls, name, function)
    cls.lora_fields = scan.fields  # type: ignore[attr-defined]
    cls.lora_unresolved = scan.unresolved  # type: ignore[attr-defined]
    cls.__lora_source__ = source  # type: ignore[attr-defined]
    return cls


def _no_source(cls: type, reason: str) -> LoraConvertError:
    return LoraConvertError(
        f"cannot read the source of {cls.__module__}.{cls.__qualname__} ({reason}). @lora_convert generates "
        "code from a class's source, which a class made by exec() or typed into a REPL does not have. "
        "Use the runtime path instead: loragen.get_lora_model(model, config)"
    )


def _scan_class(cls: type) -> tuple[ClassScan, ScanResult]:
    """The scan of ``cls`` and of its whole module file (so that its imports resolve)."""
    try:
        filename = inspect.getsourcefile(cls)
        _, line = inspect.getsourcelines(cls)
    except (OSError, TypeError) as exc:
        raise _no_source(cls, str(exc) or type(exc).__name__) from None
    if filename is None:
        raise _no_source(cls, "no source file")
    module = sys.modules.get(cls.__module__)
    lines = linecache.getlines(filename, getattr(module, "__dict__", None))
    if not lines:
        raise _no_source(cls, f"{filename} cannot be read")
    package = getattr(module, "__package__", None) or None
    try:
        result = _scan_file(filename, "".join(lines), cls.__module__, package, specs())
    except ScanError as exc:
        raise LoraConvertError(f"cannot scan the source of {cls.__qualname__}: {exc}") from None
    except RecursionError:  # the parser refuses deep nesting first; a last line of defence
        raise LoraConvertError(
            f"cannot scan the source of {cls.__qualname__}: {filename} is nested too deeply"
        ) from None
    scan = result.get(cls.__qualname__)
    if scan is None:
        raise _no_source(cls, f"no class {cls.__qualname__} in {filename} near line {line}")
    return scan, result


@functools.lru_cache(maxsize=32)
def _scan_file(
    filename: str, text: str, module: str, package: str | None, registered: tuple[LayerSpec, ...]
) -> ScanResult:
    """Cached by file content and registered layer types: several classes of one file parse it once."""
    del registered  # part of the cache key only
    return scan_source(text, filename=filename, module=module, package=package)
