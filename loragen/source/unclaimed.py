"""The scanner's last pass: every layer constructor call that no field could be followed to is reported.

After the ``__init__`` walks, a call to a registered layer type that none of them claimed (built in a
helper, at module level, in a method other than ``__init__``) is reported as
:class:`~loragen.source.fields.Unresolved` with ``file:line``, and so are calls whose name may be a layer
type but cannot be resolved: a relative import without the module's package, a star import.
"""

from __future__ import annotations

import re

import libcst as cst

from loragen.source.fields import SourceLocation, Unresolved
from loragen.source.names import Resolver
from loragen.source.syntax import code_of
from loragen.source.values import Findings

__all__ = ["report_unclaimed"]


def report_unclaimed(names: Resolver, found: Findings, hidden: dict[int, str]) -> None:
    """Add an :class:`Unresolved` to ``found`` for every layer call of ``names.tree`` not yet claimed.

    ``hidden`` maps ``id(function)`` to the source of the bodies the scanner did not read: a body whose
    source names no layer type (under any name the module binds it to) is skipped unread.
    """
    names.tree.visit(_Finder(names, found, hidden, _layer_words(names)))


def _layer_words(names: Resolver) -> re.Pattern[str]:
    """The words a call that this pass reports must contain: the registered types' own names, the module's
    layer subclasses and LoRA bindings, and the names it imports a layer type under (``Linear as L``).

    In a stubbed body names resolve at module level (:meth:`Resolver.qualnames`), so these are all."""
    words = set(names.short_layer_names)
    words.update(name.rpartition(".")[2] for name in (*names.layer_subclasses, *names.lora_bindings))
    for assignment in names.global_scope.assignments:
        bound = assignment.name
        qualified = names.global_scope.get_qualified_names_for(bound)
        if any(q.name.rpartition(".")[2] in names.short_layer_names for q in qualified):
            words.add(bound)
    return re.compile(r"\b(?:" + "|".join(sorted(map(re.escape, words))) + r")\b")


class _Finder(cst.CSTVisitor):
    def __init__(
        self, names: Resolver, found: Findings, hidden: dict[int, str], words: re.Pattern[str]
    ) -> None:
        self.names = names
        self.found = found
        self.hidden = hidden
        self.words = words
        self.scopes: list[str] = []
        self.functions: list[cst.FunctionDef] = []

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self.scopes.append(f"class {node.name.value}")

    def leave_ClassDef(self, original_node: cst.ClassDef) -> None:
        self.scopes.pop()

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        self.scopes.append(f"{node.name.value}()")
        self.functions.append(node)
        body = self.hidden.get(id(node))
        return body is None or self.words.search(body) is not None

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
