"""Opening a safetensors checkpoint: one file, or a folder of shards with an index, headers only.

Nothing but headers (and the folder's ``config.json``, for the architecture the checkpoint was saved
from) is read; tensor data is streamed later by the merge.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from loragen.adapters.json_file import read_json_file
from loragen.adapters.safetensors_file import SafetensorsHeader, TensorEntry, read_safetensors_header
from loragen.errors import AdapterError, MergeError

__all__ = ["INDEX_SUFFIX", "MERGE_MARKER_NAME", "MODEL_CONFIG_NAME", "Checkpoint", "open_checkpoint"]

INDEX_SUFFIX = ".safetensors.index.json"
MODEL_CONFIG_NAME = "config.json"
# every folder loragen merge writes holds this file; a later merge may replace such a folder
MERGE_MARKER_NAME = "loragen_merge.json"


@dataclass(frozen=True)
class Checkpoint:
    """A safetensors checkpoint: one file, or a folder of shards with an index.

    ``files`` are the safetensors files in index order, ``headers`` their parsed headers and
    ``owner`` maps each tensor name to the file that holds it. ``architectures`` are the model classes
    the ``config.json`` beside the checkpoint names (transformers writes it); ``config_note`` says where
    they come from, or why there are none.
    """

    root: Path
    files: tuple[Path, ...]
    index_path: Path | None
    headers: dict[Path, SafetensorsHeader]
    owner: dict[str, Path]
    architectures: tuple[str, ...] = ()
    config_note: str = ""

    @property
    def is_folder(self) -> bool:
        """Whether the checkpoint is a folder (its output is then a folder too)."""
        return self.root.is_dir()

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
    """The ``weight_map`` of a shard index: tensor name -> shard file name in the index's folder.

    Raises:
        MergeError: the index is not JSON of that form, or names a shard that is not a plain file name
            (a path such as ``../x.safetensors``, ``a/model.safetensors`` or an absolute path would be
            read from, and written to, somewhere else than the checkpoint folder).
    """
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


def _open(root: Path) -> tuple[tuple[Path, ...], Path | None, dict[Path, SafetensorsHeader], dict[str, Path]]:
    if root.is_file():
        header = _read_header(root)
        return (root,), None, {root: header}, dict.fromkeys(header.tensors, root)
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
        return (singles[0],), None, {singles[0]: header}, dict.fromkeys(header.tensors, singles[0])

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
    return files, index_path, headers, owner


def open_checkpoint(base: str | os.PathLike[str]) -> Checkpoint:
    """Read the headers of the checkpoint at ``base``: a ``.safetensors`` file or a folder.

    A folder holds ``*.safetensors.index.json`` with its shards, or a single ``.safetensors`` file. The
    ``config.json`` in the folder (for a file: beside it) gives the checkpoint's architectures.

    Raises:
        MergeError: nothing to read, an index that is not JSON of the expected form or names shards that
            are not plain file names in the folder, missing shards or tensors, a corrupt header.
    """
    root = Path(base)
    files, index_path, headers, owner = _open(root)
    architectures, note = _architectures(root if root.is_dir() else root.parent)
    return Checkpoint(root, files, index_path, headers, owner, architectures, note)
