"""The four kernel passes of the CUDA LoRA op, as :mod:`loragen.cuda.function` and the self-check
(:mod:`loragen.cuda.selfcheck`) run them: argument lists, grids, partial sums.

Each pass launches one kernel through the plan's launcher -- the CUDA driver, the torch path
(:mod:`loragen.cuda.torch_kernels`) or, in loragen's CPU tests, an emulator -- and adds up its float32
partial sums with torch (deterministic: no atomics). Shapes as in :mod:`loragen.cuda.function`.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from loragen.cuda import specs
from loragen.cuda.launch import KernelLauncher
from loragen.cuda.specs import LORA_DOWN, LORA_GRAD_IN, LORA_GRAD_OUT, LORA_UP, Variant, pad_rank

__all__ = ["DTYPE_NAMES", "Plan", "add_base", "down", "grad_in", "grad_out", "pad_rank", "up"]

DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _aligned16(t: Tensor) -> Tensor:
    """``t`` itself, or a fresh copy when its data is not 16-byte aligned (vector loads need it)."""
    return t if t.data_ptr() % 16 == 0 else t.clone()


class Plan:
    """What forward decides and backward reuses: sizes, the variant, and the launcher that runs it.

    A launcher with a ``route(variant, device)`` method (:class:`loragen.cuda.selfcheck.CheckedLauncher`)
    is asked which launcher runs this variant on this device: the kernels, or the torch path.
    """

    def __init__(self, x2: Tensor, out_features: int, rank: int, launcher: KernelLauncher) -> None:
        self.rows, self.in_features = x2.shape
        self.out_features = out_features
        self.rank = rank
        aligned = self.in_features % 8 == 0 and out_features % 8 == 0
        self.variant = Variant(DTYPE_NAMES[x2.dtype], specs.rank_bucket(rank), aligned)
        self.device = x2.device
        route = getattr(launcher, "route", None)
        self.launcher: KernelLauncher = route(self.variant, x2.device) if route is not None else launcher
        self.target_blocks = self.launcher.target_blocks(x2.device)

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
    grid = specs.plan_down(plan.rows, plan.in_features, plan.variant, plan.target_blocks)
    h_part = torch.empty(grid.splits, plan.rows, bucket, dtype=torch.float32, device=plan.device)
    plan.launcher.launch(
        LORA_DOWN,
        plan.variant,
        grid.grid,
        (x2, a32, h_part, plan.rows, plan.in_features, plan.rank, grid.cols_per_split, *dropout),
        plan.device,
    )
    return h_part[0] if grid.splits == 1 else h_part.sum(0)


def up(plan: Plan, h: Tensor, bt32: Tensor, bias: Tensor | None, scaling: float, out32: Tensor) -> None:
    """out32 = bias + s h B^T (rows, out), float32: the float32 variant of ``lora_up`` at the plan's rank
    bucket and alignment, so the base GEMM can be added before the one rounding (:func:`add_base`)."""
    if plan.rows == 0:
        return
    variant = Variant("float32", plan.variant.rank_bucket, plan.variant.aligned)
    bias32 = None if bias is None else plan.prepare(bias.detach().float())
    plan.launcher.launch(
        LORA_UP,
        variant,
        specs.plan_up(plan.rows, plan.out_features, variant),
        (h, bt32, bias32, out32, plan.rows, plan.out_features, plan.rank, float(scaling)),
        plan.device,
    )


_fp32_gemm_output = True  # torch.addmm(..., out_dtype=torch.float32) works for 16-bit inputs here


def add_base(term32: Tensor, x2: Tensor, w_t: Tensor, out: Tensor) -> None:
    """out = term32 + x2 w_t, rounded once into out's dtype (``term32`` may be ``out`` itself in float32).

    For 16-bit x, cuBLAS takes the float32 term as its C matrix and writes float32 (``out_dtype``); on
    the CPU, or where that is not supported, the product is taken from float32 copies. Either way the
    rank-r term is never rounded to 16 bits before the base product is added.
    """
    global _fp32_gemm_output
    if term32 is out:
        out.addmm_(x2, w_t)
        return
    if x2.is_cuda and _fp32_gemm_output:
        try:
            out.copy_(torch.addmm(term32, x2, w_t, out_dtype=torch.float32))
            return
        except (RuntimeError, TypeError) as exc:
            _fp32_gemm_output = False
            warnings.warn(
                f"loragen.cuda: torch.addmm(..., out_dtype=torch.float32) is not available ({exc}); the "
                "base product of 16-bit LoRA layers is taken in float32 instead (slower)",
                RuntimeWarning,
                stacklevel=2,
            )
    out.copy_(term32.addmm_(x2.float(), w_t.float()))


def grad_out(plan: Plan, g2: Tensor, h: Tensor, bt32: Tensor, scaling: float) -> tuple[Tensor, Tensor]:
    """dh = s g B (rows, R) and dB = s g^T h (out, R), float32."""
    bucket = plan.variant.rank_bucket
    grid = specs.plan_grad_out(plan.rows, plan.out_features, plan.variant, plan.target_blocks)
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
    grid = specs.plan_grad_in(plan.rows, plan.in_features, plan.variant, plan.target_blocks)
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
