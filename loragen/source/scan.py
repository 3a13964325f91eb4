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
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Collection, Mapping

import libcst as cst
import libcst.metadata as md
from libcst.helpers.module import ModuleNameAndPackage

from loragen.errors import ScanError

__all__ = [
    "ClassScan",
    "LayerField",
    "ScanError",
    "ScanResult",
    "ScannedModule",
    "SourceLocation",
    "SubmoduleField",
    "Unresolved",
    "absolute_module",
    "scan_module",
    "scan_source",
]


@dataclasses.dataclass(frozen=True)
class SourceLocation:
    """Where a node starts: ``file:line:column`` (line 1-based, column 0-based)."""

    filename: str
    line: int
    column: int = 0

    def __str__(self) -> str:
        return f"{self.filename}:{self.line}"


@dataclasses.dataclass(frozen=True)
class LayerField:
    """A layer built in ``__init__`` and stored under a module path of its class.

    Attributes:
        owner: qualified name of the class in its module (``"LlamaAttention"``, ``"Outer.Inner"``).
        attribute: the attribute of ``self`` that holds it or its container (``"layers"``).
        path: module path relative to an instance of ``owner``; ``{i}`` stands for a list index and
            ``{key}`` for a dictionary key only known at run time (``"layers.{i}.0"``).
        layer: qualified name of the base layer type (``"torch.nn.Linear"``).
        lora_name: the loragen class that replaces it (``"LoraLinear"``).
        location: position of the constructor call.
        conditional: built under ``if``/``else``, a conditional expression, ``try`` or a loop body.
        container: ``"ModuleList"``, ``"Sequential"`` or ``"ModuleDict"`` when built inside one.
        is_lora: the call already builds the loragen layer (a rewritten file).
    """

    owner: str
    attribute: str
    path: str
    layer: str
    lora_name: str
    location: SourceLocation
    conditional: bool = False
    container: str | None = None
    is_lora: bool = False

    @property
    def pattern(self) -> str:
        """The path with run-time indices and keys as ``*`` (``"layers.*"``)."""
        return re.sub(r"\{(i|key)\}", "*", self.path)

    def describe(self) -> str:
        """One line for summaries: ``layers.* (torch.nn.Linear, model.py:12, in ModuleList)``."""
        notes = [self.layer, str(self.location)]
        if self.container:
            notes.append(f"in {self.container}")
        if self.conditional:
            notes.append("conditional")
        return f"{self.pattern} ({', '.join(notes)})"


@dataclasses.dataclass(frozen=True)
class SubmoduleField:
    """A child module built from a class constructor that is not a layer (``self.mlp = LlamaMLP(config)``).

    ``callee`` is the qualified name of the constructor; ``local_class`` the qualified name of the class
    in the scanned module when it is defined there (used to follow containment inside one file).
    """

    owner: str
    attribute: str
    path: str
    callee: str
    location: SourceLocation
    local_class: str | None = None
    conditional: bool = False


@dataclasses.dataclass(frozen=True)
class Unresolved:
    """Something the scanner saw but cannot resolve statically, with the reason."""

    owner: str | None
    attribute: str | None
    location: SourceLocation
    reason: str

    def __str__(self) -> str:
        return f"{self.location}: {self.reason}"


@dataclasses.dataclass(frozen=True)
class ClassScan:
    """What the scanner found in one class."""

    name: str
    location: SourceLocation
    local_bases: tuple[str, ...]
    base_names: tuple[str, ...]
    fields: tuple[LayerField, ...]
    submodules: tuple[SubmoduleField, ...]
    unresolved: tuple[Unresolved, ...]
    has_init: bool
    output_head: tuple[str, ...] | None = None

    # ``output_head``: what ``get_output_embeddings`` returns when the class defines it: ``("lm_head",)``
    # for ``return self.lm_head``, ``()`` for ``return None`` or anything not a ``self.<path>``; None when
    # the class does not define it.

    def attributes(self) -> list[str]:
        """The attributes that hold layer fields, in source order, each once."""
        return list(dict.fromkeys(f.attribute for f in self.fields))


