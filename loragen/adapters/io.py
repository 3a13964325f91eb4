"""Adapter folders in peft's on-disk format: save, load, read and validate.

An adapter folder holds ``adapter_config.json`` (peft's fields, see :meth:`LoraConfig.to_peft`) and
``adapter_model.safetensors`` with peft's keys::

    base_model.model.<module path>.lora_A.weight        (r, in)       Linear, Conv1D, ConvNd
    base_model.model.<module path>.lora_B.weight        (out, r)
    base_model.model.<module path>.lora_embedding_A     (r, num_embeddings)
    base_model.model.<module path>.lora_embedding_B     (embedding_dim, r)
    base_model.model.<module path>.weight               modules_to_save, under the module's own key
    base_model.model.<module path>.base_layer.bias      a LoRA layer's bias (bias="all" / "lora_only")

In a loragen model the LoRA tensors are plain parameters of the layer (``<module path>.lora_A``), so a
file key maps to a model key by dropping the ``base_model.model.`` prefix, the peft ``base_layer`` infix
and the ``.weight`` of peft's ``lora_A``/``lora_B`` sub-modules.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch
from torch import nn

from loragen.atomic import atomic_dir
from loragen.config import LoraConfig
from loragen.convert import (
    CONFIG_ATTR,
    convert_module,
    find_lora_layers,
    mark_trainable,
    plan_conversion,
    set_submodule,
)
from loragen.errors import AdapterError
from loragen.layers import LoraLayer

__all__ = [
    "ADAPTER_CONFIG_NAME",
    "ADAPTER_WEIGHTS_NAME",
    "ADAPTER_PICKLE_NAME",
    "PEFT_PREFIX",
    "AdapterError",
    "AdapterKey",
    "Adapter",
    "SafetensorsHeader",
    "TensorEntry",
    "SafetensorsReader",
    "parse_adapter_key",
    "read_safetensors_header",
    "read_adapter_config",
    "read_adapter",
    "adapter_config_for",
    "adapter_state_dict",
    "save_adapter",
    "load_adapter",
]

M = TypeVar("M", bound=nn.Module)

ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
ADAPTER_PICKLE_NAME = "adapter_model.bin"
PEFT_PREFIX = "base_model.model."

# peft's sub-module suffix for each LoRA tensor -> the attribute name on a loragen layer.
_LORA_SUFFIXES = {
    ".lora_A.weight": "lora_A",
    ".lora_B.weight": "lora_B",
    ".lora_embedding_A": "lora_embedding_A",
    ".lora_embedding_B": "lora_embedding_B",
}

# Sub-module / parameter names of peft's LoRA layers: anything else under them is a variant loragen lacks.
_PEFT_LORA_NAMES = frozenset(
    {"lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector"}
)

# safetensors dtype string -> (bytes per element, torch dtype name or None where torch has none)
_ST_DTYPES: dict[str, tuple[int, str | None]] = {
    "BOOL": (1, "bool"),
    "U8": (1, "uint8"),
    "I8": (1, "int8"),
    "F8_E4M3": (1, "float8_e4m3fn"),
    "F8_E5M2": (1, "float8_e5m2"),
    "I16": (2, "int16"),
    "U16": (2, "uint16"),
    "F16": (2, "float16"),
    "BF16": (2, "bfloat16"),
    "I32": (4, "int32"),
    "U32": (4, "uint32"),
    "F32": (4, "float32"),
    "I64": (8, "int64"),
    "U64": (8, "uint64"),
    "F64": (8, "float64"),
    "C64": (8, "complex64"),
}
# A header larger than this is not a real safetensors header (the format's own limit is 100 MB).
_MAX_HEADER_BYTES = 100_000_000


# ---- safetensors headers ----------------------------------------------------------------------


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file: ``start``/``end`` are absolute byte offsets in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """The matching torch dtype, or None where this torch build has none."""
        name = _ST_DTYPES[self.dtype][1]
        return getattr(torch, name, None) if name else None


@dataclass(frozen=True)
class SafetensorsHeader:
    """The parsed header of a safetensors file (no tensor data is read).

    ``header_bytes`` is the file's first ``data_start`` bytes verbatim (length prefix + JSON), so a
    file with the same tensors can be rewritten byte for byte.
    """

    path: Path
    header_bytes: bytes
    data_start: int
    file_size: int
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str] = field(default_factory=dict)


def read_safetensors_header(path: str | os.PathLike[str]) -> SafetensorsHeader:
    """Read and validate the header of the safetensors file at ``path`` (tensor data is not read).

    Checks that the header is complete JSON, every dtype is known, every shape matches its byte range,
    and the byte ranges tile the data section exactly (as the safetensors library requires).

    Raises:
        AdapterError: the file is truncated or corrupt; the message names the file and what is wrong.
        OSError: the file cannot be opened.
    """
    path = Path(path)
    file_size = path.stat().st_size
    with open(path, "rb") as fh:
        prefix = fh.read(8)
        if len(prefix) < 8:
            raise AdapterError(f"{path}: truncated safetensors file ({file_size} bytes, no header)")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > min(_MAX_HEADER_BYTES, file_size - 8):
            raise AdapterError(
                f"{path}: truncated or corrupt safetensors file (header says {header_len} bytes, "
                f"the file has {file_size - 8} after the length prefix)"
            )
        raw = fh.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{path}: corrupt safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise AdapterError(f"{path}: corrupt safetensors header (expected a JSON object)")

    data_start = 8 + header_len
    data_len = file_size - data_start
    metadata = header.pop("__metadata__", None) or {}
    tensors: dict[str, TensorEntry] = {}
    for name, info in header.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            itemsize = _ST_DTYPES[dtype][0]
            ok = (
                all(isinstance(d, int) and d >= 0 for d in shape)
                and isinstance(begin, int)
                and isinstance(end, int)
            )
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise AdapterError(f"{path}: corrupt safetensors header entry for {name!r}: {info!r}")
        if end - begin != math.prod(shape) * itemsize or begin < 0:
            raise AdapterError(
                f"{path}: corrupt safetensors header: {name!r} has shape {list(shape)} ({dtype}) "
                f"but byte range [{begin}, {end})"
            )
        tensors[name] = TensorEntry(name, dtype, shape, data_start + begin, data_start + end)

    position = data_start
    for entry in sorted(tensors.values(), key=lambda e: (e.start, e.end)):
        if entry.start != position:
            raise AdapterError(
                f"{path}: corrupt safetensors file: byte ranges overlap or leave a gap at {entry.name!r}"
            )
        position = entry.end
    if position > file_size:
        raise AdapterError(
            f"{path}: truncated safetensors file: the tensors need {position - data_start} data bytes, "
            f"the file has {data_len}"
        )
    if position < file_size:
        raise AdapterError(
            f"{path}: corrupt safetensors file: {file_size - position} trailing bytes after the tensors"
        )
    return SafetensorsHeader(path, prefix + raw, data_start, file_size, tensors, dict(metadata))


class SafetensorsReader(Mapping[str, torch.Tensor]):
    """The tensors of a safetensors file, read from disk on access (nothing is cached or mapped).

    ``reader[name]`` reads a whole tensor; :meth:`rows` reads a range of its leading dimension, so a
    caller can stream a large tensor block by block with bounded memory.
    """

    def __init__(self, header: SafetensorsHeader) -> None:
        self.header = header

    def __getitem__(self, name: str) -> torch.Tensor:
        entry = self.header.tensors[name]
        return self.rows(name, 0, entry.shape[0] if entry.shape else 1)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.header.tensors)

    def __len__(self) -> int:
        return len(self.header.tensors)

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of tensor ``name`` (a 0-d tensor has one row), shape ``(stop - start, ...)``.

        Raises:
            AdapterError: the file is shorter than its header says (changed since it was read).
        """
        entry = self.header.tensors[name]
        dtype = entry.torch_dtype
        if dtype is None:
            raise AdapterError(
                f"{self.header.path}: {name!r} has dtype {entry.dtype}, which this torch cannot read"
            )
        row_shape = entry.shape[1:]
        row_bytes = math.prod(row_shape) * _ST_DTYPES[entry.dtype][0]
        buffer = bytearray((stop - start) * row_bytes)
        with open(self.header.path, "rb") as fh:
            fh.seek(entry.start + start * row_bytes)
            if fh.readinto(buffer) != len(buffer):
                raise AdapterError(f"{self.header.path}: file ended while reading {name!r} (was it changed?)")
        shape = (stop - start, *row_shape) if entry.shape else ()
        if not buffer:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(buffer, dtype=dtype).reshape(shape)


