"""The torch path: what each LoRA kernel computes, with torch products (cuBLAS on a GPU) instead.

:class:`TorchKernels` is a :class:`~loragen.cuda.launch.KernelLauncher`: it takes a kernel's launch
exactly as :mod:`loragen.cuda.passes` makes it -- the same argument list, in the order of the kernel's
parameters (each function below names them as the kernel does) -- and writes the same outputs, so the
autograd Function and its hand-written backward run unchanged on it. It is the reference the self-check
compares the kernels with, and what the custom op (``torch.compile``) runs for a variant on the torch
path -- one that fails its self-check (:mod:`loragen.cuda.selfcheck`), or every variant with
``LORAGEN_CUDA_KERNELS=torch``. The eager op, routed here, runs the same computation as one composition
with torch's autograd instead (:mod:`loragen.cuda.torch_path`, less host work per call), unless the
launcher is ``TorchKernels(whole_op=False)``.

Products are taken in float32 over the whole tensors (x, g cast up once), every output is rounded once
into its dtype, and the dropout mask is the Philox mask of :mod:`loragen.philox`, generated on the
tensors' device from the op's ``rng`` tensor without the host ever reading it (no wait for the device,
CUDA-graph capture allowed): a variant that falls back keeps the exact masks the kernels would have
drawn, and so does ``torch.utils.checkpoint`` recomputation. Only tensors of more than
:data:`BLOCK_ELEMENTS` elements are taken in row blocks, to bound the float32 temporaries.

A and B^T come padded with zero rows to the rank bucket R; the products run over all R rows, so the
columns of h, dh and dB past the rank come out as exact zeros for finite inputs, without slicing.
Split reductions write the whole sum into partial 0 and zeros into the other partials, whose sum is all
the caller reads.

Dropout on a CUDA device costs two kernels in forward (the keep bits, and x masked) and two in backward
(the keep bits again, and x and dh A masked by one kernel) (:mod:`loragen.cuda.torch_dropout`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from loragen.cuda.kernel_variants import Variant
from loragen.cuda.specs import KernelSpec
from loragen.cuda.torch_dropout import BlockDropout, keep_mask

__all__ = ["BLOCK_ELEMENTS", "TorchKernels", "keep_mask", "rng_values"]

# elements per row block: a float32 block is 128 MiB, and a batch of 16k rows of 2048 features is one
# block (the Philox temporaries of the torch formulation stay < 1 GiB); blocks start on a multiple of 8
# rows, so each starts on a whole Philox group
BLOCK_ELEMENTS = 1 << 25
_MASK64 = (1 << 64) - 1


def rng_values(rng: Tensor) -> tuple[int, int]:
    """The (seed, offset) pair the kernels read through their ``rng`` pointer, as unsigned 64-bit ints.

    For tests and tools on the host: reading a CUDA tensor waits for the device, so the op itself never
    calls this (the torch path reads ``rng`` on the device, like the kernels).
    """
    seed, offset = rng.tolist()
    return seed & _MASK64, offset & _MASK64


def _row_blocks(rows: int, cols: int) -> list[tuple[int, int]]:
    step = max(8, BLOCK_ELEMENTS // max(cols, 1) // 8 * 8)
    return [(begin, min(rows, begin + step)) for begin in range(0, rows, step)]


def _first_partial(parts: Tensor) -> Tensor:
    """Zero every partial but the first, and return the first (which then holds the whole sum)."""
    if parts.shape[0] > 1:
        parts[1:].zero_()
    return parts[0]


def _f32(t: Tensor) -> Tensor:
    """``t`` in float32: itself when it already is (no dispatch at all), else a float32 copy."""
    return t if t.dtype == torch.float32 else t.float()


def _dropout(rng: Tensor | None, start: int, threshold: int, keep_scale: float) -> BlockDropout | None:
    return None if threshold == 0 or rng is None else BlockDropout(rng, start, threshold, keep_scale)


def _down(
    x: Tensor,
    lora_a: Tensor,
    h_part: Tensor,
    rows: int,
    cols: int,
    rank: int,
    cols_per_split: int,
    rng: Tensor | None,
    threshold: int,
    keep_scale: float,
) -> None:
    """h = dropout(x) A^T (rows, R) into partial 0."""
    h = _first_partial(h_part)
    if rows * cols <= BLOCK_ELEMENTS:
        drop = _dropout(rng, 0, threshold, keep_scale)
        torch.mm(_f32(x) if drop is None else drop(x), lora_a.mT, out=h)
        return
    for begin, end in _row_blocks(rows, cols):
        drop = _dropout(rng, begin * cols, threshold, keep_scale)
        block = x[begin:end]
        torch.mm(_f32(block) if drop is None else drop(block), lora_a.mT, out=h[begin:end])


def _up_block(h: Tensor, bt: Tensor, bias: Tensor | None, out: Tensor, scaling: float) -> None:
    if out.dtype == torch.float32:  # the op's float32 variant: in place, no temporary
        if bias is not None:
            out.add_(bias)
        out.addmm_(h, bt, alpha=scaling)
        return
    term = out.float()  # the base product, as cuBLAS wrote it
    if bias is not None:
        term.add_(bias)
    out.copy_(term.addmm_(h, bt, alpha=scaling))  # onto the base product, one rounding


def _up(
    h: Tensor,
    lora_bt: Tensor,
    bias: Tensor | None,
    out: Tensor,
    rows: int,
    cols: int,
    rank: int,
    scaling: float,
) -> None:
    """out = round(out + bias + s h B^T) (rows, out) in place."""
    if rows * cols <= BLOCK_ELEMENTS:
        _up_block(h, lora_bt, bias, out, scaling)
        return
    for begin, end in _row_blocks(rows, cols):
        _up_block(h[begin:end], lora_bt, bias, out[begin:end], scaling)


def _grad_out(
    grad: Tensor,
    h: Tensor,
    lora_bt: Tensor,
    dh_part: Tensor,
    db_part: Tensor,
    rows: int,
    cols: int,
    rank: int,
    rows_per_split: int,
    scaling: float,
) -> None:
    """dh = s g B (rows, R) and dB = s g^T h (out, R), into partial 0 of each."""
    dh = _first_partial(dh_part)
    db = _first_partial(db_part)
    b = lora_bt.mT  # (out, R)
    if rows * cols <= BLOCK_ELEMENTS:
        g = _f32(grad)
        dh.addmm_(g, b, beta=0, alpha=scaling)  # beta=0: what dh held (uninitialised) is not read
        db.addmm_(g.mT, h, beta=0, alpha=scaling)
        return
    for index, (begin, end) in enumerate(_row_blocks(rows, cols)):
        g = _f32(grad[begin:end])
        dh[begin:end].addmm_(g, b, beta=0, alpha=scaling)
        db.addmm_(g.mT, h[begin:end], beta=1 if index else 0, alpha=scaling)


def _grad_in_block(
    x: Tensor, dh: Tensor, a: Tensor, gx: Tensor | None, da: Tensor, first: bool, drop: BlockDropout | None
) -> None:
    if gx is None:
        da.addmm_(dh.mT, _f32(x) if drop is None else drop(x), beta=0 if first else 1)
        return
    if drop is None:
        da.addmm_(dh.mT, _f32(x), beta=0 if first else 1)
        if gx.dtype == torch.float32:
            torch.mm(dh, a, out=gx)
        else:
            gx.copy_(torch.mm(dh, a))  # one rounding into gx
        return
    xd, product = drop.pair(x, torch.mm(dh, a))  # one keep-mask for both, applied by one kernel
    da.addmm_(dh.mT, xd, beta=0 if first else 1)
    gx.copy_(product)  # one rounding into gx


def _grad_in(
    x: Tensor,
    dh: Tensor,
    lora_a: Tensor,
    grad_x_lora: Tensor | None,
    da_part: Tensor,
    rows: int,
    cols: int,
    rank: int,
    rows_per_split: int,
    rng: Tensor | None,
    threshold: int,
    keep_scale: float,
) -> None:
    """gx = dropout(dh A) (rows, in) in x's dtype, and dA = dh^T dropout(x) (R, in) into partial 0."""
    da = _first_partial(da_part)
    if rows * cols <= BLOCK_ELEMENTS:
        _grad_in_block(x, dh, lora_a, grad_x_lora, da, True, _dropout(rng, 0, threshold, keep_scale))
        return
    for begin, end in _row_blocks(rows, cols):
        gx = None if grad_x_lora is None else grad_x_lora[begin:end]
        drop = _dropout(rng, begin * cols, threshold, keep_scale)
        _grad_in_block(x[begin:end], dh[begin:end], lora_a, gx, da, begin == 0, drop)


