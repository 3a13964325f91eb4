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

Merging adds ``scaling * B @ A`` to the base weight in its own layout, computed in float32 and rounded
once. For convolutions the LoRA branch runs with *all* of the base layer's settings (stride, padding
including ``'same'``, dilation, padding mode, groups), so merged and unmerged outputs agree for every
configuration; with ``groups > 1`` the branch convolves with the composed ``B @ A`` weight, which is
exactly what merging adds.
"""

from __future__ import annotations

from typing import Any

from loragen.layers.adapter_set import LoraAdapter
from loragen.layers.base import InitMode, LoraLayer, LoraMergeError, adapter_dtype_for
from loragen.layers.conv import LoraConv1d, LoraConv2d
from loragen.layers.derived import lora_class_for
from loragen.layers.embedding import LoraEmbedding
from loragen.layers.linear import LoraLinear, LoraLinearMixin
from loragen.layers.registration import register_builtin_types, register_layer

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
        from loragen.layers.hf_conv1d import build_lora_conv1d

        cls = build_lora_conv1d()
        globals()[name] = cls  # built once; later lookups are plain module attributes
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
