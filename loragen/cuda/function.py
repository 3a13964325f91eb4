"""The LoRA linear op on CUDA: loragen's kernels for the rank-r part, cuBLAS for the base GEMMs.

Shapes: x (N, in) after flattening, weight (out, in) -- (in, out) with ``fan_in_fan_out`` --,
A (r, in), B (out, r), h = dropout(x) A^T (N, R) in float32, R = the rank bucket (columns past r are 0).

forward   h   = lora_down(x)                        one pass over x, Philox mask regenerated
          y   = lora_up(h)  = bias + s h B^T        one write of y
          y  += x W^T                               cuBLAS, beta = 1: no extra pass over y
backward  dh, dB = lora_grad_out(g)                 one pass over g (dh carries s)
          gx, dA   = lora_grad_in(x, dh)            one pass over x, mask regenerated; gx = (dh A) * mask / (1-p)
          gx += g W                                 cuBLAS, beta = 1
          dW = g^T x, db = sum(g)                   only when the base is trainable

Split reductions come back as float32 partial sums that torch adds up (deterministic: no atomics).
LoRA parameters may be float32 (peft's default for 16-bit models) or x's dtype; the kernels read them
as float32 and accumulate in float32, and the rank-r terms are rounded once into x's dtype.

Dropout: the seed is drawn from torch's CPU generator per call, so ``torch.manual_seed`` reproduces a
run and ``torch.utils.checkpoint`` recomputes the same mask; :func:`loragen.philox.dropout_keep_mask`
gives the identical mask on the CPU. Under CUDA-graph capture with active dropout the op refuses to run:
the seed would be frozen into the graph and every replay would drop the same elements.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from loragen import philox
from loragen.cuda import specs
from loragen.cuda.launch import KernelLauncher, default_launcher
from loragen.cuda.specs import LORA_DOWN, LORA_GRAD_IN, LORA_GRAD_OUT, LORA_UP, Variant
from loragen.reference import lora_linear_reference

__all__ = ["CudaLoraError", "LoraLinearCudaFunction", "lora_linear_cuda", "unsupported_reason"]

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


class CudaLoraError(ValueError):
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
    if x.dtype not in _DTYPE_NAMES:
        return f"x dtype {x.dtype} (kernels exist for float32, float16, bfloat16)"
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        return f"base weight/bias dtype differs from x ({x.dtype})"
    if lora_A.dtype not in _DTYPE_NAMES or lora_B.dtype not in _DTYPE_NAMES:
        return f"LoRA dtype {lora_A.dtype}/{lora_B.dtype} (expected float32, float16 or bfloat16)"
    if not 1 <= lora_A.shape[0] <= specs.MAX_RANK:
        return f"rank r={lora_A.shape[0]} (the kernels take 1 <= r <= {specs.MAX_RANK})"
    if max(x.shape[-1], weight.shape[0], weight.shape[1]) >= 2**31:
        return "a feature dimension of 2**31 or more"
    return None


def _check_inputs(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    lora_A: Tensor,
    lora_B: Tensor,
    fan_in_fan_out: bool,
    p: float,
    require_cuda: bool,
) -> None:
    where = "loragen.cuda.lora_linear_cuda"
    if not 0.0 <= p < 1.0:
        raise CudaLoraError(f"{where}: dropout_p={p!r}; expected 0 <= p < 1")
    tensors = {"x": x, "weight": weight, "lora_A": lora_A, "lora_B": lora_B}
    if bias is not None:
        tensors["bias"] = bias
    devices = {name: t.device for name, t in tensors.items()}
    if (require_cuda and x.device.type != "cuda") or len(set(devices.values())) != 1:
        raise CudaLoraError(f"{where}: all tensors must be on one CUDA device, got {devices}")
    in_features = x.shape[-1]
    out_features, w_in = (weight.shape[1], weight.shape[0]) if fan_in_fan_out else tuple(weight.shape)
    layout = "(in, out) with fan_in_fan_out" if fan_in_fan_out else "(out, in)"
    if weight.dim() != 2 or w_in != in_features:
        raise CudaLoraError(
            f"{where}: weight {tuple(weight.shape)} is not {layout} for x (..., {in_features})"
        )
    if bias is not None and tuple(bias.shape) != (out_features,):
        raise CudaLoraError(f"{where}: bias {tuple(bias.shape)}; expected ({out_features},)")
    r = lora_A.shape[0]
    if lora_A.dim() != 2 or lora_A.shape[1] != in_features:
        raise CudaLoraError(f"{where}: lora_A {tuple(lora_A.shape)}; expected (r, {in_features})")
    if tuple(lora_B.shape) != (out_features, r):
        raise CudaLoraError(
            f"{where}: lora_B {tuple(lora_B.shape)}; expected ({out_features}, {r}) for r={r}"
        )


def _aligned16(t: Tensor) -> Tensor:
    """``t`` itself, or a fresh copy when its data is not 16-byte aligned (vector loads need it)."""
    return t if t.data_ptr() % 16 == 0 else t.clone()


class _Plan:
    """What forward decides and backward reuses."""

    def __init__(self, x2: Tensor, out_features: int, rank: int, launcher: KernelLauncher) -> None:
        self.rows, self.in_features = x2.shape
        self.out_features = out_features
        self.rank = rank
        aligned = self.in_features % 8 == 0 and out_features % 8 == 0
        self.variant = Variant(_DTYPE_NAMES[x2.dtype], specs.rank_bucket(rank), aligned)
        self.launcher = launcher
        self.device = x2.device
        self.target_blocks = launcher.target_blocks(x2.device)

    def prepare(self, t: Tensor) -> Tensor:
        t = t.contiguous()
        return _aligned16(t) if self.variant.aligned else t


class LoraLinearCudaFunction(torch.autograd.Function):
    """One autograd node for the whole LoRA linear; see the module docstring for the passes.

    ``apply(x, weight, bias, lora_A, lora_B, scaling, dropout_p, seed, fan_in_fan_out, launcher)``;
    ``dropout_p = 0`` means no dropout (``seed`` is then ignored).
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        lora_A: Tensor,
        lora_B: Tensor,
        scaling: float,
        dropout_p: float,
        seed: int,
        fan_in_fan_out: bool,
        launcher: KernelLauncher,
    ) -> Tensor:
        out_features = weight.shape[1] if fan_in_fan_out else weight.shape[0]
        x2 = x.reshape(-1, x.shape[-1])
        plan = _Plan(x2, out_features, lora_A.shape[0], launcher)
        x2 = plan.prepare(x2)
        # (R, in) and (R, out), padded to the rank bucket: rows r..R-1 are zero
        a32 = plan.prepare(specs.pad_rank(lora_A.detach().float(), plan.variant))
        bt32 = plan.prepare(specs.pad_rank(lora_B.detach().float().t(), plan.variant))
        dropout = (
            (seed, 0, philox.keep_threshold(dropout_p), philox.keep_scale(dropout_p))
            if dropout_p > 0
            else (0, 0, 0, 1.0)
        )

        h = _down(plan, x2, a32, dropout)
        out = torch.empty(plan.rows, out_features, dtype=x.dtype, device=x.device)
        if plan.rows:
            b = None if bias is None else plan.prepare(bias.detach())
            launcher.launch(
                LORA_UP,
                plan.variant,
                specs.plan_up(plan.rows, out_features, plan.variant),
                (h, bt32, b, out, plan.rows, out_features, plan.rank, float(scaling)),
                x.device,
            )
        out.addmm_(x2, weight if fan_in_fan_out else weight.t())  # the base GEMM accumulates onto it

        ctx.plan = plan
        ctx.scaling = float(scaling)
        ctx.dropout = dropout
        ctx.fan_in_fan_out = fan_in_fan_out
        ctx.x_shape = x.shape
        ctx.lora_params = (a32, bt32)
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x2, weight, lora_A, lora_B, h)
        return out.view(*x.shape[:-1], out_features)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        x2, weight, lora_A, lora_B, h = ctx.saved_tensors
        need_x, need_w, need_b, need_a, need_bb = ctx.needs_input_grad[:5]
        plan: _Plan = ctx.plan
        a32, bt32 = ctx.lora_params
        g2 = plan.prepare(grad_out.reshape(plan.rows, plan.out_features).to(x2.dtype))
        grad_x = grad_w = grad_b = grad_a = grad_bb = None

        if plan.rows == 0:
            grad_a = torch.zeros_like(lora_A) if need_a else None
            grad_bb = torch.zeros_like(lora_B) if need_bb else None
            grad_x = x2.new_zeros(ctx.x_shape) if need_x else None
        elif need_x or need_a or need_bb:  # grad_x always has a LoRA term, frozen adapter or not
            dh, db = _grad_out(plan, g2, h, bt32, ctx.scaling)
            if need_bb:
                grad_bb = db[:, : plan.rank].to(lora_B.dtype)
            if need_x or need_a:
                gx, da = _grad_in(plan, x2, dh, a32, ctx.dropout, need_x)
                if need_a:
                    grad_a = da[: plan.rank].to(lora_A.dtype)
                if gx is not None:
                    gx.addmm_(g2, weight.t() if ctx.fan_in_fan_out else weight)
                    grad_x = gx.view(ctx.x_shape)
        if need_w:
            grad_w = torch.mm(x2.t(), g2) if ctx.fan_in_fan_out else torch.mm(g2.t(), x2)
        if need_b and ctx.has_bias:
            grad_b = g2.sum(0)
        return grad_x, grad_w, grad_b, grad_a, grad_bb, None, None, None, None, None


