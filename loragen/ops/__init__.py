"""The CPU autograd ops of LoRA layers, each with a hand-written backward (:mod:`~loragen.ops.fused`:
``lora_linear``, ``lora_branch``, ``dora_linear``), with dropout masks as packed bits
(:mod:`~loragen.ops.masks`) and compiled masked products (:mod:`~loragen.ops.cpu_kernels`).
References: :mod:`loragen.reference`.
"""

from __future__ import annotations

from loragen.ops.fused import (
    DoraLinearFunction,
    LoraBranchFunction,
    LoraLinearFunction,
    dora_linear,
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
