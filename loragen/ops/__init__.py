"""The fused LoRA op and what it is made of.

=============== =======================================================================================
module           concern
=============== =======================================================================================
dispatch         :func:`lora_linear`: the fused CPU op, loragen's CUDA kernels or peft's composition, per call
fused_linear     the CPU autograd Function of a LoRA linear, hand-written backward (the math in its docstring)
branch           the LoRA term alone, added onto a base output computed elsewhere (quantized bases)
dora_linear      :func:`dora_linear`: DoRA as one autograd Function
siblings         LoRA linears reading one input run as one autograd node (the plan is made at conversion,
                 by loragen.sibling_planning)
expert_products  LoRA on targeted parameters (MoE expert stacks) in weight space
masks            dropout keep-masks as packed bits ("bits" and "philox" generators), row blocks
cpu_kernels      compiled kernels (AVX-512 and AVX2 builds) for the masked rank-r products
(reference       peft's plain-autograd compositions, every fast op's reference: loragen.reference)
=============== =======================================================================================

The process-wide switches (fused op on/off, dropout generator, sibling fusion, compiled CPU kernels) are
in :mod:`loragen.switches`.
"""

from __future__ import annotations

from loragen.ops.dispatch import fallback_reason, lora_linear
from loragen.ops.dora_linear import DoraLinearFunction, dora_linear
from loragen.ops.fused_linear import LoraLinearFunction, lora_output
from loragen.ops.masks import DropoutRng, dropout_keep_bits, philox_keep_bits, unpack_keep_mask
from loragen.reference import dora_linear_reference, lora_linear_reference

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