def _down(plan: _Plan, x2: Tensor, a32: Tensor, dropout: tuple[int, int, int, float]) -> Tensor:
    """h = dropout(x) A^T, float32 (rows, R)."""
    bucket = plan.variant.rank_bucket
    if plan.rows == 0:
        return x2.new_zeros((0, bucket), dtype=torch.float32)
    grid = specs.plan_down(plan.rows, plan.in_features, plan.variant, plan.target_blocks)
    h_part = torch.empty(grid.splits, plan.rows, bucket, dtype=torch.float32, device=plan.device)
    plan.launcher.launch(
        LORA_DOWN,
        plan.variant,
        grid.grid,
        (x2, a32, h_part, plan.rows, plan.in_features, plan.rank, grid.cols_per_split, *dropout),
        plan.device,
    )
    return h_part[0] if grid.splits == 1 else h_part.sum(0)


def _grad_out(plan: _Plan, g2: Tensor, h: Tensor, bt32: Tensor, scaling: float) -> tuple[Tensor, Tensor]:
    """dh = s g B (rows, R) and dB = s g^T h (out, R), float32."""
    bucket = plan.variant.rank_bucket
    grid = specs.plan_grad_out(plan.rows, plan.out_features, plan.variant, plan.target_blocks)
    dh_part = torch.empty(grid.col_blocks, plan.rows, bucket, dtype=torch.float32, device=plan.device)
    db_part = torch.empty(grid.splits, plan.out_features, bucket, dtype=torch.float32, device=plan.device)
    plan.launcher.launch(
        LORA_GRAD_OUT,
        plan.variant,
        grid.grid,
        (
            g2,
            h,
            bt32,
            dh_part,
            db_part,
            plan.rows,
            plan.out_features,
            plan.rank,
            grid.rows_per_split,
            scaling,
        ),
        plan.device,
    )
    dh = dh_part[0] if grid.col_blocks == 1 else dh_part.sum(0)
    db = db_part[0] if grid.splits == 1 else db_part.sum(0)
    return dh, db


