"""The fused LoRA linear op on the CPU: ``y = x W^T + b + scaling * (dropout(x) A^T) B^T``.

:func:`lora_linear` is what :class:`~loragen.layers.LoraLinear` and ``LoraConv1D`` call (unless
:mod:`loragen.ops.siblings` runs the layer together with siblings reading the same input). On the CPU it
runs one ``torch.autograd.Function`` (:class:`LoraLinearFunction`) with a hand-written backward; x is
(N, in) after flattening the batch dimensions, s = scaling, m the dropout keep-mask:

forward   h  = (x * m / (1 - p)) A^T              (N, r), saved
          y  = b + h (s B^T)                      rank-r term first...
          y += x W^T                              ...then the base GEMM accumulates onto it (beta = 1)
backward  dB = s h^T g                            (out, r)
          gh = s / (1 - p) * g B                  (N, r)
          dA = gh^T (x * m)                       (r, in)
          dx = (gh A) * m  then  dx += g W        again the base GEMM accumulates (beta = 1)
          dW = g^T x,  db = sum(g)                only when the base trains (hybrid mode)

Eight GEMMs, six of them rank r; the two base GEMMs are the ones ``nn.Linear`` runs, and they absorb
the rank-r terms for free (reading C in a compute-bound GEMM costs nothing), where adding a term
afterwards would be one more read and write of an (N, out) or (N, in) tensor.

Gradients are returned, so autograd adds them into existing ``.grad`` in place (micro-batches sum to the
big batch); writing into ``.grad`` here would save nothing for the (r, in) and (out, r) factors and would
bypass hooks and ``retain_graph``.

Saved for backward: x itself (a view, never a copy), h, and the mask as packed bits (N * in / 8 bytes)
or nothing but a seed -- never a float mask or a second x-sized tensor. peft's composition saves
dropout(x) and a float32 mask, both x-sized. Masked temporaries are made per row block of at most
``_BLOCK_ELEMS`` elements, so they stay in cache and in malloc's heap.

Dropout masks come from one of two generators (:data:`loragen.switches.dropout_rng`); both keep an element with
probability 1 - p rounded to a multiple of 2**-16 and draw their seed from torch's default CPU
generator, so ``torch.manual_seed`` reproduces a run and ``torch.utils.checkpoint`` (which restores
that generator) recomputes the same mask:

``"bits"`` (default)  PCG64 words combined by the binary expansion of 1 - p straight into packed bits;
                      the bits are saved. 0.44 ms per 2**19 elements on the project's CPU, 13x faster
                      than "philox" (BENCHMARKS.md), and the bits cost 1/32 of x in float32.
``"philox"``          the counter-based Philox4x32-10 mask of :mod:`loragen.philox`, bit-identical to the
                      CUDA kernels' for the same torch RNG state; nothing is saved, the mask is
                      regenerated in backward.

With dropout in float32, the three masked products (h in forward, dA and the dx term in backward) run
as compiled kernels (:mod:`loragen.ops.cpu_kernels`: an AVX-512 build, or an AVX2 build on x86-64 CPUs
without AVX-512) that read the packed bits where they use them: x is read once per product, no masked
copy is made, and all threads work. Where they cannot be built (no C compiler, no AVX2, not x86) the
numpy/BLAS row-block path below computes the same products from the same bits.

Other devices go to :func:`loragen.cuda.lora_linear_cuda` (CUDA with loragen's kernels) or to the
plain composition :func:`lora_linear_reference`, as do autocast, ``torch.compile`` with dropout and
``loragen.switches.fused`` off (see :func:`loragen.ops.dispatch.fallback_reason`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from loragen import philox
from loragen.ops import cpu_kernels
from loragen.ops.masks import KeepMask, block_rows, make_keep_bits, row_blocks

__all__ = [
    "LoraLinearFunction",
    "input_layout",
    "lora_down",
    "lora_output",
    "masked_lora_grads",
    "shaped_like_input",
]


def input_layout(x: Tensor) -> tuple[int, ...] | None:
    """The strides ``x``'s gradient should have: None when x is contiguous (the gradient is made
    contiguous), else the strides ``torch.empty_like(x)`` would give (x's own when they are dense).

    torch's linear returns a non-contiguous input's gradient in the input's layout, and some of torch's
    CPU backward kernels rely on that: BatchNorm2d's eval backward gives wrong gradients for a
    (1, C, H, W) gradient with channels-last strides and a batch stride that is not C*H*W -- what a
    contiguous (1, H*W, C) gradient becomes through CvT's ``view(...).permute(0, 2, 1)``.
    """
    return None if x.is_contiguous() else torch.empty_like(x, device="meta").stride()


def shaped_like_input(grad_x: Tensor, shape: torch.Size, layout: tuple[int, ...] | None) -> Tensor:
    """The (N, in) gradient ``grad_x`` as x's gradient: x's shape and :func:`input_layout`'s strides
    (one copy, only for an input that was not contiguous)."""
    grad = grad_x.view(shape)
    if layout is None:
        return grad
    return torch.empty_strided(shape, layout, dtype=grad.dtype, device=grad.device).copy_(grad)


class LoraLinearFunction(torch.autograd.Function):
    """:func:`lora_linear` on the CPU as one autograd node; the formulas are in the module docstring.

    ``apply(x, weight, bias, lora_A, lora_B, scaling, dropout_p, rng, seed, fan_in_fan_out)`` with
    ``dropout_p = 0`` meaning no dropout; ``seed`` fixes the mask (None draws one from torch's CPU
    generator, as the CUDA op does, so "philox" masks agree across devices).
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
        rng: str,
        seed: int | None,
        fan_in_fan_out: bool,
    ) -> Tensor:
        in_features = x.shape[-1]
        x2 = x.reshape(-1, in_features)  # a view of x when x is contiguous
        rows = x2.shape[0]
        dtype = lora_A.dtype  # the LoRA branch runs in the adapter's dtype, as in peft
        bits = None
        compiled = False
        if dropout_p > 0.0:
            if seed is None:
                seed = philox.random_seed()
            bits = make_keep_bits(rows * in_features, dropout_p, seed, rng)
            compiled = x.dtype == dtype and cpu_kernels.available(dtype, lora_A.shape[0])
        h = lora_down(x2, lora_A, bits, dropout_p, compiled)

        w_t = weight if fan_in_fan_out else weight.t()  # (in, out)
        # the output in its final shape, written through a 2-D view: no view of it escapes, so callers
        # may modify it in place
        out = torch.empty(*x.shape[:-1], w_t.shape[1], dtype=x.dtype, device=x.device)
        y = out.view(rows, w_t.shape[1])
        if dtype == x.dtype:
            lora_output(x2, w_t, bias, h, lora_B, scaling, out=y)
        else:  # as peft: the base in x's dtype, the term in the adapter's, added and rounded once
            if bias is not None:
                torch.addmm(bias, x2, w_t, out=y)
            else:
                torch.mm(x2, w_t, out=y)
            y.add_(torch.mm(h, lora_B.t()), alpha=scaling)

        need_x, need_w, _, need_a, need_b = ctx.needs_input_grad[:5]
        ctx.scaling, ctx.dropout_p, ctx.fan_in_fan_out = scaling, dropout_p, fan_in_fan_out
        ctx.rng, ctx.seed, ctx.x_shape, ctx.rows, ctx.has_bias = rng, seed, x.shape, rows, bias is not None
        ctx.compiled, ctx.x_layout = compiled, input_layout(x)
        ctx.save_for_backward(
            x2 if need_a or need_w else None,
            weight if need_x else None,
            lora_A,
            lora_B,
            h if need_b else None,
            bits if rng == "bits" else None,  # "philox" regenerates the mask from the seed
        )
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        x2, weight, lora_A, lora_B, h, bits = ctx.saved_tensors
        need_x, need_w, need_bias, need_a, need_b = ctx.needs_input_grad[:5]
        s, p, ffo = ctx.scaling, ctx.dropout_p, ctx.fan_in_fan_out
        rows, in_features = ctx.rows, ctx.x_shape[-1]
        if p > 0.0 and bits is None:
            bits = make_keep_bits(rows * in_features, p, ctx.seed, ctx.rng)

        g2 = grad_out.reshape(rows, grad_out.shape[-1])
        g_lora = g2 if g2.dtype == lora_A.dtype else g2.to(lora_A.dtype)
        grad_x = grad_w = grad_bias = grad_a = grad_b = None
        if need_b:
            grad_b = torch.mm(h.t(), g_lora).mul_(s).t()  # (out, r); h^T g is the faster layout
        if need_x or need_a:
            gh = torch.mm(g_lora, lora_B).mul_(s / (1.0 - p))  # (N, r)
            if bits is None and need_x:  # one product chain with the base gradient, peft's rounding
                grad_x = _grad_input(g2, weight, gh, lora_A, ffo)
                grad_a = lora_input_grads(x2, gh, lora_A, None, False, need_x=False, need_a=need_a)[1]
            else:
                grad_x, grad_a = lora_input_grads(
                    x2, gh, lora_A, bits, ctx.compiled, need_x=need_x, need_a=need_a, x_dtype=g2.dtype
                )
                if grad_x is not None:
                    grad_x.addmm_(g2, weight.t() if ffo else weight)  # the base GEMM accumulates onto it
        if need_w:
            grad_w = torch.mm(x2.t(), g2) if ffo else torch.mm(g2.t(), x2)
        if need_bias and ctx.has_bias:
            grad_bias = g2.sum(0)
        if grad_x is not None:
            grad_x = shaped_like_input(grad_x, ctx.x_shape, ctx.x_layout)
        return grad_x, grad_w, grad_bias, grad_a, grad_b, None, None, None, None, None


