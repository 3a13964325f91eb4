"""The layer types the scanner and the rewriter match, read without importing torch.

A rewrite reads and writes source text: ``loragen rewrite`` and :func:`loragen.rewrite_source` never import
torch (whose import alone costs more time and memory than rewriting a large modeling file). The registry
(:mod:`loragen.registry`) imports torch, so while :mod:`loragen.layers` is not imported (and so no type can
have been registered with :func:`loragen.register_layer`), the facts come from :data:`BUILTIN`: loragen's
own types as :func:`loragen.layers.registration.register_builtin_types` registers them, with the keyword-only
parameters of their LoRA classes. A test holds the table equal to the registry and to the classes' signatures.
Once :mod:`loragen.layers` is imported, the registry is read, with a user's types.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from loragen.registry import LayerSpec

__all__ = ["BUILTIN", "NO_DEFAULT", "LayerType", "LayerTypes", "layer_types"]

NO_DEFAULT = inspect.Parameter.empty  # a keyword-only parameter without a default
Keywords = tuple[tuple[str, object], ...]


@dataclasses.dataclass(frozen=True)
class LayerType:
    """One layer type as the source tools see it: the registry's :class:`~loragen.registry.LayerSpec` facts
    that matching and rewriting use, and what the LoRA class's signature says.

    Attributes:
        base_qualname, lora_qualname, aliases, linear, subclasses: as in :class:`~loragen.registry.LayerSpec`.
        protocol: the keyword-only parameters of the LoRA class's ``from_module`` (the LoRA protocol) and
            their defaults (:data:`NO_DEFAULT` if none).
        defaults: the keyword-only parameters of the LoRA class's constructor and their defaults.
        takes_any: whether the constructor takes arbitrary keywords (``**kwargs``).
        requires: the packages the LoRA class's module needs (it cannot be imported without them).
        spec: the registry's spec this was read from (None: from :data:`BUILTIN`); its LoRA class is
            imported on first use of :meth:`signature`.
    """

    base_qualname: str
    lora_qualname: str
    aliases: tuple[str, ...] = ()
    linear: bool = False
    subclasses: bool = False
    protocol: Keywords = ()
    defaults: Keywords = ()
    takes_any: bool = False
    requires: tuple[str, ...] = ()
    spec: LayerSpec | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def qualnames(self) -> tuple[str, ...]:
        """Every qualified name that denotes the base layer type."""
        return (self.base_qualname, *self.aliases)

    @property
    def lora_name(self) -> str:
        """The LoRA class's name (``"LoraLinear"``)."""
        return self.lora_qualname.rpartition(".")[2]

    @property
    def lora_module(self) -> str:
        """The module a rewritten file imports the LoRA class from."""
        return self.lora_qualname.rpartition(".")[0]

    def signature(self) -> tuple[dict[str, object], dict[str, object], bool]:
        """``(protocol, defaults, takes_any)`` (see the attributes).

        Raises:
            ImportError: the LoRA class of a registered type cannot be imported.
        """
        if self.spec is None:
            return dict(self.protocol), dict(self.defaults), self.takes_any
        return _signature(self.spec.lora_type())

    def importable(self) -> bool:
        """Whether a rewritten file can import the LoRA class by its name (a registered type: checked by
        importing it; a built-in type: its module's packages are installed)."""
        if self.spec is None:
            return all(importlib.util.find_spec(package) is not None for package in self.requires)
        from loragen.source.codegen import importable  # jinja2, only for a registered type

        try:
            return importable(self.spec.lora_qualname, self.spec.lora_type())
        except ImportError:
            return False


def _keyword_only(function: object) -> dict[str, object]:
    try:
        parameters = inspect.signature(function).parameters  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return {}
    return {n: p.default for n, p in parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}


def _signature(lora_class: type) -> tuple[dict[str, object], dict[str, object], bool]:
    try:
        parameters = inspect.signature(lora_class).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    except (TypeError, ValueError):
        takes_any = False
    return _keyword_only(getattr(lora_class, "from_module", None)), _keyword_only(lora_class), takes_any


def from_spec(spec: LayerSpec) -> LayerType:
    """The :class:`LayerType` of a registry spec (its LoRA class is read on first use)."""
    return LayerType(
        spec.base_qualname, spec.lora_qualname, spec.aliases, spec.linear, spec.subclasses, spec=spec
    )


_PROTOCOL: Keywords = (
    ("r", 8),
    ("lora_alpha", 8),
    ("lora_dropout", 0.0),
    ("use_rslora", False),
    ("init_lora_weights", True),
    ("use_dora", False),
)
_BNB_DEFAULTS = _PROTOCOL[:-1]  # the quantized layers have no DoRA


# as loragen.layers.registration.register_builtin_types registers them, in its order
BUILTIN: tuple[LayerType, ...] = (
    *(
        LayerType(
            f"torch.nn.{name}",
            f"loragen.layers.Lora{name}",
            (f"torch.nn.modules.{module}.{name}",),
            protocol=_PROTOCOL,
            defaults=_PROTOCOL,
        )
        for name, module in (("Conv1d", "conv"), ("Conv2d", "conv"), ("Embedding", "sparse"))
    ),
    LayerType(
        "torch.nn.Linear",
        "loragen.layers.LoraLinear",
        ("torch.nn.modules.linear.Linear",),
        linear=True,
        subclasses=True,
        protocol=_PROTOCOL,
        defaults=_PROTOCOL,
    ),
    LayerType(
        "transformers.pytorch_utils.Conv1D",
        "loragen.layers.LoraConv1D",
        ("transformers.modeling_utils.Conv1D", "transformers.Conv1D"),
        linear=True,
        protocol=_PROTOCOL,
        defaults=_PROTOCOL,
        requires=("transformers",),
    ),
    *(
        LayerType(
            f"bitsandbytes.nn.{name}",
            f"loragen.layers.bnb.Lora{name}",
            (f"bitsandbytes.nn.modules.{name}",),
            linear=True,
            subclasses=True,
            protocol=_PROTOCOL,
            defaults=_BNB_DEFAULTS,
            requires=("bitsandbytes",),
        )
        for name in ("Linear4bit", "Linear8bitLt")
    ),
)


class LayerTypes:
    """The layer types of one registry state, looked up by qualified name."""

    def __init__(self, types: Iterable[LayerType]) -> None:
        self.all = tuple(types)
        self._by_qualname = {q: t for t in self.all for q in t.qualnames}

    def for_qualname(self, qualname: str) -> LayerType | None:
        """The type a qualified name (``"torch.nn.Conv2d"``) denotes, or None."""
        return self._by_qualname.get(qualname)


_BUILTIN_TYPES = LayerTypes(BUILTIN)


def layer_types() -> LayerTypes:
    """The layer types to match now: the registry's once :mod:`loragen.layers` is imported (it registers
    loragen's own types; a user's need it too), else :data:`BUILTIN`, without importing torch."""
    if "loragen.layers" not in sys.modules:
        return _BUILTIN_TYPES
    from loragen.registry import specs

    return LayerTypes(from_spec(spec) for spec in specs())
