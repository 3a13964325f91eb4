"""Several named adapters on one LoRA layer: where each adapter's factors live, which one runs.

Storage
-------
A LoRA layer holds **its first adapter in its own attributes**, exactly as a single-adapter layer always
has: the factors ``lora_A`` / ``lora_B`` (``lora_embedding_A`` / ``lora_embedding_B``) and the settings
``r``, ``lora_alpha``, ``scaling``, ``lora_dropout_p``, ``use_rslora``. ``layer.adapter_name`` names that
adapter (``"default"`` unless told otherwise), so a single-adapter model keeps its state-dict keys::

    <path>.lora_A                               the layer's first adapter ("default")
    <path>.lora_adapters.<name>.lora_A          every further adapter: an AdapterFactors module

Every further adapter is an :class:`AdapterFactors` module in ``layer.lora_adapters`` (an
``nn.ModuleDict`` made when the second adapter arrives) with the same attribute names as the layer
itself, so code that reads an adapter's factors and settings takes either the layer or one of its
``AdapterFactors`` (:func:`adapter_factors`). A per-adapter extra parameter (DoRA's
``lora_magnitude_vector``) is registered the same way on both: ``<path>.lora_magnitude_vector`` for the
first adapter, ``<path>.lora_adapters.<name>.lora_magnitude_vector`` for the others.

Deleting a layer's first adapter moves the next one (in insertion order) into the layer's own attributes
(every parameter of its ``AdapterFactors`` and the :data:`SETTINGS`; the same parameter objects: optimizer state stays valid, only their state-dict keys change); deleting a
layer's last adapter is the caller's business (:func:`loragen.delete_adapter` turns the layer back into
its base layer).

Routing
-------
``layer.active_adapter`` names the adapter the forward adds (``None``: adapters disabled; a name the layer
does not hold: the base output alone, as peft does for layers an adapter does not target). While the
active adapter is the layer's first one and no mixed batch is under way, the layer runs its usual forward
(the fused op, sibling fusion). Otherwise ``layer._lora_detour`` is set and the forward goes through
:mod:`loragen.layers.adapter_routing`.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from loragen.errors import AdapterNameError
from loragen.layers import dora
from loragen.registry import EMBEDDING, Layout
from loragen.validation import InitMode, check_flag, check_lora_args

__all__ = [
    "ADAPTERS_ATTR",
    "DEFAULT_ADAPTER",
    "EXTRA_PARAMETERS",
    "SETTINGS",
    "AdapterFactors",
    "Factors",
    "adapter_names",
    "adapter_factors",
    "has_adapter",
    "add_factors",
    "remove_factors",
    "set_active",
    "update_route",
]

DEFAULT_ADAPTER = "default"
ADAPTERS_ATTR = "lora_adapters"  # the ModuleDict of a layer's further adapters
# Per-adapter parameters besides the two factors (a variant's, such as DoRA's magnitude): a layer's first
# adapter holds them as its own parameters, a further adapter on its AdapterFactors, under these names.
EXTRA_PARAMETERS: tuple[str, ...] = (dora.MAGNITUDE,)
# Per-adapter settings, on the layer (first adapter) and on each AdapterFactors alike.
SETTINGS: tuple[str, ...] = ("r", "lora_alpha", "scaling", "lora_dropout_p", "use_rslora", "use_dora")


class Factors(Protocol):
    """One adapter's factors and settings: a LoRA layer (its first adapter) or an :class:`AdapterFactors`."""

    r: int
    lora_alpha: float
    scaling: float
    lora_dropout_p: float
    use_rslora: bool
    use_dora: bool

    @property
    def factor_a(self) -> nn.Parameter: ...

    @property
    def factor_b(self) -> nn.Parameter: ...

    def lora_parameters(self) -> dict[str, nn.Parameter]: ...

    def peft_key_suffixes(self) -> dict[str, str]: ...


