"""Block-wise dynamic 8-bit quantization: the state format of :class:`loragen.training.adamw8bit.AdamW8bit`.

The scheme of Dettmers et al., "8-bit Optimizers via Block-wise Quantization" (2022), used by
bitsandbytes:

* a tensor is cut into blocks of ``block_size`` elements; a block stores one fp32 scale (its largest
  magnitude) and one byte per element;
* the byte indexes a fixed table of 256 values in ``[-1, 1]`` (``[0, 1]`` for the second moment, which is
  never negative) whose spacing is *dynamic*: the table covers seven decades, and each decade gets twice
  the entries of the one below it, so small values keep their relative precision instead of collapsing to
  zero as they would on a linear grid.
"""

from __future__ import annotations

import functools
import math

import torch

__all__ = ["dequantize_blockwise", "dynamic_code", "dynamic_kind", "quantize_blocks", "quantize_blockwise"]

_DECADES = 7  # the dynamic table spans magnitudes from about 1e-7 to 1


def dynamic_code(signed: bool) -> torch.Tensor:
    """The 256-entry dynamic quantization table, sorted ascending, float32.

    Decade ``d`` (0 = smallest) holds magnitudes ``10**(d - 6) * f`` where the fractions ``f`` are the
    centres of an even split of ``[0.1, 1]`` into ``2**d`` parts (``2**(d + 1)`` parts when unsigned: the
    sign bit is spent on precision instead). The table also holds exactly ``0`` and ``1`` so that zeros
    and each block's largest magnitude are stored without error.

    Args:
        signed: ``True`` for values in ``[-1, 1]`` (first moment), ``False`` for ``[0, 1]`` (second moment).

    Returns:
        A new tensor of shape ``(256,)``, dtype float32, strictly increasing.
    """
    return _build_dynamic_code(signed).clone()


@functools.cache
def _build_dynamic_code(signed: bool) -> torch.Tensor:
    magnitudes: list[float] = []
    for decade in range(_DECADES):
        parts = 2**decade if signed else 2 ** (decade + 1)
        edges = torch.linspace(0.1, 1.0, parts + 1, dtype=torch.float64)
        centres = (edges[:-1] + edges[1:]) / 2
        magnitudes.extend((centres * 10.0 ** (decade - _DECADES + 1)).tolist())
    values = [*magnitudes, 0.0, 1.0]
    if signed:
        values += [-m for m in magnitudes]
    table = torch.tensor(sorted(values), dtype=torch.float32)
    if table.numel() != 256 or not bool((table[1:] > table[:-1]).all()):
        raise RuntimeError("internal error: the dynamic quantization table must hold 256 distinct values")
    return table


_LUT_SHIFT = 15  # buckets of 2**15 float32 bit patterns: relative width 2**-8, below the table's spacing
_LUT_MASK = (1 << (32 - _LUT_SHIFT)) - 1  # keeps the sign bit as the bucket number's top bit


