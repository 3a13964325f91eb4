"""``loragen merge``: merge an adapter into a safetensors checkpoint offline, without the model class.

The checkpoint is opened from its headers alone (:func:`open_checkpoint`); each adapter tensor is mapped
to its own checkpoint tensor (:func:`resolve_keys`: one to one, explained, never guessed) and every
change is decided before a byte is written (:func:`plan_merge`). Each output file gets the input's header
verbatim (same names, dtypes, shapes, so the same offsets); untouched byte ranges are copied, and each
touched tensor is merged a block of rows at a time in fp32 and rounded once. Peak memory is a few blocks
plus one module's factors. Each output file appears atomically (:mod:`loragen.atomic`); an output folder's
``loragen_merge.json`` lists the files the merge wrote, the only ones a later merge replaces or removes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import json
import math
import os
import re
import shutil
import stat
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from io import BufferedReader
from pathlib import Path
from typing import BinaryIO, Literal

import torch

from loragen.adapters.files import (
    SafetensorsHeader,
    SafetensorsReader,
    TensorEntry,
    read_json_file,
    read_safetensors_header,
)
from loragen.adapters.folder import Adapter, LoraFactors, read_adapter
from loragen.atomic import WriteError, atomic_file, atomic_write_bytes, mount_points, writers_lock
from loragen.config import ALL_LINEAR, LoraConfig
from loragen.errors import AdapterError, MergeError
from loragen.layouts import PLAIN, TRANSPOSED, Layout
from loragen.plan import Candidate, entry_for, resolve_candidates, targets_parameters_of

__all__ = [
    "MERGEABLE_DTYPES",
    "MERGE_MARKER_NAME",
    "Checkpoint",
    "KeyMap",
    "MergeError",
    "MergeMarker",
    "MergeOp",
    "MergePlan",
    "MergeReport",
    "PrefixRule",
    "check_adapter_values",
    "explicit_key_map",
    "merge_checkpoint",
    "open_checkpoint",
    "plan_merge",
    "read_marker",
    "resolve_keys",
]

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
# Untouched bytes are copied, and merged tensors computed, in blocks of about this many bytes.
_BLOCK_BYTES = 4 << 20

INDEX_SUFFIX = ".safetensors.index.json"
MODEL_CONFIG_NAME = "config.json"
# every folder loragen merge writes holds this file, listing the files it wrote (see MergeMarker)
MERGE_MARKER_NAME = "loragen_merge.json"


@dataclass(frozen=True)
class Checkpoint:
    """A safetensors checkpoint: ``files`` in index order, their ``headers``, ``owner`` (tensor name ->
    file); ``architectures`` from the ``config.json`` beside it, ``config_note`` where they come from or
    why there are none."""

    root: Path
    files: tuple[Path, ...]
    index_path: Path | None
    headers: dict[Path, SafetensorsHeader]
    owner: dict[str, Path]
    architectures: tuple[str, ...] = ()
    config_note: str = ""

    def entry(self, name: str) -> TensorEntry:
        """The header entry of tensor ``name`` (``KeyError`` if the checkpoint has no such tensor)."""
        return self.headers[self.owner[name]].tensors[name]


def _read_header(path: Path) -> SafetensorsHeader:
    try:
        return read_safetensors_header(path)
    except AdapterError as exc:
        raise MergeError(str(exc)) from None


def _architectures(folder: Path) -> tuple[tuple[str, ...], str]:
    """The ``architectures`` of ``folder/config.json`` and a note on where they come from."""
    path = folder / MODEL_CONFIG_NAME
    if not path.is_file():
        return (), f"no {MODEL_CONFIG_NAME} beside the checkpoint"
    try:
        data = read_json_file(path, MergeError)
    except MergeError as exc:
        return (), f"{path} cannot be read ({exc})"
    names = (data.get("architectures") or []) if isinstance(data, dict) else None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        return (), f"{path}: 'architectures' is not a list of class names"
    if not names:
        return (), f"{path} names no architecture"
    return tuple(names), str(path)


def _weight_map(index_path: Path) -> dict[str, str]:
    """The ``weight_map`` of a shard index; MergeError unless every shard is a plain file name (a path
    would be read from, and written to, somewhere else than the checkpoint folder)."""
    data = read_json_file(index_path, MergeError)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        raise MergeError(
            f'{index_path}: not a safetensors index (expected {{"weight_map": {{tensor: shard file}}}})'
        )
    bad = {
        name: shard
        for name, shard in weight_map.items()
        if not isinstance(shard, str)
        or not shard
        or shard in (".", "..")
        or any(c in shard for c in "/\\\0")
        or not shard.endswith(".safetensors")
    }
    if bad:
        shown = ", ".join(f"{name!r}: {shard!r}" for name, shard in list(bad.items())[:5])
        raise MergeError(
            f"{index_path}: weight_map values must be shard file names in the same folder, ending in "
            f".safetensors (no folders, no paths); got {shown}"
            + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        )
    return weight_map


def open_checkpoint(base: str | os.PathLike[str]) -> Checkpoint:
    """Read the headers of the checkpoint at ``base``: a ``.safetensors`` file, or a folder holding one
    or shards with a ``*.safetensors.index.json``; ``config.json`` there gives its architectures.

    Raises:
        MergeError: nothing to read, a malformed index, missing shards or tensors, a corrupt header.
    """
    root = Path(base)
    if not root.is_file() and not root.is_dir():
        raise MergeError(
            f"{root}: no such file or folder (expected a .safetensors file or a folder of shards)"
        )
    architectures = _architectures(root if root.is_dir() else root.parent)
    indexes = sorted(root.glob("*" + INDEX_SUFFIX)) if root.is_dir() else []
    if len(indexes) > 1:
        raise MergeError(
            f"{root}: several index files ({', '.join(p.name for p in indexes)}); pass one model's file"
        )
    if not indexes:
        singles = sorted(root.glob("*.safetensors")) if root.is_dir() else [root]
        if len(singles) != 1:
            found = ", ".join(p.name for p in singles) or "no .safetensors file"
            raise MergeError(
                f"{root}: expected one .safetensors file, or shards with a *{INDEX_SUFFIX} index; found {found}"
            )
        header = _read_header(singles[0])
        owner = dict.fromkeys(header.tensors, singles[0])
        return Checkpoint(root, (singles[0],), None, {singles[0]: header}, owner, *architectures)
    index_path = indexes[0]
    weight_map = _weight_map(index_path)
    files = tuple(dict.fromkeys(root / name for name in weight_map.values()))
    missing = [p.name for p in files if not p.is_file()]
    if missing:
        raise MergeError(f"{index_path}: shards missing from {root}: {', '.join(missing)}")
    headers = {p: _read_header(p) for p in files}
    owner = {name: root / shard for name, shard in weight_map.items()}
    absent = [name for name, path in owner.items() if name not in headers[path].tensors]
    if absent:
        raise MergeError(
            f"{index_path}: tensors listed in the index but not in their shard: {', '.join(absent[:10])}"
        )
    return Checkpoint(root, files, index_path, headers, owner, *architectures)


@dataclass(frozen=True)
class PrefixRule:
    """Replace the leading path ``old`` (whole components; ``""``: every path) with ``new``."""

    old: str
    new: str

    def matches(self, path: str) -> bool:
        """Whether ``path`` is ``old`` or begins with ``old.``."""
        return not self.old or path == self.old or path.startswith(self.old + ".")

    def apply(self, path: str) -> str:
        """``path`` with its leading ``old`` replaced by ``new`` (assumes :meth:`matches`)."""
        tail = path[len(self.old) :].removeprefix(".") if self.old else path
        return f"{self.new}.{tail}" if self.new and tail else self.new or tail

    def describe(self) -> str:
        """``'old.' -> 'new.'``; ``'P.' removed`` / ``'P.' added`` when one side is empty."""
        if not self.new:
            return f"{self.old + '.'!r} removed"
        if not self.old:
            return f"{self.new + '.'!r} added"
        return f"{self.old + '.'!r} -> {self.new + '.'!r}"


@dataclass(frozen=True)
class KeyMap:
    """Prefix rules from adapter paths to checkpoint keys, and why they apply (``reason``)."""

    rules: tuple[PrefixRule, ...] = ()
    reason: str = ""

    def apply(self, path: str) -> str:
        """The checkpoint key for ``path``: rewritten by the matching rule with the longest ``old``."""
        matching = [rule for rule in self.rules if rule.matches(path)]
        return max(matching, key=lambda rule: len(rule.old)).apply(path) if matching else path

    def describe(self) -> str:
        """One line for messages and the CLI's report."""
        if not self.rules:
            return "adapter paths used as they are"
        rules = "; ".join(rule.describe() for rule in self.rules)
        return f"adapter paths with {rules}" + (f" ({self.reason})" if self.reason else "")


