"""Sibling fusion: LoRA linears that read the same input share their rank-r down-projections.

Attention's q, k and v projections read one tensor, and so do an MLP's gate and up projections. Each
LoRA layer on its own reads that input three more times than the frozen layer does: ``h = x A^T`` in
forward, ``dA = gh^T x`` and ``dx += gh A`` in backward. The first and last are rank-r GEMMs whose cost
is one pass over an (N, in) tensor, and the middle one reads x back from memory long after forward;
on a CPU these passes, not the arithmetic, are what LoRA costs (BENCHMARKS.md, issue 5). Siblings
stacked into one GEMM pay each pass once for the whole group:

leader    H  = x [A_1; ...; A_k]^T              (N, r_1 + ... + r_k): its own h_1 and its siblings'
          y1 = b1 + h_1 (s_1 B_1^T) + x W_1^T   as :class:`loragen.ops.LoraLinearFunction`
sibling i yi = bi + h_i (s_i B_i^T) + x W_i^T   h_i handed over from the leader, x not saved again
backward  dB_i = s_i h_i^T g_i,  gh_i = s_i g_i B_i          in each layer's own node
          dA   = [gh_1 ... gh_k]^T x            one pass over x, split into dA_1..dA_k
          dx   = [gh_1 ... gh_k] [A_1; ...; A_k] + g_1 W_1       in the leader's node; each sibling
                                                                 adds its base term g_i W_i

The math is the unfused op's, term for term (only the order of the sums inside a GEMM changes).

**Which layers are siblings** is decided once per layer, statically, from source code: on its first
call a LoRA layer finds the module that called it (walking up the Python stack to the frame whose
``self`` owns the layer) and :func:`call_groups` reads that method's source with :mod:`ast`. Calls
``self.<name>(<var>)`` on the same variable, in the same block of statements, with no assignment to the
variable in between, form a group; the first in source order leads. The decision never changes
afterwards, so a forward pass and its recomputation under ``torch.utils.checkpoint`` always take the
same path. Sources that cannot be read, layers called from outside their parent, and anything
unexpected mean "no group": the layer runs the plain fused op.

**At run time** the grouping is only a plan. The leader hands out h_i only while the sibling is
eligible (fused, not merged, no active dropout, same dtype and in_features), and a sibling takes it
only if it is called with *the very tensor object* the leader saw, at the same version counter, with
the same ``lora_A`` -- otherwise it computes its own h (the leader's work for it is wasted, and its
gradient contribution is zero). Correctness never depends on the plan being right.

Not fused: dropout in training (each layer draws its own mask, so the inputs differ), autocast,
``torch.compile``, devices other than the CPU, inputs whose dtype differs from the adapter's, and
everything inside ``use_sibling_fusion(False)`` or ``loragen.ops.use_fused(False)``.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import sys
import textwrap
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import CodeType, FrameType
from typing import Any

import torch
from torch import Tensor, nn

from loragen import ops

__all__ = ["call_groups", "fused_groups", "sibling_fusion_enabled", "use_sibling_fusion"]

# Frames walked up from the layer's forward to find its parent: forward, nn.Module's call wrappers,
# hooks; a parent further away than this is not looked for.
_MAX_FRAME_DEPTH = 12

_enabled = True


def sibling_fusion_enabled() -> bool:
    """Whether LoRA linears that share an input fuse their down-projections (default True)."""
    return _enabled


@contextlib.contextmanager
def use_sibling_fusion(enabled: bool) -> Iterator[None]:
    """Within the block sibling fusion is on (``True``) or off (``False``). Process-wide.

    Turning it off runs every layer through :func:`loragen.ops.lora_linear` on its own; results
    agree to rounding either way. Example: ``with loragen.siblings.use_sibling_fusion(False): ...``.
    """
    global _enabled
    previous, _enabled = _enabled, bool(enabled)
    try:
        yield
    finally:
        _enabled = previous


# ---- static analysis: which calls read the same variable --------------------------------------------


class _CallScanner(ast.NodeVisitor):
    """Collects ``self.<name>(<var>)`` calls and assignments to names, with source positions and the
    statement block each sits in."""

    def __init__(self, self_name: str) -> None:
        self.self_name = self_name
        self.calls: list[tuple[tuple[int, int], int, str, str]] = []  # (position, block id, attr, var)
        self.assignments: dict[str, list[tuple[int, int]]] = {}  # var -> end positions of its stores
        self._block = 0
        self._blocks = 0

    def _visit_block(self, statements: list[ast.stmt]) -> None:
        outer = self._block
        self._blocks += 1
        self._block = self._blocks
        for statement in statements:
            self.visit(statement)
        self._block = outer

    def generic_visit(self, node: ast.AST) -> None:
        for _, value in ast.iter_fields(node):
            if isinstance(value, list) and value and all(isinstance(item, ast.stmt) for item in value):
                self._visit_block(value)  # a body, orelse, finalbody...: a block of its own
            elif isinstance(value, list):
                for item in value:
                    if isinstance(item, ast.AST):
                        self.visit(item)
            elif isinstance(value, ast.AST):
                self.visit(value)

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, (ast.Store, ast.Del)):
            end = (node.end_lineno or node.lineno, node.end_col_offset or node.col_offset)
            self.assignments.setdefault(node.id, []).append(end)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if (
            isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Name)
            and func.value.id == self.self_name
            and len(node.args) == 1
            and not node.keywords
            and isinstance(node.args[0], ast.Name)
        ):
            self.calls.append(((node.lineno, node.col_offset), self._block, func.attr, node.args[0].id))
        self.generic_visit(node)


def _groups_from_source(source: str) -> tuple[tuple[str, ...], ...]:
    tree = ast.parse(textwrap.dedent(source))
    function = tree.body[0] if tree.body else None
    if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)) or not function.args.args:
        return ()
    scanner = _CallScanner(function.args.args[0].arg)
    scanner._visit_block(function.body)
    # a store to a variable counts from the end of the statement holding it (``x = self.q(x)`` reads
    # the old x, and the next call sees the new one)
    statements = sorted(
        (node.lineno, node.col_offset, node.end_lineno or node.lineno, node.end_col_offset or 0)
        for node in ast.walk(function)
        if isinstance(node, ast.stmt) and node is not function
    )
    stores: dict[str, list[tuple[int, int]]] = {}
    for var, positions in scanner.assignments.items():
        for position in positions:
            # the innermost statement containing the store: the last one starting at or before it
            # whose end is at or after it
            holder = position
            for start_line, start_col, end_line, end_col in statements:
                if (start_line, start_col) <= position <= (end_line, end_col):
                    holder = (end_line, end_col)
            stores.setdefault(var, []).append(holder)

    groups: list[tuple[str, ...]] = []
    by_key: dict[tuple[int, str], list[tuple[tuple[int, int], str]]] = {}
    for position, block, attr, var in sorted(scanner.calls):
        by_key.setdefault((block, var), []).append((position, attr))
    for (_, var), calls in sorted(by_key.items(), key=lambda item: item[1][0][0]):
        run: list[str] = []
        previous: tuple[int, int] | None = None
        for position, attr in calls:
            if previous is not None and any(previous < store <= position for store in stores.get(var, ())):
                if len(run) > 1:
                    groups.append(tuple(run))
                run = []
            if attr not in run:
                run.append(attr)
            previous = position
        if len(run) > 1:
            groups.append(tuple(run))
    return tuple(groups)


_source_cache: dict[CodeType, tuple[tuple[str, ...], ...]] = {}


def call_groups(code: CodeType) -> tuple[tuple[str, ...], ...]:
    """Attribute names a method calls on the same input, read from its source.

    A group is a run of calls ``self.<name>(<var>)`` (one positional argument, a plain variable) on one
    variable within one block of statements, with no assignment to the variable between them; names
    keep source order, the first is the group's leader. ``()`` when the source cannot be read or
    parsed. Results are cached per code object.

    Example: Llama's attention gives ``(("q_proj", "k_proj", "v_proj"),)``.
    """
    cached = _source_cache.get(code)
    if cached is None:
        try:
            cached = _groups_from_source(inspect.getsource(code))
        except (OSError, TypeError, SyntaxError, IndentationError):
            cached = ()
        _source_cache[code] = cached
    return cached


# ---- roles: resolved once per layer -------------------------------------------------------------------


@dataclass(frozen=True)
class _Role:
    """A layer's place in its group: the leader knows its followers (weakly: no reference cycles)."""

    names: tuple[str, ...]  # the group, qualified within the parent, leader first
    followers: tuple[weakref.ReferenceType[nn.Module], ...] = ()


