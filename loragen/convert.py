"""The runtime path: :func:`get_lora_model` converts any ``nn.Module`` in place into a LoRA model, with
peft's semantics; :func:`merge_adapter`, :func:`unmerge_adapter` and :func:`merge_and_unload` act on every
LoRA layer of a model, however it was made.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable, Iterable
from typing import TextIO, TypeVar

import torch
from torch import nn

from loragen.config import InitMode, LoraConfig
from loragen.errors import LoraConversionError, LoraMergeError
from loragen.layers import LoraLayer, lora_class_for
from loragen.layers.adapter_set import adapter_factors, has_adapter
from loragen.layers.expert_parameters import lora_parameters_class
from loragen.plan import LoraPlan, resolve, saved_modules

__all__ = [
    "CONFIG_ATTR",
    "ADAPTER_CONFIGS_ATTR",
    "LoraConversionError",
    "get_lora_model",
    "convert_module",
    "apply_plan",
    "initialise_when_loaded",
    "mark_trainable",
    "carried_config",
    "find_lora_layers",
    "merge_adapter",
    "unmerge_adapter",
    "merge_and_unload",
    "count_parameters",
    "print_trainable_parameters",
    "set_submodule",
    "add_conversion_hook",
    "run_conversion_hooks",
]

M = TypeVar("M", bound=nn.Module)
CONFIG_ATTR = "loragen_config"
# several named adapters: {name: config}, the model's first adapter first (loragen.adapters.named)
ADAPTER_CONFIGS_ATTR = "loragen_adapter_configs"
# called with a model once it holds LoRA layers; modules above this layer register here
_CONVERSION_HOOKS: list[Callable[[nn.Module], None]] = []
# loragen's own hook modules, imported by name before the first hooks run
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


def convert_module(module: nn.Module, plan: LoraPlan, path: str) -> LoraLayer:
    """The LoRA layer the ``plan`` entry for ``path`` makes of ``module`` (of its type, or on its parameters).

    Raises:
        LoraConversionError: the module's type is not supported, or a per-module value is invalid.
    """
    entry = plan.entries[path]
    if entry.parameters:
        return lora_parameters_class(type(module)).from_parameters(
            module,
            dict(entry.parameters),
            use_rslora=entry.use_rslora,
            init_lora_weights=entry.init_lora_weights,
        )
    try:
        return lora_class_for(type(module)).from_module(module, **entry.layer_kwargs())
    except LoraConversionError as exc:
        raise LoraConversionError(f"{path}: {exc}") from None
    except ValueError as exc:
        raise LoraConversionError(f"{path}: {exc}") from exc


def apply_plan(model: nn.Module, plan: LoraPlan) -> dict[str, LoraLayer]:
    """Replace every module ``plan`` adapts in ``model`` by its LoRA layer; returns them by path. Every layer
    is built before any is installed, so a failure leaves the model untouched."""
    replacements = {path: convert_module(module, plan, path) for path, module in plan.modules(model).items()}
    for path, layer in replacements.items():
        set_submodule(model, path, layer)
    return replacements


class _LoraInitWeights:
    """``model._init_weights`` of a model whose LoRA layers exist before its weights do: the class's own
    initialisation, then peft's for the LoRA factors (``init_lora_weights``)."""

    def __init__(self, model: nn.Module, init_lora_weights: InitMode) -> None:
        self.model = model
        self.init_lora_weights = init_lora_weights

    def __call__(self, module: nn.Module) -> None:
        type(self.model)._init_weights(self.model, module)  # type: ignore[attr-defined]
        if isinstance(module, LoraLayer):
            with torch.no_grad():
                module.reset_lora_parameters(self.init_lora_weights)


