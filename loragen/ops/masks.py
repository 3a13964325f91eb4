"""Dropout keep-masks of the CPU ops as packed bits (element i is bit i % 8 of byte i // 8, padded to whole
64-bit words), drawn from a PCG64 stream, and the row blocks masked products work in. Each element is kept
with probability 1 - p rounded to a multiple of 2**-16, as :func:`loragen.philox.keep_threshold` rounds p.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from torch import Tensor

from loragen import philox

__all__ = ["BLOCK_ELEMS", "KeepMask", "block_rows", "dropout_keep_bits", "row_blocks", "unpack_keep_mask"]

# Masked temporaries hold at most this many elements per row block (4 MiB in float32): big enough that
# the per-block Python cost vanishes, small enough for L2/L3 and malloc's heap (no page faults).
BLOCK_ELEMS = 1 << 20


def _keep_fraction(p: float) -> tuple[int, int]:
    """1 - p as ``t / 2**k`` with t odd (or k = 0), rounded as :func:`loragen.philox.keep_threshold` rounds p."""
    t, k = (1 << philox.THRESHOLD_BITS) - philox.keep_threshold(p), philox.THRESHOLD_BITS
    while k > 0 and t % 2 == 0:
        t, k = t // 2, k - 1
    return t, k


def dropout_keep_bits(numel: int, p: float, seed: int) -> Tensor:
    """A keep-mask of ``numel`` elements packed into bits (uint8, padded to whole 64-bit words).

    With random words R_1..R_k and the bits b_1..b_k of the keep probability ``t / 2**k``, ``acc = R_k`` and
    then ``acc = R_i | acc`` where b_i is 1, ``R_i & acc`` where it is 0, sets each bit with probability
    exactly ``t / 2**k``.

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


def unpack_keep_mask(bits: Tensor, numel: int) -> Tensor:
    """The first ``numel`` elements of a packed mask as bool (numpy's table lookup beats torch's shifts)."""
    packed = bits[: (numel + 7) // 8].numpy()
    return torch.from_numpy(np.unpackbits(packed, count=numel, bitorder="little").view(np.bool_))


class KeepMask:
    """A packed keep-mask applied to row blocks of an (N, in) tensor (numpy multiplies where it has the dtype:
    4-5x faster than torch's ``where``)."""

    def __init__(self, bits: Tensor, in_features: int, dtype: torch.dtype) -> None:
        self.bits, self.in_features = bits, in_features
        self.numpy = dtype in (torch.float16, torch.float32, torch.float64)
        self.zero = torch.zeros((), dtype=dtype)

    def block(self, start: int, stop: int) -> Tensor:
        """The keep-mask of rows [start, stop) (start a multiple of 8), (stop - start, in) bool."""
        first, numel = start * self.in_features // 8, (stop - start) * self.in_features
        return unpack_keep_mask(self.bits[first:], numel).view(stop - start, self.in_features)

    def apply(self, src: Tensor, keep: Tensor, out: Tensor) -> Tensor:
        """``out = src * keep`` (``out`` may be ``src``); returns ``out``."""
        if self.numpy:
            np.multiply(src.detach().numpy(), keep.numpy(), out=out.detach().numpy())
        else:
            torch.where(keep, src, self.zero, out=out)
        return out


def row_blocks(rows: int, row_elems: int) -> Iterator[tuple[int, int]]:
    """(start, stop) row ranges of at most ``BLOCK_ELEMS`` elements, starting on whole bytes of the mask."""
    step = block_rows(row_elems)
    for start in range(0, rows, step):
        yield start, min(start + step, rows)


def block_rows(row_elems: int) -> int:
    """Rows per block for rows of ``row_elems`` elements (a multiple of 8, at least 8)."""
    return max(8, (BLOCK_ELEMS // max(row_elems, 1)) // 8 * 8)
