"""The CPU autograd ops of LoRA layers, each with a hand-written backward.

=============== =======================================================================================
module           concern
=============== =======================================================================================
fused            :func:`lora_linear` (the whole LoRA linear; CUDA tensors go to :mod:`loragen.cuda`) and
                 :func:`lora_branch` (the term added onto a base output computed elsewhere: quantized bases)
dora             :func:`dora_linear`: DoRA as one autograd node
expert_products  LoRA on targeted parameters (MoE expert stacks) in weight space
masks            dropout keep-masks as packed bits, row blocks
cpu_kernels      compiled kernels (AVX-512 and AVX2 builds) for the masked rank-r products
=============== =======================================================================================

peft's plain compositions, every op's reference and the fallback where an op does not run, are
:mod:`loragen.reference`. The switches (fused op on/off, compiled CPU kernels) are :mod:`loragen.switches`.
"""

from __future__ import annotations

from loragen.ops.dora import DoraLinearFunction, dora_linear
from loragen.ops.fused import (
    LoraBranchFunction,
    LoraLinearFunction,
    fallback_reason,
    lora_branch,
    lora_linear,
)
from loragen.ops.masks import dropout_keep_bits, unpack_keep_mask
from loragen.reference import dora_linear_reference, lora_linear_reference

__all__ = [
    "DoraLinearFunction",
    "LoraBranchFunction",
    "LoraLinearFunction",
    "dora_linear",
    "dora_linear_reference",
    "dropout_keep_bits",
    "fallback_reason",
    "lora_branch",
    "lora_linear",
    "lora_linear_reference",
    "unpack_keep_mask",
]