def lora_down(x2: Tensor, lora_A: Tensor, bits: Tensor | None, p: float, compiled: bool) -> Tensor:
    """``h = (x * m / (1 - p)) A^T`` (N, r) in the adapter's dtype for x2 (N, in), lora_A (r, in) and the
    packed keep-mask ``bits`` (None: no dropout), without a masked copy of all of x: the compiled kernel
    reads the mask where it uses it, the numpy/BLAS path masks one row block at a time."""
    dtype = lora_A.dtype
    if bits is None:
        return torch.mm(x2 if x2.dtype == dtype else x2.to(dtype), lora_A.t())
    if compiled:  # loragen.ops.cpu_kernels
        return cpu_kernels.masked_down(x2.contiguous(), bits, lora_A, 1.0 / (1.0 - p))
    rows, in_features = x2.shape
    keep = KeepMask(bits, in_features, dtype)
    h = torch.empty(rows, lora_A.shape[0], dtype=dtype, device=x2.device)
    buffer = torch.empty(min(rows, block_rows(in_features)), in_features, dtype=dtype)
    for start, stop in row_blocks(rows, in_features):
        xb = keep.apply(x2[start:stop].to(dtype), keep.block(start, stop), buffer[: stop - start])
        torch.mm(xb, lora_A.t(), out=h[start:stop])
    return h.mul_(1.0 / (1.0 - p))


