"""Small libcst helpers shared by the scanner and the rewriter: a node's code, dotted names, string
literals, the statements nested in compound statements, and relative imports made absolute."""

from __future__ import annotations

from collections.abc import Sequence

import libcst as cst

__all__ = [
    "absolute_module",
    "class_definitions",
    "calls_in",
    "code_of",
    "dotted_name",
    "nested_statements",
    "nodes_of",
    "string_value",
]

_EMPTY = cst.Module(body=[])


def code_of(node: cst.CSTNode) -> str:
    """The source code of ``node`` (as libcst prints it, formatting kept)."""
    return _EMPTY.code_for_node(node)


def dotted_name(node: cst.CSTNode) -> str | None:
    """``"a.b.c"`` for a ``Name`` / ``Attribute`` chain, None for anything else."""
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        base = dotted_name(node.value)
        return None if base is None else f"{base}.{node.attr.value}"
    return None


def string_value(node: cst.BaseExpression) -> str | None:
    """The value of a plain string literal (``"x"``, ``'x'``), None for anything else."""
    if isinstance(node, cst.SimpleString):
        value = node.evaluated_value
        return value if isinstance(value, str) else None
    return None


def absolute_module(package: str, level: int, name: str | None) -> str | None:
    """The absolute module a relative import names (``level`` dots inside ``package``), or None if it
    reaches above the package's top."""
    parts = package.split(".") if package else []
    if level - 1 >= len(parts):
        return None
    base = parts[: len(parts) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _block_statements(block: cst.BaseSuite) -> list[cst.CSTNode]:
    if isinstance(block, cst.SimpleStatementSuite):  # `if x: a = 1`
        return [cst.SimpleStatementLine(body=block.body)]
    return list(block.body)


def nested_statements(stmt: cst.CSTNode) -> list[cst.CSTNode]:
    """The statements nested in an ``if`` / ``try`` / ``with`` / ``for`` / ``while`` / ``match``, all branches."""
    blocks: list[cst.BaseSuite] = []
    if isinstance(stmt, cst.If):
        blocks.append(stmt.body)
        orelse: cst.If | cst.Else | None = stmt.orelse
        while orelse is not None:
            blocks.append(orelse.body)
            orelse = orelse.orelse if isinstance(orelse, cst.If) else None
    elif isinstance(stmt, cst.Try):
        blocks.append(stmt.body)
        blocks.extend(h.body for h in stmt.handlers)
        if stmt.orelse is not None:
            blocks.append(stmt.orelse.body)
        if stmt.finalbody is not None:
            blocks.append(stmt.finalbody.body)
    elif isinstance(stmt, (cst.For, cst.While)):
        blocks.append(stmt.body)
        if stmt.orelse is not None:
            blocks.append(stmt.orelse.body)
    elif isinstance(stmt, cst.With):
        blocks.append(stmt.body)
    elif isinstance(stmt, cst.Match):
        blocks.extend(case.body for case in stmt.cases)
    return [s for block in blocks for s in _block_statements(block)]


def nodes_of(node: cst.CSTNode, kind: type[cst.CSTNode]) -> list[cst.CSTNode]:
    """Every node of type ``kind`` inside ``node`` (itself included), in source order."""
    found: list[cst.CSTNode] = []

    class Collect(cst.CSTVisitor):
        def on_visit(self, child: cst.CSTNode) -> bool:
            if isinstance(child, kind):
                found.append(child)
            return True

    node.visit(Collect())
    return found


def calls_in(node: cst.CSTNode) -> Sequence[cst.Call]:
    """Every call inside ``node``, in source order."""
    return [call for call in nodes_of(node, cst.Call) if isinstance(call, cst.Call)]


def class_definitions(body: Sequence[cst.CSTNode], prefix: str = "") -> dict[str, cst.ClassDef]:
    """The classes defined in ``body`` (and nested in them, in functions, in compound statements) by
    qualified name, as Python spells it: ``"Outer.Inner"``, ``"make.<locals>.Local"``."""
    found: dict[str, cst.ClassDef] = {}
    for stmt in body:
        if isinstance(stmt, cst.ClassDef):
            found[prefix + stmt.name.value] = stmt
            found.update(class_definitions(stmt.body.body, f"{prefix}{stmt.name.value}."))
        elif isinstance(stmt, cst.FunctionDef):
            found.update(class_definitions(stmt.body.body, f"{prefix}{stmt.name.value}.<locals>."))
        elif isinstance(stmt, (cst.If, cst.Try, cst.With, cst.For, cst.While, cst.Match)):
            found.update(class_definitions(nested_statements(stmt), prefix))
    return found
