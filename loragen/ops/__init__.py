"""The fused LoRA op and what it is made of.

============ ==========================================================================================
module        concern
============ ==========================================================================================
dispatch      :func:`lora_linear`: the fused CPU op, loragen's CUDA kernels or peft's composition, per call
function      the CPU autograd Function with its hand-written backward (the math is in its docstring)
dora          :func:`dora_linear`: DoRA (use_dora) as one autograd Function, and peft's DoRA composition
(reference    peft's plain-autograd composition: loragen.reference, shared with the CUDA path)
masks         dropout keep-masks as packed bits ("bits" and "philox" generators), row blocks
cpu_kernels   compiled AVX-512 kernels for the masked rank-r products
siblings      LoRA linears reading one input run as one autograd node (planned at conversion)
============ ==========================================================================================

The process-wide switches (fused op on/off, dropout generator, sibling fusion, compiled CPU kernels) are
in :mod:`loragen.switches`.
"""

from __future__ import annotations

from loragen.ops.dispatch import fallback_reason, lora_linear
from loragen.ops.dora_linear import DoraLinearFunction, dora_linear, dora_linear_reference
from loragen.ops.fused_linear import LoraLinearFunction, lora_output
from loragen.ops.masks import DropoutRng, dropout_keep_bits, philox_keep_bits, unpack_keep_mask
from loragen.reference import lora_linear_reference

__all__ = [
    "DoraLinearFunction",
    "DropoutRng",
    "LoraLinearFunction",
    "dora_linear",
    "dora_linear_reference",
    "dropout_keep_bits",
    "fallback_reason",
    "lora_linear",
    "lora_linear_reference",
    "lora_output",
    "philox_keep_bits",
    "unpack_keep_mask",
]
