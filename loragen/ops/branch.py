"""The LoRA branch alone, added onto a base output computed elsewhere: ``y = base + s * B A dropout(x)``.

For bases whose forward loragen does not replace (bitsandbytes' 4-bit and 8-bit layers, whose product
dequantizes its weight on the fly), the base output comes from the base layer and only the rank-r term
runs here, as one autograd node with a hand-written backward (x (N, in) after flattening the batch
dimensions, s = scaling, m the dropout keep-mask, p its probability):

forward   h  = (x * m / (1 - p)) A^T          (N, r), saved
          y  = base;  y += s * h B^T          in place on the base output (one GEMM with beta = 1)
backward  g_base = g                           the base output's gradient is the output's
          dB = s h^T g                         (out, r)
          gh = s / (1 - p) * g B               (N, r)
          dA = gh^T (x * m)                    (r, in)
          dx = (gh A) * m                      (N, in); the base's own backward adds g W to it

The LoRA term runs in the adapter's dtype (x cast to it, as peft does); where the base output has another
dtype (a bfloat16 model), the term is cast to it, scaled and added there, in peft's order, so results agree
with peft's bit for bit. Saved for backward: x itself (a view, never a copy), h, and the dropout mask as
packed bits (or nothing but a seed with the "philox" generator): no masked or cast copy of x, no float
mask. peft's composition clones the base output and saves dropout(x) and a float mask, both x-sized.

The sum is written into the base output itself (the base's autograd node does not save its output,
which is what makes this safe: bitsandbytes' products save only the quantized weight). A base output
that is a view of another tensor is left alone and the sum goes to a new tensor.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor

from loragen import philox, switches
from loragen.ops import cpu_kernels
from loragen.ops.dispatch import fallback_reason
from loragen.ops.fused_linear import lora_down, lora_input_grads
from loragen.ops.masks import make_keep_bits
from loragen.reference import lora_branch_reference

__all__ = ["LoraBranchFunction", "lora_branch"]

_log = logging.getLogger(__name__)


class LoraBranchFunction(torch.autograd.Function):
    """:func:`lora_branch` on the CPU as one autograd node; the formulas are in the module docstring.

    ``apply(base, x, lora_A, lora_B, scaling, dropout_p, rng, seed)`` with ``dropout_p = 0`` meaning no
    dropout; ``seed`` fixes the mask (None draws one from torch's CPU generator, so
    ``torch.manual_seed`` and activation checkpointing reproduce it).
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
        rng: str,
        seed: int | None,
    ) -> Tensor:
        in_features = x.shape[-1]
        x2 = x.reshape(-1, in_features)  # a view of x when x is contiguous
        rows = x2.shape[0]
        bits = None
        compiled = False
        if dropout_p > 0.0:
            if seed is None:
                seed = philox.random_seed()
            bits = make_keep_bits(rows * in_features, dropout_p, seed, rng)
            compiled = x.dtype == lora_A.dtype and cpu_kernels.available(lora_A.dtype, lora_A.shape[0])
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
        ctx.scaling, ctx.dropout_p, ctx.rng, ctx.seed = scaling, dropout_p, rng, seed
        ctx.x_shape, ctx.x_dtype, ctx.rows, ctx.compiled = x.shape, x.dtype, rows, compiled
        ctx.save_for_backward(
            x2 if need_a else None,
            lora_A if need_x else None,
            lora_B,
            h if need_b else None,
            bits if rng == "bits" else None,  # "philox" regenerates the mask from the seed
        )
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        x2, lora_A, lora_B, h, bits = ctx.saved_tensors
        need_base, need_x, need_a, need_b = ctx.needs_input_grad[:4]
        s, p = ctx.scaling, ctx.dropout_p
        rows, in_features = ctx.rows, ctx.x_shape[-1]
        dtype = lora_B.dtype
        if p > 0.0 and bits is None:
            bits = make_keep_bits(rows * in_features, p, ctx.seed, ctx.rng)

        g2 = grad_out.reshape(rows, grad_out.shape[-1])
        if g2.dtype == dtype:
            g_lora = g2
        else:  # the forward scaled in the base's dtype: so does the gradient, before the cast
            g_lora, s = (g2 * s).to(dtype), 1.0
        grad_x = grad_a = grad_b = None
        if need_b:
            grad_b = torch.mm(h.t(), g_lora).mul_(s).t()  # (out, r); h^T g is the faster layout
        if need_x or need_a:
            gh = torch.mm(g_lora, lora_B).mul_(s / (1.0 - p))  # (N, r)
            grad_x, grad_a = lora_input_grads(
                x2, gh, lora_A, bits, ctx.compiled, need_x=need_x, need_a=need_a, x_dtype=ctx.x_dtype
            )
        if grad_x is not None:
            grad_x = grad_x.view(ctx.x_shape).to(ctx.x_dtype)
        return grad_out if need_base else None, grad_x, grad_a, grad_b, None, None, None, None


