"""The registry: every fact loragen knows per layer type, in one table.

A :class:`LayerSpec` says, for one base layer type (``torch.nn.Linear``, transformers' ``Conv1D``, a
user's own layer):

* how a module or a constructor call is matched: the qualified names of the base type (the decorator and
  the rewriter match calls by qualified name; the runtime converter by type), and whether subclasses of
  the base type are converted too;
* which LoRA class replaces it, by importable qualified name (generated code imports it from there);
* the :class:`Layout` of its LoRA factors: their attribute names, peft's key suffixes, and how the update
  ``B @ A`` lines up with the stored base weight (used by merges, in memory and streaming);
* whether it counts as a linear layer for ``target_modules="all-linear"``.

The layer modules register loragen's own types when :mod:`loragen.layers` is imported;
:func:`loragen.register_layer` adds a user's. Everything else (conversion, the decorator, the rewriter,
adapter save/load, ``loragen merge``, ``loragen inspect``, sibling fusion) reads these facts from here.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import sys
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from functools import cache

import torch
from torch import Tensor, nn

from loragen.validation import InitMode

__all__ = [
    "Layout",
    "PlainLayout",
    "TransposedLayout",
    "EmbeddingLayout",
    "PLAIN",
    "TRANSPOSED",
    "EMBEDDING",
    "LAYOUTS",
    "LayerSpec",
    "register",
    "unregister",
    "specs",
    "spec_for",
    "spec_for_type",
    "spec_for_qualname",
    "refusal_for",
    "spec_for_lora_type",
    "supported_type_names",
    "factor_suffixes",
    "ParameterLayout",
    "EXPERTS",
    "EXPERTS_TRANSPOSED",
]

Shape = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Layout(ABC):
    """How a layer's two LoRA factors are named, stored in peft's files, initialised and merged into its
    weight. The maths differs per kind of weight, so each kind is a subclass that provides it:
    :class:`PlainLayout`, :class:`TransposedLayout`, :class:`EmbeddingLayout`.

    Attributes:
        name: the layout's name for messages and :func:`loragen.register_layer` (``"plain"``,
            ``"transposed"``, ``"embedding"``).
        factor_names: the attribute names of A and B on a loragen layer.
        peft_suffixes: the key suffixes of A and B in peft's ``adapter_model.safetensors``.
    """

    name: str
    factor_names: tuple[str, str]
    peft_suffixes: tuple[str, str]

    @abstractmethod
    def weight_shape(self, a: Shape, b: Shape) -> Shape:
        """The shape of the base weight that factors of shapes ``a`` (A) and ``b`` (B) update."""

    @abstractmethod
    def fits(self, a: Shape, b: Shape) -> bool:
        """Whether factors of shapes ``a`` (A) and ``b`` (B) are a pair of this layout."""

    @abstractmethod
    def delta(self, a: Tensor, b: Tensor) -> Tensor:
        """``B @ A`` in the base weight's layout (unscaled), in the factors' dtype."""

    @abstractmethod
    def delta_row_factors(self, a: Tensor, b: Tensor, start: int, stop: int) -> tuple[Tensor, Tensor]:
        """Two matrices whose product is :meth:`delta_rows`, ``(rows, r)`` and ``(r, -1)``: a caller adds
        them to a block in place, never materialising the delta (``block.addmm_(*factors, alpha=s)``)."""

    def delta_rows(self, a: Tensor, b: Tensor, start: int, stop: int) -> Tensor:
        """Rows ``start:stop`` of :meth:`delta` (its first dimension), computed from those rows only:
        what a streaming merge adds to one block of a stored weight, flattened to ``(rows, -1)``."""
        left, right = self.delta_row_factors(a, b, start, stop)
        return left @ right

    def init_factors(self, a: Tensor, b: Tensor, r: int, init: InitMode) -> None:
        """Initialise new factors in place as peft does: ``True``: A kaiming-uniform(a=sqrt(5)), B zeros
        (the adapter starts as a no-op); ``"gaussian"``: A normal(0, 1/r), B zeros; ``False``: both
        kaiming-uniform (not a no-op). :class:`EmbeddingLayout` initialises the other way round."""
        with torch.no_grad():
            if init == "gaussian":
                nn.init.normal_(a, std=1.0 / r)
            else:
                nn.init.kaiming_uniform_(a, a=math.sqrt(5))
            if init is False:
                nn.init.kaiming_uniform_(b, a=math.sqrt(5))
            else:
                nn.init.zeros_(b)


@dataclasses.dataclass(frozen=True)
class PlainLayout(Layout):
    """A weight stored ``(out, in, *kernel)``: Linear and ConvNd. A ``(r, in, *kernel)``, B ``(out, r, 1, ...)``
    with as many dimensions; the update is ``B @ A`` viewed as the weight."""

    def weight_shape(self, a: Shape, b: Shape) -> Shape:
        return (b[0], *a[1:])

    def fits(self, a: Shape, b: Shape) -> bool:
        return len(a) >= 2 and len(a) == len(b) and a[0] == b[1] and all(d == 1 for d in b[2:])

    def delta(self, a: Tensor, b: Tensor) -> Tensor:
        product = b.flatten(1) @ a.flatten(1)  # (out, in * prod(kernel))
        return product.view(self.weight_shape(tuple(a.shape), tuple(b.shape)))

    def delta_row_factors(self, a: Tensor, b: Tensor, start: int, stop: int) -> tuple[Tensor, Tensor]:
        return b[start:stop].flatten(1), a.flatten(1)


@dataclasses.dataclass(frozen=True)
class TransposedLayout(Layout):
    """A weight stored ``(in, out)``: transformers' ``Conv1D``. The factors keep the Linear orientation,
    A ``(r, in)`` and B ``(out, r)``, both 2-D; the update is ``(B @ A)^T``."""

    def weight_shape(self, a: Shape, b: Shape) -> Shape:
        return (a[1], b[0])

    def fits(self, a: Shape, b: Shape) -> bool:
        return len(a) == len(b) == 2 and a[0] == b[1]

    def delta(self, a: Tensor, b: Tensor) -> Tensor:
        return (b @ a).t()

    def delta_row_factors(self, a: Tensor, b: Tensor, start: int, stop: int) -> tuple[Tensor, Tensor]:
        return a[:, start:stop].t(), b.t()


@dataclasses.dataclass(frozen=True)
class EmbeddingLayout(TransposedLayout):
    """An embedding table ``(num_embeddings, dim)``: A ``(r, num_embeddings)``, B ``(dim, r)``; the update is
    ``(B @ A)^T``, as for :class:`TransposedLayout`. peft initialises these factors the other way round."""

    def init_factors(self, a: Tensor, b: Tensor, r: int, init: InitMode) -> None:
        """peft's embedding init: A zeros, B normal(0, 1); ``False``: both standard normal."""
        with torch.no_grad():
            if init is False:
                nn.init.normal_(a)
            else:
                nn.init.zeros_(a)
            nn.init.normal_(b)


