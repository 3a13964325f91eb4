"""Adapter variants, plain LoRA and DoRA: one stateless strategy object each, chosen when an adapter is made
(:func:`variant_for`). A variant checks the layer, makes its own parameters, composes the output from the
base output, merges and unmerges; a layer type names its DoRA in ``dora_variant``.

DoRA follows peft per family (:class:`LinearDora`, :class:`EmbeddingDora`, :class:`ConvDora`): the
magnitude ``lora_magnitude_vector`` has one value per output feature and starts as the norm of
``W + s B A`` along one output's weights (a new adapter is a no-op). Merging writes ``(m / n) * (W + s B A)``
and keeps ``n`` on the layer, so unmerging divides by exactly that factor.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from loragen.errors import LoraConversionError, LoraMergeError
from loragen.layouts import PlainLayout, TransposedLayout
from loragen.reference import dora_linear_reference

__all__ = [
    "LORA",
    "MAGNITUDE",
    "ConvDora",
    "EmbeddingDora",
    "LinearDora",
    "Variant",
    "variant_for",
    "weight_norm",
]

MAGNITUDE = "lora_magnitude_vector"


class Variant:
    """Plain LoRA: ``y = base(x) + scaling * B A dropout(x)``; merging adds ``scaling * B @ A``. One object
    per variant serves every layer and adapter; subclasses (DoRA) override what differs."""

    name: ClassVar[str] = "lora"
    title: ClassVar[str] = "LoRA"  # for messages
    # the value of LoraConfig.use_dora that selects this variant (an adapter folder's config says it)
    use_dora: ClassVar[bool] = False
    # parameters the variant adds beside the two factors (their attribute names = peft's key suffixes)
    extra_parameters: ClassVar[tuple[str, ...]] = ()
    # whether loragen.mixed_batch can route rows through adapters of this variant
    mixable: ClassVar[bool] = True
    # whether loragen.add_weighted_adapter can combine adapters of this variant (a sum of factors)
    combinable: ClassVar[bool] = True

    def check(self, layer: Any) -> None:
        """Raise if the variant cannot run on ``layer``."""

    def init(self, layer: Any, adapter: Any) -> None:
        """Set up the variant's own parameters of a new ``adapter`` (after its factors)."""

    def output(self, layer: Any, x: Tensor, adapter: Any, result: Tensor) -> Tensor:
        """``result + scaling * B A dropout(x)`` for the base output ``result``, cast back to its dtype."""
        return (result + layer._adapter_output(x, adapter)).to(result.dtype)

    @torch.no_grad()
    def merge(self, layer: Any, adapter: Any) -> None:
        """``W += scaling * B @ A`` in float32 (float64 for float64 weights), rounded once."""
        w = layer.weight
        w.copy_((w.to(layer._merge_dtype()) + layer.delta_weight_of(adapter)).to(w.dtype))

    @torch.no_grad()
    def unmerge(self, layer: Any, adapter: Any) -> None:
        """``W -= scaling * B @ A``."""
        w = layer.weight
        w.copy_((w.to(layer._merge_dtype()) - layer.delta_weight_of(adapter)).to(w.dtype))

    def __repr__(self) -> str:
        return f"<{type(self).__name__}>"

    def __reduce__(self) -> str | tuple[Any, ...]:
        return (_variant_by_type, (type(self).__qualname__,))  # one object per variant, pickled by name

    def __deepcopy__(self, memo: dict[int, Any]) -> Variant:
        return self


class DoraVariant(Variant):
    """DoRA as peft computes it: a trained magnitude ``m`` per output rescales ``W + scaling * B A`` to norm
    ``m`` (the norm detached)."""

    name = "dora"
    title = "DoRA"
    use_dora = True
    extra_parameters = (MAGNITUDE,)
    mixable = False  # peft refuses adapter_names with DoRA too
    combinable = False  # a sum of factors would leave out each adapter's magnitude

    def check(self, layer: Any) -> None:
        """Raise unless DoRA can be set up on ``layer`` as peft does.

        Raises:
            LoraConversionError: a non-floating (quantized) base weight, or a grouped convolution.
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

    def init(self, layer: Any, adapter: Any) -> None:
        """The magnitude: the current norm of ``W + s B A``, as peft does."""
        adapter.register(MAGNITUDE, nn.Parameter(weight_norm(layer, adapter).clone()))

    @torch.no_grad()
    def merge(self, layer: Any, adapter: Any) -> None:
        """``W <- (m / n) * (W + s B A)``, ``n = ||W + s B A||``, rounded once; keeps ``n`` for :meth:`unmerge`."""
        w = layer.weight
        full = _directed(layer, adapter)
        norm = _norm_of(layer, full)
        factor = adapter.magnitude.to(full.dtype) / norm
        w.copy_((_factor_view(layer, factor) * full).to(w.dtype))
        layer._dora_merged_norm = norm

    @torch.no_grad()
    def unmerge(self, layer: Any, adapter: Any) -> None:
        """``W <- W / (m / n) - s B A`` with the ``n`` merging used.

        Raises:
            LoraMergeError: merging left no norm (the layer was not merged in this process).
        """
        norm, layer._dora_merged_norm = layer._dora_merged_norm, None
        if norm is None:
            raise LoraMergeError(
                f"cannot unmerge this DoRA {type(layer).__qualname__}: the weight norm from before merging is not "
                "known (the layer was not merged in this process); reload the base weights instead"
            )
        w = layer.weight
        factor = adapter.magnitude.to(norm.dtype) / norm
        w.copy_((w.to(norm.dtype) / _factor_view(layer, factor) - layer.delta_weight_of(adapter)).to(w.dtype))


class LinearDora(DoraVariant):
    """DoRA on a Linear weight: :func:`loragen.reference.dora_linear_reference` on the base output."""

    def output(self, layer: Any, x: Tensor, adapter: Any, result: Tensor) -> Tensor:
        tensors = (x, layer.weight, layer.bias, adapter.factor_a, adapter.factor_b, adapter.magnitude)
        settings = (adapter.scaling, adapter.lora_dropout_p, layer.training)
        return dora_linear_reference(
            *tensors, *settings, fan_in_fan_out=isinstance(layer.layout, TransposedLayout), result=result
        )


class EmbeddingDora(DoraVariant):
    """peft's DoRA for embeddings: ``c * (table row + s * lora row)``, ``c = m / ||W + s (B A)^T||`` detached."""

    def output(self, layer: Any, x: Tensor, adapter: Any, result: Tensor) -> Tensor:
        c = adapter.magnitude / weight_norm(layer, adapter)
        return (c * result + c * layer._adapter_output(x, adapter)).to(result.dtype)


