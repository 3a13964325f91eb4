"""Adapter variants: what plain LoRA and DoRA each add to a layer, as one strategy object per variant.

Every adapter of a layer holds a :class:`Variant`, chosen once when the adapter is made (from the
config's ``use_dora``, :func:`variant_for`). The layers never ask which variant they hold; they call it:

==================  ====================================================================================
``check``           refuse a layer the variant cannot run on (before anything is made)
``init``            set up the variant's own parameters (DoRA: the magnitude vector, after the factors)
``output``          the layer's output given the base output: plain LoRA adds ``scaling * B A dropout(x)``
``fused_linear``    the same output as one fused op, for a layer whose base is exactly ``x W^T + b``
``fused_branch``    the output as the base output plus the term added in place (quantized bases)
``merge/unmerge``   put the adapter into the weight and take it out again
``extra_parameters``  the variant's own parameters, saved under the same names as peft saves them
==================  ====================================================================================

DoRA's forward depends on the layer family (peft's math per family): :class:`LinearDora` (Linear,
transformers ``Conv1D``, registered Linear-like types), :class:`EmbeddingDora` and :class:`ConvDora`. A layer
type names its DoRA variant in its ``dora_variant`` class attribute; None means it has none.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from loragen.errors import LoraConversionError
from loragen.layers import dora_magnitude
from loragen.layers.parameter_reads import parameter
from loragen.ops import dora_linear, lora_linear
from loragen.ops.branch import lora_branch
from loragen.reference import dora_linear_reference
from loragen.registry import TransposedLayout

__all__ = [
    "LORA",
    "ConvDora",
    "EmbeddingDora",
    "LinearDora",
    "Variant",
    "variant_for",
]


class LoraAdapter(Protocol):
    """What a variant reads of one adapter (a :class:`loragen.layers.adapter_set.LoraAdapter`, which holds
    its variant: this module cannot import it)."""

    scaling: float
    lora_dropout_p: float

    @property
    def factor_a(self) -> nn.Parameter: ...

    @property
    def factor_b(self) -> nn.Parameter: ...

    @property
    def magnitude(self) -> nn.Parameter: ...

    def register(self, name: str, parameter: nn.Parameter) -> None: ...


def _transposed(layer: Any) -> bool:
    return isinstance(layer.layout, TransposedLayout)


class Variant:
    """Plain LoRA: ``y = base(x) + scaling * B A dropout(x)``; merging adds ``scaling * B @ A`` to the weight.

    Subclasses (DoRA) override what differs. Variants hold no state: one object per variant serves
    every layer and adapter.
    """

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
        """Raise if the variant cannot run on ``layer`` (plain LoRA runs on every layer type)."""

    def init(self, layer: Any, adapter: LoraAdapter) -> None:
        """Set up the variant's own parameters of a new ``adapter`` (after its factors are initialised)."""

    def output(self, layer: Any, x: Tensor, adapter: LoraAdapter, result: Tensor) -> Tensor:
        """The layer's output for ``x`` given its base output ``result``: ``result + scaling * B A dropout(x)``,
        the term computed in the adapter's dtype and the sum cast back to ``result``'s dtype."""
        return (result + layer._adapter_output(x, adapter)).to(result.dtype)

    def fused_linear(self, layer: Any, x: Tensor, adapter: LoraAdapter) -> Tensor:
        """The whole output of a layer whose base is exactly ``x W^T + b``, as loragen's fused LoRA op
        (:func:`loragen.ops.lora_linear`: CPU autograd Function or CUDA kernels)."""
        return lora_linear(
            x,
            parameter(layer, "weight"),
            parameter(layer, "bias"),
            adapter.factor_a,
            adapter.factor_b,
            adapter.scaling,
            adapter.lora_dropout_p,
            layer.training,
            fan_in_fan_out=_transposed(layer),
        )

    def fused_branch(self, layer: Any, x: Tensor, adapter: LoraAdapter) -> Tensor | None:
        """The base's own output plus the term added onto it in place (:func:`loragen.ops.branch.lora_branch`,
        hand-written backward); None where the variant has no such op."""
        result: Tensor = layer._base_output(x)
        return lora_branch(
            result,
            x,
            adapter.factor_a,
            adapter.factor_b,
            adapter.scaling,
            adapter.lora_dropout_p,
            layer.training,
        )

    @torch.no_grad()
    def merge(self, layer: Any, adapter: LoraAdapter) -> None:
        """``W += scaling * B @ A`` in float32 (float64 for float64 weights), rounded once."""
        w = layer.weight
        w.copy_((w.to(layer._merge_dtype()) + layer.delta_weight_of(adapter)).to(w.dtype))

    @torch.no_grad()
    def unmerge(self, layer: Any, adapter: LoraAdapter) -> None:
        """``W -= scaling * B @ A`` (the original weight up to rounding)."""
        w = layer.weight
        w.copy_((w.to(layer._merge_dtype()) - layer.delta_weight_of(adapter)).to(w.dtype))

    def __repr__(self) -> str:
        return f"<{type(self).__name__}>"

    def __reduce__(self) -> str | tuple[Any, ...]:
        return (_variant_by_type, (type(self).__qualname__,))  # one object per variant, pickled by name

    def __deepcopy__(self, memo: dict[int, Any]) -> Variant:
        return self