_NO_ROLE = _Role(())
_roles: weakref.WeakKeyDictionary[nn.Module, _Role] = weakref.WeakKeyDictionary()
_roles_lock = threading.Lock()


def _fan_in_fan_out(layer: Any) -> bool:
    """True for transformers' Conv1D, whose weight is stored (in, out)."""
    from loragen import layers

    conv1d: Any = vars(layers).get("LoraConv1D")  # exists once transformers' Conv1D was asked for
    return conv1d is not None and isinstance(layer, conv1d)


def _is_lora_linear(module: Any) -> bool:
    from loragen import layers

    return isinstance(module, layers.LoraLinear) or _fan_in_fan_out(module)


def _find_parent(layer: nn.Module, frame: FrameType | None) -> tuple[nn.Module, CodeType] | None:
    """The module whose method called ``layer`` (its ``self`` owns it directly), and that method."""
    for _ in range(_MAX_FRAME_DEPTH):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if (
            isinstance(owner, nn.Module)
            and owner is not layer
            and any(child is layer for child in owner._modules.values())
        ):
            return owner, frame.f_code
        frame = frame.f_back
    return None


def _resolve(layer: nn.Module, frame: FrameType | None) -> _Role:
    found = _find_parent(layer, frame)
    if found is None:
        return _NO_ROLE
    parent, code = found
    children = parent._modules
    for names in call_groups(code):
        lora: list[tuple[str, Any]] = [(n, children.get(n)) for n in names if _is_lora_linear(children.get(n))]
        if not any(m is layer for _, m in lora):
            continue
        # members must agree on in_features with the leader; others are left to run alone
        leader = lora[0][1]
        group = [(name, m) for name, m in lora if m.in_features == leader.in_features]
        if len(group) < 2 or not any(m is layer for _, m in group):
            continue
        group_names = tuple(name for name, _ in group)
        with _roles_lock:
            _roles[leader] = _Role(group_names, tuple(weakref.ref(m) for _, m in group[1:]))
            for _, member in group[1:]:
                _roles[member] = _Role(group_names)
        return _roles[layer]
    return _NO_ROLE


