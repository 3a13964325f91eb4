"""An adapter folder in peft's format: read into memory (or lazily) without touching any model, and
summarised for ``loragen inspect`` (from its config and safetensors header only).

It holds ``adapter_config.json`` and ``adapter_model.safetensors``, whose keys name tensors after peft's
wrapped model: ``base_model.model.<module>.lora_A.weight`` (a factor; suffixes from the registry's
Layouts), ``...lora_magnitude_vector`` (DoRA), ``...<module>.weight`` (saved in full),
``...<module>.base_layer.bias`` (a trained bias). A model key drops the prefix, peft's ``base_layer`` /
``modules_to_save`` infixes and the factor suffix. ``adapter_model.bin`` is read only with
``allow_pickle=True`` (unpickling can run arbitrary code).

A folder is read under its readers' lock (:func:`loragen.atomic.shared_lock`), so a loragen save, which
renames its files under the writers' lock, is never seen half-done. A save killed between renaming the
weights and the config leaves new weights beside the old config; the weights' metadata
:data:`CONFIG_DIGEST_KEY` (the SHA-256 of the config saved with them) then finds that save's complete
config among its temporaries. A config that matches no digest (edited by hand, written by another program)
is read as it is.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
import torch

from loragen.adapters.files import (
    SafetensorsReader,
    parse_json,
    read_safetensors_header,
)
from loragen.atomic import leftover_temporaries, shared_lock
from loragen.config import LoraConfig
from loragen.errors import AdapterError, LoraConfigError
from loragen.layouts import EMBEDDING, LAYOUTS, Layout, factor_suffixes
from loragen.plan import entry_for

__all__ = [
    "ADAPTER_CONFIG_NAME",
    "ADAPTER_PICKLE_NAME",
    "ADAPTER_WEIGHTS_NAME",
    "CONFIG_DIGEST_KEY",
    "MAGNITUDE",
    "PEFT_PREFIX",
    "Adapter",
    "AdapterKey",
    "LoraFactors",
    "ModuleSummary",
    "TensorSummary",
    "AdapterSummary",
    "inspect_adapter",
    "format_summary",
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
# safetensors metadata of a saved adapter's weights: the SHA-256 (hex) of the adapter_config.json saved with them
CONFIG_DIGEST_KEY = "loragen_config_sha256"


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


def _check_folder(folder: Path) -> None:
    if not folder.is_dir():
        what = "does not exist" if not folder.exists() else "is not a folder"
        raise AdapterError(
            f"{folder} {what}: an adapter is a folder with {ADAPTER_CONFIG_NAME} and {ADAPTER_WEIGHTS_NAME}"
        )


def _saved_digest(weights_path: Path) -> str | None:
    """The config digest in the metadata of the weights at ``weights_path``; None where there is none (a
    file another program wrote) or the file cannot be read (:func:`read_adapter` then says why)."""
    try:
        return read_safetensors_header(weights_path).metadata.get(CONFIG_DIGEST_KEY)
    except (OSError, AdapterError):
        return None


def _config_bytes(config_path: Path, digest: str | None) -> bytes:
    """The bytes of the config saved with weights whose digest is ``digest`` (lock held): the file's, else a
    killed save's complete temporary that matches; the file's when none matches (a config edited by hand)."""
    try:
        data = config_path.read_bytes()
    except OSError as exc:
        raise AdapterError(f"{config_path}: cannot be read ({exc.strerror or exc})") from None
    if digest is None or hashlib.sha256(data).hexdigest() == digest:
        return data
    for leftover in leftover_temporaries(config_path):
        with contextlib.suppress(OSError):
            saved = leftover.read_bytes()
            if hashlib.sha256(saved).hexdigest() == digest:
                return saved
    return data


def _read_config(folder: Path) -> tuple[LoraConfig, dict[str, Any]]:
    """:func:`read_adapter_config`, for a folder checked and locked by the caller."""
    config_path = folder / ADAPTER_CONFIG_NAME
    if not config_path.exists():
        raise AdapterError(f"{folder}: no {ADAPTER_CONFIG_NAME} (not an adapter folder)")
    raw = _config_bytes(config_path, _saved_digest(folder / ADAPTER_WEIGHTS_NAME))
    data = parse_json(raw, str(config_path), AdapterError)
    if not isinstance(data, dict):
        raise AdapterError(
            f"{config_path}: expected a JSON object of peft's fields, got a {type(data).__name__}"
        )
    _check_ranks(data, config_path)
    return LoraConfig.from_peft(data, source=str(config_path)), data


def read_adapter_config(path: str | os.PathLike[str]) -> tuple[LoraConfig, dict[str, Any]]:
    """Read ``adapter_config.json`` from the adapter folder ``path``: the :class:`LoraConfig` and the raw JSON
    (the config saved with the folder's weights: see the module's docstring).

    Raises:
        AdapterError: the folder or the file is missing, or the file is not a JSON object (names file:line).
        LoraConfigError: a field is invalid or an unsupported peft feature is switched on (names the field).
    """
    folder = Path(path)
    _check_folder(folder)
    with shared_lock(folder):
        return _read_config(folder)


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


def read_adapter(path: str | os.PathLike[str], *, allow_pickle: bool = False, lazy: bool = False) -> Adapter:
    """Read an adapter folder, checking every key and that each module's factors are a LoRA pair
    (``lazy=True``: only the safetensors header; tensors are read on access).

    Raises:
        AdapterError: missing files, a truncated or corrupt weights file (names the file), a pickled
            ``adapter_model.bin`` without ``allow_pickle=True``, unsupported or inconsistent tensors.
        LoraConfigError: an invalid or unsupported config field (names the field).
    """
    folder = Path(path)
    _check_folder(folder)
    with shared_lock(folder):  # no save renames a file meanwhile
        return _read_adapter(folder, allow_pickle, lazy)


def _read_adapter(folder: Path, allow_pickle: bool, lazy: bool) -> Adapter:
    config, config_dict = _read_config(folder)
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

    keys = {key: info for key in tensors if (info := parse_adapter_key(key)) is not None}
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


_DTYPE_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}
# the config fields shown, in this order
_CONFIG_FIELDS = """peft_type base_model_name_or_path task_type target_modules target_parameters exclude_modules
r lora_alpha use_rslora lora_dropout bias modules_to_save fan_in_fan_out rank_pattern alpha_pattern
layers_to_transform layers_pattern""".split()


@dataclass(frozen=True)
class ModuleSummary:
    """One LoRA-adapted module: ``kind`` is linear, embedding, conv1d, conv2d (from the factor shapes)."""

    module: str
    kind: str
    r: int
    alpha: float
    scale: float
    in_features: int
    out_features: int
    params: int
    dtype: str


@dataclass(frozen=True)
class TensorSummary:
    """A tensor saved in full (a module to save, a trained bias, a saved embedding base weight)."""

    key: str
    shape: tuple[int, ...]
    params: int
    dtype: str


@dataclass(frozen=True)
class AdapterSummary:
    """Everything ``loragen inspect`` shows."""

    folder: str
    weights_file: str
    file_size: int
    config: dict[str, Any]
    modules: tuple[ModuleSummary, ...]
    full_tensors: tuple[TensorSummary, ...]

    @property
    def lora_params(self) -> int:
        return sum(m.params for m in self.modules)

    @property
    def full_params(self) -> int:
        return sum(t.params for t in self.full_tensors)

    @property
    def dtypes(self) -> tuple[str, ...]:
        return tuple(sorted({m.dtype for m in self.modules} | {t.dtype for t in self.full_tensors}))

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable dictionary (the output of ``loragen inspect --json``)."""
        return {
            "folder": self.folder,
            "weights_file": self.weights_file,
            "file_size": self.file_size,
            "config": self.config,
            "totals": {
                "modules": len(self.modules),
                "lora_params": self.lora_params,
                "full_params": self.full_params,
                "params": self.lora_params + self.full_params,
                "dtypes": list(self.dtypes),
            },
            "modules": [asdict(m) for m in self.modules],
            "full_tensors": [{**asdict(t), "shape": list(t.shape)} for t in self.full_tensors],
        }


