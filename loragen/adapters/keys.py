"""peft's adapter file keys and the model keys they address.

An adapter file names each tensor after peft's wrapped model::

    base_model.model.<module path>.lora_A.weight        a LoRA factor (suffixes: the registry's Layouts)
    base_model.model.<module path>.lora_embedding_A
    base_model.model.<module path>.lora_magnitude_vector   DoRA's magnitude (no ``.weight``, as peft saves it)
    base_model.model.<module path>.weight               a module saved in full (modules_to_save)
    base_model.model.<module path>.base_layer.bias      a LoRA layer's own bias (bias="all" / "lora_only")

A loragen model holds the LoRA factors as plain parameters of the layer (``<module path>.lora_A``), so
a file key maps to a model key by dropping the ``base_model.model.`` prefix, peft's ``base_layer`` and
``modules_to_save`` infixes and the factor suffix. Which suffixes name which factor of which layer
layout comes from :mod:`loragen.registry` and nowhere else.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from loragen.errors import AdapterError
from loragen.registry import LAYOUTS, Layout, factor_suffixes

__all__ = [
    "PEFT_PREFIX",
    "MAGNITUDE",
    "AdapterKey",
    "LoraFactors",
    "parse_adapter_key",
    "lora_factors",
    "group_lora_keys",
    "check_magnitudes",
]

PEFT_PREFIX = "base_model.model."

# Path components peft's LoRA layers use for tensors: all begin with this (lora_A, lora_embedding_B,
# DoRA's lora_magnitude_vector, and variants loragen does not implement such as a LoRA bias).
_PEFT_LORA_PART = "lora_"
# DoRA's magnitude vector: a LoRA tensor beside the factors (loragen.layers.dora_magnitude)
MAGNITUDE = "lora_magnitude_vector"
# Path components of peft's wrappers around a module saved in full, which carry no name of their own.
_PEFT_WRAPPER_PARTS = ("base_layer", "modules_to_save")


@dataclass(frozen=True)
class AdapterKey:
    """What one key of an adapter file addresses.

    ``module`` is the module path in the model, ``name`` the LoRA factor's attribute name (a registry
    Layout's ``factor_names``: ``lora_A``, ``lora_embedding_B``, ...; DoRA's ``lora_magnitude_vector``) or the parameter name (``weight``,
    ``bias``) of a module saved in full (modules_to_save, a trained bias, peft's saved embedding base
    weights).
    """

    key: str
    module: str
    name: str
    is_lora: bool

    @property
    def model_key(self) -> str:
        """The state-dict key of this tensor in a loragen model."""
        return f"{self.module}.{self.name}" if self.module else self.name


def _factor_name_by_suffix() -> dict[str, str]:
    """peft key suffix -> factor attribute name, longest suffix first, for every registered layout."""
    names = {suffix: layout.factor_names[index] for suffix, layout, index in factor_suffixes()}
    return dict(sorted(names.items(), key=lambda item: -len(item[0])))


def parse_adapter_key(key: str) -> AdapterKey | None:
    """Classify a peft adapter file key; ``None`` for peft-internal copies that carry no new data.

    peft's ``bias="all"`` also saves ``<module>.original_module.*`` (the untouched original of a module
    to save); those are skipped. ``<module>.modules_to_save.*`` is the same tensor as ``<module>.*``.

    Raises:
        AdapterError: a peft LoRA tensor that is neither a factor of a registered layout nor DoRA's
            ``lora_magnitude_vector`` (a LoRA bias ``lora_B.bias``); the message names the key.
    """
    path = key.removeprefix(PEFT_PREFIX)
    if path.endswith("." + MAGNITUDE):
        return AdapterKey(key, path[: -len(MAGNITUDE) - 1], MAGNITUDE, True)
    by_suffix = _factor_name_by_suffix()
    for suffix, name in by_suffix.items():
        if path.endswith("." + suffix):
            return AdapterKey(key, path[: -len(suffix) - 1], name, True)
    parts = path.split(".")
    lora_parts = [p for p in parts if p.startswith(_PEFT_LORA_PART)]
    if lora_parts:
        known = ", ".join(dict.fromkeys(n for layout in LAYOUTS.values() for n in layout.factor_names))
        raise AdapterError(
            f"{key}: unsupported adapter tensor ({lora_parts[0]} is not a LoRA factor loragen reads; "
            f"it reads {known} and DoRA's {MAGNITUDE}). LoRA biases are not supported"
        )
    if "original_module" in parts:
        return None
    parts = [p for p in parts if p not in _PEFT_WRAPPER_PARTS]
    return AdapterKey(key, ".".join(parts[:-1]), parts[-1], False)


@dataclass(frozen=True)
class LoraFactors:
    """The LoRA factors one module has in an adapter file.

    ``layouts`` are the registry layouts whose factor names these are (Linear/Conv and Conv1D weights
    share ``lora_A``/``lora_B``: the stored weight's shape tells them apart when merging). ``key_a`` and
    ``key_b`` are the file keys of A and B, ``None`` when the file lacks one.
    """

    module: str
    layouts: tuple[Layout, ...]
    key_a: str | None
    key_b: str | None

    @property
    def names(self) -> tuple[str, str]:
        """The attribute names of A and B (``("lora_A", "lora_B")``, ``("lora_embedding_A", ...)``)."""
        return self.layouts[0].factor_names

    @property
    def keys(self) -> tuple[str, ...]:
        """The file keys present, A first."""
        return tuple(k for k in (self.key_a, self.key_b) if k is not None)


def lora_factors(module: str, keys: Mapping[str, str]) -> LoraFactors | None:
    """One module's factors from ``{factor attribute name: file key}``.

    Returns:
        the factors, or ``None`` when the names belong to no single layout (``lora_A`` beside
        ``lora_embedding_B``).
    """
    layouts = tuple(layout for layout in LAYOUTS.values() if set(keys) <= set(layout.factor_names))
    if not layouts:
        return None
    a_name, b_name = layouts[0].factor_names
    return LoraFactors(module, layouts, keys.get(a_name), keys.get(b_name))


def group_lora_keys(keys: Iterable[AdapterKey], source: object) -> dict[str, LoraFactors]:
    """``{module path: its LoRA factors}`` for the LoRA keys among ``keys``, in module order (DoRA's
    magnitude vectors are not factors and are left out).

    Raises:
        AdapterError: modules whose factors belong to different layouts (all listed, with ``source``,
            the file they come from).
    """
    by_module: dict[str, dict[str, str]] = {}
    for info in keys:
        if info.is_lora and info.name != MAGNITUDE:
            by_module.setdefault(info.module, {})[info.name] = info.key
    out: dict[str, LoraFactors] = {}
    mixed = []
    for module, names in sorted(by_module.items()):
        factors = lora_factors(module, names)
        if factors is None:
            mixed.append(f"{module}: has factors of different layer types ({', '.join(sorted(names))})")
        else:
            out[module] = factors
    if mixed:
        raise AdapterError(f"{source}: inconsistent LoRA tensors:\n  " + "\n  ".join(mixed))
    return out


def check_magnitudes(keys: Iterable[AdapterKey], use_dora: bool, source: object) -> None:
    """DoRA magnitude vectors belong only in an adapter whose config says ``use_dora``.

    Raises:
        AdapterError: ``source`` (the weights file) holds ``lora_magnitude_vector`` tensors but its config
            has ``use_dora`` false: read as plain LoRA they would be dropped and the outputs would differ.
    """
    if use_dora:
        return
    stray = sorted(info.key for info in keys if info.is_lora and info.name == MAGNITUDE)
    if stray:
        raise AdapterError(
            f"{source}: {stray[0]}: a DoRA magnitude ({MAGNITUDE}, {len(stray)} in all) in an adapter whose "
            'adapter_config.json has use_dora=false; set "use_dora": true if it is a DoRA adapter'
        )
