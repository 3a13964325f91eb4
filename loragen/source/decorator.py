"""``@lora_convert``: generate explicit LoRA conversion code for a class from its source.

The Python counterpart of candle-lora's ``#[replace_layer_fields]`` + ``#[derive(AutoLoraConvert)]``:
the decorator reads the class's source with the libcst scanner (:mod:`loragen.source.scan`), renders the
class's expansion from ``templates/decorator.py.j2``, compiles it and attaches it to the class:

* ``get_lora_model(self, config=None)``: converts each targeted layer field with an explicit
  ``LoraLinear.from_module(self.q_proj, r=config.rank_for(path), ...)``; child modules of decorated
  classes run their own generated code, all others go through the runtime path. The result equals
  :func:`loragen.get_lora_model` on the same model (same layers, parameters, trainable set);
* ``get_tensors()``: the LoRA factors under peft's adapter keys;
* ``merge_weights()`` / ``unmerge_weights()``;
* ``lora_fields`` (what the scanner found), ``lora_unresolved`` (what it could not resolve) and
  ``__lora_source__`` (the generated Python, meant to be read).

It works on classes of other packages too (``lora_convert(LlamaAttention)``): the class's module file is
scanned so that its imports resolve. A class without retrievable source (made by ``exec`` or typed into a
REPL) is refused with an error pointing to the runtime path.
"""

from __future__ import annotations

import functools
import inspect
import linecache
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar, overload

from torch import nn

from loragen.config import LoraConfig
from loragen.convert import CONFIG_ATTR, convert_module, mark_trainable, plan_conversion
from loragen.errors import LoraConvertError
from loragen.layers import LoraLayer
from loragen.registry import LayerSpec, specs
from loragen.source.codegen import is_identifier, render
from loragen.source.scan import ClassScan, LayerField, ScanError, ScanResult, scan_source

__all__ = [
    "GENERATED_METHODS",
    "LoraConvertError",
    "config_or_default",
    "convert_child",
    "expansion_source",
    "finish",
    "lora_convert",
    "lora_layers_of",
    "plan",
]

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
            ``nn.Module`` subclass, or it defines one of the generated names itself.
        TypeError: ``config`` is not a :class:`~loragen.config.LoraConfig`.
    """
    if isinstance(target, LoraConfig) or target is None:
        if config is not None:
            raise TypeError(
                "lora_convert(config) takes one config; use lora_convert(cls, config) for a class"
            )
        default = target
        return lambda cls: _expand(cls, default)
    if not isinstance(target, type):
        raise TypeError(
            f"lora_convert expects a class or a LoraConfig, got {type(target).__name__}; "
            "use @lora_convert, @lora_convert(config) or lora_convert(SomeModule)"
        )
    if config is not None and not isinstance(config, LoraConfig):
        raise TypeError(f"config must be a loragen.LoraConfig, got {type(config).__name__}")
    return _expand(target, config)


def expansion_source(cls: type) -> str:
    """The generated Python for ``cls`` (what ``cls.__lora_source__`` holds after decoration).

    Raises:
        LoraConvertError: as :func:`lora_convert`.
    """
    return _render(cls, _scan_class(cls))


# ---- the expansion -----------------------------------------------------------------------------------


def _expand(cls: C, default: LoraConfig | None) -> C:
    if not isinstance(cls, type) or not issubclass(cls, nn.Module):
        raise LoraConvertError(f"@lora_convert applies to nn.Module subclasses, not {cls!r}")
    if default is not None and not isinstance(default, LoraConfig):
        raise TypeError(f"config must be a loragen.LoraConfig, got {type(default).__name__}")
    for name in GENERATED_METHODS:
        existing = vars(cls).get(name)
        if existing is not None and not getattr(existing, "__lora_generated__", False):
            raise LoraConvertError(
                f"{cls.__qualname__} defines {name}() itself; @lora_convert would replace it. Rename it, or "
                "use loragen.get_lora_model(model, config) instead of the decorator"
            )
    scan = _scan_class(cls)
    source = _render(cls, scan)
    filename = f"<loragen.lora_convert {cls.__module__}.{cls.__qualname__}>"
    # registered with linecache so tracebacks and inspect.getsource() show the generated lines
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    namespace: dict[str, Any] = {"__name__": cls.__module__}
    exec(compile(source, filename, "exec"), namespace)  # noqa: S102 - our own rendered template
    namespace["DEFAULT_CONFIG"] = default
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


def _scan_class(cls: type) -> ClassScan:
    """The scan of ``cls``, from its module's whole source file (so that its imports resolve)."""
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
    text = "".join(lines)
    try:
        result = _scan_file(filename, text, cls.__module__, package)
    except ScanError as exc:
        raise LoraConvertError(f"cannot scan the source of {cls.__qualname__}: {exc}") from None
    scan = result.get(cls.__qualname__)
    if scan is None:
        raise _no_source(cls, f"no class {cls.__qualname__} in {filename} near line {line}")
    return scan


