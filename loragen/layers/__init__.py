"""LoRA layers: Linear, Embedding, Conv1d, Conv2d and transformers' Conv1D.

Each LoRA layer *subclasses* the torch layer it replaces, so it keeps the base ``weight`` / ``bias``
parameters under their usual state-dict keys (a base checkpoint loads into a converted model unchanged)
and its constructor is a superset of the torch one: ``nn.Linear(i, o)`` -> ``LoraLinear(i, o, r=8)``.
A single-adapter layer's LoRA factors are plain parameters on the layer (as in loralib; further named
adapters: :mod:`loragen.layers.adapter_set`):

    Linear, Conv1D   lora_A (r, in_features)          lora_B (out_features, r)
    Embedding        lora_embedding_A (r, num_emb)    lora_embedding_B (embedding_dim, r)
    ConvNd           lora_A (r, in_ch // groups, *k)  lora_B (out_ch, r, 1, ...)

    y = base(x) + scaling * B(A(dropout(x)))      scaling = lora_alpha / r  (/ sqrt(r) with rsLoRA)

=================== ====================================================================================
module               concern
=================== ====================================================================================
base                 :class:`LoraLayer`: the contract, the forward, merging (and its guard), from/to base
adapter_set          the named adapters of a layer (:class:`LoraAdapter`) and their weighted combinations
variants             plain LoRA and DoRA, the strategies an adapter holds
linear               ``LoraLinear``, Linear-like layers, transformers' ``Conv1D``: the fused op
conv, embedding      ``LoraConv1d`` / ``LoraConv2d`` (every conv setting), ``LoraEmbedding``
bnb                  bitsandbytes' 4-bit and 8-bit linears (QLoRA)
expert_parameters    LoRA on targeted parameters (MoE expert stacks)
mixed_batch          one batch, one adapter per row
registration         which LoRA class a layer type gets: ``register_layer``, classes for subclasses
=================== ====================================================================================
"""

from __future__ import annotations

from typing import Any

from loragen.errors import LoraMergeError
from loragen.layers.adapter_set import LoraAdapter, adapter_dtype_for
from loragen.layers.base import LoraLayer
from loragen.layers.conv import LoraConv1d, LoraConv2d
from loragen.layers.embedding import LoraEmbedding
from loragen.layers.linear import LoraLinear, LoraLinearMixin
from loragen.layers.registration import lora_class_for, register_builtin_types, register_layer
from loragen.validation import InitMode

__all__ = [
    "InitMode",
    "LoraAdapter",
    "LoraLayer",
    "LoraLinear",
    "LoraLinearMixin",
    "LoraEmbedding",
    "LoraConv1d",
    "LoraConv2d",
    "LoraConv1D",
    "LoraMergeError",
    "adapter_dtype_for",
    "lora_class_for",
    "register_layer",
]

register_builtin_types()


def __getattr__(name: str) -> Any:
    if name == "LoraConv1D":  # built on first use: it imports transformers
        from loragen.layers.linear import build_lora_conv1d

        cls = build_lora_conv1d()
        globals()[name] = cls  # built once; later lookups are plain module attributes
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
