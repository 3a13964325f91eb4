"""The named adapters of one LoRA layer: ``layer.lora_adapter_records`` maps each name to a
:class:`LoraAdapter` (settings, :class:`~loragen.layers.variants.Variant`, where its parameters live), first
adapter first; :func:`add_factors` and :func:`remove_factors` change it, :func:`combine` makes a weighted
combination (:func:`loragen.add_weighted_adapter`). A single-adapter model keeps the keys a base
checkpoint and peft's adapter expect::

    <path>.lora_A                               the layer's first adapter
    <path>.lora_adapters.<name>.lora_A          every further adapter, in an nn.ModuleDict
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from loragen.config import InitMode, check_flag, check_lora_args
from loragen.errors import AdapterMixError, AdapterNameError, LoraConversionError
from loragen.layers.variants import LORA, Variant, variant_for
from loragen.layouts import Layout

__all__ = [
    "ADAPTERS_ATTR",
    "COMBINATIONS",
    "DEFAULT_ADAPTER",
    "RECORDS_ATTR",
    "Factors",
    "LoraAdapter",
    "adapter_dtype_for",
    "adapter_factors",
    "adapter_names",
    "add_factors",
    "combine",
    "has_adapter",
    "holds_several",
    "key_prefix",
    "lora_scaling",
    "remove_factors",
    "set_active",
]

DEFAULT_ADAPTER = "default"
ADAPTERS_ATTR = "lora_adapters"  # the ModuleDict holding further adapters' parameters
RECORDS_ATTR = "lora_adapter_records"  # name -> LoraAdapter, every adapter of the layer


class Factors(Protocol):
    """What save, load and the model-level functions read of one adapter: a :class:`LoraAdapter`, or a layer
    that is its own single adapter (LoRA on targeted parameters)."""

    r: int
    lora_alpha: float
    scaling: float
    lora_dropout_p: float
    use_rslora: bool

    @property
    def variant(self) -> Variant: ...

    @property
    def factor_a(self) -> nn.Parameter: ...

    @property
    def factor_b(self) -> nn.Parameter: ...

    def lora_parameters(self) -> dict[str, nn.Parameter]: ...

    def peft_key_suffixes(self) -> dict[str, str]: ...


def lora_scaling(r: int, lora_alpha: float, use_rslora: bool) -> float:
    """The factor on an adapter's term: ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with rsLoRA."""
    return lora_alpha / (math.sqrt(r) if use_rslora else r)


@dataclasses.dataclass(eq=False)
class LoraAdapter:
    """One named adapter of a LoRA layer: settings, variant, and where its parameters are registered.

    The parameters are read from :attr:`holder` (the layer, or its entry in ``lora_adapters``) on every
    access, so whatever replaces them there (``.to()``, ``load_state_dict(assign=True)``, FSDP) is used.
    """

    r: int
    lora_alpha: float
    lora_dropout_p: float
    use_rslora: bool
    variant: Variant
    layout: Layout = dataclasses.field(repr=False)
    holder: nn.Module = dataclasses.field(repr=False)
    scaling: float = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.scaling = lora_scaling(self.r, self.lora_alpha, self.use_rslora)

    @property
    def factor_a(self) -> nn.Parameter:
        """A (``lora_A`` / ``lora_embedding_A``)."""
        return getattr(self.holder, self.layout.factor_names[0])

    @property
    def factor_b(self) -> nn.Parameter:
        """B (``lora_B`` / ``lora_embedding_B``)."""
        return getattr(self.holder, self.layout.factor_names[1])

    @property
    def magnitude(self) -> nn.Parameter:
        """DoRA's magnitude vector (only for the DoRA variant)."""
        return getattr(self.holder, self.variant.extra_parameters[0])

    def register(self, name: str, parameter: nn.Parameter) -> None:
        """Register ``parameter`` as this adapter's ``name`` (a factor, or one of the variant's own)."""
        setattr(self.holder, name, parameter)

    def parameter_names(self) -> tuple[str, ...]:
        """The attribute names of this adapter's parameters: the factors, then the variant's own."""
        return (*self.layout.factor_names, *self.variant.extra_parameters)

    def lora_parameters(self) -> dict[str, nn.Parameter]:
        """The parameters by attribute name (``lora_A``, ``lora_B``, the variant's own)."""
        return {name: getattr(self.holder, name) for name in self.parameter_names()}

    def peft_key_suffixes(self) -> dict[str, str]:
        """Attribute name -> peft's key suffix: ``lora_A.weight`` (Linear, Conv), ``lora_embedding_A``
        (Embedding), a variant's own parameter under its name (``lora_magnitude_vector``)."""
        suffixes = dict(zip(self.layout.factor_names, self.layout.peft_suffixes))
        suffixes.update({name: name for name in self.variant.extra_parameters})
        return suffixes

    def requires_grad_(self, requires_grad: bool = True) -> None:
        """Set ``requires_grad`` on every parameter of the adapter."""
        for p in self.lora_parameters().values():
            p.requires_grad_(requires_grad)


