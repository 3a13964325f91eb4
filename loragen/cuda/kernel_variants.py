"""Kernel variants and their tile shapes: what a kernel is rendered for, and how big its pieces are.

A :class:`Variant` is (dtype, rank bucket, aligned). The tile functions here decide, per variant, the
block shape each LoRA kernel template receives (warps, rows, rank tiles, whether it runs on tensor cores);
:mod:`loragen.cuda.specs` binds them to the kernels and plans the grids.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

__all__ = [
    "CHUNK",
    "DTYPES",
    "ELEMENT_BYTES",
    "MAX_RANK",
    "RANK_BUCKETS",
    "WARP",
    "Variant",
    "backward_tile",
    "down_tile",
    "grad_out_tile",
    "grad_in_uses_mma",
    "grad_out_uses_mma",
    "pad_rank",
    "rank_bucket",
    "up_tile",
    "up_uses_mma",
    "uses_mma",
]

# torch dtype name -> the kernels' storage type (defined in kernels/lora_common.cuh.j2)
DTYPES: dict[str, str] = {"float32": "float", "float16": "f16_t", "bfloat16": "bf16_t"}
ELEMENT_BYTES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}
RANK_BUCKETS: tuple[int, ...] = (8, 16, 32, 64)
MAX_RANK = RANK_BUCKETS[-1]
WARP = 32


@dataclass(frozen=True)
class Variant:
    """What a kernel is rendered for (the GPU architecture is chosen at compile time)."""

    dtype: str  # a key of DTYPES
    rank_bucket: int  # one of RANK_BUCKETS
    aligned: bool  # every row length % 8 == 0 and every pointer 16-byte aligned: vector accesses
    # the hash, worked out once: launchers look variants up in dicts on every launch
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(
                f"loragen.cuda: dtype {self.dtype!r} has no kernels; supported: {', '.join(DTYPES)}"
            )
        if self.rank_bucket not in RANK_BUCKETS:
            raise ValueError(
                f"loragen.cuda: rank bucket {self.rank_bucket} is not one of {', '.join(map(str, RANK_BUCKETS))}"
            )
        object.__setattr__(self, "_hash", hash((self.dtype, self.rank_bucket, self.aligned)))

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple[type, tuple[str, int, bool]]:
        # rebuilt from its fields: a string's hash differs between processes
        return (Variant, (self.dtype, self.rank_bucket, self.aligned))

    @property
    def label(self) -> str:
        """A short readable name, used in cache file names: ``bfloat16-r16-aligned``."""
        return f"{self.dtype}-r{self.rank_bucket}-{'aligned' if self.aligned else 'unaligned'}"


# Register budget: each thread keeps at most 64 accumulators (and, in the backward kernels, 64 more
# values of B^T or of x), so the kernels tile the rank: a block covers RANK_TILE ranks, the tiles of one
# row or column block are neighbours in the grid (their repeated reads of x or g come from L2), and
# every lane keeps 8 columns -- one 16-byte load of 16-bit x or g per row -- at every rank.
_ACCUMULATORS = 64
_DOWN_ACCUMULATORS = 32  # lora_down's CUDA-core pass: 32 partial sums per lane, for 3 blocks per SM
CHUNK = 8  # columns per lane and row: 16 bytes of a 16-bit dtype, one Philox call


def uses_mma(v: Variant) -> bool:
    """Whether ``lora_down`` runs on tensor cores for ``v``: 16-bit x, vector accesses, R >= 16.

    At R = 8 the CUDA cores keep up with HBM (R FLOP per byte of x against a ridge of about 20, less
    the issue slots of Philox, shuffles and address arithmetic).
    """
    return v.aligned and ELEMENT_BYTES[v.dtype] == 2 and v.rank_bucket >= 16


def down_tile(v: Variant) -> dict[str, int]:
    """``lora_down``'s block: 4 warps, and registers for ``min_blocks`` blocks per multiprocessor.

    A warp owns few rows (16 on tensor cores, 32 / rank tile on the CUDA cores) so that the grid has
    enough blocks for two waves without more column splits (whose partial sums cost traffic); each lane
    keeps several 16-byte loads of x in flight (STEPS column steps before the first use): eight on tensor
    cores, four chunks of 8 columns on the CUDA cores.
    """
    if uses_mma(v):  # R / 2 accumulators per lane for one 16-row tile
        return {
            "warps": 4,
            "min_blocks": 4,
            "mma": True,
            "rank_tile": v.rank_bucket,
            "rows_per_warp": 16,
            "steps": 4,  # 2 rows x 4 steps = 8 loads of 16 bytes of x in flight per lane
        }
    rank_tile = min(v.rank_bucket, 16)
    rows_per_warp = _DOWN_ACCUMULATORS // rank_tile
    return {
        "warps": 4,
        "min_blocks": 3,
        "mma": False,
        "rank_tile": rank_tile,
        "rows_per_warp": rows_per_warp,
        # rows x steps = 64 bytes of x in flight per lane (4 chunks of 8 16-bit columns, 2 of float32), in
        # the 168 registers of 3 blocks per SM (scalar loads of unaligned rows need them: one step)
        "steps": max(1, 64 // (CHUNK * ELEMENT_BYTES[v.dtype] * rows_per_warp)) if v.aligned else 1,
    }


def up_uses_mma(v: Variant) -> bool:
    """Whether ``lora_up`` runs on tensor cores for ``v``: bf16 (h is split into two bf16 terms, whose
    range is float32's), vector accesses, R >= 16."""
    return v.aligned and v.dtype == "bfloat16" and v.rank_bucket >= 16


def _up_min_blocks(v: Variant) -> int:
    """Blocks of 128 threads per multiprocessor ``lora_up``'s CUDA-core pass asks registers for: three
    (<= 168 registers) where out moves 16 bytes at a time, two (<= 255) where float32 rows or scalar
    accesses of unaligned rows need more registers for the same loads. (Four, <= 128 registers, spill
    on sm_80.)"""
    return 3 if v.aligned and ELEMENT_BYTES[v.dtype] == 2 else 2


def up_tile(v: Variant) -> dict[str, int]:
    if up_uses_mma(v):  # rows_per_thread: 16-row tiles per warp; rank_step: unused by the mma pass
        # a block: 128 rows x 128 columns, so h and B^T are each read from L2 about R / 32 times per byte
        # of out (4 chunks of 32 columns per warp, B^T from L1 for the block's other warps); 4 chunks
        # rather than 8 so that a 4096 x 4096 output is 1024 blocks, two waves. At R = 16 the registers
        # leave room for five blocks per multiprocessor: 2 chunks, 2048 blocks, three waves
        return {
            "warps": 4,
            "min_blocks": 4 if v.rank_bucket <= 32 else 3,
            "mma": True,
            "rows_per_thread": 2,
            "rank_step": 4,
            "col_chunks": 2 if v.rank_bucket == 16 else 4,
        }
    # 4 rows x 8 columns: 32 accumulators and the 32 values of out they are added to, so that three
    # blocks fit a multiprocessor (<= 168 registers) and each thread has four 16-byte loads of out in flight
    return {
        "warps": 4,
        "min_blocks": _up_min_blocks(v),
        "mma": False,
        "rows_per_thread": 4,
        "rank_step": 4,
        "col_chunks": 1,  # the mma pass only
    }


def grad_in_uses_mma(v: Variant) -> bool:
    """Whether ``lora_grad_in`` runs on tensor cores for ``v``: bf16 (dh is split into two bf16 terms,
    whose range is float32's), vector accesses, R >= 16."""
    return v.aligned and v.dtype == "bfloat16" and v.rank_bucket >= 16


def backward_tile(v: Variant) -> dict[str, int]:
    """``lora_grad_in``'s block: 4 warps sharing its columns, taking turns over the rows.

    On tensor cores (:func:`grad_in_uses_mma`) a block owns 32 columns and every rank, and each warp
    step covers ``rows_per_step`` = 16 x M rows: M 16-row tiles whose loads of x (16 bytes per lane and
    row) and dh are all issued before the first mma -- 4 tiles (128 bytes of x in flight per lane) at
    R = 16, 2 at R = 32, 1 at R = 64, where dA's R float32 sums and A's R / 2 fragment registers per
    lane leave less room; R = 64 keeps two blocks per multiprocessor (<= 255 registers), the others three.

    On the CUDA cores a block owns 256 columns: ``lora_grad_in`` keeps RANK_TILE x 8 dA sums per lane
    and ROWS_PER_STEP rows of x and dh: rank tiles of 4 at R <= 16 (x is then read R / 4 times, the
    repeats from L2) and of 8 with 2 rows per step above, so that three blocks fit a multiprocessor
    (<= 168 registers) where two did.
    """
    if grad_in_uses_mma(v):
        tiles = {16: 4, 32: 2, 64: 1}[v.rank_bucket]
        return {
            "warps": 4,
            "min_blocks": 3 if v.rank_bucket <= 32 else 2,
            "mma": True,
            "rank_tile": v.rank_bucket,
            "rows_per_step": 16 * tiles,
        }
    if v.rank_bucket <= 16:  # scalar loads of unaligned rows need more registers: 2 rows per step there
        rows = 4 if v.aligned else 2
        # unaligned at R = 8 the whole grad_x rank loop unrolls, and 168 registers would spill: two blocks
        blocks = 2 if not v.aligned and v.rank_bucket == 8 else 3
        return {
            "warps": 4,
            "min_blocks": blocks,
            "mma": False,
            "rank_tile": min(v.rank_bucket, 4),
            "rows_per_step": rows,
        }
    # unaligned above R = 16 the scalar loads and the rng pointer's loads push past 168 registers: two blocks
    return {"warps": 4, "min_blocks": 3 if v.aligned else 2, "mma": False, "rank_tile": 8, "rows_per_step": 2}


def grad_out_uses_mma(v: Variant) -> bool:
    """Whether ``lora_grad_out`` runs on tensor cores for ``v``: bf16, vector accesses, R >= 16."""
    return v.aligned and v.dtype == "bfloat16" and v.rank_bucket >= 16


def grad_out_tile(v: Variant) -> dict[str, int]:
    if grad_out_uses_mma(v):
        # 8 warps x 1 chunk of 32 columns = 256 columns per block: twice the warps per multiprocessor of
        # 2 chunks per warp for the same partial sums; dB^T keeps R_tile / 2 accumulators per lane, so
        # R = 64 runs as two rank tiles of 32 (g read again from L2). At R = 16 a step is 2 tiles of 16
        # rows: 64 bytes of g in flight per lane in the 128 registers of two blocks per multiprocessor
        # (one tile fit three blocks: 1.5x the warps, half the bytes in flight per lane). With rank tiles
        # of 32, two tiles' dh exchange would pass the 48 KB of static shared memory: one tile.
        rank_tile = min(v.rank_bucket, 32)
        return {
            "warps": 8,
            "min_blocks": 2,  # <= 128 registers
            "mma": True,
            "col_chunks": 1,
            "rank_tile": rank_tile,
            "rows_per_step": 32 if rank_tile == 16 else 16,
        }
    # the CUDA-core pass keeps B^T and dB for 8 columns and 8 ranks per lane: two blocks per SM
    return {
        "warps": 4,
        "min_blocks": 2,
        "mma": False,
        "rank_tile": min(v.rank_bucket, 8),
        "rows_per_step": 4,
        "col_chunks": 1,
    }


def rank_bucket(rank: int) -> int:
    """The smallest rank bucket holding ``rank``.

    Raises:
        ValueError: ``rank`` < 1 or > :data:`MAX_RANK`.
    """
    for bucket in RANK_BUCKETS:
        if 1 <= rank <= bucket:
            return bucket
    raise ValueError(
        f"loragen.cuda: LoRA rank r={rank} is not supported by the CUDA kernels; expected 1 <= r <= {MAX_RANK}"
    )


def pad_rank(adapter: Tensor, variant: Variant) -> Tensor:
    """``adapter`` (r, features) as a fresh contiguous (R, features) tensor, R = the rank bucket.

    The kernels read A and B^T for every rank of the bucket with no rank test: rows r..R-1 are zero.
    """
    padded = adapter.new_zeros(variant.rank_bucket, adapter.shape[1])
    padded[: adapter.shape[0]] = adapter
    return padded
