"""Philox4x32-10 dropout masks on the CPU, bit-identical to the masks loragen's CUDA kernels regenerate.

Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11) maps a 128-bit
counter and a 64-bit key to 128 random bits. It is counter-based: any element's random bits can be
computed on their own, so a kernel regenerates a dropout mask in backward instead of storing it, and
this module -- pure torch, int64 arithmetic -- produces exactly the same mask on the CPU.

Mask layout (the contract shared with ``kernels/lora_common.cuh``)
-------------------------------------------------------------------
For a tensor of ``shape`` with ``numel`` elements, element ``i`` is its row-major flat index (for the
LoRA input ``x`` of shape (..., in): ``i = row * in + column`` over ``x.reshape(-1, in)``).

* one Philox call covers 8 consecutive elements: group ``q = i // 8``, lane ``j = i % 8``;
* counter = ``(q mod 2**32, q >> 32, offset mod 2**32, offset >> 32)``, key = ``(seed mod 2**32,
  seed >> 32)`` (``seed`` and ``offset`` are unsigned 64-bit integers);
* the call returns four 32-bit words ``w``; lane ``j`` takes the 16 bits
  ``u = (w[j // 2] >> (16 * (j % 2))) & 0xFFFF``;
* the element is kept when ``u >= keep_threshold(p)``, where ``keep_threshold(p) = round(p * 65536)``;
  so the drop probability is ``p`` rounded to a multiple of 2**-16;
* kept elements are scaled by ``1 / (1 - p)`` (inverted dropout), dropped ones are zero.

Where seeds come from: the CPU ops draw them from torch's default CPU generator (:func:`random_seed`);
the CUDA op draws seed and offset with one device-side torch RNG op into a tensor its kernels read
(:func:`loragen.cuda.op_inputs.draw_rng`), which keeps CUDA-graph replays fresh. Either way
``torch.manual_seed`` reproduces a run and ``torch.utils.checkpoint``, which restores the RNG state of
the devices involved, recomputes the same mask.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "ELEMENTS_PER_CALL",
    "THRESHOLD_BITS",
    "dropout_keep_mask",
    "keep_mask_bits",
    "keep_scale",
    "keep_threshold",
    "philox4x32_10",
    "random_seed",
]

ELEMENTS_PER_CALL = 8  # 128 random bits per call, 16 per element
THRESHOLD_BITS = 16

_M0, _M1 = 0xD2511F53, 0xCD9E8D57  # round multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85  # key schedule (Weyl) increments
_MASK32 = 0xFFFFFFFF
_CHUNK_GROUPS = 1 << 18  # groups per vectorised chunk: ~10 MiB of int64 temporaries


def _mulhilo(a: Tensor, m: int) -> tuple[Tensor, Tensor]:
    """High and low 32-bit words of ``a * m`` for uint32 values held in int64 (no overflow).

    The 64-bit product can exceed int64, so ``m`` is split into 16-bit halves: each partial product
    stays below 2**48.
    """
    p_lo = a * (m & 0xFFFF)
    p_hi = a * (m >> 16)
    low_sum = p_lo + ((p_hi & 0xFFFF) << 16)
    return (p_hi >> 16) + (low_sum >> 32), low_sum & _MASK32


def philox4x32_10(counter: Tensor, key: Sequence[int]) -> Tensor:
    """Philox4x32-10 of each counter under one key.

    Args:
        counter: int64 tensor of shape (..., 4), each word in [0, 2**32).
        key: two words ``(k0, k1)`` in [0, 2**32).

    Returns:
        int64 tensor of shape (..., 4), the four output words in [0, 2**32).

    Raises:
        ValueError: ``counter`` is not int64 with a last dimension of 4, or a key word is out of range.
    """
    if counter.dtype != torch.int64 or counter.shape[-1:] != (4,):
        raise ValueError(
            f"loragen.philox.philox4x32_10: counter must be int64 of shape (..., 4), got "
            f"{counter.dtype} {tuple(counter.shape)}"
        )
    k0, k1 = (int(k) for k in key)
    if not (0 <= k0 <= _MASK32 and 0 <= k1 <= _MASK32):
        raise ValueError(f"loragen.philox.philox4x32_10: key words must be in [0, 2**32), got {(k0, k1)}")
    c0, c1, c2, c3 = counter.unbind(-1)
    for round_index in range(10):
        if round_index > 0:
            k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32
        hi0, lo0 = _mulhilo(c0, _M0)
        hi1, lo1 = _mulhilo(c2, _M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return torch.stack([c0, c1, c2, c3], dim=-1)


def keep_threshold(p: float) -> int:
    """The 16-bit threshold for drop probability ``p``: an element is kept when its bits are >= it.

    Raises:
        ValueError: ``p`` is not in [0, 1).
    """
    if not 0.0 <= p < 1.0:
        raise ValueError(f"loragen.philox: dropout probability p={p!r}; expected 0 <= p < 1")
    return min(round(p * (1 << THRESHOLD_BITS)), (1 << THRESHOLD_BITS) - 1)


def keep_scale(p: float) -> float:
    """The factor kept elements are multiplied by: ``1 / (1 - p)``.

    Raises:
        ValueError: ``p`` is not in [0, 1).
    """
    keep_threshold(p)  # validates p
    return 1.0 / (1.0 - p)


def _check_seed(name: str, value: int) -> int:
    value = int(value)
    if not 0 <= value < 1 << 64:
        raise ValueError(f"loragen.philox: {name}={value}; expected an unsigned 64-bit integer")
    return value


def _keep_flat(numel: int, threshold: int, seed: int, offset: int) -> Tensor:
    """Bool keep-mask of ``numel`` elements (flat), per the layout in the module docstring."""
    seed = _check_seed("seed", seed)
    offset = _check_seed("offset", offset)
    key = (seed & _MASK32, seed >> 32)
    groups = (numel + ELEMENTS_PER_CALL - 1) // ELEMENTS_PER_CALL
    lane_shift = torch.tensor([0, 16] * 4, dtype=torch.int64)
    lane_word = torch.arange(ELEMENTS_PER_CALL) // 2
    chunks = []
    for start in range(0, groups, _CHUNK_GROUPS):
        q = torch.arange(start, min(start + _CHUNK_GROUPS, groups), dtype=torch.int64)
        counter = torch.stack(
            [q & _MASK32, q >> 32, torch.full_like(q, offset & _MASK32), torch.full_like(q, offset >> 32)],
            dim=-1,
        )
        words = philox4x32_10(counter, key)  # (G, 4)
        bits16 = (words[:, lane_word] >> lane_shift) & 0xFFFF  # (G, 8): lane j of group q
        chunks.append((bits16 >= threshold).reshape(-1))
    if not chunks:
        return torch.zeros(0, dtype=torch.bool)
    return torch.cat(chunks)[:numel]


def dropout_keep_mask(shape: Sequence[int] | torch.Size, p: float, seed: int, offset: int = 0) -> Tensor:
    """The keep-mask (True = kept) the CUDA kernels use for a tensor of ``shape``, on the CPU.

    Args:
        shape: the tensor's shape; elements are numbered in row-major order.
        p: drop probability in [0, 1).
        seed: unsigned 64-bit key (see :func:`random_seed`).
        offset: unsigned 64-bit stream offset (upper counter words); different offsets give
            independent masks under one seed.

    Returns:
        bool tensor of ``shape`` on the CPU.

    Raises:
        ValueError: ``p``, ``seed`` or ``offset`` out of range.
    """
    threshold = keep_threshold(p)
    size = torch.Size(shape)
    if threshold == 0:
        _check_seed("seed", seed), _check_seed("offset", offset)
        return torch.ones(size, dtype=torch.bool)
    return _keep_flat(size.numel(), threshold, seed, offset).view(size)


def keep_mask_bits(numel: int, keep_prob: float, seed: int, offset: int = 0) -> Tensor:
    """The same mask packed into bits, as :mod:`loragen.ops` stores masks: element ``i`` is bit
    ``i % 8`` of byte ``i // 8``, the byte count padded to whole 64-bit words (uint8, CPU).

    ``keep_prob`` is ``1 - p``.

    Raises:
        ValueError: ``keep_prob`` not in (0, 1], or ``seed``/``offset`` out of range.
    """
    if not 0.0 < keep_prob <= 1.0:
        raise ValueError(
            f"loragen.philox.keep_mask_bits: keep_prob={keep_prob!r}; expected 0 < keep_prob <= 1"
        )
    keep = dropout_keep_mask((numel,), 1.0 - keep_prob, seed, offset)
    padded = torch.zeros((numel + 63) // 64 * 64, dtype=torch.bool)
    padded[:numel] = keep
    weights = torch.tensor([1 << b for b in range(8)], dtype=torch.int64)
    return (padded.view(-1, 8).to(torch.int64) * weights).sum(-1).to(torch.uint8)


def random_seed(generator: torch.Generator | None = None) -> int:
    """A fresh 63-bit seed drawn from ``generator`` (default: torch's default CPU generator)."""
    return int(torch.randint(0, (1 << 63) - 1, (), generator=generator))
