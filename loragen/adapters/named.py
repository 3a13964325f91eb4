"""Several named adapters on one model, with peft's semantics: add, switch, delete, switch off.

The adapters are those the LoRA layers hold (:mod:`loragen.layers.adapter_set`); their configs are kept
as ``model.loragen_adapter_configs`` and ``model.loragen_config`` stays the first adapter's. One adapter
is active at a time: every LoRA layer adds it, and only its factors train.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeVar

from torch import nn

from loragen.config import LoraConfig
from loragen.convert import (
    ADAPTER_CONFIGS_ATTR,
    CONFIG_ATTR,
    convert_module,
    find_lora_layers,
    get_lora_model,
    set_submodule,
)
from loragen.errors import (
    AdapterError,
    AdapterNameError,
    LoraConfigError,
    LoraConversionError,
    LoraMergeError,
)
from loragen.layers import LoraLayer
from loragen.layers.adapter_set import (
    DEFAULT_ADAPTER,
    adapter_factors,
    adapter_names,
    add_factors,
    has_adapter,
    holds_several,
    remove_factors,
    set_active,
)
from loragen.plan import resolve, saved_modules

__all__ = [
    "DEFAULT_ADAPTER",
    "list_adapters",
    "active_adapter",
    "adapter_configs",
    "record_config",
    "require_adapter",
    "check_adapter_name",
    "add_adapter",
    "set_adapter",
    "set_trainable",
    "delete_adapter",
    "disable_adapter",
]

M = TypeVar("M", bound=nn.Module)


def list_adapters(model: nn.Module) -> list[str]:
    """The names of ``model``'s adapters, the first one first."""
    configs = model.__dict__.get(ADAPTER_CONFIGS_ATTR)
    names = list(configs) if isinstance(configs, dict) else []
    for layer in find_lora_layers(model).values():
        names.extend(n for n in adapter_names(layer) if n not in names)
    return names


def active_adapter(model: nn.Module) -> str | None:
    """The name of the adapter ``model``'s LoRA layers add (None: none, or no LoRA layers)."""
    for layer in find_lora_layers(model).values():
        return layer.active_adapter
    return None


def adapter_configs(model: nn.Module) -> dict[str, LoraConfig | None]:
    """``{name: config}`` of ``model``'s adapters; ``None`` for one whose layers carry no config."""
    configs = model.__dict__.get(ADAPTER_CONFIGS_ATTR)
    if isinstance(configs, dict):
        return dict(configs)
    own = getattr(model, CONFIG_ATTR, None)
    names = list_adapters(model)
    return {names[0]: own if isinstance(own, LoraConfig) else None} if names else {}


def record_config(model: nn.Module, name: str, config: LoraConfig) -> None:
    """Keep ``config`` as the config of ``model``'s adapter ``name``."""
    configs = adapter_configs(model)
    configs[name] = config
    if list(configs) == [DEFAULT_ADAPTER]:
        model.__dict__.pop(ADAPTER_CONFIGS_ATTR, None)  # a single default adapter: as before
    else:
        setattr(model, ADAPTER_CONFIGS_ATTR, configs)
    setattr(model, CONFIG_ATTR, next(iter(configs.values())))


def require_adapter(model: nn.Module, name: object, what: str = "adapter") -> str:
    """``name`` if ``model`` holds an adapter of that name.

    Raises:
        AdapterNameError: it does not (the message lists the adapters it holds).
    """
    known = list_adapters(model)
    if not isinstance(name, str) or name not in known:
        raise AdapterNameError(
            f"unknown {what} {name!r}; {type(model).__name__} holds "
            + (", ".join(map(repr, known)) if known else "no adapters")
        )
    return name


