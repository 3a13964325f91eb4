"""The torch path of the CUDA LoRA op as one composition of torch operations with torch's own autograd.

When a call's kernel variant runs on the torch path (``LORAGEN_CUDA_KERNELS=torch``, a variant that
failed its self-check, or a :class:`~loragen.cuda.torch_kernels.TorchKernels` launcher passed in), the
eager op does not run the four passes one by one through :class:`TorchKernels`: it runs
:func:`lora_linear_torch`, the products peft's composition runs, with torch's autograd -- no Python in
backward, no autograd Function, no per-pass launch, buffer or partial sum -- so that at small batches,
where a step is bound by the host's work per layer, the torch path costs about the host work of peft's
layer. Only the dropout mask is loragen's own (:func:`_keep_for`): the kernels' Philox mask, made on the
device from the op's ``rng`` tensor by one jiterator kernel (:mod:`loragen.cuda.torch_dropout`) and
looked up as a bool keep-mask, so a variant that falls back keeps the exact masks the kernels would have
drawn, ``torch.utils.checkpoint`` recomputes the same mask, and a CUDA graph captured with dropout draws
a fresh mask on every replay. Under ``torch.compile`` the op stays the custom op
(:mod:`loragen.cuda.linear_op`), whose implementation runs the passes on the torch path.

Numerics, shapes as in :mod:`loragen.cuda.linear_op` (x (..., in), A (r, in), B (out, r)), keep the
mask and ks = 1 / (1 - p) (1 without dropout):

    h   = (x * keep) A^T                      float32 (x and the factors taken in float32)
    y   = round(x W^T + bias + (s ks) h B^T)  the base product x W^T in x's dtype, as peft's base layer
                                              rounds it; bias and the rank-r term added to it in float32,
                                              one rounding

as the passes compute them up to float32 rounding (they scale x by ks before the product; float32 x
takes the bias in the base product's epilogue). Backward is autograd's: grad_x = g W + round(keep *
(dh A)) added in x's dtype, dA = dh^T (x * keep), dB = s ks g^T h, all in float32 but g W.

Memory, as peft's composition: autograd keeps the float32 x * keep (or x cast to float32) for dA, where
the kernels read x itself again, and with dropout the bool mask (1 byte per element of x).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from loragen import switches
from loragen.cuda import hostcache, torch_dropout
from loragen.cuda.torch_kernels import BLOCK_ELEMENTS, TorchKernels

__all__ = ["lora_linear_torch", "runs_on_torch_path"]

# (x dtype, device, in, out, rank, launcher handle, kernel switch) -> whether the call runs here
_routes: dict[tuple[Any, ...], bool] = {}


def runs_on_torch_path(x: Tensor, out_features: int, rank: int, handle: int) -> bool:
    """Whether a call with these inputs and launcher (``handle``, :func:`hostcache.launcher_handle`) runs
    on the torch path: the launcher its plan routes the kernel variant to is a whole-op
    :class:`TorchKernels`. Decided once per (dtype, device, sizes but the row count, launcher, switch),
    with the first call's plan (which self-checks a new variant); a variant that fails later, at a launch,
    runs its passes on the torch path through the self-check's guard.

    Raises:
        RuntimeError: the variant is new and a CUDA graph is being captured (the self-check refuses to
            run inside a capture, as the kernel path does).
    """
    key = (x.dtype, x.device, x.shape[-1], out_features, rank, handle, switches.cuda_kernels.get())
    found = _routes.get(key)
    if found is None:
        plan = hostcache.plan(x.reshape(-1, x.shape[-1]), out_features, rank, handle)
        launcher = plan.launcher
        found = _routes[key] = isinstance(launcher, TorchKernels) and launcher.whole_op
    return found


# ---- dropout: the kernels' Philox mask over whole tensors ----------------------------------------------
_PER_CALL = 8  # elements per Philox call


def _keep_for(rng: Tensor, x: Tensor, threshold: int) -> Tensor:
    """The bool keep-mask of x's shape (flat element 0 first) for (seed, offset) = ``rng``, made on x's
    device without the host reading ``rng``: on the jiterator one Philox call per 8 elements writes each
    group's keep bits (:data:`loragen.cuda.torch_dropout.KEEP_BITS_SOURCE`), whose rows in a bool table of
    the 8 bits of each byte value are the group's keep flags (one gather: 1 byte per element written);
    else the torch formulation (:func:`loragen.cuda.torch_dropout.rng_keep_mask`)."""
    device = x.device
    numel = x.numel()
    if device.type in torch_dropout.JIT_DEVICE_TYPES and numel:
        grouped = numel % _PER_CALL == 0
        philox = torch_dropout.jit_function("keep_bits" if grouped else "keep")
        if philox is not None:
            try:
                seed, offset = rng.unbind()  # views: the kernel reads the words on the device
                if grouped:
                    groups, _, flags = torch_dropout.group_numbers_and_flags(device, numel // _PER_CALL)
                    bits = philox(groups, seed, offset, first_group=0, threshold=threshold)  # int64 (G, 1)
                    return torch.embedding(flags, bits).view(x.shape)  # each group's row of 8 flags
                elements = torch.arange(numel, dtype=torch.int64, device=device).view(x.shape)
                return philox(elements, seed, offset, start=0, threshold=threshold).bool()
            except Exception as exc:  # whatever stops the jiterator, the torch formulation gives the same
                torch_dropout.jit_failed(exc)
    step = BLOCK_ELEMENTS  # a multiple of 8: bounds the formulation's int64 temporaries
    if numel <= step:
        return torch_dropout.rng_keep_mask(rng, 0, numel, threshold).view(x.shape)
    spans = [
        torch_dropout.rng_keep_mask(rng, i, min(step, numel - i), threshold) for i in range(0, numel, step)
    ]
    return torch.cat(spans).view(x.shape)


def lora_linear_torch(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    lora_A: Tensor,
    lora_B: Tensor,
    scaling: float,
    rng: Tensor | None,
    threshold: int,
    keep_scale: float,
    fan_in_fan_out: bool,
) -> Tensor:
    """``x W^T + b + scaling * B A dropout(x)`` with torch operations and torch's autograd (see the
    module docstring).

    Shapes: x (..., in), weight (out, in) -- (in, out) with ``fan_in_fan_out`` --, bias (out,) or None,
    lora_A (r, in), lora_B (out, r) -> (..., out) in x's dtype, a fresh tensor. ``rng`` (the int64
    (seed, offset) tensor on x's device, None without dropout), ``threshold`` and ``keep_scale`` are the
    kernels' dropout arguments (:func:`hostcache.dropout_args`). The caller has checked the inputs and
    turned autocast off.
    """
    w = weight.t() if fan_in_fan_out else weight
    f32 = torch.float32  # the casts below are skipped (no dispatch) for tensors already in float32
    x_lora = x  # the LoRA branch's input; the base product reads x itself
    if rng is not None:
        # x times the bool mask, in x's dtype (exact; half the bytes of a float32 product for 16-bit x):
        # autograd keeps the mask (1 byte per element, as peft's dropout does) and masks the gradient
        # alike; 1 / (1 - p) is folded into the scaling of the rank-r term
        x_lora = x * _keep_for(rng, x, threshold)
        scaling = scaling * keep_scale
    x32 = x_lora if x.dtype == f32 else x_lora.float()
    h = F.linear(x32, lora_A if lora_A.dtype == f32 else lora_A.float())  # float32 (..., r)
    b32 = lora_B if lora_B.dtype == f32 else lora_B.float()
    if x.dtype == f32:
        return F.linear(x, w, bias).add_(F.linear(h, b32), alpha=scaling)
    # the base product rounded into x's dtype, then bias + s h B^T added to it in float32 and rounded once
    # (an in-place add onto a 16-bit tensor computes in float32); s folded into B, so that backward scales
    # the float32 gradient of B only, never a 16-bit gradient (the add's alpha would scale g in x's dtype)
    term = F.linear(h, b32 * scaling, None if bias is None else bias.float())
    return F.linear(x, w).add_(term)