IDENTITY = KeyMap()


def _path(text: str, what: str) -> str:
    path = text.strip().removesuffix(".")
    if path.startswith(".") or ".." in path or any(c.isspace() for c in path):
        raise MergeError(f"{what}: {text!r} is not a dotted path prefix (like 'model' or 'model.layers')")
    return path


def explicit_key_map(
    key_map: Mapping[str, str] | None = None, strip_prefix: str | Iterable[str] | None = None
) -> KeyMap | None:
    """The :class:`KeyMap` of ``key_map`` ``{OLD: NEW}`` rewrites and ``strip_prefix`` (``P -> ""``);
    ``None`` when neither is given.

    Raises:
        MergeError: a prefix that is not a dotted path, a rule that changes nothing, an ``OLD`` twice.
    """
    strips = [strip_prefix] if isinstance(strip_prefix, str) else list(strip_prefix or ())
    pairs = [(_path(p, "strip_prefix"), "") for p in strips]
    pairs += [(_path(old, "key_map"), _path(new, "key_map")) for old, new in (key_map or {}).items()]
    if not pairs:
        return None
    idle = [old for old, new in pairs if old == new]
    if idle:
        raise MergeError(f"the key map rule {idle[0]!r} -> {idle[0]!r} changes nothing; leave it out")
    olds = [old for old, _ in pairs]
    twice = sorted({old for old in olds if olds.count(old) > 1})
    if twice:
        raise MergeError(
            f"the key map rewrites {', '.join(map(repr, twice))} more than once; give each prefix once"
        )
    return KeyMap(tuple(PrefixRule(old, new) for old, new in pairs), "as given")


def _candidates(checkpoint: Checkpoint) -> tuple[list[KeyMap], str]:
    """The key maps of the checkpoint's known wrapper (its architectures' ``base_model_prefix``, removed
    and added), and a note saying where it comes from or why there is none."""
    if not checkpoint.architectures:
        return [], checkpoint.config_note
    names = ", ".join(checkpoint.architectures)
    try:
        transformers = importlib.import_module("transformers")
    except ImportError:
        return [], f"transformers is not installed, so the wrapper of {names} is unknown"
    maps: dict[PrefixRule, KeyMap] = {}
    unknown = []
    for arch in checkpoint.architectures:
        try:
            prefix = getattr(getattr(transformers, arch), "base_model_prefix", "")
        except (AttributeError, ImportError, RuntimeError):
            unknown.append(arch)
            continue
        if isinstance(prefix, str) and prefix:
            for rule in (PrefixRule(prefix, ""), PrefixRule("", prefix)):
                maps.setdefault(rule, KeyMap((rule,), f"{arch}.base_model_prefix is {prefix!r}"))
    note = f"{checkpoint.config_note} names {names}"
    if unknown:
        note += f"; transformers has no class {', '.join(unknown)}"
    return list(maps.values()), note


def _problems(targets: Mapping[str, Iterable[str]], names: set[str], key_map: KeyMap) -> list[str]:
    """Every target with no checkpoint tensor, and every checkpoint tensor two targets land on."""
    landing: dict[str, list[str]] = {}
    problems = []
    for target, keys in targets.items():
        found = key_map.apply(target)
        if found not in names:
            problems.append(f"{', '.join(keys)}: no checkpoint tensor {found}")
        landing.setdefault(found, []).append(target)
    for found, sources in landing.items():
        if len(sources) > 1 and found in names:
            keys = "; ".join(", ".join(targets[s]) for s in sources)
            problems.append(
                f"{keys}: {len(sources)} adapter tensors would land on one checkpoint tensor {found}"
            )
    return problems


