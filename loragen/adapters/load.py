"""Loading an adapter folder into a model, all or nothing.

A plain model is first converted per the adapter's config; a model with LoRA layers is loaded into.
Every adapter tensor is matched to the model tensor it loads into, and every problem (missing,
unexpected, misshapen keys, wrong ranks) is reported together before the model is touched; a failure
while applying puts the model back exactly as it was.
"""

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
from loragen.convert import (
    ADAPTER_CONFIGS_ATTR,
    CONFIG_ATTR,
    convert_module,
    find_lora_layers,
    mark_trainable,
    plan_conversion,
    run_conversion_hooks,
    set_submodule,
)
from loragen.errors import AdapterError
from loragen.layers import LoraLayer
from loragen.layers.adapter_set import DEFAULT_ADAPTER, Factors, adapter_factors, has_adapter, set_active
from loragen.layers.expert_parameters import LoraParametersLayer, scaling_owners

__all__ = ["load_adapter"]

M = TypeVar("M", bound=nn.Module)


def _named_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    # tied parameters appear under every name they have, as in a state dict
    tensors: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    return tensors


def _plan_load(
    model: nn.Module, adapter: Adapter, layers: Mapping[str, Factors], strict: bool
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Match every adapter tensor to the model tensor it loads into; raise listing every problem.

    ``layers`` are the LoRA layers the model has, or will have once converted (they share the base
    parameters, so ``model``'s own tensors stand for everything else). Returns ``(model tensor, value)``
    pairs, values already in the target's dtype and on its device.
    """
    named = _named_tensors(model)
    config = adapter.config
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
        layer = layers.get(info.module) if info.is_lora else None
        target: torch.Tensor | None
        if key in owned:
            path, owner, attr = owned[key]
            target, target_name = owner.lora_parameters()[attr], attr.rsplit(".", 2)[1]
            found.add(f"{path}.{attr}")
            value = adapter.tensors[key]
            rank = config.rank_for(f"{path}.{target_name}")
            if tuple(value.shape) != tuple(target.shape):
                mismatched.append(f"{key}: expected shape {tuple(target.shape)}, found {tuple(value.shape)}")
            elif rank != owner.parameter_targets[target_name].r:
                wrong_rank.append(
                    f"{key}: the adapter config gives {path}.{target_name} rank {rank}, the model's "
                    f"factors have rank {owner.parameter_targets[target_name].r}"
                )
            else:
                plan[id(target)] = (target, value)
            continue
        if info.is_lora:
            target = layer.lora_parameters().get(info.name) if layer is not None else None
            if layer is not None and target is None:
                mismatched.append(
                    f"{key}: {info.module} is a {type(model.get_submodule(info.module)).__name__}, whose factors are "
                    f"{' and '.join(layer.lora_parameters())}, not {info.name}"
                )
                continue
        else:
            target = named.get(info.model_key)
        if target is None:
            unexpected.append(key)
            continue
        found.add(info.model_key)
        value = adapter.tensors[key]
        if tuple(value.shape) != tuple(target.shape):
            mismatched.append(f"{key}: expected shape {tuple(target.shape)}, found {tuple(value.shape)}")
        elif layer is not None and config.rank_for(info.module) != layer.r:
            wrong_rank.append(
                f"{key}: the adapter config gives {info.module} rank {config.rank_for(info.module)}, "
                f"the file and the model's layer have rank {layer.r}"
            )
        else:
            plan[id(target)] = (target, value)

    # model key -> file key of everything the adapter must provide
    expected = {
        f"{path}.{attr}": f"{PEFT_PREFIX}{path}.{suffix}"
        for path, layer in layers.items()
        for attr, suffix in layer.peft_key_suffixes().items()
    }
    for path, module in model.named_modules():
        if path and config.is_module_to_save(path):
            expected.update({f"{path}.{name}": f"{PEFT_PREFIX}{path}.{name}" for name in module.state_dict()})
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
    """What loading may change in a model, saved so that a failure can put it back exactly."""

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

    A model without LoRA layers is first converted per the saved config (targets, ``rank_pattern``,
    ``alpha_pattern``, ``use_rslora`` all honoured). A model that has LoRA layers (converted, rewritten
    or decorated) is loaded into: its layers must have the adapter's ranks, and take the adapter's alpha
    and ``use_rslora``. ``trainable=False`` freezes every parameter (inference); ``True`` sets
    ``requires_grad`` as :func:`~loragen.get_lora_model` does. The config is kept as
    ``model.loragen_config``.

    ``adapter_name`` names the adapter (peft's default, ``"default"``). Into a model that holds no
    adapter of that name, the adapter is added beside the others (:func:`loragen.add_adapter`; it is not
    made active); a model that holds one loads into it. One folder holds one adapter: load the
    subfolders of a multi-adapter folder (``path/<name>``) one by one.

    All or nothing: everything is checked before the model is touched, and on any error the model is
    left exactly as it was.

    Raises:
        AdapterError: a missing folder or file; a truncated or corrupt weights file (names it); a pickled
            ``adapter_model.bin`` without ``allow_pickle=True``; tensors whose shapes do not fit (key,
            expected and found shape); keys the model expects but the file lacks (all listed); keys
            nothing in the model takes (all listed); with ``strict=False`` missing and unexpected keys
            are ignored. Also a model whose LoRA layers are merged.
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
    added = False  # a further adapter added for this load: deleted again on failure
    if existing_layers and adapter_name not in list_adapters(model):
        add_adapter(model, config, adapter_name)
        added = True
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
        originals = plan_conversion(model, config)
        # the new layers share the base parameters but are not installed yet: the model is unchanged
        new_layers = {p: convert_module(module, config, p) for p, module in originals.items()}
        for layer in new_layers.values():
            layer.adapter_name = adapter_name
            set_active(layer, adapter_name)
        layers = {p: adapter_factors(layer, adapter_name) for p, layer in new_layers.items()}
    try:
        plan = _plan_load(model, adapter, layers, strict)
    except BaseException:
        if added:
            delete_adapter(model, adapter_name)
        raise

    # the factors of new layers need no backup: on failure the layers are dropped
    fresh = {id(t) for layer in new_layers.values() for t in layer.lora_parameters().values()}
    snapshot = _Snapshot(model, [t for t, _ in plan if id(t) not in fresh], existing)
    try:
        for p, layer in new_layers.items():
            set_submodule(model, p, layer)
        with torch.no_grad():
            for target, value in plan:
                target.copy_(value)
        for p, factors in existing.items():
            for key, owner in scaling_owners(p, factors):
                owner.lora_alpha = config.alpha_for(key)
                owner.use_rslora = config.use_rslora
                owner.scaling = config.scaling_for(key)
        record_config(model, adapter_name, config)
        if trainable:
            mark_trainable(model)
            set_trainable(model, adapter_name)
        else:
            model.requires_grad_(False)
    except BaseException:
        for p, module in originals.items():
            set_submodule(model, p, module)
        snapshot.restore()
        if added:
            delete_adapter(model, adapter_name)
        raise
    run_conversion_hooks(model)  # only once the load succeeded (e.g. transformers' adapter methods)
    return model
