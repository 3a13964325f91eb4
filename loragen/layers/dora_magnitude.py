"""DoRA's per-layer parts: the magnitude vector, the detached weight norm, and exact merging.

A layer with ``use_dora`` holds ``lora_magnitude_vector`` beside its factors, one value per output
feature, with peft's shapes: ``(out,)`` for Linear and transformers ``Conv1D``, ``(embedding_dim,)`` for
Embedding, ``(1, out, 1, ...)`` for ConvNd (so it broadcasts over a conv output). It starts as the norm of
``W + s B A`` (``||W||`` when B starts at zero), so a new DoRA adapter is a no-op, as in peft.

The norm is taken along the axis that holds one output's weights: the rows of a Linear / ConvNd weight
``(out, in, *k)``, the columns of a ``Conv1D`` weight ``(in, out)`` and of an embedding table
``(num_embeddings, dim)``.

Merging writes ``(m / n) * (W + s B A)`` into the weight; the norm ``n`` of the unmerged weight is kept on
the layer so that unmerging divides by exactly the factor merging multiplied with.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor, nn

from loragen.errors import LoraConversionError, LoraMergeError
from loragen.registry import Layout, PlainLayout

__all__ = ["MAGNITUDE", "check_dora_supported", "dora_merge", "dora_unmerge", "init_magnitude", "weight_norm"]

MAGNITUDE = "lora_magnitude_vector"
# the norm of the unmerged weight while a DoRA layer is merged (for unmerge)
_MERGED_NORM = "_dora_merged_norm"


class LoraLayer(Protocol):
    """What these functions use of a :class:`loragen.layers.LoraLayer` (which imports this module)."""

    @property
    def weight(self) -> Tensor: ...

    @property
    def layout(self) -> Layout: ...

    def _merge_dtype(self) -> torch.dtype: ...


class Adapter(Protocol):
    """One adapter's factors, scaling and magnitude (a :class:`loragen.layers.adapter_set.LoraAdapter`)."""

    scaling: float

    @property
    def factor_a(self) -> nn.Parameter: ...

    @property
    def factor_b(self) -> nn.Parameter: ...

    @property
    def magnitude(self) -> nn.Parameter: ...

    def register(self, name: str, parameter: nn.Parameter) -> None: ...


def _norm_of(layer: LoraLayer, full: Tensor) -> Tensor:
    """The per-output norm of a full weight ``full`` in ``layer``'s layout, shaped like the magnitude."""
    if isinstance(layer.layout, PlainLayout):
        norm = torch.linalg.vector_norm(full.flatten(1), dim=1)  # (out,)
        return norm if full.dim() == 2 else norm.view(1, -1, *([1] * (full.dim() - 2)))
    return torch.linalg.vector_norm(full, dim=0)  # Conv1D (in, out), embedding (num, dim): per column


def _factor_view(layer: LoraLayer, factor: Tensor) -> Tensor:
    """``factor`` (shaped like the magnitude) broadcastable against the stored weight."""
    flat = factor.reshape(-1)
    if isinstance(layer.layout, PlainLayout):
        return flat.view(-1, *([1] * (layer.weight.dim() - 1)))
    return flat.view(1, -1)


def _directed(layer: LoraLayer, adapter: Adapter) -> Tensor:
    """``W + s B A`` in the weight's layout, in float32 (float64 for float64 weights)."""
    dtype = layer._merge_dtype()
    delta = layer.layout.delta(adapter.factor_a.to(dtype), adapter.factor_b.to(dtype)) * adapter.scaling
    return layer.weight.to(dtype) + delta


def weight_norm(layer: LoraLayer, adapter: Adapter) -> Tensor:
    """``||W + s B A||`` of ``adapter`` per output feature, detached, shaped like the magnitude, in the
    adapter's dtype."""
    with torch.no_grad():
        return _norm_of(layer, _directed(layer, adapter)).to(adapter.factor_a.dtype)


def check_dora_supported(layer: LoraLayer) -> None:
    """Raise unless DoRA can be set up on ``layer`` (whose class has a DoRA variant) exactly as peft does.

    Raises:
        LoraConversionError: the base weight is not floating point (a quantized layer), or the layer is a
            grouped convolution (peft has no DoRA for it either); the message names the type.
    """
    name = type(layer).__qualname__
    if not layer.weight.dtype.is_floating_point:
        raise LoraConversionError(
            f"use_dora=True on {name}: its weight is stored as {layer.weight.dtype}; loragen's DoRA needs a "
            "floating-point base weight (quantized bases are not supported with DoRA); set use_dora=False"
        )
    groups = getattr(layer, "groups", 1)
    if groups != 1:
        raise LoraConversionError(
            f"use_dora=True on {name} with groups={groups}: DoRA on grouped convolutions is "
            "not supported (peft has none either); set use_dora=False or exclude the layer"
        )


def init_magnitude(layer: LoraLayer, adapter: Adapter) -> None:
    """Give a new ``adapter`` its ``lora_magnitude_vector``: the current norm of ``W + s B A``, as peft
    does (on the meta device: the shape only)."""
    adapter.register(MAGNITUDE, nn.Parameter(weight_norm(layer, adapter).clone()))


@torch.no_grad()
def dora_merge(layer: LoraLayer, adapter: Adapter) -> None:
    """``W <- (m / n) * (W + s B A)`` with ``n = ||W + s B A||``, in float32 (float64 for float64 weights),
    rounded once; keeps ``n`` on the layer for :func:`dora_unmerge`."""
    w = layer.weight
    full = _directed(layer, adapter)
    norm = _norm_of(layer, full)
    factor = adapter.magnitude.to(full.dtype) / norm
    w.copy_((_factor_view(layer, factor) * full).to(w.dtype))
    layer.__dict__[_MERGED_NORM] = norm


@torch.no_grad()
def dora_unmerge(layer: LoraLayer, adapter: Adapter) -> None:
    """Undo :func:`dora_merge`: ``W <- W / (m / n) - s B A`` with the ``n`` merging used.

    Raises:
        LoraMergeError: the layer is marked merged but merging left no norm (its state was restored from
            a checkpoint taken while merged); the message says to reload the base weights.
    """
    norm = layer.__dict__.pop(_MERGED_NORM, None)
    if norm is None:
        raise LoraMergeError(
            f"cannot unmerge this DoRA {type(layer).__qualname__}: the weight norm from before merging is not "
            "known (the layer was not merged in this process); reload the base weights instead"
        )
    w = layer.weight
    dtype = layer._merge_dtype()
    factor = adapter.magnitude.to(norm.dtype) / norm
    delta = layer.layout.delta(adapter.factor_a.to(dtype), adapter.factor_b.to(dtype)) * adapter.scaling
    w.copy_((w.to(norm.dtype) / _factor_view(layer, factor) - delta).to(w.dtype))
