"""Deciding every change a merge makes, from the checkpoint's headers and the adapter, before writing.

Each adapter tensor is mapped to its own checkpoint tensor (:mod:`loragen.adapters.key_map`); each LoRA
module's factors must fit that tensor's shape under one of the layouts of its factor names (from
:mod:`loragen.registry`: ``Layout.fits`` and ``Layout.weight_shape``), and its rank must be the config's.
Every problem is collected and reported together; nothing has been written when one is found.
"""

from __future__ import annotations

import functools
import importlib
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from loragen.adapters.checkpoint import Checkpoint, KeyMap, resolve_keys
from loragen.adapters.files import SafetensorsReader, TensorEntry
from loragen.adapters.folder import Adapter, LoraFactors
from loragen.config import LoraConfig
from loragen.errors import MergeError
from loragen.parameter_targets import name_matches
from loragen.registry import PLAIN, TRANSPOSED, Layout

__all__ = ["MERGEABLE_DTYPES", "MergeOp", "MergePlan", "check_adapter_values", "plan_merge"]

MERGEABLE_DTYPES = ("F16", "BF16", "F32", "F64")


@dataclass(frozen=True)
class MergeOp:
    """One change to one checkpoint tensor.

    ``kind`` is ``"lora"`` (add ``scaling * B @ A``; ``layout`` is the registry layout in which the delta
    lines up with the stored weight) or ``"replace"`` (the adapter holds the whole tensor:
    modules_to_save, a trained bias, peft's saved embedding base weight). Replacements are applied
    before LoRA deltas.
    """

    target: str
    kind: Literal["lora", "replace"]
    source_keys: tuple[str, ...]
    scaling: float = 0.0
    layout: Layout = PLAIN


@dataclass(frozen=True)
class MergePlan:
    """Everything a merge will do, decided from headers and the adapter before a byte is written.

    ``ops`` maps each checkpoint tensor to its changes; ``keys`` each adapter path (model key) to the
    checkpoint key it changes (one-to-one); ``mapping`` describes the key map used (for messages).
    """

    checkpoint: Checkpoint
    adapter: Adapter
    ops: dict[str, tuple[MergeOp, ...]]
    keys: dict[str, str]
    mapping: str


def _targets(adapter: Adapter) -> dict[str, list[str]]:
    """``{adapter path the merge changes: the file keys behind it}``: each LoRA module's ``weight``,
    and the key of every tensor saved in full."""
    targets = {f"{module}.weight": list(factors.keys) for module, factors in adapter.lora_modules().items()}
    for key, info in sorted(adapter.keys.items()):
        if not info.is_lora:
            targets.setdefault(info.model_key, []).append(key)
    return targets


def _fitting(
    factors: LoraFactors, a: tuple[int, ...], b: tuple[int, ...], entry: TensorEntry
) -> list[Layout]:
    return [lay for lay in factors.layouts if lay.fits(a, b) and lay.weight_shape(a, b) == entry.shape]


