"""The torch path of the CUDA LoRA op as one composition of torch operations with torch's own autograd.

When a call's kernel variant runs on the torch path (``LORAGEN_CUDA_KERNELS=torch``, a variant that
failed its self-check, or a :class:`~loragen.cuda.torch_kernels.TorchKernels` launcher passed in), the
eager op does not run the four passes one by one through :class:`TorchKernels`: it runs
:func:`lora_linear_torch`, the few products peft's composition runs, with native autograd -- no Python
in backward, no per-pass launch, buffer or partial sum -- so that at small batches, where a step is bound
by the host's work per layer, the torch path costs no more host work than peft's layer. Only the dropout
mask is loragen's own (:class:`_PhiloxDropout`): the kernels' Philox mask, made on the device from the
op's ``rng`` tensor (:mod:`loragen.cuda.torch_dropout`), so a variant that falls back keeps the exact
masks the kernels would have drawn, ``torch.utils.checkpoint`` recomputes the same mask, and a CUDA graph
captured with dropout draws a fresh mask on every replay. Under ``torch.compile`` the op stays the custom
op (:mod:`loragen.cuda.linear_op`), whose implementation runs the passes on the torch path.

Numerics, shapes as in :mod:`loragen.cuda.linear_op` (x (..., in), A (r, in), B (out, r)):

    h   = dropout(x) A^T                 float32 (x and the factors taken in float32)
    y   = round(x W^T + bias + s h B^T)  the base product x W^T in x's dtype, as peft's base layer rounds
                                         it; bias and the rank-r term added to it in float32, one rounding

as the passes compute them (float32 x: the bias in the base product's epilogue and the term added in
float32, equal to float32 rounding). Backward is autograd's: grad_x = g W + round(dropout(dh A)) added in
x's dtype, dA = dh^T dropout(x), dB = s g^T h, all products in float32 but g W.

Memory, as peft's composition: autograd keeps the float32 dropout(x) (or x cast to float32) for dA,
where the kernels regenerate it from x; with dropout, also the keep bits, 1 byte per element of x (a
bool mask's size).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from loragen import switches
from loragen.cuda import hostcache, torch_dropout
from loragen.cuda.torch_kernels import TorchKernels

__all__ = ["lora_linear_torch", "runs_on_torch_path"]

# (x dtype, device, in, out, rank, launcher handle, kernel switch) -> whether the call runs here
_routes: dict[tuple[Any, ...], bool] = {}


def runs_on_torch_path(x: Tensor, out_features: int, rank: int, handle: int) -> bool:
    """Whether a call with these inputs and launcher (``handle``, :func:`hostcache.launcher_handle`) runs
    on the torch path: the launcher its plan routes the kernel variant to is a whole-op
    :class:`TorchKernels`. Decided once per (dtype, device, sizes but the row count, launcher, switch),
    with the first call's plan (which self-checks a new variant); a variant that fails later, at a launch,
    runs its passes on the torch path through the self-check's guard."""
    key = (x.dtype, x.device, x.shape[-1], out_features, rank, handle, switches.cuda_kernels.get())
    found = _routes.get(key)
    if found is None:
        plan = hostcache.plan(x.reshape(-1, x.shape[-1]), out_features, rank, handle)
        launcher = plan.launcher
        found = _routes[key] = isinstance(launcher, TorchKernels) and launcher.whole_op
    return found


# ---- dropout: the kernels' Philox mask over whole tensors ----------------------------------------------
# What masks tensors shaped like x: on the jiterator, (keep bits, lane numbers, grouped) -- one Philox call
# per 8 elements, 1 byte per element (:mod:`loragen.cuda.torch_dropout`) --; else the bool keep-mask of
# the torch formulation.
_Keep = tuple[Tensor, Tensor, bool] | Tensor
_PER_CALL = 8


