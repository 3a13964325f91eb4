"""The fused linear ops on the CPU, each one autograd node with a hand-written backward: the whole LoRA
layer (:func:`lora_linear`), the LoRA term added onto a base output computed elsewhere (:func:`lora_branch`,
quantized bases) and DoRA (:func:`dora_linear`). x is (N, in) after flattening, s = scaling, m the
dropout keep-mask, p its probability, xd = x * m / (1 - p) (x itself without dropout):

lora_linear  forward   h  = xd A^T                    (N, r), saved
                       y  = b + h (s B^T);  y += x W^T   the base GEMM accumulates onto the rank-r term
             backward  dB = s h^T g,  gh = s / (1 - p) * g B,  dA = gh^T (x * m)
                       dx = (gh A) * m;  dx += g W;  dW = g^T x, db = sum(g) only when the base trains
lora_branch  forward   y  = base;  y += s * h B^T     in place on the base output
             backward  g flows to the base output; dB, dA and the LoRA term of dx as above
dora_linear  DoRA (arXiv 2402.09353) rescales the direction W + s B A to a trained magnitude m; with
             n = ||W + s B A|| per output row (detached, as in peft) and c = m / n, peft's formula is
             y = x W^T + b + (c - 1) * (xd W^T) + c * s (xd A^T) B^T   (y = c * (x W^T + s x A^T B^T) + b
             without dropout)
             forward   h = xd A^T;  w = xd W^T + s h B^T (N, out), saved;  y = c * w + b [ + (x - xd) W^T ]
             backward  gc = c * g;  dm = sum_N(g * w) / n;  dB = s gc^T h;  dh = s gc B;  dA = dh^T xd
                       dx = gc W + dh A, or with dropout g W + mask/(1-p) * ((c - 1) g W + dh A)

Saved for backward: x (a view), h (DoRA: and w) and the keep-mask as packed bits (:mod:`loragen.ops.masks`),
seeded from torch's CPU generator (``torch.manual_seed`` reproduces it, ``torch.utils.checkpoint``
recomputes it). With dropout in float32 the masked products of the LoRA ops run as compiled kernels
(:mod:`loragen.ops.cpu_kernels`), else as numpy/BLAS row blocks. CUDA tensors go to
:func:`loragen.cuda.lora_linear_cuda`; :func:`fallback_reason` says when peft's plain composition
(:mod:`loragen.reference`) runs instead (DoRA also for a training base weight or mixed dtypes).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor

from loragen import cuda, philox, switches
from loragen.ops import cpu_kernels
from loragen.ops.masks import KeepMask, block_rows, dropout_keep_bits, row_blocks, unpack_keep_mask
from loragen.reference import (
    dora_linear_reference,
    dora_weight_norm,
    lora_branch_reference,
    lora_linear_reference,
)

__all__ = [
    "DoraLinearFunction",
    "LoraBranchFunction",
    "LoraLinearFunction",
    "cpu_dropout",
    "dora_linear",
    "fallback_reason",
    "input_layout",
    "keep_bits",
    "lora_branch",
    "lora_linear",
    "shaped_like_input",
]

_log = logging.getLogger(__name__)
_logged_reasons: set[str] = set()


def fallback_reason(x: Tensor, dropout: bool) -> str | None:
    """Why a CPU op runs peft's composition instead for input ``x``, or None when it runs (autocast keeps its
    per-op dtypes; dynamo cannot trace the numpy mask generator, so compiling with dropout falls back)."""
    if not switches.fused.get():
        return "loragen.switches.fused is off"
    if x.device.type != "cpu":
        return f"the CPU ops take CPU tensors (x is on {x.device.type})"
    if torch.is_autocast_enabled(x.device.type):
        return "autocast is enabled: the composition keeps autocast's per-op dtypes"
    if dropout and torch.compiler.is_compiling():
        return "torch.compile with dropout: the numpy mask generator cannot be traced"
    return None


def cpu_dropout(
    op: str, x: Tensor, dropout_p: float, training: bool, reason: str | None = None
) -> float | None:
    """The dropout probability the CPU op ``op`` runs with (0: none), or None where it runs the plain
    composition: for ``reason``, else :func:`fallback_reason`'s, logged once (not while compiling)."""
    dropout = training and dropout_p > 0.0
    reason = reason or fallback_reason(x, dropout)
    if reason is None:
        return dropout_p if dropout else 0.0
    if reason not in _logged_reasons and not torch.compiler.is_compiling():
        _logged_reasons.add(reason)
        _log.info("loragen.ops.%s runs the plain composition: %s", op, reason)
    return None


