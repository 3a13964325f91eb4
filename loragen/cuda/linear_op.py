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

The op is two ``torch.library`` custom ops, ``loragen::lora_linear`` (forward, returns y and h) and
``loragen::lora_linear_backward``, with fake implementations and the autograd formula registered, so
``torch.compile(fullgraph=True)`` traces a LoRA model through them without graph breaks. Eager calls run
the same implementations through a plain ``torch.autograd.Function``: the custom-op dispatch's Python
wrappers would cost more host time per call than the rest of the op.

Host path: everything that depends only on (shapes, dtype, device, launcher) -- the kernel variant, the
routed launcher, the four grids -- is kept in a :class:`~loragen.cuda.passes.Plan` per such key; A and
B^T padded to the rank bucket in float32 are kept per parameter and refreshed only when the parameter's
``_version`` or data pointer changes (and on every call inside a CUDA-graph capture, so replays read fresh
parameters). The eager forward hands its backward the plan, those two buffers and the 2-D x it prepared,
so backward looks nothing up again; scalars travel to ``apply`` as one tuple.

Which launcher runs the kernels: by default :func:`loragen.cuda.selfcheck.default_checker`, which
self-checks each kernel variant on its first use on a device and moves a failing one to the torch path
(:mod:`loragen.cuda.torch_kernels`) with one warning; ``LORAGEN_CUDA_KERNELS`` (:data:`loragen.switches.cuda_kernels`)
turns the check off or forces the torch path. An eager call routed to the torch path runs
:func:`loragen.cuda.torch_path.lora_linear_torch` (one composition with torch's autograd) instead of the
Function below.

Dropout: each forward draws its Philox seed and offset with one device-side torch RNG op (:func:`draw_rng`)
into an int64 tensor of two elements that the kernels read through a pointer and backward reuses. So
``torch.manual_seed`` reproduces a run, ``torch.utils.checkpoint`` (which restores the device's RNG
state) recomputes the same mask, and a CUDA graph captured with dropout draws a fresh mask on every
replay. :func:`loragen.philox.dropout_keep_mask` gives the identical mask on the CPU for the same
(seed, offset) (:func:`loragen.cuda.torch_kernels.rng_values` reads them, for tests and tools). Nothing
on the op's path reads a device value on the host -- neither the kernel path nor the torch path --, so
a step never waits for the GPU (benchmarks/cuda_host.py counts such reads; its test holds them at 0).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import Tensor

from loragen.cuda import hostcache, kernel_variants, passes, streams, torch_path
from loragen.cuda.launch import KernelLauncher
from loragen.cuda.op_inputs import autocast_dtype, check_inputs, draw_rng, seed_rng, unsupported_reason
from loragen.reference import lora_linear_reference

__all__ = ["lora_linear_cuda"]


# ---- the custom ops --------------------------------------------------------------------------------

_NO_CONTEXT = contextlib.nullcontext()  # stateless: one instance serves every call

# what an eager forward hands its backward: the plan, A and B^T as the kernels read them (the cached
# buffers cannot change in between: A and B are saved for backward, so autograd refuses a step whose
# parameters were modified after the forward) and x's shape (the eager Function saves x as the 2-D,
# contiguous, aligned view or copy the kernels read)
_Prepared = tuple[passes.Plan, Tensor, Tensor, torch.Size]


def _without_autocast(x: Tensor) -> contextlib.AbstractContextManager[Any]:
    """The kernels run in the dtypes they are given: autocast off inside the op (a no-op context when it
    is not on, which is the common case and costs nothing)."""
    return _NO_CONTEXT if autocast_dtype(x) is None else torch.autocast(x.device.type, enabled=False)


def _lora_linear_impl(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    lora_A: Tensor,
    lora_B: Tensor,
    rng: Tensor | None,
    scaling: float,
    dropout_p: float,
    fan_in_fan_out: bool,
    launcher: int,
) -> tuple[Tensor, Tensor]:
    """y (..., out) in x's dtype and h (N, R) float32 (saved for backward)."""
    with _without_autocast(x):
        out, h, _, _ = _forward(
            x, weight, bias, lora_A, lora_B, rng, scaling, dropout_p, fan_in_fan_out, launcher
        )
    return out, h


_lora_linear_op = torch.library.custom_op("loragen::lora_linear", _lora_linear_impl, mutates_args=())


def _forward(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    lora_A: Tensor,
    lora_B: Tensor,
    rng: Tensor | None,
    scaling: float,
    dropout_p: float,
    fan_in_fan_out: bool,
    launcher: int,
) -> tuple[Tensor, Tensor, Tensor, _Prepared]:
    """y, h, the 2-D x the kernels read, and what backward reuses."""
    out_features = weight.shape[1] if fan_in_fan_out else weight.shape[0]
    x2 = x.reshape(-1, x.shape[-1])
    plan = hostcache.plan(x2, out_features, lora_A.shape[0], launcher)
    x2 = plan.prepare(x2)
    in_capture = streams.capturing(x2.device)
    a32 = hostcache.factor(lora_A, plan, False, in_capture)
    bt32 = hostcache.factor(lora_B, plan, True, in_capture)
    h = passes.down(plan, x2, a32, hostcache.dropout_args(rng, dropout_p))
    # the output in its final shape, written through a 2-D view: no view of it escapes
    out = torch.empty(*x.shape[:-1], out_features, dtype=x.dtype, device=x.device)
    out2 = out.view(plan.rows, out_features)
    # cuBLAS writes the base product in x's dtype, then lora_up adds bias + s h B^T in float32 and
    # writes the output once more: no float32 (N, out) temporary
    passes.add_base(x2, weight if fan_in_fan_out else weight.t(), out2)
    passes.up(plan, h, bt32, bias, scaling, out2)
    return out, h, x2, (plan, a32, bt32, x.shape)


@_lora_linear_op.register_fake
def _lora_linear_fake(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    lora_A: Tensor,
    lora_B: Tensor,
    rng: Tensor | None,
    scaling: float,
    dropout_p: float,
    fan_in_fan_out: bool,
    launcher: int,
) -> tuple[Tensor, Tensor]:
    out_features = weight.shape[1] if fan_in_fan_out else weight.shape[0]
    rows = 1
    for size in x.shape[:-1]:
        rows = rows * size
    out = x.new_empty((*x.shape[:-1], out_features))
    h = x.new_empty((rows, kernel_variants.rank_bucket(lora_A.shape[0])), dtype=torch.float32)
    return out, h


def _lora_linear_backward_impl(
    grad_out: Tensor,
    x: Tensor,
    weight: Tensor,
    lora_A: Tensor,
    lora_B: Tensor,
    h: Tensor,
    rng: Tensor | None,
    scaling: float,
    dropout_p: float,
    fan_in_fan_out: bool,
    needs: list[bool],
    launcher: int,
) -> list[Tensor]:
    """The gradients of (x, weight, bias, lora_A, lora_B) flagged in ``needs``, in that order."""
    with _without_autocast(x):
        return _backward(
            grad_out,
            x,
            weight,
            lora_A,
            lora_B,
            h,
            rng,
            scaling,
            dropout_p,
            fan_in_fan_out,
            needs,
            launcher,
            None,
        )


_lora_linear_backward_op = torch.library.custom_op(
    "loragen::lora_linear_backward", _lora_linear_backward_impl, mutates_args=()
)


def _backward(
    grad_out: Tensor,
    x: Tensor,
    weight: Tensor,
    lora_A: Tensor,
    lora_B: Tensor,
    h: Tensor,
    rng: Tensor | None,
    scaling: float,
    dropout_p: float,
    fan_in_fan_out: bool,
    needs: list[bool],
    launcher: int,
    prepared: _Prepared | None,
) -> list[Tensor]:
    """The gradients flagged in ``needs``. ``prepared``: what the eager forward worked out, ``x`` then
    being the 2-D x the kernels read; None: ``x`` as the op took it, the rest looked up again (the
    traced backward)."""
    need_x, need_w, need_b, need_a, need_bb = needs
    out_features = weight.shape[1] if fan_in_fan_out else weight.shape[0]
    if prepared is None:
        x_shape = x.shape
        x2 = x.reshape(-1, x.shape[-1])
        plan = hostcache.plan(x2, out_features, lora_A.shape[0], launcher)
        x2 = plan.prepare(x2)
        a32 = bt32 = None
    else:
        plan, a32, bt32, x_shape = prepared
        x2 = x
    g2 = grad_out.reshape(plan.rows, out_features)
    g2 = plan.prepare(g2 if g2.dtype == x2.dtype else g2.to(x2.dtype))
    grad_x = grad_a = grad_bb = None
    if plan.rows == 0:
        grad_a = torch.zeros_like(lora_A) if need_a else None
        grad_bb = torch.zeros_like(lora_B) if need_bb else None
        grad_x = x2.new_zeros(x_shape) if need_x else None
    elif need_x or need_a or need_bb:  # grad_x always has a LoRA term, frozen adapter or not
        # asked only where forward handed over no factors (the custom op's backward): both are None then
        in_capture = bt32 is None and streams.capturing(x2.device)
        if bt32 is None:
            bt32 = hostcache.factor(lora_B, plan, True, in_capture)
        dh, db = passes.grad_out(plan, g2, h, bt32, scaling)
        if need_bb:  # columns past the rank only when the rank is not a bucket; at most one copy
            grad_bb = db if plan.rank == db.shape[1] else db[:, : plan.rank].contiguous()
            if grad_bb.dtype != lora_B.dtype:
                grad_bb = grad_bb.to(lora_B.dtype)
        if need_x or need_a:
            if a32 is None:
                a32 = hostcache.factor(lora_A, plan, False, in_capture)
            gx, da = passes.grad_in(plan, x2, dh, a32, hostcache.dropout_args(rng, dropout_p), need_x)
            if need_a:  # rows past the rank only when the rank is not a bucket
                grad_a = da if plan.rank == da.shape[0] else da[: plan.rank]
                if grad_a.dtype != lora_A.dtype:
                    grad_a = grad_a.to(lora_A.dtype)
            if gx is not None:
                gx.addmm_(g2, weight.t() if fan_in_fan_out else weight)
                grad_x = gx.view(x_shape)
    grad_w = None
    if need_w:
        grad_w = torch.mm(x2.t(), g2) if fan_in_fan_out else torch.mm(g2.t(), x2)
    grad_b = g2.sum(0) if need_b else None
    return [g for g in (grad_x, grad_w, grad_b, grad_a, grad_bb) if g is not None]


@_lora_linear_backward_op.register_fake
def _lora_linear_backward_fake(
    grad_out: Tensor,
    x: Tensor,
    weight: Tensor,
    lora_A: Tensor,
    lora_B: Tensor,
    h: Tensor,
    rng: Tensor | None,
    scaling: float,
    dropout_p: float,
    fan_in_fan_out: bool,
    needs: list[bool],
    launcher: int,
) -> list[Tensor]:
    out_features = weight.shape[1] if fan_in_fan_out else weight.shape[0]
    shapes = (x, weight, x.new_empty((out_features,)), lora_A, lora_B)
    return [torch.empty_like(t, memory_format=torch.contiguous_format) for t, n in zip(shapes, needs) if n]


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    x, weight, bias, lora_A, lora_B, rng, scaling, dropout_p, fan_in_fan_out, launcher = inputs
    ctx.save_for_backward(x, weight, lora_A, lora_B, output[1], rng)
    ctx.args = (scaling, dropout_p, fan_in_fan_out, launcher)
    ctx.has_bias = bias is not None
    ctx.mark_non_differentiable(output[1])


def _gradients(ctx: Any, grad_out: Tensor, backward: Any) -> tuple[Tensor | None, ...]:
    """The autograd formula shared by the custom op and the eager Function: ``backward(grad_out, saved
    tensors, needs, ctx)`` is :func:`_traced_backward` or :func:`_eager_backward`."""
    needs = list(ctx.needs_input_grad[:5])
    needs[2] = needs[2] and ctx.has_bias
    grads = iter(backward(grad_out, ctx.saved_tensors, needs, ctx))
    return (*[next(grads) if needed else None for needed in needs], None, None, None, None, None)


def _traced_backward(grad_out: Tensor, saved: tuple[Any, ...], needs: list[bool], ctx: Any) -> list[Tensor]:
    """The backward custom op (what torch.compile traces)."""
    x, weight, lora_A, lora_B, h, rng = saved
    scaling, dropout_p, fan_in_fan_out, launcher = ctx.args
    return _lora_linear_backward_op(
        grad_out, x, weight, lora_A, lora_B, h, rng, scaling, dropout_p, fan_in_fan_out, needs, launcher
    )


def _eager_backward(grad_out: Tensor, saved: tuple[Any, ...], needs: list[bool], ctx: Any) -> list[Tensor]:
    """The backward implementation, reusing what the eager forward prepared (``saved`` holds its 2-D x)."""
    x2, weight, lora_A, lora_B, h, rng = saved
    scaling, dropout_p, fan_in_fan_out, launcher = ctx.args
    with _without_autocast(grad_out):
        return _backward(
            grad_out,
            x2,
            weight,
            lora_A,
            lora_B,
            h,
            rng,
            scaling,
            dropout_p,
            fan_in_fan_out,
            needs,
            launcher,
            ctx.prepared,
        )


def _autograd_backward(ctx: Any, grad_out: Tensor, grad_h: Tensor | None) -> tuple[Tensor | None, ...]:
    return _gradients(ctx, grad_out, _traced_backward)


_lora_linear_op.register_autograd(_autograd_backward, setup_context=_setup_context)


class _LoraLinearFunction(torch.autograd.Function):
    """The eager path: the same forward, backward and saved tensors as ``loragen::lora_linear``, without
    the custom-op dispatch (whose Python wrappers cost more host time per call than the whole op). The
    scalars travel as one tuple ``(scaling, dropout_p, fan_in_fan_out, launcher)``: autograd looks at
    every argument of ``apply``, so fewer arguments cost less."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        lora_A: Tensor,
        lora_B: Tensor,
        rng: Tensor | None,
        args: tuple[float, float, bool, int],
    ) -> Tensor:
        with _without_autocast(x):
            out, h, x2, ctx.prepared = _forward(x, weight, bias, lora_A, lora_B, rng, *args)
        ctx.save_for_backward(x2, weight, lora_A, lora_B, h, rng)
        ctx.args = args
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        return _gradients(ctx, grad_out, _eager_backward)[:7]


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
    Works inside CUDA-graph capture (dropout included) and under ``torch.compile``.

    Args:
        seed: fixes the dropout mask (unsigned 64-bit, offset 0); None draws seed and offset with the
            device's torch generator (:func:`draw_rng`).
        launcher: runs the kernels (default: the self-checked CUDA driver launcher,
            :func:`loragen.cuda.selfcheck.default_checker`); loragen's CPU tests pass an
            emulator or a null driver here.

    Raises:
        CudaLoraError: tensors not on one device, or not on a CUDA device when no launcher is given;
            mismatched shapes; ``dropout_p`` outside [0, 1); ``seed`` not unsigned 64-bit.
    """
    check_inputs(x, weight, bias, lora_A, lora_B, fan_in_fan_out, dropout_p, require_cuda=launcher is None)
    cast = autocast_dtype(x)
    if cast is not None:
        x, weight = x.to(cast), weight.to(cast)
        bias = None if bias is None else bias.to(cast)
    reason = unsupported_reason(x, weight, bias, lora_A, lora_B, fan_in_fan_out=fan_in_fan_out)
    if reason is not None:
        return lora_linear_reference(
            x, weight, bias, lora_A, lora_B, scaling, dropout_p, training, fan_in_fan_out=fan_in_fan_out
        )
    p = float(dropout_p) if training else 0.0
    rng = None
    if p > 0:
        rng = draw_rng(x.device) if seed is None else seed_rng(seed, x.device)
    scalars = (float(scaling), p, fan_in_fan_out, hostcache.launcher_handle(launcher))
    if torch.compiler.is_compiling():  # traced: the custom op, which torch.compile sees through its fake
        return _lora_linear_op(x, weight, bias, lora_A, lora_B, rng, *scalars)[0]
    if torch_path.runs_on_torch_path(x, lora_B.shape[0], lora_A.shape[0], scalars[3]):  # one composition
        args = (x, weight, bias, lora_A, lora_B, scalars[0], *hostcache.dropout_args(rng, p), fan_in_fan_out)
        if cast is None:
            return torch_path.lora_linear_torch(*args)
        with torch.autocast(x.device.type, enabled=False):
            return torch_path.lora_linear_torch(*args)
    return _LoraLinearFunction.apply(x, weight, bias, lora_A, lora_B, rng, scalars)
