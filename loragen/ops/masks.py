"""Dropout keep-masks as packed bits, and the row blocks masked products work in.

Two generators, chosen by :data:`loragen.switches.dropout_rng`; both keep an element with probability
1 - p rounded to a multiple of 2**-16 (as :func:`loragen.philox.keep_threshold` rounds p):

``"bits"`` (default)  PCG64 words combined by the binary expansion of 1 - p straight into packed bits.
``"philox"``          the counter-based Philox4x32-10 mask of :mod:`loragen.philox`, bit-identical to the
                      CUDA kernels' for the same seed (regenerated in backward, nothing saved).

A packed mask holds element i in bit i % 8 of byte i // 8, padded to whole 64-bit words.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from loragen import philox

__all__ = [
    "BLOCK_ELEMS",
    "DropoutRng",
    "KeepMask",
    "RNG_MODES",
    "block_rows",
    "check_rng",
    "dropout_keep_bits",
    "make_keep_bits",
    "philox_keep_bits",
    "row_blocks",
    "unpack_keep_mask",
]

DropoutRng = Literal["bits", "philox"]
RNG_MODES: tuple[str, ...] = ("bits", "philox")

# Masked temporaries hold at most this many elements per row block (4 MiB in float32): big enough that
# the per-block Python cost vanishes, small enough for L2/L3 and malloc's heap (no page faults).
BLOCK_ELEMS = 1 << 20

# 1 - p is resolved to this many bits, as loragen.philox does; the "bits" generator spends one random
# bit per element per resolved bit.
_KEEP_BITS = philox.THRESHOLD_BITS


def check_rng(mode: str) -> None:
    """Raise ValueError unless ``mode`` is one of the generators."""
    if mode not in RNG_MODES:
        raise ValueError(
            f"loragen.ops: dropout rng={mode!r}; expected one of {', '.join(map(repr, RNG_MODES))}"
        )


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
        raise ValueError(
            f"loragen.ops.philox_keep_bits: seed={seed}, offset={offset}; expected unsigned 64-bit"
        )
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


def make_keep_bits(numel: int, p: float, seed: int, rng: str) -> Tensor:
    """The packed keep-mask of ``numel`` elements from generator ``rng`` ("bits" or "philox")."""
    return philox_keep_bits(numel, p, seed) if rng == "philox" else dropout_keep_bits(numel, p, seed)


class KeepMask:
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
            return (
                np.unpackbits(packed, count=numel, bitorder="little").view(np.bool_).reshape(stop - start, -1)
            )
        return unpack_keep_mask(self.bits[first:], numel).view(stop - start, self.in_features)

    def apply(self, src: Tensor, keep: Any, out: Tensor) -> Tensor:
        """``out = src * keep`` (``out`` may be ``src``); returns ``out``."""
        if isinstance(keep, np.ndarray):
            np.multiply(src.detach().numpy(), keep, out=out.detach().numpy())
        else:
            torch.where(keep, src, self.zero, out=out)
        return out


def row_blocks(rows: int, row_elems: int) -> Iterator[tuple[int, int]]:
    """(start, stop) row ranges of at most ``BLOCK_ELEMS`` elements (at least 8 rows); block starts
    are multiples of 8 rows, so every block begins on a byte of the packed mask."""
    step = block_rows(row_elems)
    for start in range(0, rows, step):
        yield start, min(start + step, rows)


def block_rows(row_elems: int) -> int:
    """Rows per block for rows of ``row_elems`` elements (a multiple of 8, at least 8)."""
    return max(8, (BLOCK_ELEMS // max(row_elems, 1)) // 8 * 8)
