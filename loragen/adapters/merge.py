"""Merge an adapter into a safetensors checkpoint offline, tensor by tensor, without the model class.

The checkpoint is read through its safetensors headers only. Each output file gets the input's header
verbatim (merging keeps every tensor's name, dtype and shape, so every byte offset stays the same) and
its data section is streamed in file order: untouched byte ranges are copied as they are, and each
tensor the adapter touches is merged a block of rows at a time, in fp32 (``W + scaling * B @ A`` in the
weight's layout) and rounded once to its dtype. Peak memory is a few blocks plus one module's LoRA
factors, whatever the size of the checkpoint or of its tensors.

Adapter keys name module paths of the model the adapter was trained on (``model.layers.0.q_proj``);
checkpoint keys may carry a different wrapper (``layers.0.q_proj.weight`` saved from a base model,
``bert.encoder...`` vs ``encoder...``). One mapping - drop some leading path components and/or add a
prefix - is chosen for the whole adapter, the one under which every adapter tensor finds its weight.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Literal

import torch

from loragen.adapters.io import (
    Adapter,
    AdapterError,
    SafetensorsHeader,
    SafetensorsReader,
    TensorEntry,
    read_adapter,
    read_safetensors_header,
)
from loragen.atomic import atomic_dir, atomic_file
from loragen.errors import MergeError

__all__ = [
    "MergeError",
    "Checkpoint",
    "MergeOp",
    "MergePlan",
    "MergeReport",
    "open_checkpoint",
    "plan_merge",
    "merge_checkpoint",
]

INDEX_SUFFIX = ".safetensors.index.json"
_MERGEABLE_DTYPES = ("F16", "BF16", "F32", "F64")
# Weight files of other formats are not copied next to the merged shards: they would hold unmerged weights.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
# Untouched bytes are copied, and merged tensors computed, in blocks of about this many bytes.
_BLOCK_BYTES = 4 << 20


# ---- the checkpoint ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Checkpoint:
    """A safetensors checkpoint: one file, or a folder of shards with an index.

    ``files`` are the safetensors files in index order, ``headers`` their parsed headers and
    ``owner`` maps each tensor name to the file that holds it.
    """

    root: Path
    files: tuple[Path, ...]
    index_path: Path | None
    headers: dict[Path, SafetensorsHeader]
    owner: dict[str, Path]

    @property
    def is_folder(self) -> bool:
        return self.root.is_dir()

    def entry(self, name: str) -> TensorEntry:
        return self.headers[self.owner[name]].tensors[name]


def _read_header(path: Path) -> SafetensorsHeader:
    try:
        return read_safetensors_header(path)
    except AdapterError as exc:
        raise MergeError(str(exc)) from None


def open_checkpoint(base: str | os.PathLike[str]) -> Checkpoint:
    """Read the headers of the checkpoint at ``base``: a ``.safetensors`` file or a folder.

    A folder holds ``*.safetensors.index.json`` with its shards, or a single ``.safetensors`` file.

    Raises:
        MergeError: nothing to read, an index naming missing shards or tensors, a corrupt header.
    """
    root = Path(base)
    if root.is_file():
        header = _read_header(root)
        return Checkpoint(root, (root,), None, {root: header}, {name: root for name in header.tensors})
    if not root.is_dir():
        raise MergeError(
            f"{root}: no such file or folder (expected a .safetensors file or a folder of shards)"
        )

    indexes = sorted(root.glob("*" + INDEX_SUFFIX))
    if len(indexes) > 1:
        raise MergeError(
            f"{root}: several index files ({', '.join(p.name for p in indexes)}); pass one model's file"
        )
    if not indexes:
        singles = sorted(root.glob("*.safetensors"))
        if len(singles) != 1:
            found = ", ".join(p.name for p in singles) or "no .safetensors file"
            raise MergeError(
                f"{root}: expected one .safetensors file, or shards with a *{INDEX_SUFFIX} index; found {found}"
            )
        header = _read_header(singles[0])
        return Checkpoint(
            root, (singles[0],), None, {singles[0]: header}, dict.fromkeys(header.tensors, singles[0])
        )

    index_path = indexes[0]
    try:
        weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise MergeError(f"{index_path}: not a safetensors index ({exc})") from None
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
    return Checkpoint(root, files, index_path, headers, owner)


# ---- planning ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MergeOp:
    """One change to one checkpoint tensor.

    ``kind`` is ``"lora"`` (add ``scaling * B @ A``; ``layout`` says how the delta lines up with the
    stored weight: ``"plain"`` (out, in...), ``"transposed"`` (a Conv1D weight stored (in, out)) or
    ``"embedding"``) or ``"replace"`` (the adapter holds the whole tensor: modules_to_save, a trained
    bias, peft's saved embedding base weight). Replacements are applied before LoRA deltas.
    """

    target: str
    kind: Literal["lora", "replace"]
    source_keys: tuple[str, ...]
    scaling: float = 0.0
    layout: Literal["plain", "transposed", "embedding"] = "plain"


@dataclass(frozen=True)
class MergePlan:
    """Everything a merge will do, decided from headers and the adapter before a byte is written.

    ``mapping`` describes how adapter paths were mapped onto checkpoint keys (for messages).
    """

    checkpoint: Checkpoint
    adapter: Adapter
    ops: dict[str, tuple[MergeOp, ...]]
    mapping: str


@dataclass(frozen=True)
class MergeReport:
    """What :func:`merge_checkpoint` wrote."""

    output: Path
    files: tuple[Path, ...]
    merged: tuple[str, ...]
    replaced: tuple[str, ...]
    copied: int
    bytes_written: int
    mapping: str = ""
    extra_files: tuple[str, ...] = field(default_factory=tuple)


def _adapter_targets(adapter: Adapter) -> dict[str, str]:
    """``{model key the adapter changes: kind}``: ``<module>.weight`` of LoRA modules, full tensors' keys."""
    targets = {f"{module}.weight": "lora" for module in adapter.lora_modules()}
    for info in adapter.keys.values():
        if not info.is_lora:
            targets.setdefault(info.model_key, "replace")
    return targets


@dataclass(frozen=True)
class _KeyMap:
    """Adapter key -> checkpoint key: drop ``strip`` leading path components, then prepend ``prefix``."""

    strip: int
    prefix: str

    def apply(self, key: str) -> str | None:
        parts = key.split(".")
        if self.strip >= len(parts):
            return None
        return self.prefix + ".".join(parts[self.strip :])

    def describe(self) -> str:
        if not self.strip and not self.prefix:
            return "adapter paths used as they are"
        steps = []
        if self.strip:
            steps.append(f"dropping {self.strip} leading path component{'s' * (self.strip > 1)}")
        if self.prefix:
            steps.append(f"adding the prefix {self.prefix!r}")
        return "adapter paths mapped by " + " and ".join(steps)


def _candidate_maps(key: str, names: Iterable[str]) -> set[_KeyMap]:
    parts = key.split(".")
    maps = set()
    for strip in range(len(parts) - 1):  # keep at least "<module>.<parameter>"
        tail = ".".join(parts[strip:])
        for name in names:
            if name == tail:
                maps.add(_KeyMap(strip, ""))
            elif name.endswith("." + tail):
                maps.add(_KeyMap(strip, name[: -len(tail)]))
    return maps


def _choose_map(targets: list[str], names: set[str]) -> tuple[_KeyMap, list[str]]:
    """The key mapping under which most targets exist in the checkpoint (then the simplest one)."""
    identity = _KeyMap(0, "")
    if not targets or all(t in names for t in targets):
        return identity, []
    candidates = {identity} | _candidate_maps(targets[0], names)
    # the first target may be the one that does not fit: take candidates from a second key as well
    if len(targets) > 1:
        candidates |= _candidate_maps(targets[-1], names)

    def missing(m: _KeyMap) -> list[str]:
        return [t for t in targets if m.apply(t) not in names]

    scored = sorted(
        ((len(missing(m)), m.strip + bool(m.prefix), m.strip, m.prefix, m) for m in candidates),
        key=lambda item: item[:4],
    )
    best = scored[0]
    if best[0] == len(targets):  # nothing fits under any mapping: report the keys as the adapter has them
        return identity, list(targets)
    ties = [s for s in scored if s[:2] == best[:2]]
    if len(ties) > 1 and best[0] == 0:
        options = "; ".join(s[4].describe() for s in ties)
        raise MergeError(
            f"the adapter's paths fit the checkpoint in several ways ({options}); "
            "the checkpoint probably holds several models - merge into one model's checkpoint"
        )
    return best[4], missing(best[4])


def _lora_layout(
    module: str,
    a: tuple[int, ...],
    b: tuple[int, ...],
    entry: TensorEntry,
    embedding: bool,
    fan_in_fan_out: bool,
) -> Literal["plain", "transposed", "embedding"]:
    """How ``B @ A`` (factor shapes ``a``, ``b``) lines up with the checkpoint tensor ``entry``."""
    if embedding:
        expected: tuple[int, ...] = (a[1], b[0])  # (num_embeddings, embedding_dim)
        if entry.shape == expected:
            return "embedding"
    else:
        if any(d != 1 for d in b[2:]):
            raise MergeError(f"{module}: lora_B has shape {b}, expected ({b[0]}, {a[0]}, 1, ...)")
        expected = (b[0], *a[1:])  # (out, in, *kernel)
        square = len(a) == 2 and a[1] == b[0]
        if len(a) == 2 and entry.shape == (a[1], b[0]) and (not square or fan_in_fan_out):
            return "transposed"  # a Conv1D weight, stored (in, out)
        if entry.shape == expected:
            return "plain"
    conv1d_hint = (
        "" if embedding or len(a) != 2 else f" (or {[expected[1], expected[0]]} for a Conv1D weight)"
    )
    raise MergeError(
        f"{entry.name}: the checkpoint tensor has shape {list(entry.shape)} but the adapter's {module} "
        f"(A {a}, B {b}) needs {list(expected)}{conv1d_hint}"
    )


def plan_merge(checkpoint: Checkpoint, adapter: Adapter) -> MergePlan:
    """Decide every change the merge makes, checking that the adapter fits the checkpoint.

    Raises:
        MergeError: adapter tensors with no checkpoint tensor (all listed), shape or rank mismatches,
            non-float target weights; nothing has been written.
    """
    names = set(checkpoint.owner)
    targets = _adapter_targets(adapter)
    key_map, missing = _choose_map(sorted(targets), names)
    if missing:
        shown = "\n  ".join(f"{t} (looked for {key_map.apply(t)!r})" for t in missing)
        raise MergeError(
            f"the adapter does not fit the checkpoint {checkpoint.root}: {len(missing)} of {len(targets)} "
            f"tensors it changes are not in the checkpoint ({key_map.describe()}):\n  {shown}"
        )

    config = adapter.config
    ops: dict[str, list[MergeOp]] = {}
    problems: list[str] = []
    for key, info in adapter.keys.items():
        if info.is_lora:
            continue
        target = key_map.apply(info.model_key)
        entry = checkpoint.entry(target)
        shape = adapter.shapes[key]
        if shape != entry.shape:
            problems.append(f"{key}: shape {list(shape)}, the checkpoint's {target} has {list(entry.shape)}")
            continue
        if entry.torch_dtype is None:
            problems.append(f"{target}: dtype {entry.dtype} is not supported by this torch")
            continue
        ops.setdefault(target, []).append(MergeOp(target, "replace", (key,)))

    for module, files_keys in sorted(adapter.lora_modules().items()):
        embedding = "lora_embedding_A" in files_keys or "lora_embedding_B" in files_keys
        key_a = files_keys.get("lora_embedding_A" if embedding else "lora_A")
        key_b = files_keys.get("lora_embedding_B" if embedding else "lora_B")
        if key_a is None or key_b is None:
            problems.append(
                f"{module}: the adapter has only {', '.join(files_keys.values())}, not both LoRA factors"
            )
            continue
        a, b = adapter.shapes[key_a], adapter.shapes[key_b]
        target = key_map.apply(f"{module}.weight")
        entry = checkpoint.entry(target)
        if entry.dtype not in _MERGEABLE_DTYPES:
            problems.append(
                f"{target}: dtype {entry.dtype} cannot take a LoRA delta "
                f"(expected one of {', '.join(_MERGEABLE_DTYPES)})"
            )
            continue
        rank = config.rank_for(module)
        if a[0] != rank:
            problems.append(
                f"{key_a}: rank {a[0]}, but the adapter config gives {module} rank {rank} "
                "(check r / rank_pattern)"
            )
            continue
        try:
            layout = _lora_layout(module, a, b, entry, embedding, config.fan_in_fan_out)
        except MergeError as exc:
            problems.append(str(exc))
            continue
        ops.setdefault(target, []).append(
            MergeOp(target, "lora", (key_a, key_b), config.scaling_for(module), layout)
        )
    if problems:
        raise MergeError(
            f"the adapter does not fit the checkpoint {checkpoint.root}:\n  " + "\n  ".join(problems)
        )
    ordered = {t: tuple(sorted(o, key=lambda op: op.kind != "replace")) for t, o in ops.items()}
    return MergePlan(checkpoint, adapter, ordered, key_map.describe())


# ---- applying ---------------------------------------------------------------------------------------------


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
    """Write the merged bytes of ``entry`` to ``dst``, a block of rows at a time.

    Each block is widened to fp32 (fp64 stays fp64), takes its rows of every replacement and every
    ``scaling * B @ A``, and is rounded once to the tensor's dtype. Memory: one block (about
    ``_BLOCK_BYTES`` of the tensor's dtype, twice that in fp32) plus the module's LoRA factors.
    """
    dtype = entry.torch_dtype
    if dtype is None:
        raise MergeError(f"{entry.name}: dtype {entry.dtype} is not supported by this torch")
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
            a, b = factors[op]
            if op.layout == "plain":  # W (out, in, *kernel) rows += s * B[rows] @ A
                work.view(stop - start, -1).addmm_(b[start:stop].flatten(1), a.flatten(1), alpha=op.scaling)
            else:  # Embedding (num_embeddings, dim) and Conv1D (in, out): rows += s * A[:, rows]^T @ B^T
                work.addmm_(a[:, start:stop].t(), b.t(), alpha=op.scaling)
        out = work.to(dtype).contiguous()
        # the raw little-endian bytes (through uint8: numpy has no bfloat16)
        dst.write(out.view(-1).view(torch.uint8).numpy().data if out.numel() else b"")


def _copy_range(src: BinaryIO, dst: BinaryIO, start: int, end: int, buffer: memoryview) -> None:
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
) -> list[str]:
    """Write ``header``'s file to ``out_path`` with the planned tensors merged; returns their names."""
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
    return [e.name for e in merged]


