"""Which LoRA class a layer type gets: loragen's own types (:func:`register_builtin_types`), a user's
(:func:`register_layer`), and classes derived on demand.

``register_layer(MyLinear)`` teaches a layer that behaves like a Linear (``weight`` ``(out, in)``, or
``(in, out)`` with ``layout="transposed"``, optional ``bias``); ``register_layer(MyLayer, MyLoraLayer)``
takes your own subclass of :class:`loragen.LoraLayer` and ``MyLayer``. Either then works in every way in,
in save/load and in ``loragen merge``.

Subclasses of a registered type (Falcon's ``FalconLinear``) get ``class LoraFalconLinear(LoraLinear,
FalconLinear)``, made once (:func:`lora_class_for`), with the base's ``forward`` and the base's constructor
plus the LoRA keywords; it is reachable by name in this module and pickles by rebuilding the class.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Sequence
from typing import Any

from torch import nn

from loragen.errors import LoraConversionError
from loragen.layers.base import LoraLayer
from loragen.layers.conv import LoraConv1d, LoraConv2d, LoraConv3d
from loragen.layers.embedding import LoraEmbedding
from loragen.layers.linear import LoraLinear, LoraLinearMixin
from loragen.layouts import EMBEDDING, LAYOUTS, PLAIN, TRANSPOSED, EmbeddingLayout, Layout
from loragen.registry import LayerSpec, refusal_for, register, spec_for_type, supported_type_names

__all__ = ["derive_lora_class", "lora_class_for", "register_builtin_types", "register_layer"]


def register_builtin_types() -> None:
    """Register loragen's own layer types (idempotent); transformers' and bitsandbytes' by name, so they are
    imported only when a model holds such a layer."""
    # (class, its module in torch.nn.modules, LoRA class, layout, all-linear); subclasses of each convert too
    torch_types: list[tuple[str, str, type[nn.Module], Layout, bool]] = [
        ("Conv1d", "conv", LoraConv1d, PLAIN, False),
        ("Conv2d", "conv", LoraConv2d, PLAIN, False),
        ("Conv3d", "conv", LoraConv3d, PLAIN, False),
        ("Embedding", "sparse", LoraEmbedding, EMBEDDING, False),
        ("Linear", "linear", LoraLinear, PLAIN, True),
    ]
    builtin = [  # in the order error messages list the supported types
        *(
            LayerSpec(
                f"torch.nn.{name}",
                f"loragen.layers.{lora.__name__}",
                (f"torch.nn.modules.{module}.{name}",),
                layout,
                linear=linear,
                subclasses=True,
                lora_class=lora,
            )
            for name, module, lora, layout, linear in torch_types
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
        lora_class: your LoRA class for it; None: "behaves like a Linear" (loragen makes the class).
        layout: ``"plain"`` (weight ``(out, in, ...)``), ``"transposed"`` (``(in, out)``), ``"embedding"``,
            or a :class:`loragen.layouts.Layout`.
        linear: whether ``target_modules="all-linear"`` selects it.
        subclasses: whether subclasses of ``base_type`` are converted too.
        aliases: other qualified names ``base_type`` is imported under (for the decorator and the rewriter).
        replace: replace an existing registration of ``base_type``.

    Raises:
        TypeError: ``base_type`` is not an ``nn.Module`` class, or ``lora_class`` does not derive from
            :class:`loragen.LoraLayer` and ``base_type`` or lacks a method of the contract (named).
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


# the LoRA keywords a derived class's constructor takes, with their defaults: from_module's, in its order
_LORA_KEYWORDS: dict[str, Any] = {
    name: p.default
    for name, p in inspect.signature(LoraLayer.from_module).parameters.items()
    if p.kind is p.KEYWORD_ONLY
}
_lock = threading.Lock()
_derived: dict[tuple[type[LoraLayer], type[nn.Module]], type[LoraLayer]] = {}
_by_name: dict[str, type[LoraLayer]] = {}


def lora_class_for(base_type: type[nn.Module]) -> type[LoraLayer]:
    """The LoRA class for modules of ``base_type``: the registered one, or a derived class for a subclass.

    Raises:
        LoraConversionError: ``base_type`` is neither registered nor an accepted subclass of a registered
            type; the message lists the supported types.
    """
    name = f"{base_type.__module__}.{base_type.__qualname__}"
    refusal = refusal_for(base_type)
    if refusal is not None:
        raise LoraConversionError(f"{name} is not converted: {refusal}")
    spec = spec_for_type(base_type)
    if spec is None:
        raise LoraConversionError(
            f"{name} is not a supported layer type; supported: "
            + ", ".join(supported_type_names())
            + ". Teach loragen a type with loragen.register_layer(...)"
        )
    lora = spec.lora_type()
    if not issubclass(lora, LoraLayer):
        raise TypeError(f"{spec.lora_qualname} is not a LoraLayer subclass")
    if base_type is spec.base_type() or issubclass(base_type, LoraLayer):
        return lora
    return derive_lora_class(lora, base_type)


def derive_lora_class(lora: type[LoraLayer], base_type: type[nn.Module]) -> type[LoraLayer]:
    """``class Lora<Base>(lora, base_type)`` with the base's constructor plus the LoRA keywords, made once."""
    with _lock:
        cls = _derived.get((lora, base_type))
        if cls is None:
            cls = _derived[lora, base_type] = _make_class(lora, base_type)
    return cls


def _make_class(lora: type[LoraLayer], base_type: type[nn.Module]) -> type[LoraLayer]:
    def __init__(self: LoraLayer, *args: Any, **kwargs: Any) -> None:
        settings = [kwargs.pop(name, default) for name, default in _LORA_KEYWORDS.items()]
        base_type.__init__(self, *args, **kwargs)
        self._setup_lora(*settings)

    def __reduce_ex__(self: LoraLayer, protocol: Any) -> tuple[Any, ...]:
        return _rebuild, (lora, base_type), self.__getstate__()

    name, n = f"Lora{base_type.__name__}", 2
    while name in _by_name:  # another base class of the same name
        name, n = f"Lora{base_type.__name__}{n}", n + 1
    __init__.__doc__ = (
        f"``{base_type.__qualname__}``'s constructor plus the LoRA keywords {', '.join(_LORA_KEYWORDS)}."
    )
    namespace = {
        "__init__": __init__,
        "__reduce_ex__": __reduce_ex__,
        "__module__": __name__,
        "__qualname__": name,
        "__doc__": f"``{base_type.__module__}.{base_type.__qualname__}`` with a LoRA adapter "
        f"(made by loragen from {lora.__qualname__}).",
        "base_class": base_type,
    }
    cls = type(name, (lora, base_type), namespace)
    _by_name[name] = cls
    return cls


def _rebuild(lora: type[LoraLayer], base_type: type[nn.Module]) -> LoraLayer:
    """An empty object of the derived class (pickle then restores its state)."""
    cls = derive_lora_class(lora, base_type)
    return cls.__new__(cls)


def __getattr__(name: str) -> type[LoraLayer]:
    cls = _by_name.get(name)
    if cls is None:
        raise AttributeError(
            f"module {__name__!r} has no attribute {name!r}: derived LoRA classes exist once "
            "loragen.layers.lora_class_for(<base class>) has made them"
        )
    return cls
