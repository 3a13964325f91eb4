"""Kernel variants and their tile shapes: what a kernel is rendered for, and how big its pieces are.

A :class:`Variant` is (dtype, rank bucket, aligned). The tile functions here decide, per variant, the
block shape each LoRA kernel template receives (warps, rows, rank tiles, whether it runs on tensor cores);
:mod:`loragen.cuda.specs` binds them to the kernels and plans the grids.
"""

from __future__ import annotations

from dataclasses import dataclass
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

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(
                f"loragen.cuda: dtype {self.dtype!r} has no kernels; supported: {', '.join(DTYPES)}"
            )
        if self.rank_bucket not in RANK_BUCKETS:
            raise ValueError(
                f"loragen.cuda: rank bucket {self.rank_bucket} is not one of {', '.join(map(str, RANK_BUCKETS))}"
            )

    @property
    def label(self) -> str:
        """A short readable name, used in cache file names: ``bfloat16-r16-aligned``."""
        return f"{self.dtype}-r{self.rank_bucket}-{'aligned' if self.aligned else 'unaligned'}"


# Register budget: each thread keeps at most 64 accumulators (and, in the backward kernels, 64 more
# values of B^T or of x), so the kernels tile the rank: a block covers RANK_TILE ranks, the tiles of one
# row or column block are neighbours in the grid (their repeated reads of x or g come from L2), and
# every lane keeps 8 columns -- one 16-byte load of 16-bit x or g per row -- at every rank.
_ACCUMULATORS = 64
CHUNK = 8  # columns per lane and row: 16 bytes of a 16-bit dtype, one Philox call


def uses_mma(v: Variant) -> bool:
    """Whether ``lora_down`` runs on tensor cores for ``v``: 16-bit x, vector accesses, R >= 16.

    At R = 8 the CUDA cores keep up with HBM (R FLOP per byte of x against a ridge of about 20, less
    the issue slots of Philox, shuffles and address arithmetic).
    """
    return v.aligned and ELEMENT_BYTES[v.dtype] == 2 and v.rank_bucket >= 16


def down_tile(v: Variant) -> dict[str, int]:
    if uses_mma(v):
        row_tiles = min(4, _ACCUMULATORS // (v.rank_bucket // 2))  # R / 2 accumulators per 16-row tile
        return {
            "warps": 4,
            "min_blocks": 2,
            "mma": True,
            "rank_tile": v.rank_bucket,
            "rows_per_warp": 16 * row_tiles,
            "steps": max(
                1, 4 // row_tiles
            ),  # 2 * row_tiles * steps = 8 loads of 16 bytes of x in flight per lane
        }
    rank_tile = min(v.rank_bucket, 16)
    rows_per_warp = _ACCUMULATORS // rank_tile
    return {
        "warps": 4,
        "min_blocks": 2,
        "mma": False,
        "rank_tile": rank_tile,
        "rows_per_warp": rows_per_warp,
        # rows x steps = 8 row chunks in flight per lane (scalar loads of unaligned rows need the registers)
        "steps": max(1, 8 // rows_per_warp) if v.aligned else 1,
    }


def up_uses_mma(v: Variant) -> bool:
    """Whether ``lora_up`` runs on tensor cores for ``v``: bf16 (h is rounded to bf16, whose range is
    float32's), vector accesses, R >= 32."""
    return v.aligned and v.dtype == "bfloat16" and v.rank_bucket >= 32


def up_tile(v: Variant) -> dict[str, int]:
    if up_uses_mma(v):  # rows_per_thread: 16-row tiles per warp; rank_step: unused by the mma pass
        # a block: 128 rows x 256 columns, so h and B^T are each read from L2 about R / 64 times per byte
        # of out (8 chunks of 32 columns per warp, B^T from L1 for the block's other warps)
        return {
            "warps": 4,
            "min_blocks": 2,
            "mma": True,
            "rows_per_thread": 2,
            "rank_step": 4,
            "col_chunks": 8,
        }
    return {
        "warps": 4,
        "min_blocks": 2,
        "mma": False,
        "rows_per_thread": _ACCUMULATORS // CHUNK,
        "rank_step": 4,
        "col_chunks": 1,  # the mma pass only
    }


def backward_tile(v: Variant) -> dict[str, int]:
    rank_tile = min(v.rank_bucket, _ACCUMULATORS // CHUNK)
    return {"warps": 4, "min_blocks": 2, "rank_tile": rank_tile, "rows_per_step": 4}


def grad_out_uses_mma(v: Variant) -> bool:
    """Whether ``lora_grad_out`` runs on tensor cores for ``v``: bf16, vector accesses, R >= 16."""
    return v.aligned and v.dtype == "bfloat16" and v.rank_bucket >= 16


def grad_out_tile(v: Variant) -> dict[str, int]:
    if grad_out_uses_mma(v):
        # 8 warps x 2 chunks of 32 columns = 512 columns per block; dB^T keeps R_tile accumulators per
        # lane and chunk, so R = 64 runs as two rank tiles of 32 (g read again from L2)
        rank_tile = min(v.rank_bucket, 32)
        return {
            "warps": 8,
            "min_blocks": 1,
            "mma": True,
            "col_chunks": 2,
            "rank_tile": rank_tile,
            "rows_per_step": 16,
        }
    return {**backward_tile(v), "mma": False, "col_chunks": 1}


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