# each kernel's computation, taking the kernel's arguments in the order of its parameters
# (tests/cuda/test_torch_kernels.py checks the names against the kernel specs)
KERNELS: dict[str, Callable[..., None]] = {
    "lora_down": _down,
    "lora_up": _up,
    "lora_grad_out": _grad_out,
    "lora_grad_in": _grad_in,
}


class TorchKernels:
    """Runs the LoRA kernels' computations with torch operations; see the module docstring.

    ``whole_op`` (the default): the eager op, routed here, runs
    :func:`loragen.cuda.torch_path.lora_linear_torch` instead of the four passes (the same results up to
    float32 rounding, less host work per call); False keeps it on the passes (the self-check compares the
    kernels with the passes either way).
    """

    whole_op: bool = True

    def __init__(self, whole_op: bool = True) -> None:
        self.whole_op = whole_op

    def target_blocks(self, device: torch.device) -> int:
        """One block: the torch path needs no split reductions."""
        return 1

    def launch(
        self,
        spec: KernelSpec,
        variant: Variant,
        grid: tuple[int, int],
        args: Sequence[object],
        device: torch.device,
    ) -> None:
        """Compute what kernel ``spec`` computes for ``args`` (``variant`` and ``grid`` do not matter).

        Raises:
            KeyError: ``spec`` is not one of the four LoRA kernels.
            TypeError: ``args`` does not match the kernel's parameter list.
        """
        run = KERNELS.get(spec.name)
        if run is None:
            raise KeyError(f"loragen.cuda.torch_kernels: no torch path for kernel {spec.name!r}")
        if len(args) != len(spec.params):
            raise TypeError(
                f"loragen.cuda.torch_kernels: kernel {spec.name} takes {len(spec.params)} arguments, "
                f"got {len(args)}"
            )
        if not torch.is_grad_enabled():  # the op's own calls: autograd already off
            run(*args)
            return
        with torch.no_grad():
            run(*args)
