"""The LoRA kernels as Python sees them: variants, tiles, parameter lists, grids and the four passes.

A :class:`Variant` (dtype, rank bucket, alignment) picks one rendering of each kernel template; the tile
functions fix each kernel's threads and per-thread work; a :class:`KernelSpec` lists a kernel's
parameters in the template's order; the ``plan_*`` functions size each pass's grid. :class:`Plan` keeps
what one call's shapes decide, and :func:`down`, :func:`up`, :func:`grad_out`, :func:`grad_in` launch a
pass through a :class:`KernelLauncher` -- the CUDA driver, the torch products of
:class:`loragen.cuda.selfcheck.TorchKernels`, or in loragen's CPU tests an emulator -- and add up its
float32 partial sums with torch (deterministic: no atomics).

Shapes: x (N, in), A (r, in), B (out, r), h = dropout(x) A^T (N, R) in float32, R = the rank bucket.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

__all__ = [
    "ADAMW8BIT",
    "ARCHS",
    "CHUNK",
    "DTYPES",
    "DTYPE_NAMES",
    "DownPlan",
    "ELEMENT_BYTES",
    "KERNELS",
    "KernelLauncher",
    "KernelSpec",
    "MAX_RANK",
    "OPTIMIZER_KERNELS",
    "Param",
    "Plan",
    "RANK_BUCKETS",
    "SplitPlan",
    "Variant",
    "WARP",
    "add_base",
    "all_variants",
    "backward_tile",
    "down",
    "down_tile",
    "grad_in",
    "grad_in_uses_mma",
    "grad_out",
    "grad_out_tile",
    "grad_out_uses_mma",
    "max_optimizer_block",
    "optimizer_variants",
    "pad_rank",
    "plan_down",
    "plan_grad_in",
    "plan_grad_out",
    "plan_up",
    "rank_bucket",
    "rank_tiles",
    "render_params",
    "up",
    "up_tile",
    "up_uses_mma",
    "uses_mma",
    "wanted_blocks",
]

# ---- variants and tiles -----------------------------------------------------------------------------

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


# ---- parameter lists and grids -----------------------------------------------------------------------

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
    params["variant"] = f"Rendered by loragen.cuda.build for {variant.dtype}:\n// {summary}."
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
# pass's main traffic, which can leave a grid short of two waves.


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


class KernelLauncher(Protocol):
    """Runs a kernel variant; :class:`loragen.cuda.launch.DriverLauncher` on a GPU, an emulator in loragen's CPU tests.

    Optional methods others look for: ``arch(device) -> "sm_90"`` (the self-check refuses bfloat16
    before sm_80 without compiling), ``route(variant, device) -> KernelLauncher``
    (:class:`loragen.cuda.selfcheck.CheckedLauncher`: which launcher runs a variant).
    """

    def target_blocks(self, device: torch.device) -> int:
        """About two blocks per multiprocessor: how many blocks a grid should have to fill the device."""
        ...

    def launch(
        self,
        spec: KernelSpec,
        variant: Variant,
        grid: tuple[int, int],
        args: Sequence[object],
        device: torch.device,
    ) -> None:
        """Launch ``spec`` for ``variant`` on ``grid`` with ``spec.threads(variant)`` threads per block."""
        ...


# ---- the four passes ---------------------------------------------------------------------------------

DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _aligned16(t: Tensor) -> Tensor:
    """``t`` itself, or a fresh copy when its data is not 16-byte aligned (vector loads need it)."""
    return t if t.data_ptr() % 16 == 0 else t.clone()


class Plan:
    """What forward decides and backward reuses: sizes, the variant, the launcher that runs it, and each
    pass's grid (all fixed by the sizes, so worked out once per plan rather than per call).

    A launcher with a ``route(variant, device)`` method (:class:`loragen.cuda.selfcheck.CheckedLauncher`)
    is asked which launcher runs this variant on this device: the kernels, or the torch path.
    """

    def __init__(self, x2: Tensor, out_features: int, rank: int, launcher: KernelLauncher) -> None:
        self.rows, self.in_features = x2.shape
        self.out_features = out_features
        self.rank = rank
        aligned = self.in_features % 8 == 0 and out_features % 8 == 0
        self.variant = Variant(DTYPE_NAMES[x2.dtype], rank_bucket(rank), aligned)
        self.device = x2.device
        route = getattr(launcher, "route", None)
        self.launcher: KernelLauncher = route(self.variant, x2.device) if route is not None else launcher
        self.target_blocks = self.launcher.target_blocks(x2.device)
        rows, cols, variant, blocks = self.rows, self.in_features, self.variant, self.target_blocks
        self.down_grid = plan_down(rows, cols, variant, blocks)
        self.up_grid = plan_up(rows, out_features, variant)
        self.grad_out_grid = plan_grad_out(rows, out_features, variant, blocks)
        self.grad_in_grid = plan_grad_in(rows, cols, variant, blocks)

    def prepare(self, t: Tensor) -> Tensor:
        """``t`` contiguous, and 16-byte aligned for an aligned variant."""
        t = t.contiguous()
        return _aligned16(t) if self.variant.aligned else t


def down(plan: Plan, x2: Tensor, a32: Tensor, dropout: tuple[Tensor | None, int, float]) -> Tensor:
    """h = dropout(x) A^T, float32 (rows, R). ``dropout`` = (rng, threshold, keep_scale): rng the int64
    (seed, offset) tensor the kernels read through a pointer (None without dropout)."""
    bucket = plan.variant.rank_bucket
    if plan.rows == 0:
        return x2.new_zeros((0, bucket), dtype=torch.float32)
    grid = plan.down_grid
    h_part = torch.empty(grid.splits, plan.rows, bucket, dtype=torch.float32, device=plan.device)
    plan.launcher.launch(
        LORA_DOWN,
        plan.variant,
        grid.grid,
        (x2, a32, h_part, plan.rows, plan.in_features, plan.rank, grid.cols_per_split, *dropout),
        plan.device,
    )
    return h_part[0] if grid.splits == 1 else h_part.sum(0)


def up(plan: Plan, h: Tensor, bt32: Tensor, bias: Tensor | None, scaling: float, out: Tensor) -> None:
    """out += bias + s h B^T in place (rows, out), in x's dtype: ``lora_up`` reads the base product that
    :func:`add_base` wrote into ``out``, adds bias and the rank-r term in float32 and rounds once."""
    if plan.rows == 0:
        return
    bias_in = None if bias is None else plan.prepare(bias.detach().to(out.dtype))
    plan.launcher.launch(
        LORA_UP,
        plan.variant,
        plan.up_grid,
        (h, bt32, bias_in, out, plan.rows, plan.out_features, plan.rank, float(scaling)),
        plan.device,
    )


def add_base(x2: Tensor, w_t: Tensor, out: Tensor) -> None:
    """out = x2 w_t, written once in out's dtype by cuBLAS: the base product, rounded as peft's base
    layer rounds it; :func:`up` then adds bias + s h B^T to it in float32 before the one more rounding.

    Bytes of the output (N x out elements of x's dtype, E bytes each): this write, then ``lora_up``'s
    read and write -- 3 E per element, against 4 + 4 + 4 + 4 + E for a float32 term, a float32 cuBLAS
    C/D and a copy into x's dtype.
    """
    torch.mm(x2, w_t, out=out)


def grad_out(plan: Plan, g2: Tensor, h: Tensor, bt32: Tensor, scaling: float) -> tuple[Tensor, Tensor]:
    """dh = s g B (rows, R) and dB = s g^T h (out, R), float32."""
    bucket = plan.variant.rank_bucket
    grid = plan.grad_out_grid
    dh_part = torch.empty(grid.col_blocks, plan.rows, bucket, dtype=torch.float32, device=plan.device)
    db_part = torch.empty(grid.splits, plan.out_features, bucket, dtype=torch.float32, device=plan.device)
    plan.launcher.launch(
        LORA_GRAD_OUT,
        plan.variant,
        grid.grid,
        (
            g2,
            h,
            bt32,
            dh_part,
            db_part,
            plan.rows,
            plan.out_features,
            plan.rank,
            grid.rows_per_split,
            scaling,
        ),
        plan.device,
    )
    dh = dh_part[0] if grid.col_blocks == 1 else dh_part.sum(0)
    db = db_part[0] if grid.splits == 1 else db_part.sum(0)
    return dh, db


def grad_in(
    plan: Plan, x2: Tensor, dh: Tensor, a32: Tensor, dropout: tuple[Tensor | None, int, float], need_x: bool
) -> tuple[Tensor | None, Tensor]:
    """The LoRA part of grad_x (rows, in) in x's dtype (None unless ``need_x``) and dA (R, in) float32."""
    bucket = plan.variant.rank_bucket
    grid = plan.grad_in_grid
    gx = torch.empty_like(x2) if need_x else None
    da_part = torch.empty(grid.splits, bucket, plan.in_features, dtype=torch.float32, device=plan.device)
    plan.launcher.launch(
        LORA_GRAD_IN,
        plan.variant,
        grid.grid,
        (x2, dh, a32, gx, da_part, plan.rows, plan.in_features, plan.rank, grid.rows_per_split, *dropout),
        plan.device,
    )
    return gx, (da_part[0] if grid.splits == 1 else da_part.sum(0))
