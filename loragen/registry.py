"""The one table that maps a torch layer type to its LoRA layer class.

The runtime converter looks types up here; the decorator and the source rewriter match constructor
calls against the qualified names here. Adding a layer type is one LoRA class in :mod:`loragen.layers`
plus one :class:`LayerSpec` below.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from functools import cache

from torch import nn

__all__ = ["LayerSpec", "REGISTRY", "lora_class_for", "spec_for", "supported_type_names", "spec_by_qualname"]


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """One convertible layer type.

    Attributes:
        base_qualname: the public qualified name of the torch layer (``"torch.nn.Linear"``).
        lora_name: the LoRA class's name, importable as ``from loragen import <lora_name>``.
        aliases: other qualified names the same class is reachable under (its defining module, re-exports).
        linear: whether the layer counts as "linear" for ``target_modules="all-linear"``.
    """

    base_qualname: str
    lora_name: str
    aliases: tuple[str, ...] = ()
    linear: bool = False

    @property
    def qualnames(self) -> tuple[str, ...]:
        """Every qualified name that denotes the base layer type."""
        return (self.base_qualname, *self.aliases)

    def base_type(self) -> type[nn.Module] | None:
        """The base class, or None when its package is not installed or not imported yet.

        A package that is not imported cannot have built any module of ours to convert, so looking a
        module up never pays for importing transformers.
        """
        if self.base_qualname.partition(".")[0] not in sys.modules:
            return None
        return _import_qualname(self.base_qualname)

    def lora_type(self) -> type[nn.Module]:
        """The LoRA class."""
        from loragen import layers

        return getattr(layers, self.lora_name)


@cache
def _import_qualname(qualname: str) -> type[nn.Module] | None:
    module_name, _, attr = qualname.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return None
    return getattr(module, attr, None)


REGISTRY: tuple[LayerSpec, ...] = (
    LayerSpec("torch.nn.Linear", "LoraLinear", ("torch.nn.modules.linear.Linear",), linear=True),
    LayerSpec("torch.nn.Embedding", "LoraEmbedding", ("torch.nn.modules.sparse.Embedding",)),
    LayerSpec("torch.nn.Conv1d", "LoraConv1d", ("torch.nn.modules.conv.Conv1d",)),
    LayerSpec("torch.nn.Conv2d", "LoraConv2d", ("torch.nn.modules.conv.Conv2d",)),
    LayerSpec(
        "transformers.pytorch_utils.Conv1D",
        "LoraConv1D",
        ("transformers.modeling_utils.Conv1D", "transformers.Conv1D"),
        linear=True,
    ),
)


def spec_for(module: nn.Module) -> LayerSpec | None:
    """The spec whose base type is exactly ``type(module)``.

    Subclasses are not matched: a subclass may override ``forward`` (or, like the output projection of
    ``nn.MultiheadAttention``, be used through its weight without calling ``forward``), and a LoRA layer
    built from its base class would silently change what the model computes.
    """
    for spec in REGISTRY:
        base = spec.base_type()
        if base is not None and type(module) is base:
            return spec
    return None


def lora_class_for(module: nn.Module) -> type[nn.Module] | None:
    """The LoRA class that replaces ``module``, or None if its type is not supported."""
    spec = spec_for(module)
    return None if spec is None else spec.lora_type()


def spec_by_qualname(qualname: str) -> LayerSpec | None:
    """The spec a qualified name (``"torch.nn.Conv2d"``, ``"transformers.pytorch_utils.Conv1D"``) denotes."""
    for spec in REGISTRY:
        if qualname in spec.qualnames:
            return spec
    return None


def supported_type_names() -> list[str]:
    """The qualified names of all supported base layer types, for error messages."""
    return [spec.base_qualname for spec in REGISTRY]
