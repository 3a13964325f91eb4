"""Merge an adapter into a safetensors checkpoint offline, tensor by tensor, without the model class.

The checkpoint is read through its safetensors headers only (:mod:`loragen.adapters.checkpoint`) and
every change is decided before writing (:mod:`loragen.adapters.merge_plan`). Each output file gets the
input's header verbatim (merging keeps every tensor's name, dtype and shape, so every byte offset stays
the same) and its data section is streamed in file order: untouched byte ranges are copied as they are,
and each tensor the adapter touches is merged a block of rows at a time, in fp32 (``W + scaling * B @ A``
in the weight's layout, ``Layout.delta_row_factors``) and rounded once to its dtype. Peak memory is a few
blocks plus one module's LoRA factors, whatever the size of the checkpoint or of its tensors. The output
appears atomically (:mod:`loragen.atomic`), only once complete.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from io import BufferedReader
from pathlib import Path
from typing import Any, BinaryIO

import torch

from loragen.adapters.checkpoint import INDEX_SUFFIX, MERGE_MARKER_NAME, explicit_key_map, open_checkpoint
from loragen.adapters.files import SafetensorsHeader, SafetensorsReader, TensorEntry, read_safetensors_header
from loragen.adapters.folder import Adapter, read_adapter
from loragen.adapters.merge_plan import MergeOp, MergePlan, check_adapter_values, plan_merge
from loragen.atomic import WriteError, atomic_dir, atomic_file
from loragen.errors import AdapterError, MergeError

__all__ = ["MergeError", "MergeReport", "merge_checkpoint"]

# Weight files of other formats are not copied next to the merged shards: they would hold unmerged weights.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
# Untouched bytes are copied, and merged tensors computed, in blocks of about this many bytes.
_BLOCK_BYTES = 4 << 20


@dataclass(frozen=True)
class MergeReport:
    """What :func:`merge_checkpoint` wrote (or, with ``dry_run=True``, would write: ``files`` empty)."""

    output: Path
    files: tuple[Path, ...]
    merged: tuple[str, ...]
    replaced: tuple[str, ...]
    copied: int
    bytes_written: int
    mapping: str = ""
    extra_files: tuple[str, ...] = field(default_factory=tuple)
    keys: dict[str, str] = field(default_factory=dict)


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


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _chain(path: Path) -> list[tuple[int, int]]:
    """The identities (device, inode) of ``path`` and of each of its existing folders up to the root,
    links resolved: ``x`` is ``path`` or lies inside it when ``x``'s identity is in this chain."""
    chain = []
    for item in (path, *path.parents, *path.resolve().parents):
        identity = _identity(item)
        if identity is not None and identity not in chain:
            chain.append(identity)
    return chain


def _overlaps(a: Path, b: Path) -> bool:
    """Whether ``a`` is ``b`` or lies inside it (by path and by inode, so hard links and bind mounts count)."""
    identity = _identity(b)
    if identity is not None and identity in _chain(a):
        return True
    resolved_a, resolved_b = a.resolve(), b.resolve()
    return resolved_a == resolved_b or resolved_b in resolved_a.parents


def _is_merge_output(folder: Path) -> bool:
    return (folder / MERGE_MARKER_NAME).is_file() and not (folder / MERGE_MARKER_NAME).is_symlink()