def _layout(
    factors: LoraFactors,
    a: tuple[int, ...],
    b: tuple[int, ...],
    entry: TensorEntry,
    config: LoraConfig,
    evidence: dict[str, set[Layout]],
    architecture: Callable[[], Layout | None],
) -> Layout:
    """The layout in which ``B @ A`` lines up with ``entry``.

    A square weight fits both ``nn.Linear``'s (out, in) and transformers ``Conv1D``'s (in, out) layout.
    ``load_adapter`` (and peft) follow the layer's type there, never ``fan_in_fan_out``, so the merge
    does too, from the adapter's other modules whose shapes tell (``evidence``: the layouts of the
    unambiguous modules, by leaf name and under ``"*"`` for all): modules of the same name first, then
    all of them. With no evidence, ``fan_in_fan_out=false`` means ``nn.Linear``; ``true`` (peft writes
    it for ``Conv1D`` models but ignores it on an ``nn.Linear``) follows the checkpoint's architecture
    (``architecture()``: TRANSPOSED when its transformers module uses ``Conv1D``), and is refused when
    that is unknown.

    Raises:
        MergeError: no layout of the module's factor names gives the tensor's shape (names both shapes),
            or a square weight whose layer type cannot be told (names the module).
    """
    fits = _fitting(factors, a, b, entry)
    if len(fits) > 1:
        leaf = factors.module.rpartition(".")[2]
        for seen in (evidence.get(leaf, set()), evidence.get("*", set())):
            decided = [lay for lay in fits if lay in seen]
            if len(seen) == 1 and decided:
                return decided[0]
        hint = architecture() if config.fan_in_fan_out else PLAIN
        if hint is not None and hint in fits:
            return hint
        if config.fan_in_fan_out:
            raise MergeError(
                f"{entry.name}: a square weight {list(entry.shape)} with fan_in_fan_out=true, and neither the "
                f"checkpoint's config.json architecture nor another module of the adapter shows whether {factors.module} is an nn.Linear (fan_in_fan_out is "
                "ignored there, by peft and load_adapter) or a transformers Conv1D (weight stored (in, out)); "
                "set fan_in_fan_out to false in adapter_config.json if it is an nn.Linear, or merge in memory: "
                "load_adapter(model, ADAPTER), merge_and_unload(model), model.save_pretrained(OUT)"
            )
        fits = [lay for lay in fits if lay is PLAIN] or fits[:1]
    if fits:
        return fits[0]
    needed = " or ".join(
        f"{list(lay.weight_shape(a, b))} ({lay.name})" for lay in factors.layouts if lay.fits(a, b)
    )
    a_name, b_name = factors.names
    raise MergeError(
        f"{entry.name}: the checkpoint tensor has shape {list(entry.shape)} but the adapter's "
        f"{factors.module} ({a_name} {a}, {b_name} {b}) needs {needed or 'a LoRA pair'}"
    )


def _evidence(adapter: Adapter, checkpoint: Checkpoint, keys: dict[str, str]) -> dict[str, set[Layout]]:
    """The layouts of the LoRA modules whose shapes fit exactly one of PLAIN and TRANSPOSED, by leaf name
    and under ``"*"`` (see :func:`_layout`)."""
    evidence: dict[str, set[Layout]] = {}
    for module, factors in adapter.lora_modules().items():
        if factors.key_a is None or factors.key_b is None or TRANSPOSED not in factors.layouts:
            continue
        target = keys.get(f"{module}.weight")
        if target is None or target not in checkpoint.owner:
            continue
        fits = _fitting(
            factors, adapter.shapes[factors.key_a], adapter.shapes[factors.key_b], checkpoint.entry(target)
        )
        if len(fits) == 1:
            for name in (module.rpartition(".")[2], "*"):
                evidence.setdefault(name, set()).add(fits[0])
    return evidence


def _architecture_layout(checkpoint: Checkpoint) -> Layout | None:
    """TRANSPOSED if the checkpoint's architectures (its ``config.json``) are transformers classes whose
    modeling module uses ``Conv1D``, PLAIN if they are classes whose module does not, else None."""
    if not checkpoint.architectures:
        return None
    try:
        transformers = importlib.import_module("transformers")
        classes = [getattr(transformers, name, None) for name in checkpoint.architectures]
    except Exception:  # transformers missing, or a lazy import failing on an optional dependency
        return None
    if any(cls is None for cls in classes):
        return None
    uses = {hasattr(sys.modules.get(cls.__module__), "Conv1D") for cls in classes}
    return (TRANSPOSED if uses.pop() else PLAIN) if len(uses) == 1 else None


_FLOAT_DTYPES = frozenset(MERGEABLE_DTYPES)


