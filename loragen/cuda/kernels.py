"""The LoRA kernels as Python sees them: variants, tiles, parameter lists, grids and the four passes.

A :class:`Variant` (dtype, rank bucket, alignment) picks one rendering of each template; a
:class:`KernelSpec` lists a kernel's parameters and tile; :class:`Plan` keeps what a call's shapes decide,
and :func:`down`, :func:`up`, :func:`grad_out`, :func:`grad_in` launch a pass through a
:class:`KernelLauncher` and add up its float32 partial sums with torch (deterministic: no atomics).

Shapes: x (N, in), A (r, in), B (out, r), h = dropout(x) A^T (N, R) in float32, R = the rank bucket.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

__all__ = [
    "ADAMW8BIT",
    "ARCHS",
    "DTYPES",
    "DTYPE_NAMES",
    "DownPlan",
    "Grid",
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
    "all_variants",
    "down",
    "grad_in",
    "grad_in_uses_mma",
    "grad_out",
    "grad_out_uses_mma",
    "max_optimizer_block",
    "optimizer_variant",
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
    "up_uses_mma",
    "uses_mma",
]

# ---- variants and tiles -----------------------------------------------------------------------------

# torch dtype name -> the kernels' storage type (defined in kernels/lora_common.cuh.j2)
DTYPES: dict[str, str] = {"float32": "float", "float16": "f16_t", "bfloat16": "bf16_t"}
ELEMENT_BYTES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}
RANK_BUCKETS: tuple[int, ...] = (8, 16, 32, 64)
MAX_RANK = RANK_BUCKETS[-1]
WARP = 32
Grid = tuple[int, int]  # blocks in x and y


@dataclass(frozen=True)
class Variant:
    """What a kernel is rendered for (the GPU architecture is chosen at compile time)."""

    dtype: str  # a key of DTYPES
    rank_bucket: int  # one of RANK_BUCKETS
    aligned: bool  # every row length % 8 == 0 and every pointer 16-byte aligned: vector accesses
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


# The tile functions give each kernel's block: warps, ``min_blocks`` blocks per multiprocessor (its
# __launch_bounds__, so the register budget) and per-thread work. Rank tiles of one row or column block
# are neighbours in the grid, so their repeated reads of x or g come from L2.
CHUNK = 8  # columns per lane and row: 16 bytes of a 16-bit dtype, one Philox call


def uses_mma(v: Variant) -> bool:
    """Whether ``lora_down`` runs on tensor cores for ``v``: 16-bit x, vector accesses, R >= 16 (at R = 8
    the CUDA cores keep up with HBM)."""
    return v.aligned and ELEMENT_BYTES[v.dtype] == 2 and v.rank_bucket >= 16


def _down_tile(v: Variant) -> dict[str, int]:
    """``lora_down``'s block: few rows per warp (enough blocks for two waves without more column splits)
    and several 16-byte loads of x in flight per lane (``steps`` column steps before the first use)."""
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
    rows_per_warp = 32 // rank_tile  # 32 partial sums per lane, for 3 blocks per SM
    return {
        "warps": 4,
        "min_blocks": 3,
        "mma": False,
        "rank_tile": rank_tile,
        "rows_per_warp": rows_per_warp,
        # 64 bytes of x in flight per lane; scalar loads of unaligned rows need the registers: one step
        "steps": max(1, 64 // (CHUNK * ELEMENT_BYTES[v.dtype] * rows_per_warp)) if v.aligned else 1,
    }


def up_uses_mma(v: Variant) -> bool:
    """Whether ``lora_up``, ``lora_grad_in`` and ``lora_grad_out`` run on tensor cores for ``v``: bf16 (a
    float32 operand is split into two bf16 terms, whose range is float32's), vector accesses, R >= 16."""
    return v.aligned and v.dtype == "bfloat16" and v.rank_bucket >= 16


grad_in_uses_mma = grad_out_uses_mma = up_uses_mma


def _up_tile(v: Variant) -> dict[str, int]:
    """``lora_up``'s block."""
    if up_uses_mma(v):  # rows_per_thread: 16-row tiles per warp; rank_step: unused by the mma pass
        # 128 rows x 128 columns (2 chunks of 32 columns at R = 16, where registers allow more blocks)
        return {
            "warps": 4,
            "min_blocks": 4 if v.rank_bucket <= 32 else 3,
            "mma": True,
            "rows_per_thread": 2,
            "rank_step": 4,
            "col_chunks": 2 if v.rank_bucket == 16 else 4,
        }
    # 4 rows x 8 columns: 32 accumulators and the 32 values of out they are added to; float32 rows and
    # scalar accesses of unaligned rows need more registers for the same loads: two blocks
    return {
        "warps": 4,
        "min_blocks": 3 if v.aligned and ELEMENT_BYTES[v.dtype] == 2 else 2,
        "mma": False,
        "rows_per_thread": 4,
        "rank_step": 4,
        "col_chunks": 1,  # the mma pass only
    }


def _grad_in_tile(v: Variant) -> dict[str, int]:
    """``lora_grad_in``'s block: 4 warps sharing its columns (32 on tensor cores, 256 on the CUDA cores),
    taking turns over the rows, ``rows_per_step`` rows each (on tensor cores: 16-row tiles whose loads
    are all issued before the first mma, fewer as dA's R sums per lane grow)."""
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
        return {
            "warps": 4,
            # unaligned at R = 8 the whole grad_x rank loop unrolls: two blocks, or it spills
            "min_blocks": 2 if not v.aligned and v.rank_bucket == 8 else 3,
            "mma": False,
            "rank_tile": min(v.rank_bucket, 4),
            "rows_per_step": 4 if v.aligned else 2,
        }
    return {"warps": 4, "min_blocks": 3 if v.aligned else 2, "mma": False, "rank_tile": 8, "rows_per_step": 2}


def _grad_out_tile(v: Variant) -> dict[str, int]:
    """``lora_grad_out``'s block."""
    if grad_out_uses_mma(v):
        # 8 warps x 32 columns; R = 64 runs as two rank tiles of 32 (dB^T's R_tile / 2 sums per lane). A
        # step is 2 tiles of 16 rows at R = 16, one at 32 (two tiles' dh would pass 48 KB of shared memory)
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
    """The smallest rank bucket holding ``rank``; ValueError when ``rank`` < 1 or > :data:`MAX_RANK`."""
    for bucket in RANK_BUCKETS:
        if 1 <= rank <= bucket:
            return bucket
    raise ValueError(
        f"loragen.cuda: LoRA rank r={rank} is not supported by the CUDA kernels; expected 1 <= r <= {MAX_RANK}"
    )


def pad_rank(adapter: Tensor, variant: Variant) -> Tensor:
    """``adapter`` (r, features) as a fresh contiguous (R, features) tensor with rows r..R-1 zero (the
    kernels read every rank of the bucket)."""
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

    def threads(self, variant: Variant) -> int:
        """Threads per block."""
        return self.tile(variant)["warps"] * WARP


def _params(*pairs: tuple[str, str]) -> tuple[Param, ...]:
    return tuple(Param(name, ctype) for ctype, name in pairs)


_SIZES = (("int", "rows"), ("int", "cols"), ("int", "rank"))
# seed and offset are read through a pointer (rng[0], rng[1], int64 in device memory): CUDA-graph safe
_DROPOUT = (("const u64*", "rng"), ("unsigned", "threshold"), ("float", "keep_scale"))

LORA_DOWN = KernelSpec(
    "lora_down",
    _params(
        ("const scalar_t*", "x"),
        ("const float*", "lora_a"),
        ("float*", "h_part"),
        *_SIZES,
        ("int", "cols_per_split"),
        *_DROPOUT,
    ),
    _down_tile,
)
LORA_UP = KernelSpec(
    "lora_up",
    _params(
        ("const float*", "h"),
        ("const float*", "lora_bt"),
        ("const scalar_t*", "bias"),
        ("scalar_t*", "out"),
        *_SIZES,
        ("float", "scaling"),
    ),
    _up_tile,
)
LORA_GRAD_OUT = KernelSpec(
    "lora_grad_out",
    _params(
        ("const scalar_t*", "grad"),
        ("const float*", "h"),
        ("const float*", "lora_bt"),
        ("float*", "dh_part"),
        ("float*", "db_part"),
        *_SIZES,
        ("int", "rows_per_split"),
        ("float", "scaling"),
    ),
    _grad_out_tile,
)
LORA_GRAD_IN = KernelSpec(
    "lora_grad_in",
    _params(
        ("const scalar_t*", "x"),
        ("const float*", "dh"),
        ("const float*", "lora_a"),
        ("scalar_t*", "grad_x_lora"),
        ("float*", "da_part"),
        *_SIZES,
        ("int", "rows_per_split"),
        *_DROPOUT,
    ),
    _grad_in_tile,
)

KERNELS: dict[str, KernelSpec] = {k.name: k for k in (LORA_DOWN, LORA_UP, LORA_GRAD_OUT, LORA_GRAD_IN)}

# One block of 8 warps per quantization block, PER_THREAD elements' moments per thread in registers:
# blocks of up to 2048 elements (loragen.training.adamw8bit falls back to torch for larger ones).
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
    for spec, dtype, bucket, aligned in itertools.product(
        KERNELS.values(), DTYPES, RANK_BUCKETS, (True, False)
    ):
        yield spec, Variant(dtype, bucket, aligned)


def optimizer_variant(dtype: str) -> Variant:
    """The one variant of an optimizer kernel for ``dtype``: these kernels ignore the rank bucket and
    alignment, so they carry fixed placeholders (the smallest bucket, aligned)."""
    return Variant(dtype, RANK_BUCKETS[0], True)


def optimizer_variants() -> Iterator[tuple[KernelSpec, Variant]]:
    """Every (kernel, variant) pair of :data:`OPTIMIZER_KERNELS`: one per dtype."""
    for spec in OPTIMIZER_KERNELS.values():
        for dtype in DTYPES:
            yield spec, optimizer_variant(dtype)


def max_optimizer_block(spec: KernelSpec) -> int:
    """The largest quantization block ``spec`` handles: threads per block times elements per thread."""
    tile = spec.tile(optimizer_variant("float32"))
    return tile["warps"] * WARP * tile["per_thread"]


# ---- grids --------------------------------------------------------------------------------------------
# A grid aims at ``target_blocks`` (two per multiprocessor) times ``min_blocks``: two waves, so the last
# is not a long tail. Splits are capped so their float32 partial sums stay a small part of the traffic.


@dataclass(frozen=True)
class DownPlan:
    grid: Grid
    splits: int
    cols_per_split: int


@dataclass(frozen=True)
class SplitPlan:
    grid: Grid
    col_blocks: int
    splits: int
    rows_per_split: int


def rank_tiles(spec: KernelSpec, variant: Variant) -> int:
    """How many rank tiles ``spec`` splits the rank bucket of ``variant`` into (blocks per row/column block)."""
    return variant.rank_bucket // spec.tile(variant)["rank_tile"]


def plan_down(rows: int, cols: int, variant: Variant, target_blocks: int) -> DownPlan:
    """Grid of ``lora_down`` for x of (rows, cols): (row tiles x rank tiles) x column splits, the h
    partials (splits x rows x R float32) under a quarter of x's bytes."""
    tile = LORA_DOWN.tile(variant)
    row_blocks = math.ceil(rows / (tile["warps"] * tile["rows_per_warp"])) * rank_tiles(LORA_DOWN, variant)
    lane_cols = (32 if tile["mma"] else WARP * CHUNK) * tile["steps"]  # columns a warp covers per step
    max_splits = max(1, cols * ELEMENT_BYTES[variant.dtype] // (32 * variant.rank_bucket))
    wanted = target_blocks * tile["min_blocks"]
    splits = min(math.ceil(cols / lane_cols), max_splits, max(1, math.ceil(wanted / max(row_blocks, 1))))
    cols_per_split = math.ceil(cols / splits / lane_cols) * lane_cols
    splits = math.ceil(cols / cols_per_split)
    return DownPlan((row_blocks, splits), splits, cols_per_split)


def plan_up(rows: int, cols: int, variant: Variant) -> Grid:
    """Grid of ``lora_up`` for out of (rows, cols): row tiles x column tiles of 256 columns."""
    tile = LORA_UP.tile(variant)
    if tile["mma"]:  # a warp: rows_per_thread tiles of 16 rows x col_chunks chunks of 32 columns
        rows_per_block = tile["warps"] * 16 * tile["rows_per_thread"]
        return math.ceil(rows / rows_per_block), math.ceil(cols / (WARP * tile["col_chunks"]))
    return math.ceil(rows / (tile["warps"] * tile["rows_per_thread"])), math.ceil(cols / (WARP * CHUNK))


def _split_plan(
    spec: KernelSpec, rows: int, cols: int, variant: Variant, target_blocks: int, max_splits: int
) -> SplitPlan:
    tile = spec.tile(variant)
    shared = spec is LORA_GRAD_IN  # its warps share their columns and take turns over the rows
    if tile.get("mma") and shared:  # lora_grad_in on tensor cores: the warps share 32 columns
        block_cols = WARP
    elif tile.get("mma"):  # lora_grad_out on tensor cores: each warp col_chunks chunks of 32 columns
        block_cols = tile["warps"] * WARP * tile["col_chunks"]
    else:
        block_cols = (1 if shared else tile["warps"]) * WARP * CHUNK
    col_blocks = math.ceil(cols / block_cols)
    blocks = col_blocks * rank_tiles(spec, variant)
    step = tile["rows_per_step"] * (tile["warps"] if shared else 1)
    wanted = target_blocks * tile["min_blocks"]
    splits = max(1, min(max_splits, math.ceil(wanted / blocks), math.ceil(rows / step)))
    rows_per_split = math.ceil(math.ceil(rows / splits) / step) * step
    splits = math.ceil(rows / rows_per_split) if rows else 1
    return SplitPlan((blocks, splits), col_blocks, splits, max(rows_per_split, step))


def plan_grad_out(rows: int, cols: int, variant: Variant, target_blocks: int) -> SplitPlan:
    """Grid of ``lora_grad_out`` for g of (rows, cols): (column blocks x rank tiles) x row splits, the
    dB partials (splits x cols x R float32) under half of g's bytes."""
    max_splits = rows * ELEMENT_BYTES[variant.dtype] // (16 * variant.rank_bucket)
    return _split_plan(LORA_GRAD_OUT, rows, cols, variant, target_blocks, max_splits)


def plan_grad_in(rows: int, cols: int, variant: Variant, target_blocks: int) -> SplitPlan:
    """Grid of ``lora_grad_in`` for x of (rows, cols): (column blocks x rank tiles) x row splits, the
    dA partials (splits x R x cols float32) under a quarter of the bytes of x plus grad_x."""
    max_splits = rows * ELEMENT_BYTES[variant.dtype] // (8 * variant.rank_bucket)
    return _split_plan(LORA_GRAD_IN, rows, cols, variant, target_blocks, max_splits)


class KernelLauncher(Protocol):
    """Runs a kernel variant: :class:`loragen.cuda.launch.DriverLauncher`, the torch products of
    :class:`loragen.cuda.selfcheck.TorchKernels`, or an emulator in loragen's CPU tests. Optional:
    ``arch(device) -> "sm_90"``, ``route(variant, device) -> KernelLauncher`` (``CheckedLauncher``)."""

    def target_blocks(self, device: torch.device) -> int:
        """About two blocks per multiprocessor: how many blocks a grid should have to fill the device."""
        ...

    def launch(
        self, spec: KernelSpec, variant: Variant, grid: Grid, args: Sequence[object], device: torch.device
    ) -> None:
        """Launch ``spec`` for ``variant`` on ``grid`` with ``spec.threads(variant)`` threads per block."""
        ...


# ---- the four passes ---------------------------------------------------------------------------------

DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


class Plan:
    """What the sizes decide, worked out once: the variant, the launcher that runs it (asked of a
    launcher's ``route(variant, device)`` where it has one) and each pass's grid."""

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
        """``t`` contiguous, and 16-byte aligned for an aligned variant (vector loads need it)."""
        t = t.contiguous()
        return t.clone() if self.variant.aligned and t.data_ptr() % 16 else t


def down(plan: Plan, x2: Tensor, a32: Tensor, dropout: tuple[Tensor | None, int, float]) -> Tensor:
    """h = dropout(x) A^T, float32 (rows, R). ``dropout`` = (rng, threshold, keep_scale): rng the int64
    (seed, offset) tensor the kernels read through a pointer (None without dropout)."""
    bucket = plan.variant.rank_bucket
    if plan.rows == 0:
        return x2.new_zeros((0, bucket), dtype=torch.float32)
    grid = plan.down_grid
    h_part = torch.empty(grid.splits, plan.rows, bucket, dtype=torch.float32, device=plan.device)
    args = (x2, a32, h_part, plan.rows, plan.in_features, plan.rank, grid.cols_per_split, *dropout)
    plan.launcher.launch(LORA_DOWN, plan.variant, grid.grid, args, plan.device)
    return h_part[0] if grid.splits == 1 else h_part.sum(0)


def up(plan: Plan, h: Tensor, bt32: Tensor, bias: Tensor | None, scaling: float, out: Tensor) -> None:
    """out += bias + s h B^T in place (rows, out), in x's dtype: ``lora_up`` reads the base product in
    ``out``, adds bias and the rank-r term in float32 and rounds once."""
    if plan.rows == 0:
        return
    bias_in = None if bias is None else plan.prepare(bias.detach().to(out.dtype))
    args = (h, bt32, bias_in, out, plan.rows, plan.out_features, plan.rank, float(scaling))
    plan.launcher.launch(LORA_UP, plan.variant, plan.up_grid, args, plan.device)


def grad_out(plan: Plan, g2: Tensor, h: Tensor, bt32: Tensor, scaling: float) -> tuple[Tensor, Tensor]:
    """dh = s g B (rows, R) and dB = s g^T h (out, R), float32."""
    bucket = plan.variant.rank_bucket
    grid = plan.grad_out_grid
    dh_part = torch.empty(grid.col_blocks, plan.rows, bucket, dtype=torch.float32, device=plan.device)
    db_part = torch.empty(grid.splits, plan.out_features, bucket, dtype=torch.float32, device=plan.device)
    args = (g2, h, bt32, dh_part, db_part, plan.rows, plan.out_features, plan.rank, grid.rows_per_split)
    plan.launcher.launch(LORA_GRAD_OUT, plan.variant, grid.grid, (*args, scaling), plan.device)
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
    args = (x2, dh, a32, gx, da_part, plan.rows, plan.in_features, plan.rank, grid.rows_per_split, *dropout)
    plan.launcher.launch(LORA_GRAD_IN, plan.variant, grid.grid, args, plan.device)
    return gx, (da_part[0] if grid.splits == 1 else da_part.sum(0))