# ---- adapter keys -------------------------------------------------------------------------------


@dataclass(frozen=True)
class AdapterKey:
    """What one key of an adapter file addresses.

    ``module`` is the module path in the model, ``name`` the LoRA attribute (``lora_A``, ``lora_B``,
    ``lora_embedding_A``, ``lora_embedding_B``) or the parameter name (``weight``, ``bias``) of a
    module saved in full (modules_to_save, a trained bias, peft's saved embedding base weights).
    """

    key: str
    module: str
    name: str
    is_lora: bool

    @property
    def model_key(self) -> str:
        """The state-dict key of this tensor in a loragen model."""
        return f"{self.module}.{self.name}" if self.module else self.name


def parse_adapter_key(key: str) -> AdapterKey | None:
    """Classify a peft adapter file key; ``None`` for peft-internal copies that carry no new data.

    peft's ``bias="all"`` also saves ``<module>.original_module.*`` (the untouched original of a module
    to save); those are skipped. ``<module>.modules_to_save.*`` is the same tensor as ``<module>.*``.

    Raises:
        AdapterError: a peft LoRA variant loragen does not implement (DoRA magnitudes, LoRA biases).
    """
    path = key.removeprefix(PEFT_PREFIX)
    for suffix, name in _LORA_SUFFIXES.items():
        if path.endswith(suffix):
            return AdapterKey(key, path[: -len(suffix)], name, True)
    parts = path.split(".")
    if _PEFT_LORA_NAMES.intersection(parts):
        raise AdapterError(
            f"{key}: unsupported adapter tensor (loragen reads lora_A/lora_B weights and "
            "lora_embedding_A/lora_embedding_B; DoRA magnitudes and LoRA biases are not supported)"
        )
    if "original_module" in parts:
        return None
    parts = [p for p in parts if p not in ("base_layer", "modules_to_save")]
    return AdapterKey(key, ".".join(parts[:-1]), parts[-1], False)


