"""Module-level lines a rewrite adds among the file's definitions, each under a comment saying why.

* after a layer subclass of the file, the binding of its LoRA class::

      # Added by loragen rewrite: FalconLinear with a LoRA adapter (its own forward computes the base output).
      LoraFalconLinear = lora_class_for(FalconLinear)

* after the file's last class, the factory that builds the file's own (rewritten) classes for sub-model
  configs (see :mod:`loragen.source.composite`)::

      LoraAutoModel = lora_auto_class(AutoModel, [Gemma3TextModel], LORA_CONFIG)

A line the file has already (a previous rewrite's) is updated in place, so rewriting again changes nothing.
"""

from __future__ import annotations

import dataclasses

import libcst as cst

from loragen.source.syntax import code_of

__all__ = ["ModuleLine", "add_module_lines"]


@dataclasses.dataclass(frozen=True)
class ModuleLine:
    """``name = value`` at module level, after the class ``after`` (None: after the file's last class)."""

    name: str
    value: str
    comment: str
    after: str | None = None


def _assigned_name(stmt: cst.CSTNode) -> str | None:
    if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1:
        small = stmt.body[0]
        if (
            isinstance(small, cst.Assign)
            and len(small.targets) == 1
            and isinstance(small.targets[0].target, cst.Name)
        ):
            return small.targets[0].target.value
    return None


def add_module_lines(tree: cst.Module, lines: list[ModuleLine]) -> cst.Module:
    """``tree`` with ``lines`` added (or updated where the file assigns the name already)."""
    body = list(tree.body)
    for line in lines:
        value = cst.parse_expression(line.value)
        existing = next((i for i, s in enumerate(body) if _assigned_name(s) == line.name), None)
        if existing is not None:
            stmt = body[existing]
            assert isinstance(stmt, cst.SimpleStatementLine) and isinstance(
                stmt.body[0], cst.Assign
            )  # checked
            if code_of(stmt.body[0].value) != line.value:
                body[existing] = stmt.with_changes(body=[stmt.body[0].with_changes(value=value)])
            continue
        classes = {i: s.name.value for i, s in enumerate(body) if isinstance(s, cst.ClassDef)}
        anchor = next(
            (i for i, name in classes.items() if name == line.after), max(classes, default=len(body) - 1)
        )
        statement = cst.parse_statement(f"{line.name} = {line.value}\n")
        leading = [
            cst.EmptyLine(indent=False),
            cst.EmptyLine(indent=False),
            cst.EmptyLine(comment=cst.Comment(line.comment)),
        ]
        body.insert(anchor + 1, statement.with_changes(leading_lines=leading))
    return tree.with_changes(body=body)
