"""Philox4x32-10 dropout masks with torch operations (any device), bit-identical to the masks loragen's
CUDA kernels regenerate in backward: loragen's one Python definition of its dropout masks.

Philox4x32-10 (Salmon et al., SC'11) maps a 128-bit counter and a 64-bit key to 128 random bits.
:func:`rng_keep_mask` reads seed and offset from an int64 tensor on the device, as the kernels do, so
the host never waits for the device.

Mask layout (the contract shared with ``kernels/lora_common.cuh``)
-------------------------------------------------------------------
Element ``i`` is the row-major flat index of the tensor (for the LoRA input ``x`` (..., in),
``i = row * in + column``).

* one Philox call covers 8 consecutive elements: group ``q = i // 8``, lane ``j = i % 8``;
* counter = ``(q mod 2**32, q >> 32, offset mod 2**32, offset >> 32)``, key = ``(seed mod 2**32,
  seed >> 32)`` (``seed`` and ``offset`` are unsigned 64-bit integers);
* lane ``j`` takes the 16 bits ``u = (w[j // 2] >> (16 * (j % 2))) & 0xFFFF`` of the output words ``w``;
* the element is kept when ``u >= keep_threshold(p) = round(p * 65536)``, and scaled by ``1 / (1 - p)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "ELEMENTS_PER_CALL",
    "THRESHOLD_BITS",
    "dropout_keep_mask",
    "keep_scale",
    "keep_threshold",
    "philox4x32_10",
    "random_seed",
    "rng_keep_mask",
    "rng_tensor",
]

ELEMENTS_PER_CALL = 8  # 128 random bits per call, 16 per element
THRESHOLD_BITS = 16

_M0, _M1 = 0xD2511F53, 0xCD9E8D57  # round multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85  # key schedule (Weyl) increments
_MASK32 = 0xFFFFFFFF
_CHUNK_GROUPS = 1 << 18  # groups per vectorised chunk: ~10 MiB of int64 temporaries


def _mulhilo(a: Tensor, m: int) -> tuple[Tensor, Tensor]:
    """High and low 32-bit words of ``a * m`` for uint32 values held in int64 (whose product wraps with
    the unsigned product's low 64 bits)."""
    p = a * m
    return (p >> 32) & _MASK32, p & _MASK32


def _rounds(
    c0: Tensor, c1: Tensor, c2: Tensor, c3: Tensor, k0: int | Tensor, k1: int | Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The ten Philox rounds on int64 counter words; key words ints or int64 tensors, all in [0, 2**32)."""
    for round_index in range(10):
        if round_index > 0:
            k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32
        hi0, lo0 = _mulhilo(c0, _M0)
        hi1, lo1 = _mulhilo(c2, _M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def philox4x32_10(counter: Tensor, key: Sequence[int]) -> Tensor:
    """Philox4x32-10 of each counter (int64 (..., 4)) under one key ``(k0, k1)``: int64 (..., 4), all
    words in [0, 2**32).

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
    return torch.stack(_rounds(c0, c1, c2, c3, k0, k1), dim=-1)


def keep_threshold(p: float) -> int:
    """The 16-bit threshold for drop probability ``p`` (an element is kept when its bits are >= it).

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


def rng_tensor(seed: int, offset: int, device: torch.device | str) -> Tensor:
    """The int64 (2,) tensor holding unsigned 64-bit ``seed`` and ``offset`` as int64 bits, on ``device``,
    made by two fills (no host-to-device copy, which a CUDA-graph capture would refuse).

    Raises:
        ValueError: ``seed`` or ``offset`` is not an unsigned 64-bit integer.
    """
    words = [
        v - (1 << 64) if v >= 1 << 63 else v
        for v in (_check_seed("seed", seed), _check_seed("offset", offset))
    ]
    rng = torch.full((2,), words[1], dtype=torch.int64, device=device)
    rng[0].fill_(words[0])
    return rng


def rng_keep_mask(rng: Tensor, start: int, numel: int, threshold: int) -> Tensor:
    """Flat elements ``start .. start + numel - 1`` of the keep-mask for (seed, offset) = ``rng`` (int64
    (2,), :func:`rng_tensor`), bool on ``rng``'s device; ``threshold`` is :func:`keep_threshold` of p.
    Seed and offset are read on the device, never by the host."""
    device = rng.device
    seed, offset = rng.unbind()
    key = (seed & _MASK32, (seed >> 32) & _MASK32)
    offset_words = (offset & _MASK32, (offset >> 32) & _MASK32)
    lane = torch.arange(ELEMENTS_PER_CALL, dtype=torch.int64, device=device)
    lane_word, lane_shift = lane // 2, (lane % 2) * 16
    first = start // ELEMENTS_PER_CALL
    last = (start + numel + ELEMENTS_PER_CALL - 1) // ELEMENTS_PER_CALL
    chunks = []
    for begin in range(first, max(last, first + 1), _CHUNK_GROUPS):  # one group at least: numel may be 0
        q = torch.arange(begin, min(begin + _CHUNK_GROUPS, last), dtype=torch.int64, device=device)
        words = torch.stack(
            _rounds(q & _MASK32, q >> 32, offset_words[0].expand_as(q), offset_words[1].expand_as(q), *key),
            dim=-1,
        )  # (G, 4)
        bits16 = (words[:, lane_word] >> lane_shift) & 0xFFFF  # (G, 8): lane j of group q
        chunks.append((bits16 >= threshold).reshape(-1))
    keep = chunks[0] if len(chunks) == 1 else torch.cat(chunks)
    skip = start - first * ELEMENTS_PER_CALL
    return keep[skip : skip + numel]


def dropout_keep_mask(shape: Sequence[int] | torch.Size, p: float, seed: int, offset: int = 0) -> Tensor:
    """The keep-mask (bool, True = kept, on the CPU) the CUDA kernels use for a tensor of ``shape``, with
    drop probability ``p`` and unsigned 64-bit ``seed`` and ``offset`` (independent masks per offset).

    Raises:
        ValueError: ``p``, ``seed`` or ``offset`` out of range.
    """
    threshold = keep_threshold(p)
    size = torch.Size(shape)
    return rng_keep_mask(rng_tensor(seed, offset, "cpu"), 0, size.numel(), threshold).view(size)


def random_seed(generator: torch.Generator | None = None) -> int:
    """A fresh 63-bit seed drawn from ``generator`` (default: torch's default CPU generator)."""
    return int(torch.randint(0, (1 << 63) - 1, (), generator=generator))