# ---- reading an adapter folder --------------------------------------------------------------------


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

    def lora_modules(self) -> dict[str, dict[str, str]]:
        """``{module path: {lora attribute: file key}}`` for every module with LoRA tensors."""
        out: dict[str, dict[str, str]] = {}
        for key, info in self.keys.items():
            if info.is_lora:
                out.setdefault(info.module, {})[info.name] = key
        return out


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
        AdapterError: the folder or the file is missing, or the file is not valid JSON (names file:line).
        LoraConfigError: a field is invalid or an unsupported peft feature is switched on (names the field).
    """
    folder = Path(path)
    _require_folder(folder)
    config_path = folder / ADAPTER_CONFIG_NAME
    try:
        text = config_path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise AdapterError(f"{folder}: no {ADAPTER_CONFIG_NAME} (not an adapter folder)") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise AdapterError(f"{config_path}:{exc.lineno}:{exc.colno}: invalid JSON: {exc.msg}") from None
    return LoraConfig.from_peft(data, source=str(config_path)), data


def _load_safetensors(path: Path, lazy: bool) -> tuple[Mapping[str, torch.Tensor], SafetensorsHeader]:
    from safetensors import SafetensorError
    from safetensors.torch import load

    header = read_safetensors_header(path)
    if lazy:
        return SafetensorsReader(header), header
    try:
        tensors = load(path.read_bytes())
    except (SafetensorError, ValueError, RuntimeError) as exc:
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

    Checks that every key is one loragen understands and that each module's LoRA factors share a rank;
    whether they fit a model is checked by :func:`load_adapter` (or :func:`loragen.adapters.merge.plan_merge`).

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
    """Both factors of a module must share its rank (a lone factor is reported as a missing key later)."""
    problems = []
    for module, names in sorted(adapter.lora_modules().items()):
        embedding = {"lora_embedding_A", "lora_embedding_B"} & names.keys()
        if embedding and {"lora_A", "lora_B"} & names.keys():
            problems.append(f"{module}: has both Linear/Conv and Embedding factors ({sorted(names)})")
            continue
        a_name, b_name = ("lora_embedding_A", "lora_embedding_B") if embedding else ("lora_A", "lora_B")
        if a_name not in names or b_name not in names:
            continue
        a, b = adapter.shapes[names[a_name]], adapter.shapes[names[b_name]]
        if len(a) < 2 or len(b) < 2 or a[0] != b[1]:
            problems.append(
                f"{module}: {a_name} {a} and {b_name} {b} do not share a rank "
                f"({a_name} is (r, ...), {b_name} is (out, r, ...))"
            )
    if problems:
        raise AdapterError(f"{adapter.weights_path}: inconsistent LoRA tensors:\n  " + "\n  ".join(problems))


# ---- saving ------------------------------------------------------------------------------------------

# peft saves the base weights of a targeted input/output embedding, because their rows may have been
# resized; "auto" does the same, so both write the same keys for the same model.
_EMBEDDING_LAYER_NAMES = ("embed_tokens", "lm_head")


def _most_common(values: list[Any]) -> Any:
    counts = Counter(values)
    return max(counts, key=lambda v: (counts[v], -values.index(v)))


def _derived_config(model: nn.Module, layers: Mapping[str, LoraLayer]) -> LoraConfig:
    """A config that reproduces ``layers`` (for models with no stored config, e.g. rewritten ones)."""
    rslora = {layer.use_rslora for layer in layers.values()}
    if len(rslora) > 1:
        mixed = ", ".join(p for p, layer in layers.items() if layer.use_rslora)
        raise AdapterError(
            f"the model mixes use_rslora=True ({mixed}) and False layers; peft's adapter_config.json "
            "has one use_rslora for all layers"
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
        rank_pattern={path: layer.r for path, layer in layers.items() if layer.r != r},
        alpha_pattern={path: layer.lora_alpha for path, layer in layers.items() if layer.lora_alpha != alpha},
    )


def adapter_config_for(model: nn.Module) -> LoraConfig:
    """The config :func:`save_adapter` writes for ``model``.

    The config stored by ``get_lora_model`` (``model.loragen_config``) when there is one, else one
    derived from the LoRA layers (ranks and alphas per path go to ``rank_pattern`` / ``alpha_pattern``).
    Models whose LoRA layers are all transformers ``Conv1D`` get ``fan_in_fan_out=True``, as peft
    writes for them (tools that merge without the model need it for square weights).

    Raises:
        AdapterError: the model has no LoRA layers, or the config disagrees with a layer's rank or
            scaling (names the layer).
    """
    layers = find_lora_layers(model)
    if not layers:
        raise AdapterError(f"{type(model).__name__} has no LoRA layers: nothing to save")
    config = getattr(model, CONFIG_ATTR, None)
    if not isinstance(config, LoraConfig):
        config = _derived_config(model, layers)
    for path, layer in layers.items():
        if config.rank_for(path) != layer.r or not math.isclose(config.scaling_for(path), layer.scaling):
            raise AdapterError(
                f"{path}: the layer has r={layer.r}, scaling={layer.scaling:g} but the model's config gives "
                f"r={config.rank_for(path)}, scaling={config.scaling_for(path):g}; delete "
                f"model.{CONFIG_ATTR} to save a config derived from the layers"
            )
    conv1d = [type(layer).__name__ == "LoraConv1D" for layer in layers.values()]
    if all(conv1d) and not config.fan_in_fan_out:
        config = config.replace(fan_in_fan_out=True)
    return config


def _embedding_targeted(model: nn.Module, config: LoraConfig) -> bool:
    targets = config.target_modules
    if isinstance(targets, str):
        if targets == "all-linear":
            return False
        return any(
            config.matches_target(path)
            for path, _ in model.named_modules()
            if path.rpartition(".")[2] in _EMBEDDING_LAYER_NAMES
        )
    return any(name in (targets or ()) for name in _EMBEDDING_LAYER_NAMES)


def _tensor_for_file(t: torch.Tensor) -> torch.Tensor:
    # a contiguous CPU copy: no storage shared with the model or with another saved tensor
    return t.detach().to("cpu", copy=True).contiguous()


def adapter_state_dict(
    model: nn.Module,
    config: LoraConfig,
    *,
    save_embedding_layers: bool | Literal["auto"] = "auto",
    state_dict: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """The tensors of ``model``'s adapter under peft's file keys (contiguous CPU copies).

    LoRA factors, the state of every module in ``config.modules_to_save`` under its own key, biases per
    ``config.bias``, and with ``save_embedding_layers`` (``"auto"``: when ``target_modules`` names
    ``embed_tokens`` or ``lm_head``, as peft does) the base weights of LoRA-adapted input/output embeddings.

    Args:
        state_dict: take the tensors from this mapping of the model's own state-dict keys instead of from
            its modules (FSDP2 shards parameters; its gathered full state is passed here). It must hold
            every tensor the adapter saves.

    Raises:
        AdapterError: ``state_dict`` lacks a tensor the adapter saves (every such key is listed).
    """
    full = model.state_dict(keep_vars=True) if state_dict is None else state_dict
    layers = find_lora_layers(model)
    wanted: dict[str, str] = {}  # peft file key -> model key
    for path, layer in layers.items():
        for attr, suffix in layer.peft_key_suffixes().items():
            wanted[f"{PEFT_PREFIX}{path}.{suffix}"] = f"{path}.{attr}"

    if config.bias == "all":  # as peft: every state-dict entry named "bias"
        for name in full:
            if name == "bias" or name.endswith(".bias"):
                module, _, param = name.rpartition(".")
                infix = ".base_layer" if module in layers else ""
                wanted[f"{PEFT_PREFIX}{module}{infix}.{param}"] = name
    elif config.bias == "lora_only":
        for path, layer in layers.items():
            if layer.bias is not None:
                wanted[f"{PEFT_PREFIX}{path}.base_layer.bias"] = f"{path}.bias"

    for path, _ in model.named_modules():
        if path and config.is_module_to_save(path):
            for name in full:
                if name.startswith(path + "."):
                    wanted[f"{PEFT_PREFIX}{name}"] = name

    if save_embedding_layers == "auto":
        save_embedding_layers = _embedding_targeted(model, config)
    if save_embedding_layers:
        embeddings = []
        for getter in ("get_input_embeddings", "get_output_embeddings"):
            fn = getattr(model, getter, None)
            embeddings.append(fn() if callable(fn) else None)
        for path, layer in layers.items():
            if any(layer is e for e in embeddings):
                wanted[f"{PEFT_PREFIX}{path}.base_layer.weight"] = f"{path}.weight"

    missing = sorted(model_key for model_key in wanted.values() if model_key not in full)
    if missing:
        raise AdapterError(f"the state dict given to save the adapter lacks: {', '.join(missing)}")
    return {file_key: _tensor_for_file(full[model_key]) for file_key, model_key in wanted.items()}


def _carry_over(old: Path, new: Path) -> None:
    """Keep files that are not the adapter's own (a README, tokenizer files) when replacing a folder.

    Hard links where possible: nothing is copied, and the old folder can then be deleted.
    """
    ours = {ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME, ADAPTER_PICKLE_NAME}

    def link_or_copy(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    for item in old.iterdir():
        if item.name in ours:
            continue
        if item.is_dir() and not item.is_symlink():
            shutil.copytree(item, new / item.name, copy_function=link_or_copy, symlinks=True)
        elif item.is_symlink():
            os.symlink(os.readlink(item), new / item.name)
        else:
            link_or_copy(str(item), str(new / item.name))


def save_adapter(
    model: nn.Module,
    path: str | os.PathLike[str],
    *,
    save_embedding_layers: bool | Literal["auto"] = "auto",
    state_dict: Mapping[str, torch.Tensor] | None = None,
) -> Path:
    """Write ``model``'s adapter to the folder ``path`` in peft's format; returns the folder.

    The folder gets ``adapter_config.json`` (see :func:`adapter_config_for`) and
    ``adapter_model.safetensors`` (see :func:`adapter_state_dict`; metadata ``{"format": "pt"}``). It is
    built beside ``path`` and renamed into place only when complete, so an error or a crash never leaves
    a half-written adapter; other files already in the folder are kept.

    ``state_dict`` (model keys -> tensors) supplies the tensors instead of the model's modules: see
    :func:`adapter_state_dict` (FSDP2 models save their gathered state this way).

    Raises:
        AdapterError: the model has no LoRA layers, its config disagrees with its layers, or
            ``state_dict`` lacks a tensor the adapter saves.
        OSError: the folder cannot be written (the old one is then untouched).
    """
    from safetensors.torch import save_file

    config = adapter_config_for(model)
    tensors = adapter_state_dict(
        model, config, save_embedding_layers=save_embedding_layers, state_dict=state_dict
    )
    config_text = json.dumps(config.to_peft(), indent=2, sort_keys=True) + "\n"
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise AdapterError(f"{target} exists and is not a folder; an adapter is saved as a folder")
    with atomic_dir(target) as tmp:
        if target.is_dir():
            _carry_over(target, tmp)
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / ADAPTER_CONFIG_NAME).write_text(config_text, encoding="utf-8")
    return target


# ---- loading ------------------------------------------------------------------------------------------


def _named_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    # tied parameters appear under every name they have, as in a state dict
    tensors: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    return tensors


def _plan_load(
    model: nn.Module, adapter: Adapter, layers: Mapping[str, LoraLayer], strict: bool
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Match every adapter tensor to the model tensor it loads into; raise listing every problem.

    ``layers`` are the LoRA layers the model has, or will have once converted (they share the base
    parameters, so ``model``'s own tensors stand for everything else). Returns ``(model tensor, value)``
    pairs, values already in the target's dtype and on its device.
    """
    named = _named_tensors(model)
    config = adapter.config
    plan: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    mismatched: list[str] = []
    wrong_rank: list[str] = []
    unexpected: list[str] = []
    found: set[str] = set()
    for key, info in sorted(adapter.keys.items()):
        layer = layers.get(info.module) if info.is_lora else None
        if info.is_lora:
            target = layer.lora_parameters().get(info.name) if layer is not None else None
            if layer is not None and target is None:
                mismatched.append(
                    f"{key}: {info.module} is a {type(layer).__name__}, whose factors are "
                    f"{' and '.join(layer.lora_parameters())}, not {info.name}"
                )
                continue
        else:
            target = named.get(info.model_key)
        if target is None:
            unexpected.append(key)
            continue
        found.add(info.model_key)
        value = adapter.tensors[key]
        if tuple(value.shape) != tuple(target.shape):
            mismatched.append(f"{key}: expected shape {tuple(target.shape)}, found {tuple(value.shape)}")
        elif layer is not None and config.rank_for(info.module) != layer.r:
            wrong_rank.append(
                f"{key}: the adapter config gives {info.module} rank {config.rank_for(info.module)}, "
                f"the file and the model's layer have rank {layer.r}"
            )
        else:
            plan[id(target)] = (target, value)

    # model key -> file key of everything the adapter must provide
    expected = {
        f"{path}.{attr}": f"{PEFT_PREFIX}{path}.{suffix}"
        for path, layer in layers.items()
        for attr, suffix in layer.peft_key_suffixes().items()
    }
    for path, module in model.named_modules():
        if path and config.is_module_to_save(path):
            expected.update({f"{path}.{name}": f"{PEFT_PREFIX}{path}.{name}" for name in module.state_dict()})
    missing = sorted(file_key for model_key, file_key in expected.items() if model_key not in found)

    problems = []
    if mismatched:
        problems.append("shape mismatch:\n    " + "\n    ".join(mismatched))
    if wrong_rank:
        problems.append("rank mismatch:\n    " + "\n    ".join(wrong_rank))
    if missing and strict:
        problems.append(
            f"missing keys ({len(missing)}; the model expects them, the file lacks them):\n    "
            + "\n    ".join(missing)
        )
    if unexpected and strict:
        problems.append(
            f"unexpected keys ({len(unexpected)}; nothing in the model takes them - pass strict=False "
            "to ignore them):\n    " + "\n    ".join(unexpected)
        )
    if problems:
        raise AdapterError(
            f"{adapter.weights_path} does not fit {type(model).__name__}:\n  " + "\n  ".join(problems)
        )
    return [(target, value.to(device=target.device, dtype=target.dtype)) for target, value in plan.values()]