def describe(adapter: LoraAdapter) -> str:
    """An adapter's settings in words, for ``extra_repr``."""
    return (
        f"r={adapter.r}, lora_alpha={adapter.lora_alpha:g}, scaling={adapter.scaling:g}, "
        f"lora_dropout={adapter.lora_dropout_p:g}"
        + ("" if adapter.variant is LORA else f", {adapter.variant.name}")
    )


class AdapterParameters(nn.Module):
    """Where a layer's further adapter registers its parameters; its repr shows the adapter's settings."""

    adapter: LoraAdapter

    def extra_repr(self) -> str:
        return describe(self.adapter)


def records(layer: Any) -> dict[str, LoraAdapter]:
    """``layer``'s adapters by name, first first (empty for a layer that is its own single adapter)."""
    found: dict[str, LoraAdapter] = getattr(layer, RECORDS_ATTR, {})
    return found


def adapter_names(layer: Any) -> list[str]:
    """The names of the adapters ``layer`` holds, its first adapter first."""
    return list(records(layer)) or [layer.adapter_name]


def has_adapter(layer: Any, name: str) -> bool:
    """Whether ``layer`` holds an adapter called ``name``."""
    return name in adapter_names(layer)


def adapter_factors(layer: Any, name: str) -> Factors:
    """``layer``'s adapter ``name`` (the layer itself for a layer that is its own single adapter).

    Raises:
        AdapterNameError: the layer holds no adapter ``name`` (the message lists the ones it holds).
    """
    held = records(layer)
    if not held and name == layer.adapter_name:
        return layer
    if name not in held:
        raise AdapterNameError(
            f"{type(layer).__name__} has no adapter {name!r}; it holds {', '.join(map(repr, adapter_names(layer)))}"
        )
    return held[name]


def adapter_dtype_for(base_dtype: torch.dtype) -> torch.dtype:
    """The dtype LoRA factors get for a base weight of ``base_dtype``: float32 for fp16, bf16 and
    non-floating weights (as peft: small updates would lose their bits in half precision), else the same."""
    if base_dtype in (torch.float16, torch.bfloat16) or not base_dtype.is_floating_point:
        return torch.float32
    return base_dtype


def holds_several(layer: Any) -> bool:
    """Whether further adapters can be added to ``layer`` (not to a layer that is its own single adapter)."""
    return hasattr(layer, RECORDS_ATTR)


def key_prefix(layer: Any, name: str) -> str:
    """The state-dict key prefix of adapter ``name`` below ``layer``: ``""`` for the first adapter,
    ``"lora_adapters.<name>."`` for the others."""
    return "" if name == adapter_names(layer)[0] else f"{ADAPTERS_ATTR}.{name}."