class DoraVariant(Variant):
    """DoRA (weight-decomposed LoRA) as peft computes it: a trained magnitude ``m`` per output feature
    rescales ``W + scaling * B A`` to norm ``m`` (the norm detached); see :mod:`loragen.layers.dora_magnitude`."""

    name = "dora"
    title = "DoRA"
    use_dora = True
    extra_parameters = (dora_magnitude.MAGNITUDE,)
    mixable = False  # peft refuses adapter_names with DoRA too
    combinable = False  # a sum of factors would leave out each adapter's magnitude

    def check(self, layer: Any) -> None:
        dora_magnitude.check_dora_supported(layer)

    def init(self, layer: Any, adapter: LoraAdapter) -> None:
        dora_magnitude.init_magnitude(layer, adapter)  # the norm of W + s B A: the new adapter is a no-op

    def fused_linear(self, layer: Any, x: Tensor, adapter: LoraAdapter) -> Tensor:
        return dora_linear(
            x,
            parameter(layer, "weight"),
            parameter(layer, "bias"),
            adapter.factor_a,
            adapter.factor_b,
            adapter.magnitude,
            adapter.scaling,
            adapter.lora_dropout_p,
            layer.training,
            fan_in_fan_out=_transposed(layer),
        )

    def fused_branch(self, layer: Any, x: Tensor, adapter: LoraAdapter) -> Tensor | None:
        return None

    @torch.no_grad()
    def merge(self, layer: Any, adapter: LoraAdapter) -> None:
        dora_magnitude.dora_merge(layer, adapter)  # W <- (m / ||W + s B A||) * (W + s B A)

    @torch.no_grad()
    def unmerge(self, layer: Any, adapter: LoraAdapter) -> None:
        dora_magnitude.dora_unmerge(layer, adapter)


class LinearDora(DoraVariant):
    """DoRA on a Linear weight: peft's composition on the base output (:func:`loragen.reference.dora_linear_reference`)."""

    def output(self, layer: Any, x: Tensor, adapter: LoraAdapter, result: Tensor) -> Tensor:
        return dora_linear_reference(
            x,
            layer.weight,
            layer.bias,
            adapter.factor_a,
            adapter.factor_b,
            adapter.magnitude,
            adapter.scaling,
            adapter.lora_dropout_p,
            layer.training,
            fan_in_fan_out=_transposed(layer),
            result=result,
        )


class EmbeddingDora(DoraVariant):
    """peft's DoRA for embeddings: ``c * (table row + s * lora row)``, ``c = m / ||W + s (B A)^T||`` per
    embedding column, detached."""

    def output(self, layer: Any, x: Tensor, adapter: LoraAdapter, result: Tensor) -> Tensor:
        c = adapter.magnitude / dora_magnitude.weight_norm(layer, adapter)
        return (c * result + c * layer._adapter_output(x, adapter)).to(result.dtype)


class ConvDora(DoraVariant):
    """peft's DoRA for convolutions: ``result + (c - 1) * base + c * s * lora`` with
    ``c = m / ||W + s B A||`` per output channel (detached), shaped (1, cout, 1, ...); ``base`` is the
    convolution without bias of the input, or of the dropped-out input with dropout."""

    def output(self, layer: Any, x: Tensor, adapter: LoraAdapter, result: Tensor) -> Tensor:
        x_lora = x.to(adapter.factor_a.dtype)
        dropout = adapter.lora_dropout_p > 0 and layer.training
        if dropout:
            x_lora = F.dropout(x_lora, adapter.lora_dropout_p, True)
        lora = layer._unscaled_term(x_lora, adapter)
        c = adapter.magnitude / dora_magnitude.weight_norm(layer, adapter)
        if dropout:
            base = layer._conv_forward(x_lora, layer.weight.to(x_lora.dtype), None)
        elif layer.bias is not None:
            base = result - layer.bias.view(1, -1, *([1] * (result.dim() - 2)))
        else:
            base = result
        return (result + (c - 1) * base + c * lora * adapter.scaling).to(result.dtype)


LORA = Variant()
_VARIANTS: dict[str, Variant] = {
    type(v).__qualname__: v for v in (LORA, LinearDora(), EmbeddingDora(), ConvDora())
}
LINEAR_DORA, EMBEDDING_DORA, CONV_DORA = (
    _VARIANTS["LinearDora"],
    _VARIANTS["EmbeddingDora"],
    _VARIANTS["ConvDora"],
)


def _variant_by_type(qualname: str) -> Variant:
    return _VARIANTS[qualname]


def variant_for(layer: Any, use_dora: bool) -> Variant:
    """The variant an adapter of ``layer`` gets for the config value ``use_dora``, checked against the layer.

    Raises:
        LoraConversionError: ``use_dora`` on a layer type without a DoRA variant, a non-floating (quantized)
            weight, or a grouped convolution (the message names the type).
    """
    if not use_dora:
        return LORA
    variant: Variant | None = type(layer).dora_variant
    if variant is None:
        raise LoraConversionError(
            f"use_dora=True on {type(layer).__qualname__}: this LoRA class does not implement DoRA (loragen does "
            "for Linear, transformers Conv1D, Embedding, Conv1d and Conv2d); set use_dora=False"
        )
    variant.check(layer)
    return variant
