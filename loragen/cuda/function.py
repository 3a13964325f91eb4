"""The LoRA linear op on CUDA: loragen's kernels for the rank-r part, cuBLAS for the base GEMMs.

Shapes: x (N, in) after flattening, weight (out, in) -- (in, out) with ``fan_in_fan_out`` --,
A (r, in), B (out, r), h = dropout(x) A^T (N, R) in float32, R = the rank bucket (columns past r are 0).

forward   h   = lora_down(x)                        one pass over x, Philox mask regenerated
          y   = x W^T                               cuBLAS, written in x's dtype
          y   = round(y + (bias + s h B^T))         lora_up: reads y, adds bias and the rank-r term in
                                                    float32, writes y once more in place
backward  dh, dB = lora_grad_out(g)                 one pass over g (dh carries s)
          gx, dA   = lora_grad_in(x, dh)            one pass over x, mask regenerated; gx = (dh A) * mask / (1-p)
          gx += g W                                 cuBLAS, beta = 1
          dW = g^T x, db = sum(g)                   only when the base is trainable

Split reductions come back as float32 partial sums that torch adds up (deterministic: no atomics).
LoRA parameters may be float32 (peft's default for 16-bit models) or x's dtype; the kernels read them
as float32 and accumulate in float32; the base product x W^T is rounded into x's dtype (as peft's base
layer rounds it), and bias + the rank-r term are added to it in float32 with one more rounding: the
rank-r term is never rounded to 16 bits on its own (peft rounds it before adding). (In backward, lora_grad_in writes the LoRA
part of grad_x in x's dtype and cuBLAS adds g W to it: two roundings there, as in peft's composition.) The output is a fresh tensor (never a view),
so callers may modify it in place.

Which launcher runs the kernels: by default :func:`loragen.cuda.selfcheck.default_checker`, which
self-checks each kernel variant on its first use on a device and moves a failing one to the torch path
(:mod:`loragen.cuda.torch_kernels`) with one warning; ``LORAGEN_CUDA_KERNELS`` (:data:`loragen.switches.cuda_kernels`)
turns the check off or forces the torch path.

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
from loragen.cuda import passes, specs
from loragen.cuda.launch import KernelLauncher
from loragen.cuda.passes import DTYPE_NAMES, Plan
from loragen.cuda.selfcheck import default_checker
from loragen.errors import LoraError
from loragen.reference import lora_linear_reference

__all__ = ["CudaLoraError", "LoraLinearCudaFunction", "lora_linear_cuda", "unsupported_reason"]


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
    if not 1 <= lora_A.shape[0] <= specs.MAX_RANK:
        return f"rank r={lora_A.shape[0]} (the kernels take 1 <= r <= {specs.MAX_RANK})"
    if max(x.shape[-1], weight.shape[0], weight.shape[1]) >= 2**31:
        return "a feature dimension of 2**31 or more"
    if x.numel() // max(x.shape[-1], 1) >= 2**31:
        return "2**31 or more rows (the kernels take row counts as 32-bit int)"
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
        plan = Plan(x2, out_features, lora_A.shape[0], launcher)
        x2 = plan.prepare(x2)
        # (R, in) and (R, out), padded to the rank bucket: rows r..R-1 are zero
        a32 = plan.prepare(passes.pad_rank(lora_A.detach().float(), plan.variant))
        bt32 = plan.prepare(passes.pad_rank(lora_B.detach().float().t(), plan.variant))
        dropout = (
            (seed, 0, philox.keep_threshold(dropout_p), philox.keep_scale(dropout_p))
            if dropout_p > 0
            else (0, 0, 0, 1.0)
        )

        h = passes.down(plan, x2, a32, dropout)
        # the output in its final shape, written through a 2-D view: no view of it escapes, so callers
        # may modify it in place
        out = torch.empty(*x.shape[:-1], out_features, dtype=x.dtype, device=x.device)
        out2 = out.view(plan.rows, out_features)
        # cuBLAS writes the base product in x's dtype, then lora_up adds bias + s h B^T in float32 and
        # writes the output once more: no float32 (N, out) temporary
        passes.add_base(x2, weight if fan_in_fan_out else weight.t(), out2)
        passes.up(plan, h, bt32, bias, scaling, out2)

        ctx.plan = plan
        ctx.scaling = float(scaling)
        ctx.dropout = dropout
        ctx.fan_in_fan_out = fan_in_fan_out
        ctx.x_shape = x.shape
        ctx.lora_params = (a32, bt32)
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x2, weight, lora_A, lora_B, h)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        x2, weight, lora_A, lora_B, h = ctx.saved_tensors
        need_x, need_w, need_b, need_a, need_bb = ctx.needs_input_grad[:5]
        plan: Plan = ctx.plan
        a32, bt32 = ctx.lora_params
        g2 = plan.prepare(grad_out.reshape(plan.rows, plan.out_features).to(x2.dtype))
        grad_x = grad_w = grad_b = grad_a = grad_bb = None

        if plan.rows == 0:
            grad_a = torch.zeros_like(lora_A) if need_a else None
            grad_bb = torch.zeros_like(lora_B) if need_bb else None
            grad_x = x2.new_zeros(ctx.x_shape) if need_x else None
        elif need_x or need_a or need_bb:  # grad_x always has a LoRA term, frozen adapter or not
            dh, db = passes.grad_out(plan, g2, h, bt32, ctx.scaling)
            if need_bb:
                grad_bb = db[:, : plan.rank].to(lora_B.dtype)
            if need_x or need_a:
                gx, da = passes.grad_in(plan, x2, dh, a32, ctx.dropout, need_x)
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
        launcher: runs the kernels (default: the self-checked CUDA driver launcher,
            :func:`loragen.cuda.selfcheck.default_checker`); loragen's CPU tests pass an
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
            launcher or default_checker(),
        )
