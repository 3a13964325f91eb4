"""``mixed_batch``: one forward pass in which each row of the batch uses its own adapter.

``with loragen.mixed_batch(model, ["a", "b", "__base__", "a"]): model(x)`` gives row ``i`` of ``x`` the
output of the model with adapter ``names[i]`` active (``"__base__"``: no adapter), as peft's
``model(x, adapter_names=names)`` does. A layer that does not hold a named adapter gives those rows its
base output, as in peft.

How it is computed. peft loops over the adapters of the batch: for each, it gathers that adapter's rows,
runs its two factors on them and scatters the result back (k gathers, 2k small GEMMs and k scatters per
layer). Here a Linear-like layer runs every adapter of the batch in two GEMMs, whatever k is::

    H  = x [A_1; ...; A_k]^T              (rows, r_1 + ... + r_k)   one pass over x for every adapter
    H *= M                                M[row, cols of adapter j] = scaling_j if the row uses j, else 0
    y  = base(x) + H [B_1 ... B_k]^T      one GEMM adds every row's term

The zeros in ``M`` make the result row ``i`` exactly ``scaling_j B_j A_j x_i`` for its adapter ``j`` (the
other columns add exact zeros); the extra work is the other adapters' rank-r columns, small beside the
base GEMM. Concatenated factors and masks are cached per layer for the duration of the context, keyed on
the factors' versions. Embedding and convolution layers gather each adapter's rows (``index_select``) and
add their term back (``index_add_``).

As in peft, a mixed batch is for inference: the model must be in eval mode, and no layer may be merged;
inside :func:`loragen.disable_adapter` every row gets the base model. The names are state on the model's
layers for the duration of the block: two threads running one model with different names at once need
one model each.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from loragen.errors import MixedBatchError
from loragen.layers.adapter_set import adapter_factors, adapter_names, has_adapter, update_route
from loragen.layers.base import LoraLayer

__all__ = ["BASE_NAME", "MixedRoute", "mixed_batch", "forward"]

BASE_NAME = "__base__"


@dataclass
class MixedRoute:
    """The per-row adapter names of one mixed batch, as one layer sees them."""

    path: str
    names: tuple[str, ...]
    # adapter name -> the rows that use it, in order of first appearance ("__base__" left out)
    rows: dict[str, list[int]]
    # per-layer cache of concatenated factors and masks, keyed by id(layer)
    cache: dict[int, tuple[tuple[int, ...], Tensor, Tensor, Tensor]] = field(default_factory=dict)


def _rows_by_adapter(names: Sequence[str]) -> dict[str, list[int]]:
    rows: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        if name != BASE_NAME:
            rows.setdefault(name, []).append(i)
    return rows


@contextmanager
def mixed_batch(model: nn.Module, names: Sequence[str]) -> Iterator[nn.Module]:
    """Within the block, row ``i`` of every batch given to ``model`` uses adapter ``names[i]``
    (``"__base__"``: none); yields ``model``. Every LoRA layer's forward takes part; contexts nest.

    Raises:
        MixedBatchError: ``names`` is not a sequence of strings, names an adapter the model does
            not hold (the message lists the ones it holds) or a DoRA adapter, the model is in training mode or has merged
            layers; later, a batch whose length differs from ``len(adapter_names)`` (names the layer).
    """
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise MixedBatchError(f"mixed_batch: expected a list of adapter names, one per row, got {names!r}")
    layers = {path: m for path, m in model.named_modules() if isinstance(m, LoraLayer)}
    known = list(dict.fromkeys(n for layer in layers.values() for n in adapter_names(layer)))
    unknown = sorted(set(names) - set(known) - {BASE_NAME})
    if unknown:
        raise MixedBatchError(
            f"mixed_batch: unknown adapter name(s) {', '.join(map(repr, unknown))}; the model holds "
            f"{', '.join(map(repr, known)) or 'no adapters'} (and {BASE_NAME!r} means none)"
        )
    if model.training:
        raise MixedBatchError(
            "mixed_batch is for inference: call model.eval() first (peft refuses it in training too)"
        )
    dora = sorted(
        {
            n
            for layer in layers.values()
            for n in set(names) & set(adapter_names(layer))
            if adapter_factors(layer, n).use_dora
        }
    )
    if dora:
        raise MixedBatchError(
            f"mixed_batch: adapter(s) {', '.join(map(repr, dora))} use DoRA; a mixed batch with DoRA adapters is "
            "not supported (peft refuses adapter_names with DoRA too)"
        )
    merged = [path for path, layer in layers.items() if layer.merged]
    if merged:
        raise MixedBatchError(
            f"mixed_batch: layers are merged ({', '.join(merged[:5])}); call loragen.unmerge_adapter(model) first"
        )
    rows = _rows_by_adapter(names)
    cache: dict[int, Any] = {}
    previous = {}
    for path, layer in layers.items():
        previous[path] = layer.__dict__.get("_mixed_route")
        layer.__dict__["_mixed_route"] = MixedRoute(path, tuple(names), rows, cache)
        update_route(layer)
    try:
        yield model
    finally:
        for path, layer in layers.items():
            if previous[path] is None:
                layer.__dict__.pop("_mixed_route", None)
            else:
                layer.__dict__["_mixed_route"] = previous[path]
            update_route(layer)


def forward(layer: Any, x: Tensor, route: MixedRoute) -> Tensor:
    """``layer``'s output for a mixed batch ``x``: base output plus each row's adapter term."""
    if x.shape[0] != len(route.names):
        raise MixedBatchError(
            f"{route.path or type(layer).__name__}: mixed_batch was given {len(route.names)} adapter names but "
            f"the batch has {x.shape[0]} rows (input shape {tuple(x.shape)}); give one name per row"
        )
    result: Tensor = layer._base_output(x)
    used = [name for name in route.rows if has_adapter(layer, name)]
    if not used:
        return result
    if getattr(type(layer), "fused_base", None) is not None:  # a Linear-like layer: two GEMMs in all
        return _linear_rows(layer, x, result, used, route)
    for name in used:
        index = torch.tensor(route.rows[name], device=x.device)
        term = layer._lora_term(x.index_select(0, index), adapter_factors(layer, name))
        result = result.index_add(0, index, term.to(result.dtype))
    return result


def _linear_rows(layer: Any, x: Tensor, result: Tensor, used: list[str], route: MixedRoute) -> Tensor:
    factors = [adapter_factors(layer, name) for name in used]
    params = [t for f in factors for t in (f.factor_a, f.factor_b)]
    key = tuple(t._version for t in params) + tuple(id(t) for t in params)
    cached = route.cache.get(id(layer))
    if cached is None or cached[0] != key:
        a_all = torch.cat([f.factor_a for f in factors])  # (R, in)
        b_all = torch.cat([f.factor_b for f in factors], dim=1)  # (out, R)
        mask = a_all.new_zeros(len(route.names), a_all.shape[0])  # (rows, R)
        start = 0
        for name, f in zip(used, factors):
            rows = torch.tensor(route.rows[name], device=mask.device)
            mask[rows, start : start + f.r] = f.scaling
            start += f.r
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
