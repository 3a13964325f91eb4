"""The runtime path: convert any ``nn.Module`` into a LoRA model, with peft's semantics.

:func:`get_lora_model` replaces the targeted layers in place with LoRA layers that share the base
weights, freezes everything but the LoRA factors (plus ``modules_to_save`` and biases per ``bias``) and
returns the same model object. :func:`merge_adapter`, :func:`unmerge_adapter` and
:func:`merge_and_unload` act on every LoRA layer of a model, whichever way it was made (converted here,
rewritten by ``loragen rewrite`` or expanded by ``@lora_convert``).
"""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable, Iterable
from typing import TextIO, TypeVar

from torch import nn

from loragen.config import LoraConfig, TargetWarning
from loragen.conversion_targets import effective_config, resolve_target_modules
from loragen.errors import LoraConfigError, LoraConversionError, LoraMergeError
from loragen.layers import LoraLayer, lora_class_for
from loragen.layers.adapter_set import adapter_factors, has_adapter
from loragen.layers.expert_parameters import lora_parameters_class
from loragen.parameter_targets import (
    linear_weight_only,
    plan_parameters,
    targeted_parameters,
)
from loragen.registry import refusal_for, spec_for, supported_type_names
from loragen.validation import parameter_target_conflict

__all__ = [
    "CONFIG_ATTR",
    "ADAPTER_CONFIGS_ATTR",
    "LoraConversionError",
    "get_lora_model",
    "plan_conversion",
    "convert_module",
    "mark_trainable",
    "carried_config",
    "find_lora_layers",
    "merge_adapter",
    "unmerge_adapter",
    "merge_and_unload",
    "count_parameters",
    "print_trainable_parameters",
    "resolve_target_modules",
    "effective_config",
    "set_submodule",
    "add_conversion_hook",
    "run_conversion_hooks",
]

M = TypeVar("M", bound=nn.Module)
CONFIG_ATTR = "loragen_config"
# several named adapters: {name: config}, the model's first adapter first (loragen.adapters.named)
ADAPTER_CONFIGS_ATTR = "loragen_adapter_configs"
_SHOWN_NAMES = 20
# called with a model once it holds LoRA layers (end of mark_trainable, end of a successful load_adapter):
# the layers above register here (transformers' adapter methods), convert cannot import them
_CONVERSION_HOOKS: list[Callable[[nn.Module], None]] = []
# loragen's own hook modules, imported (by name: they sit above this layer) before the first hooks run, so a
# program that imported ``loragen.convert`` before torch -- ``import loragen`` then loads lazily -- gets
# them too
_BUILTIN_HOOK_MODULES = ("loragen.training.transformers_integration",)


def add_conversion_hook(hook: Callable[[nn.Module], None]) -> None:
    """Call ``hook(model)`` whenever a conversion or an adapter load finishes on ``model`` (once per hook)."""
    if hook not in _CONVERSION_HOOKS:
        _CONVERSION_HOOKS.append(hook)


def run_conversion_hooks(model: nn.Module) -> None:
    """Run every hook of :func:`add_conversion_hook` on ``model`` (a model with LoRA layers)."""
    for name in _BUILTIN_HOOK_MODULES:
        if name not in sys.modules:
            importlib.import_module(name)  # registers its hook
    for hook in _CONVERSION_HOOKS:
        hook(model)


