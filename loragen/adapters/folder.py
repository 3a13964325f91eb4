"""An adapter folder in peft's format: its file keys and the model keys they address, and reading it into
memory (or lazily) without touching any model.

An adapter folder holds ``adapter_config.json`` (peft's fields, see :meth:`LoraConfig.to_peft`) and
``adapter_model.safetensors``, whose keys name each tensor after peft's wrapped model::

    base_model.model.<module path>.lora_A.weight        a LoRA factor (suffixes: the registry's Layouts)
    base_model.model.<module path>.lora_embedding_A
    base_model.model.<module path>.lora_magnitude_vector   DoRA's magnitude (no ``.weight``, as peft saves it)
    base_model.model.<module path>.weight               a module saved in full (modules_to_save)
    base_model.model.<module path>.base_layer.bias      a LoRA layer's own bias (bias="all" / "lora_only")

A loragen model holds the LoRA factors as plain parameters of the layer (``<module path>.lora_A``), so a
file key maps to a model key by dropping the ``base_model.model.`` prefix, peft's ``base_layer`` and
``modules_to_save`` infixes and the factor suffix; which suffixes name which factor of which layout comes
from :mod:`loragen.registry` and nowhere else. A pickled ``adapter_model.bin`` is read only when the caller
opts in (``allow_pickle=True``): unpickling can run arbitrary code.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
import torch

from loragen.adapters.files import (
    SafetensorsHeader,
    SafetensorsReader,
    read_json_file,
    read_safetensors_header,
)
from loragen.config import LoraConfig
from loragen.errors import AdapterError, LoraConfigError
from loragen.registry import LAYOUTS, Layout, factor_suffixes

__all__ = [
    "ADAPTER_CONFIG_NAME",
    "ADAPTER_PICKLE_NAME",
    "ADAPTER_WEIGHTS_NAME",
    "MAGNITUDE",
    "PEFT_PREFIX",
    "Adapter",
    "AdapterKey",
    "LoraFactors",
    "check_magnitudes",
    "group_lora_keys",
    "parse_adapter_key",
    "read_adapter",
    "read_adapter_config",
]


# ---- adapter file keys -------------------------------------------------------------------------------------

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
        layouts = tuple(layout for layout in LAYOUTS.values() if set(names) <= set(layout.factor_names))
        if not layouts:  # lora_A beside lora_embedding_B
            mixed.append(f"{module}: has factors of different layer types ({', '.join(sorted(names))})")
        else:
            a_name, b_name = layouts[0].factor_names
            out[module] = LoraFactors(module, layouts, names.get(a_name), names.get(b_name))
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


# ---- reading an adapter folder -----------------------------------------------------------------------------

ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
ADAPTER_PICKLE_NAME = "adapter_model.bin"


@dataclass(frozen=True)
class Adapter:
    """An adapter folder, read into memory (or, with ``lazy=True``, its header, tensors read on access).

    ``tensors`` maps each file key to its tensor (a :class:`SafetensorsReader` when read lazily),
    ``shapes`` to its shape; ``keys`` maps each file key to what it addresses (peft-internal
    duplicates are left out of ``keys``).
    """

    folder: Path
    config: LoraConfig
    config_dict: dict[str, Any]
    weights_path: Path
    tensors: Mapping[str, torch.Tensor]
    shapes: dict[str, tuple[int, ...]]
    keys: dict[str, AdapterKey]
    metadata: dict[str, str]

    def lora_modules(self) -> dict[str, LoraFactors]:
        """``{module path: its LoRA factors}`` for every module with LoRA tensors, in path order."""
        return group_lora_keys(self.keys.values(), self.weights_path)


def _require_folder(path: Path) -> None:
    if not path.is_dir():
        what = "does not exist" if not path.exists() else "is not a folder"
        raise AdapterError(
            f"{path} {what}: an adapter is a folder with {ADAPTER_CONFIG_NAME} and {ADAPTER_WEIGHTS_NAME}"
        )


def read_adapter_config(path: str | os.PathLike[str]) -> tuple[LoraConfig, dict[str, Any]]:
    """Read ``adapter_config.json`` from the adapter folder ``path``.

    Returns:
        the validated :class:`LoraConfig` and the raw JSON dictionary.

    Raises:
        AdapterError: the folder or the file is missing, or the file is not UTF-8, not valid JSON (names
            file:line), nested too deeply, or not a JSON object.
        LoraConfigError: a field is invalid or an unsupported peft feature is switched on (names the field).
    """
    folder = Path(path)
    _require_folder(folder)
    config_path = folder / ADAPTER_CONFIG_NAME
    if not config_path.exists():
        raise AdapterError(f"{folder}: no {ADAPTER_CONFIG_NAME} (not an adapter folder)")
    data = read_json_file(config_path, AdapterError)
    if not isinstance(data, dict):
        raise AdapterError(
            f"{config_path}: expected a JSON object of peft's fields, got a {type(data).__name__}"
        )
    _check_ranks(data, config_path)
    return LoraConfig.from_peft(data, source=str(config_path)), data


# No layer is wider than this; a rank beyond it is a typo or a hostile file, refused before torch allocates it.
_MAX_RANK = 1 << 20


def _check_ranks(data: dict[str, Any], source: Path) -> None:
    """Refuse a rank no layer can have before a model is converted to it (torch would fail to allocate it)."""
    patterns = data.get("rank_pattern")
    ranks = [("r", data.get("r"))]
    if isinstance(patterns, dict):
        ranks += [(f"rank_pattern[{key!r}]", value) for key, value in patterns.items()]
    for name, rank in ranks:
        if isinstance(rank, int) and rank > _MAX_RANK:
            shown = str(rank) if rank < 10**40 else f"an integer of {len(str(rank))} digits"
            raise LoraConfigError(
                f"{source}: {name}={shown} is not a usable LoRA rank (at most {_MAX_RANK}; a rank is at most "
                "the width of the layer it adapts)"
            )


def _load_safetensors(path: Path, lazy: bool) -> tuple[Mapping[str, torch.Tensor], SafetensorsHeader]:
    header = read_safetensors_header(path)
    if lazy:
        return SafetensorsReader(header), header
    try:
        tensors = safetensors.torch.load(path.read_bytes())
    except (safetensors.SafetensorError, ValueError, RuntimeError) as exc:
        raise AdapterError(f"{path}: corrupt safetensors file ({exc})") from None
    return tensors, header


def _load_pickle(path: Path) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for a bad or unsafe pickle
        raise AdapterError(f"{path}: cannot be loaded with torch.load(weights_only=True): {exc}") from None
    if not isinstance(state, Mapping) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise AdapterError(f"{path}: expected a dict of tensors")
    return dict(state)


def read_adapter(path: str | os.PathLike[str], *, allow_pickle: bool = False, lazy: bool = False) -> Adapter:
    """Read and validate an adapter folder (config and weights) without touching any model.

    ``lazy=True`` reads only the safetensors header; tensors are then read from disk on access.

    Checks that every key is one loragen understands and that each module's LoRA factors are a pair of
    a registered layout (shared rank, matching dimensions); whether they fit a model is checked by
    :func:`~loragen.adapters.load.load_adapter` (or :func:`~loragen.adapters.offline_merge.plan_merge`).

    Raises:
        AdapterError: missing files, a truncated or corrupt weights file (names the file), a pickled
            ``adapter_model.bin`` without ``allow_pickle=True``, unsupported or inconsistent tensors.
        LoraConfigError: an invalid or unsupported config field (names the field).
    """
    folder = Path(path)
    config, config_dict = read_adapter_config(folder)
    weights_path = folder / ADAPTER_WEIGHTS_NAME
    metadata: dict[str, str] = {}
    tensors: Mapping[str, torch.Tensor]
    if weights_path.is_file():
        tensors, header = _load_safetensors(weights_path, lazy)
        shapes = {name: entry.shape for name, entry in header.tensors.items()}
        metadata = header.metadata
    elif (folder / ADAPTER_PICKLE_NAME).is_file():
        weights_path = folder / ADAPTER_PICKLE_NAME
        if not allow_pickle:
            raise AdapterError(
                f"{weights_path}: refusing to load a pickle file (it can run arbitrary code); convert it to "
                f"{ADAPTER_WEIGHTS_NAME}, or pass allow_pickle=True if you trust its source"
            )
        tensors = _load_pickle(weights_path)
        shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    else:
        raise AdapterError(f"{folder}: no {ADAPTER_WEIGHTS_NAME} (nor {ADAPTER_PICKLE_NAME})")

    keys: dict[str, AdapterKey] = {}
    for key in tensors:
        info = parse_adapter_key(key)
        if info is not None:
            keys[key] = info
    adapter = Adapter(folder, config, config_dict, weights_path, tensors, shapes, keys, metadata)
    _check_pairs(adapter)
    return adapter


def _check_pairs(adapter: Adapter) -> None:
    """Both factors of a module must be a pair of its layout (a lone factor is reported as missing later)."""
    check_magnitudes(adapter.keys.values(), adapter.config.use_dora, adapter.weights_path)
    problems = []
    for module, factors in adapter.lora_modules().items():
        if factors.key_a is None or factors.key_b is None:
            continue
        a, b = adapter.shapes[factors.key_a], adapter.shapes[factors.key_b]
        if not any(layout.fits(a, b) for layout in factors.layouts):
            a_name, b_name = factors.names
            problems.append(
                f"{module}: {a_name} {a} and {b_name} {b} are not a LoRA pair ({a_name} is (r, in, ...), "
                f"{b_name} is (out, r, 1, ...) with as many dimensions; the ranks must agree)"
            )
    if problems:
        raise AdapterError(f"{adapter.weights_path}: inconsistent LoRA tensors:\n  " + "\n  ".join(problems))