def initialise_when_loaded(model: nn.Module, config: LoraConfig, *, always: bool = False) -> None:
    """Make sure LoRA factors built before their weights exist get peft's initialisation.

    transformers' ``from_pretrained`` builds a model on the meta device and fills what the checkpoint lacks
    (the LoRA factors of a model converted in its ``__init__``) through ``_init_weights`` of the nearest
    ``PreTrainedModel`` holding each module. When the LoRA factors are on the meta device (``always``: in
    any case), ``model`` and every module in it that has an ``_init_weights`` and holds LoRA layers get one
    that also initialises LoRA layers; with no such module, a warning says nothing would initialise them.
    """
    layers = find_lora_layers(model)
    deferred = any(t.is_meta for layer in layers.values() for t in layer.lora_parameters().values())
    if not (deferred or always):
        return
    hooked = False
    for path, module in model.named_modules():
        if not callable(getattr(type(module), "_init_weights", None)):
            continue  # (a model has few PreTrainedModels: test those alone against every layer path)
        prefix = f"{path}." if path else ""
        if any(p.startswith(prefix) for p in layers):
            object.__setattr__(module, "_init_weights", _LoraInitWeights(module, config.init_lora_weights))
            hooked = True
    if deferred and not hooked:
        warnings.warn(
            f"{type(model).__name__}: its LoRA factors are made on the meta device (inside a model's __init__ "
            "under from_pretrained?) and nothing will initialise them; convert the PreTrainedModel itself "
            "(loragen.get_lora_model(model, config) in its __init__, or after loading), or load a checkpoint "
            "that holds the factors",
            stacklevel=3,
        )


def carried_config(model: nn.Module) -> LoraConfig:
    """The LoRA config ``model`` carries (``model.loragen_config``), else the one config its submodules
    carry.

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
    saved, bias = saved_modules(config, (path for path, _ in model.named_modules())), config.bias
    for p in model.parameters():
        p.requires_grad_(False)
    for layer in lora_layers.values():
        active = layer.active_adapter  # with several adapters, the active one trains (as in peft)
        if active is not None and has_adapter(layer, active):
            for p in adapter_factors(layer, active).lora_parameters().values():
                p.requires_grad_(True)
    if bias == "all":
        for name, p in model.named_parameters():
            if name == "bias" or name.endswith(".bias"):
                p.requires_grad_(True)
    elif bias == "lora_only":
        for layer in lora_layers.values():
            if getattr(layer, "bias", None) is not None:
                layer.bias.requires_grad_(True)
    for path in saved:
        for p in model.get_submodule(path).parameters():
            p.requires_grad_(True)
    run_conversion_hooks(model)


def get_lora_model(model: M, config: LoraConfig) -> M:
    """Convert ``model`` in place into a LoRA model and return it.

    Every module ``config`` targets (:func:`loragen.plan.resolve`) is replaced by the LoRA layer of its
    type, sharing the base weight and bias (a base checkpoint still loads). All parameters are frozen
    except the LoRA factors, ``modules_to_save`` and the biases ``bias`` selects. The resolved config is
    kept as ``model.loragen_config``. A model that already contains LoRA layers is refused.

    Raises:
        TypeError: ``config`` is neither a :class:`~loragen.config.LoraConfig` nor a peft ``LoraConfig``
            (which is read with :meth:`~loragen.config.LoraConfig.from_peft`).
        LoraConversionError, LoraConfigError: see :func:`loragen.plan.resolve`; nothing is changed then.
    """
    if not isinstance(config, LoraConfig) and type(config).__module__.startswith("peft."):
        config = LoraConfig.from_peft(config.to_dict(), source=f"peft {type(config).__name__}")
    plan = resolve(model, config)
    apply_plan(model, plan)
    mark_trainable(model, plan.config)
    setattr(model, CONFIG_ATTR, plan.config)
    initialise_when_loaded(model, plan.config)
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
    unique = {id(p): p for p in params}.values()
    return sum(p.numel() for p in unique if p.requires_grad), sum(p.numel() for p in unique)


def print_trainable_parameters(model: nn.Module, file: TextIO | None = None) -> tuple[int, int]:
    """Print ``trainable params: T || all params: N || trainable%: P`` (as peft does); return ``(T, N)``."""
    trainable, total = count_parameters(model.parameters())
    share = 100.0 * trainable / total if total else 0.0
    print(
        f"trainable params: {trainable:,d} || all params: {total:,d} || trainable%: {share:.4f}",
        file=file or sys.stdout,
    )
    return trainable, total
