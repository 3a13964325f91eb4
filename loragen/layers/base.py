"""What every LoRA layer type provides (the contract, :class:`LoraLayer`) and the behaviour they share:
adapters, the forward, merging and unmerging.

A LoRA class derives from :class:`LoraLayer` and from the base layer class it replaces (``nn.Linear``,
``nn.Embedding``, ...), so a LoRA layer keeps the base layer's ``weight`` / ``bias`` under their usual
state-dict keys. :meth:`LoraLayer.from_module` makes one from an existing module by taking over that
module's state (:mod:`loragen.layers.cloning`), and :meth:`LoraLayer.to_base` gives the base layer back.

Adding a layer type
-------------------
A layer type provides (``LoraLayer`` is an abstract base class: a class missing one of the abstract
methods cannot be instantiated):

* ``base_class``: the layer class it replaces (:func:`loragen.register_layer` sets it);
* ``_factor_shapes()``: the shapes of A and B at the layer's rank ``self.r``;
* ``_adapter_output(x, adapter)``: the adapter term ``scaling * B A dropout(x)`` of one adapter, shaped
  like the base output, in the adapter's dtype;

and optionally:

* ``_base_output(x)``: the base output (default: ``base_class.forward``);
* ``dora_variant``: its DoRA strategy (:mod:`loragen.layers.variants`; None: no DoRA);
* ``linear_term``: True when the term is ``scaling * (x A^T) B^T`` along the last dimension, so a
  mixed batch stacks the adapters into two GEMMs;
* ``_fused_output(x, adapter)``: a fused op computing the whole output (the fused LoRA op, sibling
  fusion); None to compute ``base + term``.

Its registry entry (:func:`loragen.register_layer`) gives its layout (factor names, peft keys, merge
maths). Everything else (several adapters, disabling, merging, DoRA, mixed batches, save and load) is
shared.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize
from typing_extensions import Self

from loragen.errors import LoraConversionError, LoraMergeError
from loragen.layers.adapter_set import (
    ADAPTERS_ATTR,
    DEFAULT_ADAPTER,
    RECORDS_ATTR,
    LoraAdapter,
    adapter_dtype_for,
    adapter_factors,
    add_factors,
    describe,
    records,
)
from loragen.layers.cloning import clone_as, strip_to
from loragen.layers.fast_paths import fast_output
from loragen.layers.merge_guard import GUARD_ATTR, reading, without_guard, writing
from loragen.layers.variants import LORA, Variant
from loragen.registry import Layout, spec_for_lora_type
from loragen.validation import InitMode

__all__ = ["InitMode", "LoraLayer", "LoraMergeError", "adapter_dtype_for"]


def _first_adapter_setting(name: str, doc: str, *, settable: bool = True) -> property:
    """A layer attribute that reads (and sets) the setting ``name`` of the layer's first adapter."""

    def read(self: LoraLayer) -> object:
        return getattr(self._first_adapter(), name)

    def write(self: LoraLayer, value: object) -> None:
        setattr(self._first_adapter(), name, value)

    return property(read, write if settable else None, doc=doc)