PLAIN: Layout = PlainLayout("plain", ("lora_A", "lora_B"), ("lora_A.weight", "lora_B.weight"))
TRANSPOSED: Layout = TransposedLayout("transposed", ("lora_A", "lora_B"), ("lora_A.weight", "lora_B.weight"))
EMBEDDING: Layout = EmbeddingLayout(
    "embedding", ("lora_embedding_A", "lora_embedding_B"), ("lora_embedding_A", "lora_embedding_B")
)
LAYOUTS: dict[str, Layout] = {layout.name: layout for layout in (PLAIN, TRANSPOSED, EMBEDDING)}


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """One convertible base layer type and everything loragen knows about it.

    Attributes:
        base_qualname: the public qualified name of the base type (``"torch.nn.Linear"``).
        lora_qualname: where the LoRA class is imported from (``"loragen.layers.LoraLinear"``).
        aliases: other qualified names the base type is reachable under (its defining module, re-exports).
        layout: the LoRA factors' names, peft key suffixes and merge layout.
        linear: whether the layer counts as "linear" for ``target_modules="all-linear"``.
        subclasses: whether subclasses of the base type are converted too (their own ``forward`` computes
            the base output); otherwise only the exact type matches.
        lora_class: the LoRA class itself, when it is already imported (saves the import by name).
        base_class: the base class itself, for types that cannot be imported by name (defined in a
            function, or in ``__main__`` of another process).
    """

    base_qualname: str
    lora_qualname: str
    aliases: tuple[str, ...] = ()
    layout: Layout = PLAIN
    linear: bool = False
    subclasses: bool = False
    lora_class: type[nn.Module] | None = dataclasses.field(default=None, compare=False, repr=False)
    base_class: type[nn.Module] | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def qualnames(self) -> tuple[str, ...]:
        """Every qualified name that denotes the base layer type."""
        return (self.base_qualname, *self.aliases)

    @property
    def lora_name(self) -> str:
        """The LoRA class's name (the last part of :attr:`lora_qualname`)."""
        return self.lora_qualname.rpartition(".")[2]

    @property
    def lora_module(self) -> str:
        """The module the LoRA class is imported from."""
        return self.lora_qualname.rpartition(".")[0]

    def base_type(self) -> type[nn.Module] | None:
        """The base class, or None when its package is not installed or not imported yet.

        A package that is not imported cannot have built any module to convert, so looking a module up
        never pays for importing, say, transformers.
        """
        if self.base_class is not None:
            return self.base_class
        if self.base_qualname.partition(".")[0] not in sys.modules:
            return None
        return _import_qualname(self.base_qualname)

    def lora_type(self) -> type[nn.Module]:
        """The LoRA class.

        Raises:
            ImportError: it cannot be imported from :attr:`lora_qualname`.
        """
        if self.lora_class is not None:
            return self.lora_class
        found = _import_qualname(self.lora_qualname)
        if found is None:
            raise ImportError(
                f"the LoRA class {self.lora_qualname} for {self.base_qualname} cannot be imported"
            )
        return found

    def matches(self, module: nn.Module) -> bool:
        """Whether this spec converts ``module``: its exact type, or a subclass when :attr:`subclasses`."""
        base = self.base_type()
        if base is None:
            return False
        return type(module) is base or (self.subclasses and isinstance(module, base))