def lora_output(
    x2: Tensor,
    w_t: Tensor,
    bias: Tensor | None,
    h: Tensor,
    lora_B: Tensor,
    scaling: float,
    *,
    out: Tensor | None = None,
) -> Tensor:
    """``b + h (s B^T) + x W^T`` for x2 (N, in), w_t (in, out), h (N, r), all of one dtype: the rank-r
    term first, then the base GEMM accumulates onto it (beta = 1; the module docstring says why)."""
    if bias is not None:
        y = torch.addmm(bias, h, lora_B.t(), alpha=scaling, out=out)
    else:
        y = torch.mm(h * scaling, lora_B.t(), out=out)  # scaling the (N, r) factor, not the (N, out) result
    return y.addmm_(x2, w_t)


def _grad_input(g2: Tensor, weight: Tensor, gh: Tensor, lora_A: Tensor, ffo: bool) -> Tensor:
    """``g W + gh A`` without dropout: (N, in)."""
    w = weight.t() if ffo else weight  # (out, in)
    if gh.dtype != g2.dtype:  # the LoRA term in the adapter's dtype, added to the base gradient
        return torch.mm(g2, w).add_(torch.mm(gh, lora_A))
    return torch.mm(gh, lora_A).addmm_(g2, w)


def lora_input_grads(
    x2: Tensor,
    gh: Tensor,
    lora_A: Tensor,
    bits: Tensor | None,
    compiled: bool,
    *,
    need_x: bool,
    need_a: bool,
    x_dtype: torch.dtype | None = None,
) -> tuple[Tensor | None, Tensor | None]:
    """The rank-r half of a LoRA backward: the LoRA term of dx, ``(gh A) * m`` (N, in), and
    ``dA = gh^T (x * m)`` (r, in), each only when asked for.

    ``gh`` (N, r) is ``s / (1 - p) * g B`` in the adapter's dtype, x2 (N, in) the layer input, lora_A
    (r, in), ``bits`` the packed keep-mask (None: no dropout, m = 1); ``compiled`` picks the compiled
    kernels (:mod:`loragen.ops.cpu_kernels`) over the numpy/BLAS row blocks. dA comes in the adapter's
    dtype; dx in ``x_dtype`` where the row-block path writes it (default: the adapter's), else in the
    adapter's dtype (callers cast).
    """
    dtype = gh.dtype
    grad_x = grad_a = None
    if bits is None:
        if need_a:
            grad_a = torch.mm(gh.t(), x2 if x2.dtype == dtype else x2.to(dtype))
        if need_x:
            grad_x = torch.mm(gh, lora_A)
    elif compiled:
        if need_a:
            grad_a = cpu_kernels.masked_grad_a(x2.contiguous(), bits, gh)
        if need_x:
            grad_x = cpu_kernels.masked_grad_x(gh, lora_A, bits)
    else:
        keep = KeepMask(bits, x2.shape[1], dtype)
        grad_x, grad_a = masked_lora_grads(
            x2 if need_a else None, gh, lora_A if need_x else None, keep, x_dtype or dtype
        )
    return grad_x, grad_a


