"""The scanner: the LoRA-convertible layer fields of the classes in Python source, found statically with
libcst, for both code generators (:func:`loragen.lora_convert`, :func:`loragen.rewrite_source`).

A *layer field* is a module attribute built in ``__init__`` by a constructor of a registered layer type,
matched by qualified name and followed through locals, containers and conditionals (:class:`InitWalker`).
What cannot be resolved statically is reported as :class:`Unresolved` with ``file:line``, never guessed.
Everything found is keyed by the parsed tree's own nodes (which hash by identity).
"""

from __future__ import annotations

import ast
import bisect
import contextlib
import dataclasses
import difflib
import importlib
import importlib.util
import inspect
import itertools
import re
import sys
import tokenize
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import libcst as cst
import libcst.metadata as md
from libcst._nodes.internal import CodegenState  # the base of libcst's own position providers
from libcst.metadata import CodePosition, CodeRange

from loragen.errors import ScanError

if TYPE_CHECKING:  # pragma: no cover
    from loragen.registry import LayerSpec

__all__ = [
    "BUILTIN",
    "LORA_AUTO_CLASS",
    "LORA_CLASS_FOR",
    "MAX_NESTING",
    "NO_DEFAULT",
    "ClassScan",
    "FactoryCall",
    "LayerField",
    "LayerType",
    "LayerTypes",
    "ScanError",
    "ScanResult",
    "ScannedModule",
    "SourceLocation",
    "SourcePositions",
    "SourceText",
    "SubmoduleField",
    "Unresolved",
    "absolute_module",
    "code_of",
    "definitions",
    "from_spec",
    "importable",
    "layer_types",
    "nested_statements",
    "parse",
    "scan_module",
    "scan_source",
    "skeleton",
    "source_text",
]

_EMPTY = cst.Module(body=[])
_Node = TypeVar("_Node", bound=cst.CSTNode)


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
    value = node.evaluated_value if isinstance(node, cst.SimpleString) else None
    return value if isinstance(value, str) else None


def absolute_module(package: str, level: int, name: str | None) -> str | None:
    """The absolute module a relative import names, or None if it reaches above ``package``'s top."""
    parts = package.split(".") if package else []
    if level - 1 >= len(parts):
        return None
    base = parts[: len(parts) - (level - 1)]
    return ".".join(base + ([name] if name else []))


_COMPOUND = (cst.If, cst.Try, cst.With, cst.For, cst.While, cst.Match)


_CLAUSES = (cst.If, cst.Else, cst.ExceptHandler, cst.Finally, cst.MatchCase)


def nested_statements(stmt: cst.CSTNode) -> list[cst.CSTNode]:
    """The statements nested in an ``if`` / ``try`` / ``with`` / ``for`` / ``while`` / ``match``, all branches."""
    found: list[cst.CSTNode] = []
    for child in stmt.children if isinstance(stmt, (*_COMPOUND, *_CLAUSES)) else ():
        if isinstance(child, cst.SimpleStatementSuite):  # `if x: a = 1`
            found.append(cst.SimpleStatementLine(body=child.body))
        elif isinstance(child, cst.IndentedBlock):
            found += child.body
        elif isinstance(child, _CLAUSES):
            found += nested_statements(child)
    return found


def nodes_of(node: cst.CSTNode, kind: type[_Node]) -> list[_Node]:
    """Every node of type ``kind`` inside ``node`` (itself included), in source order."""
    found: list[_Node] = []

    class Collect(cst.CSTVisitor):
        def on_visit(self, child: cst.CSTNode) -> bool:
            if isinstance(child, kind):
                found.append(child)
            return True

    node.visit(Collect())
    return found


def definitions(body: Sequence[cst.CSTNode], kind: type[_Node], prefix: str = "") -> dict[str, _Node]:
    """The classes or functions (``kind``) defined in ``body``, nested ones too, by qualified name as Python
    spells it: ``"Outer.Inner"``, ``"make.<locals>.Local"``."""
    found: dict[str, _Node] = {}
    for stmt in body:
        if isinstance(stmt, (cst.ClassDef, cst.FunctionDef)):
            name = prefix + stmt.name.value
            if isinstance(stmt, kind):
                found[name] = stmt
            inner = "." if isinstance(stmt, cst.ClassDef) else ".<locals>."
            found.update(definitions(stmt.body.body, kind, name + inner))
        elif isinstance(stmt, _COMPOUND):
            found.update(definitions(nested_statements(stmt), kind, prefix))
    return found


_LINE_END = re.compile(r"\r\n?|\n")
_LINE = re.compile(r"[^\r\n]*(?:\r\n?|\n)|[^\r\n]+\Z")
_TAB_IN_INDENT = re.compile(r"^[ \f]*\t", re.MULTILINE)
_LEADING = re.compile(r"[ \t\f]*")
_NOT_A_STATEMENT = {
    tokenize.NL,
    tokenize.NEWLINE,
    tokenize.COMMENT,
    tokenize.INDENT,
    tokenize.DEDENT,
    tokenize.ENDMARKER,
}
_BEFORE_A_STATEMENT = (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)


@dataclasses.dataclass(frozen=True)
class SourceText:
    """A source file's text as libcst can keep it, and the way back to the file's form.

    ``code`` is the text without a byte order mark, with ``\n`` line ends and, only where libcst needs it
    (tabs mixed into indentation), statements indented by spaces; its lines are the file's one for one.
    """

    code: str
    original: str  # the text without the mark
    bom: bool
    reindented: bool = False
    statements: frozenset[int] = frozenset()  # where reindented: the lines (from 0) that start statements

    def restore(self, rewritten: str) -> str:
        """``rewritten`` (a rewrite of :attr:`code`) with the file's mark, line ends and indentation."""
        mark = "\ufeff" if self.bom else ""
        if rewritten == self.code:
            return mark + self.original
        if self.code == self.original:
            return mark + rewritten
        ends = set(_LINE_END.findall(self.original))
        if not self.reindented and len(ends) == 1:
            return mark + rewritten.replace("\n", ends.pop())
        return mark + self._by_lines(rewritten)

    def _by_lines(self, rewritten: str) -> str:
        original, ours, theirs = (_LINE.findall(text) for text in (self.original, self.code, rewritten))
        first_end = _LINE_END.search(self.original)
        newline = first_end.group() if first_end else "\n"
        columns = {i: len(_indent(ours[i])) for i in self.statements}
        indents = {i: _indent(original[i]) for i in self.statements}

        def indent_for(column: int, following: int) -> str:
            # that of the next sibling, else of the previous one, else the parent's and spaces
            for i in range(following, len(ours)):
                if i in columns and columns[i] <= column:
                    if columns[i] == column:
                        return indents[i]
                    break
            for i in range(following - 1, -1, -1):
                if i in columns and columns[i] <= column:
                    return indents[i] + " " * (column - columns[i])
            return " " * column

        def as_file(line: str, following: int, replaced: int | None) -> str:
            body = line.rstrip("\n")
            end = newline if len(body) < len(line) else ""
            lead = _indent(body)
            if not self.reindented or lead.strip(" ") or not body.strip():
                return body + end
            if replaced is not None and _indent(ours[replaced]) == lead:
                return _indent(original[replaced]) + body[len(lead) :] + end
            return indent_for(len(lead), following) + body[len(lead) :] + end

        lines: list[str] = []
        matcher = difflib.SequenceMatcher(None, ours, theirs, autojunk=False)
        for tag, i1, i2, j1, j2 in matcher.get_opcodes():
            if tag == "equal":
                lines += original[i1:i2]
                continue
            paired = tag == "replace" and i2 - i1 == j2 - j1  # a line changed in place (an edited call)
            for k, line in enumerate(theirs[j1:j2]):
                lines.append(as_file(line, i2, i1 + k if paired else None))
        restored = "".join(lines)
        if self.reindented and not _same_program(restored, rewritten):
            # the file's indentation could not be carried over consistently: the rewrite's own spaces
            return rewritten.replace("\n", newline)
        return restored