def add_factors(
    layer: Any,
    name: str,
    r: int,
    lora_alpha: float,
    lora_dropout: float = 0.0,
    use_rslora: bool = False,
    init_lora_weights: InitMode = True,
    use_dora: bool = False,
) -> LoraAdapter:
    """Give ``layer`` a new, inactive adapter ``name``: factors of rank ``r`` in the layer type's shapes,
    initialised as peft does, on the weight's device, in the dtype of the layer's other adapters (else
    :func:`adapter_dtype_for` the weight's), and the variant's own parameters (DoRA's magnitude).

    Raises:
        AdapterNameError: the layer holds an adapter ``name`` already.
        LoraConfigError: an invalid LoRA argument.
        LoraConversionError: ``use_dora`` where DoRA is not supported, or a layer that holds one adapter
            only (names the type).
    """
    held: dict[str, LoraAdapter] | None = getattr(layer, RECORDS_ATTR, None)
    if held is None:  # set up by LoraLayer._setup_lora (see holds_several)
        raise LoraConversionError(
            f"{type(layer).__qualname__} holds one adapter only (LoRA on targeted parameters): a further named "
            "adapter cannot be added to it; leave it out of the new adapter's targets"
        )
    if name in held:
        raise AdapterNameError(f"{type(layer).__name__} holds an adapter {name!r} already")
    check_lora_args(r, lora_alpha, lora_dropout, use_rslora, init_lora_weights)
    check_flag(use_dora, "use_dora")
    variant = variant_for(layer, use_dora)
    first = not held
    existing = next(iter(held.values()), None)
    layout = layer.layout
    adapter = LoraAdapter(r, lora_alpha, float(lora_dropout), bool(use_rslora), variant, layout, layer)
    held[name] = adapter
    try:
        a_shape, b_shape = layer._factor_shapes()  # at the layer's (first adapter's) rank
        weight = layer.weight
        dtype = existing.factor_a.dtype if existing is not None else adapter_dtype_for(weight.dtype)
        a = torch.empty((r, *a_shape[1:]), device=weight.device, dtype=dtype)
        b = torch.empty((b_shape[0], r, *b_shape[2:]), device=weight.device, dtype=dtype)
        if weight.device.type != "meta":
            layout.init_factors(a, b, r, init_lora_weights)
        if not first:  # further adapters register on a module of their own
            adapter.holder = AdapterParameters()
            adapter.holder.adapter = adapter
        for attr, factor in zip(layout.factor_names, (a, b)):
            adapter.register(attr, nn.Parameter(factor))
        variant.init(layer, adapter)
    except BaseException:
        del held[name]
        raise
    if not first:
        further = layer._modules.get(ADAPTERS_ATTR)
        if not isinstance(further, nn.ModuleDict):
            further = nn.ModuleDict()
            layer.add_module(ADAPTERS_ATTR, further)
        further[name] = adapter.holder
    return adapter


def remove_factors(layer: Any, name: str) -> bool:
    """Remove ``layer``'s adapter ``name``; returns whether the layer still holds an adapter. Removing the
    first adapter registers the next one's parameters (the same objects) on the layer itself.

    Raises:
        AdapterNameError: the layer holds no adapter ``name``.
    """
    adapter_factors(layer, name)  # raises, naming the adapters the layer holds
    held = records(layer)
    if len(held) <= 1:
        return False
    names = list(held)
    further: nn.ModuleDict = layer._modules[ADAPTERS_ATTR]
    removed = held.pop(name)
    if name == names[0]:
        for attr in removed.parameter_names():
            layer._parameters.pop(attr, None)
        successor = held[names[1]]
        params = successor.lora_parameters()
        del further[names[1]]
        successor.holder = layer
        for attr, param in params.items():
            successor.register(attr, param)
        setattr(layer, RECORDS_ATTR, held)  # the successor is now first in order, as it was
    else:
        del further[name]
    if not len(further):
        del layer._modules[ADAPTERS_ATTR]
    return True


def set_active(layer: Any, name: str | None) -> None:
    """Make ``name`` the adapter ``layer``'s forward adds (``None``: none, the base layer alone)."""
    layer.active_adapter = name


COMBINATIONS = ("cat", "linear", "svd")