@functools.cache
def _lookup(signed: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Tables (on ``device``) for finding the nearest :func:`dynamic_code` entry of a value in ``[-1, 1]`` fast.

    A float32's bit pattern, read as an integer, orders values of one sign by magnitude, so its top
    bits name a narrow bucket of values. ``first[bucket]`` is the nearest entry for the bucket's lowest
    value (the most negative one for negative buckets). Buckets are narrower than the gap between two
    midpoints of the table, so the nearest entry of any value in the bucket is ``first[bucket]`` or the
    next one up: one comparison with the midpoint between them decides.

    Returns:
        ``(first, midpoints)``: int32 per bucket, and the table's 255 midpoints padded with ``inf``.
    """
    code = _build_dynamic_code(signed)
    midpoints = torch.cat(((code[1:] + code[:-1]) / 2, torch.tensor([math.inf])))
    patterns = torch.arange(_LUT_MASK + 1, dtype=torch.int64) << _LUT_SHIFT
    lowest = patterns.to(torch.int32).view(torch.float32)  # a bucket's first pattern: its smallest magnitude
    highest = (patterns + (1 << _LUT_SHIFT) - 1).to(torch.int32).view(torch.float32)
    lower, upper = torch.minimum(lowest, highest), torch.maximum(lowest, highest)
    usable = torch.minimum(lower.abs(), upper.abs()) <= 1.0  # the others hold no normalized value
    first = torch.where(usable, torch.bucketize(lower, midpoints[:-1]), torch.zeros((), dtype=torch.int64))
    spans = torch.bucketize(upper, midpoints[:-1]) - first
    if int(spans[usable].max()) > 1:
        raise RuntimeError("internal error: a lookup bucket spans two midpoints of the dynamic table")
    return first.to(device=device, dtype=torch.int32), midpoints.to(device)


def _dynamic_indices(normalized: torch.Tensor, signed: bool, keep_nonzero: bool) -> torch.Tensor:
    """Index of the nearest :func:`dynamic_code` entry for each value of ``normalized`` (in [-1, 1]).

    A binary search over the 256 entries (``torch.bucketize``) costs 100-200 ns per element on a CPU;
    the bucket table of :func:`_lookup` needs two gathers and a comparison.
    """
    first, midpoints = _lookup(signed, normalized.device)
    buckets = ((normalized.view(torch.int32) >> _LUT_SHIFT) & _LUT_MASK).view(-1)
    below = torch.index_select(first, 0, buckets)  # index_select: much faster than t[idx] on a CPU
    nearest = below + (normalized.view(-1) > torch.index_select(midpoints, 0, below))
    if keep_nonzero:
        # A second moment rounded to zero under a non-zero first moment would make the step m / eps.
        zero = 127 if signed else 0
        values = normalized.view(-1)
        step = (values > 0).to(torch.int32) - (values < 0).to(torch.int32)
        nearest = torch.where(nearest == zero, nearest + step, nearest)
    return nearest.view(normalized.shape)


def dynamic_kind(code: torch.Tensor) -> bool | None:
    """``True`` / ``False`` when ``code`` is the signed / unsigned :func:`dynamic_code`, else ``None``."""
    table = code.detach().cpu()
    for signed in (True, False):
        if torch.equal(table, _build_dynamic_code(signed)):
            return signed
    return None


def quantize_blocks(
    blocks: torch.Tensor, code: torch.Tensor, dynamic: bool | None, keep_nonzero: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``(n_blocks, block_size)`` values; ``dynamic`` is :func:`dynamic_kind` of ``code``."""
    absmax = blocks.abs().amax(dim=1)
    scale = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    normalized = blocks / scale[:, None]
    if dynamic is not None:
        codes = _dynamic_indices(normalized, dynamic, keep_nonzero)
    else:  # any other sorted table: nearest entry by comparing with the midpoints between entries
        codes = torch.bucketize(normalized, (code[1:] + code[:-1]) / 2)
        if keep_nonzero:
            zero = int(torch.argmin(code.abs()))
            codes = torch.where((codes == zero) & (normalized != 0), codes + normalized.sign().long(), codes)
    return codes.to(torch.uint8), absmax


def quantize_blockwise(
    values: torch.Tensor, code: torch.Tensor, block_size: int, *, keep_nonzero: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``values`` block by block to indices into ``code`` (nearest entry).

    Args:
        values: float tensor of any shape; it is flattened and zero-padded to whole blocks.
        code: sorted table of 256 values in ``[-1, 1]`` (see :func:`dynamic_code`), on ``values``' device.
        block_size: elements per block (> 0).
        keep_nonzero: round non-zero values that are nearest to ``0.0`` to the smallest entry of their
            sign instead (used for the second moment).

    Returns:
        ``(codes, absmax)``: uint8 tensor ``(n_blocks, block_size)`` and float32 tensor ``(n_blocks,)``
        holding each block's largest magnitude. An all-zero block gets scale 0 and code ``0.0``.

    Raises:
        ValueError: ``block_size`` is not positive.
    """
    if block_size <= 0:
        raise ValueError(f"quantize_blockwise: block_size must be a positive integer, got {block_size}")
    flat = values.detach().reshape(-1).float()
    padding = (-flat.numel()) % block_size
    if padding:
        flat = torch.nn.functional.pad(flat, (0, padding))
    return quantize_blocks(flat.view(-1, block_size), code, dynamic_kind(code), keep_nonzero)


def dequantize_blockwise(
    codes: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, shape: torch.Size | None = None
) -> torch.Tensor:
    """Inverse of :func:`quantize_blockwise`.

    Args:
        codes: uint8 tensor ``(n_blocks, block_size)``.
        absmax: float32 tensor ``(n_blocks,)``.
        code: the table the codes index into.
        shape: if given, the padding is dropped and the result reshaped to it.

    Returns:
        float32 tensor ``(n_blocks, block_size)``, or ``shape`` when given.
    """
    blocks = (
        torch.index_select(code, 0, codes.reshape(-1).to(torch.int32)).view(codes.shape) * absmax[:, None]
    )
    if shape is None:
        return blocks
    numel = math.prod(shape)
    return blocks.reshape(-1)[:numel].reshape(shape)
