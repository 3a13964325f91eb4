"""Reading a class's ``forward``: which ``self.<name>(<var>)`` calls share one input.

:func:`call_groups` parses a method's source with libcst and returns the groups of attribute calls that
read the same variable, e.g. ``(("q_proj", "k_proj", "v_proj"),)`` for Llama's attention. Sibling fusion
plans with it (:mod:`loragen.sibling_planning`); nothing here knows about LoRA layers.

Why a module of its own, in its own place in the layer order (above :mod:`loragen.layers`, below
:mod:`loragen.convert`): it is source analysis, like :mod:`loragen.source`, but it runs at conversion time,
so ``convert`` (which sits below ``source``) must be able to reach it; and it must stay out of
:mod:`loragen.ops` and :mod:`loragen.layers`, which run tensors and never read source. The import-linter
contract in pyproject.toml holds both: imports only point down, and no module of ``ops``, ``layers`` or
``cuda`` imports libcst.
"""

from __future__ import annotations

import inspect
import textwrap
from collections.abc import Callable
from typing import Any

import libcst as cst
import libcst.metadata as md

__all__ = ["call_groups", "groups_in_source"]

Position = tuple[int, int]


class _CallScanner(cst.CSTVisitor):
    """Collects ``self.<name>(<var>)`` calls (with their block) and the stores to plain names (at the
    end of the statement holding them: ``x = self.q(x)`` reads the old x, the next call sees the new)."""

    METADATA_DEPENDENCIES = (md.PositionProvider, md.ExpressionContextProvider)

    def __init__(self, self_name: str) -> None:
        super().__init__()
        self.self_name = self_name
        self.calls: list[tuple[Position, int, str, str]] = []  # (position, block, attribute, variable)
        self.stores: dict[str, list[Position]] = {}
        self._blocks: list[int] = [0]
        self._block_count = 0
        self._statements: list[Position] = []  # ends of the statements being visited, innermost last

    def _position(self, node: cst.CSTNode, end: bool = False) -> Position:
        pos = self.get_metadata(md.PositionProvider, node)
        point = pos.end if end else pos.start
        return point.line, point.column

    # libcst calls visit_<Node> / leave_<Node>: each suite is a block; each line or compound statement is
    # a statement
    def _enter_block(self) -> None:
        self._block_count += 1
        self._blocks.append(self._block_count)

    def visit_IndentedBlock(self, node: cst.IndentedBlock) -> None:
        self._enter_block()

    def leave_IndentedBlock(self, original_node: cst.IndentedBlock) -> None:
        self._blocks.pop()

    def visit_SimpleStatementSuite(self, node: cst.SimpleStatementSuite) -> None:
        self._enter_block()

    def leave_SimpleStatementSuite(self, original_node: cst.SimpleStatementSuite) -> None:
        self._blocks.pop()

    def visit_SimpleStatementLine(self, node: cst.SimpleStatementLine) -> None:
        self._statements.append(self._position(node, end=True))

    def leave_SimpleStatementLine(self, original_node: cst.SimpleStatementLine) -> None:
        self._statements.pop()

    def visit_BaseCompoundStatement(self, node: cst.BaseCompoundStatement) -> None:
        self._statements.append(self._position(node, end=True))

    def leave_BaseCompoundStatement(self, original_node: cst.BaseCompoundStatement) -> None:
        self._statements.pop()

    def visit_Name(self, node: cst.Name) -> None:
        context = self.get_metadata(md.ExpressionContextProvider, node, None)
        if context in (md.ExpressionContext.STORE, md.ExpressionContext.DEL) and self._statements:
            self.stores.setdefault(node.value, []).append(self._statements[-1])

    def visit_Call(self, node: cst.Call) -> None:
        func = node.func
        if (
            isinstance(func, cst.Attribute)
            and isinstance(func.value, cst.Name)
            and func.value.value == self.self_name
            and len(node.args) == 1
            and node.args[0].keyword is None
            and not node.args[0].star
            and isinstance(node.args[0].value, cst.Name)
        ):
            self.calls.append(
                (self._position(node), self._blocks[-1], func.attr.value, node.args[0].value.value)
            )


def groups_in_source(source: str) -> tuple[tuple[str, ...], ...]:
    """:func:`call_groups` for the source of one function definition (the first statement of
    ``source``, dedented; its first parameter is ``self``). ``()`` when ``source`` holds no function.

    Raises:
        libcst.ParserSyntaxError: ``source`` is not valid Python.
    """
    module = cst.parse_module(textwrap.dedent(source))
    function = module.body[0] if module.body else None
    if not isinstance(function, cst.FunctionDef) or not function.params.params:
        return ()
    scanner = _CallScanner(function.params.params[0].name.value)
    md.MetadataWrapper(cst.Module(body=[function]), unsafe_skip_copy=True).visit(scanner)
    by_variable: dict[tuple[int, str], list[tuple[Position, str]]] = {}
    for position, block, attribute, variable in sorted(scanner.calls):
        by_variable.setdefault((block, variable), []).append((position, attribute))
    groups: list[tuple[str, ...]] = []
    for (_, variable), calls in sorted(by_variable.items(), key=lambda item: item[1][0][0]):
        run: list[str] = []
        previous: Position | None = None
        for position, attribute in calls:
            stores = scanner.stores.get(variable, ())
            if previous is not None and any(previous < store <= position for store in stores):
                if len(run) > 1:
                    groups.append(tuple(run))
                run = []
            if attribute not in run:
                run.append(attribute)
            previous = position
        if len(run) > 1:
            groups.append(tuple(run))
    return tuple(groups)


_source_cache: dict[Callable[..., Any], tuple[tuple[str, ...], ...]] = {}


def call_groups(function: Callable[..., Any]) -> tuple[tuple[str, ...], ...]:
    """Attribute names a method calls on the same input, read from its source with libcst.

    A group is a run of calls ``self.<name>(<var>)`` (one positional argument, a plain variable) on one
    variable within one block of statements, with no assignment to the variable between them; names
    keep source order, the first is the group's leader. ``()`` when the source cannot be read or
    parsed. Cached per function.

    Example: Llama's attention ``forward`` gives ``(("q_proj", "k_proj", "v_proj"),)``.
    """
    cached = _source_cache.get(function)
    if cached is None:
        try:
            cached = groups_in_source(inspect.getsource(function))
        except (OSError, TypeError, cst.ParserSyntaxError):
            cached = ()
        _source_cache[function] = cached
    return cached
