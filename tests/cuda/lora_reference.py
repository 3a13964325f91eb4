"""float64 reference for the CUDA LoRA op tests (emulated and on a GPU)."""

from __future__ import annotations

import torch

from loragen import philox
from loragen.cuda.linear_op import draw_rng
from loragen.cuda.selfcheck import rng_values

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


def make_inputs(n, k, o, r, dtype, *, bias=True, fan_in_fan_out=False, seed=0, device="cpu"):
    """Fresh random inputs in ``dtype`` on ``device`` (leaves with grads) and float64 CPU copies."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=g)
    w = torch.randn(o, k, generator=g) / k**0.5
    b = torch.randn(o, generator=g) if bias else None
    a = torch.randn(r, k, generator=g) / k**0.5
    bb = torch.randn(o, r, generator=g)
    if fan_in_fan_out:
        w = w.t().contiguous()
    low = [None if t is None else t.to(device=device, dtype=dtype).requires_grad_() for t in (x, w, b, a, bb)]
    high = [None if t is None else t.detach().cpu().double().requires_grad_() for t in low]
    return low, high


def reference(x, w, b, a, bb, scaling, keep, fan_in_fan_out):
    """float64 LoRA linear; ``keep`` is the dropout mask already divided by (1 - p), or None."""
    base = x @ (w if fan_in_fan_out else w.t())
    if b is not None:
        base = base + b
    xd = x if keep is None else x * keep
    return base + scaling * (xd @ a.t()) @ bb.t()


def mask_for(rng_state, shape, p, device="cpu"):
    """The scaled mask lora_linear_cuda draws when the RNG of ``device`` (torch's CPU generator, or the
    CUDA generator for "cuda") is in ``rng_state`` (None if p == 0)."""
    if p == 0:
        return None
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_rng_state(rng_state, device)
    else:
        torch.set_rng_state(rng_state)
    seed, offset = rng_values(draw_rng(device))
    return philox.dropout_keep_mask(shape, p, seed, offset).double() / (1 - p)


def relative_error(got, want):
    """||got - want|| / ||want|| in float64 on the CPU, or ||got|| where want is exactly zero (a gradient
    whose every input was dropped); NaN stays NaN and fails every bound."""
    diff = (got.detach().cpu().double() - want.detach()).norm()
    scale = want.detach().norm()
    return (diff / scale).item() if scale > 0 else diff.item()
