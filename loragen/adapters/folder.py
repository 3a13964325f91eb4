"""Reading an adapter folder (peft's format) into memory, or lazily, without touching any model.

An adapter folder holds ``adapter_config.json`` (peft's fields, see :meth:`LoraConfig.to_peft`) and
``adapter_model.safetensors`` (keys: see :mod:`loragen.adapters.keys`). A pickled ``adapter_model.bin``
is read only when the caller opts in (``allow_pickle=True``): unpickling can run arbitrary code.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
import torch

from loragen.adapters.json_file import read_json_file
from loragen.adapters.keys import (
    AdapterKey,
    LoraFactors,
    check_magnitudes,
    group_lora_keys,
    parse_adapter_key,
)
from loragen.adapters.safetensors_file import SafetensorsHeader, SafetensorsReader, read_safetensors_header
from loragen.config import LoraConfig
from loragen.errors import AdapterError

__all__ = [
    "ADAPTER_CONFIG_NAME",
    "ADAPTER_WEIGHTS_NAME",
    "ADAPTER_PICKLE_NAME",
    "Adapter",
    "read_adapter_config",
    "read_adapter",
]

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
    return LoraConfig.from_peft(data, source=str(config_path)), data


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
