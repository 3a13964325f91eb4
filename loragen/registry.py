"""The registry: every fact loragen knows per layer type, in one table of :class:`LayerSpec`.

A spec says how a base layer type is matched (by type, or by qualified name in source), which LoRA class
replaces it, the :class:`~loragen.layouts.Layout` of its factors, and whether it counts as linear for
``all-linear``. :mod:`loragen.layers.registration` registers loragen's own types;
:func:`loragen.register_layer` adds a user's.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import threading
from functools import cache

from torch import nn

from loragen.layouts import PLAIN, Layout

__all__ = [
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
]


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """One convertible base layer type and everything loragen knows about it.

    Attributes:
        base_qualname: the public qualified name of the base type (``"torch.nn.Linear"``).
        lora_qualname: where the LoRA class is imported from (``"loragen.layers.LoraLinear"``).
        aliases: other qualified names the base type is reachable under (its defining module, re-exports).
        layout: the LoRA factors' names, peft key suffixes and merge layout.
        linear: whether the layer counts as "linear" for ``target_modules="all-linear"``.
        subclasses: whether subclasses of the base type are converted too; otherwise only the exact type.
        lora_class: the LoRA class itself, when it is already imported.
        base_class: the base class itself, for types that cannot be imported by name.
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
        """The base class, or None when its package is not installed or not imported yet (so a look-up
        never imports, say, transformers)."""
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
    """Why modules of exactly ``module_type`` are never converted, or None: a type refused by name, or a
    subclass its spec's LoRA class refuses (its classmethod ``subclass_refusal(module_type)``, if it has one)."""
    reason = _refusals.get(f"{module_type.__module__}.{module_type.__qualname__}")
    if reason is not None:
        return reason
    spec = spec_for_type(module_type)
    if spec is None or spec.lora_class is None or module_type is spec.base_type():
        return None
    refuse = getattr(spec.lora_class, "subclass_refusal", None)
    return refuse(module_type) if callable(refuse) else None


def spec_for_qualname(qualname: str) -> LayerSpec | None:
    """The spec a qualified name (``"torch.nn.Conv2d"``, ``"transformers.pytorch_utils.Conv1D"``) denotes."""
    return next((spec for spec in _specs.values() if qualname in spec.qualnames), None)


_by_lora_type: dict[type, LayerSpec | None] = {}


def spec_for_lora_type(lora_type: type) -> LayerSpec | None:
    """The spec whose LoRA class is ``lora_type`` or one of its bases. Cached per class."""
    if lora_type not in _by_lora_type:
        found = [
            spec
            for cls in lora_type.__mro__
            for spec in _specs.values()
            if spec.lora_class is cls
            or (spec.lora_class is None and f"{cls.__module__}.{cls.__qualname__}" == spec.lora_qualname)
        ]
        _by_lora_type[lora_type] = found[0] if found else None
    return _by_lora_type[lora_type]


def supported_type_names() -> list[str]:
    """The qualified names of all supported base layer types, for error messages."""
    return [spec.base_qualname + (" (and subclasses)" if spec.subclasses else "") for spec in _specs.values()]
