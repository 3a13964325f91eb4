"""Several named adapters on one model, with peft's semantics: add, switch, delete, switch off, combine.

The adapters are those the LoRA layers hold (:mod:`loragen.layers.adapter_set`); their configs are kept
as ``model.loragen_adapter_configs`` and ``model.loragen_config`` stays the first adapter's. One adapter
is active at a time: every LoRA layer adds it, and only its factors train. ``add_weighted_adapter``
combines adapters into a new one with peft's rank and config.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Sequence
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
    AdapterMixError,
    AdapterNameError,
    LoraConfigError,
    LoraConversionError,
    LoraMergeError,
)
from loragen.layers import LoraLayer
from loragen.layers.adapter_set import (
    COMBINATIONS,
    DEFAULT_ADAPTER,
    adapter_factors,
    adapter_names,
    add_factors,
    combine,
    has_adapter,
    holds_several,
    remove_factors,
    set_active,
)
from loragen.plan import max_rank, resolve, saved_modules

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
    "add_weighted_adapter",
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
    return next((layer.active_adapter for layer in find_lora_layers(model).values()), None)


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
    if name in list_adapters(model):
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
            add_factors(module, adapter_name, **plan.entries[path].layer_kwargs()).requires_grad_(False)
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


def _new_targets(names: Sequence[str], configs: dict[str, LoraConfig | None]) -> str | list[str] | None:
    targets = {n: configs[n].target_modules if configs[n] is not None else None for n in names}  # type: ignore[union-attr]
    kinds = {n: "regex" if isinstance(t, str) else "list" for n, t in targets.items() if t is not None}
    if len(set(kinds.values())) > 1:
        described = ", ".join(f"{n!r}: target_modules={targets[n]!r}" for n in kinds)
        raise AdapterMixError(
            f"cannot combine adapters whose target_modules mix a regex (a string) and a list of names ({described}); "
            "peft refuses them too"
        )
    if not kinds:
        return None
    if "regex" in kinds.values():
        return "|".join(f"({targets[n]})" for n in kinds)
    return sorted({t for n in kinds for t in targets[n]})  # type: ignore[union-attr]


def add_weighted_adapter(
    model: nn.Module,
    adapters: Sequence[str],
    weights: Sequence[float],
    adapter_name: str,
    combination_type: str = "svd",
    *,
    svd_rank: int | None = None,
    svd_clamp: float | None = None,
    svd_full_matrices: bool = True,
    svd_driver: str | None = None,
) -> None:
    """Add ``adapter_name``, the combination of ``adapters`` with ``weights``, to ``model`` (peft's semantics).

    ``combination_type``: ``"cat"`` (exact; rank = the sum of the ranks), ``"linear"`` (every rank equal)
    or ``"svd"`` (rank ``svd_rank``, default the largest); ``"linear"`` for one adapter, as peft. Weights
    may be negative. The new adapter is not made active and its factors are frozen, as in peft.

    Raises:
        AdapterNameError: an unknown adapter in ``adapters`` (the known ones are listed), or
            ``adapter_name`` exists already (peft returns silently then; loragen says so).
        AdapterMixError: ``weights`` and ``adapters`` differ in length, a weight is not a finite number, an
            unknown ``combination_type``, ``"linear"`` over adapters of different ranks, DoRA adapters, or target_modules
            that mix a regex and a list (the adapters and what differs are named).
    """
    names = list(adapters)
    if not names:
        raise AdapterMixError("add_weighted_adapter: adapters is empty; name at least one adapter")
    for name in names:
        require_adapter(model, name)
    if len(weights) != len(names):
        raise AdapterMixError(
            f"add_weighted_adapter: {len(names)} adapters ({', '.join(map(repr, names))}) but {len(weights)} weights"
        )
    bad = [
        w for w in weights if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w)
    ]
    if bad:
        raise AdapterMixError(f"add_weighted_adapter: weights must be finite numbers, got {bad!r}")
    if isinstance(adapter_name, str) and adapter_name in adapter_configs(model):
        raise AdapterNameError(
            f"add_weighted_adapter: an adapter {adapter_name!r} exists already; pick another name"
        )
    check_adapter_name(adapter_name)
    if combination_type not in COMBINATIONS:
        raise AdapterMixError(
            f"add_weighted_adapter: combination_type={combination_type!r}; loragen implements "
            f"{', '.join(map(repr, COMBINATIONS))}"
        )
    if len(names) == 1:
        combination_type = "linear"
    configs = adapter_configs(model)
    layers = {
        p: layer for p, layer in find_lora_layers(model).items() if any(has_adapter(layer, n) for n in names)
    }
    variants = {  # each adapter's variant (one per adapter: it follows the adapter's config)
        n: adapter_factors(layer, n).variant
        for layer in layers.values()
        for n in names
        if has_adapter(layer, n)
    }
    uncombinable = [n for n in names if n in variants and not variants[n].combinable]
    if uncombinable:
        title = variants[uncombinable[0]].title
        raise AdapterMixError(
            f"add_weighted_adapter: adapter(s) {', '.join(map(repr, uncombinable))} use {title}; a weighted sum of "
            f"factors leaves out what {title} adds to them, so loragen does not combine {title} adapters"
        )
    ranks = {  # the largest rank of each (peft: max(r, *rank_pattern.values()))
        n: max_rank(c)
        if (c := configs.get(n)) is not None
        else max(adapter_factors(layer, n).r for layer in layers.values() if has_adapter(layer, n))
        for n in names
    }
    if combination_type == "linear" and len(set(ranks.values())) > 1:
        described = ", ".join(f"{n!r} r={r}" for n, r in ranks.items())
        raise AdapterMixError(
            f"combination_type='linear' needs adapters of one rank, but {described}; use 'cat' or 'svd'"
        )
    new_rank = {"linear": ranks[names[0]], "cat": sum(ranks.values())}.get(
        combination_type, svd_rank or max(ranks.values())
    )
    targets = _new_targets(names, configs)
    first = configs.get(names[0])
    if first is None:
        config = LoraConfig(r=new_rank, lora_alpha=new_rank, target_modules=sorted(layers))
    else:
        config = first.replace(
            r=new_rank,
            lora_alpha=new_rank,
            target_modules=targets if targets is not None else sorted(layers),
            rank_pattern={},
            alpha_pattern={},
        )
    # every layer's factors first: an error leaves the model unchanged
    combined = {
        path: combine(
            [
                (n, adapter_factors(layer, n), float(w))
                for n, w in zip(names, weights)
                if has_adapter(layer, n)
            ],
            combination_type,
            new_rank,
            path=path,
            svd_clamp=svd_clamp,
            svd_full_matrices=svd_full_matrices,
            svd_driver=svd_driver,
        )
        for path, layer in layers.items()
    }
    for path, layer in layers.items():
        a, b = combined[path]
        factors = add_factors(
            layer,
            adapter_name,
            r=new_rank,
            lora_alpha=new_rank,
            lora_dropout=config.lora_dropout,
            use_rslora=config.use_rslora,
        )
        factors.factor_a.data.copy_(a)
        factors.factor_b.data.copy_(b)
        factors.requires_grad_(False)
    record_config(model, adapter_name, config)
