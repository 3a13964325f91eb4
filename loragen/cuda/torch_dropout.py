"""The torch path's dropout: loragen's Philox keep-mask (:mod:`loragen.philox`'s layout) applied to
float32 copies of x-shaped blocks, on any device, bit-identical to the mask the CUDA kernels regenerate.

On a CUDA device it runs on kernels that torch's jiterator compiles at first use
(:data:`JIT_FUNCTIONS`): :data:`KEEP_BITS_SOURCE` makes each group of 8 elements' keep bits with one
Philox call (half a byte per element, made once per row block and used for x and, in backward, for
dh A), and :data:`APPLY_SOURCE` writes ``x * 1/(1-p)`` or 0 in float32 -- the same bytes as the float32
copy of x the products need anyway. Rows whose length is not a multiple of 8 take
:data:`DROPOUT_SOURCE`, one Philox call per element. Where the jiterator is unavailable (a CPU tensor, a
torch built without it, a compile failure: one warning), :class:`BlockDropout` runs the vectorised torch
formulation of :func:`keep_mask`, about 70 elementwise operations on one counter per 8 elements, all
bit-identical to the jiterator kernels and to :func:`loragen.philox.dropout_keep_mask`.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable

import torch
from torch import Tensor

from loragen import philox

__all__ = [
    "APPLY_SOURCE",
    "DROPOUT_SOURCE",
    "JIT_FUNCTIONS",
    "KEEP_BITS_SOURCE",
    "BlockDropout",
    "dropped",
    "jiterator_status",
    "keep_mask",
]

_MASK32 = 0xFFFFFFFF
_M0, _M1 = 0xD2511F53, 0xCD9E8D57  # Philox round multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85  # Philox key schedule increments
_ROUNDS = 10
_EXACT_FLOAT_INDEX = 1 << 24  # row and column numbers below this are exact in float32

# Philox4x32-10 of the counter (q, offset) under the key (key0, key1), as in kernels/lora_common.cuh.j2,
# leaving the four output words in words[0..3]; pasted into the jiterator sources below.
_PHILOX_CALL = r"""
    unsigned c0 = static_cast<unsigned>(q), c1 = static_cast<unsigned>(q >> 32);
    unsigned c2 = static_cast<unsigned>(offset0), c3 = static_cast<unsigned>(offset1);
    unsigned k0 = static_cast<unsigned>(key0), k1 = static_cast<unsigned>(key1);
    for (int round = 0; round < 10; ++round) {
        if (round > 0) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        const unsigned hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
        const unsigned hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
    }
    const unsigned words[4] = {c0, c1, c2, c3};
"""

# jiterator promotes every input to one dtype (float32 here), so row, group, column and lane numbers
# arrive as float32 holding exact integers below 2**24; the seed and offset come as 32-bit words.

# One thread per group of 8 elements (rows of a multiple of 8 columns): the group's 8 keep bits.
KEEP_BITS_SOURCE = (
    r"""template <typename T>
T loragen_keep_bits(T row, T group, long long first_group, long long groups_per_row, long long key0,
                    long long key1, long long offset0, long long offset1, long long threshold) {
    const unsigned long long q =
        first_group + static_cast<long long>(row) * groups_per_row + static_cast<long long>(group);"""
    + _PHILOX_CALL
    + r"""    unsigned bits = 0;
    for (int lane = 0; lane < 8; ++lane) {
        const long long u = (words[lane >> 1] >> (16 * (lane & 1))) & 0xFFFFu;
        bits |= static_cast<unsigned>(u >= threshold) << lane;
    }
    return static_cast<T>(bits);
}
"""
)

# One thread per element, with the group's keep bits broadcast over its 8 lanes.
APPLY_SOURCE = r"""template <typename T>
T loragen_apply_keep(T value, T bits, T lane, T keep_scale) {
    return (static_cast<unsigned>(bits) >> static_cast<unsigned>(lane)) & 1u ? value * keep_scale : T(0);
}
"""

# One thread per element, its own Philox call: for rows whose length is not a multiple of 8.
DROPOUT_SOURCE = (
    r"""template <typename T>
