"""Sibling fusion at run time: LoRA linears that read the same input run as one autograd node.

Attention's q, k and v projections read one tensor, and so do an MLP's gate and up projections. Each
LoRA layer on its own reads that input three more times than the frozen layer does: ``h = x A^T`` in
forward, ``dA = gh^T x`` and ``dx += gh A`` in backward. A group of k siblings runs as one node
(:class:`_GroupFunction` on the CPU; on CUDA tensors see below) that pays each pass once:

forward   H    = x [A_1; ...; A_k]^T                 (N, r_1 + ... + r_k): every h_i in one GEMM
          y_i  = b_i + h_i (s_i B_i^T) + x W_i^T     for each member, as the single-layer op computes it
backward  dB_i = s_i h_i^T g_i,   gh_i = s_i g_i B_i
          dA   = [gh_1 ... gh_k]^T x                 one pass over x, split into dA_1..dA_k
          dx   = gh_k A_k + g_k W_k + ... + gh_1 A_1 + g_1 W_1
                                                     one buffer, every product accumulating onto it
                                                     (beta = 1), in the order peft's layers are summed

Every output is computed when the first member (the leader) is called; the others find theirs waiting.
Because dx of the whole group is summed inside the node, autograd also skips the k - 1 additions of
(N, in) gradients that separate layers -- frozen ones too -- cost. The math is the single-layer op's,
term for term, and so is the rounding: H splits into exactly the h_i each layer computes, and dx is
summed as autograd sums separate layers (the member created last first, each one's rank-r term before
its base term). One rank-R GEMM for the rank-r terms of dx would read gh and A once less, but it adds
every member's rank-r term before any base term: where one member's two terms nearly cancel, that order
rounds the others' away, 4e-4 from the per-layer op's gradient where this order stays within 1e-7
(tests/ops/test_siblings.py). With several threads, BLAS may split the row sum of dA = gh^T x
differently for R columns than for r: fp32 rounding, no worse than the per-layer op's.

**Which layers are siblings** is planned at conversion time (:mod:`loragen.sibling_planning`, which reads
the parent's ``forward`` source); this module keeps only what a plan is (:class:`Role`, kept on each
member, :func:`role_of`) and runs it.

**At run time** the plan is only a plan. The leader computes a member's output only while that member is
eligible (fused, not merged, no active dropout, the input's dtype, plain tensors), and a member takes it
only if it is called with *the very tensor object* the leader saw, at the same version counter, with the
same parameters at the same versions, with gradients (and inference mode) as they were for the leader --
otherwise it computes its own output (the leader's work for it is
wasted; no gradient flows through it). Correctness never depends on the plan. Outputs are fresh tensors
(not views of one another), so callers may modify them in place. Each member's tensors and settings are
read once per call (:func:`_member`): the leader hands them to the group's op and records them with its
hand-out, and a follower checks its own against them (:func:`_as_follower`).

Not fused: dropout in training (each layer draws its own mask, so the inputs differ), the CPU's autocast,
``torch.compile``, devices other than the CPU,
on the CPU inputs whose dtype differs from the adapter's, and everything with
:data:`loragen.switches.sibling_fusion` or :data:`loragen.switches.fused` off.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import Tensor, nn

from loragen import switches
from loragen.ops.fused_linear import input_layout, lora_output, shaped_like_input
from loragen.registry import TRANSPOSED, spec_for_lora_type

__all__ = ["ROLE_ATTR", "Role", "forward", "role_of", "set_role", "transposed"]


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


def role_of(layer: nn.Module) -> Role | None:
    """The planned role of ``layer``, or None when it runs on its own."""
    return layer.__dict__.get(ROLE_ATTR)


def set_role(layer: nn.Module, role: Role | None) -> None:
    """Record ``role`` as ``layer``'s place in a sibling group (None: it runs on its own)."""
    if role is None:
        layer.__dict__.pop(ROLE_ATTR, None)
    else:
        layer.__dict__[ROLE_ATTR] = role


def transposed(layer: nn.Module) -> bool:
    """Whether ``layer``'s weight is stored (in, out) (transformers' Conv1D), per the registry."""
    spec = spec_for_lora_type(type(layer))
    return spec is not None and spec.layout is TRANSPOSED


# ---- run time ----------------------------------------------------------------------------------------


