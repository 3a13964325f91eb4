"""The 8-bit AdamW step on CUDA: :func:`loragen.training.adamw8bit.adamw8bit_update_` as one kernel launch.

The kernel (``kernels/adamw8bit.cu.j2``) runs one CUDA block per quantization block and reproduces the
torch path's arithmetic operation by operation, so both store the same codes up to float32 roundings of
the update (and values on a midpoint of the table up to those roundings).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from loragen.cuda.kernels import (
    ADAMW8BIT,
    DTYPE_NAMES,
    KernelLauncher,
    max_optimizer_block,
    optimizer_variant,
)
from loragen.cuda.launch import default_launcher

__all__ = ["adamw8bit_update_cuda", "kernel_supports"]

_STATE_DTYPES = {
    "exp_avg_codes": torch.uint8,
    "exp_avg_absmax": torch.float32,
    "exp_avg_sq_codes": torch.uint8,
    "exp_avg_sq_absmax": torch.float32,
}


def kernel_supports(
    param: Tensor, grad: Tensor, state: dict[str, Any], signed_code: Tensor, unsigned_code: Tensor
) -> bool:
    """Whether the kernel can run this update (else the torch path does it); never synchronizes. It
    needs contiguous tensors on one device in the layout :class:`loragen.training.adamw8bit.AdamW8bit`
    creates, blocks of at most :func:`~loragen.cuda.kernels.max_optimizer_block` elements."""
    if param.dtype not in DTYPE_NAMES or grad.dtype != param.dtype or grad.shape != param.shape:
        return False
    if not param.is_contiguous() or grad.is_sparse:
        return False
    tensors = [grad, signed_code, unsigned_code]
    for key, dtype in _STATE_DTYPES.items():
        value = state.get(key)
        if not isinstance(value, Tensor) or value.dtype != dtype or not value.is_contiguous():
            return False
        tensors.append(value)
    if any(t.device != param.device for t in tensors):
        return False
    for table in (signed_code, unsigned_code):
        if table.dtype != torch.float32 or table.shape != (256,) or not table.is_contiguous():
            return False
    codes = state["exp_avg_codes"]
    if codes.dim() != 2 or state["exp_avg_sq_codes"].shape != codes.shape:
        return False
    n_blocks, block_size = codes.shape
    return (
        0 < block_size <= max_optimizer_block(ADAMW8BIT)
        and n_blocks == -(-param.numel() // block_size)
        and state["exp_avg_absmax"].shape == (n_blocks,)
        and state["exp_avg_sq_absmax"].shape == (n_blocks,)
    )


def adamw8bit_update_cuda(
    param: Tensor,
    grad: Tensor,
    state: dict[str, Any],
    *,
    signed_code: Tensor,
    unsigned_code: Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    launcher: KernelLauncher | None = None,
) -> bool:
    """One AdamW step with 8-bit moments as one kernel launch on PyTorch's current stream, in place.

    Same arguments and state layout as :func:`loragen.training.adamw8bit.adamw8bit_update_`;
    ``launcher`` defaults to the process-wide driver launcher.

    Returns:
        ``True`` when the kernel ran, ``False`` (nothing changed) when :func:`kernel_supports` refuses
        the inputs and the caller should run the torch path.
    """
    if not kernel_supports(param, grad, state, signed_code, unsigned_code):
        return False
    n_blocks, block_size = state["exp_avg_codes"].shape
    if n_blocks == 0:
        return True
    variant = optimizer_variant(DTYPE_NAMES[param.dtype])
    states = [state[key] for key in _STATE_DTYPES]  # m codes, m absmax, v codes, v absmax
    tensors = (param.detach(), grad.detach().contiguous(), *states, signed_code, unsigned_code)
    decay = 1.0 - lr * weight_decay if weight_decay else 1.0
    sqrt_correction2 = math.sqrt(1.0 - beta2**step)
    step_size = lr / (1.0 - beta1**step)
    hyper = (1.0 - beta1, beta2, 1.0 - beta2, eps, sqrt_correction2, decay, -step_size)
    args = (*tensors, param.numel(), block_size, *hyper)
    (launcher or default_launcher()).launch(ADAMW8BIT, variant, (n_blocks, 1), args, param.device)
    # the kernel writes through a raw pointer: tell autograd and version-keyed caches, as an in-place op does
    torch.autograd.graph.increment_version(param)
    return True