def source_text(code: str) -> SourceText:
    """``code`` as the scanner reads it (see :class:`SourceText`); unchanged where Python and libcst agree."""
    bom = code.startswith("\ufeff")
    original = code[1:] if bom else code
    text = _LINE_END.sub("\n", original) if "\r" in original else original
    reindented = _reindented(text)
    if reindented is None:
        return SourceText(text, original, bom)
    return SourceText(reindented[0], original, bom, reindented=True, statements=reindented[1])


def _indent(line: str) -> str:
    return _LEADING.match(line).group()  # type: ignore[union-attr]  # matches every string


def _reindented(code: str) -> tuple[str, frozenset[int]] | None:
    """``code`` with statements and comment lines indented by spaces, and the lines that start statements,
    when tabs are mixed in a way libcst cannot keep; None when there is nothing to do or Python refuses it."""
    if not _TAB_IN_INDENT.search(code):
        return None
    lines = code.split("\n")
    starts: list[tuple[int, int, bool]] = []  # (row, column, is a statement) of statements and comment lines
    try:
        ast.parse(code)
        previous = tokenize.NEWLINE
        for token in tokenize.generate_tokens(iter(line + "\n" for line in lines).__next__):
            row, column = token.start
            if token.type not in _NOT_A_STATEMENT and previous in _BEFORE_A_STATEMENT:
                starts.append((row, column, True))
            elif token.type == tokenize.COMMENT and not lines[row - 1][:column].strip(" \t\f"):
                starts.append((row, column, False))
            if token.type not in (tokenize.NL, tokenize.COMMENT):
                previous = token.type
    except (SyntaxError, tokenize.TokenError, ValueError, RecursionError, MemoryError):
        return None
    if not _libcst_cannot_keep([(lines[row - 1][:column], statement) for row, column, statement in starts]):
        return None
    for row, column, _ in starts:
        lines[row - 1] = " " * _columns(lines[row - 1][:column]) + lines[row - 1][column:]
    return "\n".join(lines), frozenset(row - 1 for row, _, statement in starts if statement)


def _libcst_cannot_keep(indents: list[tuple[str, bool]]) -> bool:
    """Whether a block's indentation (``indents``: statements True, comment lines False) does not extend
    the enclosing block's, or a comment line's is neither a block's nor an extension of one."""
    stack = [""]
    for indent, statement in indents:
        if not statement:
            if indent not in stack and not indent.startswith(stack[-1]):
                return True
            continue
        while len(stack) > 1 and _columns(indent) < _columns(stack[-1]):
            stack.pop()
        if indent != stack[-1]:
            if _columns(indent) <= _columns(stack[-1]) or not indent.startswith(stack[-1]):
                return True
            stack.append(indent)
    return False