# a member as the group ops take it: (weight, bias, lora_A, lora_B, scaling, fan_in_fan_out)
_Member = tuple[Tensor, "Tensor | None", Tensor, Tensor, float, bool]
# runs a group: (x, members) -> every member's output, or None when the group cannot run as one
_Runner = Callable[[Tensor, list[_Member]], "tuple[Tensor, ...] | None"]


@dataclass
class _Handout:
    """Outputs the leader computed for its followers on one input tensor."""

    x: weakref.ReferenceType[Tensor]
    version: int
    # gradients on, inference mode, autocast on x's device: a follower running otherwise computes its own
    modes: tuple[bool, bool, bool]
    # id(layer) -> (its output, the member it was computed from, the versions of the member's tensors)
    outputs: dict[int, tuple[Tensor, _Member, tuple[int, int, int, int]]] = field(default_factory=dict)


_local = threading.local()


def _modes(x: Tensor) -> tuple[bool, bool, bool]:
    return (
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
        torch.is_autocast_enabled(x.device.type),
    )


def _versions(member: _Member) -> tuple[int, int, int, int]:
    weight, bias, lora_a, lora_b = member[:4]
    return (weight._version, -1 if bias is None else bias._version, lora_a._version, lora_b._version)


def _member(layer: Any, dtype: torch.dtype | None, device: int, own_dtype: bool) -> _Member | None:
    """``layer``'s tensors and settings when it may take part in a group on an input of ``dtype`` (None:
    any, the group casts) on ``device`` (:meth:`torch.Tensor.get_device`) right now, else None;
    ``own_dtype``: its factors must be in ``dtype`` too. Read once per call: the leader passes them to
    the group op and records them in the hand-out, where each follower finds its own
    (:func:`_as_follower`)."""
    # not merged, its own first adapter active as plain LoRA (not DoRA), no mixed batch: the first
    # adapter's factors, the layer's own lora_A and lora_B, are what the layer computes with
    if not layer.fused or not layer.runs_plain_first_adapter():
        return None
    adapter = layer.running_adapter()
    if adapter.lora_dropout_p != 0.0 and layer.training:
        return None
    weight, lora_a = layer.weight, layer.lora_A
    if (
        (dtype is not None and weight.dtype != dtype)
        or (own_dtype and lora_a.dtype != dtype)
        or lora_a.get_device() != device
        # plain tensors only: a sharded (DTensor) or otherwise wrapped factor runs the layer's own op
        or type(lora_a) not in _PLAIN
        or type(weight) not in _PLAIN
    ):
        return None
    return (weight, layer.bias, lora_a, layer.lora_B, adapter.scaling, transposed(layer))


_PLAIN = (torch.Tensor, nn.Parameter)


def _cpu_group(x: Tensor, members: list[_Member]) -> tuple[Tensor, ...]:
    spec = tuple((m[4], m[5]) for m in members)
    outputs: tuple[Tensor, ...] = _GroupFunction.apply(x, spec, *(t for m in members for t in m[:4]))
    return outputs


def _runner(x: Tensor) -> _Runner | None:
    """How a group runs on ``x``: the CPU node, or None (each layer alone)."""
    if x.is_cpu:
        return None if torch.is_autocast_enabled("cpu") else _cpu_group
    return None


def forward(layer: Any, x: Tensor) -> Tensor | None:
    """Run ``layer`` (a LoraLinear or LoraConv1D) as part of its sibling group, or return None to let
    it run :func:`loragen.ops.lora_linear` on its own."""
    if not (switches.sibling_fusion.get() and switches.fused.get()) or torch.compiler.is_compiling():
        return None
    role = role_of(layer)
    if role is None:
        return None
    if not role.followers:
        return _as_follower(layer, x)
    run = _runner(x)
    if run is None:
        return None
    # the factors in x's dtype (as the CPU op computes)
    dtype: torch.dtype | None = x.dtype
    device, own_dtype = x.get_device(), run is _cpu_group
    own = _member(layer, dtype, device, own_dtype)
    if own is None:
        return None
    followers, members = [], [own]
    for follower in role.followers:
        member = _member(follower, dtype, device, own_dtype)
        if member is not None:
            followers.append(follower)
            members.append(member)
    if not followers:
        return None
    outputs = run(x, members)
    if outputs is None:
        return None  # no hand-out: every member computes its own
    handout = _Handout(weakref.ref(x), x._version, _modes(x))
    for follower, member, y in zip(followers, members[1:], outputs[1:]):
        handout.outputs[id(follower)] = (y, member, _versions(member))
    _local.handout = handout
    return outputs[0]


