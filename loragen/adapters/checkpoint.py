"""A safetensors checkpoint (a file, or shards with an index) opened from its headers alone, and which
checkpoint tensor each adapter tensor changes (:func:`resolve_keys`): one to one, explained, never guessed.
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
]

INDEX_SUFFIX = ".safetensors.index.json"
MODEL_CONFIG_NAME = "config.json"
# every folder loragen merge writes holds this file; a later merge may replace such a folder
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


def _open(root: Path) -> tuple[tuple[Path, ...], Path | None, dict[Path, SafetensorsHeader], dict[str, Path]]:
    if not root.is_file() and not root.is_dir():
        raise MergeError(
            f"{root}: no such file or folder (expected a .safetensors file or a folder of shards)"
        )
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
    """Read the headers of the checkpoint at ``base``: a ``.safetensors`` file, or a folder holding one
    or shards with a ``*.safetensors.index.json``; ``config.json`` there gives its architectures.

    Raises:
        MergeError: nothing to read, a malformed index, missing shards or tensors, a corrupt header.
    """
    root = Path(base)
    files, index_path, headers, owner = _open(root)
    architectures, note = _architectures(root if root.is_dir() else root.parent)
    return Checkpoint(root, files, index_path, headers, owner, architectures, note)


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