class LoraLayer(nn.Module, ABC):
    """A LoRA layer: the contract every layer type fulfils (see the module docstring) and the behaviour
    they share. Each concrete class also derives from the base layer class it replaces (:attr:`base_class`).

    Attributes:
        merged: whether the active adapter is currently added into ``weight``.
        active_adapter: the adapter the forward adds (``None``: none).
        fused: whether the forward may run the layer type's fused ops (set False on a layer to run
            peft's plain composition).
        r, lora_alpha, scaling, lora_dropout_p, use_rslora, adapter_name: those of the layer's first
            adapter (every adapter: :mod:`loragen.layers.adapter_set`).
    """

    # the class this LoRA class replaces; to_base() returns an object of it
    base_class: ClassVar[type[nn.Module]]
    # the DoRA strategy of this layer type (loragen.layers.variants); None: no DoRA
    dora_variant: ClassVar[Variant | None] = None
    # the adapter term is scaling * (x A^T) B^T along the last dimension (mixed batches stack adapters)
    linear_term: ClassVar[bool] = False
    # instance attributes the LoRA setup adds (besides the parameters): removed again by to_base()
    _lora_attributes: ClassVar[tuple[str, ...]] = (
        "merged",
        "fused",
        "_sibling_role",
        "_dora_merged_norm",
        RECORDS_ATTR,
        "active_adapter",
        "_mixed_route",
        "_merged_adapter",
        GUARD_ATTR,
    )
    active_adapter: str | None = DEFAULT_ADAPTER
    fused: bool = True

    weight: Tensor
    merged: bool

    r = _first_adapter_setting(
        "r", "The first adapter's rank (fixed: the factors' shapes follow it).", settable=False
    )
    lora_alpha = _first_adapter_setting("lora_alpha", "The first adapter's alpha.")
    scaling = _first_adapter_setting("scaling", "The first adapter's scaling of its term.")
    lora_dropout_p = _first_adapter_setting("lora_dropout_p", "The first adapter's dropout probability.")
    use_rslora = _first_adapter_setting(
        "use_rslora", "Whether the first adapter uses rank-stabilised scaling."
    )

    def __getstate__(self) -> dict[str, Any]:
        """The state copies and pickles carry: the merge guard (a lock) is left out; a copy makes its own."""
        return without_guard(super().__getstate__())

    # ---- what a layer type provides --------------------------------------------------------------

    @abstractmethod
    def _factor_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The shapes of A and B at the layer's rank ``self.r``."""

    @abstractmethod
    def _adapter_output(self, x: Tensor, adapter: LoraAdapter) -> Tensor:
        """``scaling * B A dropout(x)`` of ``adapter``, shaped like the base output, in the adapter's dtype."""

    def _base_output(self, x: Tensor) -> Tensor:
        """The base layer's forward on this layer's (possibly merged) weight."""
        result: Tensor = self.base_class.forward(self, x)
        return result

    def _fused_output(self, x: Tensor, adapter: LoraAdapter) -> Tensor | None:
        """The whole output with ``adapter`` as one fused op, or None (this default) to compute base + term."""
        return None

    # ---- making and unmaking ------------------------------------------------------------------------

    def _setup_lora(
        self,
        r: int,
        lora_alpha: float,
        lora_dropout: float,
        use_rslora: bool,
        init_lora_weights: InitMode,
        use_dora: bool = False,
    ) -> None:
        """Make the layer's first adapter (``"default"``); every constructor and :meth:`from_module` calls it.

        Raises:
            LoraConfigError: an invalid LoRA argument (the message names it).
            LoraConversionError: ``use_dora`` where the layer type or its weight has no DoRA.
        """
        self.merged = False
        self.__dict__[RECORDS_ATTR] = {}
        add_factors(
            self,
            DEFAULT_ADAPTER,
            r=r,
            lora_alpha=lora_alpha,
            lora_dropout=lora_dropout,
            use_rslora=use_rslora,
            init_lora_weights=init_lora_weights,
            use_dora=use_dora,
        )

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
        weight and bias parameters, buffers, hooks and attributes; nothing is copied) and adds an adapter
        initialised as ``init_lora_weights`` says; with ``use_dora`` a DoRA adapter (:mod:`loragen.layers.dora_magnitude`).

        Raises:
            LoraConfigError: an invalid LoRA argument (the message names it).
            LoraConversionError: ``base``'s forward is replaced on the instance (see
                :func:`loragen.layers.cloning.clone_as`), or ``use_dora`` where DoRA is not supported.
        """
        layer = clone_as(base, cls)
        layer._setup_lora(r, lora_alpha, lora_dropout, use_rslora, init_lora_weights, use_dora)
        return layer

    def to_base(self) -> nn.Module:
        """The base layer again (an object of :attr:`base_class`) holding this layer's current, possibly
        merged, weight and bias: the same parameter objects and every other state, minus the LoRA parts."""
        return strip_to(
            self, self.base_class, tuple(self.lora_parameters()), (ADAPTERS_ATTR,), self._lora_attributes
        )

    # ---- adapters -------------------------------------------------------------------------------------

    @property
    def layout(self) -> Layout:
        """The registry's layout of this layer type: factor names, peft key suffixes, init and merge maths.

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

    def _first_adapter(self) -> LoraAdapter:
        return next(iter(records(self).values()))

    @property
    def adapter_name(self) -> str:
        """The name of the layer's first adapter (whose parameters are the layer's own, ``<path>.lora_A``).
        Setting it renames that adapter."""
        return next(iter(records(self)))

    @adapter_name.setter
    def adapter_name(self, name: str) -> None:
        held = records(self)
        self.__dict__[RECORDS_ATTR] = {(name if i == 0 else k): v for i, (k, v) in enumerate(held.items())}

    @property
    def factor_a(self) -> nn.Parameter:
        """The first adapter's A (``lora_A``, or ``lora_embedding_A``)."""
        return self._first_adapter().factor_a

    @property
    def factor_b(self) -> nn.Parameter:
        """The first adapter's B (``lora_B``, or ``lora_embedding_B``)."""
        return self._first_adapter().factor_b

    def lora_parameters(self) -> dict[str, nn.Parameter]:
        """The first adapter's parameters by attribute name, ``{"lora_A": ..., "lora_B": ...}`` (plus a
        variant's own, DoRA's ``"lora_magnitude_vector"``)."""
        return self._first_adapter().lora_parameters()

    def peft_key_suffixes(self) -> dict[str, str]:
        """The first adapter's attribute name -> key suffix in peft's ``adapter_model.safetensors``
        (see :meth:`loragen.layers.adapter_set.LoraAdapter.peft_key_suffixes`)."""
        return self._first_adapter().peft_key_suffixes()

    def reset_lora_parameters(self, init_lora_weights: InitMode = True) -> None:
        """(Re)initialise the first adapter's A and B as peft does (the layout's init:
        :meth:`loragen.registry.Layout.init_factors`)."""
        first = self._first_adapter()
        self.layout.init_factors(first.factor_a, first.factor_b, first.r, init_lora_weights)

    def running_adapter(self) -> LoraAdapter | None:
        """The adapter the forward adds now: the active one, unless the layer is merged, adapters are off
        or the layer does not hold the active adapter."""
        name = self.active_adapter
        if self.merged or name is None:
            return None
        return records(self).get(name)

    def runs_plain_first_adapter(self) -> bool:
        """Whether the forward computes exactly base + ``scaling * B A dropout(x)`` with the layer's own
        ``lora_A``, ``lora_B`` and ``scaling``: not merged, no mixed batch, the first adapter active and
        plain LoRA. Sibling fusion (:mod:`loragen.ops.siblings`) reads those attributes directly."""
        adapter = self.running_adapter()
        return (
            adapter is not None
            and adapter is self._first_adapter()
            and adapter.variant is LORA
            and self.__dict__.get("_mixed_route") is None
        )

    # ---- forward ------------------------------------------------------------------------------------

    @reading
    def forward(self, input: Tensor) -> Tensor:
        """``base(x)`` plus the running adapter's term (its variant's: plain LoRA adds
        ``scaling * B A dropout(x)``); a fused op where the layer type has one (:mod:`loragen.layers.fast_paths`)."""
        x = input  # torch's name for the argument
        adapter = self.running_adapter()
        fast = fast_output(self, x, adapter)
        if fast is not None:
            return fast
        result = self._base_output(x)
        if adapter is None:
            return result
        if not isinstance(result, Tensor):  # a Linear subclass whose forward returns several values
            raise LoraConversionError(
                f"{type(self).__qualname__}: its base layer {self.base_class.__qualname__} returns a "
                f"{type(result).__name__}, not a tensor, so it has no single output to add a LoRA term to (an "
                "MoE router returning scores and logits is one); leave it out of target_modules "
                "(exclude_modules), or adapt its weight with target_parameters"
            )
        return adapter.variant.output(self, x, adapter, result)

    # ---- merging --------------------------------------------------------------------------------

    def _merge_dtype(self) -> torch.dtype:
        """float32, or float64 for float64 weights: merges never compute in less than float32."""
        return torch.promote_types(self.weight.dtype, torch.float32)

    def delta_weight_of(self, adapter: LoraAdapter) -> Tensor:
        """``scaling * B @ A`` of ``adapter`` in the base weight's layout, in float32 (float64 for float64
        weights)."""
        dtype = self._merge_dtype()
        return self.layout.delta(adapter.factor_a.to(dtype), adapter.factor_b.to(dtype)) * adapter.scaling

    def delta_weight(self, adapter: str | None = None) -> Tensor:
        """:meth:`delta_weight_of` the adapter named ``adapter`` (None: the layer's first adapter).

        Raises:
            AdapterNameError: the layer holds no adapter ``adapter``.
        """
        held = self._first_adapter() if adapter is None else adapter_factors(self, adapter)
        return self.delta_weight_of(held)  # type: ignore[arg-type]

    def _check_mergeable(self) -> None:
        """Raise :class:`LoraMergeError` if merged and unmerged outputs could not agree."""
        if parametrize.is_parametrized(self, "weight"):
            raise LoraMergeError(
                f"cannot merge into the weight of this {type(self).__qualname__}: a parametrization computes "
                "it (torch.nn.utils.parametrize), so there is no stored weight to add the update to"
            )

    @writing
    @torch.no_grad()
    def merge(self) -> None:
        """Add the active adapter into ``weight`` (its variant's merge; float32 math, rounded once). A no-op
        if merged; with no active adapter, or one the layer does not hold, ``weight`` stays as it is."""
        if self.merged:
            return
        self._check_mergeable()
        adapter = self.running_adapter()
        if adapter is not None:
            adapter.variant.merge(self, adapter)
        self.__dict__["_merged_adapter"] = None if adapter is None else self.active_adapter
        self.merged = True

    @writing
    @torch.no_grad()
    def unmerge(self) -> None:
        """Take the merged adapter out of ``weight`` again. A no-op if not merged.

        In float32 the original weight comes back up to rounding; in fp16/bf16 each merge/unmerge
        round trip can move a weight by up to one unit in its last place.
        """
        if not self.merged:
            return
        name = self.__dict__.pop("_merged_adapter", self.adapter_name)
        adapter = None if name is None else records(self).get(name)
        if adapter is not None:
            adapter.variant.unmerge(self, adapter)
        self.merged = False

    def lora_extra_repr(self) -> str:
        """The first adapter's settings (further adapters show theirs in ``lora_adapters``), for ``extra_repr``."""
        return describe(self._first_adapter()) + (", merged" if self.merged else "")
