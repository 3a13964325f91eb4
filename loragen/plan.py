"""The one place a :class:`~loragen.config.LoraConfig`'s matching rules are read: config + model -> plan.

:func:`resolve` interprets the config's target, exclusion, layer, pattern, parameter, bias and task fields
against a model and returns a :class:`LoraPlan` (per module path: layer kind, rank, alpha, scaling and
variant; what else trains; the config the converted model keeps). It raises every error up front and
changes nothing; :mod:`loragen.convert` applies plans. The rules work on :class:`Candidate` descriptions,
so the source rewriter asks :func:`resolve_candidates` the same questions about source text. The functions
at the end answer questions about module paths read from an adapter file.

``all-linear`` follows peft 0.21, including on transformers 5 MoE models of the ``mixtral`` /
``qwen2_moe`` conversion families, where it also adapts the fused expert parameters and the router.
"""

from __future__ import annotations

import dataclasses
import math
import re
import sys
import warnings
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from loragen.config import ALL_LINEAR, BiasMode, InitMode, LoraConfig, LoraConfigWarning, TargetWarning
from loragen.errors import LoraConfigError, LoraConversionError, LoraError

if TYPE_CHECKING:
    from torch import nn

# torch, the registry and the layers are imported only where a live model is described (the rewriter
# runs without torch)

__all__ = [
    "Candidate",
    "PlanEntry",
    "LoraPlan",
    "resolve",
    "resolve_candidates",
    "candidates_of",
    "entry_for",
    "saved_modules",
    "embedding_targeted",
    "targets_parameters_of",
    "fused_expert_parameters",
    "max_rank",
]

_SHOWN = 20
_SHOWN_PARAMETERS = 12

# model_type -> the modules peft adapts when target_modules is None (peft's
# TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING, peft/utils/constants.py)
_QV = ("q_proj", "v_proj")
_QKV = ("query_key_value",)
_DEFAULT_TARGETS: Mapping[str, str | tuple[str, ...]] = {
    **dict.fromkeys(("t5", "mt5"), ("q", "v")),
    **dict.fromkeys(("gpt2", "gpt_bigcode"), ("c_attn",)),
    **dict.fromkeys(("bloom", "gpt_neox", "chatglm", "RefinedWebModel", "RefinedWeb", "falcon"), _QKV),
    **dict.fromkeys(("bert", "roberta", "xlm-roberta", "electra", "layoutlm"), ("query", "value")),
    **dict.fromkeys(
        ("bart", "opt", "gptj", "gpt_neo", "llama", "llama4", "mistral", "mixtral", "stablelm", "gemma"), _QV
    ),
    **dict.fromkeys(("gemma2", "gemma3_text", "qwen2", "qwen3"), _QV),
    "blip-2": ("q", "v", "q_proj", "v_proj"),
    "deberta-v2": ("query_proj", "value_proj"),
    "deberta": ("in_proj",),
    "mpt": ("Wqkv",),
    "btlm": ("c_proj", "c_attn"),
    "codegen": ("qkv_proj",),
    "phi": ("q_proj", "v_proj", "fc1", "fc2"),
    "rwkv": ("key", "value", "receptance", "output"),
    "rwkv7": ("r_proj", "k_proj", "v_proj", "o_proj", "key", "value"),
    "gemma4": r".*language_model\..*\.(q_proj|v_proj)",
    "nemotron_h": ("q_proj", "k_proj", "v_proj", "o_proj"),
}
# task_type -> the head modules peft trains in full beside the adapter (peft's PeftModelFor<Task> classes)
_TASK_HEADS: Mapping[str, tuple[str, ...]] = {
    "SEQ_CLS": ("classifier", "score"),
    "TOKEN_CLS": ("classifier", "score"),
    "QUESTION_ANS": ("qa_outputs",),
}


def _name_matches(names: str | Sequence[str], path: str) -> bool:
    """peft's rule: a string is a full-match regex; a list matches a name exactly or as a dotted suffix."""
    if isinstance(names, str):
        return re.fullmatch(names, path) is not None
    return any(path == n or path.endswith("." + n) for n in names)


