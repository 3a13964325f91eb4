"""The one place a LoRA layer's forward leaves ``base(x) + term``: the opt-in fast ops.

:meth:`loragen.LoraLayer.forward` asks :func:`fast_output` first; None means "compute the base output and
add the running adapter's term" (the readable path, and the reference every fast op is checked against).
The fast ops, in the order they are tried:

* a mixed batch (:func:`loragen.mixed_batch`) under way, adapters not off: each row gets its own adapter
  (:func:`mixed_rows`: for a layer with a ``linear_term``, every adapter of the batch in two GEMMs);
* the layer type's fused op (its ``_fused_output``) when the layer's ``fused`` is on: for a Linear-like
  base, loragen's fused LoRA or DoRA op (:func:`loragen.ops.lora_linear`, :func:`loragen.ops.dora_linear`)
  or sibling fusion (:mod:`loragen.ops.siblings`); for a quantized base, the in-place branch
  (:func:`loragen.ops.branch.lora_branch`).

Mixed batches, in detail. peft loops over the adapters of the batch: for each, it gathers that adapter's
rows, runs its two factors on them and scatters the result back (k gathers, 2k small GEMMs and k scatters
per layer). Here a layer whose term is ``scaling * (x A^T) B^T`` runs every adapter of the batch in two
GEMMs, whatever k is::

    H  = x [A_1; ...; A_k]^T              (rows, r_1 + ... + r_k)   one pass over x for every adapter
    H *= M                                M[row, cols of adapter j] = scaling_j if the row uses j, else 0
    y  = base(x) + H [B_1 ... B_k]^T      one GEMM adds every row's term

The zeros in ``M`` make the result row ``i`` exactly ``scaling_j B_j A_j x_i`` for its adapter ``j`` (the
other columns add exact zeros); the extra work is the other adapters' rank-r columns, small beside the
base GEMM. Concatenated factors and masks are cached per layer for the duration of the context, keyed on
the factors' versions. Other layers gather each adapter's rows (``index_select``) and add their term back
(``index_add_``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor

from loragen.errors import MixedBatchError
from loragen.layers.adapter_set import records

if TYPE_CHECKING:
    from loragen.layers.adapter_set import LoraAdapter

__all__ = ["MIXED_ROUTE", "MixedRoute", "fast_output", "mixed_rows"]

MIXED_ROUTE = "_mixed_route"  # the layer attribute holding the MixedRoute of a mixed batch under way


@dataclass
class MixedRoute:
    """The per-row adapter names of one mixed batch, as one layer sees them."""

    path: str
    names: tuple[str, ...]
    # adapter name -> the rows that use it, in order of first appearance ("__base__" left out)
    rows: dict[str, list[int]]
    # per-layer cache of concatenated factors and masks, keyed by id(layer)
    cache: dict[int, tuple[tuple[int, ...], Tensor, Tensor, Tensor]] = field(default_factory=dict)


def fast_output(layer: Any, x: Tensor, adapter: LoraAdapter | None) -> Tensor | None:
    """``layer``'s output for ``x`` through a fast op, or None to compute ``base + term``.

    ``adapter``: the adapter the forward adds (:meth:`loragen.LoraLayer.running_adapter`), None for none.
    """
    route: MixedRoute | None = layer.__dict__.get(MIXED_ROUTE)
    if (
        route is not None and layer.active_adapter is not None
    ):  # adapters off (disable_adapter) win, as in peft
        return mixed_rows(layer, x, route)
    if adapter is None or not layer.fused:
        return None
    fused: Tensor | None = layer._fused_output(x, adapter)
    return fused


def mixed_rows(layer: Any, x: Tensor, route: MixedRoute) -> Tensor:
    """``layer``'s output for a mixed batch ``x``: base output plus each row's adapter term.

    Raises:
        MixedBatchError: the batch has another number of rows than the mixed batch has names.
    """
    if x.shape[0] != len(route.names):
        raise MixedBatchError(
            f"{route.path or type(layer).__name__}: mixed_batch was given {len(route.names)} adapter names but "
            f"the batch has {x.shape[0]} rows (input shape {tuple(x.shape)}); give one name per row"
        )
    result: Tensor = layer._base_output(x)
    held = records(layer)
    used = [name for name in route.rows if name in held]
    if not used:
        return result
    if type(layer).linear_term:  # two GEMMs in all
        return _stacked_rows(layer, x, result, used, route)
    for name in used:
        index = torch.tensor(route.rows[name], device=x.device)
        term = layer._adapter_output(x.index_select(0, index), held[name])
        result = result.index_add(0, index, term.to(result.dtype))
    return result


def _stacked_rows(layer: Any, x: Tensor, result: Tensor, used: list[str], route: MixedRoute) -> Tensor:
    held = records(layer)
    adapters = [held[name] for name in used]
    params = [t for a in adapters for t in (a.factor_a, a.factor_b)]
    key = tuple(t._version for t in params) + tuple(id(t) for t in params)
    cached = route.cache.get(id(layer))
    if cached is None or cached[0] != key:
        a_all = torch.cat([a.factor_a for a in adapters])  # (R, in)
        b_all = torch.cat([a.factor_b for a in adapters], dim=1)  # (out, R)
        mask = a_all.new_zeros(len(route.names), a_all.shape[0])  # (rows, R)
        start = 0
        for name, a in zip(used, adapters):
            rows = torch.tensor(route.rows[name], device=mask.device)
            mask[rows, start : start + a.r] = a.scaling
            start += a.r
        cached = (key, a_all, b_all, mask)
        route.cache[id(layer)] = cached
    _, a_all, b_all, mask = cached
    hidden = F.linear(x.to(a_all.dtype), a_all)  # (rows, ..., R)
    hidden = hidden * mask.view(mask.shape[0], *([1] * (hidden.dim() - 2)), mask.shape[1])
    if result.dtype == b_all.dtype and result.is_contiguous() and not result.requires_grad:
        flat = result.view(-1, result.shape[-1])
        flat.addmm_(hidden.reshape(-1, hidden.shape[-1]), b_all.t())
        return result
    return (result + F.linear(hidden, b_all)).to(result.dtype)
