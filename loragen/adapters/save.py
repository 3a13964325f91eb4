"""Writing a model's adapters in peft's format: :func:`adapter_config_for` (``adapter_config.json``),
:func:`adapter_state_dict` (the tensors under peft's keys) and :func:`save_adapter` (the files).

A save replaces only the files it writes, each atomically (:meth:`loragen.atomic.Folder.write_files`), under
the adapter folder's writers' lock: ``adapter_model.safetensors`` first, then ``adapter_config.json``. The
weights' safetensors metadata carries the SHA-256 of the config bytes written with them
(:data:`~loragen.adapters.folder.CONFIG_DIGEST_KEY`), so a reader tells the pair apart from a config a
killed save left behind (see :func:`loragen.adapters.folder.read_adapter`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import safetensors.torch
import torch
from torch import nn

from loragen.adapters.folder import (
    ADAPTER_CONFIG_NAME,
    ADAPTER_WEIGHTS_NAME,
    CONFIG_DIGEST_KEY,
    PEFT_PREFIX,
)
from loragen.adapters.named import adapter_configs, check_adapter_name, list_adapters, require_adapter
from loragen.atomic import Folder, WriteError, locked_folder
from loragen.config import LoraConfig
from loragen.convert import CONFIG_ATTR, find_lora_layers
from loragen.errors import AdapterError
from loragen.layers.adapter_set import DEFAULT_ADAPTER, Factors, adapter_factors, has_adapter, key_prefix
from loragen.layers.expert_parameters import LoraParametersLayer, scaling_owners
from loragen.layouts import TRANSPOSED
from loragen.plan import embedding_targeted, entry_for, saved_modules

__all__ = ["adapter_config_for", "adapter_state_dict", "save_adapter"]

# peft saves the base weights of a targeted input/output embedding (their rows may have been resized)
_EMBEDDING_LAYER_NAMES = ("embed_tokens", "lm_head")


def _most_common(values: list[Any]) -> Any:
    return Counter(values).most_common(1)[0][0]  # ties: the first value met


def _derived_config(model: nn.Module, layers: Mapping[str, Factors]) -> LoraConfig:
    """A config that reproduces ``layers`` (for models with no stored config)."""
    adapted = [p for p, layer in layers.items() if isinstance(layer, LoraParametersLayer)]
    if adapted:
        raise AdapterError(
            f"{', '.join(adapted)}: LoRA on parameters, but the model carries no config (model.{CONFIG_ATTR}) "
            "saying how they were targeted; set it to the LoraConfig used (target_parameters=...)"
        )
    rslora = {layer.use_rslora for layer in layers.values()}
    if len(rslora) > 1:
        mixed = ", ".join(p for p, layer in layers.items() if layer.use_rslora)
        raise AdapterError(
            f"the model mixes use_rslora=True ({mixed}) and False layers; peft's adapter_config.json "
            "has one use_rslora for all layers"
        )
    dora = {layer.variant.use_dora for layer in layers.values()}
    if len(dora) > 1:
        mixed = ", ".join(p for p, layer in layers.items() if layer.variant.use_dora)
        raise AdapterError(
            f"the model mixes DoRA layers ({mixed}) and plain LoRA layers; peft's adapter_config.json has one "
            "use_dora for all layers"
        )
    r = _most_common([layer.r for layer in layers.values()])
    alpha = _most_common([layer.lora_alpha for layer in layers.values()])
    leaf_names = sorted({path.rpartition(".")[2] for path in layers})
    selected = {
        path
        for path, _ in model.named_modules()
        if path and any(path == n or path.endswith("." + n) for n in leaf_names)
    }
    # leaf names are what people write; full paths when the names would also select other modules
    targets = leaf_names if selected == set(layers) else list(layers)
    return LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=_most_common([layer.lora_dropout_p for layer in layers.values()]),
        target_modules=targets,
        use_rslora=rslora.pop(),
        use_dora=dora.pop(),
        rank_pattern={path: layer.r for path, layer in layers.items() if layer.r != r},
        alpha_pattern={path: layer.lora_alpha for path, layer in layers.items() if layer.lora_alpha != alpha},
    )


def adapter_config_for(model: nn.Module, adapter_name: str | None = None) -> LoraConfig:
    """The config :func:`save_adapter` writes for ``model``'s adapter ``adapter_name`` (default: its first).

    The config stored by ``get_lora_model`` (``model.loragen_config``), else one derived from the LoRA
    layers (per-path ranks and alphas in ``rank_pattern`` / ``alpha_pattern``); ``fan_in_fan_out=True``
    when every LoRA layer is a transformers ``Conv1D``, as peft writes.

    Raises:
        AdapterError: the model has no LoRA layers, the config disagrees with a layer's rank, scaling or
            DoRA setting (names the layer), or a derived config would mix DoRA and plain layers.
    """
    all_layers = find_lora_layers(model)
    if not all_layers:
        raise AdapterError(f"{type(model).__name__} has no LoRA layers: nothing to save")
    name = list_adapters(model)[0] if adapter_name is None else require_adapter(model, adapter_name)
    layers = {p: adapter_factors(layer, name) for p, layer in all_layers.items() if has_adapter(layer, name)}
    config = adapter_configs(model).get(name)
    if not isinstance(config, LoraConfig):
        config = _derived_config(model, layers)
    for path, layer in layers.items():
        if layer.variant.use_dora != config.use_dora:
            raise AdapterError(
                f"{path}: the layer has use_dora={layer.variant.use_dora} but the model's config has "
                f"use_dora={config.use_dora}; delete model.{CONFIG_ATTR} to save a config derived from the layers"
            )
        for key, owner in scaling_owners(path, layer):
            entry = entry_for(config, key)
            if entry.r != owner.r or not math.isclose(entry.scaling, owner.scaling):
                raise AdapterError(
                    f"{key}: the layer has r={owner.r}, scaling={owner.scaling:g} but the model's config gives "
                    f"r={entry.r}, scaling={entry.scaling:g}; delete "
                    f"model.{CONFIG_ATTR} to save a config derived from the layers"
                )
    # peft's fan_in_fan_out means "weights stored (in, out)": the transposed layout
    if all(all_layers[p].layout is TRANSPOSED for p in layers) and not config.fan_in_fan_out:
        config = config.replace(fan_in_fan_out=True)
    return config


def _tensor_for_file(key: str, t: torch.Tensor) -> torch.Tensor:
    if t.is_meta:
        raise AdapterError(
            f"{key} is on the meta device (it has a shape but no values): materialise the model "
            "(e.g. model.to_empty(device=...) and load its weights) before saving its adapter"
        )
    # a contiguous CPU copy: no storage shared with the model or with another saved tensor
    return t.detach().to("cpu", copy=True).contiguous()


def adapter_state_dict(
    model: nn.Module,
    config: LoraConfig,
    *,
    save_embedding_layers: bool | Literal["auto"] = "auto",
    state_dict: Mapping[str, torch.Tensor] | None = None,
    adapter_name: str | None = None,
) -> dict[str, torch.Tensor]:
    """The tensors of ``model``'s adapter ``adapter_name`` (default: its first) under peft's file keys,
    as contiguous CPU copies.

    LoRA factors, ``config.modules_to_save``, biases per ``config.bias`` and, with
    ``save_embedding_layers`` (``"auto"``: when ``target_modules`` names ``embed_tokens`` or ``lm_head``,
    as peft), the base weights of LoRA-adapted input/output embeddings. ``state_dict`` (model keys ->
    tensors, e.g. FSDP2's gathered state) supplies the tensors instead of the modules.

    Raises:
        AdapterError: ``state_dict`` lacks a tensor the adapter saves (every such key is listed).
    """
    full = model.state_dict(keep_vars=True) if state_dict is None else state_dict
    layers = find_lora_layers(model)
    name = list_adapters(model)[0] if adapter_name is None else adapter_name
    wanted: dict[str, str] = {}  # peft file key -> model key
    for path, layer in layers.items():
        if not has_adapter(layer, name):
            continue
        # the layer's first adapter is its own lora_A/lora_B; others are in lora_adapters.<name>
        owner = f"{path}.{key_prefix(layer, name)}"
        for attr, suffix in adapter_factors(layer, name).peft_key_suffixes().items():
            wanted[f"{PEFT_PREFIX}{path}.{suffix}"] = f"{owner}{attr}"

    saved, bias = saved_modules(config, (path for path, _ in model.named_modules())), config.bias
    if bias == "all":  # as peft: every state-dict entry named "bias"
        for name in full:
            if name == "bias" or name.endswith(".bias"):
                module, _, param = name.rpartition(".")
                infix = ".base_layer" if module in layers else ""
                wanted[f"{PEFT_PREFIX}{module}{infix}.{param}"] = name
    elif bias == "lora_only":
        for path, layer in layers.items():
            if layer.bias is not None:
                wanted[f"{PEFT_PREFIX}{path}.base_layer.bias"] = f"{path}.bias"

    wanted.update(
        {f"{PEFT_PREFIX}{name}": name for path in saved for name in full if name.startswith(path + ".")}
    )

    if save_embedding_layers == "auto":
        paths = [path for path, _ in model.named_modules()]
        save_embedding_layers = embedding_targeted(config, paths, _EMBEDDING_LAYER_NAMES)
    if save_embedding_layers:
        getters = (getattr(model, name, None) for name in ("get_input_embeddings", "get_output_embeddings"))
        embeddings = [get() for get in getters if callable(get)]
        for path, layer in layers.items():
            if any(layer is e for e in embeddings):
                wanted[f"{PEFT_PREFIX}{path}.base_layer.weight"] = f"{path}.weight"

    missing = sorted(model_key for model_key in wanted.values() if model_key not in full)
    if missing:
        raise AdapterError(f"the state dict given to save the adapter lacks: {', '.join(missing)}")
    return {file_key: _tensor_for_file(model_key, full[model_key]) for file_key, model_key in wanted.items()}


def _serialised(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """The safetensors file of ``tensors``, the same bytes for the same tensors (safetensors writes the
    metadata in hash order: here it is sorted by key)."""
    data = safetensors.torch.save(tensors, metadata=metadata)
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data stays 8-byte aligned, as safetensors writes it
    return len(text).to_bytes(8, "little") + text + data[8 + size :]


def save_adapter(
    model: nn.Module,
    path: str | os.PathLike[str],
    *,
    save_embedding_layers: bool | Literal["auto"] = "auto",
    state_dict: Mapping[str, torch.Tensor] | None = None,
    selected_adapters: list[str] | None = None,
    root_adapter: str = DEFAULT_ADAPTER,
) -> Path:
    """Write ``model``'s adapters to the folder ``path`` in peft's format; returns the folder.

    Each adapter gets ``adapter_config.json`` (:func:`adapter_config_for`, with the model's
    ``name_or_path`` as ``base_model_name_or_path``) and ``adapter_model.safetensors``
    (:func:`adapter_state_dict`), in ``path`` for ``root_adapter`` and in ``path/<name>/`` for the others,
    as peft's ``save_pretrained``. ``selected_adapters`` picks some (default: all). Only these files are
    written, each atomically; every other file in the folders (another adapter's, a README, what other
    processes write meanwhile) is left as it is. The folders are opened without following links and checked
    under their writers' lock, just before the files are written.

    Raises:
        AdapterError: the model has no LoRA layers, its config disagrees with its layers, ``state_dict``
            lacks a tensor, a tensor is on the meta device; ``path`` is ``.``/``..``, a symbolic link, a
            file, or holds a link or a file where an adapter's subfolder goes.
        AdapterNameError: an unknown name in ``selected_adapters``, or a name that cannot be a folder name.
        WriteError: a folder cannot be written (no space left, no permission; an ``OSError`` too), or became
            a link or a file while the save waited for the lock: the adapter's old files are then unchanged
            and no temporary file is left.
    """
    if not find_lora_layers(model):
        raise AdapterError(f"{type(model).__name__} has no LoRA layers: nothing to save")
    names = (
        list_adapters(model)
        if selected_adapters is None
        else [require_adapter(model, n) for n in selected_adapters]
    )
    target = _check_target(path, names, root_adapter)
    written = []
    try:
        for name in names:
            config = adapter_config_for(model, name)
            tensors = adapter_state_dict(
                model,
                config,
                save_embedding_layers=save_embedding_layers,
                state_dict=state_dict,
                adapter_name=name,
            )
            data = {**config.to_peft(), "base_model_name_or_path": model.__dict__.get("name_or_path") or None}
            config_bytes = (json.dumps(data, indent=2, sort_keys=True) + "\n").encode()
            metadata = {"format": "pt", CONFIG_DIGEST_KEY: hashlib.sha256(config_bytes).hexdigest()}
            written.append((name, config_bytes, _serialised(tensors, metadata)))
        with locked_folder(target) as root, contextlib.ExitStack() as stack:
            # every subfolder opened (no link, checked now) before the first file is written
            folders: list[Folder] = [
                root if name == root_adapter else stack.enter_context(root.subfolder(name))
                for name, _, _ in written
            ]
            for folder, (_, config_bytes, weights_bytes) in zip(folders, written):
                folder.write_files(
                    [(ADAPTER_WEIGHTS_NAME, weights_bytes), (ADAPTER_CONFIG_NAME, config_bytes)]
                )
    except WriteError:
        raise
    except (OSError, safetensors.SafetensorError) as exc:
        code = exc.errno if isinstance(exc, OSError) else None
        raise WriteError(
            code, f"{target}: cannot write the adapter ({exc}); its old files are unchanged"
        ) from exc
    return target


def _check_target(path: str | os.PathLike[str], names: list[str], root_adapter: str) -> Path:
    """The folder ``save_adapter`` writes, checked (see there) before anything is built."""
    raw = os.fspath(path)
    if not raw or Path(raw).name in ("", ".", ".."):
        raise AdapterError(
            f"save_adapter: {raw!r} names no folder of its own (an adapter is a folder); give a path "
            "ending in the adapter folder's name, e.g. 'out/my-adapter'"
        )
    target = Path(raw)
    if target.is_symlink():
        where = os.readlink(target)
        state = "" if target.exists() else ", which does not exist"
        raise AdapterError(
            f"{target} is a symbolic link (to {where}{state}); save_adapter writes a folder, never a link: "
            "save to the folder it points to, or remove the link"
        )
    if target.exists() and not target.is_dir():
        raise AdapterError(f"{target} exists and is not a folder; an adapter is saved as a folder")
    for name in names:
        check_adapter_name(name)
        if name == root_adapter:
            continue
        sub = target / name
        if sub.is_symlink():
            raise AdapterError(
                f"{sub} is a symbolic link (to {os.readlink(sub)}): adapter {name!r} would be written through "
                "it, outside the folder; remove the link or save elsewhere"
            )
        if os.path.lexists(sub) and not sub.is_dir():
            raise AdapterError(
                f"{sub} exists and is not a folder; adapter {name!r} is saved in a folder there"
            )
    return target