def fused_groups(model: nn.Module) -> list[tuple[str, ...]]:
    """The sibling groups resolved so far in ``model``, as qualified module names (leader first).

    Groups are resolved on each layer's first call, so call this after a forward pass. Example:
    ``[("model.layers.0.self_attn.q_proj", "...k_proj", "...v_proj"), ...]``.
    """
    names = {module: name for name, module in model.named_modules()}
    groups = []
    for module, name in names.items():
        role = _roles.get(module)
        if role is not None and role.followers:
            parent = name.rpartition(".")[0]
            groups.append(tuple(f"{parent}.{n}" if parent else n for n in role.names))
    return groups


# ---- run time ----------------------------------------------------------------------------------------


@dataclass
class _Handout:
    """Down-projections the leader computed for its followers on one input tensor."""

    x: weakref.ReferenceType[Tensor]
    version: int
    h: dict[int, tuple[Tensor, Tensor, int]] = field(default_factory=dict)  # id(layer) -> (h, A, A version)


_local = threading.local()


def _eligible(layer: Any, x: Tensor) -> bool:
    """Whether ``layer`` may take part in a fused group for input ``x`` right now."""
    lora_a = layer.lora_A
    return (
        layer.fused
        and not layer.merged
        and (layer.lora_dropout_p == 0.0 or not layer.training)
        and lora_a.dtype == x.dtype
        and layer.weight.dtype == x.dtype
        and lora_a.device == x.device
    )


