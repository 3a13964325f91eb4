"""The forward of a LoRA layer off its single-adapter path (see :mod:`loragen.layers.adapter_set`).

A layer's usual forward (the fused op, sibling fusion) computes its first adapter. It comes here instead
when ``layer._lora_detour`` is set:

* a mixed batch is under way (:func:`loragen.mixed_batch`) and adapters are not off: each row gets its
  own adapter (:func:`loragen.layers.mixed_batch.forward`);
* adapters are off (``active_adapter`` is None), the active adapter is one the layer does not hold, or the
  layer is merged: the base layer's forward alone;
* the active adapter is a further one: the base output plus that adapter's term -- for a layer whose base
  computes ``x W^T + b`` through the same fused op (:func:`loragen.ops.lora_linear`) as the first adapter;
  a DoRA adapter through :func:`loragen.ops.dora_linear` (or the layer's DoRA composition).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from loragen.layers import mixed_batch
from loragen.layers.adapter_set import adapter_factors, has_adapter
from loragen.layers.dora import MAGNITUDE
from loragen.ops import dora_linear, dora_linear_reference, lora_linear, lora_linear_reference
from loragen.registry import TRANSPOSED

__all__ = ["forward"]


def forward(layer: Any, x: Tensor) -> Tensor:
    """``layer``'s output for ``x`` with the routing its adapter state asks for (see the module docstring)."""
    name = layer.active_adapter
    route = layer.__dict__.get("_mixed_route")
    if route is not None and name is not None:  # adapters off (disable_adapter) win, as in peft
        return mixed_batch.forward(layer, x, route)
    if layer.merged or name is None or not has_adapter(layer, name):
        return layer._base_output(x)  # type: ignore[no-any-return, unused-ignore]
    factors = adapter_factors(layer, name)
    if factors.use_dora:  # DoRA (loragen.layers.dora): the fused DoRA op, or the layer's DoRA composition
        if getattr(layer, "fused_base", False):
            dora = dora_linear if layer.fused else dora_linear_reference
            return dora(
                x,
                layer.weight,
                layer.bias,
                factors.factor_a,
                factors.factor_b,
                getattr(factors, MAGNITUDE),
                factors.scaling,
                factors.lora_dropout_p,
                layer.training,
                fan_in_fan_out=layer.layout is TRANSPOSED,
            )
        return layer._dora_output(x, factors, layer._base_output(x))  # type: ignore[no-any-return, unused-ignore]
    if getattr(layer, "fused_base", False):
        fn = lora_linear if layer.fused else lora_linear_reference
        return fn(
            x,
            layer.weight,
            layer.bias,
            factors.factor_a,
            factors.factor_b,
            factors.scaling,
            factors.lora_dropout_p,
            layer.training,
            fan_in_fan_out=layer.layout is TRANSPOSED,
        )
    result: Tensor = layer._base_output(x)
    return (result + layer._lora_term(x, factors)).to(result.dtype)
