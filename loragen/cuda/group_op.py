"""Sibling LoRA linears on CUDA tensors as one autograd node: one ``lora_down`` and one ``lora_grad_in``
launch for the whole group.

k LoRA linears that read one input x (attention's q, k, v; an MLP's gate and up) each pay, as separate
layers, a ``lora_down`` launch in forward and a ``lora_grad_in`` launch in backward -- both passes over x
--, and autograd adds their k gradients of x. Here the members' A are stacked into one factor, each in a
block of its own rank bucket b_i (rows r_i..b_i-1 of a block zero, as the single-layer op pads A), and
the group runs these passes (shapes as in :mod:`loragen.cuda.linear_op`; R = the rank bucket of
b_1 + ... + b_k, which must be at most :data:`~loragen.cuda.kernel_variants.MAX_RANK`)::

    forward   H     = lora_down(x, [A_1; ...; A_k])         one pass over x: (N, R), every h_i at once
              h_i   = H[:, o_i : o_i + b_i]                  copied out, (N, b_i): what the member's own
                                                             lora_down writes
              y_i   = x W_i^T, then lora_up(h_i, B_i)        k base products, k lora_up launches: each
                                                             member's own B, bias, scaling and output
    backward  dh_i, dB_i = lora_grad_out(g_i, h_i, B_i)      k launches, as the single-layer op
              dx, dA = lora_grad_in(x, [dh_1 ... dh_k])      one pass over x: every dA_i, and the sum of
                                                             the rank-r terms of dx in one buffer
              dx   += g_i W_i    for each member             cuBLAS, beta = 1: no (N, in) temporary, and
                                                             autograd adds no x-gradients

So a group of k members launches 2 + 2k kernels per forward + backward where k separate layers launch 4k,
and it is one autograd node where they are k (plus k - 1 additions of (N, in) gradients). What it costs:
the h_i copies out of H (N b_i float32 each, beside the (N, out) outputs) and the concatenation of the
dh_i in backward.

Rounding: the products are the single-layer op's, member by member, except dx: the kernel sums the
members' rank-r terms in float32 and rounds them into x's dtype once, and cuBLAS adds each base term to
that buffer, where separate layers round each member's dx and autograd sums them in x's dtype. For 16-bit
x that is closer to the exact gradient; in float32 the order differs from peft's (a member whose rank-r
and base terms nearly cancel rounds the others' rank-r terms with its own large one, as the CPU group's
docstring explains), which stays within float32 rounding of the sum's largest term.

Not run as a group -- :func:`lora_group_cuda` returns None and each member runs
:func:`~loragen.cuda.linear_op.lora_linear_cuda` alone --: dropout (each member draws its own mask, so
the members read different inputs), stacked ranks past the largest bucket, ``torch.compile``, empty
inputs, and inputs the kernels do not take (:func:`~loragen.cuda.op_inputs.unsupported_reason`).

Under autocast (Trainer's and TRL's ``bf16=True``) the group does what the single-layer op does: x and
every member's weight and bias are cast to the autocast dtype (casts autograd records, no-ops for a model
already in that dtype), the factors are read as they are, and the node runs with autocast off, its
backward too, wherever ``backward()`` is called.

Host path: the group's plan (the members' :class:`~loragen.cuda.passes.Plan` and the stacked factor's,
the block offsets) is kept per (sizes, dtype, device, launcher, switch), as the single-layer op keeps its
plans (:mod:`loragen.cuda.hostcache`, which also keeps each B^T); the stacked A is kept per group and
refreshed block by block, only for members whose A changed (``_version``, data pointer), and on every call
inside a CUDA-graph capture and after one (as :mod:`loragen.cuda.hostcache` keeps each factor). The zero
columns that pad the dh_i to a bucket are views of zeros kept per (device, stream, width), not per plan.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import Tensor

from loragen import switches
from loragen.cuda import hostcache, kernel_variants, passes, streams
from loragen.cuda.launch import KernelLauncher
from loragen.cuda.op_inputs import autocast_anywhere, autocast_dtype, check_inputs, unsupported_reason
from loragen.cuda.torch_path import runs_on_torch_path

__all__ = ["GroupMember", "group_reason", "lora_group_cuda"]

# (weight, bias, lora_A, lora_B, scaling, fan_in_fan_out): one member, as lora_linear_cuda takes it
GroupMember = tuple[Tensor, Tensor | None, Tensor, Tensor, float, bool]

_NO_DROPOUT: tuple[Tensor | None, int, float] = (None, 0, 1.0)


# ---- what is kept between calls -------------------------------------------------------------------------


class _GroupPlan:
    """The members' plans, their blocks in the stacked factor and the stacked factor's own plan.

    ``stacked``: the plan of ``lora_down`` / ``lora_grad_in`` over every block (rank b_1 + ... + b_k,
    its ``out_features`` set to in: those kernels read no row of length out, so only x's row length
    decides whether their accesses are vectors). ``sizes``: the blocks, and the padding past them when
    their sum is not a bucket; ``block``: the common block width when every block and the padding have
    one (0 otherwise); ``pad``: the padding's width (its columns of dh are zeros, :func:`_zero_columns`);
    ``ranks``: the members' ranks.
    """

    __slots__ = ("block", "members", "offsets", "pad", "ranks", "sizes", "stacked")

    def __init__(self, x2: Tensor, outs: Sequence[int], ranks: Sequence[int], handle: int) -> None:
        self.ranks = tuple(ranks)
        self.members = tuple(hostcache.plan(x2, out, rank, handle) for out, rank in zip(outs, ranks))
        blocks = [p.variant.rank_bucket for p in self.members]
        offsets, total = [], 0
        for block in blocks:
            offsets.append(total)
            total += block
        self.offsets = tuple(offsets)
        self.stacked = hostcache.plan(x2, x2.shape[1], total, handle)
        pad = self.stacked.variant.rank_bucket - total
        self.sizes = (*blocks, pad) if pad else tuple(blocks)
        self.block = blocks[0] if len(set(self.sizes)) == 1 else 0
        self.pad = pad


_plans: dict[tuple[Any, ...], _GroupPlan] = {}


def _group_plan(x2: Tensor, outs: tuple[int, ...], ranks: tuple[int, ...], handle: int) -> _GroupPlan:
    key = (x2.shape, x2.dtype, x2.device, outs, ranks, handle, switches.cuda_kernels.get())
    found = _plans.get(key)
    if found is None:
        if len(_plans) >= hostcache.MAX_PLANS:  # kept per shape: bounded as the layers' plans are
            _plans.clear()
        found = _plans[key] = _GroupPlan(x2, outs, ranks, handle)
    return found


# float32 zeros per (device, stream, width), a power of two of rows, grown as more rows come; the ones
# outgrown are kept, since a CUDA graph captured with one reads it on every replay (at most as much again)
_zeros: dict[tuple[torch.device, int, int], Tensor] = {}
_outgrown: list[Tensor] = []


def _zero_columns(rows: int, width: int, device: torch.device, in_capture: bool) -> Tensor:
    """(rows, width) float32 zeros on ``device``, read and never written: a view of the kept zeros (one
    buffer per device, stream and width, whatever the rows: plans are kept per shape, and a plan holding
    its own zeros would keep device memory for every sequence length seen; per stream, so that no stream
    reads zeros whose fill another stream has only queued), or, inside a CUDA-graph capture that finds
    them too small, a tensor for that call only (work queued there runs only on replay)."""
    key = (device, streams.current_handle(device), width)
    found = _zeros.get(key)
    if found is None or found.shape[0] < rows:
        fresh = hostcache.new_buffer(1 << max(rows - 1, 0).bit_length(), width, device=device).zero_()
        if in_capture:
            return fresh[:rows]
        if found is not None:
            _outgrown.append(found)
        found = _zeros[key] = fresh
    return found[:rows]


class _Stacked:
    """The stacked A of one group, float32 (R, in), what each block was copied from (and at which
    optimizer step), whether a CUDA-graph capture has read each block (copied on every call since), the
    members' ranks, and whether the zero rows have been written outside a capture; as
    :func:`loragen.cuda.hostcache.factor` keeps one factor."""

    __slots__ = ("buffer", "captured", "data_ptrs", "ranks", "sources", "steps", "versions", "zeroed")

    def __init__(self, factors: Sequence[Tensor], buffer: Tensor) -> None:
        self.sources = [weakref.ref(a) for a in factors]
        self.buffer = buffer
        self.versions = [-1] * len(factors)
        self.data_ptrs = [-1] * len(factors)
        self.captured = [False] * len(factors)
        self.ranks: tuple[int, ...] = ()
        self.steps = -1
        self.zeroed = False


_stacked: dict[tuple[int, ...], _Stacked] = {}


def _stacked_a(factors: Sequence[Tensor], group: _GroupPlan, in_capture: bool) -> Tensor:
    """``[A_1; ...; A_k]`` as the kernels read it: float32 (R, in), member i's A at rows o_i..o_i+r_i-1,
    every other row zero; copied block by block, only where a member's A changed since the last call
    (or a capture has read it; after an optimizer step every block)."""
    key = tuple(map(id, factors))
    entry = _stacked.get(key)
    bucket, features = group.stacked.variant.rank_bucket, group.stacked.in_features
    if (
        entry is None
        or any(ref() is not a for ref, a in zip(entry.sources, factors))
        or entry.buffer.shape != (bucket, features)
        or entry.buffer.device != factors[0].device
    ):
        entry = _stacked[key] = _Stacked(
            factors, hostcache.new_buffer(bucket, features, device=factors[0].device)
        )
        for a in factors:  # the entry goes with the first member that goes
            weakref.finalize(a, _stacked.pop, key, None)
        hostcache.watch_optimizer_steps()
    steps = hostcache.optimizer_steps()
    stepped = entry.steps != steps
    zeroing = not entry.zeroed or group.ranks != entry.ranks  # a smaller rank leaves rows that must be zero
    entry.ranks = group.ranks
    entry.steps = steps
    if zeroing:  # a zero_ inside a capture writes only when the graph replays: every block copied again
        with torch.no_grad():
            entry.buffer.zero_()
        entry.zeroed = not in_capture
    for i, a in enumerate(factors):
        if (
            zeroing
            or stepped
            or in_capture
            or entry.captured[i]
            or entry.versions[i] != a._version
            or entry.data_ptrs[i] != a.data_ptr()
        ):
            offset = group.offsets[i]
            with torch.no_grad():
                entry.buffer[offset : offset + a.shape[0]].copy_(a)
            entry.versions[i] = a._version
            entry.data_ptrs[i] = a.data_ptr()
            entry.captured[i] = entry.captured[i] or in_capture
    return entry.buffer


# ---- the autograd node ---------------------------------------------------------------------------------


class _CudaGroupFunction(torch.autograd.Function):
    """``apply(x, (scalings, transposed, launcher handle), W_1, b_1, A_1, B_1, ..., W_k, b_k, A_k, B_k)``
    -> ``(y_1, ..., y_k)``; the passes of the module docstring."""

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, static: tuple[tuple[float, ...], tuple[bool, ...], int], *tensors: Tensor | None
    ) -> tuple[Tensor, ...]:
        scalings, transposed, handle = static
        # every member's weight, lora_A and lora_B is a tensor; only biases may be None
        weights, biases = cast("tuple[Tensor, ...]", tensors[0::4]), tensors[1::4]
        factors_a, factors_b = (
            cast("tuple[Tensor, ...]", tensors[2::4]),
            cast("tuple[Tensor, ...]", tensors[3::4]),
        )
        outs = tuple(w.shape[1] if t else w.shape[0] for w, t in zip(weights, transposed))
        x2 = x.reshape(-1, x.shape[-1])
        in_capture = streams.capturing(x2.device)
        group = _group_plan(x2, outs, tuple(a.shape[0] for a in factors_a), handle)
        x2 = group.stacked.prepare(x2)
        stacked_a = _stacked_a(factors_a, group, in_capture)
        h_all = passes.down(group.stacked, x2, stacked_a, _NO_DROPOUT)
        k = len(outs)
        if group.block:  # one copy: (R / b, N, b), each h_i a contiguous (N, b) piece of it
            hs = (
                h_all.view(-1, h_all.shape[1] // group.block, group.block)
                .transpose(0, 1)
                .contiguous()
                .unbind(0)[:k]
            )
        else:
            hs = tuple(h.contiguous() for h in h_all.split(group.sizes, dim=1)[:k])  # each (N, b_i)
        bts, ys = [], []
        lead = x.shape[:-1]
        for plan, w, t, bias, b, s, h in zip(
            group.members, weights, transposed, biases, factors_b, scalings, hs
        ):
            bt = hostcache.factor(b, plan, True, in_capture)
            y = torch.empty(*lead, plan.out_features, dtype=x.dtype, device=x.device)  # fresh, final shape
            y2 = y.view(plan.rows, plan.out_features)
            passes.add_base(x2, w if t else w.t(), y2)
            passes.up(plan, h, bt, bias, s, y2)
            bts.append(bt)
            ys.append(y)
        # the padding columns of dh, which backward's lora_grad_in reads only for x's or an A's gradient
        need = ctx.needs_input_grad
        need_dh = need[0] or any(need[4::4])
        zeros = (
            _zero_columns(group.stacked.rows, group.pad, x2.device, in_capture)
            if group.pad and need_dh
            else None
        )
        ctx.static, ctx.prepared = static, (group, stacked_a, bts, zeros, x.shape)
        ctx.set_materialize_grads(False)  # an output nobody used gets None: its member's terms are skipped
        ctx.save_for_backward(x2, *weights, *factors_a, *factors_b, *hs)
        return tuple(ys)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        if not autocast_anywhere():
            return _CudaGroupFunction._backward(ctx, grads)
        # a backward() called inside an autocast region must not recast the float32 products
        with torch.autocast(ctx.prepared[0].stacked.device.type, enabled=False):
            return _CudaGroupFunction._backward(ctx, grads)

    @staticmethod
    def _backward(ctx: Any, grads: tuple[Tensor | None, ...]) -> tuple[Tensor | None, ...]:
        scalings, transposed, _ = ctx.static
        # the stacked A and the B^T buffers as forward read them: they cannot have changed since, as the
        # parameters they copy are saved (autograd refuses a backward after an in-place change)
        group, stacked_a, bts, zeros, x_shape = ctx.prepared
        k = len(scalings)
        x2, *saved = ctx.saved_tensors
        weights, factors_a, factors_b, hs = saved[:k], saved[k : 2 * k], saved[2 * k : 3 * k], saved[3 * k :]
        need = ctx.needs_input_grad
        need_x, need_a = need[0], need[4::4]
        need_dh = need_x or any(need_a)
        result: list[Tensor | None] = [None] * (2 + 4 * k)
        g2s: list[Tensor | None] = []
        dhs: list[Tensor] = []
        for i, (plan, g) in enumerate(zip(group.members, grads)):
            if g is None:  # an output that no loss reached: its terms are zero
                g2s.append(None)
                if need_dh:
                    dhs.append(x2.new_zeros(plan.rows, plan.variant.rank_bucket, dtype=torch.float32))
                continue
            g2 = g.reshape(plan.rows, plan.out_features)
            g2 = plan.prepare(g2 if g2.dtype == x2.dtype else g2.to(x2.dtype))
            g2s.append(g2)
            at = 2 + 4 * i
            if need_dh or need[at + 3]:
                dh, db = passes.grad_out(plan, g2, hs[i], bts[i], scalings[i])
                dhs.append(dh)
                if need[at + 3]:  # columns past the rank only when the rank is not a bucket
                    grad_b = db if plan.rank == db.shape[1] else db[:, : plan.rank].contiguous()
                    result[at + 3] = (
                        grad_b if grad_b.dtype == factors_b[i].dtype else grad_b.to(factors_b[i].dtype)
                    )
            if need[at]:
                result[at] = torch.mm(x2.t(), g2) if transposed[i] else torch.mm(g2.t(), x2)
            if need[at + 1]:
                result[at + 1] = g2.sum(0)
        if need_dh:
            if zeros is not None:
                dhs.append(zeros)
            gx, da = passes.grad_in(group.stacked, x2, torch.cat(dhs, dim=1), stacked_a, _NO_DROPOUT, need_x)
            if any(need_a):
                for i, (a, block) in enumerate(zip(factors_a, da.split(group.sizes))):
                    # a member whose output reached no loss gets no gradient, as a layer run alone
                    if need_a[i] and g2s[i] is not None:  # rows past the rank only when it is not a bucket
                        grad_a = block if block.shape[0] == a.shape[0] else block[: a.shape[0]]
                        result[4 + 4 * i] = grad_a if grad_a.dtype == a.dtype else grad_a.to(a.dtype)
            if gx is not None:
                for i in reversed(range(k)):  # the base terms onto the rank-r terms' buffer, beta = 1
                    g_i = g2s[i]
                    if g_i is not None:
                        gx.addmm_(g_i, weights[i].t() if transposed[i] else weights[i])
                result[0] = gx.view(x_shape)
        return tuple(result)


# ---- the entry point -----------------------------------------------------------------------------------


def group_reason(x: Tensor, members: Sequence[GroupMember]) -> str | None:
    """Why ``members`` cannot run as one group on ``x`` (each then runs alone), or None when they can."""
    if torch.compiler.is_compiling():
        return "torch.compile traces each layer's custom op"
    in_features = x.shape[-1]
    if x.numel() == 0:
        return "an empty input"
    total = 0
    for w, b, a, bb, _, t in members:
        reason = unsupported_reason(x, w, b, a, bb, fan_in_fan_out=t)
        if reason is not None:
            return reason
        if a.shape[1] != in_features:
            return f"lora_A {tuple(a.shape)} does not read x (..., {in_features})"
        total += kernel_variants.rank_bucket(a.shape[0])
    if total > kernel_variants.MAX_RANK:
        return (
            f"the stacked rank buckets sum to {total} (the kernels take at most {kernel_variants.MAX_RANK})"
        )
    return None


def lora_group_cuda(
    x: Tensor, members: Sequence[GroupMember], *, launcher: KernelLauncher | None = None
) -> tuple[Tensor, ...] | None:
    """Every member's LoRA linear ``x W_i^T + b_i + s_i B_i A_i x`` as one autograd node (no dropout).

    Shapes: x (..., in); each member ``(weight, bias, lora_A, lora_B, scaling, fan_in_fan_out)`` as
    :func:`~loragen.cuda.linear_op.lora_linear_cuda` takes it: weight (out_i, in) -- (in, out_i) with
    ``fan_in_fan_out`` --, bias (out_i,) or None, lora_A (r_i, in), lora_B (out_i, r_i). Returns
    ``(y_1, ..., y_k)``, y_i (..., out_i) in x's dtype (the autocast dtype under autocast, as the
    single-layer op), each a fresh tensor, with gradients to x and every member's tensors that require
    them; or None where the group cannot run as one (:func:`group_reason`): the caller then runs each
    member alone.

    Args:
        launcher: runs the kernels (default: the self-checked CUDA driver launcher); loragen's CPU tests
            pass an emulator, the torch path or a null driver here.

    Raises:
        CudaLoraError: a member's tensors not on x's device (not a CUDA device when no launcher is given),
            or shapes that do not fit, as :func:`~loragen.cuda.linear_op.lora_linear_cuda` words them.
    """
    for w, b, a, bb, _, t in members:
        check_inputs(x, w, b, a, bb, t, 0.0, require_cuda=launcher is None)
    cast = autocast_dtype(x) if autocast_anywhere() else None
    if cast is not None:  # as F.linear takes them under autocast; the factors as they are
        x = x.to(cast)
        members = [
            (w.to(cast), None if b is None else b.to(cast), a, bb, s, t) for w, b, a, bb, s, t in members
        ]
    if group_reason(x, members) is not None:
        return None
    handle = hostcache.launcher_handle(launcher)
    # Where the torch path runs the whole op, each member's composition with torch's autograd is leaner
    # than one node made of the passes' torch implementations: the members then run alone. The first
    # member's route stands for the group's (the switch and the launcher decide it for all of them).
    first = members[0]
    if runs_on_torch_path(x, first[3].shape[0], first[2].shape[0], handle):
        return None
    static = (tuple(float(m[4]) for m in members), tuple(bool(m[5]) for m in members), handle)
    tensors = [t for m in members for t in m[:4]]
    if cast is None:
        outputs: tuple[Tensor, ...] = _CudaGroupFunction.apply(x, static, *tensors)
        return outputs
    with torch.autocast(x.device.type, enabled=False):
        outputs = _CudaGroupFunction.apply(x, static, *tensors)
    return outputs
