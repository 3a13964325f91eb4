"""A safetensors checkpoint (one file, or a folder of shards with an index), opened from its headers alone,
and which checkpoint tensor each adapter tensor changes (:func:`resolve_keys`): a one-to-one mapping,
explained, never guessed. Tensor data is streamed later by the merge.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from loragen.adapters.files import SafetensorsHeader, TensorEntry, read_json_file, read_safetensors_header
from loragen.errors import AdapterError, MergeError

__all__ = [
    "IDENTITY",
    "INDEX_SUFFIX",
    "MERGE_MARKER_NAME",
    "MODEL_CONFIG_NAME",
    "Checkpoint",
    "KeyMap",
    "PrefixRule",
    "explicit_key_map",
    "open_checkpoint",
    "resolve_keys",
    "wrapper_prefixes",
]


# ---- opening a checkpoint ----------------------------------------------------------------------------------

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


# ---- adapter paths -> checkpoint keys ----------------------------------------------------------------------


def _join(head: str, tail: str) -> str:
    return f"{head}.{tail}" if head and tail else head or tail


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
        return _join(self.new, path[len(self.old) :].removeprefix(".") if self.old else path)

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
        if not matching:
            return path
        return max(matching, key=lambda rule: len(rule.old)).apply(path)

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
    """The :class:`KeyMap` a caller asks for: ``key_map`` ``{OLD: NEW}`` prefix rewrites and
    ``strip_prefix`` prefixes to remove (``P`` is the rule ``P -> ""``); ``None`` when neither is given.

    Raises:
        MergeError: a prefix that is not a dotted path, a rule that changes nothing, or the same ``OLD``
            given twice.
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


def wrapper_prefixes(checkpoint: Checkpoint) -> tuple[list[tuple[str, str]], str]:
    """``[(architecture, base_model_prefix)]`` for the checkpoint's architectures, and a note saying
    where they come from or why there are none (no ``config.json``, no transformers, unknown class)."""
    if not checkpoint.architectures:
        return [], checkpoint.config_note
    try:
        transformers = importlib.import_module("transformers")
    except ImportError:
        return (
            [],
            f"transformers is not installed, so the wrapper of {', '.join(checkpoint.architectures)} is unknown",
        )
    found, unknown = [], []
    for name in checkpoint.architectures:
        try:
            prefix = getattr(getattr(transformers, name), "base_model_prefix", "")
        except (AttributeError, ImportError, RuntimeError):
            unknown.append(name)
            continue
        if isinstance(prefix, str) and prefix:
            found.append((name, prefix))
    note = f"{checkpoint.config_note} names {', '.join(checkpoint.architectures)}"
    if unknown:
        note += f"; transformers has no class {', '.join(unknown)}"
    return found, note


def _candidates(checkpoint: Checkpoint) -> tuple[list[KeyMap], str]:
    """The checkpoint's known wrapper as key maps: each prefix removed, then added (once per prefix)."""
    wrappers, note = wrapper_prefixes(checkpoint)
    maps: dict[tuple[PrefixRule, ...], KeyMap] = {}
    for arch, prefix in wrappers:
        why = f"{arch}.base_model_prefix is {prefix!r}"
        for rule in (PrefixRule(prefix, ""), PrefixRule("", prefix)):
            maps.setdefault((rule,), KeyMap((rule,), why))
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


def _unused(rules: Iterable[PrefixRule], paths: Iterable[str]) -> list[PrefixRule]:
    paths = list(paths)
    return [rule for rule in rules if rule.old and not any(rule.matches(p) for p in paths)]


def resolve_keys(
    targets: Mapping[str, Iterable[str]], checkpoint: Checkpoint, explicit: KeyMap | None = None
) -> tuple[KeyMap, dict[str, str]]:
    """Map every adapter target path to its own checkpoint key.

    Adapter paths are those of the model the adapter was trained on (``model.layers.0.mlp.up_proj.weight``); a
    checkpoint may store the same model under another wrapper. Tried in turn: (1) the paths as they are,
    when every one is a checkpoint tensor; (2) the checkpoint's known wrapper: its ``config.json`` names its
    architecture, and transformers' ``base_model_prefix`` of that class, ``P`` (``"model"``), is where a task
    model keeps its base model, so the paths are tried with ``P.`` removed from their front and with ``P.``
    added, and exactly one must fit (no wrapper without transformers or for a class it does not know);
    (3) otherwise only ``explicit`` prefix rules (``--key-map OLD=NEW``, ``--strip-prefix P``): a path equal
    to ``OLD`` or beginning with ``OLD.`` has that part replaced by ``NEW``, the longest ``OLD`` winning.
    Every adapter tensor must find its own checkpoint tensor.

    Args:
        targets: ``{adapter path (model key) the merge changes: the adapter file keys behind it}``.
        explicit: the caller's prefix rules (:func:`explicit_key_map`); then nothing else is tried.

    Returns:
        the key map used and ``{adapter path: checkpoint key}`` (one-to-one).

    Raises:
        MergeError: a path with no checkpoint tensor, two paths on one tensor, several default mappings
            that fit, or an explicit rule that matches no path; the message names the keys.
    """
    targets = {t: tuple(keys) for t, keys in sorted(targets.items())}
    names = set(checkpoint.owner)
    note = ""
    if explicit is not None:
        unused = _unused(explicit.rules, targets)
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