def masked_lora_grads(
    x2: Tensor | None, gh: Tensor, lora_A: Tensor | None, keep: KeepMask, out_dtype: torch.dtype
) -> tuple[Tensor | None, Tensor | None]:
    """With dropout, block by block, one unpacked mask serving both ``dx = (gh A) * m`` (N, in), in
    ``out_dtype``, and ``dA = gh^T (x * m)`` (r, in), in the adapter's dtype (gh's). Each is computed when
    its operand is given: x2 for dA (A trains), lora_A for dx (x needs a gradient); the other may be None,
    so shapes come from gh and the mask."""
    (rows, rank), in_features, dtype = gh.shape, keep.in_features, gh.dtype
    grad_x = torch.empty(rows, in_features, dtype=out_dtype) if lora_A is not None else None
    grad_a = torch.zeros(rank, in_features, dtype=dtype) if x2 is not None else None
    buffer = torch.empty(min(rows, block_rows(in_features)), in_features, dtype=dtype)
    gh_t = gh.t()
    for start, stop in row_blocks(rows, in_features):
        mask = keep.block(start, stop)
        if x2 is not None and grad_a is not None:
            xb = keep.apply(x2[start:stop].to(dtype), mask, buffer[: stop - start])
            grad_a.addmm_(gh_t[:, start:stop], xb)
        if grad_x is not None and lora_A is not None:
            target = grad_x[start:stop] if out_dtype == dtype else buffer[: stop - start]
            keep.apply(torch.mm(gh[start:stop], lora_A, out=target), mask, target)
            if out_dtype != dtype:
                grad_x[start:stop].copy_(target)
    return grad_x, grad_a