def _adapter_dtype(adapter: Adapter, key: str) -> str:
    """The safetensors dtype name of adapter tensor ``key`` (e.g. ``"F32"``), read from the header
    when the adapter is read lazily."""
    if isinstance(adapter.tensors, SafetensorsReader):
        return adapter.tensors.header.tensors[key].dtype
    dtype = adapter.tensors[key].dtype
    names = {"float16": "F16", "bfloat16": "BF16", "float32": "F32", "float64": "F64"}
    return names.get(str(dtype).removeprefix("torch."), str(dtype).removeprefix("torch."))


def _dtype_problem(adapter: Adapter, key: str, entry: TensorEntry, lora: bool) -> str | None:
    """Why adapter tensor ``key`` cannot go into ``entry`` (None if it can): LoRA factors must be
    floating point; a replacement must be floating point for a floating-point tensor, else of its dtype."""
    dtype = _adapter_dtype(adapter, key)
    if dtype in _FLOAT_DTYPES:
        if lora or entry.dtype in _FLOAT_DTYPES:
            return None
    elif not lora and dtype == entry.dtype:
        return None
    accepted = "a floating-point dtype" if lora or entry.dtype in _FLOAT_DTYPES else entry.dtype
    return (
        f"{key}: dtype {dtype} in {adapter.weights_path}, expected {accepted} ({', '.join(MERGEABLE_DTYPES)} "
        "for floating point); loragen merge does not cast it silently"
    )