def check_dropout(op: str, dropout_p: float) -> None:
    """Raise ValueError unless ``0 <= dropout_p < 1``."""
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"loragen.ops.{op}: dropout_p={dropout_p!r}; expected 0 <= p < 1")


def lora_linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    lora_A: Tensor,
    lora_B: Tensor,
    scaling: float,
    dropout_p: float,
    training: bool,
    *,
    fan_in_fan_out: bool = False,
    seed: int | None = None,
) -> Tensor:
    """LoRA linear ``x W^T + b + scaling * B A dropout(x)`` as one fused op.

    Shapes: x (..., in), weight (out, in) -- (in, out) with ``fan_in_fan_out`` (transformers' ``Conv1D``) --,
    bias (out,) or None, lora_A (r, in), lora_B (out, r) -> (..., out) in x's dtype. The branch runs in
    lora_A's dtype (as in peft) and is added to the base result with one rounding. Dropout (``dropout_p``,
    only when ``training``) applies to the branch; ``seed`` fixes its mask (None: drawn from torch's CPU
    generator). Gradients flow to every input that requires them, base weight and bias included.

    Raises:
        ValueError: ``dropout_p`` outside [0, 1).
    """
    check_dropout("lora_linear", dropout_p)
    args = (x, weight, bias, lora_A, lora_B, scaling, dropout_p, training)
    if x.is_cuda and switches.fused.get() and cuda.is_available():
        return cuda.lora_linear_cuda(*args, fan_in_fan_out=fan_in_fan_out, seed=seed)
    p = cpu_dropout("lora_linear", x, dropout_p, training)
    if p is None:
        return lora_linear_reference(*args, fan_in_fan_out=fan_in_fan_out)
    return LoraLinearFunction.apply(x, weight, bias, lora_A, lora_B, scaling, p, seed, fan_in_fan_out)


def lora_branch(
    base: Tensor,
    x: Tensor,
    lora_A: Tensor,
    lora_B: Tensor,
    scaling: float,
    dropout_p: float,
    training: bool,
    *,
    seed: int | None = None,
) -> Tensor:
    """``base + scaling * B A dropout(x)``: the LoRA term added onto a base output.

    Shapes: base (..., out), x (..., in), lora_A (r, in), lora_B (out, r) -> (..., out) in base's dtype.
    On the CPU the sum is written into ``base`` itself (unless it is a view): pass a base output nothing else
    reads. Where :func:`fallback_reason` says so it returns a new tensor (the reference composition).

    Raises:
        ValueError: ``dropout_p`` outside [0, 1), or ``base`` and ``x`` with different leading dimensions.
    """
    check_dropout("lora_branch", dropout_p)
    if base.shape[:-1] != x.shape[:-1]:
        raise ValueError(
            f"loragen.ops.lora_branch: base output {tuple(base.shape)} and input {tuple(x.shape)} differ "
            "in their leading (batch) dimensions"
        )
    p = cpu_dropout("lora_branch", x, dropout_p, training)
    if p is None:
        return lora_branch_reference(base, x, lora_A, lora_B, scaling, dropout_p, training)
    return LoraBranchFunction.apply(base, x, lora_A, lora_B, scaling, p, seed)


def input_layout(x: Tensor) -> tuple[int, ...] | None:
    """The strides x's gradient should have (None: contiguous), as torch's linear gives it; some CPU backward
    kernels rely on it (BatchNorm2d's eval backward on CvT's permuted channels-last input)."""
    return None if x.is_contiguous() else torch.empty_like(x, device="meta").stride()


def shaped_like_input(grad_x: Tensor, shape: torch.Size, layout: tuple[int, ...] | None) -> Tensor:
    """The (N, in) gradient ``grad_x`` in x's shape and :func:`input_layout`'s strides."""
    grad = grad_x.view(shape)
    if layout is None:
        return grad
    return torch.empty_strided(shape, layout, dtype=grad.dtype, device=grad.device).copy_(grad)


def keep_bits(x2: Tensor, lora_A: Tensor, p: float, seed: int | None) -> tuple[Tensor | None, bool]:
    """The packed keep-mask of x2 (N, in) (None: no dropout; ``seed`` None: drawn from torch's CPU
    generator) and whether the compiled kernels run."""
    if p == 0.0:
        return None, False
    seed = philox.random_seed() if seed is None else seed
    compiled = x2.dtype == lora_A.dtype and cpu_kernels.available(lora_A.dtype, lora_A.shape[0])
    return dropout_keep_bits(x2.numel(), p, seed), compiled