def inspect_adapter(path: str | os.PathLike[str], *, allow_pickle: bool = False) -> AdapterSummary:
    """Summarise the adapter folder ``path`` from its config and weights header.

    Raises:
        AdapterError: missing files, a truncated or corrupt weights file, a pickle without
            ``allow_pickle=True``, inconsistent LoRA tensors.
        LoraConfigError: an invalid or unsupported config field.
    """
    adapter = read_adapter(path, allow_pickle=allow_pickle, lazy=True)
    shapes = adapter.shapes

    def dtype(key: str) -> str:
        name = adapter.dtype_name(key)
        return _DTYPE_NAMES.get(name, name.lower())

    full = [
        TensorSummary(key, shapes[key], math.prod(shapes[key]), dtype(key))
        for key, info in sorted(adapter.keys.items())
        if not info.is_lora
    ]
    modules = []
    for module, factors in adapter.lora_modules().items():
        if factors.key_a is None or factors.key_b is None:
            raise AdapterError(
                f"{adapter.weights_path}: {module} has only {', '.join(factors.keys)}, expected both LoRA factors"
            )
        a_shape, b_shape = shapes[factors.key_a], shapes[factors.key_b]
        entry = entry_for(adapter.config, module)
        modules.append(
            ModuleSummary(
                module=module,
                kind="embedding"
                if EMBEDDING in factors.layouts
                else {2: "linear", 3: "conv1d"}.get(len(a_shape), f"conv{len(a_shape) - 2}d"),
                r=a_shape[0],
                alpha=entry.lora_alpha,
                scale=entry.scaling,
                in_features=math.prod(a_shape[1:]),
                out_features=b_shape[0],
                params=math.prod(a_shape) + math.prod(b_shape),
                dtype=dtype(factors.key_a),
            )
        )
    shown = {name: adapter.config_dict.get(name) for name in _CONFIG_FIELDS if name in adapter.config_dict}
    weights = adapter.weights_path
    return AdapterSummary(
        str(adapter.folder), str(weights), weights.stat().st_size, shown, tuple(modules), tuple(full)
    )


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _table(header: list[str], rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))
        ).rstrip()

    return [line(header), line(["-" * w for w in widths]), *map(line, rows)]


