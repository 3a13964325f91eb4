"""The fused DoRA linear op: ``dora_linear``, peft's DoRA math as one autograd node.

DoRA (arXiv 2402.09353) rescales the direction ``W + s B A`` to a trained magnitude ``m``; with
``n = ||W + s B A||`` per output row (detached, as in peft) and ``c = m / n``:

without dropout   y = c * (x W^T + s (x A^T) B^T) + b
with dropout d    y = x W^T + b + (c - 1) * (d(x) W^T) + c * s (d(x) A^T) B^T      (peft's formula)

On the CPU, x flattened to (N, in), xd = d(x) (x itself without dropout):

forward   h = xd A^T (N, r);  w = xd W^T + s h B^T (N, out);  y = c * w + b  [ + (x - xd) W^T ]
backward  gc = c * g;  dm = sum_N(g * w) / n;  dB = s gc^T h;  dh = s gc B;  dA = dh^T xd;  db = sum_N(g)
          dx = gc W + dh A  (no dropout),  g W + mask/(1-p) * ((c - 1) g W + dh A)  (dropout)

Saved: x (a view), h, w and the mask as packed bits. A training base weight and mixed dtypes run peft's
composition, :func:`loragen.reference.dora_linear_reference`, which this op is tested against.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from loragen.ops.fused import (
    check_dropout,
    cpu_dropout,
    input_layout,
    keep_bits,
    shaped_like_input,
)
from loragen.ops.masks import unpack_keep_mask
from loragen.reference import dora_linear_reference, dora_weight_norm

__all__ = ["DoraLinearFunction", "dora_linear"]


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

        # the output in its final shape, written through a 2-D view (callers may modify it in place)
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
