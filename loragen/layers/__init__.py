"""LoRA layers: Linear, Embedding, Conv1d, Conv2d, Conv3d and transformers' Conv1D.

Each subclasses the torch layer it replaces (``weight`` / ``bias`` keep their keys; the constructor is
the torch one plus LoRA keywords: ``nn.Linear(i, o)`` -> ``LoraLinear(i, o, r=8)``) and holds its first
adapter's factors as plain parameters, as loralib does:

    Linear, Conv1D   lora_A (r, in_features)          lora_B (out_features, r)
    Embedding        lora_embedding_A (r, num_emb)    lora_embedding_B (embedding_dim, r)
    ConvNd           lora_A (r, in_ch // groups, *k)  lora_B (out_ch, r, 1, ...)

    y = base(x) + scaling * B(A(dropout(x)))      scaling = lora_alpha / r  (/ sqrt(r) with rsLoRA)
"""

from __future__ import annotations

from typing import Any

from loragen.config import InitMode
from loragen.errors import LoraMergeError
from loragen.layers.adapter_set import LoraAdapter, adapter_dtype_for
from loragen.layers.base import LoraLayer
from loragen.layers.conv import LoraConv1d, LoraConv2d, LoraConv3d
from loragen.layers.embedding import LoraEmbedding
from loragen.layers.linear import LoraLinear, LoraLinearMixin
from loragen.layers.registration import lora_class_for, register_builtin_types, register_layer

__all__ = [
    "InitMode",
    "LoraAdapter",
    "LoraLayer",
    "LoraLinear",
    "LoraLinearMixin",
    "LoraEmbedding",
    "LoraConv1d",
    "LoraConv2d",
    "LoraConv3d",
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
