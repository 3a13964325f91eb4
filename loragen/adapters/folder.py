"""An adapter folder in peft's format, read into memory (or lazily) without touching any model.

It holds ``adapter_config.json`` and ``adapter_model.safetensors``, whose keys name tensors after peft's
wrapped model: ``base_model.model.<module>.lora_A.weight`` (a factor; suffixes from the registry's
Layouts), ``...lora_magnitude_vector`` (DoRA), ``...<module>.weight`` (saved in full),
``...<module>.base_layer.bias`` (a trained bias). A model key drops the prefix, peft's ``base_layer`` /
``modules_to_save`` infixes and the factor suffix. ``adapter_model.bin`` is read only with
``allow_pickle=True`` (unpickling can run arbitrary code).
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
    SafetensorsReader,
    read_json_file,
    read_safetensors_header,
)
from loragen.config import LoraConfig
from loragen.errors import AdapterError
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
    "group_lora_keys",
    "parse_adapter_key",
    "read_adapter",
    "read_adapter_config",
]

PEFT_PREFIX = "base_model.model."

# every peft LoRA tensor has a path component beginning with this (lora_A, a LoRA bias loragen lacks...)
_PEFT_LORA_PART = "lora_"
MAGNITUDE = "lora_magnitude_vector"  # DoRA's, beside the factors
_PEFT_WRAPPER_PARTS = ("base_layer", "modules_to_save")


@dataclass(frozen=True)
class AdapterKey:
    """What one key of an adapter file addresses: ``module`` (its path in the model) and ``name``, a
    LoRA factor's attribute (``lora_A``, ..., DoRA's magnitude) or a parameter saved in full (``weight``)."""

    key: str
    module: str
    name: str
    is_lora: bool

    @property
    def model_key(self) -> str:
        """The state-dict key of this tensor in a loragen model."""
        return f"{self.module}.{self.name}" if self.module else self.name


def parse_adapter_key(key: str) -> AdapterKey | None:
    """Classify a peft adapter file key; ``None`` for peft's ``original_module`` copies (no new data).

    Raises:
        AdapterError: a peft LoRA tensor that is neither a factor of a registered layout nor DoRA's
            ``lora_magnitude_vector`` (a LoRA bias ``lora_B.bias``); the message names the key.
    """
    path = key.removeprefix(PEFT_PREFIX)
    if path.endswith("." + MAGNITUDE):
        return AdapterKey(key, path[: -len(MAGNITUDE) - 1], MAGNITUDE, True)
    for suffix, layout, index in sorted(factor_suffixes(), key=lambda item: -len(item[0])):
        if path.endswith("." + suffix):
            return AdapterKey(key, path[: -len(suffix) - 1], layout.factor_names[index], True)
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
    """One module's LoRA factors in an adapter file: the ``layouts`` with these factor names (several:
    Linear and Conv1D share them) and the file keys of A and B (``None`` when missing)."""

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
    """``{module path: its LoRA factors}`` for the LoRA keys among ``keys``, in module order.

    Raises:
        AdapterError: modules whose factors belong to different layouts (all listed, with ``source``).
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


ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
ADAPTER_PICKLE_NAME = "adapter_model.bin"


@dataclass(frozen=True)
class Adapter:
    """An adapter folder: ``tensors`` (a :class:`SafetensorsReader` when lazy) and ``shapes`` by file key,
    ``keys`` what each addresses (without peft's internal copies)."""

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

    def dtype_name(self, key: str) -> str:
        """The safetensors dtype name of tensor ``key`` (``"F32"``; torch's name for others, ``"int64"``)."""
        if isinstance(self.tensors, SafetensorsReader):
            return self.tensors.header.tensors[key].dtype
        name = str(self.tensors[key].dtype).removeprefix("torch.")
        return {"float16": "F16", "bfloat16": "BF16", "float32": "F32", "float64": "F64"}.get(name, name)


def read_adapter_config(path: str | os.PathLike[str]) -> tuple[LoraConfig, dict[str, Any]]:
    """Read ``adapter_config.json`` from the adapter folder ``path``: the :class:`LoraConfig` and the raw JSON.

    Raises:
        AdapterError: the folder or the file is missing, or the file is not a JSON object (names file:line).
        LoraConfigError: a field is invalid or an unsupported peft feature is switched on (names the field).
    """
    folder = Path(path)
    if not folder.is_dir():
        what = "does not exist" if not folder.exists() else "is not a folder"
        raise AdapterError(
            f"{folder} {what}: an adapter is a folder with {ADAPTER_CONFIG_NAME} and {ADAPTER_WEIGHTS_NAME}"
        )
    config_path = folder / ADAPTER_CONFIG_NAME
    if not config_path.exists():
        raise AdapterError(f"{folder}: no {ADAPTER_CONFIG_NAME} (not an adapter folder)")
    data = read_json_file(config_path, AdapterError)
    if not isinstance(data, dict):
        raise AdapterError(
            f"{config_path}: expected a JSON object of peft's fields, got a {type(data).__name__}"
        )
    return LoraConfig.from_peft(data, source=str(config_path)), data


def read_adapter(path: str | os.PathLike[str], *, allow_pickle: bool = False, lazy: bool = False) -> Adapter:
    """Read an adapter folder, checking every key and that each module's factors are a LoRA pair
    (``lazy=True``: only the safetensors header; tensors are read on access).

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
        header = read_safetensors_header(weights_path)
        tensors = SafetensorsReader(header)
        if not lazy:
            try:
                tensors = safetensors.torch.load(weights_path.read_bytes())
            except (safetensors.SafetensorError, ValueError, RuntimeError) as exc:
                raise AdapterError(f"{weights_path}: corrupt safetensors file ({exc})") from None
        shapes = {name: entry.shape for name, entry in header.tensors.items()}
        metadata = header.metadata
    elif (folder / ADAPTER_PICKLE_NAME).is_file():
        weights_path = folder / ADAPTER_PICKLE_NAME
        if not allow_pickle:
            raise AdapterError(
                f"{weights_path}: refusing to load a pickle file (it can run arbitrary code); convert it to "
                f"{ADAPTER_WEIGHTS_NAME}, or pass allow_pickle=True if you trust its source"
            )
        try:
            state = torch.load(weights_path, map_location="cpu", weights_only=True)
        except Exception as exc:  # torch raises many types for a bad or unsafe pickle
            raise AdapterError(
                f"{weights_path}: cannot be loaded with torch.load(weights_only=True): {exc}"
            ) from None
        if not isinstance(state, Mapping) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
        ):
            raise AdapterError(f"{weights_path}: expected a dict of tensors")
        tensors = dict(state)
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
    """Both factors of a module must be a pair of its layout (a lone one is reported later)."""
    stray = sorted(info.key for info in adapter.keys.values() if info.is_lora and info.name == MAGNITUDE)
    if stray and not adapter.config.use_dora:
        raise AdapterError(
            f"{adapter.weights_path}: {stray[0]}: a DoRA magnitude ({MAGNITUDE}, {len(stray)} in all) in an "
            'adapter whose adapter_config.json has use_dora=false; set "use_dora": true if it is a DoRA adapter'
        )
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