@dataclasses.dataclass(frozen=True)
class ScanResult:
    """What the scanner found in a module: its classes, and what it could not resolve anywhere."""

    filename: str
    module: str | None
    classes: tuple[ClassScan, ...]
    unresolved: tuple[Unresolved, ...]

    def get(self, name: str) -> ClassScan | None:
        """The class with qualified name ``name``, or None."""
        return next((c for c in self.classes if c.name == name), None)

    @property
    def fields(self) -> list[LayerField]:
        """All layer fields of all classes, in source order."""
        return [f for c in self.classes for f in c.fields]

    def contexts(self, name: str, *, limit: int = 64) -> list[tuple[str, str]]:
        """Where instances of class ``name`` appear, following containment in this file.

        Returns ``(root class, path prefix)`` pairs: the fields of ``name`` sit at ``prefix + field.path``
        inside an instance of the root class. ``(name, "")`` (the class on its own) comes first. For
        ``LlamaAttention`` in ``modeling_llama.py``: ``("LlamaAttention", "")``,
        ``("LlamaDecoderLayer", "self_attn.")``, ``("LlamaModel", "layers.{i}.self_attn.")``,
        ``("LlamaForCausalLM", "model.layers.{i}.self_attn.")``, ... Subclasses defined in the file run
        their base's ``__init__``, so they share its placements.
        """
        subclasses: dict[str, set[str]] = {c.name: set() for c in self.classes}
        for c in self.classes:
            for base in c.local_bases:
                subclasses.setdefault(base, set()).add(c.name)

        def family(cls: str) -> set[str]:  # cls and its local subclasses: they all run cls.__init__
            seen, todo = set(), [cls]
            while todo:
                item = todo.pop()
                if item not in seen:
                    seen.add(item)
                    todo.extend(subclasses.get(item, ()))
            return seen

        result: list[tuple[str, str]] = []

        def walk(cls: str, suffix: str, stack: tuple[str, ...]) -> None:
            members = family(cls)
            for member in [cls, *sorted(members - {cls})]:  # a subclass instance holds the same fields
                if (member, suffix) not in result:
                    result.append((member, suffix))
            if len(result) >= limit or cls in stack:
                return
            for owner in self.classes:
                for sub in owner.submodules:
                    if sub.local_class in members:
                        # the owner's subclasses run the owner's __init__ and hold the child too
                        for holder in [owner.name, *sorted(family(owner.name) - {owner.name})]:
                            walk(holder, f"{sub.path}.{suffix}", (*stack, cls))

        walk(name, "", ())
        return result


@dataclasses.dataclass
class ScannedModule:
    """A parsed module and its scan, kept together for the rewriter.

    ``tree`` is the full syntax tree; ``calls`` maps ``id(call node)`` of every followed layer constructor
    call in it to the fields that call builds, and ``call_nodes`` the id to the node.
    """

    tree: cst.Module
    result: ScanResult
    calls: dict[int, list[LayerField]]
    call_nodes: dict[int, cst.Call]


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
    try:
        tree = cst.parse_module(code)
    except (cst.ParserSyntaxError, SyntaxError, ValueError, RecursionError) as exc:
        raise _syntax_error(code, filename, exc) from None
    # Scope and position analysis of a whole file is libcst's slowest part; only the bodies of
    # ``__init__`` (and ``get_output_embeddings``) need it, so it runs on a skeleton whose other function
    # bodies are stubbed out with the same number of lines. The kept bodies are the very nodes of
    # ``tree``, so positions and names found for them hold for ``tree`` too.
    skeleton, stubs = _skeleton(tree)
    cache = {}
    if package is not None:
        cache[md.FullyQualifiedNameProvider] = ModuleNameAndPackage(module or "__scanned__", package)
    wrapper = md.MetadataWrapper(skeleton, unsafe_skip_copy=True, cache=cache)
    names: Mapping[cst.CSTNode, Collection[md.QualifiedName]] | None = None
    if package is not None:
        try:
            names = wrapper.resolve(md.FullyQualifiedNameProvider)
        except ImportError:  # a relative import reaching above the given package: keep it relative
            names = None
    absolute = names is not None
    if names is None:
        names = wrapper.resolve(md.QualifiedNameProvider)
    from loragen.source.walker import ModuleScanner  # the walker needs this module's data classes

    scanner = ModuleScanner(tree, wrapper, names, absolute, filename, module, package)
    scanner.stubs = stubs
    return scanner.run()


