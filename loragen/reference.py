"""peft's composition of a LoRA linear, in plain autograd: the reference the fused op and the CUDA
kernels are checked against, and what runs where neither does (see
:func:`loragen.ops.dispatch.fallback_reason` and :func:`loragen.cuda.unsupported_reason`)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

__all__ = ["lora_linear_reference", "lora_term"]


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
) -> Tensor:
    """Plain-autograd LoRA linear, composed as peft composes it (``F.linear`` and ``F.dropout``).

    Shapes: x (..., in), weight (out, in) -- (in, out) with ``fan_in_fan_out`` --, bias (out,) or None,
    lora_A (r, in), lora_B (out, r) -> (..., out). The LoRA branch runs in the adapter's dtype and the
    sum is cast back to the base result's dtype.
    """
    result = F.linear(x, weight.t() if fan_in_fan_out else weight, bias)
    return (result + lora_term(x, lora_A, lora_B, scaling, dropout_p, training)).to(result.dtype)


def lora_term(
    x: Tensor, lora_A: Tensor, lora_B: Tensor, scaling: float, dropout_p: float, training: bool
) -> Tensor:
    """The LoRA term of a linear layer, ``scaling * B A dropout(x)``, as peft computes it: x cast to the
    adapter's dtype, dropout (only when ``training``) on the term's input alone.

    Shapes: x (..., in), lora_A (r, in), lora_B (out, r) -> (..., out) in the adapter's dtype.
    """
    x_lora = x.to(lora_A.dtype)
    if dropout_p > 0 and training:
        x_lora = F.dropout(x_lora, dropout_p, True)
    return F.linear(F.linear(x_lora, lora_A), lora_B) * scaling