def _check_output(base: Path, adapter: Path, out: Path) -> None:
    """Refuse an output that would write into or onto the base or the adapter, or replace other files.

    Raises:
        MergeError: ``out`` is the base or the adapter, lies inside one or contains one (by path or inode),
            is a symbolic link, has the wrong kind (a file for a folder checkpoint, or the reverse), or is
            an existing folder that is neither empty nor a previous ``loragen merge`` output (its
            ``loragen_merge.json``), or an existing file that is not a safetensors checkpoint.
    """
    for what, other in (("base checkpoint", base), ("adapter", adapter)):
        if _overlaps(out, other):
            raise MergeError(
                f"refusing to write {out}: it is, or lies inside, the {what} {other}; choose an output outside it"
            )
        if os.path.lexists(out) and _overlaps(other, out):
            raise MergeError(
                f"refusing to write {out}: it contains the {what} {other}, which replacing it would delete"
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
        if out.is_dir() and not _is_merge_output(out):
            held = sorted(p.name for p in out.iterdir())
            if held:
                shown = ", ".join(held[:5]) + (f" and {len(held) - 5} more" if len(held) > 5 else "")
                raise MergeError(
                    f"refusing to write {out}: the folder holds other files ({shown}) and is not a previous "
                    f"loragen merge output (no {MERGE_MARKER_NAME}); give a new or empty folder"
                )
        return
    if out.is_dir():
        raise MergeError(f"{out} is a folder, but the base {base} is one file: give an output file path")
    if out.exists():
        try:
            read_safetensors_header(out)
        except (AdapterError, OSError):
            raise MergeError(
                f"refusing to overwrite {out}: it is not a safetensors checkpoint; give a new file path"
            ) from None


def _progress(total: int, enabled: bool | None) -> Any:
    from tqdm.auto import tqdm  # only a merge that writes needs it

    if enabled is None:
        enabled = sys.stderr.isatty()
    return tqdm(
        total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="merging", disable=not enabled
    )


def _extra_files(root: Path, shards: Iterable[Path]) -> list[Path]:
    """The files of a checkpoint folder copied beside the merged shards: the index, config.json,
    tokenizer files; not the shards (written merged) nor weights in other formats (they are unmerged)."""
    names = {p.name for p in shards} | {MERGE_MARKER_NAME}
    return [
        item
        for item in sorted(root.iterdir())
        if item.is_file()
        and item.name not in names
        and (item.name.endswith(INDEX_SUFFIX) or not item.name.endswith(_WEIGHT_SUFFIXES))
    ]


def _marker(plan: MergePlan) -> str:
    """What ``loragen_merge.json`` records: that loragen wrote the folder, and from what."""
    record = {
        "loragen_merge": 1,
        "base": str(plan.checkpoint.root.resolve()),
        "adapter": str(plan.adapter.folder.resolve()),
        "note": "written by loragen merge; a later loragen merge may replace this folder",
    }
    return json.dumps(record, indent=2) + "\n"


def _write(
    plan: MergePlan, out_path: Path, progress: bool | None
) -> tuple[tuple[Path, ...], list[str], list[str]]:
    """Write the merged checkpoint atomically; returns its files, the merged tensors, the extra files."""
    checkpoint = plan.checkpoint
    total = sum(h.file_size for h in checkpoint.headers.values())
    merged: list[str] = []
    extra: list[str] = []
    with _progress(total, progress) as bar:
        if checkpoint.is_folder:
            with atomic_dir(out_path) as tmp:
                for shard in checkpoint.files:
                    merged += _write_file(checkpoint.headers[shard], tmp / shard.name, plan, bar.update)
                for item in _extra_files(checkpoint.root, checkpoint.files):
                    shutil.copy2(item, tmp / item.name)  # the index is unchanged: same names, shards, sizes
                    extra.append(item.name)
                (tmp / MERGE_MARKER_NAME).write_text(_marker(plan), encoding="utf-8")
            return tuple(out_path / shard.name for shard in checkpoint.files), merged, extra
        with atomic_file(out_path) as tmp:
            merged += _write_file(checkpoint.headers[checkpoint.root], tmp, plan, bar.update)
        return (out_path,), merged, extra


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

    ``base`` is a ``.safetensors`` file (``output`` is then a file path) or a folder of shards with an
    index (``output`` is then a folder with the same shards, the same index and copies of the folder's
    other non-weight files such as ``config.json``). Tensors the adapter does not touch are copied
    byte for byte; merged ones keep their dtype, computed in fp32 and rounded once. The output appears
    atomically, only once complete. ``progress``: a progress bar on stderr (default: when it is a
    terminal).

    Which checkpoint tensor each adapter tensor changes is decided one to one: the adapter's paths as
    they are, or under the checkpoint's known wrapper (its ``config.json`` architecture's
    ``base_model_prefix``: see :mod:`loragen.adapters.key_map`). Anything else only through
    ``key_map`` (``{OLD: NEW}``: adapter paths beginning with ``OLD`` get ``NEW`` instead) and
    ``strip_prefix`` (prefixes removed from adapter paths); then nothing else is tried.
    ``dry_run=True`` decides everything and writes nothing (``report.keys`` holds the key map).

    Only these outputs are written: a new path, an empty folder, a folder holding a previous merge
    output (recognised by the ``loragen_merge.json`` every merged folder gets), or (for a one-file base)
    an existing safetensors file; never the base or the adapter, nothing inside them or containing them.
    Adapter tensors must be floating point and finite (``allow_nonfinite=True`` lets NaN and inf through).

    Raises:
        MergeError: the output is refused (see above), an adapter tensor is not floating point or holds NaN
            or inf (names the key), an adapter tensor finds no checkpoint tensor or
            shares one with another (names the keys), shapes or ranks do not fit, or the checkpoint is
            corrupt. Nothing is written in these cases.
        AdapterError, LoraConfigError: the adapter folder cannot be read.
        WriteError: the output cannot be written (an ``OSError`` too); it is then left as it was.
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

    files: tuple[Path, ...] = ()
    merged: list[str] = [t for t in checkpoint.owner if t in plan.ops]
    extra: list[str] = []
    if not dry_run:
        try:
            files, merged, extra = _write(plan, out_path, progress)
        except WriteError:
            raise
        except OSError as exc:  # no space left, no permission: the output was not touched
            raise WriteError(
                exc.errno, f"{out_path}: cannot write the merged checkpoint ({exc}); nothing was replaced"
            ) from exc
    replaced = tuple(sorted(t for t, ops in plan.ops.items() if any(op.kind == "replace" for op in ops)))
    lora = tuple(sorted(t for t, ops in plan.ops.items() if any(op.kind == "lora" for op in ops)))
    total = sum(h.file_size for h in checkpoint.headers.values())
    return MergeReport(
        output=out_path,
        files=files,
        merged=lora,
        replaced=replaced,
        copied=len(checkpoint.owner) - len(merged),
        bytes_written=0 if dry_run else total + sum(os.path.getsize(out_path / n) for n in extra),
        mapping=plan.mapping,
        extra_files=tuple(extra),
        keys=plan.keys,
    )