class _Snapshot:
    """What loading may change in a model, saved so that a failure can put it back exactly."""

    def __init__(self, model: nn.Module, overwritten: list[torch.Tensor], layers: Mapping[str, LoraLayer]):
        self.model = model
        self.values = [(t, t.detach().clone()) for t in overwritten]
        self.requires_grad = [(p, p.requires_grad) for p in model.parameters()]
        self.scaling = {
            layer: (layer.lora_alpha, layer.use_rslora, layer.scaling) for layer in layers.values()
        }
        self.config = model.__dict__.get(CONFIG_ATTR, _MISSING)

    @torch.no_grad()
    def restore(self) -> None:
        for tensor, saved in self.values:
            tensor.copy_(saved)
        for p, flag in self.requires_grad:
            p.requires_grad_(flag)
        for layer, (alpha, rslora, scaling) in self.scaling.items():
            layer.lora_alpha, layer.use_rslora, layer.scaling = alpha, rslora, scaling
        if self.config is _MISSING:
            self.model.__dict__.pop(CONFIG_ATTR, None)
        else:
            setattr(self.model, CONFIG_ATTR, self.config)


_MISSING = object()


def load_adapter(
    model: M,
    path: str | os.PathLike[str],
    *,
    trainable: bool = False,
    strict: bool = True,
    allow_pickle: bool = False,
) -> M:
    """Load the adapter folder ``path`` (peft's format) into ``model``; returns the same model.

    A model without LoRA layers is first converted per the saved config (targets, ``rank_pattern``,
    ``alpha_pattern``, ``use_rslora`` all honoured). A model that has LoRA layers (converted, rewritten
    or decorated) is loaded into: its layers must have the adapter's ranks, and take the adapter's alpha
    and ``use_rslora``. ``trainable=False`` freezes every parameter (inference); ``True`` sets
    ``requires_grad`` as :func:`~loragen.get_lora_model` does. The config is kept as
    ``model.loragen_config``.

    All or nothing: everything is checked before the model is touched, and on any error the model is
    left exactly as it was.

    Raises:
        AdapterError: a missing folder or file; a truncated or corrupt weights file (names it); a pickled
            ``adapter_model.bin`` without ``allow_pickle=True``; tensors whose shapes do not fit (key,
            expected and found shape); keys the model expects but the file lacks (all listed); keys
            nothing in the model takes (all listed); with ``strict=False`` missing and unexpected keys
            are ignored. Also a model whose LoRA layers are merged.
        LoraConfigError: an invalid or unsupported field in ``adapter_config.json`` (names the field).
        LoraConversionError: the config's targets match nothing in the model (names the targets), or
            match layers loragen cannot adapt.
    """
    adapter = read_adapter(path, allow_pickle=allow_pickle)
    config = adapter.config
    existing = find_lora_layers(model)
    originals: dict[str, nn.Module] = {}  # path -> the plain module a new LoRA layer replaces
    new_layers: dict[str, LoraLayer] = {}
    if existing:
        merged = [p for p, layer in existing.items() if layer.merged]
        if merged:
            raise AdapterError(
                f"cannot load an adapter into merged LoRA layers ({', '.join(merged)}): "
                "call loragen.unmerge_adapter(model) first"
            )
        layers = existing
    else:
        originals = plan_conversion(model, config)
        # the new layers share the base parameters but are not installed yet: the model is unchanged
        new_layers = {p: convert_module(module, config, p) for p, module in originals.items()}
        layers = new_layers
    plan = _plan_load(model, adapter, layers, strict)

    # the factors of new layers need no backup: on failure the layers are dropped
    fresh = {id(t) for layer in new_layers.values() for t in layer.lora_parameters().values()}
    snapshot = _Snapshot(model, [t for t, _ in plan if id(t) not in fresh], existing)
    try:
        for p, layer in new_layers.items():
            set_submodule(model, p, layer)
        with torch.no_grad():
            for target, value in plan:
                target.copy_(value)
        for p, layer in existing.items():
            layer.lora_alpha = config.alpha_for(p)
            layer.use_rslora = config.use_rslora
            layer.scaling = config.scaling_for(p)
        setattr(model, CONFIG_ATTR, config)
        if trainable:
            mark_trainable(model, config)
        else:
            model.requires_grad_(False)
    except BaseException:
        for p, module in originals.items():
            set_submodule(model, p, module)
        snapshot.restore()
        raise
    return model
