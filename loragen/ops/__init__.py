"""The CPU autograd ops of LoRA layers, each with a hand-written backward: :mod:`~loragen.ops.fused`
(``lora_linear``, ``lora_branch``), :mod:`~loragen.ops.dora` (``dora_linear``),
:mod:`~loragen.ops.expert_products` (MoE expert stacks), :mod:`~loragen.ops.masks` (dropout masks as
packed bits) and :mod:`~loragen.ops.cpu_kernels` (compiled masked products). References:
:mod:`loragen.reference`.
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