class AdapterFactors(nn.Module):
    """A further named adapter of one LoRA layer: its two factors under the layer's factor names, and its
    settings under the layer's attribute names (``r``, ``lora_alpha``, ``scaling``, ``lora_dropout_p``,
    ``use_rslora``). Shapes are the layer's factor shapes at rank ``r``."""

    def __init__(
        self,
        layout: Layout,
        a: Tensor,
        b: Tensor,
        *,
        r: int,
        lora_alpha: float,
        lora_dropout: float,
        use_rslora: bool,
        use_dora: bool = False,
    ) -> None:
        super().__init__()
        self.layout = layout
        self.use_dora = use_dora  # with DoRA, loragen.layers.dora.init_magnitude adds lora_magnitude_vector
        self.r = r
        self.lora_alpha = lora_alpha
        self.use_rslora = bool(use_rslora)
        self.scaling = lora_alpha / (math.sqrt(r) if use_rslora else r)
        self.lora_dropout_p = float(lora_dropout)
        first, second = layout.factor_names
        setattr(self, first, nn.Parameter(a))
        setattr(self, second, nn.Parameter(b))

    @property
    def factor_a(self) -> nn.Parameter:
        """The first factor (``lora_A`` / ``lora_embedding_A``)."""
        return getattr(self, self.layout.factor_names[0])

    @property
    def factor_b(self) -> nn.Parameter:
        """The second factor (``lora_B`` / ``lora_embedding_B``)."""
        return getattr(self, self.layout.factor_names[1])

    def lora_parameters(self) -> dict[str, nn.Parameter]:
        """The factors by attribute name (and DoRA's magnitude), as :meth:`loragen.LoraLayer.lora_parameters`."""
        names = (*self.layout.factor_names, dora.MAGNITUDE) if self.use_dora else self.layout.factor_names
        return {name: getattr(self, name) for name in names}

    def peft_key_suffixes(self) -> dict[str, str]:
        """Attribute name -> peft's key suffix, as :meth:`loragen.LoraLayer.peft_key_suffixes`."""
        suffixes = dict(zip(self.layout.factor_names, self.layout.peft_suffixes))
        if self.use_dora:
            suffixes[dora.MAGNITUDE] = dora.MAGNITUDE
        return suffixes

    def extra_repr(self) -> str:
        return f"r={self.r}, lora_alpha={self.lora_alpha:g}, scaling={self.scaling:g}, lora_dropout={self.lora_dropout_p:g}"


def _further(layer: Any) -> nn.ModuleDict | None:
    found = layer._modules.get(ADAPTERS_ATTR)
    return found if isinstance(found, nn.ModuleDict) else None


def adapter_names(layer: Any) -> list[str]:
    """The names of the adapters ``layer`` holds, its first adapter first."""
    further = _further(layer)
    return [layer.adapter_name, *(further.keys() if further is not None else ())]


def has_adapter(layer: Any, name: str) -> bool:
    """Whether ``layer`` holds an adapter called ``name``."""
    further = _further(layer)
    return name == layer.adapter_name or (further is not None and name in further)


def adapter_factors(layer: Any, name: str) -> Factors:
    """The factors and settings of ``layer``'s adapter ``name``: the layer itself for its first adapter.

    Raises:
        AdapterNameError: the layer holds no adapter ``name`` (the message lists the ones it holds).
    """
    if name == layer.adapter_name:
        return layer  # type: ignore[no-any-return, unused-ignore]
    further = _further(layer)
    if further is None or name not in further:
        raise AdapterNameError(
            f"{type(layer).__name__} has no adapter {name!r}; it holds {', '.join(map(repr, adapter_names(layer)))}"
        )
    return further[name]  # type: ignore[return-value]


def _init_factors(layout: Layout, a: Tensor, b: Tensor, r: int, init: InitMode) -> None:
    """peft's init, as :meth:`loragen.LoraLayer.reset_lora_parameters` (and the Embedding's) do it."""
    with torch.no_grad():
        if layout is EMBEDDING:
            (nn.init.normal_ if init is False else nn.init.zeros_)(a)
            nn.init.normal_(b)
            return
        if init == "gaussian":
            nn.init.normal_(a, std=1.0 / r)
        else:
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))
        if init is False:
            nn.init.kaiming_uniform_(b, a=math.sqrt(5))
        else:
            nn.init.zeros_(b)


