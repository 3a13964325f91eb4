"""``lora_linear``: where a LoRA linear runs — the fused CPU op, loragen's CUDA kernels, or peft's
plain composition — chosen per call from the device, the switches and what the fused op can take."""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from loragen import cuda, switches
from loragen.ops.fused_linear import LoraLinearFunction
from loragen.ops.masks import DropoutRng, check_rng
from loragen.reference import lora_linear_reference

__all__ = ["fallback_reason", "lora_linear"]

_log = logging.getLogger(__name__)


def fallback_reason(x: Tensor, dropout: bool) -> str | None:
    """Why :func:`lora_linear` runs :func:`lora_linear_reference` instead of the fused CPU op for a
    CPU tensor ``x``, or None when the fused op runs.

    Under autocast the composition (made of ``F.linear``) keeps autocast's per-op dtypes. Under
    ``torch.compile`` with dropout, dynamo cannot trace the numpy mask generator, and inductor fuses
    the composition's dropout itself; without dropout the fused op compiles (no graph break).
    """
    if torch.is_autocast_enabled(x.device.type):
        return "autocast is enabled: the composition keeps autocast's per-op dtypes"
    if dropout and torch.compiler.is_compiling():
        return "torch.compile with dropout: the numpy mask generator cannot be traced"
    return None


_logged_reasons: set[str] = set()


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
    rng: DropoutRng | None = None,
    seed: int | None = None,
) -> Tensor:
    """LoRA linear ``x W^T + b + scaling * B A dropout(x)``: the fused op.

    Shapes: x (..., in), weight (out, in) -- (in, out) with ``fan_in_fan_out`` (transformers'
    ``Conv1D``) --, bias (out,) or None, lora_A (r, in), lora_B (out, r) -> (..., out) in x's dtype. The
    LoRA branch is computed in lora_A's dtype (x cast to it, as peft does) and added to the base result
    with one rounding. Dropout (probability ``dropout_p``, only when ``training``) applies to the LoRA
    branch only, with inverted scaling. Gradients flow to every input that requires them, the base
    weight and bias included.

    CPU tensors run :class:`LoraLinearFunction`; CUDA tensors run loragen's kernels when
    :func:`loragen.cuda.is_available`; the plain composition (:func:`lora_linear_reference`) runs
    with ``switches.fused`` off, on other devices and for the reasons of :func:`fallback_reason`.

    Args:
        rng: CPU dropout mask generator, "bits" or "philox" (default: :data:`loragen.switches.dropout_rng`).
        seed: fixes the dropout mask (tests, gradcheck); None draws one from torch's CPU generator.

    Raises:
        ValueError: ``dropout_p`` outside [0, 1) or an unknown ``rng``.
    """
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"loragen.ops.lora_linear: dropout_p={dropout_p!r}; expected 0 <= p < 1")
    if rng is not None:
        check_rng(rng)
    args = (x, weight, bias, lora_A, lora_B, scaling, dropout_p, training)
    if not switches.fused.get():
        return lora_linear_reference(*args, fan_in_fan_out=fan_in_fan_out)
    if not x.is_cpu:
        if x.is_cuda and cuda.is_available():
            return cuda.lora_linear_cuda(*args, fan_in_fan_out=fan_in_fan_out, seed=seed)
        return lora_linear_reference(*args, fan_in_fan_out=fan_in_fan_out)
    if rng is None:  # the CPU masks' generator
        rng = switches.dropout_rng.get()  # type: ignore[assignment]
    dropout = training and dropout_p > 0.0
    reason = fallback_reason(x, dropout)
    if reason is not None:
        if reason not in _logged_reasons and not torch.compiler.is_compiling():  # a log call breaks the graph
            _logged_reasons.add(reason)
            _log.info("loragen.ops.lora_linear runs the plain composition: %s", reason)
        return lora_linear_reference(*args, fan_in_fan_out=fan_in_fan_out)
    p = dropout_p if dropout else 0.0
    return LoraLinearFunction.apply(x, weight, bias, lora_A, lora_B, scaling, p, rng, seed, fan_in_fan_out)