def forward(layer: Any, x: Tensor) -> Tensor | None:
    """Run ``layer`` (a LoraLinear or LoraConv1D) as part of its sibling group, or return None to let
    it run :func:`loragen.ops.lora_linear` on its own."""
    if not (_enabled and ops.fused_enabled()) or x.device.type != "cpu":
        return None
    if torch.compiler.is_compiling() or torch.is_autocast_enabled("cpu"):
        return None
    role = _roles.get(layer)
    if role is None:
        role = _resolve(layer, sys._getframe(2))  # 0: here, 1: the layer's forward
        if role is _NO_ROLE:
            with _roles_lock:
                _roles.setdefault(layer, _NO_ROLE)
    if not role.names or not _eligible(layer, x):
        return None
    if not role.followers:
        return _as_follower(layer, x)
    followers = [f for f in (ref() for ref in role.followers) if f is not None and _eligible(f, x)]
    if not followers:
        return None
    return _as_leader(layer, x, followers)


def _as_leader(layer: Any, x: Tensor, followers: list[Any]) -> Tensor:
    ffo = _fan_in_fan_out(layer)
    outputs = _LeaderFunction.apply(
        x, layer.weight, layer.bias, layer.lora_A, layer.lora_B, layer.scaling, ffo,
        *(f.lora_A for f in followers),
    )
    handout = _Handout(weakref.ref(x), x._version)
    for follower, h in zip(followers, outputs[1:]):
        handout.h[id(follower)] = (h, follower.lora_A, follower.lora_A._version)
    _local.handout = handout
    return outputs[0]


def _as_follower(layer: Any, x: Tensor) -> Tensor | None:
    handout: _Handout | None = getattr(_local, "handout", None)
    if handout is None or handout.x() is not x or handout.version != x._version:
        return None
    entry = handout.h.pop(id(layer), None)
    if not handout.h:
        _local.handout = None
    if entry is None:
        return None
    h, lora_a, a_version = entry
    if lora_a is not layer.lora_A or a_version != lora_a._version:
        return None
    ffo = _fan_in_fan_out(layer)
    return _FollowerFunction.apply(x, layer.weight, layer.bias, h, layer.lora_B, layer.scaling, ffo)


# ---- the two autograd nodes ----------------------------------------------------------------------------


def _base_forward(x2: Tensor, weight: Tensor, bias: Tensor | None, h: Tensor, lora_B: Tensor, scaling: float,
                  ffo: bool) -> Tensor:
    """``b + h (s B^T) + x W^T``, the rank-r term first and the base GEMM accumulating onto it."""
    y = torch.addmm(bias, h, lora_B.t(), alpha=scaling) if bias is not None else torch.mm(h * scaling, lora_B.t())
    return y.addmm_(x2, weight if ffo else weight.t())


def _base_grads(ctx: Any, g2: Tensor, x2: Tensor | None, need_w: bool, need_bias: bool) -> tuple[Tensor | None, ...]:
    grad_w = grad_bias = None
    if need_w:
        assert x2 is not None
        grad_w = torch.mm(x2.t(), g2) if ctx.ffo else torch.mm(g2.t(), x2)
    if need_bias and ctx.has_bias:
        grad_bias = g2.sum(0)
    return grad_w, grad_bias