def add_factors(
    layer: Any,
    name: str,
    *,
    r: int,
    lora_alpha: float,
    lora_dropout: float = 0.0,
    use_rslora: bool = False,
    init_lora_weights: InitMode = True,
    use_dora: bool = False,
) -> AdapterFactors:
    """Give ``layer`` a further adapter ``name`` (factors shaped like its first adapter's at rank ``r``,
    initialised as peft does, on the first factor's device and dtype; with ``use_dora`` also DoRA's
    magnitude, the norm of ``W + s B A``). It is not made active.

    Raises:
        AdapterNameError: the layer holds an adapter ``name`` already.
        LoraConfigError: an invalid LoRA argument.
        LoraConversionError: ``use_dora`` on a layer where DoRA is not supported (names the type).
    """
    if has_adapter(layer, name):
        raise AdapterNameError(f"{type(layer).__name__} holds an adapter {name!r} already")
    check_lora_args(r, lora_alpha, lora_dropout, use_rslora, init_lora_weights)
    check_flag(use_dora, "use_dora")
    if use_dora:
        dora.check_dora_supported(layer, type(layer).supports_dora)
    first_a, first_b = layer.factor_a, layer.factor_b
    a = first_a.new_empty((r, *first_a.shape[1:]))
    b = first_b.new_empty((first_b.shape[0], r, *first_b.shape[2:]))
    layout = layer.layout
    if a.device.type != "meta":
        _init_factors(layout, a, b, r, init_lora_weights)
    factors = AdapterFactors(
        layout,
        a,
        b,
        r=r,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        use_rslora=use_rslora,
        use_dora=use_dora,
    )
    if use_dora:
        dora.init_magnitude(layer, factors)
    further = _further(layer)
    if further is None:
        further = nn.ModuleDict()
        layer.add_module(ADAPTERS_ATTR, further)
    further[name] = factors
    update_route(layer)
    return factors


def remove_factors(layer: Any, name: str) -> bool:
    """Remove ``layer``'s adapter ``name``; returns whether the layer still holds an adapter.

    Removing the first adapter moves the next further one into the layer's own attributes (the same
    parameter objects). The layer's active adapter is left as it is (see :func:`set_active`).

    Raises:
        AdapterNameError: the layer holds no adapter ``name``.
    """
    further = _further(layer)
    if name != layer.adapter_name:
        if further is None or name not in further:
            adapter_factors(layer, name)  # raises, naming the adapters the layer holds
            return True
        del further[name]
    elif further is None or not len(further):
        return False
    else:
        successor_name = next(iter(further.keys()))
        successor: AdapterFactors = further[successor_name]  # type: ignore[assignment]
        del further[successor_name]
        for attr in EXTRA_PARAMETERS:
            layer._parameters.pop(attr, None)
        for attr, param in successor._parameters.items():  # the factors and any extra parameter
            layer._parameters[attr] = param
        for attr in SETTINGS:
            if hasattr(successor, attr):
                setattr(layer, attr, getattr(successor, attr))
        layer.adapter_name = successor_name
    if further is not None and not len(further):
        del layer._modules[ADAPTERS_ATTR]
    update_route(layer)
    return True


def set_active(layer: Any, name: str | None) -> None:
    """Make ``name`` the adapter ``layer``'s forward adds (``None``: none, the base layer alone)."""
    layer.active_adapter = name
    update_route(layer)


def update_route(layer: Any) -> None:
    """Set ``layer._lora_detour``: whether its forward leaves the single-adapter path."""
    detour = layer.active_adapter != layer.adapter_name or layer.__dict__.get("_mixed_route") is not None
    if detour:
        layer._lora_detour = True
    else:
        layer.__dict__.pop("_lora_detour", None)  # the class default, False
