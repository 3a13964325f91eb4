"""Sibling fusion: LoRA linears that read the same input run as one autograd node.

Attention's q, k and v projections read one tensor, and so do an MLP's gate and up projections. Each
LoRA layer on its own reads that input three more times than the frozen layer does: ``h = x A^T`` in
forward, ``dA = gh^T x`` and ``dx += gh A`` in backward. The first and last are rank-r GEMMs whose cost
is one pass over an (N, in) tensor, and the middle one reads x back from memory long after forward;
on a CPU these passes cost about as much as the arithmetic (BENCHMARKS.md, issue 5). A group of k
siblings runs as one node (:class:`_GroupFunction`) that pays each pass once:

forward   H    = x [A_1; ...; A_k]^T                 (N, r_1 + ... + r_k): every h_i in one GEMM
          y_i  = b_i + h_i (s_i B_i^T) + x W_i^T     for each member, as the single-layer op computes it
backward  dB_i = s_i h_i^T g_i,   gh_i = s_i g_i B_i
          dA   = [gh_1 ... gh_k]^T x                 one pass over x, split into dA_1..dA_k
          dx   = [gh_1 ... gh_k] [A_1; ...; A_k] + g_1 W_1 + ... + g_k W_k
                                                     one buffer: the rank-r term, then every base GEMM
                                                     accumulating onto it (beta = 1)

Every output is computed when the first member (the leader) is called; the others find theirs waiting.
Because dx of the whole group is summed inside the node, autograd also skips the k - 1 additions of
(N, in) gradients that separate layers -- frozen ones too -- cost. The math is the single-layer op's,
term for term (only the order of the sums inside a GEMM changes).

**Which layers are siblings** is decided once per layer, statically, from source code: on its first
call a LoRA layer finds the module that called it (walking up the Python stack to the frame whose
``self`` owns the layer) and :func:`call_groups` reads that method's source with :mod:`ast`. Calls
``self.<name>(<var>)`` on the same variable, in the same block of statements, with no assignment to the
variable in between, form a group; the first in source order leads. The decision never changes
afterwards, so a forward pass and its recomputation under ``torch.utils.checkpoint`` always take the
same path. Sources that cannot be read, layers called from outside their parent, and anything
unexpected mean "no group": the layer runs the single-layer op.

**At run time** the grouping is only a plan. The leader computes a member's output only while that
member is eligible (fused, not merged, no active dropout, the input's dtype, plain tensors), and a
member takes it only if it is called with *the very tensor object* the leader saw, at the same version
counter, with the same parameters at the same versions -- otherwise it computes its own output (the
leader's work for it is wasted; no gradient flows through it). Correctness never depends on the plan.

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
from typing import Any, cast

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
    agree to rounding either way. Example: ``with loragen.ops.siblings.use_sibling_fusion(False): ...``.
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
        lora: list[tuple[str, Any]] = [
            (n, children.get(n)) for n in names if _is_lora_linear(children.get(n))
        ]
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
    """Outputs the leader computed for its followers on one input tensor."""

    x: weakref.ReferenceType[Tensor]
    version: int
    # id(layer) -> (its output, the tensors it was computed from with their versions, its scaling)
    outputs: dict[int, tuple[Tensor, tuple[tuple[Tensor | None, int], ...], float]] = field(
        default_factory=dict
    )


_local = threading.local()


def _inputs_of(layer: Any) -> tuple[tuple[Tensor | None, int], ...]:
    return tuple(
        (t, -1 if t is None else t._version) for t in (layer.weight, layer.bias, layer.lora_A, layer.lora_B)
    )


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
        # plain tensors only: a sharded (DTensor) or otherwise wrapped factor runs the layer's own op
        and type(lora_a) in _PLAIN
        and type(layer.weight) in _PLAIN
    )


_PLAIN = (torch.Tensor, nn.Parameter)


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
    members = [layer, *followers]
    spec = tuple((m.scaling, _fan_in_fan_out(m)) for m in members)
    tensors = [t for m in members for t in (m.weight, m.bias, m.lora_A, m.lora_B)]
    outputs = _GroupFunction.apply(x, spec, *tensors)
    handout = _Handout(weakref.ref(x), x._version)
    for follower, y in zip(followers, outputs[1:]):
        handout.outputs[id(follower)] = (y, _inputs_of(follower), follower.scaling)
    _local.handout = handout
    return outputs[0]


def _as_follower(layer: Any, x: Tensor) -> Tensor | None:
    handout: _Handout | None = getattr(_local, "handout", None)
    if handout is None or handout.x() is not x or handout.version != x._version:
        return None
    entry = handout.outputs.pop(id(layer), None)
    if not handout.outputs:
        _local.handout = None
    if entry is None:
        return None
    y, inputs, scaling = entry
    if scaling != layer.scaling or any(
        a is not b or version != (-1 if b is None else b._version)
        for (a, version), b in zip(inputs, (layer.weight, layer.bias, layer.lora_A, layer.lora_B))
    ):
        return None  # changed since the leader ran: compute afresh
    return y


# ---- the group's autograd node ---------------------------------------------------------------------------


class _GroupFunction(torch.autograd.Function):
    """Every member of a group as one node: ``apply(x, spec, W_1, b_1, A_1, B_1, ..., W_k, b_k, A_k, B_k)``
    -> ``(y_1, ..., y_k)`` with ``spec = ((scaling_i, fan_in_fan_out_i), ...)``.

    One node rather than one per layer: backward sums every member's dx into one buffer (each base GEMM
    accumulating onto it with beta = 1), where separate nodes would leave autograd k - 1 additions of an
    (N, in) tensor.
    """

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, spec: tuple[tuple[float, bool], ...], *tensors: Tensor | None
    ) -> tuple[Tensor, ...]:  # type: ignore[override]
        x2 = x.reshape(-1, x.shape[-1])
        weights, biases = cast(list[Tensor], tensors[0::4]), tensors[1::4]
        factors_a, factors_b = cast(list[Tensor], tensors[2::4]), cast(list[Tensor], tensors[3::4])
        ranks = [a.shape[0] for a in factors_a]
        h_all = torch.mm(x2, torch.cat(factors_a).t())  # (N, r_1 + ... + r_k): one pass over x for all
        ys = []
        for (scaling, ffo), w, b, h, lora_b in zip(
            spec, weights, biases, h_all.split(ranks, dim=1), factors_b
        ):
            y = ops.lora_output(x2, w if ffo else w.t(), b, h, lora_b, scaling)
            ys.append(y.view(*x.shape[:-1], -1))
        ctx.spec, ctx.ranks, ctx.x_shape = spec, ranks, x.shape
        ctx.set_materialize_grads(False)  # a follower that never ran gets None: its terms are skipped
        # parameters cost nothing to keep; x2 is a view of x
        ctx.save_for_backward(x2, h_all, *weights, *factors_a, *factors_b)
        return tuple(ys)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x2, h_all, *params = ctx.saved_tensors
        k, rows = len(ctx.spec), x2.shape[0]
        weights, factors_a, factors_b = params[:k], params[k : 2 * k], params[2 * k :]
        need = ctx.needs_input_grad
        need_x = need[0]
        need_w, need_bias, need_a, need_b = need[2::4], need[3::4], need[4::4], need[5::4]
        g2s = [None if g is None else g.reshape(rows, g.shape[-1]) for g in grads]
        hs = h_all.split(ctx.ranks, dim=1)
        grad_w: list[Tensor | None] = [None] * k
        grad_bias: list[Tensor | None] = [None] * k
        grad_a: list[Tensor | None] = [None] * k
        grad_b: list[Tensor | None] = [None] * k
        grad_x = None
        need_gh = need_x or any(need_a)
        ghs: list[Tensor | None] = [None] * k
        for i, ((scaling, ffo), g) in enumerate(zip(ctx.spec, g2s)):
            if g is None:
                continue
            # both rank-r products of g_i back to back, while g_i is in cache
            if need_gh:
                ghs[i] = torch.mm(g, factors_b[i]).mul_(scaling)
            if need_b[i]:
                grad_b[i] = torch.mm(hs[i].t(), g).mul_(scaling).t()  # (out, r); h^T g is the faster layout
            if need_w[i]:
                grad_w[i] = torch.mm(x2.t(), g) if ffo else torch.mm(g.t(), x2)
            if need_bias[i]:
                grad_bias[i] = g.sum(0)
        if need_gh:
            gh_all = torch.cat(
                [
                    torch.zeros(rows, r, dtype=h_all.dtype) if gh is None else gh
                    for gh, r in zip(ghs, ctx.ranks)
                ],
                dim=1,
            )  # (N, R); None: never called
            if any(need_a):
                split = torch.mm(gh_all.t(), x2).split(ctx.ranks)  # one pass over x for every dA
                grad_a = [g if wanted else None for g, wanted in zip(split, need_a)]
            if need_x:
                grad_x = torch.mm(gh_all, torch.cat(factors_a))  # the rank-r term first...
                for (_, ffo), g, w in zip(ctx.spec, g2s, weights):
                    if g is not None:  # ...then every member's base GEMM accumulates onto it
                        grad_x.addmm_(g, w.t() if ffo else w)
                grad_x = grad_x.view(ctx.x_shape)
        per_member = [t for i in range(k) for t in (grad_w[i], grad_bias[i], grad_a[i], grad_b[i])]
        return (grad_x, None, *per_member)
