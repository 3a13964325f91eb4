"""The scanner's last pass: every layer constructor call that no field could be followed to is reported.

After the ``__init__`` walks, a call to a registered layer type that none of them claimed (built in a
helper, at module level, in a method other than ``__init__``) is reported as
:class:`~loragen.source.fields.Unresolved` with ``file:line``, and so are calls whose name may be a layer
type but cannot be resolved: a relative import without the module's package, a star import.
"""

from __future__ import annotations

import libcst as cst

from loragen.source.fields import SourceLocation, Unresolved
from loragen.source.names import Resolver
from loragen.source.syntax import code_of
from loragen.source.values import Findings

__all__ = ["report_unclaimed"]


def report_unclaimed(names: Resolver, found: Findings) -> None:
    """Add an :class:`Unresolved` to ``found`` for every layer call of ``names.tree`` not yet claimed."""
    names.tree.visit(_Finder(names, found))


class _Finder(cst.CSTVisitor):
    def __init__(self, names: Resolver, found: Findings) -> None:
        self.names = names
        self.found = found
        self.scopes: list[str] = []
        self.functions: list[cst.FunctionDef] = []

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self.scopes.append(f"class {node.name.value}")

    def leave_ClassDef(self, original_node: cst.ClassDef) -> None:
        self.scopes.pop()

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.scopes.append(f"{node.name.value}()")
        self.functions.append(node)

    def leave_FunctionDef(self, original_node: cst.FunctionDef) -> None:
        self.scopes.pop()
        self.functions.pop()

    def _where(self, node: cst.CSTNode) -> SourceLocation:
        stubbed = next((f for f in self.functions if id(f) in self.names.stubs), None)
        return self.names.loc(node, stubbed)

    def _report(self, node: cst.CSTNode, reason: str) -> None:
        self.found.unresolved.append(Unresolved(None, None, self._where(node), reason))

    def visit_Call(self, node: cst.Call) -> None:
        if id(node) in self.found.claimed:
            return
        names = self.names
        scope = " in " + ".".join(self.scopes) if self.scopes else " at module level"
        if names.layer(node) is not None:
            self.found.claimed.add(id(node))
            self._report(
                node,
                f"{code_of(node.func)}(...){scope} is not assigned to a module field the scanner can follow; "
                "not converted",
            )
        elif isinstance(node.func, (cst.Name, cst.Attribute)) and any(
            n.startswith(".") and n.rpartition(".")[2] in names.short_layer_names
            for n in names.qualnames(node.func)
        ):
            self._report(
                node,
                f"{code_of(node.func)} comes from a relative import that cannot be resolved without the "
                "module's package (pass package=...); not converted",
            )
        elif (
            names.star_imports
            and isinstance(node.func, cst.Name)
            and node.func.value in names.short_layer_names
            and not names.qualnames(node.func) - {names.module_prefix + node.func.value}
        ):
            self._report(
                node,
                f"{node.func.value}(...){scope} may come from a star import "
                f"(from {', '.join(names.star_imports)} import *); import it by name to convert it",
            )
