"""The four kernel passes of the CUDA LoRA op, as :mod:`loragen.cuda.linear_op` and the self-check
(:mod:`loragen.cuda.selfcheck`) run them: argument lists, grids, partial sums.

Each pass launches one kernel through the plan's launcher -- the CUDA driver, the torch path
(:mod:`loragen.cuda.torch_kernels`) or, in loragen's CPU tests, an emulator -- and adds up its float32
partial sums with torch (deterministic: no atomics). Shapes as in :mod:`loragen.cuda.linear_op`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from loragen.cuda import kernel_variants, specs
from loragen.cuda.kernel_variants import Variant, pad_rank
from loragen.cuda.launch import KernelLauncher
from loragen.cuda.specs import LORA_DOWN, LORA_GRAD_IN, LORA_GRAD_OUT, LORA_UP

__all__ = ["DTYPE_NAMES", "Plan", "add_base", "down", "grad_in", "grad_out", "pad_rank", "up"]

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
        self.variant = Variant(DTYPE_NAMES[x2.dtype], kernel_variants.rank_bucket(rank), aligned)
        self.device = x2.device
        route = getattr(launcher, "route", None)
        self.launcher: KernelLauncher = route(self.variant, x2.device) if route is not None else launcher
        self.target_blocks = self.launcher.target_blocks(x2.device)
        rows, cols, variant, blocks = self.rows, self.in_features, self.variant, self.target_blocks
        self.down_grid = specs.plan_down(rows, cols, variant, blocks)
        self.up_grid = specs.plan_up(rows, out_features, variant)
        self.grad_out_grid = specs.plan_grad_out(rows, out_features, variant, blocks)
        self.grad_in_grid = specs.plan_grad_in(rows, cols, variant, blocks)

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
