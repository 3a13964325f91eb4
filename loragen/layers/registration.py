"""Every layer type loragen converts is registered here: its own types (:func:`register_builtin_types`, run
when :mod:`loragen.layers` is imported) and a user's (:func:`register_layer`).

``register_layer``: teach loragen a layer type of your own.

After registration the type works in all three ways in (``get_lora_model``, ``@lora_convert``,
``loragen rewrite``), in ``save_adapter`` / ``load_adapter`` and in ``loragen merge``, like the built-in
types. Two ways to register:

* ``register_layer(MyLinear)``: ``MyLinear`` behaves like a Linear — it has a ``weight`` stored
  ``(out_features, in_features)`` (``layout="transposed"``: ``(in, out)``) and an optional ``bias``. Its
  own ``forward`` computes the base output; loragen adds ``scaling * B A dropout(x)`` to it, merges by
  adding ``scaling * B @ A`` to ``weight`` (after checking on a probe that ``forward`` is ``x W^T + b``),
  and saves peft's ``lora_A`` / ``lora_B`` keys.
* ``register_layer(MyLayer, MyLoraLayer)``: your own LoRA class, a subclass of both
  :class:`loragen.LoraLayer` and ``MyLayer`` that provides what :class:`loragen.LoraLayer` lists as
  abstract (``_factor_shapes`` and ``_adapter_output``; see :mod:`loragen.layers.base`); ``layout`` says
  how its factors are named, initialised, saved and merged. It gets several named adapters, disabling,
  merging and mixed batches from :class:`loragen.LoraLayer`.

Example::

    class ScaledLinear(nn.Module):
        def __init__(self, d_in, d_out):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(d_out, d_in))
            self.bias = None
        def forward(self, x):
            return x @ self.weight.t()

    loragen.register_layer(ScaledLinear)
    model = loragen.get_lora_model(model, LoraConfig(target_modules=["proj"]))
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from loragen.layers.base import LoraLayer
from loragen.layers.conv import LoraConv1d, LoraConv2d
from loragen.layers.derived import derive_lora_class
from loragen.layers.embedding import LoraEmbedding
from loragen.layers.linear import LoraLinear, LoraLinearMixin
from loragen.registry import (
    EMBEDDING,
    LAYOUTS,
    PLAIN,
    TRANSPOSED,
    EmbeddingLayout,
    LayerSpec,
    Layout,
    register,
)

__all__ = ["register_builtin_types", "register_layer"]


def register_builtin_types() -> None:
    """Register loragen's own layer types (idempotent). transformers' ``Conv1D`` and bitsandbytes' quantized
    linears are registered by name: their LoRA classes are imported (with transformers, bitsandbytes) only
    when a model holds such a layer (bitsandbytes is the optional extra ``loragen[bnb]``)."""
    builtin = [  # in the order error messages list the supported types
        LayerSpec(
            "torch.nn.Conv1d",
            "loragen.layers.LoraConv1d",
            ("torch.nn.modules.conv.Conv1d",),
            PLAIN,
            lora_class=LoraConv1d,
        ),
        LayerSpec(
            "torch.nn.Conv2d",
            "loragen.layers.LoraConv2d",
            ("torch.nn.modules.conv.Conv2d",),
            PLAIN,
            lora_class=LoraConv2d,
        ),
        LayerSpec(
            "torch.nn.Embedding",
            "loragen.layers.LoraEmbedding",
            ("torch.nn.modules.sparse.Embedding",),
            EMBEDDING,
            lora_class=LoraEmbedding,
        ),
        LayerSpec(
            "torch.nn.Linear",
            "loragen.layers.LoraLinear",
            ("torch.nn.modules.linear.Linear",),
            PLAIN,
            linear=True,
            subclasses=True,
            lora_class=LoraLinear,
        ),
        LayerSpec(
            "transformers.pytorch_utils.Conv1D",
            "loragen.layers.LoraConv1D",
            ("transformers.modeling_utils.Conv1D", "transformers.Conv1D"),
            TRANSPOSED,
            linear=True,
        ),
        *(
            LayerSpec(
                f"bitsandbytes.nn.{name}",
                f"loragen.layers.bnb.Lora{name}",
                (f"bitsandbytes.nn.modules.{name}",),
                linear=True,
                subclasses=True,
            )
            for name in ("Linear4bit", "Linear8bitLt")
        ),
    ]
    for spec in builtin:
        register(spec)


def register_layer(
    base_type: type[nn.Module],
    lora_class: type[LoraLayer] | None = None,
    *,
    layout: str | Layout = "plain",
    linear: bool = True,
    subclasses: bool = False,
    aliases: Sequence[str] = (),
    replace: bool = False,
) -> LayerSpec:
    """Register ``base_type`` so loragen converts it (see the module docstring) and return its spec.

    Args:
        base_type: the layer class to convert.
        lora_class: your LoRA class for it; None means "behaves like a Linear" (loragen makes the class).
        layout: ``"plain"`` (weight ``(out, in, ...)``), ``"transposed"`` (weight ``(in, out)``) or
            ``"embedding"``, or a :class:`loragen.registry.Layout`.
        linear: whether ``target_modules="all-linear"`` selects it.
        subclasses: whether subclasses of ``base_type`` are converted too.
        aliases: other qualified names ``base_type`` is imported under (for the decorator and the rewriter).
        replace: replace an existing registration of ``base_type``.

    Raises:
        TypeError: ``base_type`` is not an ``nn.Module`` class, or ``lora_class`` does not derive from
            both :class:`loragen.LoraLayer` and ``base_type``, or lacks a method the contract asks for
            (``_factor_shapes``, ``_adapter_output``; the message names it).
        ValueError: an unknown ``layout``, or ``base_type`` is registered already (without ``replace``).
    """
    if not (isinstance(base_type, type) and issubclass(base_type, nn.Module)):
        raise TypeError(f"register_layer: base_type={base_type!r} is not an nn.Module subclass")
    if isinstance(layout, str):
        if layout not in LAYOUTS:
            raise ValueError(
                f"register_layer: layout={layout!r}; expected one of {', '.join(map(repr, LAYOUTS))}"
            )
        layout = LAYOUTS[layout]
    if lora_class is None:
        if isinstance(layout, EmbeddingLayout):
            raise ValueError(
                "register_layer: layout='embedding' needs a LoRA class of your own; "
                "loragen makes LoRA classes only for layers that behave like a Linear"
            )
        lora_class = derive_lora_class(LoraLinearMixin, base_type)
    elif not (
        isinstance(lora_class, type)
        and issubclass(lora_class, LoraLayer)
        and issubclass(lora_class, base_type)
    ):
        raise TypeError(
            f"register_layer: lora_class={lora_class!r} must derive from both loragen.LoraLayer and "
            f"{base_type.__qualname__}"
        )
    elif lora_class.__abstractmethods__:
        raise TypeError(
            f"register_layer: lora_class={lora_class.__qualname__} does not provide "
            f"{', '.join(sorted(lora_class.__abstractmethods__))}, which every LoRA layer type defines "
            "(see loragen.LoraLayer)"
        )
    elif "base_class" not in vars(lora_class):
        lora_class.base_class = base_type
    spec = LayerSpec(
        base_qualname=f"{base_type.__module__}.{base_type.__qualname__}",
        lora_qualname=f"{lora_class.__module__}.{lora_class.__qualname__}",
        aliases=tuple(aliases),
        layout=layout,
        linear=linear,
        subclasses=subclasses,
        lora_class=lora_class,
        base_class=base_type,
    )
    return register(spec, replace=replace)
