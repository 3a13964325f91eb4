"""Layer subclasses defined in the scanned file, and the names bound to their LoRA classes.

A class of the file that derives from a registered layer type accepting subclasses (``nn.Linear``), directly
or through other classes of the file, is a layer type too: Falcon's ``class FalconLinear(nn.Linear)``. Its
constructor calls are layer fields like ``nn.Linear(...)`` calls, and its LoRA class is the one
:func:`loragen.layers.lora_class_for` derives from it (its own ``forward`` computes the base output). A
rewritten file binds that class at module level, right after the subclass::

    LoraFalconLinear = lora_class_for(FalconLinear)

and a second scan recognises ``LoraFalconLinear(...)`` calls as already rewritten. Only classes defined at the
module's top level count (a nested class cannot get such a module-level line).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import libcst as cst

from loragen.source.layer_types import LayerType

__all__ = ["LORA_CLASS_FOR", "LORA_CLASS_FOR_NAMES", "derived_lora_name", "layer_subclasses", "lora_bindings"]

LORA_CLASS_FOR = ("loragen.layers", "lora_class_for")  # where a rewritten file imports it from
LORA_CLASS_FOR_NAMES = frozenset(
    {"loragen.layers.lora_class_for", "loragen.layers.derived.lora_class_for", "loragen.lora_class_for"}
)

# (qualified names a node may denote, the class of the file it denotes or None)
Qualnames = Callable[[cst.CSTNode], set[str]]
LocalClass = Callable[[cst.CSTNode], "str | None"]


def derived_lora_name(subclass: str) -> str:
    """The name a rewrite binds the LoRA class of ``subclass`` to: ``"LoraFalconLinear"``."""
    return f"Lora{subclass}"


def layer_subclasses(
    class_defs: Mapping[str, cst.ClassDef],
    layer_names: Mapping[str, tuple[LayerType, bool]],
    qualnames: Qualnames,
    local_class: LocalClass,
) -> dict[str, LayerType]:
    """The classes of ``class_defs`` (the file's top-level classes) that are layer types: class name -> the spec
    of the registered base type they derive from (only specs that accept subclasses; LoRA classes do not count)."""
    found: dict[str, LayerType] = {}
    changed = True
    while changed:  # a subclass of a subclass of the file: repeat until nothing new is found
        changed = False
        for name, node in class_defs.items():
            if name in found:
                continue
            for base in node.bases:
                spec = _base_spec(base.value, found, layer_names, qualnames, local_class)
                if spec is not None:
                    found[name] = spec
                    changed = True
                    break
    return found


def _base_spec(
    node: cst.BaseExpression,
    found: Mapping[str, LayerType],
    layer_names: Mapping[str, tuple[LayerType, bool]],
    qualnames: Qualnames,
    local_class: LocalClass,
) -> LayerType | None:
    local = local_class(node)
    if local is not None:
        return found.get(local)
    for name in sorted(qualnames(node)):
        hit = layer_names.get(name)
        if hit is not None and not hit[1] and hit[0].subclasses:
            return hit[0]
    return None


def lora_bindings(
    body: list[cst.CSTNode], subclasses: Mapping[str, LayerType], qualnames: Qualnames
) -> dict[str, str]:
    """Module-level ``Name = lora_class_for(Subclass)`` lines: bound name -> subclass, for the subclasses of
    ``subclasses`` (a previous rewrite's lines)."""
    found: dict[str, str] = {}
    for stmt in body:
        if not isinstance(stmt, cst.SimpleStatementLine):
            continue
        for small in stmt.body:
            if not (isinstance(small, cst.Assign) and len(small.targets) == 1):
                continue
            target, value = small.targets[0].target, small.value
            if not (isinstance(target, cst.Name) and isinstance(value, cst.Call) and len(value.args) == 1):
                continue
            argument = value.args[0].value
            if (
                qualnames(value.func) & LORA_CLASS_FOR_NAMES
                and isinstance(argument, cst.Name)
                and argument.value in subclasses
            ):
                found[target.value] = argument.value
    return found