def _grad_in(
    plan: _Plan, x2: Tensor, dh: Tensor, a32: Tensor, dropout: tuple[int, int, int, float], need_x: bool
) -> tuple[Tensor | None, Tensor]:
    """The LoRA part of grad_x (rows, in) in x's dtype (None unless ``need_x``) and dA (R, in) float32."""
    bucket = plan.variant.rank_bucket
    grid = specs.plan_grad_in(plan.rows, plan.in_features, plan.variant, plan.target_blocks)
    gx = torch.empty_like(x2) if need_x else None
    da_part = torch.empty(grid.splits, bucket, plan.in_features, dtype=torch.float32, device=plan.device)
    plan.launcher.launch(
        LORA_GRAD_IN,
        plan.variant,
        grid.grid,
        (x2, dh, a32, gx, da_part, plan.rows, plan.in_features, plan.rank, grid.rows_per_split, *dropout),
        plan.device,
    )
    return gx, (da_part[0] if grid.splits == 1 else da_part.sum(0))


def lora_linear_cuda(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    lora_A: Tensor,
    lora_B: Tensor,
    scaling: float,
    dropout_p: float,
    training: bool,
    *,
    fan_in_fan_out: bool = False,
    seed: int | None = None,
    launcher: KernelLauncher | None = None,
) -> Tensor:
    """LoRA linear ``x W^T + b + scaling * B A dropout(x)`` with loragen's CUDA kernels.

    Same semantics as :func:`loragen.ops.lora_linear`: shapes x (..., in), weight (out, in) -- (in, out)
    with ``fan_in_fan_out`` --, bias (out,) or None, lora_A (r, in), lora_B (out, r) -> (..., out) in x's
    dtype; dropout (probability ``dropout_p``, only when ``training``) on the LoRA branch only, with
    inverted scaling and the Philox mask of :mod:`loragen.philox`. Under autocast, x, weight and bias
    are cast to the autocast dtype first, as ``F.linear`` would. Inputs the kernels do not take (see
    :func:`unsupported_reason`) run through :func:`loragen.reference.lora_linear_reference` instead.

    Args:
        seed: fixes the dropout mask (unsigned 64-bit); None draws one from torch's CPU generator.
        launcher: runs the kernels (default: the CUDA driver launcher); loragen's CPU tests pass an
            emulator here.

    Raises:
        CudaLoraError: tensors not on one device, or not on a CUDA device when no launcher is given;
            mismatched shapes; ``dropout_p`` outside [0, 1).
        RuntimeError: dropout is active while a CUDA graph is being captured.
    """
    _check_inputs(x, weight, bias, lora_A, lora_B, fan_in_fan_out, dropout_p, require_cuda=launcher is None)
    if x.device.type == "cuda" and torch.is_autocast_enabled("cuda"):
        dtype = torch.get_autocast_dtype("cuda")
        x, weight = x.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    reason = unsupported_reason(x, weight, bias, lora_A, lora_B, fan_in_fan_out=fan_in_fan_out)
    if reason is not None:
        return lora_linear_reference(
            x, weight, bias, lora_A, lora_B, scaling, dropout_p, training, fan_in_fan_out=fan_in_fan_out
        )
    p = float(dropout_p) if training else 0.0
    if p > 0 and x.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "loragen.cuda.lora_linear_cuda: LoRA dropout is active while a CUDA graph is being captured; the "
            "dropout seed would be frozen into the graph and every replay would reuse one mask. Capture with "
            "lora_dropout=0 or the model in eval mode, or train without CUDA graphs."
        )
    if p == 0:
        seed = 0
    elif seed is None:
        seed = philox.random_seed()
    elif not 0 <= seed < 1 << 64:
        raise CudaLoraError(
            f"loragen.cuda.lora_linear_cuda: seed={seed}; expected an unsigned 64-bit integer"
        )
    with torch.autocast(x.device.type, enabled=False):
        return LoraLinearCudaFunction.apply(
            x,
            weight,
            bias,
            lora_A,
            lora_B,
            float(scaling),
            p,
            seed,
            fan_in_fan_out,
            launcher or default_launcher(),
        )