@functools.lru_cache(maxsize=32)
def _scan_file(filename: str, text: str, module: str, package: str | None) -> ScanResult:
    """Scans are cached by file content: decorating several classes of one file parses it once."""
    return scan_source(text, filename=filename, module=module, package=package)


def _base_expression(spec: LayerSpec, imports: dict[str, set[str]]) -> str:
    """How the generated code names the base type, adding the import it needs."""
    module, _, name = spec.base_qualname.rpartition(".")
    if module == "torch.nn":
        imports.setdefault("torch", set()).add("nn")
        return f"nn.{name}"
    imports.setdefault(module, set()).add(name)
    return name


def _render(cls: type, scan: ClassScan) -> str:
    by_name = {spec.base_qualname: spec for spec in specs()}
    imports: dict[str, set[str]] = {"loragen.source": {"decorator as _lora"}, "loragen.layers": set()}
    short = Path(scan.location.filename).name
    branches: list[dict[str, Any]] = []
    layer_branches: list[dict[str, Any]] = []
    seen: set[tuple[str, str, bool]] = set()
    for field in scan.fields:
        segments = field.path.split(".")
        container = len(segments) == 2
        if len(segments) > 2 or (field.attribute, field.layer, container) in seen:
            continue  # deeper nesting goes through the runtime path; one branch per attribute and type
        seen.add((field.attribute, field.layer, container))
        spec = by_name[field.layer]
        base = _base_expression(spec, imports)
        imports["loragen.layers"].add(spec.lora_name)
        name = repr(field.attribute).replace("'", '"')
        where = f"{field.layer} in {field.container}" if container else field.layer
        lines = sorted(
            {
                f.location.line
                for f in scan.fields
                if f.attribute == field.attribute and f.layer == field.layer
            }
        )
        comment = f"{where}, {short}:{', '.join(map(str, lines))}"
        target = f"self.{field.attribute}" if is_identifier(field.attribute) else f"self._modules[{name}]"
        branches.append(
            {
                "condition": f"name == {name}" if container else f"name == {name} and type(child) is {base}",
                "comment": comment,
                "container": container,
                "base": base,
                "lora": spec.lora_name,
                "target": target,
            }
        )
        layer_branches.append(
            {
                "condition": f"name == {name}"
                if container
                else f"name == {name} and isinstance(child, {spec.lora_name})",
                "container": container,
                "lora": spec.lora_name,
            }
        )
    # a container branch must not shadow a direct branch of the same attribute: direct ones first
    branches.sort(key=lambda b: b["container"])
    layer_branches.sort(key=lambda b: b["container"])
    field_rows = _table(
        [
            (f.pattern, f"{f.layer} -> {f.lora_name}", f"{short}:{f.location.line}" + _notes(f))
            for f in scan.fields
        ]
    )
    unresolved_rows = [f"{short}:{u.location.line}: {u.reason}" for u in scan.unresolved]
    import_lines: dict[bool, list[str]] = {
        True: [],
        False: [],
    }  # loragen's imports in a group of their own, as isort would
    for module in sorted(imports):
        if imports[module]:
            import_lines[module.startswith("loragen")].append(
                f"from {module} import {', '.join(sorted(imports[module]))}"
            )
    return render(
        "decorator.py.j2",
        qualified_class=f"{cls.__module__}.{cls.__qualname__}",
        class_name=cls.__name__,
        location=f"{short}:{scan.location.line}",
        field_rows=field_rows,
        unresolved_rows=unresolved_rows,
        imports=import_lines[False],
        loragen_imports=import_lines[True],
        branches=branches,
        layer_branches=layer_branches,
    )


