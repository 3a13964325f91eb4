"""Find the LoRA-convertible layer fields of classes in Python source, statically, with libcst.

One scanner serves both code generators: :func:`loragen.lora_convert` (which turns a class's fields
into explicit conversion code) and :func:`loragen.rewrite_source` (which swaps the constructor calls
of targeted fields for loragen layers).

A *layer field* is a module attribute built in ``__init__`` by a constructor that the registry
(:mod:`loragen.registry`) knows, matched by *qualified name*: ``nn.Linear``, ``torch.nn.Linear`` and
``from torch.nn import Linear as L`` are the same; a user class that happens to be called ``Linear``
is not. The scanner follows:

* ``self.x = Layer(...)``, ``self.x: T = Layer(...)``, ``self.a, self.b = Layer(...), Layer(...)``;
* locals: ``proj = Layer(...); self.x = proj``;
* containers: ``nn.ModuleList([...])`` and comprehensions (path ``x.{i}``), ``nn.Sequential(...)``
  (``x.0``, ``x.1``, ... or the names of an ``OrderedDict``), ``nn.ModuleDict({...})`` (``x.key``,
  ``x.{key}`` for comprehensions), ``self.x.append(...)`` / ``extend``, ``self.add_module("x", ...)``,
  ``self.x["key"] = ...``, nested to any depth;
* conditionals: both branches of ``if``/``else`` and of ``a if c else b`` (``conditional=True``).

What it cannot resolve it reports as :class:`Unresolved` with ``file:line``, and never guesses: a layer
built by a helper function or a method, a constructor obtained through ``getattr`` or passed in as an
argument, an attribute name computed at run time, a layer constructed where no field can be followed.

The work is split by concern: :mod:`~loragen.source.parse` (parsing, the skeleton),
:mod:`~loragen.source.names` (qualified names), :mod:`~loragen.source.init_walk` (the ``__init__``
walk); the results are the data classes of :mod:`~loragen.source.fields`. This module ties them together,
and makes the last pass (:func:`report_unclaimed`): after the ``__init__`` walks, a call to a registered layer type that none of them claimed (built in a
helper, at module level, in a method other than ``__init__``) is reported as
:class:`~loragen.source.fields.Unresolved` with ``file:line``, and so are calls whose name may be a layer
type but cannot be resolved: a relative import without the module's package, a star import.
"""

from __future__ import annotations

import re

import libcst as cst

from loragen.errors import ScanError
from loragen.source.fields import (
    ClassScan,
    LayerField,
    ScannedModule,
    ScanResult,
    SourceLocation,
    SubmoduleField,
    Unresolved,
)
from loragen.source.init_walk import Findings, InitWalker
from loragen.source.names import Resolver
from loragen.source.parse import parse, skeleton
from loragen.source.syntax import code_of, nodes_of

__all__ = [
    "ClassScan",
    "LayerField",
    "ScanError",
    "ScanResult",
    "ScannedModule",
    "SourceLocation",
    "SubmoduleField",
    "Unresolved",
    "report_unclaimed",
    "scan_module",
    "scan_source",
]


def scan_source(
    code: str, *, filename: str = "<string>", module: str | None = None, package: str | None = None
) -> ScanResult:
    """Scan Python source for the layer fields of every class in it.

    Args:
        code: the module's source.
        filename: used in locations and messages.
        module: the module's dotted name (``"transformers.models.gpt2.modeling_gpt2"``), for names.
        package: the module's package, needed to resolve relative imports (``from ...pytorch_utils
            import Conv1D`` inside ``transformers.models.gpt2``).

    Returns:
        a :class:`ScanResult`.

    Raises:
        ScanError: ``code`` is not valid Python; the message starts with ``filename:line:``.
    """
    return scan_module(code, filename=filename, module=module, package=package).result


def scan_module(
    code: str, *, filename: str = "<string>", module: str | None = None, package: str | None = None
) -> ScannedModule:
    """Parse and scan ``code``; like :func:`scan_source` but also returns the tree and the call nodes.

    Raises:
        ScanError: ``code`` is not valid Python.
    """
    tree = parse(code, filename)
    stripped, stubs, hidden = skeleton(tree)
    names = Resolver(tree, stripped, stubs, filename, module, package, hidden)
    found = Findings()
    classes = [_scan_class(names, found, name, node) for name, node in names.class_defs.items()]
    report_unclaimed(names, found, hidden)
    unresolved = sorted(found.unresolved, key=lambda u: (u.location.line, u.location.column))
    result = ScanResult(filename, module, tuple(classes), tuple(unresolved))
    return ScannedModule(
        tree,
        result,
        found.calls,
        names.positions,
        names.lora_bindings,
        found.factories,
        names.auto_bindings,
        hidden,
    )


def _scan_class(names: Resolver, found: Findings, name: str, node: cst.ClassDef) -> ClassScan:
    walker = InitWalker(names, found, name)
    init = _method(node, "__init__")
    if init is not None:
        walker.scan_init(init)
    return ClassScan(
        name=name,
        location=names.loc(node),
        local_bases=tuple(filter(None, (names.local_class(b.value) for b in node.bases))),
        base_names=tuple(sorted({q for b in node.bases for q in names.qualnames(b.value)})),
        fields=tuple(walker.fields),
        submodules=tuple(walker.submodules),
        unresolved=tuple(walker.unresolved),
        output_head=_output_head(node),
        factories=tuple(walker.factories),
    )


def _method(node: cst.ClassDef, name: str) -> cst.FunctionDef | None:
    return next((s for s in node.body.body if isinstance(s, cst.FunctionDef) and s.name.value == name), None)


def _output_head(node: cst.ClassDef) -> tuple[str, ...] | None:
    """What ``get_output_embeddings`` returns: ``("lm_head",)`` for ``return self.lm_head``, ``()`` for
    anything else, None when the class does not define it."""
    method = _method(node, "get_output_embeddings")
    if method is None:
        return None
    returns = [r for r in nodes_of(method, cst.Return) if isinstance(r, cst.Return)]
    if len(returns) != 1 or returns[0].value is None:
        return ()
    parts: list[str] = []
    value: cst.BaseExpression = returns[0].value
    while isinstance(value, cst.Attribute):
        parts.append(value.attr.value)
        value = value.value
    if isinstance(value, cst.Name) and value.value == "self" and parts:
        return (".".join(reversed(parts)),)
    return ()


def report_unclaimed(names: Resolver, found: Findings, hidden: dict[cst.FunctionDef, str]) -> None:
    """Add an :class:`Unresolved` to ``found`` for every layer call of ``names.tree`` not yet claimed.

    ``hidden`` maps each function to the source of the bodies the scanner did not read: a body whose
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
        self, names: Resolver, found: Findings, hidden: dict[cst.FunctionDef, str], words: re.Pattern[str]
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
        body = self.hidden.get(node)
        return body is None or self.words.search(body) is not None

    def leave_FunctionDef(self, original_node: cst.FunctionDef) -> None:
        self.scopes.pop()
        self.functions.pop()

    def _where(self, node: cst.CSTNode) -> SourceLocation:
        stubbed = next((f for f in self.functions if f in self.names.stubs), None)
        return self.names.loc(node, stubbed)

    def _report(self, node: cst.CSTNode, reason: str) -> None:
        self.found.unresolved.append(Unresolved(None, None, self._where(node), reason))

    def visit_Call(self, node: cst.Call) -> None:
        if node in self.found.claimed:
            return
        names = self.names
        scope = " in " + ".".join(self.scopes) if self.scopes else " at module level"
        if names.layer(node) is not None:
            self.found.claimed.add(node)
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
