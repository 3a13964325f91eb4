"""Loading an adapter folder into a model, all or nothing (:func:`load_adapter`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TypeVar

import torch
from torch import nn

from loragen.adapters.folder import PEFT_PREFIX, Adapter, read_adapter
from loragen.adapters.named import (
    add_adapter,
    check_adapter_name,
    delete_adapter,
    list_adapters,
    record_config,
    set_trainable,
)
from loragen.config import LoraConfig
from loragen.convert import (
    ADAPTER_CONFIGS_ATTR,
    CONFIG_ATTR,
    convert_module,
    find_lora_layers,
    mark_trainable,
    run_conversion_hooks,
    set_submodule,
)
from loragen.errors import AdapterError
from loragen.layers import LoraLayer
from loragen.layers.adapter_set import DEFAULT_ADAPTER, Factors, adapter_factors, has_adapter, set_active
from loragen.layers.expert_parameters import LoraParametersLayer, scaling_owners
from loragen.plan import entry_for, resolve, saved_modules

__all__ = ["load_adapter"]

M = TypeVar("M", bound=nn.Module)


def _plan_load(
    model: nn.Module, adapter: Adapter, config: LoraConfig, layers: Mapping[str, Factors], strict: bool
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(model tensor, value)`` for every adapter tensor, values in the target's dtype and device;
    raises listing every problem. ``layers``: the LoRA layers the model has or will have once converted."""
    # tied parameters appear under every name they have, as in a state dict
    named: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    plan: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    mismatched: list[str] = []
    wrong_rank: list[str] = []
    unexpected: list[str] = []
    found: set[str] = set()
    # factors of targeted parameters: their keys (peft's nested wrappers) come from the layers themselves
    owned = {
        f"{PEFT_PREFIX}{path}.{suffix}": (path, layer, attr)
        for path, layer in layers.items()
        if isinstance(layer, LoraParametersLayer)
        for attr, suffix in layer.peft_key_suffixes().items()
    }
    for key, info in sorted(adapter.keys.items()):
        value = adapter.tensors[key]
        layer = layers.get(info.module) if info.is_lora else None
        target: torch.Tensor | None
        rank_of = None  # (the config's path, the model's rank, whose rank it is)
        if key in owned:
            path, owner, attr = owned[key]
            name = attr.rsplit(".", 2)[1]
            target, model_key = owner.lora_parameters()[attr], f"{path}.{attr}"
            rank_of = (f"{path}.{name}", owner.parameter_targets[name].r, "the model's factors have")
        elif layer is not None:
            target, model_key = layer.lora_parameters().get(info.name), info.model_key
            if target is None:
                mismatched.append(
                    f"{key}: {info.module} is a {type(model.get_submodule(info.module)).__name__}, whose factors are "
                    f"{' and '.join(layer.lora_parameters())}, not {info.name}"
                )
                continue
            rank_of = (info.module, layer.r, "the file and the model's layer have")
        else:
            target, model_key = (None if info.is_lora else named.get(info.model_key)), info.model_key
        if target is None:
            unexpected.append(key)
            continue
        found.add(model_key)
        if tuple(value.shape) != tuple(target.shape):
            mismatched.append(f"{key}: expected shape {tuple(target.shape)}, found {tuple(value.shape)}")
        elif rank_of is not None and (rank := entry_for(config, rank_of[0]).r) != rank_of[1]:
            wrong_rank.append(
                f"{key}: the adapter config gives {rank_of[0]} rank {rank}, {rank_of[2]} rank {rank_of[1]}"
            )
        else:
            plan[id(target)] = (target, value)

    # model key -> file key of everything the adapter must provide
    expected = {
        f"{path}.{attr}": f"{PEFT_PREFIX}{path}.{suffix}"
        for path, layer in layers.items()
        for attr, suffix in layer.peft_key_suffixes().items()
    }
    for path in saved_modules(config, (path for path, _ in model.named_modules())):
        state = model.get_submodule(path).state_dict()
        expected.update({f"{path}.{name}": f"{PEFT_PREFIX}{path}.{name}" for name in state})
    missing = sorted(file_key for model_key, file_key in expected.items() if model_key not in found)

    problems = []
    dora_mismatch = [path for path, layer in layers.items() if layer.variant.use_dora != config.use_dora]
    if dora_mismatch:
        problems.append(
            f"the adapter config has use_dora={config.use_dora} but these LoRA layers have use_dora="
            f"{not config.use_dora}:\n    " + "\n    ".join(dora_mismatch)
        )
    if mismatched:
        problems.append("shape mismatch:\n    " + "\n    ".join(mismatched))
    if wrong_rank:
        problems.append("rank mismatch:\n    " + "\n    ".join(wrong_rank))
    if missing and strict:
        problems.append(
            f"missing keys ({len(missing)}; the model expects them, the file lacks them):\n    "
            + "\n    ".join(missing)
        )
    if unexpected and strict:
        problems.append(
            f"unexpected keys ({len(unexpected)}; nothing in the model takes them - pass strict=False "
            "to ignore them):\n    " + "\n    ".join(unexpected)
        )
    if problems:
        raise AdapterError(
            f"{adapter.weights_path} does not fit {type(model).__name__}:\n  " + "\n  ".join(problems)
        )
    return [(target, value.to(device=target.device, dtype=target.dtype)) for target, value in plan.values()]