T loragen_dropout(T value, T row, T col, long long start, long long cols, long long key0, long long key1,
                  long long offset0, long long offset1, long long threshold, T keep_scale) {
    const unsigned long long i = start + static_cast<long long>(row) * cols + static_cast<long long>(col);
    const unsigned long long q = i >> 3;"""
    + _PHILOX_CALL
    + r"""    const unsigned lane = static_cast<unsigned>(i & 7);
    const long long u = (words[lane >> 1] >> (16 * (lane & 1))) & 0xFFFFu;
    return u >= threshold ? value * keep_scale : T(0);
}
"""
)

_KEY_ARGS = {"key0": 0, "key1": 0, "offset0": 0, "offset1": 0, "threshold": 0}
# each jiterator function: its source and its keyword arguments, in the order of the C++ parameters
# after the tensor inputs (torch passes them in this order)
JIT_FUNCTIONS: dict[str, tuple[str, dict[str, int | float]]] = {
    "keep_bits": (KEEP_BITS_SOURCE, {"first_group": 0, "groups_per_row": 1, **_KEY_ARGS}),
    "apply": (APPLY_SOURCE, {"keep_scale": 1.0}),
    "dropout": (DROPOUT_SOURCE, {"start": 0, "cols": 1, **_KEY_ARGS, "keep_scale": 1.0}),
}

_jit_lock = threading.Lock()
_jit_functions: dict[str, Callable[..., Tensor]] = {}
_jit_failure: list[str] = []  # the first failure, once there was one


def jiterator_status() -> str:
    """``"unused"`` before the first CUDA dropout, ``"ok"`` once the jiterator kernels ran, else why the
    torch formulation is used instead."""
    if _jit_failure:
        return _jit_failure[0]
    return "ok" if _jit_functions else "unused"


def _jit(name: str) -> Callable[..., Tensor] | None:
    """The jiterator function ``name`` of :data:`JIT_FUNCTIONS` (created once), or None after a failure."""
    with _jit_lock:
        if _jit_failure:
            return None
        if name not in _jit_functions:
            from torch.cuda import jiterator

            source, kwargs = JIT_FUNCTIONS[name]
            _jit_functions[name] = jiterator._create_jit_fn(source, **kwargs)
        return _jit_functions[name]


def _jit_failed(exc: BaseException) -> None:
    text = str(exc).strip()
    with _jit_lock:
        if _jit_failure:
            return
        _jit_failure.append(f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}")
    warnings.warn(
        "loragen.cuda: the jiterator dropout kernels of the torch path (torch.cuda.jiterator) are unavailable "
        f"({_jit_failure[0]}); the mask is built from torch operations instead (same bits, slower)",
        RuntimeWarning,
        stacklevel=4,
    )


def _round_constants(seed: int, device: torch.device) -> tuple[Tensor, ...]:
    """12 int64 (2, 1) tensors: the multipliers of the two state rows in even and odd rounds, then the
    key words of the two rows in each of the 10 rounds.

    The rows of :func:`_philox_words`'s state E hold counter words (c0, c2) in even rounds and
    (c2, c0) in odd ones; a row holding c0 produces the new c2 (key word 1), one holding c2 the new c0
    (key word 0).
    """
    rows = [[_M0, _M1], [_M1, _M0]]
    for r in range(_ROUNDS):
        k0 = ((seed & _MASK32) + r * _W0) & _MASK32
        k1 = ((seed >> 32) + r * _W1) & _MASK32
        rows.append([k1, k0] if r % 2 == 0 else [k0, k1])
    return torch.tensor(rows, dtype=torch.int64, device=device).unsqueeze(-1).unbind(0)


def _philox_words(first: int, count: int, seed: int, offset: int, device: torch.device) -> Tensor:
    """Philox4x32-10 of the counters (q, offset) for groups q = first .. first + count - 1 under key
    ``seed``: int64 (4, count), the words c0..c3 in [0, 2**32).

    The four words are carried as two (2, count) tensors so each round is six whole-tensor operations:
    E, the words that are multiplied, and O, their xor partners. A uint32 product is taken as an int64
    product, which wraps modulo 2**64 with the same low 64 bits as the unsigned product; its high word is
    ``(p >> 32) & 0xFFFFFFFF`` and its low word is left in O unmasked until it is used.
    """
    even_multipliers, odd_multipliers, *round_keys = _round_constants(seed, device)
    q = torch.arange(first, first + count, dtype=torch.int64, device=device)
    e = torch.stack((q & _MASK32, q.new_full((count,), offset & _MASK32)))  # (c0, c2)
    o = torch.stack((q.new_full((count,), offset >> 32), q >> 32))  # their partners (c3, c1)
    for r in range(_ROUNDS):
        partners = o if r == 0 else o.flip(0)  # the row order of E alternates, O's does not
        product = e * (odd_multipliers if r % 2 else even_multipliers)
        e = ((product >> 32) ^ partners ^ round_keys[r]) & _MASK32
        o = product
    # after an even number of rounds E = (c0, c2), O = (c1, c3): interleave them into c0, c1, c2, c3
    return torch.stack((e, o & _MASK32), dim=1).view(4, count)


def keep_mask(start: int, numel: int, threshold: int, seed: int, offset: int, device: torch.device) -> Tensor:
    """Flat elements ``start .. start + numel - 1`` of the Philox keep-mask (:mod:`loragen.philox`'s
    layout), as bool on ``device``; ``threshold`` is :func:`loragen.philox.keep_threshold` of p.

    Torch operations only (about 70, on one counter per 8 elements), so it runs on any device; on a CPU
    tensor it equals :func:`loragen.philox.dropout_keep_mask`.
    """
    if threshold == 0:
        return torch.ones(numel, dtype=torch.bool, device=device)
    per_call = philox.ELEMENTS_PER_CALL
    first, last = start // per_call, (start + numel + per_call - 1) // per_call
    words = _philox_words(first, last - first, seed, offset, device)  # (4, G)
    halves = torch.stack((words & 0xFFFF, words >> 16), dim=-1)  # (4, G, 2): lane 2w + h of each group
    keep = (halves >= threshold).permute(1, 0, 2).reshape(-1)  # group-major: element 8q + lane
    skip = start - first * per_call
    return keep[skip : skip + numel]


class BlockDropout:
    """The dropout of one block of a masked tensor whose element [0, 0] is flat element ``start``:
    applied to x and, in backward, to the x-shaped product dh A, with one keep-mask between them."""

    def __init__(self, start: int, threshold: int, keep_scale: float, seed: int, offset: int) -> None:
        self.start, self.threshold, self.keep_scale = start, threshold, keep_scale
        self.seed, self.offset = seed, offset
        self._keep: Tensor | None = None  # bool (rows, cols), the torch formulation
        self._bits: tuple[Tensor, Tensor] | None = None  # jiterator: keep bits (rows * cols / 8, 1), lanes

    def _key_args(self) -> dict[str, int]:
        return {
            "key0": self.seed & _MASK32,
            "key1": self.seed >> 32,
            "offset0": self.offset & _MASK32,
            "offset1": self.offset >> 32,
            "threshold": self.threshold,
        }

    def __call__(self, values: Tensor) -> Tensor:
        """``values`` (rows, cols) in float32, kept elements times keep_scale, dropped ones 0; without
        dropout, ``values`` itself when it is float32 (callers only read it)."""
        rows, cols = values.shape
        if self.threshold == 0:
            return values.float()
        if values.is_cuda and values.numel() and rows < _EXACT_FLOAT_INDEX and cols < _EXACT_FLOAT_INDEX:
            try:
                out = self._jitted(values)
            except Exception as exc:  # whatever stops the jiterator, the torch formulation gives the same
                _jit_failed(exc)
            else:
                if out is not None:
                    return out
        if self._keep is None:
            keep = keep_mask(
                self.start, values.numel(), self.threshold, self.seed, self.offset, values.device
            )
            self._keep = keep.view(rows, cols)
        return torch.where(self._keep, values.float() * self.keep_scale, 0.0)

    def _jitted(self, values: Tensor) -> Tensor | None:
        rows, cols = values.shape
        if cols % 8 == 0 and self.start % 8 == 0 and values.is_contiguous():
            # one Philox call per 8 elements (kept for the next tensor of this block), then one pass
            if self._bits is None:
                keep_bits, apply = _jit("keep_bits"), _jit("apply")
                if keep_bits is None or apply is None:
                    return None
                index = torch.arange(max(rows, cols // 8, 8), dtype=torch.float32, device=values.device)
                bits = keep_bits(
                    index[:rows, None],
                    index[None, : cols // 8],
                    first_group=self.start // 8,
                    groups_per_row=cols // 8,
                    **self._key_args(),
                )
                self._bits = bits.reshape(-1, 1), index[:8]
            apply = _jit("apply")
            if apply is None:
                return None
            bits, lanes = self._bits  # (groups, 1), (8,): a two-dimensional broadcast, cheap to index
            return apply(values.view(-1, 8), bits, lanes, keep_scale=self.keep_scale).view(rows, cols)
        dropout = _jit("dropout")
        if dropout is None:
            return None
        index = torch.arange(max(rows, cols), dtype=torch.float32, device=values.device)
        return dropout(
            values,
            index[:rows, None],
            index[None, :cols],
            start=self.start,
            cols=cols,
            **self._key_args(),
            keep_scale=self.keep_scale,
        )


def dropped(values: Tensor, start: int, threshold: int, keep_scale: float, seed: int, offset: int) -> Tensor:
    """``values`` (rows, cols) in float32 with dropout applied: kept elements times ``keep_scale``,
    dropped ones 0; ``values[0, 0]`` is flat element ``start`` of the masked tensor (row-major).

    ``values`` itself when ``threshold`` is 0 and it is float32, else a fresh tensor. One kernel on a CUDA device (the jiterator), the torch
    formulation of :func:`keep_mask` elsewhere; the same numbers either way.
    """
    return BlockDropout(start, threshold, keep_scale, seed, offset)(values)