class LoraLinearFunction(torch.autograd.Function):
    """:func:`lora_linear` on the CPU as one autograd node (module docstring); ``dropout_p = 0``: none."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        lora_A: Tensor,
        lora_B: Tensor,
        scaling: float,
        dropout_p: float,
        seed: int | None,
        fan_in_fan_out: bool,
    ) -> Tensor:
        x2 = x.reshape(-1, x.shape[-1])  # a view of x when x is contiguous
        rows = x2.shape[0]
        dtype = lora_A.dtype  # the LoRA branch runs in the adapter's dtype, as in peft
        bits, compiled = keep_bits(x2, lora_A, dropout_p, seed)
        h = lora_down(x2, lora_A, bits, dropout_p, compiled)
        w_t = weight if fan_in_fan_out else weight.t()  # (in, out)
        # the output in its final shape, written through a 2-D view (callers may modify it in place)
        out = torch.empty(*x.shape[:-1], w_t.shape[1], dtype=x.dtype, device=x.device)
        y = out.view(rows, w_t.shape[1])
        if dtype == x.dtype:
            if bias is not None:
                torch.addmm(bias, h, lora_B.t(), alpha=scaling, out=y)
            else:
                torch.mm(h * scaling, lora_B.t(), out=y)  # scaling the (N, r) factor, not the (N, out) result
            y.addmm_(x2, w_t)
        else:  # as peft: the base in x's dtype, the term in the adapter's, added and rounded once
            if bias is not None:
                torch.addmm(bias, x2, w_t, out=y)
            else:
                torch.mm(x2, w_t, out=y)
            y.add_(torch.mm(h, lora_B.t()), alpha=scaling)

        need_x, need_w, _, need_a, need_b = ctx.needs_input_grad[:5]
        ctx.scaling, ctx.dropout_p, ctx.fan_in_fan_out = scaling, dropout_p, fan_in_fan_out
        ctx.x_shape, ctx.has_bias, ctx.compiled = x.shape, bias is not None, compiled
        ctx.x_layout = input_layout(x)
        saved_x, saved_w = x2 if need_a or need_w else None, weight if need_x else None
        ctx.save_for_backward(saved_x, saved_w, lora_A, lora_B, h if need_b else None, bits)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        x2, weight, lora_A, lora_B, h, bits = ctx.saved_tensors
        need_x, need_w, need_bias, need_a, need_b = ctx.needs_input_grad[:5]
        s, p, ffo = ctx.scaling, ctx.dropout_p, ctx.fan_in_fan_out
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        g_lora = g2 if g2.dtype == lora_A.dtype else g2.to(lora_A.dtype)
        grad_x = grad_w = grad_bias = grad_a = grad_b = None
        if need_b:
            grad_b = torch.mm(h.t(), g_lora).mul_(s).t()  # (out, r); h^T g is the faster layout
        if need_x or need_a:
            gh = torch.mm(g_lora, lora_B).mul_(s / (1.0 - p))  # (N, r)
            w = weight.t() if ffo and need_x else weight  # (out, in); None when x needs no gradient
            if bits is None and need_x:  # one product chain with the base gradient, peft's rounding
                if gh.dtype != g2.dtype:  # the LoRA term in the adapter's dtype, added to the base gradient
                    grad_x = torch.mm(g2, w).add_(torch.mm(gh, lora_A))
                else:
                    grad_x = torch.mm(gh, lora_A).addmm_(g2, w)
                grad_a = lora_input_grads(x2, gh, lora_A, None, False, need_x=False, need_a=need_a)[1]
            else:
                grad_x, grad_a = lora_input_grads(
                    x2, gh, lora_A, bits, ctx.compiled, need_x=need_x, need_a=need_a, x_dtype=g2.dtype
                )
                if grad_x is not None:
                    grad_x.addmm_(g2, w)  # the base GEMM accumulates onto it
        if need_w:
            grad_w = torch.mm(x2.t(), g2) if ffo else torch.mm(g2.t(), x2)
        if need_bias and ctx.has_bias:
            grad_bias = g2.sum(0)
        if grad_x is not None:
            grad_x = shaped_like_input(grad_x, ctx.x_shape, ctx.x_layout)
        return grad_x, grad_w, grad_bias, grad_a, grad_b, None, None, None, None


class LoraBranchFunction(torch.autograd.Function):
    """:func:`lora_branch` on the CPU as one autograd node (module docstring).

    The sum is written into the base output (unless it is a view): the base's node does not save its output
    (bitsandbytes' products save only the quantized weight). Where the base's dtype differs from the
    adapter's, the term is cast, scaled and added in peft's order, so results match peft's bit for bit.
    """

    @staticmethod
    def forward(
        ctx: Any,
        base: Tensor,
        x: Tensor,
        lora_A: Tensor,
        lora_B: Tensor,
        scaling: float,
        dropout_p: float,
        seed: int | None,
    ) -> Tensor:
        x2 = x.reshape(-1, x.shape[-1])  # a view of x when x is contiguous
        rows = x2.shape[0]
        bits, compiled = keep_bits(x2, lora_A, dropout_p, seed)
        h = lora_down(x2, lora_A, bits, dropout_p, compiled)
        in_place = not base._is_view()
        out = base if in_place else torch.empty_like(base)
        y = out.view(rows, base.shape[-1])  # a 2-D view of out: nothing of it escapes
        if base.dtype == lora_B.dtype:
            if not in_place:
                y.copy_(base.reshape(rows, -1))
            y.addmm_(h, lora_B.t(), alpha=scaling)
        else:  # as peft: the term in the adapter's dtype, cast to the base's, scaled, added
            term = torch.mm(h, lora_B.t()).to(base.dtype).mul_(scaling)
            torch.add(base.reshape(rows, -1), term, out=y)
        if in_place:
            ctx.mark_dirty(base)
        _, need_x, need_a, need_b = ctx.needs_input_grad[:4]
        ctx.scaling, ctx.dropout_p, ctx.compiled = scaling, dropout_p, compiled
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        saved_x, saved_a = x2 if need_a else None, lora_A if need_x else None
        ctx.save_for_backward(saved_x, saved_a, lora_B, h if need_b else None, bits)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        x2, lora_A, lora_B, h, bits = ctx.saved_tensors
        need_base, need_x, need_a, need_b = ctx.needs_input_grad[:4]
        s, p, dtype = ctx.scaling, ctx.dropout_p, lora_B.dtype
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        if g2.dtype == dtype:
            g_lora = g2
        else:  # the forward scaled in the base's dtype: so does the gradient, before the cast
            g_lora, s = (g2 * s).to(dtype), 1.0
        grad_x = grad_a = grad_b = None
        if need_b:
            grad_b = torch.mm(h.t(), g_lora).mul_(s).t()  # (out, r)
        if need_x or need_a:
            gh = torch.mm(g_lora, lora_B).mul_(s / (1.0 - p))  # (N, r)
            grad_x, grad_a = lora_input_grads(
                x2, gh, lora_A, bits, ctx.compiled, need_x=need_x, need_a=need_a, x_dtype=ctx.x_dtype
            )
        if grad_x is not None:
            grad_x = grad_x.view(ctx.x_shape).to(ctx.x_dtype)
        return grad_out if need_base else None, grad_x, grad_a, grad_b, None, None, None


def lora_down(x2: Tensor, lora_A: Tensor, bits: Tensor | None, p: float, compiled: bool) -> Tensor:
    """``h = (x * m / (1 - p)) A^T`` (N, r) in the adapter's dtype, without a masked copy of all of x."""
    dtype = lora_A.dtype
    if bits is None:
        return torch.mm(x2 if x2.dtype == dtype else x2.to(dtype), lora_A.t())
    if compiled:
        return cpu_kernels.masked_down(x2.contiguous(), bits, lora_A, 1.0 / (1.0 - p))
    rows, in_features = x2.shape
    keep = KeepMask(bits, in_features, dtype)
    h = torch.empty(rows, lora_A.shape[0], dtype=dtype, device=x2.device)
    buffer = torch.empty(min(rows, block_rows(in_features)), in_features, dtype=dtype)
    for start, stop in row_blocks(rows, in_features):
        xb = keep.apply(x2[start:stop].to(dtype), keep.block(start, stop), buffer[: stop - start])
        torch.mm(xb, lora_A.t(), out=h[start:stop])
    return h.mul_(1.0 / (1.0 - p))


def lora_input_grads(
    x2: Tensor,
    gh: Tensor,
    lora_A: Tensor,
    bits: Tensor | None,
    compiled: bool,
    *,
    need_x: bool,
    need_a: bool,
    x_dtype: torch.dtype | None = None,
) -> tuple[Tensor | None, Tensor | None]:
    """The rank-r half of a LoRA backward, each part only when asked for: dx's LoRA term ``(gh A) * m``
    (N, in) and ``dA = gh^T (x * m)`` (r, in), with ``gh = s / (1 - p) * g B`` (N, r) in the adapter's
    dtype. dx comes in ``x_dtype`` from the row blocks, else in the adapter's (callers cast)."""
    dtype = gh.dtype
    if bits is None:
        grad_a = torch.mm(gh.t(), x2 if x2.dtype == dtype else x2.to(dtype)) if need_a else None
        return (torch.mm(gh, lora_A) if need_x else None), grad_a
    if compiled:
        grad_a = cpu_kernels.masked_grad_a(x2.contiguous(), bits, gh) if need_a else None
        return (cpu_kernels.masked_grad_x(gh, lora_A, bits) if need_x else None), grad_a
    (rows, rank), in_features = gh.shape, lora_A.shape[1] if lora_A is not None else x2.shape[1]
    keep = KeepMask(bits, in_features, dtype)
    out_dtype = x_dtype or dtype
    grad_x = torch.empty(rows, in_features, dtype=out_dtype) if need_x else None
    grad_a = torch.zeros(rank, in_features, dtype=dtype) if need_a else None
    buffer = torch.empty(min(rows, block_rows(in_features)), in_features, dtype=dtype)
    for start, stop in row_blocks(rows, in_features):
        mask = keep.block(start, stop)
        if grad_a is not None:
            xb = keep.apply(x2[start:stop].to(dtype), mask, buffer[: stop - start])
            grad_a.addmm_(gh[start:stop].t(), xb)
        if grad_x is not None:
            target = grad_x[start:stop] if out_dtype == dtype else buffer[: stop - start]
            keep.apply(torch.mm(gh[start:stop], lora_A, out=target), mask, target)
            if out_dtype != dtype:
                grad_x[start:stop].copy_(target)
    return grad_x, grad_a


class DoraLinearFunction(torch.autograd.Function):
    """:func:`dora_linear` on the CPU as one node (module docstring): tensors of one dtype, a frozen weight.

    ``norm`` is the detached row norm when the caller has it (None: computed here); gradcheck passes it,
    as the norm is a constant of the backward but a function of A and B for finite differences.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        lora_A: Tensor,
        lora_B: Tensor,
        magnitude: Tensor,
        scaling: float,
        dropout_p: float,
        seed: int | None,
        fan_in_fan_out: bool,
        norm: Tensor | None = None,
    ) -> Tensor:
        in_features = x.shape[-1]
        x2 = x.reshape(-1, in_features)  # a view of x when x is contiguous
        rows = x2.shape[0]
        w_t = weight if fan_in_fan_out else weight.t()  # (in, out)
        out_features = w_t.shape[1]
        if norm is None:
            norm = dora_weight_norm(weight, lora_A, lora_B, scaling, fan_in_fan_out=fan_in_fan_out)
        norm = norm.detach()
        c = magnitude.detach() / norm  # (out,)

        bits, _ = keep_bits(x2, lora_A, dropout_p, seed)
        keep = None if bits is None else unpack_keep_mask(bits, x2.numel()).view(x2.shape)
        xd = x2 if keep is None else _dropped(x2, keep, dropout_p)
        h = torch.mm(xd, lora_A.t())  # (N, r)
        w = torch.mm(h * scaling, lora_B.t()).addmm_(xd, w_t)  # (N, out): the rank-r term, then the GEMM

        out = torch.empty(*x.shape[:-1], out_features, dtype=x.dtype, device=x.device)
        y = out.view(rows, out_features)
        if bias is not None:
            torch.addcmul(bias, w, c, out=y)
        else:
            torch.mul(w, c, out=y)
        if bits is not None:
            y.addmm_(x2 - xd, w_t)  # x W^T - xd W^T as one GEMM

        need_x, _, _, need_a, need_b, need_m = ctx.needs_input_grad[:6]
        ctx.scaling, ctx.dropout_p, ctx.fan_in_fan_out = scaling, dropout_p, fan_in_fan_out
        ctx.x_shape, ctx.rows, ctx.has_bias = x.shape, rows, bias is not None
        ctx.x_layout = input_layout(x)  # a non-contiguous x gets its gradient in its own layout
        ctx.save_for_backward(
            x2 if need_a else None,
            weight if need_x else None,
            lora_A,
            lora_B,
            h if need_b else None,
            w if need_m else None,
            c,
            norm,
            bits,
        )
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        x2, weight, lora_A, lora_B, h, w, c, norm, bits = ctx.saved_tensors
        need_x, _, need_bias, need_a, need_b, need_m = ctx.needs_input_grad[:6]
        s, p, ffo = ctx.scaling, ctx.dropout_p, ctx.fan_in_fan_out
        g2 = grad_out.reshape(ctx.rows, grad_out.shape[-1])
        keep = None  # unpacked once for every product
        if bits is not None:
            keep = unpack_keep_mask(bits, ctx.rows * ctx.x_shape[-1]).view(ctx.rows, ctx.x_shape[-1])
        grad_x = grad_bias = grad_a = grad_b = grad_m = None
        if need_m:
            grad_m = (g2 * w).sum(0).div_(norm)
        if need_bias and ctx.has_bias:
            grad_bias = g2.sum(0)
        if need_x or need_a or need_b:
            gc = g2 * c  # (N, out)
            if need_b:
                grad_b = torch.mm(h.t(), gc).mul_(s).t()  # (out, r); h^T g is the faster layout
            if need_x or need_a:
                dh = torch.mm(gc, lora_B).mul_(s)  # (N, r)
                if need_a:
                    xd = x2 if keep is None else _dropped(x2, keep, p)
                    grad_a = torch.mm(dh.t(), xd)
                if need_x:
                    w_oi = weight.t() if ffo else weight  # (out, in)
                    if keep is None:
                        grad_x = torch.mm(dh, lora_A).addmm_(gc, w_oi)
                    else:
                        inner = torch.mm(dh, lora_A).addmm_(g2 * (c - 1), w_oi)  # the gradient wrt xd
                        grad_x = _dropped(inner, keep, p).addmm_(g2, w_oi)
                    grad_x = shaped_like_input(grad_x, ctx.x_shape, ctx.x_layout)
        return grad_x, None, grad_bias, grad_a, grad_b, grad_m, None, None, None, None, None


def _dropped(t: Tensor, keep: Tensor, p: float) -> Tensor:
    """``t * keep / (1 - p)`` for t (N, in) and a bool keep-mask of its shape: a new tensor."""
    return torch.where(keep, t, torch.zeros((), dtype=t.dtype)).mul_(1.0 / (1.0 - p))


def dora_linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    lora_A: Tensor,
    lora_B: Tensor,
    magnitude: Tensor,
    scaling: float,
    dropout_p: float,
    training: bool,
    *,
    fan_in_fan_out: bool = False,
    seed: int | None = None,
) -> Tensor:
    """DoRA linear with peft's math (module docstring): a fresh tensor (..., out) in x's dtype.

    Shapes: x (..., in), weight (out, in) -- (in, out) with ``fan_in_fan_out`` --, bias (out,) or None,
    lora_A (r, in), lora_B (out, r), magnitude (out,). Dropout (``dropout_p``, only when ``training``)
    applies to the adapter's input; ``seed`` fixes its mask (None: drawn from torch's CPU generator).

    Raises:
        ValueError: ``dropout_p`` outside [0, 1), or a magnitude of the wrong shape.
    """
    check_dropout("dora_linear", dropout_p)
    if tuple(magnitude.shape) != (lora_B.shape[0],):
        raise ValueError(
            f"loragen.ops.dora_linear: magnitude has shape {tuple(magnitude.shape)}; expected ({lora_B.shape[0]},), "
            "one value per output feature"
        )
    tensors = (x, weight, bias, lora_A, lora_B, magnitude)
    reason = None
    if weight.requires_grad:
        reason = "the base weight trains: the fused DoRA op gives no weight gradient"
    elif any(t is not None and t.dtype != x.dtype for t in tensors[1:]):
        reason = "mixed dtypes: the composition casts as peft does"
    p = cpu_dropout("dora_linear", x, dropout_p, training, reason)
    if p is None:
        return dora_linear_reference(*tensors, scaling, dropout_p, training, fan_in_fan_out=fan_in_fan_out)
    return DoraLinearFunction.apply(*tensors, scaling, p, seed, fan_in_fan_out)
