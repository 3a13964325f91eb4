"""peft's composition of a LoRA linear, in plain autograd: the reference the fused op and the CUDA
kernels are checked against, and what runs where neither does (see
:func:`loragen.ops.dispatch.fallback_reason` and :func:`loragen.cuda.unsupported_reason`).

With ``keep`` (the dropout keep-mask the fast op drew), the same composition reproduces a fast op's
dropout exactly; tests hold every op of :mod:`loragen.ops` to it (tests/ops/test_against_reference.py).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

__all__ = ["lora_dropout", "lora_linear_reference", "lora_term"]


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
    """Plain-autograd LoRA linear, composed as peft composes it (``F.linear`` and ``F.dropout``).

    Shapes: x (..., in), weight (out, in) -- (in, out) with ``fan_in_fan_out`` --, bias (out,) or None,
    lora_A (r, in), lora_B (out, r) -> (..., out). The LoRA branch runs in the adapter's dtype and the
    sum is cast back to the base result's dtype. ``keep`` (bool, x's shape) fixes the dropout mask
    (:func:`lora_dropout`).
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
) -> Tensor:
    """The LoRA term of a linear layer, ``scaling * B A dropout(x)``, as peft computes it: x cast to the
    adapter's dtype, dropout (only when ``training``) on the term's input alone; ``keep`` fixes the mask
    (:func:`lora_dropout`).

    Shapes: x (..., in), lora_A (r, in), lora_B (out, r) -> (..., out) in the adapter's dtype.
    """
    x_lora = lora_dropout(x.to(lora_A.dtype), dropout_p, training, keep)
    return F.linear(F.linear(x_lora, lora_A), lora_B) * scaling