def _pattern_value(patterns: Mapping[str, Any], path: str, default: Any) -> Any:
    """The first ``rank_pattern`` / ``alpha_pattern`` value whose key matches ``path`` as peft matches it."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", path):
            return value
    return default


def _is_excluded(config: LoraConfig, path: str) -> bool:
    """``exclude_modules`` or ``modules_to_save`` (trained in full, with all inside it) rule ``path`` out."""
    excluded = config.exclude_modules
    if excluded is not None and _name_matches(excluded, path):
        return True
    return any(re.match(rf"(^|.*\.){re.escape(name)}($|\..*)", path) for name in config.modules_to_save or ())


def _layer_index(config: LoraConfig, path: str) -> int | None:
    """The layer index of ``path`` as peft finds it."""
    patterns = config.layers_pattern
    if not patterns:
        found = [re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", path)]
    else:
        names = (patterns,) if isinstance(patterns, str) else patterns
        found = [re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", path) for pattern in names]
    m = next((m for m in found if m is not None), None)
    return None if m is None else int(m.group("idx"))


def _matches(config: LoraConfig, path: str, targets: str | Sequence[str]) -> bool:
    """Whether ``targets`` (the config's, or one entry of its list) selects ``path``, with peft's rules."""
    if _is_excluded(config, path):
        return False
    if isinstance(targets, str) or path in targets:  # an exact path ignores layers_to_transform (as peft)
        return _name_matches(targets, path)
    if not _name_matches(targets, path):
        return False
    layers = config.layers_to_transform
    if layers is None or (not isinstance(layers, int) and len(layers) == 0):
        return True
    index = _layer_index(config, path)
    return index is not None and (index == layers if isinstance(layers, int) else index in layers)


def _values(config: LoraConfig, path: str) -> tuple[int, float, float]:
    """``(r, lora_alpha, scaling)`` for the module (or ``<module>.<parameter>``) at ``path``."""
    r = int(_pattern_value(config.rank_pattern, path, config.r))
    alpha = float(_pattern_value(config.alpha_pattern, path, config.lora_alpha))
    return r, alpha, alpha / (math.sqrt(r) if config.use_rslora else r)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A module the rules may select, described without the module itself.

    Attributes:
        path: its dotted module path.
        layer: the qualified name of its type when loragen can adapt it, else None.
        linear / output_head: whether it counts as linear for ``all-linear`` / is the output head.
        type_name: its type's qualified name, for messages.
        refusal: why loragen never adapts its type, or None.
        torch_linear: whether it is a plain ``nn.Linear`` (peft's ``all-linear`` takes every one).
        parameters: its own parameters, ``(name, shape)`` in registration order.
    """

    path: str
    layer: str | None
    linear: bool = False
    output_head: bool = False
    type_name: str = ""
    refusal: str | None = None
    torch_linear: bool = False
    parameters: tuple[tuple[str, tuple[int, ...]], ...] = ()


@dataclasses.dataclass(frozen=True)
class PlanEntry:
    """What one module becomes: a LoRA layer of its kind, or LoRA on some of its parameters.

    Attributes:
        path: the module path.
        layer: the qualified name of the base layer type (None for parameter targets of a plain module).
        r / lora_alpha / scaling: the module's rank, alpha and scaling (``alpha / r`` or ``/ sqrt(r)``).
        lora_dropout / use_rslora / use_dora / init_lora_weights: the variant.
        parameters: for LoRA on parameters, ``{name: (r, lora_alpha)}`` in registration order; else empty.
    """

    path: str
    layer: str | None
    r: int
    lora_alpha: float
    scaling: float
    lora_dropout: float
    use_rslora: bool
    use_dora: bool
    init_lora_weights: InitMode
    parameters: Mapping[str, tuple[int, float]] = dataclasses.field(default_factory=dict)

    def layer_kwargs(self) -> dict[str, Any]:
        """The keywords of ``LoraLayer.from_module`` (and ``add_factors``) for this entry."""
        names = ("r", "lora_alpha", "lora_dropout", "use_rslora", "init_lora_weights", "use_dora")
        return {name: getattr(self, name) for name in names}


@dataclasses.dataclass(frozen=True)
class LoraPlan:
    """A config interpreted against a model (or a description of its modules).

    Attributes:
        config: the config the converted model keeps and saves (defaults resolved, ``all-linear`` made
            explicit for peft where it differs).
        entries: ``{module path: PlanEntry}`` in module order.
        modules_to_save: paths of the modules trained in full beside the adapter (and saved whole).
        bias: which biases train (``"none"``, ``"all"``, ``"lora_only"``).
        unmatched: entries of a ``target_modules`` list that select no module, or the whole string.
        unmatched_parameters: entries of ``target_parameters`` that select no parameter.
        refused: targeted modules of types loragen never adapts, ``"path (type): why"``.
        unsupported: targeted modules of types loragen cannot adapt, ``"path (type)"``.
        problems: errors found before the targets are matched.
        conflicts: errors of what the targets select (parameters the config cannot adapt, a module
            targeted twice).
    """

    config: LoraConfig
    entries: Mapping[str, PlanEntry]
    modules_to_save: tuple[str, ...] = ()
    bias: BiasMode = "none"
    unmatched: tuple[str, ...] = ()
    unmatched_parameters: tuple[str, ...] = ()
    refused: tuple[str, ...] = ()
    unsupported: tuple[str, ...] = ()
    problems: tuple[LoraError, ...] = ()
    conflicts: tuple[LoraError, ...] = ()

    def __contains__(self, path: object) -> bool:
        return path in self.entries

    def modules(self, model: nn.Module) -> dict[str, nn.Module]:
        """``{path: module}`` of ``model``'s modules the plan adapts."""
        return {path: model.get_submodule(path) for path in self.entries}


def candidates_of(model: nn.Module, *, further: bool = False) -> list[Candidate]:
    """The modules of ``model`` described as candidates; with ``further`` its LoRA layers are candidates
    (as their base type) and nothing inside them is."""
    from torch import nn

    from loragen.layers import LoraLayer
    from loragen.registry import refusal_for, spec_for, spec_for_lora_type

    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    found: list[Candidate] = []
    inside: tuple[str, ...] = ()
    for path, module in model.named_modules():
        if path and further and path.startswith(inside):
            continue
        lora = isinstance(module, LoraLayer)
        if lora and further:
            inside = (*inside, path + ".")
        refusal = refusal_for(type(module))
        spec = spec_for_lora_type(type(module)) if lora else spec_for(module)
        found.append(
            Candidate(
                path=path,
                layer=spec.base_qualname if spec is not None else None,
                linear=spec is not None and spec.linear,
                output_head=head is not None and module is head,
                type_name=f"{type(module).__module__}.{type(module).__qualname__}",
                refusal=refusal,
                torch_linear=isinstance(module, nn.Linear) and not lora,
                parameters=tuple((n, tuple(p.shape)) for n, p in module.named_parameters(recurse=False)),
            )
        )
    return found


def _model_type(model: nn.Module) -> str | None:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return model_type if isinstance(model_type, str) else None


def resolve(
    model: nn.Module, config: LoraConfig, *, further: bool = False, optional: bool = False
) -> LoraPlan:
    """Interpret ``config`` against ``model``; change nothing.

    ``further``: plan a further named adapter on a model that may hold LoRA layers already (they are
    targets too; nothing inside them is); otherwise a model with LoRA layers is refused. ``optional``: an
    empty plan instead of an error when nothing is targeted (a sub-model). A list entry of
    ``target_modules`` or ``target_parameters`` that matches nothing while others do gets a
    :class:`~loragen.config.TargetWarning`.

    Raises:
        LoraConversionError: the model already has LoRA layers; ``target_modules`` is None and peft has no
            default for the model type; a targeted module's type is not supported (every such path and type
            is listed, with the supported types); nothing matches (the patterns are repeated and some of the
            model's module names shown); with ``strict_targets=True``, an entry matches nothing; a targeted
            parameter is the top-level module's or not 2-D/3-D; a module is targeted twice.
        LoraConfigError: the config cannot adapt the parameters it (or ``all-linear``) selects.
    """
    if not isinstance(config, LoraConfig):
        raise TypeError(
            f"config must be a loragen.LoraConfig, got {type(config).__name__}; "
            "for a peft config use LoraConfig.from_peft(peft_config.to_dict())"
        )
    from loragen.layers import LoraLayer

    name = type(model).__name__
    if not further:
        existing = [path for path, m in model.named_modules() if isinstance(m, LoraLayer)]
        if existing:
            paths = ", ".join(existing[:5]) + (" ..." if len(existing) > 5 else "")
            raise LoraConversionError(
                f"the model already has LoRA layers ({paths}); converting it again would stack adapters. "
                "Use loragen.mark_trainable(model, config) to set which parameters train, load_adapter() to "
                "load weights into it, or merge_and_unload() first to start from plain layers"
            )
    candidates = candidates_of(model, further=further)
    plan = resolve_candidates(
        config, candidates, model_type=_model_type(model), moe=None if further else _moe_family(model)
    )
    if optional and not (plan.entries or plan.refused or plan.unsupported or plan.problems or plan.conflicts):
        return plan
    _raise_problems(plan, candidates, name)
    return plan


def _raise_problems(plan: LoraPlan, candidates: Sequence[Candidate], name: str) -> None:
    """Raise (or warn about) what :func:`resolve_candidates` found wrong, in a fixed order."""
    config = plan.config
    if plan.problems:
        raise plan.problems[0]
    if plan.unmatched_parameters:
        sample = [
            f"{c.path}.{n}" if c.path else n for c in candidates for n, s in c.parameters if len(s) in (2, 3)
        ]
        where = (
            f"match no parameter of {name}; an entry matches a parameter's full name or its dotted suffix. Its "
            f"2-D and 3-D parameters include: {_sample(sample, _SHOWN_PARAMETERS)}"
        )
        if config.strict_targets or (not plan.entries and config.target_modules is None):
            strict = " (strict_targets=True)" if config.strict_targets else ""
            raise LoraConversionError(
                f"target_parameters entries {list(plan.unmatched_parameters)!r} {where}{strict}"
            )
        for entry in plan.unmatched_parameters:  # as target_modules entries: peft converts with the others
            warnings.warn(
                f"target_parameters entry {entry!r} {where}. LoraConfig(strict_targets=True) makes this an error",
                TargetWarning,
                stacklevel=4,
            )
    if plan.conflicts:
        raise plan.conflicts[0]
    if plan.refused:
        raise LoraConversionError(
            "target_modules matched modules loragen will not adapt: "
            + "; ".join(plan.refused)
            + ". Narrow target_modules (or add these to exclude_modules)"
        )
    listed = not isinstance(config.target_modules, str) and config.target_modules is not None
    if listed and plan.unmatched:
        hint = (
            "an entry matches a module path exactly or as a dotted suffix (peft's rule). "
            f"{name}'s modules include: {_leaves(candidates)}"
        )
        if config.strict_targets:
            raise LoraConversionError(
                f"target_modules entries {list(plan.unmatched)!r} match no module of {name} "
                f"(strict_targets=True); {hint}"
            )
        if plan.entries or plan.unsupported:
            for entry in plan.unmatched:
                warnings.warn(
                    f"target_modules entry {entry!r} matches no module of {name}; {hint}. "
                    "LoraConfig(strict_targets=True) makes this an error",
                    TargetWarning,
                    stacklevel=4,
                )
    if plan.unsupported:
        from loragen.registry import supported_type_names

        raise LoraConversionError(
            "target_modules matched modules loragen cannot adapt: "
            + "; ".join(plan.unsupported)
            + ". Supported layer types: "
            + ", ".join(supported_type_names())
            + ". Narrow target_modules (or add these to exclude_modules), or teach loragen the type with "
            "loragen.register_layer(...)"
        )
    if not plan.entries:
        targets = config.target_modules
        if targets == ALL_LINEAR or targets is None:
            patterns: object = []
        else:
            patterns = targets if isinstance(targets, str) else list(targets)
        extra = ""
        if config.layers_to_transform is not None:
            extra = f" with layers_to_transform={config.layers_to_transform!r}"
            if config.layers_pattern is not None:
                extra += f", layers_pattern={config.layers_pattern!r}"
        raise LoraConversionError(
            f"target_modules={patterns!r}{extra} matched no module of {name}. "
            f"Its modules include: {_leaves(candidates)}"
        )


def _leaves(candidates: Sequence[Candidate]) -> str:
    """Some of the model's leaf module paths, for messages."""
    parents = {c.path.rpartition(".")[0] for c in candidates if "." in c.path}
    leaves = [c.path for c in candidates if c.path and c.path not in parents]
    return _sample(leaves, _SHOWN, "(the model has no submodules)")


def _sample(names: Sequence[str], shown: int, empty: str = "(none)") -> str:
    if not names:
        return empty
    more = f", ... ({len(names) - shown} more)" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def resolve_candidates(
    config: LoraConfig,
    candidates: Iterable[Candidate],
    *,
    model_type: str | None = None,
    moe: tuple[str, bool] | None = None,
) -> LoraPlan:
    """Interpret ``config`` against module descriptions; never raises for what it finds (the plan lists it).

    ``model_type`` gives peft's default targets when ``target_modules`` is None; ``moe`` (``(family, peft
    converts it)`` for a transformers 5 MoE model) makes ``all-linear`` adapt the fused expert parameters.

    Raises:
        LoraConfigError: ``all-linear`` adds expert parameters this config cannot adapt on a family peft
            converts too (peft refuses it).
    """
    cands = list(candidates)
    config, no_targets = _with_defaults(config, model_type)
    config = _with_task_heads(config)
    if config.target_modules == ALL_LINEAR:
        linear = {c.path for c in cands if c.path and c.linear and not c.output_head}
        config = _exclude_what_peft_adds(config, cands, linear)
        if moe is not None:
            config = _expand_all_linear(config, cands, linear, moe)
        targets: str | Sequence[str] = tuple(p for p in (c.path for c in cands) if p in linear)
    else:
        targets = config.target_modules if config.target_modules is not None else ()
    module_entries: dict[str, PlanEntry] = {}
    refused: list[str] = []
    unsupported: list[str] = []
    for c in cands:
        if not c.path or not _matches(config, c.path, targets):
            continue
        if c.refusal is not None:
            refused.append(f"{c.path} ({c.type_name}): {c.refusal}")
        elif c.layer is None:
            unsupported.append(f"{c.path} ({c.type_name})" if c.type_name else c.path)
        else:
            module_entries[c.path] = _entry(config, c.path, c.layer)
    parameter_entries, as_modules, unused, problems, conflicts = _plan_parameters(config, cands)
    module_entries.update((p, e) for p, e in as_modules.items() if p not in module_entries)
    both = sorted(set(parameter_entries) & set(module_entries))
    if both:
        conflicts.append(
            LoraConversionError(
                f"{', '.join(both)}: targeted by target_modules and by target_parameters; a module is adapted "
                "one way (peft refuses it too). Narrow target_modules or target_parameters"
            )
        )
    entries = {c.path: e for c in cands if (e := parameter_entries.get(c.path) or module_entries.get(c.path))}
    paths = [c.path for c in cands if c.path]
    return LoraPlan(
        config=config,
        entries=entries,
        modules_to_save=saved_modules(config, paths),
        bias=config.bias,
        unmatched=_unmatched(config, paths, targets),
        unmatched_parameters=unused,
        refused=tuple(refused),
        unsupported=tuple(unsupported),
        problems=(no_targets, *problems) if no_targets is not None else tuple(problems),
        conflicts=tuple(conflicts),
    )


def _with_defaults(config: LoraConfig, model_type: str | None) -> tuple[LoraConfig, LoraError | None]:
    """``config`` with peft's default targets when ``target_modules`` is None, or the error that there are none."""
    if config.target_modules is not None or config.target_parameters:
        return config, None
    defaults = _DEFAULT_TARGETS.get(model_type or "")
    if defaults is None:
        known = (
            f"model type {model_type!r} has none"
            if model_type
            else "the model has no transformers model_type"
        )
        return config, LoraConversionError(
            "LoraConfig.target_modules is None: name the modules to adapt, e.g. "
            "target_modules=['q_proj', 'v_proj'], a regex, or 'all-linear' (peft's per-architecture defaults "
            f"apply to transformers models, and {known})"
        )
    return config.replace(target_modules=defaults if isinstance(defaults, str) else list(defaults)), None


def _with_task_heads(config: LoraConfig) -> LoraConfig:
    """``config`` with the heads peft trains for its ``task_type`` added to ``modules_to_save``."""
    heads = _TASK_HEADS.get(str(config.task_type or ""), ())
    have = tuple(config.modules_to_save or ())
    missing = [h for h in heads if h not in have]
    return config.replace(modules_to_save=[*have, *missing]) if missing else config


def _entry(
    config: LoraConfig, path: str, layer: str | None, parameters: Mapping[str, tuple[int, float]] = {}
) -> PlanEntry:
    r, alpha, scaling = _values(config, path)
    return PlanEntry(
        path=path,
        layer=layer,
        r=r,
        lora_alpha=alpha,
        scaling=scaling,
        lora_dropout=config.lora_dropout,
        use_rslora=config.use_rslora,
        use_dora=config.use_dora,
        init_lora_weights=config.init_lora_weights,
        parameters=dict(parameters),
    )


def _unmatched(config: LoraConfig, paths: Sequence[str], targets: str | Sequence[str]) -> tuple[str, ...]:
    listed = config.target_modules
    if listed is None:
        return ()
    if isinstance(listed, str):
        return () if any(_matches(config, p, targets) for p in paths) else (listed,)
    return tuple(entry for entry in listed if not any(_matches(config, p, (entry,)) for p in paths))


def _selected(entries: Iterable[str], key: str) -> list[str]:
    return [entry for entry in entries if key == entry or key.endswith("." + entry)]


def _plan_parameters(
    config: LoraConfig, cands: Sequence[Candidate]
) -> tuple[dict[str, PlanEntry], dict[str, PlanEntry], tuple[str, ...], list[LoraError], list[LoraError]]:
    """``({path: entry of its targeted parameters}, {path: entry of a linear adapted as a module},
    unused entries, problems, conflicts)``."""
    entries = config.target_parameters or ()
    if not entries:
        return {}, {}, (), [], []
    planned: dict[str, dict[str, tuple[int, float]]] = {}
    used: set[str] = set()
    problems: list[LoraError] = []
    conflicts: list[LoraError] = []
    as_modules: dict[str, PlanEntry] = {}
    for c in cands:
        for name, shape in c.parameters:
            key = f"{c.path}.{name}" if c.path else name
            hits = _selected(entries, key)
            if not hits:
                continue
            used.update(hits)
            if c.path and len(shape) in (2, 3):
                r, alpha, _ = _values(config, key)
                planned.setdefault(c.path, {})[name] = (r, alpha)
            elif not c.path:
                problem = (
                    f"target_parameters selects {key!r}, a parameter of the top-level {c.type_name.rpartition('.')[2]} "
                    "itself; only parameters of submodules can be adapted"
                )
                problems.append(LoraConversionError(problem))
            else:
                problem = (
                    f"target_parameters selects {key} of shape {list(shape)}: only 2-D (out, in) weights "
                    "and 3-D expert stacks (num_experts, out, in) can take LoRA factors"
                )
                problems.append(LoraConversionError(problem))
    if planned:
        selected = [f"{p}.{n}" for p, names in planned.items() for n in names]
        conflict = _parameter_conflict(
            config, ", ".join(selected[:3]) + (" ..." if len(selected) > 3 else "")
        )
        if conflict is not None:
            conflicts.append(LoraConfigError(conflict))
    # a linear's weight named by its full name (all-linear's explicit form for peft) makes a LoRA layer of its type
    layers = {c.path: c.layer for c in cands if c.linear and c.layer is not None}
    for path in [p for p, n in planned.items() if list(n) == ["weight"] and p in layers]:
        if f"{path}.weight" in entries:
            del planned[path]
            as_modules[path] = _entry(config, path, layers[path])
    out = {path: _entry(config, path, None, names) for path, names in planned.items()}
    return out, as_modules, tuple(e for e in entries if e not in used), problems, conflicts


def _parameter_conflict(config: LoraConfig, selected: str) -> str | None:
    """Why ``config`` cannot adapt the parameters ``selected`` names (as peft refuses), or None."""
    if config.lora_dropout:
        return (
            f"target_parameters selects {selected} with lora_dropout={config.lora_dropout!r}: LoRA on a parameter "
            "adds scaling * B @ A to the weight, where no input is there to drop out; set lora_dropout=0 (peft "
            "refuses it too)"
        )
    if config.use_dora:
        return (
            f"target_parameters selects {selected} with use_dora=True: DoRA on targeted parameters is not "
            "supported (peft refuses it too); set use_dora=False"
        )
    if config.fan_in_fan_out:
        return (
            f"target_parameters selects {selected} with fan_in_fan_out=True: a targeted parameter's layout "
            "comes from its shape (experts stored (num_experts, out, in), or (num_experts, in, out) on modules "
            "with is_transposed); set fan_in_fan_out=False"
        )
    return None


def _exclude_what_peft_adds(
    config: LoraConfig, cands: Sequence[Candidate], linear: Collection[str]
) -> LoraConfig:
    """``config`` with the ``nn.Linear`` modules loragen's ``all-linear`` leaves out and peft's takes
    (``nn.MultiheadAttention.out_proj``) in ``exclude_modules``, so peft adapts the same modules."""
    left_out = [
        c.path
        for c in cands
        if c.path
        and c.torch_linear
        and c.path not in linear
        and not c.output_head
        and not _is_excluded(config, c.path)
    ]
    if not left_out:
        return config
    excluded = config.exclude_modules
    if excluded is None:
        return config.replace(exclude_modules=left_out)
    if isinstance(excluded, str):  # a regex, which peft matches whole: one more alternative
        return config.replace(exclude_modules=f"(?:{excluded})|" + "|".join(re.escape(p) for p in left_out))
    return config.replace(exclude_modules=[*excluded, *left_out])


# transformers' conversion families whose experts and router were nn.Linear layers before transformers 5
_FUSED_FAMILIES = ("mixtral", "qwen2_moe")
# (parameter entry, how many transformers 4 linears it fuses): the router's weight, the experts' stacks.
_FUSED_ENTRIES = (("gate.weight", 1), ("gate_up_proj", 2), ("down_proj", 1))
# the transformers 4 module names peft's conversion moves from target_modules to those parameters
_MOVED_NAMES = {
    "mixtral": ("gate", "w1", "w2", "w3"),
    "qwen2_moe": ("gate", "gate_proj", "up_proj", "down_proj"),
}


def _moe_family(model: nn.Module) -> tuple[str, bool] | None:
    """``(family, peft converts it)`` for a transformers 5 MoE model of the ``mixtral`` / ``qwen2_moe``
    conversion families, else None. peft finds the family in transformers' table, which names
    ``qwen2_moe`` only as the family of others: peft 0.21 leaves Qwen2-MoE itself unconverted."""
    model_type = _model_type(model) if "transformers" in sys.modules else None
    if model_type is None:
        return None
    try:
        from transformers.conversion_mapping import _MODEL_TO_CONVERSION_PATTERN as table
    except ImportError:  # a transformers without the table (4.x)
        table = {}
    listed = table.get(model_type)
    listed = listed if listed in _FUSED_FAMILIES else None
    family = model_type if model_type in _FUSED_FAMILIES else listed
    return None if family is None else (family, model_type == "mixtral" or listed is not None)


def _expand_all_linear(
    config: LoraConfig, cands: Sequence[Candidate], linear: Collection[str], moe: tuple[str, bool]
) -> LoraConfig:
    """``config`` with the parameters peft's ``all-linear`` adds on a fused-family MoE model made explicit.

    Each fused entry joins ``target_parameters``; one fusing ``k`` linears gets ``rank_pattern`` /
    ``alpha_pattern`` values ``r * k`` / ``lora_alpha * k`` under peft's key (``.*\\.gate_up_proj``).
    Linears peft's conversion moves to parameters (:data:`_MOVED_NAMES`) are listed by full name. A config
    that cannot adapt parameters is refused, or, where peft does not convert (Qwen2-MoE), warned about.
    """
    found: dict[str, int] = {}
    for c in cands:
        if not c.path or c.path in linear:
            continue
        for name, shape in c.parameters:
            for entry, count in _FUSED_ENTRIES:
                if len(shape) in (2, 3) and _selected((entry,), f"{c.path}.{name}"):
                    found[entry] = count
    added = tuple((entry, count) for entry, count in _FUSED_ENTRIES if entry in found)
    if not added:
        return config
    family, converts = moe
    entries = list(config.target_parameters or ())
    moved = _MOVED_NAMES[family] if converts else ()
    for path in sorted(linear):
        if path.rpartition(".")[2] in moved and f"{path}.weight" not in entries:
            entries.append(f"{path}.weight")
    ranks, alphas = dict(config.rank_pattern), dict(config.alpha_pattern)
    # peft warns about a pattern key that matches no targeted module: the key also names one adapted module
    anchor = next(
        (p for p in sorted(linear) if p.rpartition(".")[2] not in moved and not _is_excluded(config, p)), None
    )
    anchor_r, anchor_alpha, _ = _values(config, anchor or "")
    for entry, count in added:
        if entry not in entries:
            entries.append(entry)
        if count > 1 and rf".*\.{entry}" not in ranks:  # peft's own key (a folder peft wrote) stands
            key = rf".*\.{entry}"
            if anchor is not None:  # the anchor's own key first (in any order, sorted too)
                own = f"(?:{re.escape(anchor)})"
                ranks.setdefault(own, anchor_r)
                alphas.setdefault(own, anchor_alpha)
                key = f"{own}|{key}"
            ranks.setdefault(key, config.r * count)
            alphas.setdefault(key, config.lora_alpha * count)
    conflict = _parameter_conflict(config, str([entry for entry, _ in added]))
    if conflict is None:
        # named where peft converts, as peft saves it then (a string would make peft convert again on load)
        names = sorted({p.rpartition(".")[2] for p in linear if p.rpartition(".")[2] not in moved})
        return config.replace(
            target_modules=names if converts else config.target_modules,
            target_parameters=entries,
            rank_pattern=ranks,
            alpha_pattern=alphas,
        )
    if not converts:
        warnings.warn(
            f"target_modules='all-linear' leaves the fused expert parameters {[e for e, _ in added]} out, as "
            f"peft does on this model type: {conflict}",
            LoraConfigWarning,
            stacklevel=5,
        )
        return config
    raise LoraConfigError(
        f"target_modules='all-linear' on a {family}-family MoE model also adapts the fused expert parameters "
        f"{[e for e, _ in added]}, as peft does: {conflict}. Or list the linear modules to adapt instead of "
        "'all-linear' (the experts are then left out)"
    )


def entry_for(config: LoraConfig, path: str) -> PlanEntry:
    """The plan entry ``config`` gives the module (or ``<module>.<parameter>``) at ``path``, whether or not
    its targets select it."""
    return _entry(config, path, None)


def saved_modules(config: LoraConfig, paths: Iterable[str]) -> tuple[str, ...]:
    """The module ``paths`` that ``modules_to_save`` names (exact name or dotted suffix): trained in full
    and saved whole."""
    names = tuple(config.modules_to_save or ())
    return tuple(p for p in paths if p and _name_matches(names, p)) if names else ()


def embedding_targeted(config: LoraConfig, paths: Iterable[str], names: Collection[str]) -> bool:
    """Whether ``target_modules`` (not ``all-linear``) selects a module whose last name is in ``names``
    (peft's check for ``save_embedding_layers="auto"``)."""
    targets = config.target_modules
    if targets == ALL_LINEAR or targets is None:
        return False
    if isinstance(targets, str):
        return any(_matches(config, p, targets) for p in paths if p.rpartition(".")[2] in names)
    return any(name in targets for name in names)


def targets_parameters_of(config: LoraConfig, module: str) -> bool:
    """Whether ``target_parameters`` selects a parameter of ``module`` (by the names its entries end in)."""
    entries = config.target_parameters or ()
    return any(_selected(entries, f"{module}.{entry.rpartition('.')[2]}") for entry in entries)


def fused_expert_parameters(config: LoraConfig, names: Iterable[str]) -> tuple[str, ...]:
    """Which of ``names`` (``Class.attribute`` of declared parameters) ``all-linear`` adapts as fused expert
    stacks on a transformers 5 MoE model, as peft does."""
    if config.target_modules != ALL_LINEAR:
        return ()
    fused = {entry for entry, _ in _FUSED_ENTRIES if "." not in entry}
    return tuple(name for name in names if name.rpartition(".")[2] in fused)


def max_rank(config: LoraConfig) -> int:
    """The largest rank ``config`` gives any module (``r`` or a ``rank_pattern`` value)."""
    return max(config.r, *config.rank_pattern.values()) if config.rank_pattern else config.r