class ConvDora(DoraVariant):
    """peft's DoRA for convolutions: ``result + (c - 1) * base + c * s * lora``, ``c = m / ||W + s B A||``
    (detached) per output channel; ``base`` is the convolution of the (dropped-out) input without bias."""

    def output(self, layer: Any, x: Tensor, adapter: Any, result: Tensor) -> Tensor:
        x_lora = x.to(adapter.factor_a.dtype)
        dropout = adapter.lora_dropout_p > 0 and layer.training
        if dropout:
            x_lora = F.dropout(x_lora, adapter.lora_dropout_p, True)
        lora = layer._unscaled_term(x_lora, adapter)
        c = adapter.magnitude / weight_norm(layer, adapter)
        if dropout:
            base = layer._conv_forward(x_lora, layer.weight.to(x_lora.dtype), None)
        elif layer.bias is not None:
            base = result - layer.bias.view(1, -1, *([1] * (result.dim() - 2)))
        else:
            base = result
        return (result + (c - 1) * base + c * lora * adapter.scaling).to(result.dtype)


def _norm_of(layer: Any, full: Tensor) -> Tensor:
    """The per-output norm of a full weight in ``layer``'s layout, shaped like the magnitude."""
    if isinstance(layer.layout, PlainLayout):
        norm = torch.linalg.vector_norm(full.flatten(1), dim=1)  # (out,)
        return norm if full.dim() == 2 else norm.view(1, -1, *([1] * (full.dim() - 2)))
    return torch.linalg.vector_norm(full, dim=0)  # Conv1D (in, out), embedding (num, dim): per column


def _factor_view(layer: Any, factor: Tensor) -> Tensor:
    """``factor`` (shaped like the magnitude) broadcastable against the stored weight."""
    flat = factor.reshape(-1)
    if isinstance(layer.layout, PlainLayout):
        return flat.view(-1, *([1] * (layer.weight.dim() - 1)))
    return flat.view(1, -1)


def _directed(layer: Any, adapter: Any) -> Tensor:
    """``W + s B A`` in the weight's layout, in the merge dtype."""
    return layer.weight.to(layer._merge_dtype()) + layer.delta_weight_of(adapter)


def weight_norm(layer: Any, adapter: Any) -> Tensor:
    """``||W + s B A||`` per output feature, detached, shaped like the magnitude, in the adapter's dtype."""
    with torch.no_grad():
        return _norm_of(layer, _directed(layer, adapter)).to(adapter.factor_a.dtype)


LORA, LINEAR_DORA, EMBEDDING_DORA, CONV_DORA = Variant(), LinearDora(), EmbeddingDora(), ConvDora()
_VARIANTS: dict[str, Variant] = {
    type(v).__qualname__: v for v in (LORA, LINEAR_DORA, EMBEDDING_DORA, CONV_DORA)
}


def _variant_by_type(qualname: str) -> Variant:
    return _VARIANTS[qualname]


def variant_for(layer: Any, use_dora: bool) -> Variant:
    """The variant an adapter of ``layer`` gets for ``use_dora``, checked against the layer.

    Raises:
        LoraConversionError: ``use_dora`` on a layer type without DoRA, a non-floating (quantized) weight, or
            a grouped convolution (the message names the type).
    """
    if not use_dora:
        return LORA
    variant: Variant | None = type(layer).dora_variant
    if variant is None:
        raise LoraConversionError(
            f"use_dora=True on {type(layer).__qualname__}: this LoRA class does not implement DoRA (loragen does "
            "for Linear, transformers Conv1D, Embedding, Conv1d, Conv2d and Conv3d); set use_dora=False"
        )
    variant.check(layer)
    return variant