def check_adapter_name(name: object) -> str:
    """``name`` if it can name an adapter, a key component and a folder name (``save_adapter`` writes
    ``path/name``); AdapterNameError, saying why, if it has a ``.``, ``/``, ``\\``, a control
    character, is empty or is ``"__base__"`` (the mixed-batch name for no adapter)."""
    accepted = "expected a non-empty name without '.', '/', '\\' or control characters, other than '__base__'"
    if not isinstance(name, str):
        raise AdapterNameError(f"adapter_name={name!r}: a {type(name).__name__}, {accepted}")
    bad = [repr(c) for c in ".\\/" if c in name] + [
        repr(c) for c in sorted(set(name)) if ord(c) < 32 or c == "\x7f"
    ]
    if not name or bad or name == "__base__":
        reason = f" (contains {', '.join(bad)})" if bad else ""
        raise AdapterNameError(f"adapter_name={name!r}{reason}: {accepted}")
    return name


def _check_new_adapter(model: nn.Module, config: LoraConfig, name: str) -> None:
    check_adapter_name(name)
    known = list_adapters(model)
    if name in known:
        raise AdapterNameError(f"{type(model).__name__} holds an adapter {name!r} already; pick another name")
    others = {n: c for n, c in adapter_configs(model).items() if c is not None}
    biased = [n for n, c in [*others.items(), (name, config)] if c.bias != "none"]
    if biased:
        raise LoraConfigError(
            f"bias: adapters {', '.join(map(repr, biased))} train biases (bias != 'none'); with several adapters "
            "every adapter needs bias='none' (as in peft), since the base biases are shared"
        )
    if config.target_parameters:
        raise LoraConfigError(
            f"target_parameters={list(config.target_parameters)!r}: LoRA on parameters holds one adapter only; a "
            "further adapter cannot target parameters (leave target_parameters empty for it)"
        )
    if config.modules_to_save:
        raise LoraConfigError(
            f"modules_to_save={list(config.modules_to_save)!r}: a further adapter cannot train modules in full "
            "(loragen keeps one copy of each module); leave modules_to_save empty"
        )


def add_adapter(model: M, config: LoraConfig, adapter_name: str = DEFAULT_ADAPTER) -> M:
    """Add the adapter ``adapter_name`` with ``config`` to ``model``; returns the same model.

    Beside the others it is *not* made active (its factors are frozen), as in peft; targeted plain layers
    become LoRA layers holding only it. A model without LoRA layers is converted (``get_lora_model``)
    and the adapter is active and trainable.

    Raises:
        AdapterNameError: ``adapter_name`` exists already or is not a valid name.
        LoraConfigError: ``bias`` other than ``"none"`` or ``modules_to_save`` with several adapters.
        LoraConversionError: the targets match nothing, or a layer type that holds one adapter only.
    """
    if not isinstance(config, LoraConfig):
        raise TypeError(f"config must be a loragen.LoraConfig, got {type(config).__name__}")
    existing = find_lora_layers(model)
    if not existing:
        check_adapter_name(adapter_name)
        get_lora_model(model, config)
        for layer in find_lora_layers(model).values():
            layer.adapter_name = adapter_name
            set_active(layer, adapter_name)
        record_config(model, adapter_name, getattr(model, CONFIG_ATTR))  # as converted: all-linear explicit
        return model
    _check_new_adapter(model, config, adapter_name)
    plan = resolve(model, config, further=True)
    config = plan.config  # all-linear: the modules peft's would add are excluded for it
    targets = plan.modules(model)
    single = [p for p, m in targets.items() if isinstance(m, LoraLayer) and not holds_several(m)]
    if single:
        raise LoraConversionError(
            f"{', '.join(single)}: {type(targets[single[0]]).__qualname__} holds one adapter only "
            "(LoRA on targeted parameters); leave these out of target_modules"
        )
    active = active_adapter(model)
    # build every new layer first, so a failure leaves the model as it was
    new_layers = {
        path: convert_module(module, plan, path)
        for path, module in targets.items()
        if not isinstance(module, LoraLayer)
    }
    for path, layer in new_layers.items():
        layer.adapter_name = adapter_name
        set_active(layer, active)
        for p in layer.lora_parameters().values():
            p.requires_grad_(False)
        set_submodule(model, path, layer)
    for path, module in targets.items():
        if isinstance(module, LoraLayer):
            factors = add_factors(module, adapter_name, **plan.entries[path].layer_kwargs())
            factors.requires_grad_(False)
    record_config(model, adapter_name, config)
    return model