_logged_reasons: set[str] = set()


def lora_branch(
    base: Tensor,
    x: Tensor,
    lora_A: Tensor,
    lora_B: Tensor,
    scaling: float,
    dropout_p: float,
    training: bool,
    *,
    rng: str | None = None,
    seed: int | None = None,
) -> Tensor:
    """``base + scaling * B A dropout(x)``: the LoRA term added onto a base output.

    Shapes: base (..., out), x (..., in), lora_A (r, in), lora_B (out, r) -> (..., out) in base's dtype.
    The term runs in lora_A's dtype (x cast to it, as peft does); dropout (probability ``dropout_p``, only
    when ``training``) applies to the branch only, with inverted scaling.

    On the CPU this is :class:`LoraBranchFunction`, which writes the sum into ``base`` itself (unless
    ``base`` is a view) and returns it: pass a base output that nothing else reads. With
    ``loragen.switches.fused`` off, on other devices, and for the reasons of
    :func:`loragen.ops.dispatch.fallback_reason` (autocast, ``torch.compile`` with dropout) it runs
    :func:`loragen.reference.lora_branch_reference`, which returns a new tensor.

    Args:
        rng: CPU dropout mask generator, "bits" or "philox" (default: :data:`loragen.switches.dropout_rng`).
        seed: fixes the dropout mask (tests); None draws one from torch's CPU generator.

    Raises:
        ValueError: ``dropout_p`` outside [0, 1), an unknown ``rng``, or ``base`` and ``x`` with different
            leading dimensions.
    """
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"loragen.ops.lora_branch: dropout_p={dropout_p!r}; expected 0 <= p < 1")
    if base.shape[:-1] != x.shape[:-1]:
        raise ValueError(
            f"loragen.ops.lora_branch: base output {tuple(base.shape)} and input {tuple(x.shape)} differ "
            "in their leading (batch) dimensions"
        )
    if rng is None:
        rng = switches.dropout_rng.get()
    elif rng not in ("bits", "philox"):
        raise ValueError(f"loragen.ops.lora_branch: rng={rng!r}; expected 'bits' or 'philox'")
    dropout = training and dropout_p > 0.0
    reason = None
    if not switches.fused.get():
        reason = "loragen.switches.fused is off"
    elif x.device.type != "cpu":
        reason = f"the fused branch runs on the CPU only (x is on {x.device.type})"
    else:
        reason = fallback_reason(x, dropout)
    if reason is not None:
        if reason not in _logged_reasons and not torch.compiler.is_compiling():  # a log call breaks the graph
            _logged_reasons.add(reason)
            _log.info("loragen.ops.lora_branch runs the plain composition: %s", reason)
        return lora_branch_reference(base, x, lora_A, lora_B, scaling, dropout_p, training)
    p = dropout_p if dropout else 0.0
    return LoraBranchFunction.apply(base, x, lora_A, lora_B, scaling, p, rng, seed)
