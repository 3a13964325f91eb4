"""The LoRA kernels loragen compiles, their variants, tile shapes and grids.

Every decision about a kernel is made here, in Python: the templates in ``kernels/`` only substitute
the values this module computes. A kernel is rendered per :class:`Variant` -- (dtype, rank bucket,
aligned) -- with a tile shape derived from it, and compiled per GPU architecture.

Kernels (see each template's header comment for the exact formulas):

============== ============================================ =====================================
kernel         computes                                     reads / writes (large tensors)
============== ============================================ =====================================
lora_down      h = dropout(x) A^T, float32 (N, R)            x once
lora_up        out = bias + s h B^T                          out once (then cuBLAS adds x W^T)
lora_grad_out  dh = s g B,  dB = s g^T h                     g once
lora_grad_in   dA = dh^T dropout(x),  (dh A) * mask / (1-p)  x once, grad_x once (then += g W)
adamw8bit      one 8-bit AdamW step (loragen.training.adamw8bit)     param, grad, codes once each
============== ============================================ =====================================

``adamw8bit`` varies by dtype only (:data:`OPTIMIZER_KERNELS`, :func:`optimizer_variants`); it is not
part of :data:`KERNELS`, whose variants also vary by rank bucket and alignment.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from loragen.cuda.kernel_variants import (
    CHUNK,
    DTYPES,
    ELEMENT_BYTES,
    RANK_BUCKETS,
    WARP,
    Variant,
    backward_tile,
    down_tile,
    grad_out_tile,
    up_tile,
)

__all__ = [
    "ADAMW8BIT",
    "ARCHS",
    "KERNELS",
    "OPTIMIZER_KERNELS",
    "DownPlan",
    "KernelSpec",
    "Param",
    "SplitPlan",
    "all_variants",
    "max_optimizer_block",
    "optimizer_variants",
    "plan_down",
    "plan_grad_in",
    "plan_grad_out",
    "plan_up",
    "rank_tiles",
    "render_params",
    "wanted_blocks",
]

ARCHS: tuple[str, ...] = ("sm_80", "sm_90")


@dataclass(frozen=True)
class Param:
    """One kernel parameter, with its C type exactly as the template's signature spells it."""

    name: str
    ctype: str


@dataclass(frozen=True)
class KernelSpec:
    """A kernel template, its parameter list and how its tile shape follows from a variant."""

    name: str  # the extern "C" function name; the template is kernels/<name>.cu.j2
    params: tuple[Param, ...]
    tile: Callable[[Variant], dict[str, int]]
    by_rank: bool = True  # False: the template takes neither rank_bucket nor aligned (dtype-only variants)

    @property
    def template(self) -> str:
        return f"{self.name}.cu.j2"

    def threads(self, variant: Variant) -> int:
        """Threads per block."""
        return self.tile(variant)["warps"] * WARP


def _params(*pairs: tuple[str, str]) -> tuple[Param, ...]:
    return tuple(Param(name, ctype) for ctype, name in pairs)


# seed and offset are read through a pointer (rng[0], rng[1], int64 in device memory): CUDA-graph safe
_DROPOUT = (("const u64*", "rng"), ("unsigned", "threshold"), ("float", "keep_scale"))

LORA_DOWN = KernelSpec(
    "lora_down",
    _params(
        ("const scalar_t*", "x"),
        ("const float*", "lora_a"),
        ("float*", "h_part"),
        ("int", "rows"),
        ("int", "cols"),
        ("int", "rank"),
        ("int", "cols_per_split"),
        *_DROPOUT,
    ),
    down_tile,
)
LORA_UP = KernelSpec(
    "lora_up",
    _params(
        ("const float*", "h"),
        ("const float*", "lora_bt"),
        ("const scalar_t*", "bias"),
        ("scalar_t*", "out"),
        ("int", "rows"),
        ("int", "cols"),
        ("int", "rank"),
        ("float", "scaling"),
    ),
    up_tile,
)
LORA_GRAD_OUT = KernelSpec(
    "lora_grad_out",
    _params(
        ("const scalar_t*", "grad"),
        ("const float*", "h"),
        ("const float*", "lora_bt"),
        ("float*", "dh_part"),
        ("float*", "db_part"),
        ("int", "rows"),
        ("int", "cols"),
        ("int", "rank"),
        ("int", "rows_per_split"),
        ("float", "scaling"),
    ),
    grad_out_tile,
)
LORA_GRAD_IN = KernelSpec(
    "lora_grad_in",
    _params(
        ("const scalar_t*", "x"),
        ("const float*", "dh"),
        ("const float*", "lora_a"),
        ("scalar_t*", "grad_x_lora"),
        ("float*", "da_part"),
        ("int", "rows"),
        ("int", "cols"),
        ("int", "rank"),
        ("int", "rows_per_split"),
        *_DROPOUT,
    ),
    backward_tile,
)