def _syntax_error(code: str, filename: str, exc: Exception) -> ScanError:
    """The clearest report for unparsable code: Python's own message and line when it has one."""
    try:
        compile(code, filename, "exec", dont_inherit=True)
    except SyntaxError as py_exc:
        return ScanError(
            py_exc.msg, filename=filename, line=py_exc.lineno or 1, column=max((py_exc.offset or 1) - 1, 0)
        )
    except (ValueError, RecursionError, MemoryError) as other:  # NUL bytes, absurd nesting
        return ScanError(str(other), filename=filename, line=1)
    if isinstance(exc, cst.ParserSyntaxError):
        return ScanError(
            f"libcst cannot parse this: {exc.message}",
            filename=filename,
            line=exc.raw_line,
            column=exc.raw_column,
        )
    return ScanError(
        f"libcst cannot parse this: {exc}", filename=filename, line=getattr(exc, "lineno", None) or 1
    )


_KEPT_BODIES = ("__init__", "get_output_embeddings")


def _skeleton(tree: cst.Module) -> tuple[cst.Module, dict[int, cst.FunctionDef]]:
    """``tree`` with function bodies stubbed out (same line count), and ``id(function) -> its stub``.

    Kept whole: ``__init__`` and ``get_output_embeddings``, and the bodies of functions that define
    classes (whose methods are stubbed in turn).
    """
    stubs: dict[int, cst.FunctionDef] = {}

    def strip(stmt: cst.CSTNode) -> cst.CSTNode:
        if isinstance(stmt, cst.FunctionDef):
            if stmt.name.value in _KEPT_BODIES or not isinstance(stmt.body, cst.IndentedBlock):
                return stmt
            text = _code(stmt.body)
            if _DEFINES_CLASS.search(text):
                new = stmt.with_changes(body=stmt.body.with_changes(body=[strip(s) for s in stmt.body.body]))
            else:
                lines = text.count("\n")
                body = cst.IndentedBlock(
                    body=[cst.SimpleStatementLine(body=[cst.Expr(cst.Ellipsis())])],
                    header=stmt.body.header,
                    indent=stmt.body.indent,
                    footer=[cst.EmptyLine(indent=False)] * max(lines - 2, 0),
                )
                new = stmt.with_changes(body=body)
            stubs[id(stmt)] = new
            return new
        if isinstance(stmt, cst.ClassDef) and isinstance(stmt.body, cst.IndentedBlock):
            return stmt.with_changes(body=stmt.body.with_changes(body=[strip(s) for s in stmt.body.body]))
        return stmt

    return tree.with_changes(body=[strip(s) for s in tree.body]), stubs


_DEFINES_CLASS = re.compile(r"^[ \t]*class[ \t]", re.MULTILINE)


def _code(node: cst.CSTNode) -> str:
    return cst.Module(body=[]).code_for_node(node)


def absolute_module(package: str, level: int, name: str | None) -> str | None:
    """The absolute module a relative import names (``level`` dots inside ``package``), or None if it
    reaches above the package's top."""
    parts = package.split(".") if package else []
    if level - 1 >= len(parts):
        return None
    base = parts[: len(parts) - (level - 1)]
    return ".".join(base + ([name] if name else []))
