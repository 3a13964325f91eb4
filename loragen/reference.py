"""peft's compositions in plain autograd: the references every fast op of :mod:`loragen.ops` and
:mod:`loragen.cuda` is held to, and what runs where no fast op does. The LoRA term ``scaling * B A
dropout(x)`` is written once, in :func:`lora_term`. With ``keep`` (the keep-mask a fast op drew), each
composition reproduces that op's dropout exactly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "dora_linear_reference",
    "dora_weight_norm",
    "lora_branch_reference",
    "lora_dropout",
    "lora_linear_reference",
    "lora_term",
]


def lora_dropout(x: Tensor, dropout_p: float, training: bool, keep: Tensor | None = None) -> Tensor:
    """The LoRA branch's input: ``dropout(x)`` with inverted scaling, or ``x * keep / (1 - p)`` with a
    given bool keep-mask (x's shape), or x itself without dropout (p = 0 or not training).

    Raises:
        ValueError: ``keep`` does not have x's shape.
    """
    if dropout_p == 0 or not training:
        return x
    if keep is None:
        return F.dropout(x, dropout_p, True)
    if keep.shape != x.shape:
        raise ValueError(
            f"loragen.reference.lora_dropout: keep-mask of shape {tuple(keep.shape)} for x of shape "
            f"{tuple(x.shape)}; expected x's shape"
        )
    return x * keep / (1 - dropout_p)


def lora_linear_reference(
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
    keep: Tensor | None = None,
) -> Tensor:
    """Plain-autograd LoRA linear, composed as peft composes it; the sum in the base result's dtype.

    Shapes: x (..., in), weight (out, in) -- (in, out) with ``fan_in_fan_out`` --, bias (out,) or None,
    lora_A (r, in), lora_B (out, r) -> (..., out).
    """
    result = F.linear(x, weight.t() if fan_in_fan_out else weight, bias)
    return (result + lora_term(x, lora_A, lora_B, scaling, dropout_p, training, keep=keep)).to(result.dtype)


def lora_term(
    x: Tensor,
    lora_A: Tensor,
    lora_B: Tensor,
    scaling: float,
    dropout_p: float,
    training: bool,
    *,
    keep: Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> Tensor:
    """The LoRA term of a linear layer, ``scaling * B A dropout(x)``, as peft computes it (x cast to the
    adapter's dtype). ``dtype``: cast the product to it *before* scaling, peft's order for quantized bases.

    Shapes: x (..., in), lora_A (r, in), lora_B (out, r) -> (..., out) in the adapter's dtype (or ``dtype``).
    """
    x_lora = lora_dropout(x.to(lora_A.dtype), dropout_p, training, keep)
    product = F.linear(F.linear(x_lora, lora_A), lora_B)
    if dtype is not None:
        product = product.to(dtype)
    return product * scaling


def lora_branch_reference(
    base: Tensor,
    x: Tensor,
    lora_A: Tensor,
    lora_B: Tensor,
    scaling: float,
    dropout_p: float,
    training: bool,
    *,
    keep: Tensor | None = None,
) -> Tensor:
    """``base + (B A dropout(x)).to(base.dtype) * scaling``, as peft adds the term onto a quantized base's
    output (a new tensor).

    Shapes: base (..., out), x (..., in), lora_A (r, in), lora_B (out, r) -> (..., out) in base's dtype.
    """
    return base + lora_term(x, lora_A, lora_B, scaling, dropout_p, training, keep=keep, dtype=base.dtype)


def dora_weight_norm(
    weight: Tensor, lora_A: Tensor, lora_B: Tensor, scaling: float, *, fan_in_fan_out: bool = False
) -> Tensor:
    """``||W + s B A||`` per output row, (out,), detached, in lora_A's dtype (as peft computes it).

    Shapes: weight (out, in) -- (in, out) with ``fan_in_fan_out`` --, lora_A (r, in), lora_B (out, r).
    """
    with torch.no_grad():
        w = weight.t() if fan_in_fan_out else weight
        directed = torch.addmm(w.to(lora_A.dtype), lora_B, lora_A, alpha=scaling)  # (out, in)
        return torch.linalg.vector_norm(directed, dim=1)


def dora_linear_reference(
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
    result: Tensor | None = None,
    keep: Tensor | None = None,
) -> Tensor:
    """peft's DoRA composition in plain autograd: with ``c = m / ||W + s B A||`` per output (detached),
    ``y = result + (c - 1) * base + c * lora * s``, where ``base`` is ``dropout(x) W^T`` (``x W^T``
    without dropout) and ``lora = B A dropout(x)`` in lora_A's dtype. ``result``: the base layer's own
    output ``x W^T + b`` when the caller has it.

    Shapes: x (..., in), weight (out, in) -- (in, out) with ``fan_in_fan_out`` --, bias (out,) or None,
    lora_A (r, in), lora_B (out, r), magnitude (out,) -> (..., out) in ``result``'s dtype.
    """
    w = weight.t() if fan_in_fan_out else weight  # (out, in)
    if result is None:
        result = F.linear(x, w, bias)
    dtype = lora_A.dtype
    x_lora = x.to(dtype)
    norm = dora_weight_norm(weight, lora_A, lora_B, scaling, fan_in_fan_out=fan_in_fan_out)
    c = magnitude / norm
    if dropout_p > 0.0 and training:
        x_lora = lora_dropout(x_lora, dropout_p, training, keep)
        base = F.linear(x_lora, w.to(dtype))
    else:
        base = result if bias is None else result - bias
    # peft's order, (c * lora) * s: the unscaled product, so not lora_term (whose scaling comes first)
    lora = F.linear(F.linear(x_lora, lora_A), lora_B)
    return (result + (c - 1) * base + c * lora * scaling).to(result.dtype)
