"""``loragen inspect``: what an adapter folder holds (targets, ranks, alphas, scales, sizes, dtypes),
read from its config and safetensors header only, so instant for adapters of any size.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from typing import Any

from loragen.adapters.folder import read_adapter
from loragen.errors import AdapterError
from loragen.plan import entry_for
from loragen.registry import EMBEDDING

__all__ = ["ModuleSummary", "TensorSummary", "AdapterSummary", "inspect_adapter", "format_summary"]

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


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    raise AssertionError("unreachable")


def _table(header: list[str], rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))
        ).rstrip()

    return [line(header), line(["-" * w for w in widths]), *map(line, rows)]


def format_summary(summary: AdapterSummary) -> str:
    """The human-readable report ``loragen inspect`` prints: config, one row per module, totals."""
    lines = [f"adapter: {summary.folder}"]
    lines.append(f"weights: {summary.weights_file} ({_size(summary.file_size)})")
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