def _notes(field: LayerField) -> str:
    notes = [
        n
        for n in (
            f"in {field.container}" if field.container else "",
            "conditional" if field.conditional else "",
        )
        if n
    ]
    return f" ({', '.join(notes)})" if notes else ""


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    if not rows:
        return []
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)) + "  " + r[-1] for r in rows]


# ---- runtime helpers called by the generated code --------------------------------------------------


def config_or_default(config: LoraConfig | None, default: LoraConfig | None, owner: str) -> LoraConfig:
    """``config``, else the decorator's default.

    Raises:
        TypeError: neither is given, or ``config`` is not a LoraConfig.
    """
    if config is None:
        config = default
    if config is None:
        raise TypeError(
            f"{owner}.get_lora_model() needs a LoraConfig: pass one, or decorate the class with "
            "@lora_convert(LoraConfig(...)) to give it a default"
        )
    if not isinstance(config, LoraConfig):
        raise TypeError(
            f"config must be a loragen.LoraConfig, got {type(config).__name__}; "
            "for a peft config use LoraConfig.from_peft(peft_config.to_dict())"
        )
    return config


def plan(model: nn.Module, config: LoraConfig) -> dict[str, nn.Module]:
    """The layers to convert, by module path: exactly what :func:`loragen.get_lora_model` would convert.

    Raises:
        LoraConversionError: as :func:`loragen.convert.plan_conversion`.
    """
    return plan_conversion(model, config)


def finish(model: nn.Module, config: LoraConfig) -> None:
    """Freeze all but the adapter (and ``modules_to_save`` / biases per config) and record the config."""
    mark_trainable(model, config)
    setattr(model, CONFIG_ATTR, config)


def convert_child(
    parent: nn.Module, name: str, config: LoraConfig, planned: dict[str, nn.Module], path: str
) -> None:
    """Convert the planned layers in ``parent``'s child ``name`` (at module path ``path``).

    A planned layer is replaced in place; a child whose class was decorated runs its generated code;
    any other child goes through the runtime path for the planned layers below it.
    """
    child = parent._modules.get(name)
    if child is None:
        return
    if path in planned:
        setattr(parent, name, convert_module(child, config, path))
        return
    if hasattr(type(child), "__lora_source__") and callable(getattr(child, "_lora_convert", None)):
        child._lora_convert(config, planned, path + ".")
        return
    prefix = path + "."
    for sub_path in [p for p in planned if p.startswith(prefix)]:
        relative = sub_path[len(prefix) :]
        parent_path, _, leaf = relative.rpartition(".")
        holder = child.get_submodule(parent_path) if parent_path else child
        # a shared module may already have been converted under another path
        if holder._modules.get(leaf) is planned[sub_path]:
            setattr(holder, leaf, convert_module(planned[sub_path], config, sub_path))


def lora_layers_of(module: nn.Module, prefix: str) -> Iterator[tuple[str, LoraLayer]]:
    """``(path, layer)`` for every LoRA layer in ``module`` (itself included), paths under ``prefix``."""
    if isinstance(module, LoraLayer):
        yield prefix[:-1], module
        return
    if hasattr(type(module), "__lora_source__") and callable(getattr(module, "_lora_layers", None)):
        yield from module._lora_layers(prefix)
        return
    for name, child in module.named_children():
        yield from lora_layers_of(child, f"{prefix}{name}.")
