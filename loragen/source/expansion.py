"""The Python that :func:`loragen.lora_convert` generates for a class, rendered from
``templates/decorator.py.j2``; every decision is made here.

A layer field gets an explicit branch unless the decorator's config does not target it, it is nested
deeper than one container, or its classes cannot be imported by name; the runtime path converts the rest.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loragen.config import LoraConfig
from loragen.convert import CONFIG_ATTR
from loragen.registry import LayerSpec, spec_for_qualname
from loragen.source.codegen import CONFIG_NAME, config_literal, is_identifier, py_literal, render
from loragen.source.scan import LORA_CLASS_FOR, ClassScan, LayerField, ScanResult, importable
from loragen.source.targets import Targets

__all__ = ["CONFIG_NAME", "render_expansion"]


class _Imports:
    """The generated code's ``from <module> import <name>`` lines; refuses a name bound twice."""

    def __init__(self) -> None:
        self.names: dict[str, str] = {}  # bound name -> module

    def add(self, module: str, name: str) -> bool:
        bound = self.names.setdefault(name, module)
        return bound == module

    def lines(self, loragen: bool) -> list[str]:
        by_module: dict[str, list[str]] = {}
        for name, module in self.names.items():
            if not module.startswith("<") and module.startswith("loragen") == loragen:
                by_module.setdefault(module, []).append(name)
        return [f"from {m} import {', '.join(sorted(by_module[m]))}" for m in sorted(by_module)]


def _spellings(spec: LayerSpec, imports: _Imports) -> tuple[str, str] | None:
    """How the generated code names the base type and the LoRA class (importing them), or None when
    either cannot be imported by name."""
    try:
        lora_ok = importable(spec.lora_qualname, spec.lora_type())
    except ImportError:
        lora_ok = False
    if not lora_ok or not importable(spec.base_qualname, spec.base_type()):
        return None
    module, _, name = spec.base_qualname.rpartition(".")
    if module == "torch.nn":  # as model code spells it: nn.Linear
        base_ok, base = imports.add("torch", "nn"), f"nn.{name}"
    else:
        base_ok, base = imports.add(module, name), name
    if not (base_ok and imports.add(spec.lora_module, spec.lora_name)):
        return None
    return base, spec.lora_name


def _subclass_spellings(
    module: str, field: LayerField, imports: _Imports, derived: dict[str, str]
) -> tuple[str, str] | None:
    """How the generated code names a layer subclass of the class's own file and its LoRA class
    (``LoraFalconLinear = lora_class_for(FalconLinear)``), or None when the subclass cannot be imported."""
    subclass = field.subclass
    assert subclass is not None  # only called for subclass fields
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


def _table(rows: Sequence[tuple[str, str, str]]) -> list[str]:
    if not rows:
        return []
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)) + "  " + r[-1] for r in rows]


def render_expansion(cls: type, scan: ClassScan, result: ScanResult, config: LoraConfig | None) -> str:
    """The generated Python for ``cls`` (scanned as ``scan`` in ``result``), with ``config`` as the default
    of ``get_lora_model()`` when given."""
    imports = _Imports()
    imports.add("loragen.convert", "mark_trainable")
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
        spec = spec_for_qualname(fields[0].layer)
        container = depth == 1
        spelled: tuple[str, str] | None = None
        if targets is not None and not any(targets.selects(f) for f in fields):
            reason = f"not targeted by {CONFIG_NAME}"
        elif depth > 1:
            reason = "runtime path: nested in more than one container"
        elif (
            spec is None
            or (
                spelled := (
                    _spellings(spec, imports)
                    if fields[0].subclass is None
                    else _subclass_spellings(cls.__module__, fields[0], imports, derived)
                )
            )
            is None
        ):
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
        extra = [
            n
            for n in (
                f"in {f.container}" if f.container else "",
                "conditional" if f.conditional else "",
                notes.get(id(f), ""),
            )
            if n
        ]
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
