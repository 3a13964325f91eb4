"""``mixed_batch``: one forward pass in which each row of the batch uses its own adapter.

``with loragen.mixed_batch(model, ["a", "b", "__base__", "a"]): model(x)`` gives row ``i`` the output
with adapter ``names[i]`` (``"__base__"``: none), as peft's ``model(x, adapter_names=names)``; a layer
without a named adapter gives those rows its base output. As in peft it is for inference (eval mode,
nothing merged; inside :func:`loragen.disable_adapter` every row gets the base). The names are state on
the layers for the block: two threads running one model need one model each.

A layer with a ``linear_term`` runs every adapter of the batch in two GEMMs, where peft gathers and
scatters per adapter: ``y = base(x) + ((x [A_1; ...; A_k]^T) * M) [B_1 ... B_k]^T`` with
``M[row, cols of adapter j] = scaling_j`` if the row uses ``j``, else 0 (cached per layer for the block).
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
from loragen.layers.adapter_set import adapter_factors, adapter_names, records
from loragen.layers.base import LoraLayer

__all__ = ["BASE_NAME", "MixedRoute", "mixed_batch"]

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

    def output(self, layer: Any, x: Tensor) -> Tensor:
        """``layer``'s output for a mixed batch ``x``: base output plus each row's adapter term.

        Raises:
            MixedBatchError: the batch has another number of rows than the mixed batch has names.
        """
        if x.shape[0] != len(self.names):
            raise MixedBatchError(
                f"{self.path or type(layer).__name__}: mixed_batch was given {len(self.names)} adapter names but "
                f"the batch has {x.shape[0]} rows (input shape {tuple(x.shape)}); give one name per row"
            )
        result: Tensor = layer._base_output(x)
        held = records(layer)
        used = [name for name in self.rows if name in held]
        if not used:
            return result
        if type(layer).linear_term:  # two GEMMs in all
            return _stacked_rows(layer, x, result, used, self)
        for name in used:
            index = torch.tensor(self.rows[name], device=x.device)
            term = layer._adapter_output(x.index_select(0, index), held[name])
            result = result.index_add(0, index, term.to(result.dtype))
        return result


@contextmanager
def mixed_batch(model: nn.Module, names: Sequence[str]) -> Iterator[nn.Module]:
    """Within the block, row ``i`` of every batch given to ``model`` uses adapter ``names[i]`` (``"__base__"``:
    none); yields ``model``. Every LoRA layer takes part; contexts nest.

    Raises:
        MixedBatchError: ``names`` is not a sequence of strings, names an adapter the model does not hold
            (the message lists those it holds) or a DoRA adapter, the model is in training mode or has
            merged layers; later, a batch whose length differs from ``len(names)`` (names the layer).
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
    unmixable = {
        n: adapter_factors(layer, n).variant
        for layer in layers.values()
        for n in set(names) & set(adapter_names(layer))
        if not adapter_factors(layer, n).variant.mixable
    }
    if unmixable:
        title = next(iter(unmixable.values())).title
        raise MixedBatchError(
            f"mixed_batch: adapter(s) {', '.join(map(repr, sorted(unmixable)))} use {title}; a mixed batch with "
            f"{title} adapters is not supported (peft refuses adapter_names with {title} too)"
        )
    merged = [path for path, layer in layers.items() if layer.merged]
    if merged:
        raise MixedBatchError(
            f"mixed_batch: layers are merged ({', '.join(merged[:5])}); call loragen.unmerge_adapter(model) first"
        )
    rows: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        if name != BASE_NAME:
            rows.setdefault(name, []).append(i)
    cache: dict[int, Any] = {}
    previous = {}
    for path, layer in layers.items():
        previous[path] = layer.mixed_route
        layer.mixed_route = MixedRoute(path, tuple(names), rows, cache)
    try:
        yield model
    finally:
        for path, layer in layers.items():
            layer.mixed_route = previous[path]


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