@cache
def _import_qualname(qualname: str) -> type[nn.Module] | None:
    module_name, _, attr = qualname.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return None
    return getattr(module, attr, None)


_lock = threading.Lock()
_specs: dict[str, LayerSpec] = {}


def register(spec: LayerSpec, *, replace: bool = False) -> LayerSpec:
    """Add ``spec`` to the registry and return it.

    Raises:
        ValueError: a spec for the same base type is registered already (and ``replace`` is False).
    """
    with _lock:
        existing = _specs.get(spec.base_qualname)
        base = spec.base_type()
        if existing is None and base is not None:  # the same class registered under another name
            existing = next((s for s in _specs.values() if s.base_type() is base), None)
        if existing is not None and existing != spec and not replace:
            raise ValueError(
                f"{existing.base_qualname} is registered already (LoRA class {existing.lora_qualname}); "
                "pass replace=True to replace it"
            )
        if existing is not None:
            _specs.pop(existing.base_qualname, None)
        _specs[spec.base_qualname] = spec
        _by_lora_type.clear()
        _import_qualname.cache_clear()
    return spec


def unregister(base_qualname: str) -> None:
    """Remove the spec of ``base_qualname`` (a no-op when none is registered)."""
    with _lock:
        _specs.pop(base_qualname, None)
        _by_lora_type.clear()


def specs() -> tuple[LayerSpec, ...]:
    """Every registered spec, in registration order."""
    return tuple(_specs.values())


def spec_for(module: nn.Module) -> LayerSpec | None:
    """The spec that converts ``module`` (see :func:`spec_for_type`); None also for a refused type."""
    if refusal_for(type(module)) is not None:
        return None
    return spec_for_type(type(module))


def spec_for_type(module_type: type[nn.Module]) -> LayerSpec | None:
    """The spec for modules of ``module_type``: an exact type match first, then the spec of the most
    specific registered base class among those that accept subclasses."""
    subclass_matches: list[tuple[int, LayerSpec]] = []
    for spec in _specs.values():
        base = spec.base_type()
        if base is None:
            continue
        if module_type is base:
            return spec
        if spec.subclasses and issubclass(module_type, base):
            subclass_matches.append((module_type.__mro__.index(base), spec))
    return min(subclass_matches, key=lambda item: item[0])[1] if subclass_matches else None


_refusals: dict[str, str] = {
    "torch.nn.modules.linear.NonDynamicallyQuantizableLinear": (
        "it is nn.MultiheadAttention's out_proj: MultiheadAttention reads out_proj.weight directly "
        "(F.multi_head_attention_forward) and never calls its forward, so a LoRA branch there would be "
        "silently skipped; target the attention's other layers, or exclude it"
    ),
}


def refusal_for(module_type: type[nn.Module]) -> str | None:
    """Why modules of exactly ``module_type`` are never converted, or None."""
    return _refusals.get(f"{module_type.__module__}.{module_type.__qualname__}")


def spec_for_qualname(qualname: str) -> LayerSpec | None:
    """The spec a qualified name (``"torch.nn.Conv2d"``, ``"transformers.pytorch_utils.Conv1D"``) denotes."""
    for spec in _specs.values():
        if qualname in spec.qualnames:
            return spec
    return None


_by_lora_type: dict[type, LayerSpec | None] = {}


