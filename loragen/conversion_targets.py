"""What a config targets in a model: ``target_modules`` resolved to module paths (``all-linear`` as peft
means it), and the config a model is converted with and saves, with what ``all-linear`` means on it made
explicit for peft: the MoE parameters peft's ``all-linear`` adds
(:func:`loragen.parameter_targets.expand_all_linear`) and the linear modules it would take that loragen
leaves out.
"""

from __future__ import annotations

import re

from torch import nn

from loragen.config import ALL_LINEAR, LoraConfig
from loragen.errors import LoraConversionError
from loragen.layers import LoraLayer
from loragen.parameter_targets import expand_all_linear
from loragen.registry import spec_for

__all__ = ["effective_config", "exclude_what_peft_adds", "output_head_names", "resolve_target_modules"]


def output_head_names(model: nn.Module) -> set[str]:
    """Paths of the output head that ``all-linear`` leaves out (transformers' output embeddings)."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if head is None:
        return set()
    return {name for name, m in model.named_modules() if m is head}


def resolve_target_modules(model: nn.Module, config: LoraConfig) -> str | tuple[str, ...]:
    """``config.target_modules`` with ``"all-linear"`` expanded to the model's linear-layer paths.

    ``all-linear`` means every ``nn.Linear`` / transformers ``Conv1D`` except the output head (the
    module returned by ``get_output_embeddings()`` on transformers models), as in peft.

    Raises:
        LoraConversionError: ``target_modules`` is not set.
    """
    targets = config.target_modules
    if targets is None and config.target_parameters:
        return ()  # only parameters are targeted
    if targets is None:
        raise LoraConversionError(
            "LoraConfig.target_modules is None: name the modules to adapt, e.g. "
            "target_modules=['q_proj', 'v_proj'], a regex, or 'all-linear' "
            "(loragen has no per-architecture defaults)"
        )
    if targets != ALL_LINEAR:
        return targets if isinstance(targets, str) else tuple(targets)
    heads = output_head_names(model)
    return tuple(
        name
        for name, m in model.named_modules()
        if name
        and name not in heads
        and not isinstance(m, LoraLayer)
        and (spec := spec_for(m)) is not None
        and spec.linear
    )


def effective_config(model: nn.Module, config: LoraConfig) -> LoraConfig:
    """The config ``model`` is converted with: ``config``, with what ``all-linear`` adds on a transformers 5
    MoE model made explicit (the fused expert parameters and the router, as peft adds them; see
    :func:`loragen.parameter_targets.expand_all_linear`), and what it leaves out that peft's would adapt
    (:func:`exclude_what_peft_adds`). The model keeps this one, and saves it.

    Raises:
        LoraConfigError: ``all-linear`` would add parameters this config cannot adapt (``lora_dropout`` ...).
    """
    if config.target_modules != ALL_LINEAR:
        return config
    linear = set(resolve_target_modules(model, config))
    return expand_all_linear(model, exclude_what_peft_adds(model, config, linear), linear)


def exclude_what_peft_adds(model: nn.Module, config: LoraConfig, linear: set[str]) -> LoraConfig:
    """``config`` with the ``nn.Linear`` modules loragen's ``all-linear`` leaves out and peft's takes (every
    ``nn.Linear`` but the output head: ``nn.MultiheadAttention.out_proj``, whose weight is read without
    calling it) added to ``exclude_modules``. Saved with the adapter, that makes peft's ``all-linear`` adapt
    the same modules when it loads it; without it peft would add adapters whose keys the file lacks."""
    heads = output_head_names(model)
    inside_lora = tuple(f"{path}." for path, m in model.named_modules() if path and isinstance(m, LoraLayer))
    left_out = [
        path
        for path, m in model.named_modules()
        if path
        and isinstance(m, nn.Linear)
        and not isinstance(m, LoraLayer)
        and path not in linear
        and path not in heads
        and not path.startswith(inside_lora)
        and not config.is_excluded(path)
    ]
    if not left_out:
        return config
    excluded = config.exclude_modules
    if excluded is None:
        return config.replace(exclude_modules=left_out)
    if isinstance(excluded, str):  # a regex, which peft matches whole: one more alternative
        return config.replace(exclude_modules=f"(?:{excluded})|" + "|".join(re.escape(p) for p in left_out))
    return config.replace(exclude_modules=[*excluded, *left_out])