def find_lora_layers(model: nn.Module) -> dict[str, LoraLayer]:
    """All LoRA layers of ``model`` by module path, in ``named_modules`` order."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def set_submodule(model: nn.Module, path: str, new: nn.Module) -> None:
    """Replace the submodule at dotted ``path`` (works inside ``ModuleList`` / ``Sequential`` too)."""
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    setattr(parent, name, new)


def _report_unmatched(model: nn.Module, config: LoraConfig, planned: bool) -> None:
    """Warn about (``strict_targets``: refuse) each ``target_modules`` entry that matches no module.

    When nothing at all is planned the caller's "matched no module" error says it already.
    """
    unmatched = config.unmatched_entries(path for path, _ in model.named_modules() if path)
    if not unmatched:
        return
    hint = (
        "an entry matches a module path exactly or as a dotted suffix (peft's rule). "
        f"{type(model).__name__}'s modules include: {_module_name_sample(model)}"
    )
    if config.strict_targets:
        raise LoraConversionError(
            f"target_modules entries {list(unmatched)!r} match no module of {type(model).__name__} "
            f"(strict_targets=True); {hint}"
        )
    if not planned:
        return
    for entry in unmatched:
        warnings.warn(
            f"target_modules entry {entry!r} matches no module of {type(model).__name__}; {hint}. "
            "LoraConfig(strict_targets=True) makes this an error",
            TargetWarning,
            stacklevel=4,
        )


def _module_name_sample(model: nn.Module) -> str:
    leaves = [name for name, m in model.named_modules() if name and not list(m.children())]
    shown = ", ".join(leaves[:_SHOWN_NAMES])
    more = f", ... ({len(leaves) - _SHOWN_NAMES} more)" if len(leaves) > _SHOWN_NAMES else ""
    return f"{shown}{more}" if leaves else "(the model has no submodules)"


def plan_conversion(model: nn.Module, config: LoraConfig) -> dict[str, nn.Module]:
    """The modules ``config`` targets in ``model``, by path, without changing anything.

    An entry of a ``target_modules`` list that matches no module while others do is reported with a
    :class:`~loragen.config.TargetWarning` per entry (peft is silent there).

    Raises:
        LoraConversionError: the model already has LoRA layers; a targeted module's type is not
            supported (every such path and type is listed, with the supported types); nothing matches
            (the patterns are repeated and some of the model's module names shown); or, with
            ``strict_targets=True``, some entry of a ``target_modules`` list matches nothing.
    """
    existing = find_lora_layers(model)
    if existing:
        paths = ", ".join(list(existing)[:5]) + (" ..." if len(existing) > 5 else "")
        raise LoraConversionError(
            f"the model already has LoRA layers ({paths}); converting it again would stack adapters. "
            "Use loragen.mark_trainable(model, config) to set which parameters train, load_adapter() to "
            "load weights into it, or merge_and_unload() first to start from plain layers"
        )
    targets = resolve_target_modules(model, config)
    planned: dict[str, nn.Module] = {}
    unsupported: list[str] = []
    refused: list[str] = []
    for path, module in model.named_modules():
        if not path or not config.matches_target(path, targets):
            continue
        refusal = refusal_for(type(module))
        if refusal is not None:
            refused.append(f"{path} ({type(module).__module__}.{type(module).__qualname__}): {refusal}")
        elif spec_for(module) is None:
            unsupported.append(f"{path} ({type(module).__module__}.{type(module).__qualname__})")
        else:
            planned[path] = module
    parameters = {
        path: names
        for path, names in plan_parameters(model, config).items()
        if not (path in planned and linear_weight_only(planned[path], config, names))
    }
    if parameters:  # what a parameter cannot take is refused where one is selected, as peft refuses it
        selected = [f"{path}.{name}" for path, names in parameters.items() for name in names]
        conflict = parameter_target_conflict(
            config, ", ".join(selected[:3]) + (" ..." if len(selected) > 3 else "")
        )
        if conflict is not None:
            raise LoraConfigError(conflict)
    both = sorted(set(parameters) & set(planned))
    if both:
        raise LoraConversionError(
            f"{', '.join(both)}: targeted by target_modules and by target_parameters; a module is adapted one way "
            "(peft refuses it too). Narrow target_modules or target_parameters"
        )
    planned.update((path, model.get_submodule(path)) for path in parameters)
    if refused:
        raise LoraConversionError(
            "target_modules matched modules loragen will not adapt: "
            + "; ".join(refused)
            + ". Narrow target_modules (or add these to exclude_modules)"
        )
    _report_unmatched(model, config, bool(planned) or bool(unsupported))
    if unsupported:
        raise LoraConversionError(
            "target_modules matched modules loragen cannot adapt: "
            + "; ".join(unsupported)
            + ". Supported layer types: "
            + ", ".join(supported_type_names())
            + ". Narrow target_modules (or add these to exclude_modules), or teach loragen the type with "
            "loragen.register_layer(...)"
        )
    if not planned:
        patterns = config.target_modules if isinstance(config.target_modules, str) else list(targets)
        extra = ""
        if config.layers_to_transform is not None:
            extra = f" with layers_to_transform={config.layers_to_transform!r}"
            if config.layers_pattern is not None:
                extra += f", layers_pattern={config.layers_pattern!r}"
        raise LoraConversionError(
            f"target_modules={patterns!r}{extra} matched no module of {type(model).__name__}. "
            f"Its modules include: {_module_name_sample(model)}"
        )
    return planned


def convert_module(module: nn.Module, config: LoraConfig, path: str) -> LoraLayer:
    """The LoRA layer for ``module`` at ``path``, with the rank and alpha ``config`` gives that path.

    A module with parameters ``config.target_parameters`` selects gets LoRA on those parameters
    (:mod:`loragen.layers.expert_parameters`).

    Raises:
        LoraConversionError: the module's type is not supported, or a per-module value is invalid.
    """
    names = targeted_parameters(module, path, config)
    if names and not linear_weight_only(module, config, names):
        targets = {
            name: (config.rank_for(f"{path}.{name}"), config.alpha_for(f"{path}.{name}")) for name in names
        }
        return lora_parameters_class(type(module)).from_parameters(
            module, targets, use_rslora=config.use_rslora, init_lora_weights=config.init_lora_weights
        )
    try:
        lora_class = lora_class_for(type(module))
    except LoraConversionError as exc:
        raise LoraConversionError(f"{path}: {exc}") from None
    try:
        return lora_class.from_module(
            module,
            r=config.rank_for(path),
            lora_alpha=config.alpha_for(path),
            lora_dropout=config.lora_dropout,
            use_rslora=config.use_rslora,
            init_lora_weights=config.init_lora_weights,
            use_dora=config.use_dora,
        )
    except ValueError as exc:
        raise LoraConversionError(f"{path}: {exc}") from exc


def carried_config(model: nn.Module) -> LoraConfig:
    """The LoRA config ``model`` carries: ``model.loragen_config`` (set by :func:`get_lora_model`,
    ``load_adapter`` and a decorated class's ``get_lora_model``; a rewritten class's ``LORA_CONFIG``), else the
    one config its submodules carry (a rewritten class inside a model written by hand).

    Raises:
        LoraConversionError: the model carries none, or its submodules carry different ones.
    """
    own = getattr(model, CONFIG_ATTR, None)
    if isinstance(own, LoraConfig):
        return own
    found: dict[str, LoraConfig] = {}  # the first module path carrying each distinct config
    for path, module in model.named_modules():
        config = getattr(module, CONFIG_ATTR, None)
        if isinstance(config, LoraConfig) and config not in found.values():
            found[path] = config
    if len(found) == 1:
        return next(iter(found.values()))
    if found:
        raise LoraConversionError(
            f"the modules of {type(model).__name__} carry different LoRA configs (at {', '.join(found)}); "
            "pass the one to use: mark_trainable(model, config)"
        )
    raise LoraConversionError(
        f"{type(model).__name__} carries no LoRA config (model.{CONFIG_ATTR} is set by get_lora_model, "
        "load_adapter, @lora_convert and loragen rewrite); pass one: mark_trainable(model, config)"
    )


def mark_trainable(model: nn.Module, config: LoraConfig | None = None) -> None:
    """Freeze every parameter except LoRA factors, ``modules_to_save`` and the biases ``config.bias`` names.

    ``config`` None means the config the model carries (:func:`carried_config`). ``bias="all"`` follows
    peft: every parameter named ``bias`` trains (not, say, T5's ``relative_attention_bias.weight``).

    Raises:
        LoraConversionError: ``config`` is None and the model carries no config (or different ones).
    """
    if config is None:
        config = carried_config(model)
    lora_layers = find_lora_layers(model)
    for p in model.parameters():
        p.requires_grad_(False)
    for layer in lora_layers.values():
        active = layer.active_adapter  # with several adapters, the active one trains (as in peft)
        if active is not None and has_adapter(layer, active):
            for p in adapter_factors(layer, active).lora_parameters().values():
                p.requires_grad_(True)
    if config.bias == "all":
        for name, p in model.named_parameters():
            if name == "bias" or name.endswith(".bias"):
                p.requires_grad_(True)
    elif config.bias == "lora_only":
        for layer in lora_layers.values():
            if getattr(layer, "bias", None) is not None:
                layer.bias.requires_grad_(True)
    for path, module in model.named_modules():
        if path and config.is_module_to_save(path):
            for p in module.parameters():
                p.requires_grad_(True)
    run_conversion_hooks(model)


def get_lora_model(model: M, config: LoraConfig) -> M:
    """Convert ``model`` in place into a LoRA model and return it.

    Every module ``config`` targets is replaced by the LoRA layer of its type, sharing the base weight
    and bias (no copy; a base checkpoint still loads into the model). All parameters are frozen except
    the LoRA factors, the modules in ``modules_to_save`` (trained fully: hybrid LoRA + full fine-tuning)
    and the biases selected by ``bias``. The config is kept as ``model.loragen_config`` for saving.
    ``all-linear`` on a transformers 5 MoE model also adapts the fused expert parameters and the router,
    as peft does (the kept config lists them: :func:`effective_config`).

    A model that already contains LoRA layers is refused (see :func:`plan_conversion`): loragen keeps one
    adapter per layer, and stacking a second silently is never what a user meant.

    Raises:
        TypeError: ``config`` is neither a :class:`~loragen.config.LoraConfig` nor a peft ``LoraConfig``
            (which is read with :meth:`~loragen.config.LoraConfig.from_peft`).
        LoraConversionError: see :func:`plan_conversion`; nothing is changed when it raises.
        LoraConfigError: see :func:`effective_config`.
    """
    if not isinstance(config, LoraConfig) and type(config).__module__.startswith("peft."):
        config = LoraConfig.from_peft(config.to_dict(), source=f"peft {type(config).__name__}")
    if not isinstance(config, LoraConfig):
        raise TypeError(
            f"config must be a loragen.LoraConfig, got {type(config).__name__}; "
            "for a peft config use LoraConfig.from_peft(peft_config.to_dict())"
        )
    config = effective_config(model, config)
    planned = plan_conversion(model, config)
    # build every LoRA layer before replacing any, so a failure leaves the model untouched
    replacements = {path: convert_module(module, config, path) for path, module in planned.items()}
    for path, layer in replacements.items():
        set_submodule(model, path, layer)
    mark_trainable(model, config)
    setattr(model, CONFIG_ATTR, config)
    return model


def _require_lora_layers(model: nn.Module, action: str) -> dict[str, LoraLayer]:
    layers = find_lora_layers(model)
    if not layers:
        raise LoraConversionError(f"cannot {action}: {type(model).__name__} has no LoRA layers")
    return layers


def _merge_all(layers: dict[str, LoraLayer]) -> None:
    """Merge every layer, after checking that every one can be merged (so a refusal changes nothing)."""
    for path, layer in layers.items():
        if not layer.merged:
            try:
                layer._check_mergeable()
            except LoraMergeError as exc:
                raise LoraMergeError(f"{path}: {exc}") from None
    for layer in layers.values():
        layer.merge()


def merge_adapter(model: nn.Module) -> None:
    """Merge every LoRA layer's update into its base weight, in place. Safe to repeat.

    With several named adapters, the active one is merged (see :func:`loragen.set_adapter`).

    Raises:
        LoraConversionError: the model has no LoRA layers.
        LoraMergeError: a layer cannot be merged exactly (the message names its path and why); nothing
            is merged then.
    """
    _merge_all(_require_lora_layers(model, "merge"))


def unmerge_adapter(model: nn.Module) -> None:
    """Undo :func:`merge_adapter` on every LoRA layer, in place. Safe to repeat.

    Raises:
        LoraConversionError: the model has no LoRA layers.
    """
    for layer in _require_lora_layers(model, "unmerge").values():
        layer.unmerge()


def merge_and_unload(model: M) -> M:
    """Merge every LoRA layer and replace it with the plain torch layer; returns the same model.

    With several named adapters, the active one is merged and the others are dropped (as peft does).

    Raises:
        LoraConversionError: the model has no LoRA layers.
    """
    layers = _require_lora_layers(model, "merge and unload")
    _merge_all(layers)
    for path, layer in layers.items():
        set_submodule(model, path, layer.to_base())
    model.__dict__.pop(CONFIG_ATTR, None)  # a rewritten class's own config (a class attribute) stays
    model.__dict__.pop(ADAPTER_CONFIGS_ATTR, None)
    return model


def count_parameters(params: Iterable[nn.Parameter]) -> tuple[int, int]:
    """``(trainable, total)`` element counts over ``params``, each shared tensor counted once."""
    seen: set[int] = set()
    trainable = total = 0
    for p in params:
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        if p.requires_grad:
            trainable += p.numel()
    return trainable, total


def print_trainable_parameters(model: nn.Module, file: TextIO | None = None) -> tuple[int, int]:
    """Print ``trainable params: T || all params: N || trainable%: P`` (as peft does); return ``(T, N)``."""
    trainable, total = count_parameters(model.parameters())
    share = 100.0 * trainable / total if total else 0.0
    print(
        f"trainable params: {trainable:,d} || all params: {total:,d} || trainable%: {share:.4f}",
        file=file or sys.stdout,
    )
    return trainable, total