class _LeaderFunction(torch.autograd.Function):
    """The leader's LoRA linear plus its followers' h_i: ``apply(x, W, b, A, B, s, ffo, *A_i)`` ->
    ``(y, *h_i)``."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, lora_A: Tensor, lora_B: Tensor, scaling: float,
        ffo: bool, *follower_As: Tensor,
    ) -> tuple[Tensor, ...]:
        x2 = x.reshape(-1, x.shape[-1])
        ranks = [lora_A.shape[0], *(a.shape[0] for a in follower_As)]
        a_all = torch.cat([lora_A, *follower_As])  # (R, in): R = r_1 + ... + r_k, a few KiB
        h_all = torch.mm(x2, a_all.t())  # (N, R): one pass over x for the whole group
        parts = h_all.split(ranks, dim=1)
        y = _base_forward(x2, weight, bias, parts[0], lora_B, scaling, ffo)
        need_x = ctx.needs_input_grad[0]
        ctx.scaling, ctx.ffo, ctx.ranks, ctx.x_shape, ctx.has_bias = scaling, ffo, ranks, x.shape, bias is not None
        ctx.save_for_backward(x2, weight if need_x else None, a_all, lora_B, parts[0])
        return (y.view(*x.shape[:-1], y.shape[-1]), *parts[1:])

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor, *grad_hs: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x2, weight, a_all, lora_B, h = ctx.saved_tensors
        need = ctx.needs_input_grad
        need_x, need_w, need_bias, need_a, need_b = need[:5]
        need_follower_a = need[7:]
        s, rows = ctx.scaling, x2.shape[0]
        g2 = grad_out.reshape(rows, grad_out.shape[-1])
        grad_b = torch.mm(h.t(), g2).mul_(s).t() if need_b else None
        grad_as: list[Tensor | None] = [None] * len(ctx.ranks)
        grad_x = None
        if need_x or need_a or any(need_follower_a):
            gh = torch.mm(g2, lora_B).mul_(s)
            gh_all = torch.cat([gh, *(g.reshape(rows, -1) for g in grad_hs)], dim=1)  # (N, R)
            if need_a or any(need_follower_a):
                split = torch.mm(gh_all.t(), x2).split(ctx.ranks)  # one pass over x for every dA
                grad_as = [g if wanted else None for g, wanted in zip(split, (need_a, *need_follower_a))]
            if need_x:
                w = weight.t() if ctx.ffo else weight
                grad_x = torch.mm(gh_all, a_all).addmm_(g2, w).view(ctx.x_shape)
        grad_w, grad_bias = _base_grads(ctx, g2, x2, need_w, need_bias)
        return (grad_x, grad_w, grad_bias, grad_as[0], grad_b, None, None, *grad_as[1:])


class _FollowerFunction(torch.autograd.Function):
    """A follower's LoRA linear on the leader's h: ``apply(x, W, b, h, B, s, ffo)`` -> y. Its gradient
    for h flows back to the leader, which adds the rank-r part of dx and computes dA."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, h: Tensor, lora_B: Tensor, scaling: float,
        ffo: bool,
    ) -> Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        y = _base_forward(x2, weight, bias, h, lora_B, scaling, ffo)
        need_x, need_w = ctx.needs_input_grad[:2]
        ctx.scaling, ctx.ffo, ctx.x_shape, ctx.has_bias = scaling, ffo, x.shape, bias is not None
        ctx.save_for_backward(x2 if need_w else None, weight if need_x else None, h, lora_B)
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x2, weight, h, lora_B = ctx.saved_tensors
        need_x, need_w, need_bias, need_h, need_b = ctx.needs_input_grad[:5]
        s = ctx.scaling
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        grad_b = torch.mm(h.t(), g2).mul_(s).t() if need_b else None
        grad_h = torch.mm(g2, lora_B).mul_(s) if need_h else None
        grad_x = torch.mm(g2, weight.t() if ctx.ffo else weight).view(ctx.x_shape) if need_x else None
        grad_w, grad_bias = _base_grads(ctx, g2, x2, need_w, need_bias)
        return grad_x, grad_w, grad_bias, grad_h, grad_b, None, None