def set_adapter(model: nn.Module, adapter_name: str, *, inference_mode: bool = False) -> None:
    """Make ``adapter_name`` the adapter every LoRA layer of ``model`` adds; only its factors require grad
    (none with ``inference_mode``), as peft's. Merged layers are unmerged first (with a warning).

    Raises:
        AdapterNameError: ``model`` holds no adapter ``adapter_name`` (the message lists those it holds).
    """
    require_adapter(model, adapter_name)
    for path, layer in find_lora_layers(model).items():
        if layer.merged:
            warnings.warn(f"{path}: set_adapter unmerges the merged layer first", stacklevel=2)
            layer.unmerge()
        set_active(layer, adapter_name)
    set_trainable(model, None if inference_mode else adapter_name)


def set_trainable(model: nn.Module, adapter_name: str | None) -> None:
    """Make adapter ``adapter_name``'s factors require grad and every other adapter's not (None: none)."""
    for layer in find_lora_layers(model).values():
        for name in adapter_names(layer):
            for p in adapter_factors(layer, name).lora_parameters().values():
                p.requires_grad_(name == adapter_name)


def delete_adapter(model: nn.Module, adapter_name: str) -> None:
    """Remove the adapter ``adapter_name`` from ``model`` (every layer, its config).

    A layer left without adapters becomes its base layer again. If it was active, the first remaining
    name in sorted order becomes active; the modules it trained in full are frozen again unless another
    adapter saves them (peft's rules).

    Raises:
        AdapterNameError: ``model`` holds no adapter ``adapter_name``.
        LoraMergeError: the adapter is merged into some layer (unmerge first, as peft asks).
    """
    require_adapter(model, adapter_name)
    layers = find_lora_layers(model)
    merged = [
        p
        for p, layer in layers.items()
        if layer.merged and layer.__dict__.get("_merged_adapter") == adapter_name
    ]
    if merged:
        raise LoraMergeError(
            f"cannot delete adapter {adapter_name!r} while it is merged into {', '.join(merged[:5])}; "
            "call loragen.unmerge_adapter(model) first"
        )
    was_active = active_adapter(model) == adapter_name
    configs = adapter_configs(model)
    for path, layer in layers.items():
        if has_adapter(layer, adapter_name) and not remove_factors(layer, adapter_name):
            set_submodule(model, path, layer.to_base())
    deleted = configs.pop(adapter_name, None)
    if deleted is not None and deleted.modules_to_save:  # what it trained in full is frozen again, as in peft
        paths = [path for path, _ in model.named_modules()]
        kept = {p for config in configs.values() if config is not None for p in saved_modules(config, paths)}
        for path in saved_modules(deleted, paths):
            if path not in kept:
                model.get_submodule(path).requires_grad_(False)
    model.__dict__.pop(ADAPTER_CONFIGS_ATTR, None)
    remaining = list_adapters(model)
    if not remaining:
        model.__dict__.pop(CONFIG_ATTR, None)
    else:
        for name, config in configs.items():
            if config is not None:
                record_config(model, name, config)
        if was_active:
            set_adapter(model, sorted(remaining)[0])


@contextmanager
def disable_adapter(model: M) -> Iterator[M]:
    """Within the block ``model`` computes its base model (merged layers unmerged, merged again on exit).
    Yields ``model``. Trained biases and ``modules_to_save`` stay (loragen keeps no second copy of them).

    Raises:
        AdapterError: the model has no LoRA layers.
    """
    layers = find_lora_layers(model)
    if not layers:
        raise AdapterError(f"disable_adapter: {type(model).__name__} has no LoRA layers")
    saved = {path: (layer.active_adapter, layer.merged) for path, layer in layers.items()}
    for layer in layers.values():
        layer.unmerge()
        set_active(layer, None)
    try:
        yield model
    finally:
        for path, layer in layers.items():
            active, merged = saved[path]
            set_active(layer, active)
            if merged:
                layer.merge()