def format_summary(summary: AdapterSummary) -> str:
    """The human-readable report ``loragen inspect`` prints: config, one row per module, totals."""
    lines = [f"adapter: {summary.folder}", f"weights: {summary.weights_file} ({_size(summary.file_size)})"]
    for name, value in summary.config.items():
        if value not in (None, {}, [], False) or name in ("use_rslora", "r", "lora_alpha"):
            lines.append(f"  {name}: {value}")
    lines.append("")
    rows = [
        [
            m.module,
            m.kind,
            str(m.r),
            f"{m.alpha:g}",
            f"{m.scale:.4g}",
            f"{m.in_features}->{m.out_features}",
            f"{m.params:,}",
            m.dtype,
        ]
        for m in summary.modules
    ]
    lines += _table(
        ["module", "type", "r", "alpha", "scale", "in->out", "params", "dtype"], rows, {2, 3, 4, 6}
    )
    if summary.full_tensors:
        lines += ["", "saved in full:"]
        lines += _table(
            ["key", "shape", "params", "dtype"],
            [[t.key, "x".join(map(str, t.shape)), f"{t.params:,}", t.dtype] for t in summary.full_tensors],
            {2},
        )
    lines += [
        "",
        f"{len(summary.modules)} LoRA modules, {summary.lora_params:,} LoRA parameters"
        + (f" + {summary.full_params:,} saved in full" if summary.full_tensors else "")
        + f"; dtype {', '.join(summary.dtypes) or '-'}; file {_size(summary.file_size)}",
    ]
    return "\n".join(lines)
