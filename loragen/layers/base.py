"""The part every LoRA layer shares: its LoRA factors, their init, merging and unmerging.

A LoRA class derives from :class:`LoraLayer` and from the base layer class it replaces (``nn.Linear``,
``nn.Embedding``, ...), so a LoRA layer keeps the base layer's ``weight`` / ``bias`` under their usual
state-dict keys. :meth:`LoraLayer.from_module` makes one from an existing module by taking over that
module's state (:mod:`loragen.layers.cloning`), and :meth:`LoraLayer.to_base` gives the base layer back.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize
from typing_extensions import Self

from loragen.errors import LoraMergeError
from loragen.layers import dora
from loragen.layers.adapter_set import ADAPTERS_ATTR, DEFAULT_ADAPTER, Factors, adapter_factors, has_adapter
from loragen.layers.cloning import clone_as, strip_to
from loragen.registry import Layout, spec_for_lora_type
from loragen.validation import InitMode, check_flag, check_lora_args

__all__ = ["InitMode", "LoraLayer", "LoraMergeError", "adapter_dtype_for"]


def adapter_dtype_for(base_dtype: torch.dtype) -> torch.dtype:
    """The dtype LoRA factors get for a base weight of ``base_dtype``.

    Half-precision bases (fp16, bf16) get float32 adapters, as peft does by default: the factors are
    small and their updates would lose most of their bits in 8 significant bits. Other floating dtypes
    are kept.
    """
    if base_dtype in (torch.float16, torch.bfloat16) or not base_dtype.is_floating_point:
        return torch.float32
    return base_dtype


class LoraLayer(nn.Module):
    """Common state and behaviour of all LoRA layers (a mixin; each concrete class also derives from the
    base layer class it replaces, named by :attr:`base_class`).

    Attributes:
        r: rank. lora_alpha: alpha. scaling: the factor applied to the LoRA branch.
        lora_dropout_p: dropout probability on the branch's input. use_rslora: rank-stabilised scaling.
        merged: whether ``scaling * B @ A`` is currently added into ``weight``.
        adapter_name: the name of the adapter in the layer's own factors; active_adapter: the adapter the
        forward adds (``None``: none). Further named adapters: :mod:`loragen.layers.adapter_set`.
    """

    # the class this LoRA class replaces; to_base() returns an object of it
    base_class: ClassVar[type[nn.Module]]
    # instance attributes the LoRA setup adds (besides the factors): removed again by to_base()
    _lora_attributes: ClassVar[tuple[str, ...]] = (
        "r",
        "lora_alpha",
        "scaling",
        "lora_dropout_p",
        "use_rslora",
        "merged",
        "_sibling_role",
        "use_dora",
        "_dora_merged_norm",
        "adapter_name",
        "active_adapter",
        "_lora_detour",
        "_mixed_route",
        "_merged_adapter",
    )
    # several named adapters (loragen.layers.adapter_set); instances set these when they differ
    adapter_name: str = DEFAULT_ADAPTER
    active_adapter: str | None = DEFAULT_ADAPTER
    _lora_detour: bool = False  # the forward goes through loragen.layers.adapter_routing

    weight: Tensor
    r: int
    lora_alpha: float
    scaling: float
    lora_dropout_p: float
    use_rslora: bool
    merged: bool
    # DoRA (loragen.layers.dora): a magnitude vector beside the factors; off unless set up with use_dora
    use_dora: bool = False
    # whether the class's forward and merge implement DoRA (loragen's Linear, Conv1D, Embedding, ConvNd)
    supports_dora: ClassVar[bool] = False

    def _setup_lora(
        self,
        r: int,
        lora_alpha: float,
        lora_dropout: float,
        use_rslora: bool,
        init_lora_weights: InitMode,
        use_dora: bool = False,
    ) -> None:
        check_lora_args(r, lora_alpha, lora_dropout, use_rslora, init_lora_weights)
        check_flag(use_dora, "use_dora")
        self.r = r
        self.lora_alpha = lora_alpha
        self.use_rslora = bool(use_rslora)
        self.scaling = lora_alpha / (math.sqrt(r) if use_rslora else r)
        self.lora_dropout_p = float(lora_dropout)
        self.merged = False
        device, dtype = self.weight.device, adapter_dtype_for(self.weight.dtype)
        a_shape, b_shape = self._factor_shapes()
        first, second = self.layout.factor_names
        setattr(self, first, nn.Parameter(torch.empty(a_shape, device=device, dtype=dtype)))
        setattr(self, second, nn.Parameter(torch.empty(b_shape, device=device, dtype=dtype)))
        if self.weight.device.type != "meta":
            self.reset_lora_parameters(init_lora_weights)
        if use_dora:
            dora.check_dora_supported(self, type(self).supports_dora)
            self.use_dora = True
            dora.init_magnitude(self, self)  # after the factors: the norm of W + s B A

    @property
    def layout(self) -> Layout:
        """The registry's layout of this layer type: factor names, peft key suffixes, merge layout.

        Raises:
            TypeError: the class is not registered (see :func:`loragen.register_layer`).
        """
        spec = spec_for_lora_type(type(self))
        if spec is None:
            raise TypeError(
                f"{type(self).__qualname__} is not a registered LoRA layer class; "
                "register it with loragen.register_layer(base_type, lora_class=...)"
            )
        return spec.layout

    def _factor_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        raise NotImplementedError(f"{type(self).__name__} must define the shapes of its LoRA factors")

    @classmethod
    def from_module(
        cls,
        base: nn.Module,
        *,
        r: int = 8,
        lora_alpha: float = 8,
        lora_dropout: float = 0.0,
        use_rslora: bool = False,
        init_lora_weights: InitMode = True,
        use_dora: bool = False,
    ) -> Self:
        """The LoRA layer for an existing ``base`` module: it takes over ``base``'s state (the same
        weight and bias parameters, buffers, hooks and attributes; nothing is copied) and adds LoRA
        factors initialised as ``init_lora_weights`` says; with ``use_dora`` also DoRA's magnitude vector
        (:mod:`loragen.layers.dora`).

        Raises:
            LoraConfigError: an invalid LoRA argument (the message names it).
            LoraConversionError: ``base``'s forward is replaced on the instance (see
                :func:`loragen.layers.cloning.clone_as`).
        """
        layer = clone_as(base, cls)
        layer._setup_lora(r, lora_alpha, lora_dropout, use_rslora, init_lora_weights, use_dora)
        return layer

    # ---- factors -----------------------------------------------------------------------------

    @property
    def factor_a(self) -> nn.Parameter:
        """The first LoRA factor (``lora_A``, or ``lora_embedding_A``)."""
        return getattr(self, self.layout.factor_names[0])

    @property
    def factor_b(self) -> nn.Parameter:
        """The second LoRA factor (``lora_B``, or ``lora_embedding_B``)."""
        return getattr(self, self.layout.factor_names[1])

    def lora_parameters(self) -> dict[str, nn.Parameter]:
        """The LoRA parameters by attribute name, ``{"lora_A": ..., "lora_B": ...}``, plus
        ``"lora_magnitude_vector"`` with DoRA."""
        names = (*self.layout.factor_names, dora.MAGNITUDE) if self.use_dora else self.layout.factor_names
        return {name: getattr(self, name) for name in names}

    def peft_key_suffixes(self) -> dict[str, str]:
        """Attribute name -> the key suffix peft uses in ``adapter_model.safetensors``.

        ``{"lora_A": "lora_A.weight", "lora_B": "lora_B.weight"}`` for Linear / Conv / Conv1D, and
        ``{"lora_embedding_A": "lora_embedding_A", ...}`` for Embedding; DoRA's magnitude is saved as
        ``lora_magnitude_vector`` (no ``.weight``), as peft saves it.
        """
        layout = self.layout
        suffixes = dict(zip(layout.factor_names, layout.peft_suffixes))
        if self.use_dora:
            suffixes[dora.MAGNITUDE] = dora.MAGNITUDE
        return suffixes

    def reset_lora_parameters(self, init_lora_weights: InitMode = True) -> None:
        """(Re)initialise A and B as peft does.

        ``True``: A kaiming-uniform(a=sqrt(5)), B zeros (the adapter starts as a no-op);
        ``"gaussian"``: A normal(0, 1/r), B zeros; ``False``: both kaiming-uniform (not a no-op).
        """
        with torch.no_grad():
            a, b = self.factor_a, self.factor_b
            if init_lora_weights == "gaussian":
                nn.init.normal_(a, std=1.0 / self.r)
            else:
                nn.init.kaiming_uniform_(a, a=math.sqrt(5))
            if init_lora_weights is False:
                nn.init.kaiming_uniform_(b, a=math.sqrt(5))
            else:
                nn.init.zeros_(b)

    # ---- merging --------------------------------------------------------------------------------

    def _merge_dtype(self) -> torch.dtype:
        """float32, or float64 for float64 weights: merges never compute in less than float32."""
        return torch.promote_types(self.weight.dtype, torch.float32)

    def delta_weight(self, adapter: str | None = None) -> Tensor:
        """``scaling * B @ A`` of adapter ``adapter`` (None: the layer's own, first adapter) in the base
        weight's layout, in float32 (float64 for float64 weights)."""
        factors: Factors = self if adapter is None else adapter_factors(self, adapter)
        dtype = self._merge_dtype()
        return self.layout.delta(factors.factor_a.to(dtype), factors.factor_b.to(dtype)) * factors.scaling

    def _check_mergeable(self) -> None:
        """Raise :class:`LoraMergeError` if merged and unmerged outputs could not agree."""
        if parametrize.is_parametrized(self, "weight"):
            raise LoraMergeError(
                f"cannot merge into the weight of this {type(self).__qualname__}: a parametrization computes "
                "it (torch.nn.utils.parametrize), so there is no stored weight to add the update to"
            )

    @torch.no_grad()
    def merge(self) -> None:
        """Add the active adapter's ``scaling * B @ A`` into ``weight`` (float32 math, rounded once). A no-op
        if merged; with no active adapter, or one the layer does not hold, ``weight`` stays as it is."""
        if self.merged:
            return
        self._check_mergeable()
        name = self.active_adapter
        if name is not None and has_adapter(self, name):
            factors = adapter_factors(self, name)
            if getattr(factors, "use_dora", False):
                dora.dora_merge(self, factors)  # W <- (m / ||W + s B A||) * (W + s B A)
            else:
                w = self.weight
                w.copy_((w.to(self._merge_dtype()) + self.delta_weight(name)).to(w.dtype))
            self.__dict__["_merged_adapter"] = name
        else:
            self.__dict__["_merged_adapter"] = None
        self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """Subtract the LoRA update from ``weight`` again. A no-op if not merged.

        In float32 the original weight comes back up to rounding; in fp16/bf16 each merge/unmerge
        round trip can move a weight by up to one unit in its last place.
        """
        if not self.merged:
            return
        name = self.__dict__.pop("_merged_adapter", self.adapter_name)
        if name is not None:
            factors = adapter_factors(self, name)
            if getattr(factors, "use_dora", False):
                dora.dora_unmerge(self, factors)
            else:
                w = self.weight
                w.copy_((w.to(self._merge_dtype()) - self.delta_weight(name)).to(w.dtype))
        self.merged = False

    def to_base(self) -> nn.Module:
        """The base layer again (an object of :attr:`base_class`) holding this layer's current, possibly
        merged, weight and bias: the same parameter objects and every other state, minus the LoRA parts."""
        return strip_to(
            self, self.base_class, tuple(self.lora_parameters()), (ADAPTERS_ATTR,), self._lora_attributes
        )

    # ---- several adapters (loragen.layers.adapter_routing) -------------------------------------------

    def _base_output(self, x: Tensor) -> Tensor:
        """The base layer's forward on this layer's (possibly merged) weight."""
        result: Tensor = self.base_class.forward(self, x)
        return result

    def _lora_term(self, x: Tensor, factors: Factors) -> Tensor:
        """``scaling * B A dropout(x)`` of one adapter (``factors``), in the adapter's dtype, shaped like the
        base output. Layer types without it hold one adapter only."""
        raise NotImplementedError(f"{type(self).__qualname__} holds one adapter only")

    def _dora_output(self, x: Tensor, factors: Factors, result: Tensor) -> Tensor:
        """The layer's output with DoRA adapter ``factors``, given the base output ``result`` (peft's math,
        :mod:`loragen.layers.dora`). Layer types that support DoRA define it."""
        raise NotImplementedError(f"{type(self).__qualname__} does not implement DoRA")

    def lora_extra_repr(self) -> str:
        return (
            f"r={self.r}, lora_alpha={self.lora_alpha:g}, scaling={self.scaling:g}, "
            f"lora_dropout={self.lora_dropout_p:g}"
            + (", use_dora" if self.use_dora else "")
            + (", merged" if self.merged else "")
        )