def _is_within(path: Path, folder: Path) -> bool:
    """Whether ``path`` is ``folder`` or lies inside it (after resolving links)."""
    path, folder = path.resolve(), folder.resolve()
    return path == folder or folder in path.parents


def _check_output(base: Path, out: Path) -> None:
    overwrites = _is_within(out, base) if base.is_dir() else out.resolve() == base.resolve()
    if overwrites:
        raise MergeError(
            f"refusing to write over the base checkpoint {base}: choose an output outside it (got {out})"
        )
    if _is_within(base, out):
        raise MergeError(
            f"refusing to write {out}: it contains the base checkpoint {base}, "
            "which replacing it would delete"
        )
    if base.is_dir() and out.exists() and not out.is_dir():
        raise MergeError(
            f"{out} is a file, but the base {base} is a folder of shards: the output must be a folder"
        )
    if base.is_file() and out.is_dir():
        raise MergeError(f"{out} is a folder, but the base {base} is one file: give an output file path")


def _progress(total: int, enabled: bool | None):
    from tqdm.auto import tqdm

    if enabled is None:
        enabled = sys.stderr.isatty()
    return tqdm(
        total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="merging", disable=not enabled
    )


def merge_checkpoint(
    base: str | os.PathLike[str],
    adapter: str | os.PathLike[str] | Adapter,
    output: str | os.PathLike[str],
    *,
    allow_pickle: bool = False,
    progress: bool | None = None,
) -> MergeReport:
    """Merge ``adapter`` into the safetensors checkpoint ``base``, writing ``output``.

    ``base`` is a ``.safetensors`` file (``output`` is then a file path) or a folder of shards with an
    index (``output`` is then a folder with the same shards, the same index and copies of the folder's
    other non-weight files such as ``config.json``). Tensors the adapter does not touch are copied
    byte for byte; merged ones keep their dtype, computed in fp32 and rounded once. The output appears
    atomically, only once complete. ``progress``: a progress bar on stderr (default: when it is a
    terminal).

    Raises:
        MergeError: the output would overwrite the base, the adapter does not fit the checkpoint (names
            the keys), or the checkpoint is corrupt. Nothing is written in these cases.
        AdapterError, LoraConfigError: the adapter folder cannot be read.
    """
    base_path, out_path = Path(base), Path(output)
    if not base_path.exists():
        raise MergeError(f"{base_path}: no such file or folder")
    _check_output(base_path, out_path)
    checkpoint = open_checkpoint(base_path)
    loaded = (
        adapter
        if isinstance(adapter, Adapter)
        else read_adapter(adapter, allow_pickle=allow_pickle, lazy=True)
    )
    plan = plan_merge(checkpoint, loaded)

    total = sum(h.file_size for h in checkpoint.headers.values())
    merged: list[str] = []
    extra: list[str] = []
    with _progress(total, progress) as bar:
        if checkpoint.is_folder:
            with atomic_dir(out_path) as tmp:
                for shard in checkpoint.files:
                    merged += _write_file(checkpoint.headers[shard], tmp / shard.name, plan, bar.update)
                for item in sorted(checkpoint.root.iterdir()):
                    if (
                        item.is_file()
                        and item.name not in {p.name for p in checkpoint.files}
                        and (item.name.endswith(INDEX_SUFFIX) or not item.name.endswith(_WEIGHT_SUFFIXES))
                    ):
                        shutil.copy2(
                            item, tmp / item.name
                        )  # the index is unchanged: same names, shards, sizes
                        extra.append(item.name)
            files = tuple(out_path / shard.name for shard in checkpoint.files)
        else:
            with atomic_file(out_path) as tmp:
                merged += _write_file(checkpoint.headers[checkpoint.root], tmp, plan, bar.update)
            files = (out_path,)

    replaced = tuple(sorted(t for t, ops in plan.ops.items() if any(op.kind == "replace" for op in ops)))
    lora = tuple(sorted(t for t, ops in plan.ops.items() if any(op.kind == "lora" for op in ops)))
    return MergeReport(
        output=out_path,
        files=files,
        merged=lora,
        replaced=replaced,
        copied=len(checkpoint.owner) - len(merged),
        bytes_written=total + sum(os.path.getsize(out_path / n) for n in extra),
        mapping=plan.mapping,
        extra_files=tuple(extra),
    )
