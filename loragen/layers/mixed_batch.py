"""``mixed_batch``: one forward pass in which each row of the batch uses its own adapter.

``with loragen.mixed_batch(model, ["a", "b", "__base__", "a"]): model(x)`` gives row ``i`` of ``x`` the
output of the model with adapter ``names[i]`` active (``"__base__"``: no adapter), as peft's
``model(x, adapter_names=names)`` does. A layer that does not hold a named adapter gives those rows its
base output, as in peft.

How it is computed: :mod:`loragen.layers.fast_paths` (every adapter of the batch in two GEMMs for
Linear-like layers).

As in peft, a mixed batch is for inference: the model must be in eval mode, and no layer may be merged;
inside :func:`loragen.disable_adapter` every row gets the base model. The names are state on the model's
layers for the duration of the block: two threads running one model with different names at once need
one model each.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from torch import nn

from loragen.errors import MixedBatchError
from loragen.layers.adapter_set import adapter_factors, adapter_names
from loragen.layers.base import LoraLayer
from loragen.layers.fast_paths import MIXED_ROUTE, MixedRoute

__all__ = ["BASE_NAME", "MixedRoute", "mixed_batch"]

BASE_NAME = "__base__"


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
    rows = _rows_by_adapter(names)
    cache: dict[int, Any] = {}
    previous = {}
    for path, layer in layers.items():
        previous[path] = layer.__dict__.get(MIXED_ROUTE)
        layer.__dict__[MIXED_ROUTE] = MixedRoute(path, tuple(names), rows, cache)
    try:
        yield model
    finally:
        for path, layer in layers.items():
            if previous[path] is None:
                layer.__dict__.pop(MIXED_ROUTE, None)
            else:
                layer.__dict__[MIXED_ROUTE] = previous[path]