def _as_follower(layer: Any, x: Tensor) -> Tensor | None:
    """The output the leader computed for ``layer`` on ``x``, if there is one and ``layer`` would compute
    the same now: still fused, unmerged and running its first adapter as plain LoRA without active dropout,
    with the very tensors the leader read, at the same versions, and the same scaling. (Their dtypes and
    devices, which the leader checked, come with the tensors' identity.)"""
    handout: _Handout | None = getattr(_local, "handout", None)
    if handout is None or handout.x() is not x or handout.version != x._version or handout.modes != _modes(x):
        return None
    entry = handout.outputs.pop(id(layer), None)
    if not handout.outputs:
        _local.handout = None
    if entry is None or not layer.fused or not layer.runs_plain_first_adapter():
        return None
    y, member, versions = entry
    adapter = layer.running_adapter()
    if (
        (adapter.lora_dropout_p != 0.0 and layer.training)
        or member[0] is not layer.weight
        or member[1] is not layer.bias
        or member[2] is not layer.lora_A
        or member[3] is not layer.lora_B
        or member[4] != adapter.scaling
        or versions != _versions(member)
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
    ) -> tuple[Tensor, ...]:
        x2 = x.reshape(-1, x.shape[-1])
        weights, biases = cast(list[Tensor], tensors[0::4]), tensors[1::4]
        factors_a, factors_b = cast(list[Tensor], tensors[2::4]), cast(list[Tensor], tensors[3::4])
        ranks = [a.shape[0] for a in factors_a]
        h_all = torch.mm(x2, torch.cat(factors_a).t())  # (N, r_1 + ... + r_k): one pass over x for all
        ys = []
        for (scaling, ffo), w, b, h, lora_b in zip(
            spec, weights, biases, h_all.split(ranks, dim=1), factors_b
        ):
            w_t = w if ffo else w.t()  # (in, out)
            y = torch.empty(
                *x.shape[:-1], w_t.shape[1], dtype=x.dtype, device=x.device
            )  # final shape: no view escapes
            lora_output(x2, w_t, b, h, lora_b, scaling, out=y.view(-1, w_t.shape[1]))
            ys.append(y)
        ctx.spec, ctx.ranks, ctx.x_shape, ctx.x_layout = spec, ranks, x.shape, input_layout(x)
        ctx.set_materialize_grads(False)  # a follower that never ran gets None: its terms are skipped
        # parameters cost nothing to keep; x2 is a view of x
        ctx.save_for_backward(x2, h_all, *weights, *factors_a, *factors_b)
        return tuple(ys)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
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
                # a member whose output reached no loss gets no gradient, as a layer run alone
                grad_a = [
                    g if wanted and gh is not None else None for g, wanted, gh in zip(split, need_a, ghs)
                ]
        if need_x:
            grad_x = _grad_input(ctx.spec, g2s, ghs, weights, factors_a)
            grad_x = shaped_like_input(
                grad_x, ctx.x_shape, ctx.x_layout
            )  # x's layout (function.input_layout)
        per_member = [t for i in range(k) for t in (grad_w[i], grad_bias[i], grad_a[i], grad_b[i])]
        return (grad_x, None, *per_member)


def _grad_input(
    spec: tuple[tuple[float, bool], ...],
    g2s: list[Tensor | None],
    ghs: list[Tensor | None],
    weights: list[Tensor],
    factors_a: list[Tensor],
) -> Tensor:
    """``dx = sum_i (gh_i A_i + g_i W_i)`` (N, in) in one buffer, summed in the order separate layers are
    summed: members last to first (autograd runs the node created last first and adds each layer's dx to
    what has arrived), each member's rank-r term before its base term. Every product accumulates onto the
    buffer (beta = 1), so no member needs an (N, in) temporary."""
    grad_x: Tensor | None = None
    for i in reversed(range(len(spec))):
        g, gh = g2s[i], ghs[i]
        if g is None or gh is None:
            continue  # a member that was never called
        w = weights[i].t() if spec[i][1] else weights[i]  # (out, in)
        grad_x = torch.mm(gh, factors_a[i]) if grad_x is None else grad_x.addmm_(gh, factors_a[i])
        grad_x.addmm_(g, w)
    assert grad_x is not None  # backward runs only when some member's output has a gradient
    return grad_x
