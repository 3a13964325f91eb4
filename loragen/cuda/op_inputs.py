"""What the CUDA LoRA op accepts, and the dropout rng tensors it takes: the checks that word a bad
argument's error, the reasons the kernels hand an input to the plain composition, and the (seed, offset)
tensor drawn per forward or made from an explicit seed.

Shapes as in :mod:`loragen.cuda.linear_op`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from loragen.cuda import kernel_variants
from loragen.cuda.passes import DTYPE_NAMES
from loragen.cuda.torch_dropout import rng_tensor
from loragen.errors import LoraError

__all__ = [
    "CudaLoraError",
    "autocast_anywhere",
    "autocast_dtype",
    "check_inputs",
    "draw_rng",
    "seed_rng",
    "unsupported_reason",
]

_WHERE = "loragen.cuda.lora_linear_cuda"


class CudaLoraError(LoraError, ValueError):
    """Inputs the CUDA LoRA op cannot take; the message names the argument and what is accepted."""


def unsupported_reason(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    lora_A: Tensor,
    lora_B: Tensor,
    *,
    fan_in_fan_out: bool = False,
) -> str | None:
    """Why the CUDA kernels cannot run on these inputs, or None when they can.

    :func:`lora_linear_cuda` falls back to the plain composition for the reasons returned here.
    """
    if x.dtype not in DTYPE_NAMES:
        return f"x dtype {x.dtype} (kernels exist for float32, float16, bfloat16)"
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        return f"base weight/bias dtype differs from x ({x.dtype})"
    if lora_A.dtype not in DTYPE_NAMES or lora_B.dtype not in DTYPE_NAMES:
        return f"LoRA dtype {lora_A.dtype}/{lora_B.dtype} (expected float32, float16 or bfloat16)"
    if not 1 <= lora_A.shape[0] <= kernel_variants.MAX_RANK:
        return f"rank r={lora_A.shape[0]} (the kernels take 1 <= r <= {kernel_variants.MAX_RANK})"
    features = (x.shape[-1], weight.shape[0], weight.shape[1])
    if max(features) >= 2**31:
        return "a feature dimension of 2**31 or more"
    if 0 in features:
        return "a feature dimension of 0 (no grid to launch)"
    if x.numel() // max(x.shape[-1], 1) >= 2**31:
        return "2**31 or more rows (the kernels take row counts as 32-bit int)"
    return None


def _devices(tensors: tuple[Tensor | None, ...]) -> str:
    names = ("x", "weight", "bias", "lora_A", "lora_B")
    return ", ".join(f"{n}: {t.device}" for n, t in zip(names, tensors) if t is not None)


def check_inputs(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    lora_A: Tensor,
    lora_B: Tensor,
    fan_in_fan_out: bool,
    p: float,
    require_cuda: bool,
) -> None:
    """Raise :class:`CudaLoraError` naming the first bad argument; messages are built only on failure."""
    if not 0.0 <= p < 1.0:
        raise CudaLoraError(f"{_WHERE}: dropout_p={p!r}; expected 0 <= p < 1")
    device = x.device
    if (
        (require_cuda and device.type != "cuda")
        or weight.device != device
        or lora_A.device != device
        or lora_B.device != device
        or (bias is not None and bias.device != device)
    ):
        raise CudaLoraError(
            f"{_WHERE}: all tensors must be on one CUDA device, got {_devices((x, weight, bias, lora_A, lora_B))}"
        )
    in_features = x.shape[-1]
    if weight.dim() != 2 or weight.shape[0 if fan_in_fan_out else 1] != in_features:
        layout = "(in, out) with fan_in_fan_out" if fan_in_fan_out else "(out, in)"
        raise CudaLoraError(
            f"{_WHERE}: weight {tuple(weight.shape)} is not {layout} for x (..., {in_features})"
        )
    out_features = weight.shape[1 if fan_in_fan_out else 0]
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != out_features):
        raise CudaLoraError(f"{_WHERE}: bias {tuple(bias.shape)}; expected ({out_features},)")
    r = lora_A.shape[0]
    if lora_A.dim() != 2 or lora_A.shape[1] != in_features:
        raise CudaLoraError(f"{_WHERE}: lora_A {tuple(lora_A.shape)}; expected (r, {in_features})")
    if lora_B.dim() != 2 or lora_B.shape[0] != out_features or lora_B.shape[1] != r:
        raise CudaLoraError(
            f"{_WHERE}: lora_B {tuple(lora_B.shape)}; expected ({out_features}, {r}) for r={r}"
        )


#: Whether autocast is on for any device: torch's own argument-free check where it has one (a hot path
#: asks this before :func:`autocast_dtype`, which it then need not call in the common case).
autocast_anywhere = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)


def autocast_dtype(x: Tensor) -> torch.dtype | None:
    """The dtype the op casts x, weight and bias to under autocast on x's device (as ``F.linear`` takes
    them there), or None where autocast is off for x's device.

    The op runs on CUDA tensors; loragen's CPU tests run it on CPU tensors, which follow the same rule
    with the CPU's autocast (and its host benchmarks on meta tensors, which have no autocast).
    """
    if not autocast_anywhere():  # one call without arguments: the common case costs next to nothing
        return None
    if x.is_cuda:
        device = "cuda"
    elif x.is_cpu:
        device = "cpu"
    else:
        return None
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


def draw_rng(device: torch.device) -> Tensor:
    """A fresh (seed, offset) pair for one forward's dropout mask: int64 (2,) on ``device``, drawn by
    torch's generator of that device (the CUDA generator on a GPU: safe inside CUDA-graph capture, fresh
    values on every replay)."""
    return torch.randint(0, (1 << 63) - 1, (2,), dtype=torch.int64, device=device)


def seed_rng(seed: int, device: torch.device, offset: int = 0) -> Tensor:
    """The rng tensor for an explicit unsigned 64-bit ``seed`` and ``offset`` (stored as int64 bits),
    made on ``device`` without a host-to-device copy (so without waiting for the device).

    Raises:
        CudaLoraError: ``seed`` or ``offset`` is not an unsigned 64-bit integer.
    """
    for name, value in (("seed", seed), ("offset", offset)):
        if not 0 <= value < 1 << 64:
            raise CudaLoraError(f"{_WHERE}: {name}={value}; expected an unsigned 64-bit integer")
    return rng_tensor(seed, offset, device)  # filled on the device: no host-to-device copy
