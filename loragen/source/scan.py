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
:mod:`~loragen.source.names` (qualified names, positions), :mod:`~loragen.source.init_walk` and
:mod:`~loragen.source.values` (the ``__init__`` walk), :mod:`~loragen.source.unclaimed` (the calls left
over); the results are the data classes of :mod:`~loragen.source.fields`. This module ties them together.
"""

from __future__ import annotations

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
from loragen.source.init_walk import InitWalker
from loragen.source.names import Resolver
from loragen.source.parse import parse, skeleton
from loragen.source.syntax import nodes_of
from loragen.source.unclaimed import report_unclaimed
from loragen.source.values import Findings

__all__ = [
    "ClassScan",
    "LayerField",
    "ScanError",
    "ScanResult",
    "ScannedModule",
    "SourceLocation",
    "SubmoduleField",
    "Unresolved",
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
    names = Resolver(tree, stripped, stubs, filename, module, package)
    found = Findings()
    classes = [_scan_class(names, found, name, node) for name, node in names.class_defs.items()]
    report_unclaimed(names, found, hidden)
    unresolved = sorted(found.unresolved, key=lambda u: (u.location.line, u.location.column))
    result = ScanResult(filename, module, tuple(classes), tuple(unresolved))
    return ScannedModule(
        tree,
        result,
        found.calls,
        found.call_nodes,
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
