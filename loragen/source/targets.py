"""Which layer fields a config targets in a source file, for the rewriter and the decorator.

A rewrite changes a class, so every instance of it: a field is targeted when the config selects it at the
paths the file gives its class (``LlamaAttention.q_proj`` as ``model.layers.{i}.self_attn.q_proj``), with
``{i}`` and ``{key}`` tried at sample values by :func:`loragen.plan.resolve_candidates`; a config that picks
only some instances inside one model is an error.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Iterator

from loragen.config import LoraConfig
from loragen.plan import Candidate, LoraPlan, resolve_candidates
from loragen.source.codegen import py_literal
from loragen.source.scan import LayerField, LayerTypes, ScanResult, layer_types

__all__ = ["PRETRAINED", "Decision", "Targets", "overridden_method"]

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


def _instances(template: str, extra_keys: Iterable[str]) -> list[str]:
    """Concrete sample paths for a path with ``{i}`` / ``{key}`` placeholders."""
    if "{i}" not in template and "{key}" not in template:
        return [template]
    keys = list(dict.fromkeys([*_SAMPLE_KEYS, *extra_keys]))
    out = [
        template.replace("{i}", str(index)).replace("{key}", key)
        for index, key in itertools.product(_SAMPLE_INDICES, keys if "{key}" in template else keys[:1])
    ]
    if template.count("{i}") > 1:  # nested lists: also differing indices
        first, _, rest = template.partition("{i}")
        out.append(first + "0" + rest.replace("{i}", "1").replace("{key}", keys[0]))
    return out


def overridden_method(field: LayerField, result: ScanResult, types: LayerTypes) -> tuple[str, str] | None:
    """``(class, method)`` when ``field``'s layer subclass, or a class of the file between it and the layer type,
    replaces a method the type's LoRA class needs kept (its ``refused_overrides``: a convolution's ``forward``
    and ``_conv_forward``), so the runtime refuses to convert it; else None."""
    layer_type = types.for_qualname(field.layer)
    refused = layer_type.refused_overrides if layer_type is not None else ()
    name, seen = field.subclass, set()
    while refused and name is not None and name not in seen:
        seen.add(name)
        cls = result.get(name)
        if cls is None:
            return None
        method = next((m for m in refused if m in cls.methods), None)
        if method is not None:
            return name, method
        name = cls.local_bases[0] if cls.local_bases else None
    return None


class Targets:
    """The fields of a file as candidates of :func:`loragen.plan.resolve_candidates`: each field under every
    context the file gives its class, asked of the plan the runtime path uses."""

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
        self._plans: dict[int, LoraPlan] = {}

    def _family_heads(self, root: str) -> set[str]:
        """Paths of the output head in an instance of ``root``."""
        cls = self.by_name.get(root)
        seen: set[str] = set()
        while cls is not None and cls.name not in seen:
            seen.add(cls.name)
            if cls.output_head is not None:
                return set(cls.output_head)
            cls = self.by_name.get(cls.local_bases[0]) if cls.local_bases else None
        # PreTrainedModel.get_output_embeddings: self.lm_head
        return {"lm_head"} if self.is_pretrained(root) else set()

    def ancestors(self, name: str) -> set[str]:
        """The classes that class ``name`` derives from through the file's classes."""
        found: set[str] = set()
        todo = [name]
        while todo:
            cls = self.by_name.get(todo.pop())
            for base in cls.local_bases if cls is not None else ():
                if base not in found:
                    found.add(base)
                    todo.append(base)
        return found

    def is_pretrained(self, name: str) -> bool:
        """Whether class ``name`` derives from transformers' ``PreTrainedModel`` (through the file's classes)."""
        classes = [self.by_name.get(c) for c in {name} | self.ancestors(name)]
        return any(b in PRETRAINED for cls in classes if cls is not None for b in cls.base_names)

    def candidates(self, field: LayerField) -> list[Candidate]:
        """``field`` at each of its sample paths. A field that is some model's output head is described as
        the head everywhere: a rewrite changes every instance of its class alike."""
        contexts = self.contexts.get(field.owner, [(field.owner, "")])
        head = any(prefix + field.path in self._family_heads(root) for root, prefix in contexts)
        spec = self.types.for_qualname(field.layer)
        return [
            Candidate(path, field.layer, linear=spec is not None and spec.linear, output_head=head)
            for _, path in self.paths(field.owner, field.path)
        ]

    def plan(self, field: LayerField) -> LoraPlan:
        """The plan for ``field``'s sample paths."""
        if id(field) not in self._plans:
            self._plans[id(field)] = resolve_candidates(self.config, self.candidates(field))
        return self._plans[id(field)]

    def paths(self, owner: str, path: str) -> Iterator[tuple[str, str]]:
        """``(root class, sample module path)`` for ``path`` in class ``owner``, under each of its contexts."""
        for root, prefix in self.contexts.get(owner, [(owner, "")]):
            yield from ((root, sample) for sample in _instances(prefix + path, self.extra_keys))

    def selected_non_layers(self, paths: Iterable[str]) -> str | None:
        """The first of ``paths`` (of modules that are not layers: containers, sub-models) the config's
        targets select, or None."""
        plan = resolve_candidates(self.config, [Candidate(path, None) for path in paths])
        return plan.unsupported[0] if plan.unsupported else None

    def unmatched(self) -> tuple[str, ...]:
        """The entries of ``target_modules`` that select no layer field of the file under any context
        (the rule the runtime converter warns with), or the whole regex / ``"all-linear"`` string."""
        seen: dict[str, Candidate] = {}
        for f in self.result.fields:
            for c in self.candidates(f):
                seen.setdefault(c.path, c)
        return resolve_candidates(self.config, list(seen.values())).unmatched

    def subclass_refusal(self, field: LayerField) -> str | None:
        """Why ``field``'s layer subclass (a class of the file) is not adapted, as the runtime refuses it (see
        :func:`overridden_method`), or None."""
        found = overridden_method(field, self.result, self.types)
        if found is None:
            return None
        name, method = found
        return (
            f"{name} overrides {field.layer.rpartition('.')[2]}.{method}, and peft builds the LoRA factors of such "
            f"a layer as {field.subclass} layers, so that method acts on the factors too; loragen's factors are "
            "plain convolutions and could not give peft's outputs or files (get_lora_model refuses it too). Leave "
            "the field out of target_modules"
        )

    def decide(self, field: LayerField) -> Decision:
        """Whether ``field`` is rewritten, with which rank and alpha, or why it cannot be."""
        plan = self.plan(field)
        by_root: dict[str, list[str]] = {}
        for root, path in self.paths(field.owner, field.path):
            by_root.setdefault(root, []).append(path)
        where = f"{field.owner}.{field.pattern}"
        chosen: list[str] = []
        for root, paths in by_root.items():
            hits = [p for p in paths if p in plan]
            misses = [p for p in paths if p not in plan]
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
        refusal = self.subclass_refusal(field)
        if refusal is not None:
            return Decision(True, error=f"{where}: {refusal}")
        per_root: dict[str, tuple[int, float]] = {}
        for root in chosen:
            root_values = {(plan.entries[p].r, plan.entries[p].lora_alpha) for p in by_root[root]}
            if len(root_values) > 1:
                return Decision(
                    True,
                    error=(
                        f"{where}: rank_pattern/alpha_pattern give different values inside {root} "
                        f"({sorted(root_values)}); a source rewrite has one constructor call per field. Use "
                        "loragen.get_lora_model or @lora_convert"
                    ),
                )
            per_root[root] = root_values.pop()
        # with several roots (the class used on its own, inside a model, ...) prefer the outermost path
        longest = max(chosen, key=lambda root: max(len(p) for p in by_root[root]))
        r, alpha = per_root[longest]
        values = set(per_root.values())
        warning = None
        if len(values) > 1:
            warning = (
                f"{where}: rank/alpha depend on where the class is used ({sorted(values)}); "
                f"using r={r}, lora_alpha={py_literal(alpha)} from {longest}"
            )
        return Decision(True, r, alpha, warning=warning)
