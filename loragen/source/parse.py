"""Parsing for the scanner: source to a libcst tree, with Python's own message for invalid code, and the
*skeleton* of a tree that keeps only the function bodies the scanner reads.

Python's own parser reads the code first: it is fast, gives the clearest message for invalid code, and
stands guard for libcst. libcst's native parser crashes the process (a stack overflow, no exception) on
brackets nested about 2,000 deep, and the visitors over its tree run out of Python's recursion limit
from about 150 levels of nested expressions. Code nested deeper than :data:`MAX_NESTING` levels of
Python's syntax tree is refused before libcst sees it, at the line where the limit is crossed
(transformers' 530 modeling files reach 22 at most).

Positions are libcst's :class:`~libcst.metadata.PositionProvider` ranges, found at a fraction of its cost
(:class:`SourcePositions`). Scope and position analysis of a whole file is libcst's slowest part; only the bodies of ``__init__`` and
``get_output_embeddings`` need it, so it runs on a skeleton whose other function bodies are stubbed out
with the same number of lines. The kept bodies are the very nodes of the full tree, so positions and
names found for them hold for the full tree too.
"""

from __future__ import annotations

import ast
import bisect
import contextlib
import itertools
import re
from collections.abc import Iterator, Mapping

import libcst as cst
from libcst._nodes.internal import CodegenState  # the base of libcst's own position providers
from libcst.metadata import CodePosition, CodeRange

from loragen.errors import ScanError
from loragen.source.syntax import code_of

__all__ = ["KEPT_BODIES", "MAX_NESTING", "SourcePositions", "parse", "skeleton", "without_signatures"]

MAX_NESTING = 100

KEPT_BODIES = ("__init__", "get_output_embeddings")
_DEFINES_CLASS = re.compile(r"^[ \t]*class[ \t]", re.MULTILINE)


def parse(code: str, filename: str) -> cst.Module:
    """Parse ``code`` into a libcst module.

    Raises:
        ScanError: ``code`` is not valid Python, holds a NUL character or text that is not Unicode, or is
            nested deeper than :data:`MAX_NESTING`; names ``filename:line`` and what is wrong (Python's own
            message for invalid code).
    """
    _check_with_python(code, filename)
    try:
        return cst.parse_module(code)
    except (cst.ParserSyntaxError, SyntaxError, ValueError, RecursionError) as exc:
        raise _libcst_error(filename, exc) from None


def _check_with_python(code: str, filename: str) -> None:
    """Python's parser on ``code``, then the nesting depth of its tree; raises :class:`ScanError`."""
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


def _libcst_error(filename: str, exc: Exception) -> ScanError:
    """libcst refusing code that Python's parser accepts (syntax newer than libcst knows)."""
    if isinstance(exc, cst.ParserSyntaxError):
        return ScanError(
            f"libcst cannot parse this: {exc.message}",
            filename=filename,
            line=exc.raw_line,
            column=exc.raw_column,
        )
    if isinstance(exc, RecursionError):
        return ScanError(
            f"nesting deeper than libcst can parse ({MAX_NESTING} at most)", filename=filename, line=1
        )
    return ScanError(
        f"libcst cannot parse this: {exc}", filename=filename, line=getattr(exc, "lineno", None) or 1
    )


def skeleton(
    tree: cst.Module,
) -> tuple[cst.Module, dict[cst.FunctionDef, cst.FunctionDef], dict[cst.FunctionDef, str]]:
    """``tree`` with function bodies stubbed out (same line count), ``function -> its stub``, and
    ``function -> the source of its body`` for the functions whose whole body was stubbed (keyed by the
    nodes of ``tree``, which hash by identity).

    Kept whole: the bodies named in :data:`KEPT_BODIES`, and the bodies of functions that define classes
    (whose methods are stubbed in turn). Nothing the scanner follows lies in a wholly stubbed body, so
    later passes may skip those bodies when their source shows nothing they look for.
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
                # one string literal spanning the body's lines keeps the line count in a single node
                # (blank lines would be three nodes each, for every pass over the skeleton)
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
    """``skeleton`` with the ``stubbed`` functions' parameters, return annotations and decorators dropped.

    What scope analysis needs: the names each scope binds, and the kept bodies. A stubbed function still
    binds its name; its signature binds nothing outside it and holds no field, so analysing it is wasted
    (about a third of a modeling file's skeleton). Names in those signatures then resolve at module level
    (:meth:`loragen.source.names.Resolver.qualnames`). Everything else is ``skeleton``'s own nodes.
    """

    def strip(stmt: cst.BaseStatement) -> cst.BaseStatement:
        if isinstance(stmt, cst.FunctionDef) and stmt in stubbed:
            return stmt.with_changes(params=cst.Parameters(), returns=None, decorators=())
        if isinstance(stmt, (cst.ClassDef, cst.FunctionDef)) and isinstance(stmt.body, cst.IndentedBlock):
            body = [strip(s) for s in stmt.body.body]
            if any(new is not old for new, old in zip(body, stmt.body.body)):
                return stmt.with_changes(body=stmt.body.with_changes(body=body))
        return stmt

    return skeleton.with_changes(body=[strip(s) for s in skeleton.body])


_NEWLINE = re.compile(r"\r\n?|\n")


class _TokenState(CodegenState):
    """Code generation that notes, for every node, the indices of the tokens its range starts and ends at:
    the syntactic range where the node records one, else all the whitespace it owns (as
    :class:`~libcst.metadata.PositionProvider` decides). Line and column are worked out only for the nodes
    asked about, so a pass costs little more than printing the code."""

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
            end = len(self.tokens)
            if start_node is not None:
                start = self.ranges[start_node][0]
            if end_node is not None:
                end = self.ranges[end_node][1]
            self.ranges[node] = (start, end)


class SourcePositions(Mapping[cst.CSTNode, CodeRange]):
    """``node -> CodeRange`` for every node of ``module``: what ``MetadataWrapper(module).resolve(PositionProvider)``
    gives, keyed by the module's own nodes (nothing is copied)."""

    def __init__(self, module: cst.Module) -> None:
        state = _TokenState(module)
        module._codegen(state)
        self._ranges = state.ranges
        self._offsets = list(itertools.accumulate(map(len, state.tokens), initial=0))
        self._line_ends = [match.end() for match in _NEWLINE.finditer("".join(state.tokens))]

    def _position(self, token: int) -> CodePosition:
        offset = self._offsets[token]
        line = bisect.bisect_right(self._line_ends, offset)
        return CodePosition(line + 1, offset - (self._line_ends[line - 1] if line else 0))

    def __getitem__(self, node: cst.CSTNode) -> CodeRange:
        start, end = self._ranges[node]
        return CodeRange(self._position(start), self._position(end))

    def __contains__(self, node: object) -> bool:
        return node in self._ranges

    def __iter__(self) -> Iterator[cst.CSTNode]:
        return iter(self._ranges)

    def __len__(self) -> int:
        return len(self._ranges)
