"""The factors of a weighted combination of one layer's adapters, as peft's ``add_weighted_adapter``
computes them (the model-level function is :func:`loragen.add_weighted_adapter`).

For adapters ``i`` with factors ``A_i`` (r_i, in), ``B_i`` (out, r_i), scaling ``s_i`` and weight ``w_i``,
the new adapter gets rank ``new_rank`` and scaling 1 (peft sets its ``lora_alpha`` to its rank):

``cat``     ``A = [w_1 s_1 A_1; ...; w_k s_k A_k]``, ``B = [B_1 ... B_k]``: exactly ``sum_i w_i s_i B_i A_i``
            (rows past ``r_1 + ... + r_k`` are zero).
``linear``  ``A = sum_i sign(c_i) sqrt|c_i| A_i``, ``B = sum_i sqrt|c_i| B_i`` with ``c_i = w_i s_i``: every
            rank equal; an approximation (cross terms ``B_i A_j`` appear).
``svd``     the best rank-``new_rank`` approximation of ``sum_i w_i s_i B_i A_i`` (the delta flattened to
            ``(out, in * kernel)``): ``B = U_r diag(S_r)``, ``A = Vh_r``; ``svd_clamp`` clamps both to the
            ``clamp`` quantile of their values, as peft does.

A layer that does not hold one of the adapters leaves it out of its sum.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from loragen.errors import AdapterMixError
from loragen.layers.adapter_set import Factors

__all__ = ["COMBINATIONS", "combine"]

COMBINATIONS = ("cat", "linear", "svd")


def combine(
    parts: Sequence[tuple[str, Factors, float]],
    combination_type: str,
    new_rank: int,
    *,
    path: str = "",
    svd_clamp: float | None = None,
    svd_full_matrices: bool = True,
    svd_driver: str | None = None,
) -> tuple[Tensor, Tensor]:
    """``(A, B)`` of rank ``new_rank`` combining ``parts`` (``(name, factors, weight)``) of one layer.

    Raises:
        AdapterMixError: ``linear`` with factors of different shapes (names the layer ``path``, the adapters
            and their ranks).
    """
    first = parts[0][1]
    a0, b0 = first.factor_a, first.factor_b
    new_a = a0.new_zeros((new_rank, *a0.shape[1:]))
    new_b = b0.new_zeros((b0.shape[0], new_rank, *b0.shape[2:]))
    with torch.no_grad():
        if combination_type == "cat":
            a = torch.cat([f.factor_a * w * f.scaling for _, f, w in parts])
            b = torch.cat([f.factor_b for _, f, w in parts], dim=1)
            new_a[: a.shape[0]] = a
            new_b[:, : b.shape[1]] = b
            return new_a, new_b
        if combination_type == "linear":
            shapes = {name: tuple(f.factor_a.shape) for name, f, _ in parts}
            if len(set(shapes.values())) > 1:
                ranks = ", ".join(f"{name!r} r={shape[0]}" for name, shape in shapes.items())
                raise AdapterMixError(
                    f"{path}: combination_type='linear' needs adapters of one rank, here {ranks}; "
                    "use 'cat' or 'svd'"
                )
            coeffs = [w * f.scaling for _, f, w in parts]
            weights_a = torch.tensor([math.copysign(math.sqrt(abs(c)), c) for c in coeffs])
            weights_b = torch.tensor([math.sqrt(abs(c)) for c in coeffs])
            a = _weighted_sum([f.factor_a for _, f, _ in parts], weights_a)
            b = _weighted_sum([f.factor_b for _, f, _ in parts], weights_b)
            return a.to(a0.dtype), b.to(b0.dtype)
        # svd
        delta = _weighted_sum(
            [f.factor_b.flatten(1) @ f.factor_a.flatten(1) * f.scaling for _, f, _ in parts],
            torch.tensor([w for _, _, w in parts]),
        )  # (out, in * kernel)
        u, s, vh = torch.linalg.svd(delta, full_matrices=svd_full_matrices, driver=svd_driver)
        u = u[:, :new_rank] @ torch.diag(s[:new_rank])
        vh = vh[:new_rank, :]
        if svd_clamp is not None:
            high = torch.quantile(torch.cat([u.flatten(), vh.flatten()]), svd_clamp)
            u, vh = u.clamp(-high, high), vh.clamp(-high, high)
        kept = u.shape[1]  # below new_rank when the delta has fewer rows or columns
        new_b.flatten(1)[:, :kept] = u.to(new_b.dtype)
        new_a[:kept] = vh.view(kept, *a0.shape[1:]).to(new_a.dtype)
        return new_a, new_b


def _weighted_sum(tensors: list[Tensor], weights: Tensor) -> Tensor:
    """``sum_i weights[i] * tensors[i]`` (stacked, as peft's task arithmetic sums)."""
    stacked = torch.stack(tensors)
    weights = weights.to(stacked.device, stacked.dtype).view(-1, *([1] * (stacked.dim() - 1)))
    return (stacked * weights).sum(dim=0)