KERNELS: dict[str, KernelSpec] = {k.name: k for k in (LORA_DOWN, LORA_UP, LORA_GRAD_OUT, LORA_GRAD_IN)}

# One block of 8 warps per quantization block; each thread keeps PER_THREAD elements' moments in
# registers between the block-max reduction and the requantization, so blocks of up to
# 256 * 8 = 2048 elements run on the GPU (loragen.training.adamw8bit falls back to torch for larger ones).
ADAMW8BIT = KernelSpec(
    "adamw8bit",
    _params(
        ("scalar_t*", "param"),
        ("const scalar_t*", "grad"),
        ("unsigned char*", "m_codes"),
        ("float*", "m_absmax"),
        ("unsigned char*", "v_codes"),
        ("float*", "v_absmax"),
        ("const float*", "signed_code"),
        ("const float*", "unsigned_code"),
        ("u64", "numel"),
        ("int", "block_size"),
        ("float", "lerp_weight"),
        ("float", "beta2"),
        ("float", "one_minus_beta2"),
        ("float", "eps"),
        ("float", "sqrt_correction2"),
        ("float", "decay"),
        ("float", "neg_step_size"),
    ),
    lambda v: {"warps": 8, "min_blocks": 2, "per_thread": 8},
    by_rank=False,
)
OPTIMIZER_KERNELS: dict[str, KernelSpec] = {ADAMW8BIT.name: ADAMW8BIT}


def render_params(spec: KernelSpec, variant: Variant) -> dict[str, object]:
    """Everything the template of ``spec`` substitutes, for ``variant``."""
    params: dict[str, object] = {"scalar_t": DTYPES[variant.dtype]}
    if spec.by_rank:
        params.update(rank_bucket=variant.rank_bucket, aligned=variant.aligned)
    params.update(spec.tile(variant))
    summary = ", ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in params.items())
    params["variant"] = f"Rendered by loragen.cuda.render for {variant.dtype}:\n// {summary}."
    return params


def all_variants() -> Iterator[tuple[KernelSpec, Variant]]:
    """Every (kernel, variant) pair loragen can render: what CI compiles."""
    for spec in KERNELS.values():
        for dtype in DTYPES:
            for bucket in RANK_BUCKETS:
                for aligned in (True, False):
                    yield spec, Variant(dtype, bucket, aligned)


def optimizer_variants() -> Iterator[tuple[KernelSpec, Variant]]:
    """Every (kernel, variant) pair of :data:`OPTIMIZER_KERNELS`: one per dtype.

    These kernels ignore the rank bucket and alignment; their variants carry the smallest bucket and
    ``aligned=True`` as fixed placeholders, so each dtype has exactly one variant (and cache entry).
    """
    for spec in OPTIMIZER_KERNELS.values():
        for dtype in DTYPES:
            yield spec, Variant(dtype, RANK_BUCKETS[0], True)


def max_optimizer_block(spec: KernelSpec) -> int:
    """The largest quantization block ``spec`` handles: threads per block times elements per thread."""
    tile = spec.tile(Variant("float32", RANK_BUCKETS[0], True))
    return tile["warps"] * WARP * tile["per_thread"]


# ---- grids --------------------------------------------------------------------------------------------
# ``target_blocks`` is two blocks per multiprocessor; a grid aims at ``target_blocks * min_blocks`` blocks:
# two waves of the ``min_blocks`` blocks per multiprocessor the kernel's registers allow (its
# __launch_bounds__), so that a multiprocessor finishing early takes another block and the last wave is
# not a long tail. Split reductions write float32 partial sums that torch adds up afterwards
# (deterministic, no atomics); the splits are capped so the partials stay a small fraction of the
# pass's main traffic, which can leave a grid short of two waves (see benchmarks/cuda_perf_model.py).


def wanted_blocks(spec: KernelSpec, variant: Variant, target_blocks: int) -> int:
    """The blocks a grid of ``spec`` aims at: two waves of ``min_blocks`` blocks per multiprocessor."""
    return target_blocks * spec.tile(variant)["min_blocks"]


@dataclass(frozen=True)
class DownPlan:
    grid: tuple[int, int]
    splits: int
    cols_per_split: int


@dataclass(frozen=True)
class SplitPlan:
    grid: tuple[int, int]
    col_blocks: int
    splits: int
    rows_per_split: int


def rank_tiles(spec: KernelSpec, variant: Variant) -> int:
    """How many rank tiles ``spec`` splits the rank bucket of ``variant`` into (blocks per row/column block)."""
    return variant.rank_bucket // spec.tile(variant)["rank_tile"]


