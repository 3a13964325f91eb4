"""Which LoRA linears are siblings (read the same input), planned once, at conversion time.

:func:`plan_siblings` looks at each module that owns two or more linear LoRA layers on the fused path,
reads its class's ``forward`` source with libcst (:func:`call_groups`) and records, for each group of
calls ``self.<name>(<var>)`` on one variable, a plan: the first member leads and computes every output,
the others take theirs (:mod:`loragen.ops.siblings`). Nothing here inspects the call stack: the plan
depends only on the module structure and the source, so a forward pass and its recomputation under
``torch.utils.checkpoint`` take the same path.

The conversion entry points call :func:`plan_siblings` when they finish (``get_lora_model`` and
``mark_trainable``, which rewritten and decorated models and ``load_adapter`` go through). LoRA layers
that were never planned, or whose parent's source cannot be read, run on their own: correct, unfused.

A layer takes part when it is a Linear-like LoRA layer whose base forward the fused op replaces: its
class is registered with the PLAIN or TRANSPOSED layout (:mod:`loragen.registry`) and it says
``fused_base``.
"""

from __future__ import annotations

import inspect
import textwrap
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import libcst as cst
import libcst.metadata as md
from torch import nn

from loragen.registry import PLAIN, TRANSPOSED, spec_for_lora_type

__all__ = ["ROLE_ATTR", "Role", "call_groups", "fused_groups", "plan_siblings", "role_of", "transposed"]

Position = tuple[int, int]


# ---- reading a forward's source --------------------------------------------------------------------


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


def _groups_in(source: str) -> tuple[tuple[str, ...], ...]:
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
            cached = _groups_in(inspect.getsource(function))
        except (OSError, TypeError, cst.ParserSyntaxError):
            cached = ()
        _source_cache[function] = cached
    return cached


# ---- the plan ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Role:
    """A layer's place in its group: the leader knows its followers.

    The role is kept on the layer itself (attribute :data:`ROLE_ATTR`, a plain attribute, not a
    submodule), so ``copy.deepcopy`` and pickling carry the plan over to the copy's own layers.
    """

    names: tuple[str, ...]  # the group, named within the parent, leader first
    followers: tuple[nn.Module, ...] = ()


ROLE_ATTR = "_sibling_role"
_lock = threading.Lock()


def transposed(layer: nn.Module) -> bool:
    """Whether ``layer``'s weight is stored (in, out) (transformers' Conv1D), per the registry."""
    spec = spec_for_lora_type(type(layer))
    return spec is not None and spec.layout is TRANSPOSED


def _fusable(module: nn.Module | None) -> bool:
    if module is None or not getattr(type(module), "fused_base", False):
        return False
    spec = spec_for_lora_type(type(module))
    return spec is not None and spec.layout in (PLAIN, TRANSPOSED)


def role_of(layer: nn.Module) -> Role | None:
    """The planned role of ``layer``, or None when it runs on its own."""
    return layer.__dict__.get(ROLE_ATTR)


def _set_role(layer: nn.Module, role: Role | None) -> None:
    if role is None:
        layer.__dict__.pop(ROLE_ATTR, None)
    else:
        layer.__dict__[ROLE_ATTR] = role


def plan_siblings(model: nn.Module) -> None:
    """Plan sibling groups for every module of ``model`` (replacing earlier plans for its layers)."""
    for parent in model.modules():
        children = parent._modules
        members = [child for child in children.values() if child is not None and _fusable(child)]
        with _lock:
            for child in members:
                _set_role(child, None)
        if len(members) < 2:
            continue
        for names in call_groups(type(parent).forward):
            group: list[tuple[str, Any]] = []
            for name in names:
                candidate = children.get(name)
                if candidate is not None and _fusable(candidate):
                    group.append((name, candidate))
            if len(group) < 2:
                continue
            # members must agree on in_features with the leader; others run alone
            leader = group[0][1]
            group = [(name, m) for name, m in group if m.in_features == leader.in_features]
            if len(group) < 2 or any(role_of(m) is not None for _, m in group):
                continue  # a layer leads or follows in one group only
            group_names = tuple(name for name, _ in group)
            with _lock:
                _set_role(leader, Role(group_names, tuple(m for _, m in group[1:])))
                for _, member in group[1:]:
                    _set_role(member, Role(group_names))


def fused_groups(model: nn.Module) -> list[tuple[str, ...]]:
    """The sibling groups planned in ``model``, as qualified module names (leader first).

    Example: ``[("model.layers.0.self_attn.q_proj", "...k_proj", "...v_proj"), ...]``.
    """
    groups = []
    for name, module in model.named_modules():
        role = role_of(module)
        if role is not None and role.followers:
            parent = name.rpartition(".")[0]
            groups.append(tuple(f"{parent}.{n}" if parent else n for n in role.names))
    return groups