def combine(
    parts: Sequence[tuple[str, Factors, float]],
    combination_type: str,
    new_rank: int,
    *,
    path: str = "",
    svd_clamp: float | None = None,
    svd_full_matrices: bool = True,
    svd_driver: str | None = None,
) -> tuple[Tensor, Tensor]:
    """``(A, B)`` of rank ``new_rank`` combining ``parts`` (``(name, factors, weight)``) of one layer as peft's
    ``add_weighted_adapter`` does; with scaling ``s_i`` and weight ``w_i`` the new adapter has scaling 1 and:

    ``cat``     ``A = [w_1 s_1 A_1; ...]``, ``B = [B_1 ...]``: exactly ``sum_i w_i s_i B_i A_i``
    ``linear``  ``A = sum_i sign(c_i) sqrt|c_i| A_i``, ``B = sum_i sqrt|c_i| B_i``, ``c_i = w_i s_i``
                (one rank for all; cross terms ``B_i A_j`` make it an approximation)
    ``svd``     the best rank-``new_rank`` approximation of ``sum_i w_i s_i B_i A_i`` (flattened to
                ``(out, in * kernel)``); ``svd_clamp`` clamps to that quantile, as peft does

    Raises:
        AdapterMixError: ``linear`` with factors of different shapes (names ``path``, adapters, ranks).
    """
    first = parts[0][1]
    a0, b0 = first.factor_a, first.factor_b
    new_a = a0.new_zeros((new_rank, *a0.shape[1:]))
    new_b = b0.new_zeros((b0.shape[0], new_rank, *b0.shape[2:]))
    with torch.no_grad():
        if combination_type == "cat":
            a = torch.cat([f.factor_a * w * f.scaling for _, f, w in parts])
            b = torch.cat([f.factor_b for _, f, w in parts], dim=1)
            new_a[: a.shape[0]] = a
            new_b[:, : b.shape[1]] = b
            return new_a, new_b
        if combination_type == "linear":
            shapes = {name: tuple(f.factor_a.shape) for name, f, _ in parts}
            if len(set(shapes.values())) > 1:
                ranks = ", ".join(f"{name!r} r={shape[0]}" for name, shape in shapes.items())
                raise AdapterMixError(
                    f"{path}: combination_type='linear' needs adapters of one rank, here {ranks}; "
                    "use 'cat' or 'svd'"
                )
            coeffs = [w * f.scaling for _, f, w in parts]
            weights_a = torch.tensor([math.copysign(math.sqrt(abs(c)), c) for c in coeffs])
            weights_b = torch.tensor([math.sqrt(abs(c)) for c in coeffs])
            a = _weighted_sum([f.factor_a for _, f, _ in parts], weights_a)
            b = _weighted_sum([f.factor_b for _, f, _ in parts], weights_b)
            return a.to(a0.dtype), b.to(b0.dtype)
        # svd
        delta = _weighted_sum(
            [f.factor_b.flatten(1) @ f.factor_a.flatten(1) * f.scaling for _, f, _ in parts],
            torch.tensor([w for _, _, w in parts]),
        )  # (out, in * kernel)
        u, s, vh = torch.linalg.svd(delta, full_matrices=svd_full_matrices, driver=svd_driver)
        u = u[:, :new_rank] @ torch.diag(s[:new_rank])
        vh = vh[:new_rank, :]
        if svd_clamp is not None:
            high = torch.quantile(torch.cat([u.flatten(), vh.flatten()]), svd_clamp)
            u, vh = u.clamp(-high, high), vh.clamp(-high, high)
        kept = u.shape[1]  # below new_rank when the delta has fewer rows or columns
        new_b.flatten(1)[:, :kept] = u.to(new_b.dtype)
        new_a[:kept] = vh.view(kept, *a0.shape[1:]).to(new_a.dtype)
        return new_a, new_b


def _weighted_sum(tensors: list[Tensor], weights: Tensor) -> Tensor:
    """``sum_i weights[i] * tensors[i]``."""
    stacked = torch.stack(tensors)
    weights = weights.to(stacked.device, stacked.dtype).view(-1, *([1] * (stacked.dim() - 1)))
    return (stacked * weights).sum(dim=0)