def plan_down(rows: int, cols: int, variant: Variant, target_blocks: int) -> DownPlan:
    """Grid of ``lora_down`` for x of (rows, cols): (row tiles x rank tiles) x column splits.

    The h partials (splits x rows x R float32, written and read back) are kept under a quarter of x's bytes.
    """
    tile = LORA_DOWN.tile(variant)
    row_blocks = math.ceil(rows / (tile["warps"] * tile["rows_per_warp"])) * rank_tiles(LORA_DOWN, variant)
    lane_cols = (32 if tile["mma"] else WARP * CHUNK) * tile["steps"]  # columns a warp covers per step
    max_splits = max(1, cols * ELEMENT_BYTES[variant.dtype] // (32 * variant.rank_bucket))
    wanted = wanted_blocks(LORA_DOWN, variant, target_blocks)
    splits = min(math.ceil(cols / lane_cols), max_splits, max(1, math.ceil(wanted / max(row_blocks, 1))))
    cols_per_split = math.ceil(cols / splits / lane_cols) * lane_cols
    splits = math.ceil(cols / cols_per_split)
    return DownPlan((row_blocks, splits), splits, cols_per_split)


def plan_up(rows: int, cols: int, variant: Variant) -> tuple[int, int]:
    """Grid of ``lora_up`` for out of (rows, cols): row tiles x column tiles of 256 columns."""
    tile = LORA_UP.tile(variant)
    if tile["mma"]:  # a warp: rows_per_thread tiles of 16 rows x col_chunks chunks of 32 columns
        rows_per_block = tile["warps"] * 16 * tile["rows_per_thread"]
        return math.ceil(rows / rows_per_block), math.ceil(cols / (WARP * tile["col_chunks"]))
    return math.ceil(rows / (tile["warps"] * tile["rows_per_thread"])), math.ceil(cols / (WARP * CHUNK))


def _row_splits(
    rows: int, col_blocks: int, target_blocks: int, max_splits: int, step: int
) -> tuple[int, int]:
    splits = max(1, min(max_splits, math.ceil(target_blocks / col_blocks), math.ceil(rows / step)))
    rows_per_split = math.ceil(math.ceil(rows / splits) / step) * step
    return math.ceil(rows / rows_per_split) if rows else 1, max(rows_per_split, step)


def _split_plan(
    spec: KernelSpec, rows: int, cols: int, variant: Variant, target_blocks: int, max_splits: int
) -> SplitPlan:
    tile = spec.tile(variant)
    # lora_grad_out: every lane of the block has its own columns; lora_grad_in: the warps share 256
    # columns and take turns over the rows, ROWS_PER_STEP each
    shared = spec is LORA_GRAD_IN
    if tile.get("mma") and shared:  # lora_grad_in on tensor cores: the warps share 32 columns
        block_cols = WARP
    elif tile.get("mma"):  # lora_grad_out on tensor cores: each warp col_chunks chunks of 32 columns
        block_cols = tile["warps"] * WARP * tile["col_chunks"]
    else:
        block_cols = (1 if shared else tile["warps"]) * WARP * CHUNK
    col_blocks = math.ceil(cols / block_cols)
    blocks = col_blocks * rank_tiles(spec, variant)
    step = tile["rows_per_step"] * (tile["warps"] if shared else 1)
    splits, rows_per_split = _row_splits(
        rows, blocks, wanted_blocks(spec, variant, target_blocks), max_splits, step
    )
    return SplitPlan((blocks, splits), col_blocks, splits, rows_per_split)


def plan_grad_out(rows: int, cols: int, variant: Variant, target_blocks: int) -> SplitPlan:
    """Grid of ``lora_grad_out`` for g of (rows, cols): (column blocks x rank tiles) x row splits.

    The dB partials (splits x cols x R float32, written and read back) are kept under half of g's bytes:
    with 256 columns per block the column blocks alone give a 4096-feature layer 16 blocks, so the row
    splits are what fills the GPU (32 splits at R = 16: 1.3 waves instead of 0.65 with a quarter).
    """
    per_split = 16 * variant.rank_bucket
    max_splits = rows * ELEMENT_BYTES[variant.dtype] // per_split
    return _split_plan(LORA_GRAD_OUT, rows, cols, variant, target_blocks, max_splits)


def plan_grad_in(rows: int, cols: int, variant: Variant, target_blocks: int) -> SplitPlan:
    """Grid of ``lora_grad_in`` for x of (rows, cols): (column blocks x rank tiles) x row splits.

    The dA partials (splits x R x cols float32) are kept under a quarter of the bytes of x plus grad_x.
    """
    max_splits = rows * ELEMENT_BYTES[variant.dtype] // (8 * variant.rank_bucket)
    return _split_plan(LORA_GRAD_IN, rows, cols, variant, target_blocks, max_splits)
