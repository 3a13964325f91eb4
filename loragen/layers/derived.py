"""LoRA classes made on demand: for subclasses of a supported type, and for a user's own layer types.

``nn.Linear`` subclasses (Falcon's ``FalconLinear``, bitsandbytes' ``Linear4bit``, ...) and layers a user
registers as "behaves like a Linear" get a LoRA class derived from the LoRA mixin and the base class
itself, so the base's own ``forward`` computes the base output and every attribute of the base stays::

    class LoraFalconLinear(LoraLinear, FalconLinear): ...      # made by lora_class_for(FalconLinear)

Such a class is made once per base class and cached. Its constructor takes the base class's arguments
plus the LoRA keywords (``r``, ``lora_alpha``, ``lora_dropout``, ``use_rslora``, ``init_lora_weights``),
so ``loragen rewrite`` can swap a constructor call the same way it does for ``nn.Linear``. The class is
reachable by name in this module's namespace (``from loragen.layers.derived import LoraFalconLinear``
after :func:`lora_class_for` has run), and its objects pickle and deep-copy by rebuilding the class
from the base class.
"""

from __future__ import annotations

import threading
from typing import Any

from torch import nn

from loragen.errors import LoraConversionError
from loragen.layers.base import LoraLayer
from loragen.registry import refusal_for, spec_for_type, supported_type_names

__all__ = ["lora_class_for", "derive_lora_class"]

_LORA_KEYWORDS = ("r", "lora_alpha", "lora_dropout", "use_rslora", "init_lora_weights", "use_dora")
_lock = threading.Lock()
_derived: dict[tuple[type[LoraLayer], type[nn.Module]], type[LoraLayer]] = {}
_by_name: dict[str, type[LoraLayer]] = {}


def lora_class_for(base_type: type[nn.Module]) -> type[LoraLayer]:
    """The LoRA class that replaces modules of ``base_type``: the registered LoRA class for a
    registered type, a derived class (see the module docstring) for a subclass of one.

    Raises:
        LoraConversionError: ``base_type`` is not registered and not an accepted subclass of a registered
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
    """``class Lora<Base>(lora, base_type)`` with the base's constructor plus the LoRA keywords
    (made once per pair and cached)."""
    key = (lora, base_type)
    with _lock:
        cls = _derived.get(key)
        if cls is None:
            cls = _make_class(lora, base_type)
            _derived[key] = cls
    return cls


def _make_class(lora: type[LoraLayer], base_type: type[nn.Module]) -> type[LoraLayer]:
    def __init__(self: LoraLayer, *args: Any, **kwargs: Any) -> None:
        lora_kwargs = {name: kwargs.pop(name) for name in _LORA_KEYWORDS if name in kwargs}
        base_type.__init__(self, *args, **kwargs)
        self._setup_lora(
            lora_kwargs.get("r", 8),
            lora_kwargs.get("lora_alpha", 8),
            lora_kwargs.get("lora_dropout", 0.0),
            lora_kwargs.get("use_rslora", False),
            lora_kwargs.get("init_lora_weights", True),
            lora_kwargs.get("use_dora", False),
        )

    def __reduce_ex__(self: LoraLayer, protocol: Any) -> tuple[Any, ...]:
        return _rebuild, (lora, base_type), self.__getstate__()

    name = _unique_name(f"Lora{base_type.__name__}")
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


def _unique_name(name: str) -> str:
    candidate, n = name, 2
    while candidate in _by_name:
        candidate, n = f"{name}{n}", n + 1
    return candidate


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