def resolve_keys(
    targets: Mapping[str, Iterable[str]], checkpoint: Checkpoint, explicit: KeyMap | None = None
) -> tuple[KeyMap, dict[str, str]]:
    """Map every adapter target path (``{path: the adapter file keys behind it}``) to its own checkpoint key;
    returns the key map used and ``{path: checkpoint key}``.

    Tried in turn: (1) the paths as they are; (2) the checkpoint's known wrapper: transformers'
    ``base_model_prefix`` ``P`` of its ``config.json`` architecture, removed from or added to the paths'
    front, exactly one fitting. ``explicit`` prefix rules (:func:`explicit_key_map`: a path equal to
    ``OLD`` or beginning with ``OLD.`` gets ``NEW`` instead, the longest ``OLD`` winning) replace both.

    Raises:
        MergeError: a path with no checkpoint tensor, two paths on one tensor, several default mappings
            that fit, or an explicit rule that matches no path; the message names the keys.
    """
    targets = {t: tuple(keys) for t, keys in sorted(targets.items())}
    names = set(checkpoint.owner)
    note = ""
    if explicit is not None:
        unused = [r for r in explicit.rules if r.old and not any(r.matches(p) for p in targets)]
        if unused:
            sample = ", ".join(list(targets)[:3])
            raise MergeError(
                f"the key map rule {unused[0].describe()} matches no adapter path (adapter paths, without "
                f"peft's base_model.model. prefix, look like: {sample})"
            )
        results = [(explicit, _problems(targets, names, explicit))]
    else:
        results = [(IDENTITY, _problems(targets, names, IDENTITY))]
        if results[0][1]:  # only then is the wrapper looked up (it may import transformers)
            wrappers, note = _candidates(checkpoint)
            results += [(key_map, _problems(targets, names, key_map)) for key_map in wrappers]
    fitting = [key_map for key_map, problems in results if not problems]
    if len(fitting) > 1:
        raise MergeError(
            f"the adapter fits the checkpoint {checkpoint.root} in several ways ("
            + "; ".join(m.describe() for m in fitting)
            + "): choose one with --key-map / --strip-prefix (merge_checkpoint(key_map=..., strip_prefix=...))"
        )
    if fitting:
        return fitting[0], {t: fitting[0].apply(t) for t in targets}

    best, problems = min(results, key=lambda item: len(item[1]))
    lines = "\n  ".join(problems)
    others = "".join(
        f"\nalso tried: {m.describe()}: {len(p)} problem{'s' * (len(p) > 1)}"
        for m, p in results
        if m is not best
    )
    wrapper = f"\nthe checkpoint's wrapper: {note}" if note else ""
    raise MergeError(
        f"the adapter does not fit the checkpoint {checkpoint.root} ({best.describe()}; every adapter "
        f"tensor must find its own checkpoint tensor):\n  {lines}{others}{wrapper}\n"
        "if the checkpoint names the model's modules differently, map them explicitly with "
        "--key-map OLD=NEW or --strip-prefix PREFIX (merge_checkpoint(key_map=..., strip_prefix=...))"
    )


MERGEABLE_DTYPES = ("F16", "BF16", "F32", "F64")


@dataclass(frozen=True)
class MergeOp:
    """One change to one checkpoint tensor: ``"lora"`` adds ``scaling * B @ A`` in ``layout``;
    ``"replace"`` writes a tensor the adapter holds in full (applied before LoRA deltas)."""

    target: str
    kind: Literal["lora", "replace"]
    source_keys: tuple[str, ...]
    scaling: float = 0.0
    layout: Layout = PLAIN


@dataclass(frozen=True)
class MergePlan:
    """Everything a merge will do: ``ops`` per checkpoint tensor, ``keys`` from each adapter path to
    its checkpoint key (one to one), ``mapping`` the key map used (for messages)."""

    checkpoint: Checkpoint
    adapter: Adapter
    ops: dict[str, tuple[MergeOp, ...]]
    keys: dict[str, str]
    mapping: str


def _targets(adapter: Adapter) -> dict[str, list[str]]:
    """``{adapter path the merge changes: the file keys behind it}``."""
    targets = {f"{module}.weight": list(factors.keys) for module, factors in adapter.lora_modules().items()}
    for key, info in sorted(adapter.keys.items()):
        if not info.is_lora:
            targets.setdefault(info.model_key, []).append(key)
    return targets


def _adapter_path(key_map: KeyMap, key: str) -> str | None:
    """The adapter path that ``key_map`` sends to the checkpoint key ``key`` (through a rule rather than
    unchanged, where both would), or None."""
    inverse = [PrefixRule(rule.new, rule.old) for rule in key_map.rules]
    paths = [rule.apply(key) for rule in inverse if rule.matches(key)] + [key]
    return next((p for p in paths if key_map.apply(p) == key), None)


def _target_problems(adapter: Adapter, checkpoint: Checkpoint, key_map: KeyMap) -> list[str]:
    """Where the adapter's config and weights disagree as ``load_adapter`` finds it on the checkpoint's model:
    LoRA factors of a module its ``target_modules`` / ``layers_to_transform`` / ``exclude_modules`` do not
    select (unexpected keys), and a checkpoint module they select with no factors (missing keys). The
    modules are those of the checkpoint (each tensor ``M.weight`` of two or more dimensions, under the
    adapter's paths) and of the adapter; :func:`loragen.plan.resolve_candidates` selects among them."""
    modules = adapter.lora_modules()
    config = adapter.config
    # None / all-linear select per model type / layer type, which names do not tell: then only the other
    # fields (layers_to_transform, layers_pattern, exclude_modules) are checked against the factors, with
    # the factors' own leaf names as targets (a suffix target, to which layers_to_transform applies)
    by_type = config.target_modules is None or config.target_modules == ALL_LINEAR
    if by_type:
        leaves = tuple(dict.fromkeys(path.rsplit(".", 1)[-1] for path in modules))
        config = dataclasses.replace(config, target_modules=leaves)
    paths = dict.fromkeys(modules)
    for name in checkpoint.owner:
        if name.endswith(".weight") and len(checkpoint.entry(name).shape) >= 2:
            path = _adapter_path(key_map, name.removesuffix(".weight"))
            if path:
                paths.setdefault(path)
    candidates = [Candidate(path=path, layer="checkpoint module", linear=True) for path in paths]
    plan = resolve_candidates(config, candidates)
    fields = ("target_modules", "layers_to_transform", "layers_pattern", "exclude_modules")
    values = {name: getattr(adapter.config, name) for name in fields}  # as adapter_config.json gives them
    selection = ", ".join(
        f"{name}={list(value) if isinstance(value, tuple) else value!r}"
        for name, value in values.items()
        if value is not None
    )
    problems = [
        f"{', '.join(factors.keys)}: LoRA factors of {module}, which {selection} does not select "
        "(unexpected keys)"
        for module, factors in modules.items()
        if module not in plan.entries
    ]
    missing = [] if by_type else [path for path in plan.entries if path not in modules]
    problems += [
        f"{path}: {selection} selects it (checkpoint tensor {key_map.apply(path)}.weight), but the adapter "
        "has no LoRA factors for it (missing keys)"
        for path in missing[:20]
    ]
    if len(missing) > 20:
        problems.append(f"... and {len(missing) - 20} more modules without factors")
    return problems


def _fitting(
    factors: LoraFactors, a: tuple[int, ...], b: tuple[int, ...], entry: TensorEntry, transposed: bool
) -> list[Layout]:
    """The layouts of ``factors`` in which ``B @ A`` has ``entry``'s shape; TRANSPOSED (a transformers
    ``Conv1D``, weight stored (in, out)) only where ``transposed`` says the module may be one."""
    return [
        lay
        for lay in factors.layouts
        if lay.fits(a, b) and lay.weight_shape(a, b) == entry.shape and (transposed or lay is not TRANSPOSED)
    ]


