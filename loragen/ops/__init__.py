"""The LoRA linear op: ``y = x W^T + b + scaling * (dropout(x) A^T) B^T``.

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

Dropout masks come from one of two generators (:func:`use_dropout_rng`); both keep an element with
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
as compiled AVX-512 kernels (:mod:`loragen.ops.cpu_kernels`) that read the packed bits where they use them:
x is read once per product, no masked copy is made, and all threads work. Where they cannot be built
(no C compiler, no AVX-512) the numpy/BLAS row-block path below computes the same products from the
same bits.

Other devices go to :func:`loragen.cuda.lora_linear_cuda` (CUDA with loragen's kernels) or to the
plain composition :func:`lora_linear_reference`, as do autocast, ``torch.compile`` with dropout and
``use_fused(False)`` (see :func:`fallback_reason`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from loragen import philox
from loragen.ops import cpu_kernels

__all__ = [
    "DropoutRng",
    "LoraLinearFunction",
    "dropout_keep_bits",
    "fallback_reason",
    "fused_enabled",
    "lora_linear",
    "lora_linear_reference",
    "philox_keep_bits",
    "unpack_keep_mask",
    "use_dropout_rng",
    "use_fused",
]

DropoutRng = Literal["bits", "philox"]
_RNG_MODES: tuple[str, ...] = ("bits", "philox")

# Masked temporaries hold at most this many elements per row block (4 MiB in float32): big enough that
# the per-block Python cost vanishes, small enough for L2/L3 and malloc's heap (no page faults).
_BLOCK_ELEMS = 1 << 20

# 1 - p is resolved to this many bits, as loragen.philox does; the "bits" generator spends one random
# bit per element per resolved bit.
_KEEP_BITS = philox.THRESHOLD_BITS

_log = logging.getLogger(__name__)
_fused_default = True
_rng_default: DropoutRng = "bits"


# ---- switches --------------------------------------------------------------------------------------


def fused_enabled() -> bool:
    """Whether :func:`lora_linear` runs the fused op (True unless inside ``use_fused(False)``)."""
    return _fused_default


@contextlib.contextmanager
def use_fused(enabled: bool) -> Iterator[None]:
    """Within the block :func:`lora_linear` runs the fused op (``True``) or peft's plain-autograd
    composition (``False``), whatever each layer's ``fused`` flag says. Process-wide, not per thread.

    Example: ``with loragen.ops.use_fused(False): loss = model(x).sum()``.
    """
    global _fused_default
    previous, _fused_default = _fused_default, bool(enabled)
    try:
        yield
    finally:
        _fused_default = previous


@contextlib.contextmanager
def use_dropout_rng(mode: DropoutRng) -> Iterator[None]:
    """Within the block, CPU dropout masks come from generator ``mode`` ("bits" or "philox").

    Raises:
        ValueError: ``mode`` is not one of the two.
    """
    global _rng_default
    _check_rng(mode)
    previous, _rng_default = _rng_default, mode
    try:
        yield
    finally:
        _rng_default = previous


def _check_rng(mode: str) -> None:
    if mode not in _RNG_MODES:
        raise ValueError(f"loragen.ops: dropout rng={mode!r}; expected one of {', '.join(map(repr, _RNG_MODES))}")


# ---- dropout masks as packed bits -------------------------------------------------------------------


def _keep_fraction(p: float) -> tuple[int, int]:
    """1 - p as ``t / 2**k`` with t odd (or k = 0), rounded as :func:`loragen.philox.keep_threshold`
    rounds p, so both generators keep with the same probability."""
    t, k = (1 << _KEEP_BITS) - philox.keep_threshold(p), _KEEP_BITS
    while k > 0 and t % 2 == 0:
        t, k = t // 2, k - 1
    return t, k


def dropout_keep_bits(numel: int, p: float, seed: int) -> Tensor:
    """The "bits" generator: a keep-mask of ``numel`` elements packed into bits (uint8; element i is
    bit i % 8 of byte i // 8; padded to whole 64-bit words), each kept with probability 1 - p rounded
    to a multiple of 2**-16.

    A PCG64 stream seeded with ``seed`` feeds the binary expansion of the keep probability: with random
    words R_1..R_k and the bits b_1..b_k of ``t / 2**k``, ``acc = R_k`` and then ``acc = R_i | acc``
    where b_i is 1 and ``R_i & acc`` where it is 0 leaves each bit of ``acc`` set with probability
    exactly ``t / 2**k``: 64 elements per word operation and no packing pass.

    Raises:
        ValueError: ``p`` not in [0, 1).
    """
    words = (numel + 63) // 64
    t, k = _keep_fraction(p)
    if k == 0:  # t = 1: keep everything
        return torch.full((words * 8,), 255, dtype=torch.uint8)
    draws = np.random.PCG64(seed).random_raw(words * k).reshape(k, words)
    acc = draws[k - 1].copy()  # bit k of t is 1 (t is odd); a copy, not a view of all the draws
    for i in range(k - 2, -1, -1):
        combine = np.bitwise_or if (t >> (k - 1 - i)) & 1 else np.bitwise_and
        combine(acc, draws[i], out=acc)
    return torch.from_numpy(acc.view(np.uint8))


_PHILOX_M0, _PHILOX_M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_PHILOX_W0, _PHILOX_W1 = 0x9E3779B9, 0xBB67AE85
_LOW32, _SHIFT32 = np.uint64(0xFFFFFFFF), np.uint64(32)
_PHILOX_CHUNK = 1 << 18  # Philox calls per vectorised chunk: 2 MiB per uint64 temporary


def philox_keep_bits(numel: int, p: float, seed: int, offset: int = 0) -> Tensor:
    """The "philox" generator: the mask of :func:`loragen.philox.dropout_keep_mask` (the one the CUDA
    kernels regenerate) packed like :func:`dropout_keep_bits`. numpy's uint64 holds the exact
    32x32-bit products, which makes this several times faster than the int64-torch reference.

    Raises:
        ValueError: ``p`` not in [0, 1), or ``seed`` / ``offset`` not unsigned 64-bit.
    """
    threshold = philox.keep_threshold(p)
    if not (0 <= seed < 1 << 64 and 0 <= offset < 1 << 64):
        raise ValueError(f"loragen.ops.philox_keep_bits: seed={seed}, offset={offset}; expected unsigned 64-bit")
    calls = (numel + 63) // 64 * 8  # 8 elements per call, whole 64-bit words of output
    chunks = []
    for first in range(0, calls, _PHILOX_CHUNK):
        q = np.arange(first, min(first + _PHILOX_CHUNK, calls), dtype=np.uint64)
        c0, c1 = q & _LOW32, q >> _SHIFT32
        c2, c3 = np.full_like(q, offset & 0xFFFFFFFF), np.full_like(q, offset >> 32)
        p0, p1 = np.empty_like(q), np.empty_like(q)
        k0, k1 = seed & 0xFFFFFFFF, seed >> 32
        for round_index in range(10):
            if round_index:
                k0, k1 = (k0 + _PHILOX_W0) & 0xFFFFFFFF, (k1 + _PHILOX_W1) & 0xFFFFFFFF
            np.multiply(c0, _PHILOX_M0, out=p0)  # exact: both factors < 2**32
            np.multiply(c2, _PHILOX_M1, out=p1)
            # c0, c1, c2, c3 = hi(p1) ^ c1 ^ k0, lo(p1), hi(p0) ^ c3 ^ k1, lo(p0), in place
            np.right_shift(p1, _SHIFT32, out=c0)
            np.bitwise_xor(c0, c1, out=c0)
            np.bitwise_xor(c0, np.uint64(k0), out=c0)
            np.bitwise_and(p1, _LOW32, out=c1)
            np.right_shift(p0, _SHIFT32, out=c2)
            np.bitwise_xor(c2, c3, out=c2)
            np.bitwise_xor(c2, np.uint64(k1), out=c2)
            np.bitwise_and(p0, _LOW32, out=c3)
        words = np.empty((len(q), 4), dtype=np.uint32)
        for j, c in enumerate((c0, c1, c2, c3)):
            words[:, j] = c
        # little-endian: the uint16 view puts lane j at (w[j // 2] >> 16 * (j % 2)) & 0xFFFF
        chunks.append(np.packbits(words.view(np.uint16) >= threshold, bitorder="little"))
    return torch.from_numpy(np.concatenate(chunks) if chunks else np.zeros(0, np.uint8))


_BIT_SHIFTS = torch.arange(8, dtype=torch.uint8)


def unpack_keep_mask(bits: Tensor, numel: int) -> Tensor:
    """The first ``numel`` elements of a packed mask (see :func:`dropout_keep_bits`) as bool."""
    unpacked = (bits[: (numel + 7) // 8].unsqueeze(-1) >> _BIT_SHIFTS) & 1
    return unpacked.view(torch.bool).view(-1)[:numel]


def _make_keep_bits(numel: int, p: float, seed: int, rng: str) -> Tensor:
    return philox_keep_bits(numel, p, seed) if rng == "philox" else dropout_keep_bits(numel, p, seed)


class _Keep:
    """A packed keep-mask applied to row blocks of an (N, in) tensor.

    For the dtypes numpy has, numpy unpacks (a table lookup) and multiplies by the bool mask: 4-5x
    faster here than torch's shifts and ``where``, which do the work for bfloat16.
    """

    _NUMPY_DTYPES = (torch.float16, torch.float32, torch.float64)

    def __init__(self, bits: Tensor, in_features: int, dtype: torch.dtype) -> None:
        self.bits = bits
        self.in_features = in_features
        self.bits_np = bits.numpy() if dtype in self._NUMPY_DTYPES else None
        self.zero = torch.zeros((), dtype=dtype)

    def block(self, start: int, stop: int) -> Any:
        """The keep-mask of rows [start, stop) (start a multiple of 8), (stop - start, in) bool."""
        first, numel = start * self.in_features // 8, (stop - start) * self.in_features
        if self.bits_np is not None:
            packed = self.bits_np[first : first + (numel + 7) // 8]
            return np.unpackbits(packed, count=numel, bitorder="little").view(np.bool_).reshape(stop - start, -1)
        return unpack_keep_mask(self.bits[first:], numel).view(stop - start, self.in_features)

    def apply(self, src: Tensor, keep: Any, out: Tensor) -> Tensor:
        """``out = src * keep`` (``out`` may be ``src``); returns ``out``."""
        if isinstance(keep, np.ndarray):
            np.multiply(src.detach().numpy(), keep, out=out.detach().numpy())
        else:
            torch.where(keep, src, self.zero, out=out)
        return out


def _row_blocks(rows: int, row_elems: int) -> Iterator[tuple[int, int]]:
    """(start, stop) row ranges of at most ``_BLOCK_ELEMS`` elements (at least 8 rows); block starts
    are multiples of 8 rows, so every block begins on a byte of the packed mask."""
    step = _block_rows(row_elems)
    for start in range(0, rows, step):
        yield start, min(start + step, rows)


def _block_rows(row_elems: int) -> int:
    return max(8, (_BLOCK_ELEMS // max(row_elems, 1)) // 8 * 8)


# ---- the op ----------------------------------------------------------------------------------------


class LoraLinearFunction(torch.autograd.Function):
    """:func:`lora_linear` on the CPU as one autograd node; the formulas are in the module docstring.

    ``apply(x, weight, bias, lora_A, lora_B, scaling, dropout_p, rng, seed, fan_in_fan_out)`` with
    ``dropout_p = 0`` meaning no dropout; ``seed`` fixes the mask (None draws one from torch's CPU
    generator, as the CUDA op does, so "philox" masks agree across devices).
    """

    @staticmethod
    def forward(  # type: ignore[override]
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
            bits = _make_keep_bits(rows * in_features, dropout_p, seed, rng)
            compiled = x.dtype == dtype and cpu_kernels.available(dtype, lora_A.shape[0])
        if compiled:  # the mask read where it is used: no masked copy of x (loragen.ops.cpu_kernels)
            assert bits is not None
            h = cpu_kernels.masked_down(x2.contiguous(), bits, lora_A, 1.0 / (1.0 - dropout_p))
        elif bits is not None:
            keep = _Keep(bits, in_features, dtype)
            h = torch.empty(rows, lora_A.shape[0], dtype=dtype)
            buffer = torch.empty(min(rows, _block_rows(in_features)), in_features, dtype=dtype)
            for start, stop in _row_blocks(rows, in_features):
                xb = keep.apply(x2[start:stop].to(dtype), keep.block(start, stop), buffer[: stop - start])
                torch.mm(xb, lora_A.t(), out=h[start:stop])
            h.mul_(1.0 / (1.0 - dropout_p))
        else:
            h = torch.mm(x2 if x.dtype == dtype else x2.to(dtype), lora_A.t())

        w_t = weight if fan_in_fan_out else weight.t()  # (in, out)
        if dtype == x.dtype:
            y = lora_output(x2, w_t, bias, h, lora_B, scaling)
        else:  # as peft: the base in x's dtype, the term in the adapter's, added and rounded once
            y = torch.addmm(bias, x2, w_t) if bias is not None else torch.mm(x2, w_t)
            y.add_(torch.mm(h, lora_B.t()), alpha=scaling)

        need_x, need_w, _, need_a, need_b = ctx.needs_input_grad[:5]
        ctx.scaling, ctx.dropout_p, ctx.fan_in_fan_out = scaling, dropout_p, fan_in_fan_out
        ctx.rng, ctx.seed, ctx.x_shape, ctx.rows, ctx.has_bias = rng, seed, x.shape, rows, bias is not None
        ctx.compiled = compiled
        ctx.save_for_backward(
            x2 if need_a or need_w else None,
            weight if need_x else None,
            lora_A,
            lora_B,
            h if need_b else None,
            bits if rng == "bits" else None,  # "philox" regenerates the mask from the seed
        )
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x2, weight, lora_A, lora_B, h, bits = ctx.saved_tensors
        need_x, need_w, need_bias, need_a, need_b = ctx.needs_input_grad[:5]
        s, p, ffo = ctx.scaling, ctx.dropout_p, ctx.fan_in_fan_out
        rows, in_features = ctx.rows, ctx.x_shape[-1]
        dtype = lora_A.dtype
        keep = None
        if p > 0.0:
            if bits is None:
                bits = _make_keep_bits(rows * in_features, p, ctx.seed, ctx.rng)
            if not ctx.compiled:
                keep = _Keep(bits, in_features, dtype)

        g2 = grad_out.reshape(rows, grad_out.shape[-1])
        g_lora = g2 if g2.dtype == dtype else g2.to(dtype)
        grad_x = grad_w = grad_bias = grad_a = grad_b = None
        if need_b:
            grad_b = torch.mm(h.t(), g_lora).mul_(s).t()  # (out, r); h^T g is the faster layout
        if need_x or need_a:
            gh = torch.mm(g_lora, lora_B).mul_(s / (1.0 - p))  # (N, r)
            if ctx.compiled:
                if need_a:
                    grad_a = cpu_kernels.masked_grad_a(x2.contiguous(), bits, gh)
                if need_x:
                    w = weight.t() if ffo else weight
                    grad_x = cpu_kernels.masked_grad_x(gh, lora_A, bits).addmm_(g2, w)
            elif keep is None:
                if need_a:
                    grad_a = torch.mm(gh.t(), x2 if x2.dtype == dtype else x2.to(dtype))
                if need_x:
                    grad_x = _grad_input(g2, weight, gh, lora_A, ffo)
            else:
                grad_x, grad_a = _grads_masked(g2, x2, weight, gh, lora_A, keep, ffo, need_x, need_a)
        if need_w:
            grad_w = torch.mm(x2.t(), g2) if ffo else torch.mm(g2.t(), x2)
        if need_bias and ctx.has_bias:
            grad_bias = g2.sum(0)
        if grad_x is not None:
            grad_x = grad_x.view(ctx.x_shape)
        return grad_x, grad_w, grad_bias, grad_a, grad_b, None, None, None, None, None


def lora_output(x2: Tensor, w_t: Tensor, bias: Tensor | None, h: Tensor, lora_B: Tensor, scaling: float) -> Tensor:
    """``b + h (s B^T) + x W^T`` for x2 (N, in), w_t (in, out), h (N, r), all of one dtype: the rank-r
    term first, then the base GEMM accumulates onto it (beta = 1; the module docstring says why)."""
    if bias is not None:
        y = torch.addmm(bias, h, lora_B.t(), alpha=scaling)
    else:
        y = torch.mm(h * scaling, lora_B.t())  # scaling the (N, r) factor, not the (N, out) result
    return y.addmm_(x2, w_t)


def _grad_input(g2: Tensor, weight: Tensor, gh: Tensor, lora_A: Tensor, ffo: bool) -> Tensor:
    """``g W + gh A`` without dropout: (N, in)."""
    w = weight.t() if ffo else weight  # (out, in)
    if gh.dtype != g2.dtype:  # the LoRA term in the adapter's dtype, added to the base gradient
        return torch.mm(g2, w).add_(torch.mm(gh, lora_A))
    return torch.mm(gh, lora_A).addmm_(g2, w)


def _grads_masked(
    g2: Tensor,
    x2: Tensor | None,
    weight: Tensor | None,
    gh: Tensor,
    lora_A: Tensor,
    keep: _Keep,
    ffo: bool,
    need_x: bool,
    need_a: bool,
) -> tuple[Tensor | None, Tensor | None]:
    """With dropout, block by block, one unpacked mask serving both:
    ``dx = (gh A) * m + g W`` (N, in) and ``dA = gh^T (x * m)`` (r, in)."""
    rows, in_features = g2.shape[0], lora_A.shape[1]
    dtype = lora_A.dtype
    same_dtype = g2.dtype == dtype
    grad_x = torch.empty(rows, in_features, dtype=g2.dtype) if need_x else None
    grad_a = torch.zeros(lora_A.shape, dtype=dtype) if need_a else None
    gh_t = gh.t()
    buffer = torch.empty(min(rows, _block_rows(in_features)), in_features, dtype=dtype)
    for start, stop in _row_blocks(rows, in_features):
        mask = keep.block(start, stop)
        if grad_a is not None:
            assert x2 is not None  # saved whenever A needs a gradient
            xb = keep.apply(x2[start:stop].to(dtype), mask, buffer[: stop - start])
            grad_a.addmm_(gh_t[:, start:stop], xb)
        if grad_x is not None:
            target = grad_x[start:stop] if same_dtype else buffer[: stop - start]
            keep.apply(torch.mm(gh[start:stop], lora_A, out=target), mask, target)
            if not same_dtype:
                grad_x[start:stop].copy_(target)
    if grad_x is not None:
        assert weight is not None  # saved whenever x needs a gradient
        grad_x.addmm_(g2, weight.t() if ffo else weight)
    return grad_x, grad_a


# ---- entry points ----------------------------------------------------------------------------------


def lora_linear_reference(
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
) -> Tensor:
    """Plain-autograd LoRA linear, composed as peft composes it (``F.linear`` and ``F.dropout``).

    Shapes: x (..., in), weight (out, in) -- (in, out) with ``fan_in_fan_out`` --, bias (out,) or None,
    lora_A (r, in), lora_B (out, r) -> (..., out). The LoRA branch runs in the adapter's dtype and the
    sum is cast back to the base result's dtype.
    """
    result = F.linear(x, weight.t() if fan_in_fan_out else weight, bias)
    x_lora = x.to(lora_A.dtype)
    if dropout_p > 0 and training:
        x_lora = F.dropout(x_lora, dropout_p, True)
    lora = F.linear(F.linear(x_lora, lora_A), lora_B)
    return (result + lora * scaling).to(result.dtype)


def fallback_reason(x: Tensor, dropout: bool) -> str | None:
    """Why :func:`lora_linear` runs :func:`lora_linear_reference` instead of the fused CPU op for a
    CPU tensor ``x``, or None when the fused op runs.

    Under autocast the composition (made of ``F.linear``) keeps autocast's per-op dtypes. Under
    ``torch.compile`` with dropout, dynamo cannot trace the numpy mask generator, and inductor fuses
    the composition's dropout itself; without dropout the fused op compiles (no graph break).
    """
    if torch.is_autocast_enabled(x.device.type):
        return "autocast is enabled: the composition keeps autocast's per-op dtypes"
    if dropout and torch.compiler.is_compiling():
        return "torch.compile with dropout: the numpy mask generator cannot be traced"
    return None


_logged_reasons: set[str] = set()


def lora_linear(
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
    rng: DropoutRng | None = None,
    seed: int | None = None,
) -> Tensor:
    """LoRA linear ``x W^T + b + scaling * B A dropout(x)``: the fused op.

    Shapes: x (..., in), weight (out, in) -- (in, out) with ``fan_in_fan_out`` (transformers'
    ``Conv1D``) --, bias (out,) or None, lora_A (r, in), lora_B (out, r) -> (..., out) in x's dtype. The
    LoRA branch is computed in lora_A's dtype (x cast to it, as peft does) and added to the base result
    with one rounding. Dropout (probability ``dropout_p``, only when ``training``) applies to the LoRA
    branch only, with inverted scaling. Gradients flow to every input that requires them, the base
    weight and bias included.

    CPU tensors run :class:`LoraLinearFunction`; CUDA tensors run loragen's kernels when
    :func:`loragen.cuda.is_available`; the plain composition (:func:`lora_linear_reference`) runs
    inside ``use_fused(False)``, on other devices and for the reasons of :func:`fallback_reason`.

    Args:
        rng: CPU dropout mask generator, "bits" or "philox" (default: see :func:`use_dropout_rng`).
        seed: fixes the dropout mask (tests, gradcheck); None draws one from torch's CPU generator.

    Raises:
        ValueError: ``dropout_p`` outside [0, 1) or an unknown ``rng``.
    """
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"loragen.ops.lora_linear: dropout_p={dropout_p!r}; expected 0 <= p < 1")
    if rng is None:
        rng = _rng_default
    else:
        _check_rng(rng)
    dropout = training and dropout_p > 0.0
    args = (x, weight, bias, lora_A, lora_B, scaling, dropout_p, training)
    if not _fused_default:
        return lora_linear_reference(*args, fan_in_fan_out=fan_in_fan_out)
    if x.device.type != "cpu":
        if x.is_cuda and _cuda_ready():
            from loragen import cuda

            return cuda.lora_linear_cuda(*args, fan_in_fan_out=fan_in_fan_out)
        return lora_linear_reference(*args, fan_in_fan_out=fan_in_fan_out)
    reason = fallback_reason(x, dropout)
    if reason is not None:
        if reason not in _logged_reasons:
            _logged_reasons.add(reason)
            _log.info("loragen.ops.lora_linear runs the plain composition: %s", reason)
        return lora_linear_reference(*args, fan_in_fan_out=fan_in_fan_out)
    p = dropout_p if dropout else 0.0
    return LoraLinearFunction.apply(x, weight, bias, lora_A, lora_B, scaling, p, rng, seed, fan_in_fan_out)


def _cuda_ready() -> bool:
    from loragen import cuda

    return cuda.is_available()