def _columns(indent: str) -> int:
    """The column Python's tokenizer gives ``indent`` (tabs to the next multiple of 8, a form feed resets)."""
    column = 0
    for char in indent:
        column = (column // 8 + 1) * 8 if char == "\t" else 0 if char == "\f" else column + 1
    return column


def _same_program(a: str, b: str) -> bool:
    try:
        return ast.dump(ast.parse(a)) == ast.dump(ast.parse(b))
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False


MAX_NESTING = 100

KEPT_BODIES = ("__init__", "get_output_embeddings")
_DEFINES_CLASS = re.compile(r"^[ \t]*class[ \t]", re.MULTILINE)


def parse(code: str, filename: str) -> cst.Module:
    """Parse ``code`` into a libcst module, checked by Python's parser first.

    Raises:
        ScanError: ``code`` is not valid Python (Python's message), holds a NUL character or text that is not
            Unicode, is nested deeper than :data:`MAX_NESTING`, or libcst cannot parse it; names
            ``filename:line``.
    """
    nul = code.find("\0")
    if nul >= 0:  # Python's message for it has no line
        line = code.count("\n", 0, nul) + 1
        raise ScanError("the source holds a NUL character (a binary file?)", filename=filename, line=line)
    try:
        tree = compile(code, filename, "exec", ast.PyCF_ONLY_AST, dont_inherit=True)
    except SyntaxError as exc:
        raise ScanError(
            exc.msg, filename=filename, line=exc.lineno or 1, column=max((exc.offset or 1) - 1, 0)
        ) from None
    except UnicodeError as exc:  # lone surrogates in a str
        line = code.count("\n", 0, getattr(exc, "start", 0)) + 1
        raise ScanError(
            f"the source is not valid Unicode text: {exc}", filename=filename, line=line
        ) from None
    except (RecursionError, MemoryError):  # Python's own limit, deeper than ours
        raise ScanError(f"nesting deeper than {MAX_NESTING}", filename=filename, line=1) from None
    deep = _deeper_than(tree, MAX_NESTING)
    if deep is not None:
        raise ScanError(
            f"nesting deeper than {MAX_NESTING} (brackets, calls or operators inside one another); "
            "loragen reads model files, whose nesting is far shallower",
            filename=filename,
            line=deep,
        )
    try:
        return cst.parse_module(code)
    except cst.ParserSyntaxError as exc:  # syntax newer than libcst knows
        raise ScanError(
            f"libcst cannot parse this: {exc.message}",
            filename=filename,
            line=exc.raw_line,
            column=exc.raw_column,
        ) from None
    except RecursionError:
        raise ScanError(
            f"nesting deeper than libcst can parse ({MAX_NESTING} at most)", filename=filename, line=1
        ) from None
    except (SyntaxError, ValueError) as exc:
        raise ScanError(
            f"libcst cannot parse this: {exc}", filename=filename, line=getattr(exc, "lineno", None) or 1
        ) from None


def _deeper_than(tree: ast.AST, limit: int) -> int | None:
    """The line of the first node found more than ``limit`` levels down in ``tree``, or None."""
    stack = [(tree, 0, 1)]
    while stack:
        node, depth, line = stack.pop()
        line = getattr(node, "lineno", line)  # expression contexts (Load, Store) have no position
        if depth > limit:
            return line
        stack.extend((child, depth + 1, line) for child in ast.iter_child_nodes(node))
    return None


def skeleton(
    tree: cst.Module,
) -> tuple[cst.Module, dict[cst.FunctionDef, cst.FunctionDef], dict[cst.FunctionDef, str]]:
    """``tree`` with function bodies stubbed out (same line count), ``function -> its stub``, and
    ``function -> the source of its body`` for the wholly stubbed ones; kept: the bodies named in
    :data:`KEPT_BODIES` and those of functions that define classes (whose methods are stubbed in turn).
    """
    stubs: dict[cst.FunctionDef, cst.FunctionDef] = {}
    hidden: dict[cst.FunctionDef, str] = {}

    def strip(stmt: cst.BaseStatement) -> cst.BaseStatement:
        if isinstance(stmt, cst.FunctionDef):
            if stmt.name.value in KEPT_BODIES or not isinstance(stmt.body, cst.IndentedBlock):
                return stmt
            text = code_of(stmt.body)
            if _DEFINES_CLASS.search(text):
                new = stmt.with_changes(body=stmt.body.with_changes(body=[strip(s) for s in stmt.body.body]))
            else:
                # one string literal keeps the line count in a single node
                lines = "\n" * max(text.count("\n") - 2, 0)
                stub = cst.SimpleStatementLine(body=[cst.Expr(cst.SimpleString(f'"""{lines}"""'))])
                body = cst.IndentedBlock(body=[stub], header=stmt.body.header, indent=stmt.body.indent)
                new = stmt.with_changes(body=body)
                hidden[stmt] = text
            stubs[stmt] = new
            return new
        if isinstance(stmt, cst.ClassDef) and isinstance(stmt.body, cst.IndentedBlock):
            return stmt.with_changes(body=stmt.body.with_changes(body=[strip(s) for s in stmt.body.body]))
        return stmt

    return tree.with_changes(body=[strip(s) for s in tree.body]), stubs, hidden


def without_signatures(skeleton: cst.Module, stubbed: set[cst.FunctionDef]) -> cst.Module:
    """``skeleton`` without the ``stubbed`` functions' parameters, return annotations and decorators, which
    scope analysis need not see (they hold no field); everything else is ``skeleton``'s own nodes."""

    def strip(stmt: cst.BaseStatement) -> cst.BaseStatement:
        if isinstance(stmt, cst.FunctionDef) and stmt in stubbed:
            return stmt.with_changes(params=cst.Parameters(), returns=None, decorators=())
        if isinstance(stmt, (cst.ClassDef, cst.FunctionDef)) and isinstance(stmt.body, cst.IndentedBlock):
            body = [strip(s) for s in stmt.body.body]
            if any(new is not old for new, old in zip(body, stmt.body.body)):
                return stmt.with_changes(body=stmt.body.with_changes(body=body))
        return stmt

    return skeleton.with_changes(body=[strip(s) for s in skeleton.body])


class _TokenState(CodegenState):
    """Code generation noting each node's range as token indices, as
    :class:`~libcst.metadata.PositionProvider` decides it; lines and columns are worked out on demand."""

    def __init__(self, module: cst.Module) -> None:
        super().__init__(default_indent=module.default_indent, default_newline=module.default_newline)
        self.ranges: dict[cst.CSTNode, tuple[int, int]] = {}
        self.starts: list[int] = []

    def before_codegen(self, node: cst.CSTNode) -> None:
        self.starts.append(len(self.tokens))

    def after_codegen(self, node: cst.CSTNode) -> None:
        start = self.starts.pop()
        self.ranges.setdefault(node, (start, len(self.tokens)))

    @contextlib.contextmanager
    def record_syntactic_position(
        self,
        node: cst.CSTNode,
        *,
        start_node: cst.CSTNode | None = None,
        end_node: cst.CSTNode | None = None,
    ) -> Iterator[None]:
        start = len(self.tokens)
        try:
            yield
        finally:
            start = start if start_node is None else self.ranges[start_node][0]
            end = len(self.tokens) if end_node is None else self.ranges[end_node][1]
            self.ranges[node] = (start, end)


class SourcePositions(Mapping[cst.CSTNode, CodeRange]):
    """``node -> CodeRange`` for every node of ``module``, as libcst's ``PositionProvider`` gives it, keyed by
    the module's own nodes (nothing is copied)."""

    def __init__(self, module: cst.Module) -> None:
        state = _TokenState(module)
        module._codegen(state)
        self._ranges = state.ranges
        self._offsets = list(itertools.accumulate(map(len, state.tokens), initial=0))
        self._line_ends = [match.end() for match in _LINE_END.finditer("".join(state.tokens))]

    def _position(self, token: int) -> CodePosition:
        offset = self._offsets[token]
        line = bisect.bisect_right(self._line_ends, offset)
        return CodePosition(line + 1, offset - (self._line_ends[line - 1] if line else 0))

    def __getitem__(self, node: cst.CSTNode) -> CodeRange:
        start, end = self._ranges[node]
        return CodeRange(self._position(start), self._position(end))

    def __iter__(self) -> Iterator[cst.CSTNode]:
        return iter(self._ranges)

    def __len__(self) -> int:
        return len(self._ranges)


NO_DEFAULT = inspect.Parameter.empty  # a keyword-only parameter without a default
Keywords = tuple[tuple[str, object], ...]


@dataclasses.dataclass(frozen=True)
class LayerType:
    """One layer type as the source tools see it.

    Attributes:
        base_qualname, lora_qualname, aliases, linear, subclasses: as in :class:`~loragen.registry.LayerSpec`.
        protocol / defaults: the keyword-only parameters of the LoRA class's ``from_module`` / constructor
            and their defaults (:data:`NO_DEFAULT` if none); ``takes_any``: the constructor takes ``**kwargs``.
        requires: the packages the LoRA class's module needs.
        refused_overrides: methods of the base type a subclass must keep to be converted (the LoRA class's
            ``refused_overrides``; a convolution's ``forward`` and ``_conv_forward``).
        spec: the registry's spec (None: from :data:`BUILTIN`); its LoRA class is imported by :meth:`signature`.
    """

    base_qualname: str
    lora_qualname: str
    aliases: tuple[str, ...] = ()
    linear: bool = False
    subclasses: bool = False
    protocol: Keywords = ()
    defaults: Keywords = ()
    takes_any: bool = False
    requires: tuple[str, ...] = ()
    refused_overrides: tuple[str, ...] = ()
    spec: LayerSpec | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def qualnames(self) -> tuple[str, ...]:
        """Every qualified name that denotes the base layer type."""
        return (self.base_qualname, *self.aliases)

    @property
    def lora_name(self) -> str:
        """The LoRA class's name (``"LoraLinear"``)."""
        return self.lora_qualname.rpartition(".")[2]

    @property
    def lora_module(self) -> str:
        """The module a rewritten file imports the LoRA class from."""
        return self.lora_qualname.rpartition(".")[0]

    def signature(self) -> tuple[dict[str, object], dict[str, object], bool]:
        """``(protocol, defaults, takes_any)`` (see the attributes).

        Raises:
            ImportError: the LoRA class of a registered type cannot be imported.
        """
        if self.spec is None:
            return dict(self.protocol), dict(self.defaults), self.takes_any
        return _signature(self.spec.lora_type())

    def importable(self) -> bool:
        """Whether a rewritten file can import the LoRA class by its name."""
        if self.spec is None:
            return all(importlib.util.find_spec(package) is not None for package in self.requires)
        try:
            return importable(self.spec.lora_qualname, self.spec.lora_type())
        except ImportError:
            return False


def importable(qualname: str, obj: object) -> bool:
    """Whether ``from <module> import <name>`` of ``qualname`` gives ``obj`` (generated code can name it)."""
    module_name, _, name = qualname.rpartition(".")
    if not module_name or "<locals>" in qualname or obj is None:
        return False
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return False
    return getattr(module, name, None) is obj


def _keyword_only(function: object) -> dict[str, object]:
    try:
        parameters = inspect.signature(function).parameters  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return {}
    return {n: p.default for n, p in parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}


def _signature(lora_class: type) -> tuple[dict[str, object], dict[str, object], bool]:
    try:
        parameters = inspect.signature(lora_class).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    except (TypeError, ValueError):
        takes_any = False
    return _keyword_only(getattr(lora_class, "from_module", None)), _keyword_only(lora_class), takes_any


def from_spec(spec: LayerSpec) -> LayerType:
    """The :class:`LayerType` of a registry spec (its LoRA class is read on first use)."""
    return LayerType(
        spec.base_qualname,
        spec.lora_qualname,
        spec.aliases,
        spec.linear,
        spec.subclasses,
        refused_overrides=tuple(getattr(spec.lora_class, "refused_overrides", ())),
        spec=spec,
    )


_PROTOCOL: Keywords = (
    ("r", 8),
    ("lora_alpha", 8),
    ("lora_dropout", 0.0),
    ("use_rslora", False),
    ("init_lora_weights", True),
    ("use_dora", False),
)
_PLAIN: dict[str, Any] = {"protocol": _PROTOCOL, "defaults": _PROTOCOL}
_LINEAR: dict[str, Any] = {**_PLAIN, "linear": True, "subclasses": True}


# as loragen.layers.registration.register_builtin_types registers them, in its order
BUILTIN: tuple[LayerType, ...] = (
    *(
        LayerType(
            f"torch.nn.{n}",
            f"loragen.layers.Lora{n}",
            (f"torch.nn.modules.{m}.{n}",),
            **_PLAIN,
            subclasses=True,
            refused_overrides=("forward", "_conv_forward") if m == "conv" else (),
        )
        for n, m in (("Conv1d", "conv"), ("Conv2d", "conv"), ("Conv3d", "conv"), ("Embedding", "sparse"))
    ),
    LayerType("torch.nn.Linear", "loragen.layers.LoraLinear", ("torch.nn.modules.linear.Linear",), **_LINEAR),
    LayerType(
        "transformers.pytorch_utils.Conv1D",
        "loragen.layers.LoraConv1D",
        ("transformers.modeling_utils.Conv1D", "transformers.Conv1D"),
        linear=True,
        requires=("transformers",),
        **_PLAIN,
    ),
    *(
        LayerType(
            f"bitsandbytes.nn.{n}",
            f"loragen.layers.bnb.Lora{n}",
            (f"bitsandbytes.nn.modules.{n}",),
            requires=("bitsandbytes",),
            **{**_LINEAR, "defaults": _PROTOCOL[:-1]},  # the quantized layers have no DoRA
        )
        for n in ("Linear4bit", "Linear8bitLt")
    ),
)


class LayerTypes:
    """The layer types of one registry state, looked up by qualified name."""

    def __init__(self, types: Iterable[LayerType]) -> None:
        self.all = tuple(types)
        self._by_qualname = {q: t for t in self.all for q in t.qualnames}

    def for_qualname(self, qualname: str) -> LayerType | None:
        """The type a qualified name (``"torch.nn.Conv2d"``) denotes, or None."""
        return self._by_qualname.get(qualname)


_BUILTIN_TYPES = LayerTypes(BUILTIN)


def layer_types() -> LayerTypes:
    """The layer types to match: the registry's once :mod:`loragen.layers` is imported, else :data:`BUILTIN`
    (without importing torch)."""
    if "loragen.layers" not in sys.modules:
        return _BUILTIN_TYPES
    from loragen.registry import specs

    return LayerTypes(from_spec(spec) for spec in specs())


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
        path: module path relative to an instance of ``owner``; ``{i}`` / ``{key}`` stand for a list index /
            dictionary key known only at run time (``"layers.{i}.0"``).
        layer / lora_name: the base layer type's qualified name / the class that replaces it.
        conditional: built under a branch, a conditional expression or a loop; ``container``: built in one.
        is_lora: the call already builds the loragen layer; ``subclass``: the file's own layer subclass.
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
    subclass: str | None = None

    @property
    def pattern(self) -> str:
        """The path with run-time indices and keys as ``*`` (``"layers.*"``)."""
        return re.sub(r"\{(i|key)\}", "*", self.path)


@dataclasses.dataclass(frozen=True)
class SubmoduleField:
    """A child module built from a class constructor that is not a layer (``self.mlp = LlamaMLP(config)``);
    ``local_class``: the constructor's qualified name in the scanned module when it is defined there."""

    owner: str
    attribute: str
    path: str
    callee: str
    location: SourceLocation
    local_class: str | None = None
    conditional: bool = False


@dataclasses.dataclass(frozen=True)
class FactoryCall:
    """A sub-model built by a transformers auto class: ``self.language_model = AutoModel.from_config(...)``;
    ``lora_name``: the LoRA auto class a rewrite builds it with, ``is_lora``: the call does so already."""

    owner: str
    attribute: str
    path: str
    auto_class: str
    lora_name: str
    location: SourceLocation
    is_lora: bool = False


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
    """What the scanner found in one class: its bases (``local_bases``: those of the same file), what its
    ``__init__`` builds, and ``output_head``: what ``get_output_embeddings`` returns (``("lm_head",)`` for
    ``return self.lm_head``, ``()`` for anything else, None when the class does not define it)."""

    name: str
    location: SourceLocation
    local_bases: tuple[str, ...]
    base_names: tuple[str, ...]
    fields: tuple[LayerField, ...]
    submodules: tuple[SubmoduleField, ...]
    unresolved: tuple[Unresolved, ...]
    output_head: tuple[str, ...] | None = None
    factories: tuple[FactoryCall, ...] = ()
    methods: tuple[str, ...] = ()  # the names of the methods its body defines


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
        """Where instances of class ``name`` appear, following containment in this file: ``(root class,
        path prefix)`` pairs, ``(name, "")`` first, then e.g. ``("LlamaModel", "layers.{i}.self_attn.")``.
        Subclasses defined in the file run their base's ``__init__``, so they share its placements."""
        subclasses: dict[str, set[str]] = {c.name: set() for c in self.classes}
        for c in self.classes:
            for base in c.local_bases:
                subclasses.setdefault(base, set()).add(c.name)

        def family(cls: str) -> list[str]:  # cls, then its local subclasses: they all run cls.__init__
            seen, todo = set(), [cls]
            while todo:
                item = todo.pop()
                if item not in seen:
                    seen.add(item)
                    todo.extend(subclasses.get(item, ()))
            return [cls, *sorted(seen - {cls})]

        result: list[tuple[str, str]] = []

        def walk(cls: str, suffix: str, stack: tuple[str, ...]) -> None:
            members = family(cls)
            for member in members:  # a subclass instance holds the same fields
                if (member, suffix) not in result:
                    result.append((member, suffix))
            if len(result) >= limit or cls in stack:
                return
            for owner in self.classes:
                for sub in owner.submodules:
                    if sub.local_class in members:
                        # the owner's subclasses run the owner's __init__ and hold the child too
                        for holder in family(owner.name):
                            walk(holder, f"{sub.path}.{suffix}", (*stack, cls))

        walk(name, "", ())
        return result


@dataclasses.dataclass
class ScannedModule:
    """A parsed module and its scan for the rewriter, every map keyed by the nodes of ``tree``: ``calls``
    (followed layer calls -> their fields), a previous rewrite's ``lora_bindings`` / ``auto_bindings``
    (name -> subclass / ``AutoX``), ``factories``, and ``hidden`` (see :func:`skeleton`)."""

    tree: cst.Module
    result: ScanResult
    calls: dict[cst.Call, list[LayerField]]
    positions: Mapping[cst.CSTNode, CodeRange]
    lora_bindings: dict[str, str] = dataclasses.field(default_factory=dict)
    factories: dict[cst.Call, FactoryCall] = dataclasses.field(default_factory=dict)
    auto_bindings: dict[str, str] = dataclasses.field(default_factory=dict)
    hidden: dict[cst.FunctionDef, str] = dataclasses.field(default_factory=dict)


CONTAINERS = {
    "ModuleList": ("torch.nn.ModuleList", "torch.nn.modules.container.ModuleList"),
    "Sequential": ("torch.nn.Sequential", "torch.nn.modules.container.Sequential"),
    "ModuleDict": ("torch.nn.ModuleDict", "torch.nn.modules.container.ModuleDict"),
}
AUTO_METHODS = ("from_config",)
LORA_AUTO_CLASS = ("loragen.source.composite", "lora_auto_class")  # where a rewritten file imports it from
_LORA_AUTO_CLASS_NAMES = frozenset({".".join(LORA_AUTO_CLASS), "loragen.lora_auto_class"})
# transformers.AutoModel, transformers.models.auto.modeling_auto.AutoModelForCausalLM, ..auto.AutoModel
_AUTO_CLASS = re.compile(r"^(transformers\.|\.)([\w.]*\.)?Auto[A-Z]\w*$")
LORA_CLASS_FOR = ("loragen.layers", "lora_class_for")  # where a rewritten file imports it from
_LORA_CLASS_FOR_NAMES = frozenset(
    {"loragen.layers.lora_class_for", "loragen.layers.registration.lora_class_for", "loragen.lora_class_for"}
)


class LayerMatch(NamedTuple):
    """What a constructor call builds, whether it is the LoRA class already, and a file's own subclass."""

    spec: LayerType
    is_lora: bool
    subclass: str | None = None
    lora_name: str | None = None


def _assignments(body: Sequence[cst.CSTNode]) -> Iterator[tuple[str, cst.Call, bool]]:
    """``(name, call, alone on its line)`` for every ``name = call(argument, ...)`` in ``body``."""
    for stmt in body:
        if not isinstance(stmt, cst.SimpleStatementLine):
            continue
        for small in stmt.body:
            if isinstance(small, cst.Assign) and len(small.targets) == 1:
                target, value = small.targets[0].target, small.value
                if isinstance(target, cst.Name) and isinstance(value, cst.Call) and value.args:
                    yield target.value, value, len(stmt.body) == 1


class Resolver:
    """Names, definitions and positions of one parsed module: what a name denotes, which layer type a call
    builds, the classes and functions defined, and ``file:line`` positions (also in stubbed bodies).
    ``skeleton`` / ``stubs`` / ``hidden``: as :func:`skeleton` gives them; ``package``: to resolve relative
    imports (None: keep them relative).
    """

    def __init__(
        self,
        tree: cst.Module,
        skeleton: cst.Module,
        stubs: dict[cst.FunctionDef, cst.FunctionDef],
        filename: str,
        module: str | None,
        package: str | None,
        hidden: Mapping[cst.FunctionDef, str] | None = None,
    ) -> None:
        self.stubs = stubs
        self.filename = filename
        self.package = package
        self.module_prefix = (module or "__scanned__") + "."
        self._qualnames: dict[cst.CSTNode, frozenset[str]] = {}
        stubbed = {stubs[function] for function in hidden or ()}
        scoped = without_signatures(skeleton, stubbed)
        wrapper = md.MetadataWrapper(scoped, unsafe_skip_copy=True)  # node identity: see module docstring
        self.scopes: Mapping[cst.CSTNode, md.Scope | None] = wrapper.resolve(md.ScopeProvider)
        self.positions: Mapping[cst.CSTNode, CodeRange] = SourcePositions(skeleton)
        scope = self.scopes[wrapper.module]
        if scope is None:  # libcst gives every module a global scope
            raise ScanError("libcst found no module scope", filename=filename, line=1)
        self.global_scope = scope
        # every qualified name a registered base type or its LoRA class is reachable under
        self.layer_names: dict[str, tuple[LayerType, bool]] = {}
        for spec in layer_types().all:
            self.layer_names.update((qualname, (spec, False)) for qualname in spec.qualnames)
            self.layer_names[spec.lora_qualname] = (spec, True)
            if spec.lora_module.startswith("loragen."):  # ``from loragen import LoraLinear``
                self.layer_names[f"loragen.{spec.lora_name}"] = (spec, True)
        self.short_layer_names = {q.rpartition(".")[2] for q in self.layer_names}
        self.class_defs = definitions(skeleton.body, cst.ClassDef)
        self.function_defs = definitions(tree.body, cst.FunctionDef)  # bodies intact
        top = list(skeleton.body)
        self.layer_subclasses = self._layer_subclasses(
            {s.name.value: s for s in top if isinstance(s, cst.ClassDef)}
        )
        # a previous rewrite's ``LoraFalconLinear = lora_class_for(FalconLinear)`` and ``LoraAutoModel = ...``
        self.lora_bindings = {
            name: call.args[0].value.value
            for name, call, _ in _assignments(top)
            if len(call.args) == 1
            and self.qualnames(call.func) & _LORA_CLASS_FOR_NAMES
            and isinstance(call.args[0].value, cst.Name)
            and call.args[0].value.value in self.layer_subclasses
        }
        self.auto_bindings = {
            name: code_of(call.args[0].value)
            for name, call, alone in _assignments(top)
            if alone and self.qualnames(call.func) & _LORA_AUTO_CLASS_NAMES
        }
        self.star_imports: list[str] = []
        self._index_star_imports(skeleton.body)

    def _layer_subclasses(self, class_defs: Mapping[str, cst.ClassDef]) -> dict[str, LayerType]:
        """Top-level class name -> the registered type accepting subclasses it derives from, maybe indirectly."""
        found: dict[str, LayerType] = {}
        changed = True
        while changed:  # a subclass of a subclass of the file: repeat until nothing new is found
            changed = False
            for name, node in class_defs.items():
                for base in node.bases if name not in found else ():
                    local = self.local(base.value)
                    if local is not None:
                        spec = found.get(local)
                    else:
                        hits = (self.layer_names.get(q) for q in sorted(self.qualnames(base.value)))
                        spec = next((h[0] for h in hits if h and not h[1] and h[0].subclasses), None)
                    if spec is not None:
                        found[name] = spec
                        changed = True
                        break
        return found

    def _index_star_imports(self, body: Sequence[cst.CSTNode]) -> None:
        for stmt in body:
            if isinstance(stmt, _COMPOUND):
                self._index_star_imports(nested_statements(stmt))
            elif isinstance(stmt, cst.SimpleStatementLine):
                for small in stmt.body:
                    if isinstance(small, cst.ImportFrom) and isinstance(small.names, cst.ImportStar):
                        self.star_imports.append(code_of(small.module) if small.module else ".")

    def local(self, node: cst.CSTNode, defs: Mapping[str, object] | None = None) -> str | None:
        """The name in this module of what ``node`` denotes when it is a key of ``defs`` (None: the classes)."""
        defs = self.class_defs if defs is None else defs
        for name in self.qualnames(node):
            if name.startswith(self.module_prefix) and name[len(self.module_prefix) :] in defs:
                return name[len(self.module_prefix) :]
        return None

    def qualnames(self, node: cst.CSTNode) -> set[str]:
        """The absolute qualified names ``node`` may denote (relative ones when no package is known);
        remembered per node, as libcst's scope lookup is the scan's costliest step."""
        found = self._qualnames.get(node)
        if found is None:
            scope = self.scopes.get(node)
            if scope is None:  # in a stubbed body: resolve the dotted name at module level
                dotted = dotted_name(node)
                names = self.global_scope.get_qualified_names_for(dotted) if dotted else ()
            else:
                names = scope.get_qualified_names_for(node)
            found = self._qualnames[node] = frozenset(self._normalise(q) for q in names)
        return set(found)

    def _normalise(self, q: md.QualifiedName) -> str:
        if q.source is md.QualifiedNameSource.LOCAL:
            return self.module_prefix + q.name
        if q.name.startswith(".") and self.package is not None:
            level = len(q.name) - len(q.name.lstrip("."))
            return absolute_module(self.package, level, q.name.lstrip(".")) or q.name
        return q.name

    def layer(self, call: cst.Call) -> LayerMatch | None:
        """The registered layer type ``call`` constructs (and whether it is already the LoRA class)."""
        subclass = self.local(call.func, self.layer_subclasses)
        if subclass is not None:  # its LoRA class: the file's binding, else Lora<subclass>
            bound = min((n for n, sub in self.lora_bindings.items() if sub == subclass), default=None)
            return LayerMatch(self.layer_subclasses[subclass], False, subclass, bound or f"Lora{subclass}")
        bound = self.local(call.func, self.lora_bindings)
        if bound is not None:
            subclass = self.lora_bindings[bound]
            return LayerMatch(self.layer_subclasses[subclass], True, subclass, bound)
        for name in sorted(self.qualnames(call.func)):
            hit = self.layer_names.get(name)
            if hit is not None:
                return LayerMatch(*hit)
        return None

    def auto_factory(self, call: cst.Call) -> tuple[str, str, bool] | None:
        """``(auto class as spelled, the LoRA auto class's name, whether the call names that already)`` for
        a call like ``AutoModel.from_config(...)``, else None."""
        func = call.func
        if not (isinstance(func, cst.Attribute) and func.attr.value in AUTO_METHODS):
            return None
        bound = self.local(func.value, self.auto_bindings)
        if bound is not None:
            return self.auto_bindings[bound], code_of(func.value), True
        if any(_AUTO_CLASS.match(name) for name in self.qualnames(func.value)):
            auto_class = code_of(func.value)
            return auto_class, "Lora" + auto_class.rpartition(".")[2], False
        return None

    def container_kind(self, call: cst.Call) -> str | None:
        """``"ModuleList"``, ``"Sequential"`` or ``"ModuleDict"`` when ``call`` builds one."""
        names = self.qualnames(call.func)
        return next((kind for kind, qualnames in CONTAINERS.items() if names & set(qualnames)), None)

    def loc(self, node: cst.CSTNode, within: cst.FunctionDef | None = None) -> SourceLocation:
        """Position of ``node``; ``within`` is the enclosing function when its body was stubbed."""
        pos = self.positions.get(node)
        if pos is not None:
            return SourceLocation(self.filename, pos.start.line, pos.start.column)
        stub = None if within is None else self.stubs.get(within)
        if within is None or stub is None or stub not in self.positions:
            return SourceLocation(self.filename, 1, 0)
        mini = SourcePositions(cst.Module(body=[within]))
        offset = mini[node].start.line - mini[within].start.line
        return SourceLocation(
            self.filename, self.positions[stub].start.line + offset, mini[node].start.column
        )


_SETATTR = "builtins.setattr"
_ORDERED_DICT = ("collections.OrderedDict", "builtins.dict", "typing.OrderedDict")
_GETATTR = "builtins.getattr"


@dataclasses.dataclass
class Site:
    """Where a value ends up: the attribute of self and the path below it."""

    attribute: str
    path: str
    conditional: bool
    container: str | None = None

    def child(self, part: str, container: str) -> Site:
        """The site of item ``part`` (``"0"``, ``"{i}"``, ``"key"``) of the ``container`` built here."""
        return dataclasses.replace(self, path=f"{self.path}.{part}", container=container)


@dataclasses.dataclass
class Findings:
    """What the walks of all classes of a module found, by call node; ``claimed``: the calls accounted for."""

    calls: dict[cst.Call, list[LayerField]] = dataclasses.field(default_factory=dict)
    claimed: set[cst.Call] = dataclasses.field(default_factory=set)
    unresolved: list[Unresolved] = dataclasses.field(default_factory=list)
    factories: dict[cst.Call, FactoryCall] = dataclasses.field(default_factory=dict)


class InitWalker:
    """Walks one class's ``__init__`` (branches and loops marked conditional), following each value stored on
    ``self`` through conditional expressions, locals and containers to the constructor calls it holds."""

    def __init__(self, names: Resolver, found: Findings, owner: str) -> None:
        self.names = names
        self.found = found
        self.owner = owner
        self.fields: list[LayerField] = []
        self.submodules: list[SubmoduleField] = []
        self.unresolved: list[Unresolved] = []
        self.factories: list[FactoryCall] = []
        self.self_name = "self"
        self.params: set[str] = set()
        self.locals: dict[str, list[tuple[cst.BaseExpression, bool]]] = {}
        self.following: set[str] = set()

    def report(self, node: cst.CSTNode, attribute: str | None, reason: str) -> None:
        item = Unresolved(self.owner, attribute, self.names.loc(node), reason)
        self.unresolved.append(item)
        self.found.unresolved.append(item)

    def opaque(self, node: cst.BaseExpression, site: Site, what: str) -> None:
        """Report the ``what`` of a container built from ``node`` when it builds layers."""
        if self.builds_layer(node):
            reason = f"the {what} of {site.attribute} come from {code_of(node)!s:.60}; cannot follow them statically"
            self.report(node, site.attribute, reason)

    def is_self_attr(self, node: cst.BaseExpression) -> str | None:
        """``"x"`` for ``self.x``, None for anything else."""
        if isinstance(node, cst.Attribute) and dotted_name(node.value) == self.self_name:
            return node.attr.value
        return None

    def value(self, node: cst.BaseExpression, site: Site) -> None:
        if isinstance(node, cst.IfExp):
            conditional_site = dataclasses.replace(site, conditional=True)
            self.value(node.body, conditional_site)
            self.value(node.orelse, conditional_site)
            return
        if isinstance(node, cst.Name) and node.value in self.locals and node.value not in self.following:
            self.following.add(node.value)
            bindings = self.locals[node.value]
            for bound, branch in bindings:
                conditional = site.conditional or branch or len(bindings) > 1
                self.value(bound, dataclasses.replace(site, conditional=conditional))
            self.following.discard(node.value)
            return
        if not isinstance(node, cst.Call):
            return
        hit = self.names.layer(node)
        if hit is not None:
            field = LayerField(
                owner=self.owner,
                attribute=site.attribute,
                path=site.path,
                layer=hit.spec.base_qualname,
                lora_name=hit.lora_name or hit.spec.lora_name,
                location=self.names.loc(node),
                conditional=site.conditional,
                container=site.container,
                is_lora=hit.is_lora,
                subclass=hit.subclass,
            )
            self.fields.append(field)
            self.found.claimed.add(node)
            self.found.calls.setdefault(node, []).append(field)
            return
        kind = self.names.container_kind(node)
        if kind is not None:
            self.container(node, kind, site)
            return
        self.other_call(node, site)

    def container(self, call: cst.Call, kind: str, site: Site) -> None:
        positional = [a for a in call.args if a.keyword is None]
        if kind != "Sequential":
            if positional and kind == "ModuleList":
                self.items(positional[0].value, site.child("{i}", kind))
            elif positional:
                self.mapping(positional[0].value, site, kind)
            return
        # Sequential(a, b, c) or Sequential(OrderedDict([...]))
        if len(positional) == 1 and isinstance(positional[0].value, (cst.Call, cst.Dict, cst.DictComp)):
            inner = positional[0].value
            if not isinstance(inner, cst.Call) or self.names.qualnames(inner.func) & set(_ORDERED_DICT):
                self.mapping(inner, site, kind)
                return
        for index, arg in enumerate(positional):
            if arg.star:
                self.items(arg.value, site.child("{i}", kind))
                if any(self.builds_layer(a.value) for a in positional[index + 1 :]):
                    self.report(
                        arg.value,
                        site.attribute,
                        f"items after *{code_of(arg.value)} in {kind} have indices known only at run time",
                    )
                return
            self.value(arg.value, site.child(str(index), kind))

    def items(self, node: cst.BaseExpression, site: Site) -> None:
        base = site.path.removesuffix(".{i}")
        if isinstance(node, (cst.List, cst.Tuple)):
            starred = any(isinstance(e, cst.StarredElement) for e in node.elements)  # run-time indices
            for index, element in enumerate(node.elements):
                item = site if starred else dataclasses.replace(site, path=f"{base}.{index}")
                self.value(element.value, item)
        elif isinstance(node, (cst.ListComp, cst.GeneratorExp)):
            self.value(node.elt, site)
        elif isinstance(node, cst.BinaryOperation) and isinstance(node.operator, cst.Add):
            self.items(node.left, site)
            self.items(node.right, site)
        else:
            self.opaque(node, site, "items")

    def mapping(self, node: cst.BaseExpression, site: Site, kind: str) -> None:
        def at(key: cst.BaseExpression | None) -> Site:  # a key known statically, else ``{key}``
            text = None if key is None else string_value(key)
            return site.child("{key}" if text is None else text, kind)

        if isinstance(node, cst.Call) and node.args:
            keywords = [a.keyword.value for a in node.args if a.keyword is not None]
            if len(keywords) == len(node.args):  # dict(a=..., b=...)
                for keyword, a in zip(keywords, node.args):
                    self.value(a.value, site.child(keyword, kind))
                return
            node = node.args[0].value
        if isinstance(node, cst.Dict):
            for element in node.elements:
                if isinstance(element, cst.DictElement):
                    self.value(element.value, at(element.key))
        elif isinstance(node, cst.DictComp):
            self.value(node.value, at(None))
        elif isinstance(node, (cst.List, cst.Tuple, cst.ListComp, cst.GeneratorExp)):
            literal = isinstance(node, (cst.List, cst.Tuple))
            pairs = (
                [e.value for e in node.elements] if isinstance(node, (cst.List, cst.Tuple)) else [node.elt]
            )
            for pair in pairs:
                if isinstance(pair, (cst.Tuple, cst.List)) and len(pair.elements) == 2:
                    self.value(pair.elements[1].value, at(pair.elements[0].value if literal else None))
        else:
            self.opaque(node, site, "entries")

    def other_call(self, call: cst.Call, site: Site) -> None:
        func = call.func
        factory = self.names.auto_factory(call)
        if factory is not None:  # self.language_model = AutoModel.from_config(config.text_config)
            auto_class, lora_name, is_lora = factory
            where = self.names.loc(call)
            item = FactoryCall(self.owner, site.attribute, site.path, auto_class, lora_name, where, is_lora)
            self.factories.append(item)
            self.found.factories[call] = item
            return
        local = self.names.local(func)
        if local is not None:
            self._submodule(site, call, local, local, site.conditional)
            return
        if isinstance(func, cst.Name) and func.value in self.locals and func.value not in self.params:
            classes = self.alias_classes(func.value)
            if classes is not None:  # attention_class = CrossAttention if cross else SelfAttention
                for local in classes:
                    self._submodule(site, call, local, local, True)
                return
        reason = None
        if isinstance(func, cst.Call) and _GETATTR in self.names.qualnames(func.func):
            reason = f"{code_of(func)}(...); a constructor looked up with getattr is known only at run time"
        elif isinstance(func, cst.Name) and (func.value in self.params or func.value in self.locals):
            what = "a parameter of __init__" if func.value in self.params else "a local variable"
            reason = f"{func.value}(...), {what}; its type is known only at run time"
        elif self.calls_layer_helper(call):
            reason = (
                f"the helper {code_of(func)}(...), which constructs layers; "
                "move the constructor into __init__ to convert it"
            )
        if reason is not None:
            self.report(call, site.attribute, f"{site.path} is built by {reason}")
            return
        names = self.names.qualnames(func)
        external = sorted(n for n in names if not n.startswith(self.names.module_prefix))
        if external and external[0].rpartition(".")[2][:1].isupper():  # a class, by its name
            self._submodule(site, call, external[0], None, site.conditional)

    def _submodule(
        self, site: Site, call: cst.Call, callee: str, local: str | None, conditional: bool
    ) -> None:
        where = self.names.loc(call)
        self.submodules.append(
            SubmoduleField(self.owner, site.attribute, site.path, callee, where, local, conditional)
        )

    def alias_classes(self, name: str) -> list[str] | None:
        """The local classes local ``name`` may hold (``cls = A if c else B``), or None if not only those."""
        found: list[str] = []
        todo = [value for value, _ in self.locals[name]]
        while todo:
            node = todo.pop(0)
            if isinstance(node, cst.IfExp):
                todo.extend((node.body, node.orelse))
                continue
            local = self.names.local(node) if isinstance(node, (cst.Name, cst.Attribute)) else None
            if local is None:
                return None
            found.append(local)
        return list(dict.fromkeys(found)) or None

    def calls_layer_helper(self, node: cst.BaseExpression) -> bool:
        if not isinstance(node, cst.Call):
            return False
        helper = self.names.local(node.func, self.names.function_defs)
        method = self.is_self_attr(node.func)
        if method is not None and f"{self.owner}.{method}" in self.names.function_defs:
            helper = f"{self.owner}.{method}"
        return helper is not None and self.builds_layer(self.names.function_defs[helper])

    def builds_layer(self, node: cst.CSTNode) -> bool:
        return any(self.names.layer(c) is not None for c in nodes_of(node, cst.Call))

    def scan_init(self, init: cst.FunctionDef) -> None:
        params = init.params
        positional = [*params.posonly_params, *params.params]
        if positional:
            self.self_name = positional[0].name.value
        stars = [star for star in (params.star_arg, params.star_kwarg) if isinstance(star, cst.Param)]
        self.params = {p.name.value for p in [*positional, *params.kwonly_params, *stars]} - {self.self_name}
        self.statements(init.body.body, conditional=False)

    def statements(self, body: Sequence[cst.CSTNode], conditional: bool) -> None:
        for stmt in body:  # a nested def/class's layer calls are reported as unclaimed
            if isinstance(stmt, (cst.If, cst.Try, cst.For, cst.While, cst.Match)):
                self.statements(nested_statements(stmt), True)
            elif isinstance(stmt, cst.With):
                self.statements(nested_statements(stmt), conditional)
            for small in stmt.body if isinstance(stmt, cst.SimpleStatementLine) else ():
                if isinstance(small, cst.Assign):
                    for target in small.targets:
                        self.assign(target.target, small.value, conditional)
                elif isinstance(small, cst.AnnAssign) and small.value is not None:
                    self.assign(small.target, small.value, conditional)
                elif isinstance(small, cst.Expr) and isinstance(small.value, cst.Call):
                    self.call_statement(small.value, conditional)

    def assign(self, target: cst.BaseExpression, value: cst.BaseExpression, conditional: bool) -> None:
        attribute = self.is_self_attr(target)
        if attribute is not None:
            self.value(value, Site(attribute, attribute, conditional))
            return
        if isinstance(target, cst.Name):
            self.locals.setdefault(target.value, []).append((value, conditional))
            return
        if isinstance(target, (cst.Tuple, cst.List)):
            elements = [e.value for e in target.elements]
            if isinstance(value, (cst.Tuple, cst.List)) and len(value.elements) == len(elements):
                for sub_target, element in zip(elements, value.elements):
                    self.assign(sub_target, element.value, conditional)
            elif any(self.is_self_attr(e) for e in elements) and (
                self.builds_layer(value) or self.calls_layer_helper(value)
            ):
                self.report(value, None, f"tuple assignment from {code_of(value)!s:.60} cannot be followed")
            return
        if isinstance(target, cst.Subscript):
            attribute = self.is_self_attr(target.value)
            if attribute is not None and len(target.slice) == 1:
                index = target.slice[0].slice
                key = None
                if isinstance(index, cst.Index):
                    key = string_value(index.value)
                    if key is None and isinstance(index.value, cst.Integer):
                        key = index.value.value
                site = Site(attribute, attribute, conditional)
                self.value(value, site.child("{key}" if key is None else key, "ModuleDict"))

    def call_statement(self, call: cst.Call, conditional: bool) -> None:
        func = call.func
        # self.x.append(...), self.x.extend([...])
        if isinstance(func, cst.Attribute) and func.attr.value in ("append", "extend", "insert"):
            attribute = self.is_self_attr(func.value)
            if attribute is not None and call.args:
                site = Site(attribute, attribute, conditional).child("{i}", "ModuleList")
                arg = call.args[-1].value
                if func.attr.value == "extend":
                    self.items(arg, site)
                else:
                    self.value(arg, site)
            return
        # self.add_module("x", ...), self.register_module("x", ...), setattr(self, "x", ...)
        args = [a.value for a in call.args]
        me = self.self_name
        if dotted_name(func) in (f"{me}.add_module", f"{me}.register_module") and len(args) == 2:
            name_arg, value_arg = args
        elif _SETATTR in self.names.qualnames(func) and len(args) == 3 and dotted_name(args[0]) == me:
            _, name_arg, value_arg = args
        else:
            return
        name = string_value(name_arg)
        if name is None:
            self.report(
                call,
                None,
                f"{code_of(func)}() with an attribute name computed at run time ({code_of(name_arg)}); "
                "its module path cannot be known statically",
            )
            return
        self.value(value_arg, Site(name, name, conditional))


def scan_source(
    code: str, *, filename: str = "<string>", module: str | None = None, package: str | None = None
) -> ScanResult:
    """Scan Python source for the layer fields of every class in it; ``module``: its dotted name,
    ``package``: its package, needed to resolve relative imports.

    Raises:
        ScanError: ``code`` is not valid Python; the message starts with ``filename:line:``.
    """
    return scan_module(code, filename=filename, module=module, package=package).result


def scan_module(
    code: str, *, filename: str = "<string>", module: str | None = None, package: str | None = None
) -> ScannedModule:
    """Like :func:`scan_source`, but also returns the tree and the call nodes.

    Raises:
        ScanError: ``code`` is not valid Python.
    """
    tree = parse(code, filename)
    stripped, stubs, hidden = skeleton(tree)
    names = Resolver(tree, stripped, stubs, filename, module, package, hidden)
    found = Findings()
    classes = [_scan_class(names, found, name, node) for name, node in names.class_defs.items()]
    tree.visit(_Unclaimed(names, found, hidden))
    unresolved = sorted(found.unresolved, key=lambda u: (u.location.line, u.location.column))
    result = ScanResult(filename, module, tuple(classes), tuple(unresolved))
    bindings = (names.lora_bindings, found.factories, names.auto_bindings)
    return ScannedModule(tree, result, found.calls, names.positions, *bindings, hidden)


def _scan_class(names: Resolver, found: Findings, name: str, node: cst.ClassDef) -> ClassScan:
    walker = InitWalker(names, found, name)
    init = _method(node, "__init__")
    if init is not None:
        walker.scan_init(init)
    return ClassScan(
        name=name,
        location=names.loc(node),
        local_bases=tuple(filter(None, (names.local(b.value) for b in node.bases))),
        base_names=tuple(sorted({q for b in node.bases for q in names.qualnames(b.value)})),
        fields=tuple(walker.fields),
        submodules=tuple(walker.submodules),
        unresolved=tuple(walker.unresolved),
        output_head=_output_head(node),
        factories=tuple(walker.factories),
        methods=tuple(s.name.value for s in node.body.body if isinstance(s, cst.FunctionDef)),
    )


def _method(node: cst.ClassDef, name: str) -> cst.FunctionDef | None:
    return next((s for s in node.body.body if isinstance(s, cst.FunctionDef) and s.name.value == name), None)


def _output_head(node: cst.ClassDef) -> tuple[str, ...] | None:
    method = _method(node, "get_output_embeddings")
    if method is None:
        return None
    returns = nodes_of(method, cst.Return)
    if len(returns) != 1 or returns[0].value is None:
        return ()
    dotted = dotted_name(returns[0].value) or ""
    return (dotted.removeprefix("self."),) if dotted.startswith("self.") else ()


class _Unclaimed(cst.CSTVisitor):
    """The last pass: an :class:`Unresolved` for every layer call no ``__init__`` walk claimed, and for calls
    that may build a layer but cannot be resolved (relative or star imports); a ``hidden`` body naming no
    layer type under any name the module binds one to is skipped unread."""

    def __init__(self, names: Resolver, found: Findings, hidden: dict[cst.FunctionDef, str]) -> None:
        self.names = names
        self.found = found
        self.hidden = hidden
        self.scopes: list[str] = []
        self.functions: list[cst.FunctionDef] = []
        words = set(names.short_layer_names)
        words.update(name.rpartition(".")[2] for name in (*names.layer_subclasses, *names.lora_bindings))
        for assignment in names.global_scope.assignments:
            qualified = names.global_scope.get_qualified_names_for(assignment.name)
            if any(q.name.rpartition(".")[2] in names.short_layer_names for q in qualified):
                words.add(assignment.name)
        self.words = re.compile(r"\b(?:" + "|".join(sorted(map(re.escape, words))) + r")\b")

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

    def _report(self, node: cst.CSTNode, reason: str) -> None:
        stubbed = next((f for f in self.functions if f in self.names.stubs), None)
        self.found.unresolved.append(Unresolved(None, None, self.names.loc(node, stubbed), reason))

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