def _transposed_allowed(architecture: Callable[[], Layout | None]) -> bool:
    """Whether a module may be stored transposed, (in, out), as a transformers ``Conv1D``: not in a checkpoint
    whose ``config.json`` architecture has no ``Conv1D`` layers, where ``load_adapter`` finds an ``nn.Linear``;
    elsewhere the shapes decide (a model of unknown type may hold a layer type registered as transposed)."""
    return architecture() is not PLAIN


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

    A square weight fits both ``nn.Linear``'s (out, in) and ``Conv1D``'s (in, out) layout; as
    ``load_adapter`` and peft follow the layer's type, so does the merge: from the unambiguous modules
    (``evidence``: same leaf name first, then ``"*"``), else ``fan_in_fan_out=false`` means PLAIN and
    ``true`` follows the checkpoint's architecture (``architecture()``), refused when that is unknown.

    Raises:
        MergeError: no layout of the module's factor names gives the tensor's shape (names both shapes),
            or a square weight whose layer type cannot be told (names the module).
    """
    transposed = _transposed_allowed(architecture)
    fits = _fitting(factors, a, b, entry, transposed)
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
                f"checkpoint's config.json architecture nor another module of the adapter shows whether "
                f"{factors.module} is an nn.Linear (fan_in_fan_out is ignored there, by peft and load_adapter) "
                "or a transformers Conv1D (weight stored (in, out)); "
                "set fan_in_fan_out to false in adapter_config.json if it is an nn.Linear, or merge in memory: "
                "load_adapter(model, ADAPTER), merge_and_unload(model), model.save_pretrained(OUT)"
            )
        fits = [lay for lay in fits if lay is PLAIN] or fits[:1]
    if fits:
        return fits[0]
    a_name, b_name = factors.names
    if any(lay.weight_shape(a, b) == entry.shape for lay in factors.layouts if lay.fits(a, b)):
        raise MergeError(
            f"{entry.name}: the checkpoint tensor has shape {list(entry.shape)}, which the adapter's "
            f"{factors.module} ({a_name} {a}, {b_name} {b}) fits only as a transformers Conv1D weight stored "
            f"(in, out), but {factors.module} is an nn.Linear (the checkpoint's config.json names an "
            "architecture without Conv1D layers): load_adapter refuses this adapter (shape mismatch), so the "
            "merge does too; were lora_A and lora_B swapped?"
        )
    needed = " or ".join(
        f"{list(lay.weight_shape(a, b))} ({lay.name})"
        for lay in factors.layouts
        if lay.fits(a, b) and (transposed or lay is not TRANSPOSED)
    )
    raise MergeError(
        f"{entry.name}: the checkpoint tensor has shape {list(entry.shape)} but the adapter's "
        f"{factors.module} ({a_name} {a}, {b_name} {b}) needs {needed or 'a LoRA pair'}"
    )


def _evidence(
    adapter: Adapter, checkpoint: Checkpoint, keys: dict[str, str], transposed: bool
) -> dict[str, set[Layout]]:
    """The layouts of the unambiguous LoRA modules, by leaf name and under ``"*"``."""
    evidence: dict[str, set[Layout]] = {}
    for module, factors in adapter.lora_modules().items():
        if factors.key_a is None or factors.key_b is None or TRANSPOSED not in factors.layouts:
            continue
        entry = checkpoint.entry(keys[f"{module}.weight"])  # resolve_keys mapped every target
        a, b = adapter.shapes[factors.key_a], adapter.shapes[factors.key_b]
        fits = _fitting(factors, a, b, entry, transposed)
        if len(fits) == 1:
            for name in (module.rpartition(".")[2], "*"):
                evidence.setdefault(name, set()).add(fits[0])
    return evidence


def _architecture_layout(checkpoint: Checkpoint) -> Layout | None:
    """TRANSPOSED / PLAIN if the checkpoint's transformers architectures' modules do / do not use
    ``Conv1D``; None when unknown."""
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


def _dtype_problem(adapter: Adapter, key: str, entry: TensorEntry, lora: bool) -> str | None:
    """Why adapter tensor ``key`` cannot go into ``entry``, or None."""
    dtype = adapter.dtype_name(key)
    floating = lora or entry.dtype in MERGEABLE_DTYPES
    if dtype in MERGEABLE_DTYPES if floating else dtype == entry.dtype:
        return None
    accepted = "a floating-point dtype" if floating else entry.dtype
    return (
        f"{key}: dtype {dtype} in {adapter.weights_path}, expected {accepted} ({', '.join(MERGEABLE_DTYPES)} "
        "for floating point); loragen merge does not cast it silently"
    )


def check_adapter_values(plan: MergePlan, *, allow_nonfinite: bool = False, block: int = 1 << 22) -> None:
    """Refuse adapter tensors holding NaN or inf (unless ``allow_nonfinite``), ``block`` elements at a time.

    Raises:
        MergeError: a tensor holds NaN or inf (names every such key and the count).
    """
    if allow_nonfinite:
        return
    adapter = plan.adapter
    used = sorted({key for ops in plan.ops.values() for op in ops for key in op.source_keys})
    bad = []
    for key in used:
        if adapter.dtype_name(key) not in MERGEABLE_DTYPES:
            continue
        shape = adapter.shapes[key]
        rows = shape[0] if shape else 1
        step = max(1, block // max(1, math.prod(shape[1:])))
        count = 0
        for start in range(0, rows, step):
            part = _rows(adapter.tensors, key, start, min(rows, start + step))
            count += int((~torch.isfinite(part)).sum())
        if count:
            bad.append(f"{key} ({count} NaN/inf values)")
    if bad:
        raise MergeError(
            f"{adapter.weights_path}: non-finite adapter values would be written into the merged weights: "
            + ", ".join(bad)
            + "; nothing was written (pass --allow-nonfinite / allow_nonfinite=True to merge them anyway)"
        )


def plan_merge(checkpoint: Checkpoint, adapter: Adapter, key_map: KeyMap | None = None) -> MergePlan:
    """Decide every change the merge makes, checking that the adapter fits the checkpoint.

    ``key_map``: explicit prefix rules (see :func:`resolve_keys`).

    Raises:
        MergeError: adapter tensors with no checkpoint tensor or sharing one, shape, rank or dtype
            mismatches, a DoRA or ``target_parameters`` adapter, a square weight whose layer type cannot
            be told; every problem is listed, by key.
    """
    config = adapter.config
    if config.target_parameters:  # which factors go to which parameter follows the model's parameter order
        adapted = sorted(
            key
            for key, info in adapter.keys.items()
            if info.is_lora and targets_parameters_of(config, info.module.replace(".base_layer", ""))
        )
        shown = ", ".join(adapted[:6]) + (f", ... ({len(adapted) - 6} more)" if len(adapted) > 6 else "")
        raise MergeError(
            f"the adapter adapts parameters directly (target_parameters={list(config.target_parameters)}; keys "
            f"{shown or 'none'}): which factors belong to which parameter follows the module's parameter order "
            "in the model, which a checkpoint does not record, so loragen merge does not merge them; nothing was "
            "written. Merge in memory instead: load_adapter(model, ADAPTER), merge_and_unload(model), "
            "model.save_pretrained(OUT)"
        )
    if config.use_dora:
        raise MergeError(
            f"{adapter.folder}: a DoRA adapter (use_dora=true) cannot be merged by streaming: each output's "
            "scale m / ||W + s B A|| needs the whole weight. Load it (loragen.load_adapter) and call "
            "loragen.merge_and_unload, then save the model"
        )
    if not adapter.keys:
        raise MergeError(
            f"{adapter.weights_path}: the adapter holds no tensors (no LoRA factors, nothing saved in full); "
            "there is nothing to merge, and load_adapter refuses it too (missing keys)"
        )
    used_map, keys = resolve_keys(_targets(adapter), checkpoint, key_map)
    target_problems = _target_problems(adapter, checkpoint, used_map)
    if target_problems:
        raise MergeError(
            f"{adapter.folder}: the adapter's config and its weights disagree, so load_adapter refuses it and "
            "the merge does too:\n  " + "\n  ".join(target_problems)
        )
    architecture = functools.cache(lambda: _architecture_layout(checkpoint))
    evidence = _evidence(adapter, checkpoint, keys, _transposed_allowed(architecture))
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
        values = entry_for(config, module)
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
        if a[0] != values.r:
            problems.append(
                f"{factors.key_a}: rank {a[0]}, but the adapter config gives {module} rank {values.r} "
                "(check r / rank_pattern)"
            )
            continue
        try:
            layout = _layout(factors, a, b, entry, config, evidence, architecture)
        except MergeError as exc:
            problems.append(str(exc))
            continue
        ops.setdefault(target, []).append(
            MergeOp(target, "lora", (factors.key_a, factors.key_b), values.scaling, layout)
        )
    if problems:
        raise MergeError(
            f"the adapter does not fit the checkpoint {checkpoint.root}:\n  " + "\n  ".join(problems)
        )
    ordered = {t: tuple(sorted(o, key=lambda op: op.kind != "replace")) for t, o in ops.items()}
    return MergePlan(checkpoint, adapter, ordered, keys, used_map.describe())


@dataclass(frozen=True)
class MergeReport:
    """What :func:`merge_checkpoint` wrote (or, with ``dry_run=True``, would write: ``files`` empty):
    ``extra_files`` the base folder's other files copied (relative paths), ``skipped`` those left out
    (``"name (why)"``), ``removed`` the files of a previous merge into the folder that this one does not
    write."""

    output: Path
    files: tuple[Path, ...]
    merged: tuple[str, ...]
    replaced: tuple[str, ...]
    copied: int
    bytes_written: int
    mapping: str = ""
    extra_files: tuple[str, ...] = ()
    keys: dict[str, str] = field(default_factory=dict)
    skipped: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()


def _rows(tensors: Mapping[str, torch.Tensor], key: str, start: int, stop: int) -> torch.Tensor:
    if isinstance(tensors, SafetensorsReader):
        return tensors.rows(key, start, stop)
    tensor = tensors[key]
    return tensor[start:stop] if tensor.dim() else tensor


def _merge_tensor(
    checkpoint: SafetensorsReader,
    entry: TensorEntry,
    ops: tuple[MergeOp, ...],
    adapter: Adapter,
    dst: BinaryIO,
) -> None:
    """Write the merged bytes of ``entry`` to ``dst``, a block of rows at a time, computed in fp32
    (fp64 stays fp64) and rounded once to the tensor's dtype."""
    dtype = entry.torch_dtype
    assert dtype is not None  # plan_merge refuses the others
    # only replacements: no arithmetic, so integer tensors stay exact
    compute = dtype if all(op.kind == "replace" for op in ops) else torch.promote_types(dtype, torch.float32)
    factors = {
        op: tuple(adapter.tensors[k].to(compute) for k in op.source_keys) for op in ops if op.kind == "lora"
    }
    rows = entry.shape[0] if entry.shape else 1
    row_bytes = entry.nbytes // rows if rows else 0
    block = max(1, _BLOCK_BYTES // max(row_bytes, 1))
    for start in range(0, rows, block):
        stop = min(rows, start + block)
        work = checkpoint.rows(entry.name, start, stop).to(compute)  # (n, *row_shape)
        for op in ops:
            if op.kind == "replace":
                work.copy_(_rows(adapter.tensors, op.source_keys[0], start, stop))
                continue
            a, b = factors[op]  # rows of W (flattened to (n, -1)) += s * the same rows of B @ A, fused
            work.view(stop - start, -1).addmm_(
                *op.layout.delta_row_factors(a, b, start, stop), alpha=op.scaling
            )
        out = work.to(dtype).contiguous()
        # the raw little-endian bytes (through uint8: numpy has no bfloat16)
        dst.write(out.view(-1).view(torch.uint8).numpy().data if out.numel() else b"")


def _copy_range(src: BufferedReader, dst: BinaryIO, start: int, end: int, buffer: memoryview) -> None:
    src.seek(start)
    remaining = end - start
    while remaining:
        n = src.readinto(buffer[: min(remaining, len(buffer))])
        if not n:
            raise MergeError(f"{src.name}: file ended early (was it changed during the merge?)")
        dst.write(buffer[:n])
        remaining -= n


def _write_file(
    header: SafetensorsHeader, out_path: Path, plan: MergePlan, advance: Callable[[int], None]
) -> None:
    """Write ``header``'s file to ``out_path`` with the planned tensors merged."""
    merged = sorted((e for e in header.tensors.values() if e.name in plan.ops), key=lambda e: e.start)
    reader = SafetensorsReader(header)
    buffer = memoryview(bytearray(_BLOCK_BYTES))
    with open(header.path, "rb") as src, open(out_path, "wb") as dst:
        dst.write(header.header_bytes)  # same names, dtypes and shapes, so the same offsets
        advance(header.data_start)
        position = header.data_start
        for entry in merged:
            _copy_range(src, dst, position, entry.start, buffer)
            advance(entry.start - position)
            _merge_tensor(reader, entry, plan.ops[entry.name], plan.adapter, dst)
            advance(entry.nbytes)
            position = entry.end
        _copy_range(src, dst, position, header.file_size, buffer)
        advance(header.file_size - position)


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _overlaps(a: Path, b: Path) -> bool:
    """Whether ``a`` is ``b`` or lies inside it (by path and by inode, so hard links and bind mounts count)."""
    identity = _identity(b)
    if identity is not None and identity in map(_identity, (a, *a.parents, *a.resolve().parents)):
        return True
    resolved_a, resolved_b = a.resolve(), b.resolve()
    return resolved_a == resolved_b or resolved_b in resolved_a.parents


# ---- the output folder: what a previous merge wrote ------------------------------------------------

MARKER_FORMAT = "loragen merge output"
MARKER_VERSION = 2
_MARKER_MAX_BYTES = 64 << 20
# loragen's temporary names beside a file being written (.NAME.loragen-PID-RANDOM.tmp, see loragen.atomic)
_TEMPORARY = re.compile(r"\..+\.loragen-\d+-[0-9a-f]+\.(tmp|new|old)")

FileIdentity = tuple[int, int]  # (size, mtime_ns) of a file as a merge wrote it


def _file_identity(path: Path) -> FileIdentity | None:
    """``(size, mtime_ns)`` of ``path`` if it is a regular file (links not followed), else None."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_size, st.st_mtime_ns) if stat.S_ISREG(st.st_mode) else None


def _is_relative_name(name: object) -> bool:
    """Whether ``name`` is a path inside a folder: ``/``-separated parts, none empty, ``.`` or ``..``."""
    return (
        isinstance(name, str)
        and not any(c in name for c in "\\\0")
        and all(part not in ("", ".", "..") for part in name.split("/"))
        and name != MERGE_MARKER_NAME
    )


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass(frozen=True)
class MergeMarker:
    """``loragen_merge.json``: the files a merge wrote into its output folder (paths relative to it), each
    with the identities ``(size, mtime_ns)`` it may have (two while a merge replaces it: the old and the
    new), and whether that merge completed. A later merge replaces or removes a listed file only while it
    still has one of its identities, and never touches anything else."""

    files: dict[str, tuple[FileIdentity, ...]]
    complete: bool
    base: str = ""
    adapter: str = ""

    def to_json(self) -> bytes:
        """The marker file's content."""
        record = {
            "format": MARKER_FORMAT,
            "version": MARKER_VERSION,
            "complete": self.complete,
            "base": self.base,
            "adapter": self.adapter,
            "files": {name: [list(i) for i in ids] for name, ids in sorted(self.files.items())},
            "note": (
                "written by loragen merge: a later loragen merge into this folder replaces or removes the files "
                "listed here (while they are as this merge wrote them), and nothing else"
            ),
        }
        return (json.dumps(record, indent=2) + "\n").encode("utf-8")


def read_marker(folder: str | os.PathLike[str]) -> tuple[MergeMarker | None, str]:
    """The marker of a previous ``loragen merge`` into ``folder``, or None and why there is none (a missing,
    empty, linked, malformed or foreign ``loragen_merge.json``). Never raises for the file's content."""
    path = Path(folder) / MERGE_MARKER_NAME
    try:
        st = os.lstat(path)
    except OSError:
        return None, f"no {MERGE_MARKER_NAME}"
    if not stat.S_ISREG(st.st_mode):
        return None, f"{path} is not a regular file"
    if st.st_size > _MARKER_MAX_BYTES:
        return None, f"{path} is too large ({st.st_size} bytes) to be loragen's"
    try:
        data = read_json_file(path, MergeError)
    except MergeError as exc:
        return None, f"{path} is not loragen's ({exc})"
    if not isinstance(data, dict) or data.get("format") != MARKER_FORMAT:
        older = isinstance(data, dict) and "loragen_merge" in data
        return None, (
            f"{path} was written by an older loragen merge, which did not record the files it wrote"
            if older
            else f'{path} is not loragen\'s (no "format": "{MARKER_FORMAT}")'
        )
    if data.get("version") != MARKER_VERSION or not isinstance(data.get("complete"), bool):
        return None, f"{path}: unknown version {data.get('version')!r} (this loragen writes {MARKER_VERSION})"
    files = data.get("files")
    if not isinstance(files, dict):
        return None, f'{path}: "files" is not {{relative path: [[size, mtime_ns], ...]}}'
    valid = all(
        _is_relative_name(name)
        and isinstance(ids, list)
        and 1 <= len(ids) <= 2
        and all(isinstance(i, list) and len(i) == 2 and all(map(_is_count, i)) for i in ids)
        for name, ids in files.items()
    )
    if not valid:
        return None, f'{path}: "files" is not {{relative path: [[size, mtime_ns], ...]}}'
    return MergeMarker(
        {name: tuple((i[0], i[1]) for i in ids) for name, ids in files.items()},
        data["complete"],
        str(data.get("base", "")),
        str(data.get("adapter", "")),
    ), ""


def _crossing(folder: Path, path: Path) -> Path | None:
    """The first entry between ``folder`` and ``path`` (``path``'s parents inside ``folder``) that is not a
    plain folder of ``folder``'s file system (a link, a mount point, a file), or None."""
    device = os.lstat(folder).st_dev
    current = folder
    mounts: frozenset[str] | None = None
    for part in path.relative_to(folder).parts[:-1]:
        current = current / part
        try:
            st = os.lstat(current)
        except FileNotFoundError:
            return None  # the merge creates it
        if not stat.S_ISDIR(st.st_mode) or st.st_dev != device or os.path.ismount(current):
            return current
        mounts = mount_points() if mounts is None else mounts
        if os.path.realpath(current) in mounts:  # a bind mount of a folder of the same file system
            return current
    return None


def _owned(folder: Path, marker: MergeMarker | None) -> dict[str, FileIdentity]:
    """The files ``marker`` lists that are still as a merge wrote them (a regular file with a listed identity,
    reached through plain folders): ``{name: identity}``."""
    owned = {}
    for name, identities in (marker.files if marker else {}).items():
        path = folder / name
        identity = _file_identity(path) if _crossing(folder, path) is None else None
        if identity is not None and identity in identities:
            owned[name] = identity
    return owned


def _leftover(path: Path) -> bool:
    """Whether ``path`` is what a merge killed before its marker was written leaves: a loragen temporary,
    or a plain folder holding nothing else."""
    if _TEMPORARY.fullmatch(path.name):
        return True
    if path.is_symlink() or not path.is_dir():
        return False
    try:
        for root, folders, files in os.walk(path, onerror=_raise):
            if any(Path(root, name).is_symlink() for name in folders):
                return False
            if not all(_TEMPORARY.fullmatch(name) for name in files):
                return False
    except OSError:  # unreadable: not known to hold nothing
        return False
    return True


def _raise(error: OSError) -> None:
    raise error


def _check_output(base: Path, adapter: Path, out: Path, ours: Iterable[str] = ()) -> MergeMarker | None:
    """Refuse an output that would write into or onto the base or the adapter, or replace other files
    (see :func:`merge_checkpoint`), raising MergeError; returns the marker of a previous merge into the
    output folder. ``ours``: entries of the output folder the running merge made."""
    for what, other in (("base checkpoint", base), ("adapter", adapter)):
        if _overlaps(out, other):
            raise MergeError(
                f"refusing to write {out}: it is, or lies inside, the {what} {other}; choose an output outside it"
            )
        if os.path.lexists(out) and _overlaps(other, out):
            raise MergeError(
                f"refusing to write {out}: it contains the {what} {other}, which writing it could change"
            )
    if out.is_symlink():
        raise MergeError(
            f"refusing to write {out}: it is a symbolic link (to {os.readlink(out)}); give the real path"
        )
    if base.is_dir():
        if out.exists() and not out.is_dir():
            raise MergeError(
                f"{out} is a file, but the base {base} is a folder of shards: the output must be a folder"
            )
        if not out.is_dir():
            return None
        marker, why = read_marker(out)
        if marker is not None:
            return marker
        held = sorted(n for n in os.listdir(out) if n not in set(ours) and not _leftover(out / n))
        if held:
            shown = ", ".join(held[:5]) + (f" and {len(held) - 5} more" if len(held) > 5 else "")
            raise MergeError(
                f"refusing to write {out}: the folder holds other files ({shown}) and is not a previous loragen "
                f"merge output ({why}); give a new or empty folder"
            )
        return None
    if out.is_dir():
        raise MergeError(f"{out} is a folder, but the base {base} is one file: give an output file path")
    if out.exists():
        try:
            read_safetensors_header(out)
        except (AdapterError, OSError):
            raise MergeError(
                f"refusing to overwrite {out}: it is not a safetensors checkpoint; give a new file path"
            ) from None
    return None


def _check_names(out: Path, names: Iterable[str], owned: Mapping[str, FileIdentity]) -> None:
    """Refuse to write a file of ``names`` through a link or mount point, or onto a file a previous merge
    did not write (or that changed since)."""
    for name in names:
        path = out / name
        crossing = _crossing(out, path)
        if crossing is not None:
            raise MergeError(
                f"refusing to write {path}: {crossing} is a link, a mount point or not a folder; the merge "
                f"writes only into plain folders of {out}"
            )
        if os.path.lexists(path) and name not in owned:
            raise MergeError(
                f"refusing to replace {path}: the previous loragen merge into {out} did not write it, or it was "
                "changed since; move it away or choose another output"
            )


def _base_files(root: Path) -> tuple[list[tuple[str, Path]], list[str]]:
    """The files of the base folder the merge copies beside its shards (``(relative name, source)``: the
    index, ``config.json``, tokenizer files, subfolders file by file), and those it leaves out, each as
    ``"name (why)"``: weights it does not merge, links to folders, hidden folders, special files."""
    copies: list[tuple[str, Path]] = []
    skipped: list[str] = []

    def visit(folder: Path, prefix: str) -> None:
        for item in sorted(folder.iterdir()):
            name, rel = item.name, prefix + item.name
            if (not prefix and name == MERGE_MARKER_NAME) or _TEMPORARY.fullmatch(name):
                continue
            if item.is_symlink() and item.is_dir():
                skipped.append(f"{rel}/ (a link to a folder, not followed)")
            elif item.is_dir():
                if name.startswith("."):
                    skipped.append(f"{rel}/ (a hidden folder)")
                else:
                    visit(item, rel + "/")
            elif not item.is_file():
                skipped.append(f"{rel} (not a regular file)")
            elif name.endswith(_WEIGHT_SUFFIXES) and not name.endswith(INDEX_SUFFIX):
                skipped.append(f"{rel} (weights this merge does not change)")
            else:
                copies.append((rel, item))

    visit(root, "")
    return copies, skipped


@dataclass
class _Written:
    """What :func:`_write` wrote: the checkpoint files, the other files copied, those left out, those a
    previous merge wrote that were removed, and the bytes written."""

    files: tuple[Path, ...] = ()
    extra: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    nbytes: int = 0


def _write(plan: MergePlan, base: Path, adapter: Path, out: Path, progress: bool | None) -> _Written:
    """Write the merged checkpoint: one file atomically, or a folder's files each atomically in place."""
    checkpoint = plan.checkpoint
    from tqdm.auto import tqdm  # only a merge that writes needs it

    total = sum(h.file_size for h in checkpoint.headers.values())
    shown = sys.stderr.isatty() if progress is None else progress
    with tqdm(
        total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="merging", disable=not shown
    ) as bar:
        if checkpoint.root.is_dir():
            return _write_folder(plan, base, adapter, out, bar.update)
        with atomic_file(out) as tmp:
            _write_file(checkpoint.headers[checkpoint.root], tmp, plan, bar.update)
            _check_output(base, adapter, out)  # again: under the writers' lock, right before the replace
        return _Written(files=(out,), nbytes=total)


def _make_parents(out: Path, path: Path, made: list[Path]) -> None:
    """Create the folders between ``out`` and ``path`` one by one, refusing links and mount points."""
    current = out
    for part in path.relative_to(out).parts[:-1]:
        current = current / part
        with contextlib.suppress(FileExistsError):
            current.mkdir()
            made.append(current)
        crossing = _crossing(out, current / "_")
        if crossing is not None:
            raise MergeError(
                f"refusing to write {path}: {crossing} is a link, a mount point or not a folder; the merge "
                f"writes only into plain folders of {out}"
            )


def _write_folder(
    plan: MergePlan, base: Path, adapter: Path, out: Path, advance: Callable[[int], None]
) -> _Written:
    """Write a folder of shards in place: every file to a temporary beside it, then, once all are complete
    and the output checked again under the writers' lock, renamed into place; the marker records them
    (first with the files they replace, so a merge cut off by a crash is finished by the next one). Files of
    the previous merge that this one does not write are removed; nothing else is touched."""
    checkpoint = plan.checkpoint
    copies, skipped = _base_files(checkpoint.root)
    names = [p.name for p in checkpoint.files] + [rel for rel, _ in copies]
    created = not os.path.lexists(out)
    out.mkdir(parents=True, exist_ok=True)
    made: list[Path] = []  # folders this merge created inside ``out``
    committing = False  # whether files are being renamed into place
    record = {"base": str(checkpoint.root.resolve()), "adapter": str(plan.adapter.folder.resolve())}
    try:
        with writers_lock(out):
            marker = _check_output(base, adapter, out)  # again, now that other merges wait
            _check_names(out, names, _owned(out, marker))
            new: dict[str, FileIdentity] = {}
            with contextlib.ExitStack() as stack:  # leaving it renames every file into place
                for shard in checkpoint.files:
                    tmp = stack.enter_context(atomic_file(out / shard.name))
                    _write_file(checkpoint.headers[shard], tmp, plan, advance)
                    new[shard.name] = _file_identity(tmp) or (0, 0)
                for rel, source in copies:
                    _make_parents(out, out / rel, made)
                    tmp = stack.enter_context(atomic_file(out / rel))
                    shutil.copyfile(source, tmp)
                    new[rel] = _file_identity(tmp) or (0, 0)
                # all written beside their targets: check once more, right before anything is replaced
                marker = _check_output(base, adapter, out, ours=[p.name for p in made if p.parent == out])
                owned = _owned(out, marker)
                _check_names(out, names, owned)
                stale = {name: identity for name, identity in owned.items() if name not in new}
                journal = {
                    name: (identity, *((owned[name],) if name in owned else ()))
                    for name, identity in new.items()
                }
                journal.update((name, (identity,)) for name, identity in stale.items())
                atomic_write_bytes(out / MERGE_MARKER_NAME, MergeMarker(journal, False, **record).to_json())
                committing = True
            removed = [name for name, identity in stale.items() if _remove_own(out, name, identity)]
            done = {name: _file_identity(out / name) or identity for name, identity in new.items()}
            atomic_write_bytes(
                out / MERGE_MARKER_NAME,
                MergeMarker({n: (i,) for n, i in done.items()}, True, **record).to_json(),
            )
    except OSError as exc:
        _undo(out, made, created)
        if committing and not isinstance(exc, WriteError):
            raise WriteError(
                exc.errno,
                f"{out}: the merged files could not all be renamed into place ({exc}); it holds some new files and "
                f"some old ones, all listed in its {MERGE_MARKER_NAME}: run the merge again to finish it",
            ) from exc
        raise
    except BaseException:
        _undo(out, made, created)
        raise
    return _Written(
        files=tuple(out / shard.name for shard in checkpoint.files),
        extra=tuple(rel for rel, _ in copies),
        skipped=tuple(skipped),
        removed=tuple(removed),
        nbytes=sum(size for size, _ in done.values()),
    )


def _undo(out: Path, made: list[Path], created: bool) -> None:
    """Remove the folders a failed merge created, where they are empty (no file was renamed into them)."""
    for folder in [*reversed(made), *([out] if created else [])]:
        with contextlib.suppress(OSError):
            folder.rmdir()


def _remove_own(out: Path, name: str, identity: FileIdentity) -> bool:
    """Unlink the file ``name`` a previous merge wrote if it is still as it wrote it, then its folders that
    this leaves empty (``rmdir``: never a folder that holds anything); whether it was removed."""
    path = out / name
    if _crossing(out, path) is not None or _file_identity(path) != identity:
        return False
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    for folder in path.parents:
        if folder == out or out not in folder.parents:
            break
        try:
            folder.rmdir()
        except OSError:
            break
    return True


def merge_checkpoint(
    base: str | os.PathLike[str],
    adapter: str | os.PathLike[str] | Adapter,
    output: str | os.PathLike[str],
    *,
    key_map: Mapping[str, str] | None = None,
    strip_prefix: str | Iterable[str] | None = None,
    allow_pickle: bool = False,
    progress: bool | None = None,
    dry_run: bool = False,
    allow_nonfinite: bool = False,
) -> MergeReport:
    """Merge ``adapter`` into the safetensors checkpoint ``base``, writing ``output``.

    ``base`` is a ``.safetensors`` file (``output`` is then a file, replaced atomically) or a folder of
    shards with an index (``output`` is then a folder with the same shards, index and the other files such
    as ``config.json`` and ``tokenizer/``, copied file by file; weights of other formats, hidden folders and
    links to folders are left out and listed in ``report.skipped``). Untouched tensors are copied byte for
    byte; merged ones keep their dtype. ``progress``: a bar on stderr (default: on a terminal).

    Adapter paths map to checkpoint keys one to one: as they are, or under the checkpoint's known wrapper
    (see :func:`resolve_keys`); else only through ``key_map`` (``{OLD: NEW}``
    prefix rewrites) and ``strip_prefix``. ``dry_run=True`` decides everything and writes nothing
    (``report.keys`` holds the key map).

    Only a new path, an empty folder, a previous merge output (a valid ``loragen_merge.json``, which lists
    the files that merge wrote) or, for a one-file base, an existing safetensors file is written; never the
    base or the adapter, nothing inside or containing them. In an output folder, each file is written to a
    temporary beside it and renamed into place once every file is complete and the output has been checked
    again under the writers' lock; the files of the previous merge that this one does not write are
    removed, and nothing else is touched (other files, links, mount points). Adapter tensors must be
    floating point and finite (``allow_nonfinite=True`` lets NaN and inf through).

    Raises:
        MergeError: the output is refused, an adapter tensor is not floating point or not finite, does not
            find its own checkpoint tensor, shapes or ranks do not fit, the adapter's config and weights
            disagree, or the checkpoint is corrupt (names the keys). Nothing is written then.
        AdapterError, LoraConfigError: the adapter folder cannot be read.
        WriteError: the output cannot be written (an ``OSError`` too); no file is replaced then.
    """
    base_path, out_path = Path(base), Path(output)
    if not base_path.exists():
        raise MergeError(f"{base_path}: no such file or folder")
    adapter_folder = adapter.folder if isinstance(adapter, Adapter) else Path(adapter)
    _check_output(base_path, adapter_folder, out_path)
    rules = explicit_key_map(key_map, strip_prefix)
    checkpoint = open_checkpoint(base_path)
    loaded = (
        adapter
        if isinstance(adapter, Adapter)
        else read_adapter(adapter, allow_pickle=allow_pickle, lazy=True)
    )
    plan = plan_merge(checkpoint, loaded, rules)
    check_adapter_values(plan, allow_nonfinite=allow_nonfinite)

    written = _Written()
    if not dry_run:
        try:
            written = _write(plan, base_path, adapter_folder, out_path, progress)
        except (WriteError, MergeError):
            raise
        except OSError as exc:  # no space left, no permission: no file was replaced
            raise WriteError(
                exc.errno, f"{out_path}: cannot write the merged checkpoint ({exc}); nothing was replaced"
            ) from exc
    kinds = {
        kind: tuple(sorted(t for t, ops in plan.ops.items() if any(op.kind == kind for op in ops)))
        for kind in ("lora", "replace")
    }
    return MergeReport(
        output=out_path,
        files=written.files,
        merged=kinds["lora"],
        replaced=kinds["replace"],
        copied=len(checkpoint.owner) - len(plan.ops),
        bytes_written=written.nbytes,
        mapping=plan.mapping,
        extra_files=written.extra,
        keys=plan.keys,
        skipped=written.skipped,
        removed=written.removed,
    )