class _Snapshot:
    """What loading may change in a model, to put back on failure."""

    def __init__(self, model: nn.Module, overwritten: list[torch.Tensor], layers: Mapping[str, Factors]):
        self.model = model
        self.values = [(t, t.detach().clone()) for t in overwritten]
        self.requires_grad = [(p, p.requires_grad) for p in model.parameters()]
        self.scaling = {
            owner: (owner.lora_alpha, owner.use_rslora, owner.scaling)
            for path, layer in layers.items()
            for _, owner in scaling_owners(path, layer)
        }
        self.config = model.__dict__.get(CONFIG_ATTR, _MISSING)
        self.configs = model.__dict__.get(ADAPTER_CONFIGS_ATTR, _MISSING)

    @torch.no_grad()
    def restore(self) -> None:
        for tensor, saved in self.values:
            tensor.copy_(saved)
        for p, flag in self.requires_grad:
            p.requires_grad_(flag)
        for layer, (alpha, rslora, scaling) in self.scaling.items():
            layer.lora_alpha, layer.use_rslora, layer.scaling = alpha, rslora, scaling
        for attr, value in ((CONFIG_ATTR, self.config), (ADAPTER_CONFIGS_ATTR, self.configs)):
            if value is _MISSING:
                self.model.__dict__.pop(attr, None)
            else:
                setattr(self.model, attr, value)


_MISSING = object()


def load_adapter(
    model: M,
    path: str | os.PathLike[str],
    *,
    adapter_name: str = DEFAULT_ADAPTER,
    trainable: bool = False,
    strict: bool = True,
    allow_pickle: bool = False,
) -> M:
    """Load the adapter folder ``path`` (peft's format) into ``model``; returns the same model.

    A model without LoRA layers is first converted per the saved config; one with LoRA layers is loaded
    into (its ranks must be the adapter's; it takes the adapter's alpha and ``use_rslora``). An
    ``adapter_name`` the model does not hold is added beside the others (not made active). One folder
    holds one adapter (load ``path/<name>`` subfolders one by one). As peft's ``is_trainable``:
    ``trainable=False`` freezes every parameter and puts the model in eval mode; ``True`` sets
    ``requires_grad`` as :func:`~loragen.get_lora_model` does and puts the LoRA layers that hold the adapter
    in train mode (the rest keeps its mode).

    All or nothing: everything is checked before the model is touched; on any error it is left as it was.

    Raises:
        AdapterError: a missing or corrupt file (names it), a pickle without ``allow_pickle=True``;
            misshapen tensors, wrong ranks, keys the file lacks or nothing takes (all listed; missing and
            unexpected keys are ignored with ``strict=False``); merged LoRA layers.
        LoraConfigError: an invalid or unsupported field in ``adapter_config.json`` (names the field).
        LoraConversionError: the config's targets match nothing in the model (names the targets), or
            match layers loragen cannot adapt.
    """
    check_adapter_name(adapter_name)
    adapter = read_adapter(path, allow_pickle=allow_pickle)
    config = adapter.config
    existing_layers = find_lora_layers(model)
    originals: dict[str, nn.Module] = {}  # path -> the plain module a new LoRA layer replaces
    new_layers: dict[str, LoraLayer] = {}
    # a further adapter added for this load: deleted again on failure
    added = bool(existing_layers) and adapter_name not in list_adapters(model)
    if added:
        add_adapter(model, config, adapter_name)
        existing_layers = find_lora_layers(model)
    # the factors this load writes: the named adapter's in every layer that holds it
    existing: dict[str, Factors] = {
        p: adapter_factors(layer, adapter_name)
        for p, layer in existing_layers.items()
        if has_adapter(layer, adapter_name)
    }
    if existing_layers:
        merged = [p for p, layer in existing_layers.items() if layer.merged and p in existing]
        if merged:
            raise AdapterError(
                f"cannot load an adapter into merged LoRA layers ({', '.join(merged)}): "
                "call loragen.unmerge_adapter(model) first"
            )
        layers: Mapping[str, Factors] = existing
    else:
        plan = resolve(model, config)
        config = plan.config
        originals = plan.modules(model)
        # the new layers share the base parameters but are not installed yet: the model is unchanged
        new_layers = {p: convert_module(module, plan, p) for p, module in originals.items()}
        for layer in new_layers.values():
            layer.adapter_name = adapter_name
            set_active(layer, adapter_name)
        layers = {p: adapter_factors(layer, adapter_name) for p, layer in new_layers.items()}
    try:
        pairs = _plan_load(model, adapter, config, layers, strict)
    except BaseException:
        if added:
            delete_adapter(model, adapter_name)
        raise

    # the factors of new layers need no backup: on failure the layers are dropped
    fresh = {id(t) for layer in new_layers.values() for t in layer.lora_parameters().values()}
    snapshot = _Snapshot(model, [t for t, _ in pairs if id(t) not in fresh], existing)
    try:
        for p, layer in new_layers.items():
            set_submodule(model, p, layer)
        with torch.no_grad():
            for target, value in pairs:
                target.copy_(value)
        for p, factors in existing.items():
            for key, owner in scaling_owners(p, factors):
                entry = entry_for(config, key)
                owner.lora_alpha = entry.lora_alpha
                owner.use_rslora = entry.use_rslora
                owner.scaling = entry.scaling
        record_config(model, adapter_name, config)
        if trainable:
            mark_trainable(model)
            set_trainable(model, adapter_name)
        else:
            model.requires_grad_(False)
        if not trainable:
            model.eval()
    except BaseException:
        for p, module in originals.items():
            set_submodule(model, p, module)
        snapshot.restore()
        if added:
            delete_adapter(model, adapter_name)
        raise
    if trainable:
        for layer in find_lora_layers(model).values():
            if has_adapter(layer, adapter_name):
                layer.train()
    run_conversion_hooks(model)  # only once the load succeeded (e.g. transformers' adapter methods)
    return model
