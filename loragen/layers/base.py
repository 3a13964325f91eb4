"""What every LoRA layer is (:class:`LoraLayer`): the contract a layer type fulfils, the behaviour all
share (adapters, the forward, merging and its thread guard), and turning a module into a LoRA layer
(:func:`clone_as`: the same state, nothing copied) and back (:meth:`LoraLayer.to_base`).

A layer type derives from :class:`LoraLayer` and the base class it replaces, and provides ``base_class``,
``_factor_shapes()`` and ``_adapter_output(x, adapter)``; optionally ``_base_output(x)``,
``dora_variant`` (:mod:`loragen.layers.variants`), ``linear_term`` (the term is ``scaling * (x A^T) B^T``:
a mixed batch stacks adapters into two GEMMs) and ``_adapted_output(x, adapter)`` (a fused op).
"""

from __future__ import annotations

import functools
import sys
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize
from typing_extensions import Self

from loragen.config import InitMode
from loragen.errors import LoraConversionError, LoraMergeError
from loragen.layers.adapter_set import (
    ADAPTERS_ATTR,
    DEFAULT_ADAPTER,
    LoraAdapter,
    adapter_factors,
    add_factors,
    describe,
)
from loragen.layers.variants import Variant
from loragen.layouts import Layout
from loragen.registry import spec_for_lora_type

__all__ = ["LoraLayer", "MergeGuard", "clone_as", "reading", "writing"]

M = TypeVar("M", bound=nn.Module)
F = TypeVar("F", bound=Callable[..., Any])
_GIL: bool = getattr(sys, "_is_gil_enabled", lambda: True)()
_RECOUNT_S = 0.005  # how often a waiting merge counts the forwards in flight again


class MergeGuard:
    """A readers-writer turn per layer: forwards read together, ``merge()`` / ``unmerge()`` write alone (a
    forward could otherwise read ``merged`` before a change and the weight after it). A forward counts
    itself in ``_readers``, then looks for ``_writer``; a merge sets ``_writer``, then waits for
    ``_readers`` to empty: whichever comes second sees the other. Under the GIL each step is atomic and a
    forward takes no lock; free-threaded, its two steps run under the lock."""

    __slots__ = ("_changed", "_readers", "_writer")

    def __init__(self) -> None:
        self._changed = threading.Condition(threading.Lock())
        self._readers: list[None] = []  # one entry per forward in flight
        self._writer: int | None = None  # the thread ident of the merge in progress

    def start_reading(self) -> bool:
        """Wait for another thread's merge, then count this forward in; False when this thread merges."""
        readers = self._readers
        while True:
            if _GIL:
                readers.append(None)
                writer = self._writer
            else:
                with self._changed:
                    readers.append(None)
                    writer = self._writer
            if writer is None:
                return True
            readers.pop()  # a merge holds the layer, or is waiting for the forwards in flight
            if writer == threading.get_ident():
                return False
            with self._changed:
                self._changed.notify_all()  # a merge counting the forwards in flight counts again
                while self._writer is not None:
                    self._changed.wait()

    def stop_reading(self) -> None:
        self._readers.pop()
        if self._writer is not None:
            with self._changed:
                self._changed.notify_all()

    def start_writing(self) -> bool:
        """Wait until no forward and no other merge runs, then hold the layer; False when this thread does."""
        me = threading.get_ident()
        with self._changed:
            if self._writer == me:
                return False
            while self._writer is not None:
                self._changed.wait()
            self._writer = me
            while self._readers:  # forwards notify as they leave; the timeout covers a notification
                self._changed.wait(_RECOUNT_S)  # sent between their pop and this check
        return True

    def stop_writing(self) -> None:
        with self._changed:
            self._writer = None
            self._changed.notify_all()