def _keep_for(rng: Tensor, x: Tensor, threshold: int) -> _Keep:
    """The keep-mask of x's elements (flat element 0 first) for (seed, offset) = ``rng``, made on x's
    device without the host reading ``rng``."""
    device = x.device
    numel = x.numel()
    if device.type in torch_dropout.JIT_DEVICE_TYPES and numel:
        grouped = numel % _PER_CALL == 0
        philox = torch_dropout.jit_function("keep_bits" if grouped else "keep")
        if philox is not None:
            try:
                seed, offset = rng.unbind()  # views: the kernel reads the words on the device
                if grouped:
                    groups, lanes = torch_dropout.group_numbers(device, numel // _PER_CALL)
                    return philox(groups, seed, offset, first_group=0, threshold=threshold), lanes, True
                elements = torch.arange(numel, dtype=torch.int64, device=device).view(x.shape)
                lanes = torch.zeros(1, dtype=torch.float32, device=device)  # each element's flag is lane 0
                return philox(elements, seed, offset, start=0, threshold=threshold), lanes, False
            except Exception as exc:  # whatever stops the jiterator, the torch formulation gives the same
                torch_dropout.jit_failed(exc)
    return torch_dropout.rng_keep_mask(rng, 0, numel, threshold).view(x.shape)


def _masked(values: Tensor, keep: _Keep, keep_scale: float) -> Tensor:
    """float32 ``values * keep_scale`` where kept, 0 where dropped (a fresh tensor of values' shape)."""
    if isinstance(keep, Tensor):
        return torch.where(keep, values.float() * keep_scale, 0.0)
    bits, lanes, grouped = keep
    apply = torch_dropout.jit_function("apply")
    if apply is not None:
        try:
            if not grouped:
                return apply(values, bits, lanes, keep_scale=keep_scale)
            flat = values.contiguous().view(-1, _PER_CALL)
            return apply(flat, bits, lanes, keep_scale=keep_scale).view(values.shape)
        except Exception as exc:  # the keep bits hold the mask: the torch formulation applies them
            torch_dropout.jit_failed(exc)
    kept = ((bits >> lanes.to(torch.int64)) & 1).bool().reshape(values.shape)
    return torch.where(kept, values.float() * keep_scale, 0.0)


class _Masked(torch.autograd.Function):
    """x (any shape, any dtype) -> float32 x * keep / (1 - p) for a keep-mask made beforehand
    (:func:`_keep_for`); its own adjoint: backward masks the gradient alike (one elementwise kernel on the
    jiterator), through this Function again when backward is differentiated."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, keep: _Keep, keep_scale: float) -> Tensor:
        # the mask stays on ctx (1 byte per element on the jiterator, a bool per element else): backward
        # reuses it instead of running the Philox kernel again
        ctx.keep, ctx.keep_scale, ctx.dtype = keep, keep_scale, x.dtype
        return _masked(x, keep, keep_scale)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        if torch.is_grad_enabled():  # backward is being differentiated
            masked = _Masked.apply(grad, ctx.keep, ctx.keep_scale)
        else:
            masked = _masked(grad, ctx.keep, ctx.keep_scale)
        return masked if ctx.dtype == torch.float32 else masked.to(ctx.dtype), None, None


def _f32(t: Tensor) -> Tensor:
    return t if t.dtype == torch.float32 else t.float()


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
    if rng is None:
        x32 = _f32(x)
    else:
        x32 = _Masked.apply(x, _keep_for(rng, x, threshold), keep_scale)
    h = F.linear(x32, _f32(lora_A))  # float32 (..., r)
    if x.dtype == torch.float32:
        return F.linear(x, w, bias).add_(F.linear(h, lora_B), alpha=scaling)
    # the base product rounded into x's dtype, then bias + s h B^T added to it in float32 and rounded once
    # (an in-place add onto a 16-bit tensor computes in float32); s folded into B, so that backward scales
    # the float32 gradient of B only, never a 16-bit gradient (the add's alpha would scale g in x's dtype)
    term = F.linear(h, _f32(lora_B) * scaling, None if bias is None else bias.float())
    return F.linear(x, w).add_(term)
