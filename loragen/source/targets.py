"""Which layer fields a config targets in a source file, for :mod:`loragen.source.rewriter`.

A rewrite changes a class, so every instance of it: a field is targeted when the config selects it under
the paths the file gives its class (``LlamaAttention.q_proj`` is ``model.layers.{i}.self_attn.q_proj``
inside ``LlamaForCausalLM``, ``q_proj`` on its own). ``{i}`` and ``{key}`` are tried with sample values;
a config that picks only some of them (per-layer targets or ranks) cannot be written as one constructor
call and is an error. Private: used by :func:`loragen.source.rewriter.rewrite_source`.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Iterator

from loragen.config import ALL_LINEAR, LoraConfig
from loragen.source.codegen import py_literal
from loragen.source.scan import LayerField, ScanResult, layer_types

__all__ = ["PRETRAINED", "Decision", "Targets", "instances"]

PRETRAINED = ("transformers.modeling_utils.PreTrainedModel", "transformers.PreTrainedModel")
_SAMPLE_INDICES = (0, 1, 2, 3, 7, 10, 11, 99)
_SAMPLE_KEYS = ("key_a", "key_b")


@dataclasses.dataclass
class Decision:
    """Whether a field is targeted, with its rank and alpha, or why it cannot be rewritten."""

    targeted: bool
    r: int = 0
    alpha: float = 0.0
    error: str | None = None
    warning: str | None = None


def instances(template: str, extra_keys: Iterable[str]) -> list[str]:
    """Concrete sample paths for a path with ``{i}`` / ``{key}`` placeholders."""
    if "{i}" not in template and "{key}" not in template:
        return [template]
    keys = list(dict.fromkeys([*_SAMPLE_KEYS, *extra_keys]))
    out = []
    for index, key in itertools.product(_SAMPLE_INDICES, keys if "{key}" in template else keys[:1]):
        out.append(template.replace("{i}", str(index)).replace("{key}", key))
    if template.count("{i}") > 1:  # nested lists: also differing indices
        first, _, rest = template.partition("{i}")
        out.append(first + "0" + rest.replace("{i}", "1").replace("{key}", keys[0]))
    return out


class Targets:
    """The config's matching rules applied to a field under every context the file gives its class."""

    def __init__(self, config: LoraConfig, result: ScanResult) -> None:
        self.config = config
        self.result = result
        self.types = layer_types()
        self.by_name = {c.name: c for c in result.classes}
        self.contexts = {c.name: result.contexts(c.name) for c in result.classes}
        targets = config.target_modules
        self.extra_keys = (
            [] if targets is None or isinstance(targets, str) else [t.rpartition(".")[2] for t in targets]
        )

    def _family_heads(self, root: str) -> set[str]:
        """Paths ``all-linear`` leaves out in an instance of ``root`` (its output head)."""
        heads: set[str] = set()
        cls = self.by_name.get(root)
        seen: set[str] = set()
        while cls is not None and cls.name not in seen:
            seen.add(cls.name)
            if cls.output_head is not None:
                return set(cls.output_head)
            cls = self.by_name.get(cls.local_bases[0]) if cls.local_bases else None
        if self.is_pretrained(root):
            heads.add("lm_head")  # PreTrainedModel.get_output_embeddings: self.lm_head
        return heads

    def is_pretrained(self, name: str) -> bool:
        """Whether class ``name`` derives from transformers' ``PreTrainedModel`` (through the file's classes)."""
        seen: set[str] = set()
        todo = [name]
        while todo:
            item = todo.pop()
            cls = self.by_name.get(item)
            if cls is None or item in seen:
                continue
            seen.add(item)
            if any(b in PRETRAINED for b in cls.base_names):
                return True
            todo.extend(cls.local_bases)
        return False

    def matches(self, field: LayerField, path: str, target: str | None = None) -> bool:
        """Whether the config (or only its list entry ``target``) selects ``field`` at module path ``path``."""
        if self.config.target_modules == ALL_LINEAR:
            spec = self.types.for_qualname(field.layer)
            linear = spec is not None and spec.linear
            return self.config.matches_target(path, (path,) if linear else ())
        return self.config.matches_target(path, None if target is None else (target,))

    def paths(self, field: LayerField) -> Iterator[tuple[str, str]]:
        """``(root class, sample module path)`` for ``field`` under every context the file gives its class."""
        for root, prefix in self.contexts.get(field.owner, [(field.owner, "")]):
            for path in instances(prefix + field.path, self.extra_keys):
                yield root, path

    def selects(self, field: LayerField) -> bool:
        """Whether the config selects ``field`` under some context (the decorator's test for a branch)."""
        return any(self.matches(field, path) for _, path in self.paths(field))

    def unmatched(self) -> tuple[str, ...]:
        """The entries of ``target_modules`` that select no layer field of the file under any context:
        list entries by name (:meth:`LoraConfig.unmatched_entries`, the rule the runtime converter warns
        with), or the whole regex / ``"all-linear"`` string."""
        targets = self.config.target_modules
        if targets is None:
            return ()
        if isinstance(targets, str):
            hit = any(self.matches(f, path) for f in self.result.fields for _, path in self.paths(f))
            return () if hit else (targets,)
        return self.config.unmatched_entries(path for f in self.result.fields for _, path in self.paths(f))

    def decide(self, field: LayerField) -> Decision:
        config = self.config
        contexts = self.contexts.get(field.owner, [(field.owner, "")])
        if config.target_modules == ALL_LINEAR and any(
            prefix + field.path in self._family_heads(root) for root, prefix in contexts
        ):
            return Decision(False)  # the output head of some model in the file: all-linear leaves it out
        by_root: dict[str, list[tuple[str, bool]]] = {}
        for root, path in self.paths(field):
            by_root.setdefault(root, []).append((path, self.matches(field, path)))
        where = f"{field.owner}.{field.pattern}"
        chosen: list[str] = []
        for root, results in by_root.items():
            hits = [p for p, hit in results if hit]
            misses = [p for p, hit in results if not hit]
            if hits and misses:
                return Decision(
                    False,
                    error=(
                        f"{where}: the config selects only some instances inside {root} (e.g. {hits[0]} but "
                        f"not {misses[0]}); a source rewrite changes every instance of the class alike. Use "
                        "loragen.get_lora_model or @lora_convert for per-layer targets"
                    ),
                )
            if hits:
                chosen.append(root)
        if not chosen:
            return Decision(False)
        values: dict[tuple[int, float], list[str]] = {}
        for root in chosen:
            root_values = {(config.rank_for(p), config.alpha_for(p)) for p, _ in by_root[root]}
            if len(root_values) > 1:
                return Decision(
                    True,
                    error=(
                        f"{where}: rank_pattern/alpha_pattern give different values inside {root} "
                        f"({sorted(root_values)}); a source rewrite has one constructor call per field. Use "
                        "loragen.get_lora_model or @lora_convert"
                    ),
                )
            for value in root_values:
                values.setdefault(value, []).append(root)
        # with several roots (the class used on its own, inside a model, ...) prefer the outermost path
        longest = max(chosen, key=lambda root: max(len(p) for p, _ in by_root[root]))
        r, alpha = next(v for v, roots in values.items() if longest in roots)
        warning = None
        if len(values) > 1:
            warning = (
                f"{where}: rank/alpha depend on where the class is used ({sorted(values)}); "
                f"using r={r}, lora_alpha={py_literal(alpha)} from {longest}"
            )
        return Decision(True, r, alpha, warning=warning)