def check_adapter_values(plan: MergePlan, *, allow_nonfinite: bool = False, block: int = 1 << 22) -> None:
    """Refuse adapter tensors holding NaN or inf before anything is written (unless ``allow_nonfinite``).

    Reads every adapter tensor the plan uses once, ``block`` elements' worth of rows at a time.

    Raises:
        MergeError: a tensor holds NaN or inf (names every such key and the count).
    """
    if allow_nonfinite:
        return
    adapter = plan.adapter
    used = sorted({key for ops in plan.ops.values() for op in ops for key in op.source_keys})
    bad = []
    for key in used:
        if _adapter_dtype(adapter, key) not in _FLOAT_DTYPES:
            continue
        shape = adapter.shapes[key]
        rows = shape[0] if shape else 1
        step = max(1, block // max(1, math.prod(shape[1:])))
        count = 0
        for start in range(0, rows, step):
            if isinstance(adapter.tensors, SafetensorsReader):
                part = adapter.tensors.rows(key, start, min(rows, start + step))
            else:
                tensor = adapter.tensors[key]
                part = tensor[start : start + step] if tensor.dim() else tensor
            count += int((~torch.isfinite(part)).sum())
        if count:
            bad.append(f"{key} ({count} NaN/inf values)")
    if bad:
        raise MergeError(
            f"{adapter.weights_path}: non-finite adapter values would be written into the merged weights: "
            + ", ".join(bad)
            + "; nothing was written (pass --allow-nonfinite / allow_nonfinite=True to merge them anyway)"
        )


def _refuse_parameter_targets(adapter: Adapter) -> None:
    """Raise when the adapter adapts parameters (``target_parameters``): which factors belong to which
    parameter follows the module's parameter registration order (peft nests its wrappers in it), which a
    checkpoint does not record, so a streaming merge could add an update to the wrong tensor."""
    entries = adapter.config.target_parameters
    if not entries:
        return
    names = {entry.rpartition(".")[2] for entry in entries}
    keys = sorted(
        key
        for key, info in adapter.keys.items()
        if info.is_lora
        and any(name_matches(entries, f"{info.module.replace('.base_layer', '')}.{name}") for name in names)
    )
    shown = ", ".join(keys[:6]) + (f", ... ({len(keys) - 6} more)" if len(keys) > 6 else "")
    raise MergeError(
        f"the adapter adapts parameters directly (target_parameters={list(entries)}; keys {shown or 'none'}): "
        "which factors belong to which parameter follows the module's parameter order in the model, which a "
        "checkpoint does not record, so loragen merge does not merge them; nothing was written. Merge in "
        "memory instead: load_adapter(model, ADAPTER), merge_and_unload(model), model.save_pretrained(OUT)"
    )


def plan_merge(checkpoint: Checkpoint, adapter: Adapter, key_map: KeyMap | None = None) -> MergePlan:
    """Decide every change the merge makes, checking that the adapter fits the checkpoint.

    Args:
        key_map: explicit prefix rules from adapter paths to checkpoint keys; by default only the paths
            as they are and the checkpoint's known wrapper are accepted (see :mod:`~loragen.adapters.key_map`).

    Raises:
        MergeError: adapter tensors with no checkpoint tensor or sharing one (all listed, by key), shape
            or rank mismatches, non-float target weights, adapter tensors of a dtype that would be cast
            (LoRA factors must be floating point), a square weight whose layer type cannot be told (see
            :func:`_layout`); nothing has been written.
    """
    config = adapter.config
    _refuse_parameter_targets(adapter)
    if config.use_dora:
        raise MergeError(
            f"{adapter.folder}: a DoRA adapter (use_dora=true) cannot be merged by streaming: each output's "
            "scale m / ||W + s B A|| needs the whole weight. Load it (loragen.load_adapter) and call "
            "loragen.merge_and_unload, then save the model"
        )
    used_map, keys = resolve_keys(_targets(adapter), checkpoint, key_map)
    evidence = _evidence(adapter, checkpoint, keys)
    architecture = functools.cache(lambda: _architecture_layout(checkpoint))
    ops: dict[str, list[MergeOp]] = {}
    problems: list[str] = []
    for key, info in sorted(adapter.keys.items()):
        if info.is_lora:
            continue
        target = keys[info.model_key]
        entry = checkpoint.entry(target)
        shape = adapter.shapes[key]
        if shape != entry.shape:
            problems.append(f"{key}: shape {list(shape)}, the checkpoint's {target} has {list(entry.shape)}")
        elif (problem := _dtype_problem(adapter, key, entry, lora=False)) is not None:
            problems.append(problem)
        elif entry.torch_dtype is None:
            problems.append(f"{target}: dtype {entry.dtype} is not supported by this torch")
        elif any(op.kind == "replace" for op in ops.get(target, ())):
            problems.append(f"{key}: the adapter holds {target} twice")
        else:
            ops.setdefault(target, []).append(MergeOp(target, "replace", (key,)))

    for module, factors in adapter.lora_modules().items():
        if factors.key_a is None or factors.key_b is None:
            problems.append(
                f"{module}: the adapter has only {', '.join(factors.keys)}, not both LoRA factors"
            )
            continue
        a, b = adapter.shapes[factors.key_a], adapter.shapes[factors.key_b]
        target = keys[f"{module}.weight"]
        entry = checkpoint.entry(target)
        rank = config.rank_for(module)
        if entry.dtype not in MERGEABLE_DTYPES:
            problems.append(
                f"{target}: dtype {entry.dtype} cannot take a LoRA delta "
                f"(expected one of {', '.join(MERGEABLE_DTYPES)})"
            )
            continue
        dtype_problems = [
            p for k in (factors.key_a, factors.key_b) if (p := _dtype_problem(adapter, k, entry, lora=True))
        ]
        if dtype_problems:
            problems.extend(dtype_problems)
            continue
        if a[0] != rank:
            problems.append(
                f"{factors.key_a}: rank {a[0]}, but the adapter config gives {module} rank {rank} "
                "(check r / rank_pattern)"
            )
            continue
        try:
            layout = _layout(factors, a, b, entry, config, evidence, architecture)
        except MergeError as exc:
            problems.append(str(exc))
            continue
        ops.setdefault(target, []).append(
            MergeOp(target, "lora", (factors.key_a, factors.key_b), config.scaling_for(module), layout)
        )
    if problems:
        raise MergeError(
            f"the adapter does not fit the checkpoint {checkpoint.root}:\n  " + "\n  ".join(problems)
        )
    ordered = {t: tuple(sorted(o, key=lambda op: op.kind != "replace")) for t, o in ops.items()}
    return MergePlan(checkpoint, adapter, ordered, keys, used_map.describe())
