"""Parsing for the scanner: source to a libcst tree, with Python's own message for invalid code, and the
*skeleton* of a tree that keeps only the function bodies the scanner reads.

Scope and position analysis of a whole file is libcst's slowest part; only the bodies of ``__init__`` and
``get_output_embeddings`` need it, so it runs on a skeleton whose other function bodies are stubbed out
with the same number of lines. The kept bodies are the very nodes of the full tree, so positions and
names found for them hold for the full tree too.
"""

from __future__ import annotations

import re

import libcst as cst

from loragen.errors import ScanError
from loragen.source.syntax import code_of

__all__ = ["KEPT_BODIES", "parse", "skeleton"]

KEPT_BODIES = ("__init__", "get_output_embeddings")
_DEFINES_CLASS = re.compile(r"^[ \t]*class[ \t]", re.MULTILINE)


def parse(code: str, filename: str) -> cst.Module:
    """Parse ``code`` into a libcst module.

    Raises:
        ScanError: ``code`` is not valid Python; names ``filename:line`` and Python's own message.
    """
    try:
        return cst.parse_module(code)
    except (cst.ParserSyntaxError, SyntaxError, ValueError, RecursionError) as exc:
        raise _syntax_error(code, filename, exc) from None


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


def skeleton(tree: cst.Module) -> tuple[cst.Module, dict[int, cst.FunctionDef]]:
    """``tree`` with function bodies stubbed out (same line count), and ``id(function) -> its stub``.

    Kept whole: the bodies named in :data:`KEPT_BODIES`, and the bodies of functions that define classes
    (whose methods are stubbed in turn).
    """
    stubs: dict[int, cst.FunctionDef] = {}

    def strip(stmt: cst.BaseStatement) -> cst.BaseStatement:
        if isinstance(stmt, cst.FunctionDef):
            if stmt.name.value in KEPT_BODIES or not isinstance(stmt.body, cst.IndentedBlock):
                return stmt
            text = code_of(stmt.body)
            if _DEFINES_CLASS.search(text):
                new = stmt.with_changes(body=stmt.body.with_changes(body=[strip(s) for s in stmt.body.body]))
            else:
                body = cst.IndentedBlock(
                    body=[cst.SimpleStatementLine(body=[cst.Expr(cst.Ellipsis())])],
                    header=stmt.body.header,
                    indent=stmt.body.indent,
                    footer=[cst.EmptyLine(indent=False)] * max(text.count("\n") - 2, 0),
                )
                new = stmt.with_changes(body=body)
            stubs[id(stmt)] = new
            return new
        if isinstance(stmt, cst.ClassDef) and isinstance(stmt.body, cst.IndentedBlock):
            return stmt.with_changes(body=stmt.body.with_changes(body=[strip(s) for s in stmt.body.body]))
        return stmt

    return tree.with_changes(body=[strip(s) for s in tree.body]), stubs
