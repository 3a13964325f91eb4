"""Deciding every change a merge makes, from the checkpoint's headers and the adapter, before writing.

Each adapter tensor is mapped to its own checkpoint tensor (:mod:`loragen.adapters.key_map`); each LoRA
module's factors must fit that tensor's shape under one of the layouts of its factor names (from
:mod:`loragen.registry`: ``Layout.fits`` and ``Layout.weight_shape``), and its rank must be the config's.
Every problem is collected and reported together; nothing has been written when one is found.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from loragen.adapters.checkpoint import Checkpoint
from loragen.adapters.folder import Adapter
from loragen.adapters.key_map import KeyMap, resolve_keys
from loragen.adapters.keys import LoraFactors
from loragen.adapters.safetensors_file import TensorEntry
from loragen.config import LoraConfig
from loragen.errors import MergeError
from loragen.parameter_targets import name_matches
from loragen.registry import PLAIN, TRANSPOSED, Layout

__all__ = ["MERGEABLE_DTYPES", "MergeOp", "MergePlan", "plan_merge"]

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


def _layout(
    factors: LoraFactors, a: tuple[int, ...], b: tuple[int, ...], entry: TensorEntry, config: LoraConfig
) -> Layout:
    """The layout in which ``B @ A`` lines up with ``entry``; a square Conv1D weight ((in, out) and
    (out, in) look alike) is told apart by the config's ``fan_in_fan_out``.

    Raises:
        MergeError: no layout of the module's factor names gives the tensor's shape (names both shapes).
    """
    fits = [lay for lay in factors.layouts if lay.fits(a, b) and lay.weight_shape(a, b) == entry.shape]
    if len(fits) > 1:
        preferred = TRANSPOSED if config.fan_in_fan_out else PLAIN
        fits = [lay for lay in fits if lay is preferred] or fits[:1]
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
            or rank mismatches, non-float target weights; nothing has been written.
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
        if a[0] != rank:
            problems.append(
                f"{factors.key_a}: rank {a[0]}, but the adapter config gives {module} rank {rank} "
                "(check r / rank_pattern)"
            )
            continue
        try:
            layout = _layout(factors, a, b, entry, config)
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