def reading(forward: F) -> F:
    """Decorate a LoRA layer's ``forward``: it runs while no merge of that layer is in progress."""

    @functools.wraps(forward)
    def guarded(self: LoraLayer, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling() or not self.merge_guard.start_reading():
            return forward(self, *args, **kwargs)  # traced, or inside this thread's own merge
        try:
            return forward(self, *args, **kwargs)
        finally:
            self.merge_guard.stop_reading()

    return guarded  # type: ignore[return-value]


def writing(change: F) -> F:
    """Decorate a LoRA layer's ``merge`` / ``unmerge``: it waits for the forwards in flight and holds off new ones."""

    @functools.wraps(change)
    def guarded(self: LoraLayer, *args: Any, **kwargs: Any) -> Any:
        if not self.merge_guard.start_writing():
            return change(self, *args, **kwargs)  # nested in this thread's own merge
        try:
            return change(self, *args, **kwargs)
        finally:
            self.merge_guard.stop_writing()

    return guarded  # type: ignore[return-value]


# The containers of nn.Module state that a LoRA layer adds to (or removes from): copied, not shared.
_OWN_CONTAINERS = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set")
# What accelerate's add_hook_to_module puts on an instance.
_ACCELERATE_ATTRS = ("forward", "_old_forward", "_hf_hook")


def clone_as(module: nn.Module, cls: type[M]) -> M:
    """A new ``cls`` object (``type(module)``, a subclass, or a class of the same instance layout) sharing
    ``module``'s state: parameters, buffers, submodules, hooks, attributes; accelerate's hook is moved onto it.

    Raises:
        LoraConversionError: another instance-level ``forward`` replaces the class's.
    """
    state = dict(module.__dict__)
    hook = state.get("_hf_hook")
    if "forward" in state and hook is None:
        raise LoraConversionError(
            f"{type(module).__qualname__} has an instance-level forward ({state['forward']!r}) in place of "
            "its class's forward; loragen cannot tell what it computes. Remove the override before converting"
        )
    if hook is not None:
        for name in _ACCELERATE_ATTRS:
            state.pop(name, None)
    for name in _OWN_CONTAINERS:
        if name in state:
            state[name] = type(state[name])(state[name])
    clone = cls.__new__(cls)
    clone.__dict__.update(state)
    if hook is not None:
        from accelerate.hooks import add_hook_to_module  # present: the hook came from it

        add_hook_to_module(clone, hook)
    return clone


def _first_adapter_setting(name: str, doc: str, *, settable: bool = True) -> property:
    """A layer attribute that reads (and sets) the setting ``name`` of the layer's first adapter."""

    def read(self: LoraLayer) -> object:
        return getattr(self._first_adapter(), name)

    def write(self: LoraLayer, value: object) -> None:
        setattr(self._first_adapter(), name, value)

    return property(read, write if settable else None, doc=doc)


class LoraLayer(nn.Module, ABC):
    """A LoRA layer: the contract every layer type fulfils (module docstring) and the behaviour they share.

    Attributes:
        merged: whether the active adapter is added into ``weight``. active_adapter: the adapter the forward
            adds (``None``: none). fused: whether the layer type's fused op may run (False: peft's composition).
        lora_adapter_records: every adapter by name, first first. mixed_route: the running mixed batch, if any.
        r, lora_alpha, scaling, lora_dropout_p, use_rslora, adapter_name: those of the layer's first adapter.
    """

    base_class: ClassVar[type[nn.Module]]
    dora_variant: ClassVar[Variant | None] = None
    linear_term: ClassVar[bool] = False
    # instance attributes the LoRA setup adds (besides the parameters): to_base() removes them
    _lora_attributes: ClassVar[tuple[str, ...]] = (
        "merged",
        "fused",
        "lora_adapter_records",
        "active_adapter",
        "mixed_route",
        "merge_guard",
        "_merged_adapter",
        "_dora_merged_norm",
    )
    # submodules the LoRA setup adds: to_base() removes them
    _lora_modules: ClassVar[tuple[str, ...]] = (ADAPTERS_ATTR,)

    weight: Tensor
    merged: bool
    lora_adapter_records: dict[str, LoraAdapter]
    merge_guard: MergeGuard
    active_adapter: str | None = DEFAULT_ADAPTER
    fused: bool = True
    mixed_route: Any = None  # a loragen.layers.mixed_batch.MixedRoute while a mixed batch runs
    _merged_adapter: str | None = None  # the adapter merge() added (None: none), for unmerge()
    _dora_merged_norm: Tensor | None = None  # a merged DoRA adapter's weight norm, for unmerge()

    r = _first_adapter_setting("r", "The first adapter's rank.", settable=False)
    lora_alpha = _first_adapter_setting("lora_alpha", "The first adapter's alpha.")
    scaling = _first_adapter_setting("scaling", "The first adapter's scaling of its term.")
    lora_dropout_p = _first_adapter_setting("lora_dropout_p", "The first adapter's dropout probability.")
    use_rslora = _first_adapter_setting("use_rslora", "Whether the first adapter uses rsLoRA's scaling.")
    factor_a = _first_adapter_setting("factor_a", "The first adapter's A.", settable=False)
    factor_b = _first_adapter_setting("factor_b", "The first adapter's B.", settable=False)

    def __getstate__(self) -> dict[str, Any]:
        """Copies and pickles leave the merge guard (a lock) out."""
        return {key: value for key, value in super().__getstate__().items() if key != "merge_guard"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A copy or an unpickled layer gets a guard of its own."""
        super().__setstate__(state)
        self.merge_guard = MergeGuard()

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

    def _init_lora_state(self) -> None:
        """The per-layer state every LoRA layer holds before its first adapter."""
        self.merged = False
        self.merge_guard = MergeGuard()

    def _setup_lora(
        self,
        r: int,
        lora_alpha: float,
        lora_dropout: float,
        use_rslora: bool,
        init_lora_weights: InitMode,
        use_dora: bool = False,
    ) -> None:
        """Make the layer's first adapter (``"default"``).

        Raises:
            LoraConfigError: an invalid LoRA argument. LoraConversionError: ``use_dora`` without DoRA support.
        """
        self._init_lora_state()
        self.lora_adapter_records = {}
        add_factors(
            self, DEFAULT_ADAPTER, r, lora_alpha, lora_dropout, use_rslora, init_lora_weights, use_dora
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
        """The LoRA layer for ``base``, taking over its state (:func:`clone_as`), with one adapter.

        Raises:
            LoraConfigError: an invalid LoRA argument. LoraConversionError: see :func:`clone_as`, or
                ``use_dora`` where DoRA is not supported.
        """
        layer = clone_as(base, cls)
        layer._setup_lora(r, lora_alpha, lora_dropout, use_rslora, init_lora_weights, use_dora)
        return layer

    def to_base(self) -> nn.Module:
        """The base layer again (:attr:`base_class`) with this layer's current, possibly merged, parameters and
        state, minus the LoRA parts."""
        base = clone_as(self, self.base_class)
        for name in self.lora_parameters():
            base._parameters.pop(name, None)
        for name in self._lora_modules:
            base._modules.pop(name, None)
        for name in self._lora_attributes:
            base.__dict__.pop(name, None)
        return base

    @property
    def layout(self) -> Layout:
        """The registry's layout of this layer type (factor names, peft key suffixes, init and merge maths).

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
        return next(iter(self.lora_adapter_records.values()))

    @property
    def adapter_name(self) -> str:
        """The name of the layer's first adapter (whose parameters are the layer's own); setting it renames it."""
        return next(iter(self.lora_adapter_records))

    @adapter_name.setter
    def adapter_name(self, name: str) -> None:
        held = self.lora_adapter_records
        self.lora_adapter_records = {(name if i == 0 else k): v for i, (k, v) in enumerate(held.items())}

    def lora_parameters(self) -> dict[str, nn.Parameter]:
        """The first adapter's parameters by attribute name (``lora_A``, ``lora_B``, DoRA's magnitude)."""
        return self._first_adapter().lora_parameters()

    def peft_key_suffixes(self) -> dict[str, str]:
        """The first adapter's attribute name -> key suffix in peft's ``adapter_model.safetensors``."""
        return self._first_adapter().peft_key_suffixes()

    def reset_lora_parameters(self, init_lora_weights: InitMode = True) -> None:
        """(Re)initialise the first adapter's A and B as peft does."""
        first = self._first_adapter()
        self.layout.init_factors(first.factor_a, first.factor_b, first.r, init_lora_weights)

    def running_adapter(self) -> LoraAdapter | None:
        """The adapter the forward adds now: the active one, unless merged, disabled or not held here."""
        name = self.active_adapter
        if self.merged or name is None:
            return None
        return self.lora_adapter_records.get(name)

    @reading
    def forward(self, input: Tensor) -> Tensor:
        """``base(x)`` plus the running adapter's term; in a mixed batch, each row's own adapter's."""
        x = input  # torch's name for the argument
        if self.mixed_route is not None and self.active_adapter is not None:  # adapters off win, as in peft
            return self.mixed_route.output(self, x)
        adapter = self.running_adapter()
        if adapter is None:  # merged, adapters disabled, or an adapter this layer does not hold
            return self._base_output(x)
        return self._adapted_output(x, adapter)

    def _adapted_output(self, x: Tensor, adapter: LoraAdapter) -> Tensor:
        """The output with ``adapter``: the base output and its term as its variant composes them.

        Raises:
            LoraConversionError: the base layer returns something other than one tensor.
        """
        result = self._base_output(x)
        if not isinstance(result, Tensor):  # a Linear subclass whose forward returns several values
            raise LoraConversionError(
                f"{type(self).__qualname__}: its base layer {self.base_class.__qualname__} returns a "
                f"{type(result).__name__}, not a tensor, so it has no single output to add a LoRA term to (an "
                "MoE router returning scores and logits is one); leave it out of target_modules "
                "(exclude_modules), or adapt its weight with target_parameters"
            )
        return adapter.variant.output(self, x, adapter, result)

    def _merge_dtype(self) -> torch.dtype:
        """float32, or float64 for float64 weights: merges never compute in less than float32."""
        return torch.promote_types(self.weight.dtype, torch.float32)

    def delta_weight_of(self, adapter: LoraAdapter) -> Tensor:
        """``scaling * B @ A`` of ``adapter`` in the base weight's layout, in :meth:`_merge_dtype`."""
        dtype = self._merge_dtype()
        return self.layout.delta(adapter.factor_a.to(dtype), adapter.factor_b.to(dtype)) * adapter.scaling

    def delta_weight(self, adapter: str | None = None) -> Tensor:
        """:meth:`delta_weight_of` the adapter named ``adapter`` (None: the first).

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
        """Add the active adapter into ``weight`` (float32 math, rounded once). A no-op if merged; with no
        active adapter held here, ``weight`` stays as it is."""
        if self.merged:
            return
        self._check_mergeable()
        adapter = self.running_adapter()
        self._merged_adapter = None if adapter is None else self.active_adapter
        if adapter is not None:
            self._merge_adapter(adapter)
        self.merged = True

    @writing
    @torch.no_grad()
    def unmerge(self) -> None:
        """Take the merged adapter out of ``weight`` again (float32: the original up to rounding; fp16/bf16: up
        to one unit in the last place per round trip). A no-op if not merged."""
        if not self.merged:
            return
        name, self._merged_adapter = self._merged_adapter, None
        if name is not None:
            self._unmerge_adapter(name)
        self.merged = False

    def _merge_adapter(self, adapter: LoraAdapter) -> None:
        adapter.variant.merge(self, adapter)

    def _unmerge_adapter(self, name: str) -> None:
        adapter = self.lora_adapter_records.get(name)  # None: deleted since merging
        if adapter is not None:
            adapter.variant.unmerge(self, adapter)

    def lora_extra_repr(self) -> str:
        """The first adapter's settings, for ``extra_repr``."""
        return describe(self._first_adapter()) + (", merged" if self.merged else "")