def spec_for_lora_type(lora_type: type) -> LayerSpec | None:
    """The spec whose LoRA class is ``lora_type`` or one of its bases (LoRA classes made for
    subclasses of a base type derive from that type's LoRA class). Cached per class."""
    if lora_type in _by_lora_type:
        return _by_lora_type[lora_type]
    found = None
    for cls in lora_type.__mro__:
        found = next(
            (
                spec
                for spec in _specs.values()
                if spec.lora_class is cls
                or (spec.lora_class is None and f"{cls.__module__}.{cls.__qualname__}" == spec.lora_qualname)
            ),
            None,
        )
        if found is not None:
            break
    _by_lora_type[lora_type] = found
    return found


def supported_type_names() -> list[str]:
    """The qualified names of all supported base layer types, for error messages."""
    return [spec.base_qualname + (" (and subclasses)" if spec.subclasses else "") for spec in _specs.values()]


def factor_suffixes() -> Iterator[tuple[str, Layout, int]]:
    """``(peft key suffix, layout, factor index)`` for every factor of every layout: index 0 is A, 1 is B."""
    for layout in LAYOUTS.values():
        for index, suffix in enumerate(layout.peft_suffixes):
            yield suffix, layout, index


# ---- parameters targeted directly (LoraConfig.target_parameters) ------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ParameterLayout:
    """How LoRA factors line up with a parameter targeted by ``target_parameters`` (peft's ``ParamWrapper``).

    A 3-D parameter ``(E, d1, d2)`` stacks ``E`` experts. ``"experts"`` stores each expert as an
    ``F.linear`` weight ``(out, in)`` (transformers' default); ``"experts_transposed"`` as ``(in, out)`` (modules
    with ``is_transposed = True``, e.g. gpt-oss). A 2-D parameter ``(out, in)`` is one expert. The factors are
    stored as peft stores them: ``A (r*E, in)`` and ``B (out, r*E)``; expert ``e`` owns rows ``e*r .. e*r+r-1``
    of A and columns ``e, e+E, e+2E, ...`` of B, so its update is ``B_e @ A_e`` (``(B_e @ A_e)^T`` transposed).

    Attributes:
        name: ``"experts"`` or ``"experts_transposed"``.
    """

    name: str
    factor_names: tuple[str, str] = ("lora_A", "lora_B")
    peft_suffixes: tuple[str, str] = ("lora_A.weight", "lora_B.weight")

    def features(self, shape: Shape) -> tuple[int, int, int]:
        """``(num_experts, in_features, out_features)`` of a parameter of ``shape`` (2-D or 3-D).

        Raises:
            ValueError: the parameter is neither 2-D nor 3-D.
        """
        if len(shape) == 2:
            return 1, shape[1], shape[0]
        if len(shape) != 3:
            raise ValueError(
                f"a {len(shape)}-D parameter: LoRA on parameters takes 2-D and 3-D (experts) ones"
            )
        if self.name == "experts_transposed":
            return shape[0], shape[1], shape[2]
        return shape[0], shape[2], shape[1]

    def factor_shapes(self, shape: Shape, r: int) -> tuple[Shape, Shape]:
        """The shapes of A and B for rank ``r`` on a parameter of ``shape``."""
        experts, in_features, out_features = self.features(shape)
        return (r * experts, in_features), (out_features, r * experts)

    def expert_factors(self, a: Tensor, b: Tensor, num_experts: int, ndim: int) -> tuple[Tensor, Tensor]:
        """Two batched factors ``(E, m, r)`` and ``(E, r, n)`` whose product is the update of every expert
        in the stored orientation of a ``ndim``-D parameter (views of ``a`` and ``b``, no copy)."""
        a_e = a.view(num_experts, -1, a.shape[-1])  # (E, r, in)
        b_e = b.view(b.shape[0], -1, num_experts).permute(2, 0, 1)  # (E, out, r)
        if ndim == 3 and self.name == "experts_transposed":
            return a_e.transpose(1, 2), b_e.transpose(1, 2)  # (E, in, r) @ (E, r, out)
        return b_e, a_e  # (E, out, r) @ (E, r, in)

    def delta(self, a: Tensor, b: Tensor, shape: Shape) -> Tensor:
        """``B_e @ A_e`` for every expert, shaped like the parameter (unscaled), in the factors' dtype."""
        left, right = self.expert_factors(a, b, self.features(shape)[0], len(shape))
        return torch.bmm(left, right).view(shape)


EXPERTS = ParameterLayout("experts")
EXPERTS_TRANSPOSED = ParameterLayout("experts_transposed")
