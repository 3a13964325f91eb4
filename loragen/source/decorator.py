"""``@lora_convert``: generate explicit LoRA conversion code for a class from its source.

The decorator scans the class's module file (:mod:`loragen.source.scan`), renders its expansion from
``templates/decorator.py.j2`` (every decision is made in Python, here), compiles it and
attaches ``get_lora_model``, ``get_tensors``, ``merge_weights`` and ``unmerge_weights`` to the class, with
``lora_fields``, ``lora_unresolved`` and ``__lora_source__`` (the generated code, exactly what runs).
``get_lora_model`` gives what :func:`loragen.get_lora_model` gives on the same model (docs/ways-in.md).

A layer field gets an explicit branch unless the decorator's config does not target it, it is nested
deeper than one container, or its classes cannot be imported by name; the runtime path converts the rest.
"""

from __future__ import annotations

import functools
import inspect
import linecache
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar, overload

from torch import nn

from loragen.config import LoraConfig
from loragen.convert import CONFIG_ATTR
from loragen.errors import LoraConvertError
from loragen.registry import LayerSpec, spec_for_qualname, specs
from loragen.source.codegen import CONFIG_NAME, config_literal, is_identifier, py_literal, render
from loragen.source.scan import (
    LORA_CLASS_FOR,
    ClassScan,
    LayerField,
    ScanError,
    ScanResult,
    from_spec,
    importable,
    layer_types,
    scan_source,
)
from loragen.source.targets import Targets, overridden_method

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
    return _render_expansion(cls, scan, result, config)


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
    source = _render_expansion(cls, scan, result, config)
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


class _Imports:
    """The generated code's ``from <module> import <name>`` lines; refuses a name bound twice."""

    def __init__(self) -> None:
        self.names: dict[str, str] = {}  # bound name -> module

    def add(self, module: str, name: str) -> bool:
        return self.names.setdefault(name, module) == module

    def lines(self, loragen: bool) -> list[str]:
        by_module: dict[str, list[str]] = {}
        for name, module in self.names.items():
            if not module.startswith("<") and module.startswith("loragen") == loragen:
                by_module.setdefault(module, []).append(name)
        return [f"from {m} import {', '.join(sorted(by_module[m]))}" for m in sorted(by_module)]


def _spellings(
    field: LayerField, module: str, imports: _Imports, derived: dict[str, str]
) -> tuple[str, str] | None:
    """How the generated code names ``field``'s layer type and its LoRA class, importing them (a layer
    subclass of the class's own ``module`` gets ``LoraFalconLinear = lora_class_for(FalconLinear)`` in
    ``derived``), or None when either cannot be imported by name."""
    spec = spec_for_qualname(field.layer)
    if spec is None:
        return None
    subclass = field.subclass
    if subclass is not None:
        if not importable(f"{module}.{subclass}", getattr(sys.modules.get(module), subclass, None)):
            return None
        if not (
            imports.add(module, subclass)
            and imports.add(*LORA_CLASS_FOR)
            and imports.add("<derived>", field.lora_name)
        ):
            return None
        derived[field.lora_name] = f"{field.lora_name} = lora_class_for({subclass})"
        return subclass, field.lora_name
    if not from_spec(spec).importable() or not importable(spec.base_qualname, spec.base_type()):
        return None
    module, _, name = spec.base_qualname.rpartition(".")
    if module == "torch.nn":  # as model code spells it: nn.Linear
        base_ok, base = imports.add("torch", "nn"), f"nn.{name}"
    else:
        base_ok, base = imports.add(module, name), name
    if not (base_ok and imports.add(spec.lora_module, spec.lora_name)):
        return None
    return base, spec.lora_name


def _table(rows: Sequence[tuple[str, str, str]]) -> list[str]:
    if not rows:
        return []
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)) + "  " + r[-1] for r in rows]


def _render_expansion(cls: type, scan: ClassScan, result: ScanResult, config: LoraConfig | None) -> str:
    """The generated Python for ``cls`` (scanned as ``scan`` in ``result``), with ``config`` as the default
    of ``get_lora_model()`` when given."""
    imports = _Imports()
    imports.add("loragen.convert", "mark_trainable")
    imports.add("loragen.convert", "initialise_when_loaded")
    imports.add("loragen.plan", "resolve")
    imports.add("loragen.source", "runtime")
    if config is not None:
        imports.add("loragen", "LoraConfig")
    targets = Targets(config, result) if config is not None else None
    short = Path(scan.location.filename).name
    branches: list[dict[str, Any]] = []
    notes: dict[int, str] = {}
    # one branch per attribute, layer type and depth (0: the field itself, 1: in a container, 2: deeper)
    groups: dict[tuple[str, str, int], list[LayerField]] = {}
    for field in scan.fields:
        kind = field.subclass or field.layer
        groups.setdefault((field.attribute, kind, min(field.path.count("."), 2)), []).append(field)
    derived: dict[str, str] = {}  # the LoRA classes of layer subclasses: name -> its line
    for (attribute, _, depth), fields in groups.items():
        container = depth == 1
        if targets is not None and not any(targets.plan(f).entries for f in fields):
            reason = f"not targeted by {CONFIG_NAME}"
        elif depth > 1:
            reason = "runtime path: nested in more than one container"
        elif (overridden := overridden_method(fields[0], result, layer_types())) is not None:
            reason = f"runtime path, which refuses it: {overridden[0]} overrides {overridden[1]}"
        elif (spelled := _spellings(fields[0], cls.__module__, imports, derived)) is None:
            reason = "runtime path: its classes cannot be imported by name"
        else:
            base, lora = spelled
            name = py_literal(attribute)
            lines = ", ".join(str(line) for line in sorted({f.location.line for f in fields}))
            branches.append(
                {
                    "attribute": name,
                    "container": container,
                    "base": base,
                    "lora": lora,
                    "target": f"self.{attribute}" if is_identifier(attribute) else f"self._modules[{name}]",
                    "comment": (f"in {fields[0].container}, " if container else "") + f"{short}:{lines}",
                }
            )
            continue
        for f in fields:
            notes[id(f)] = reason
    branches.sort(key=lambda b: b["container"])  # a container branch must not shadow a direct one
    rows: list[tuple[str, str, str]] = []
    for f in scan.fields:
        extra = [f"in {f.container}"] if f.container else []
        extra += ["conditional"] if f.conditional else []
        extra += [notes[id(f)]] if id(f) in notes else []
        where = f"{short}:{f.location.line}" + (f" ({', '.join(extra)})" if extra else "")
        layer = f"{f.subclass}({f.layer})" if f.subclass else f.layer
        rows.append((f.pattern, f"{layer} -> {f.lora_name}", where))
    return render(
        "decorator.py.j2",
        qualified_class=f"{cls.__module__}.{cls.__qualname__}",
        class_name=cls.__name__,
        location=f"{short}:{scan.location.line}",
        field_rows=_table(rows),
        unresolved_rows=[f"{short}:{u.location.line}: {u.reason}" for u in scan.unresolved],
        imports=imports.lines(loragen=False),
        loragen_imports=imports.lines(loragen=True),
        derived_lines=list(derived.values()),
        config_name=CONFIG_NAME,
        config=None if config is None else config_literal(config, column=len(CONFIG_NAME) + 3),
        config_attr=CONFIG_ATTR,
        branches=branches,
    )
