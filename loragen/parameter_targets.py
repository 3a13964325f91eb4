"""Which parameters ``LoraConfig.target_parameters`` selects, with peft's rules.

peft matches a parameter by its full name (``<module path>.<parameter name>``): an entry selects it when
the name equals the entry or ends with ``"." + entry``, so ``"experts.gate_up_proj"`` selects the
``gate_up_proj`` of every ``experts`` module, and ``"model.layers.0.mlp.experts.down_proj"`` one parameter.
Only a module's own parameters count (``recurse=False``), as in peft. ``exclude_modules`` and
``layers_to_transform`` do not apply to parameters (peft ignores them there too).

peft wraps each targeted parameter of a module in a ``ParamWrapper``, the first in the module's
registration order innermost; an adapter file therefore names the factors of the ``k``-th of ``n``
targeted parameters of a module ``<module>{".base_layer" * (n - 1 - k)}.lora_A.weight``.
:func:`peft_infix` gives that infix.

``all-linear`` on a transformers 5 MoE model: transformers 4 stored each expert and the router as
``nn.Linear`` layers; transformers 5 fuses the experts into 3-D parameters (``experts.gate_up_proj``,
``experts.down_proj``) and makes the router a module of its own with a ``weight``. peft 0.21 keeps
``all-linear`` meaning what it meant on transformers 4 for the model types whose checkpoints transformers
converts this way: it also targets those parameters, ``gate_up_proj`` (two linears fused) at twice the
rank and twice the alpha (the same scaling). :func:`all_linear_parameters` gives the entries and
:func:`expand_all_linear` the config loragen converts with (see ``loragen.convert``).

One model type on purpose differs: peft 0.21 finds a model's family in transformers' table, which names
``qwen2_moe`` only as the family of others (Qwen3-MoE, Qwen3-Next, ...), not as an entry of its own, so
peft's ``all-linear`` leaves Qwen2-MoE's own experts and router untrained while it trains Qwen3-MoE's.
loragen adapts them on Qwen2-MoE too (what ``all-linear`` meant there on transformers 4), and the config
it saves names them, so ``PeftModel.from_pretrained`` loads the adapter with the same layers.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Collection, Iterable, Mapping

from torch import nn

from loragen.config import LoraConfig, LoraConfigWarning, TargetWarning
from loragen.errors import LoraConfigError, LoraConversionError
from loragen.registry import spec_for
from loragen.validation import parameter_target_conflict

__all__ = [
    "name_matches",
    "targeted_parameters",
    "plan_parameters",
    "peft_infix",
    "fused_expert_family",
    "all_linear_parameters",
    "expand_all_linear",
    "linear_weight_only",
]

_SHOWN = 12


def name_matches(entries: Iterable[str], key: str) -> bool:
    """Whether the parameter named ``key`` (``<module path>.<name>``) is selected by one of ``entries``."""
    return any(key == entry or key.endswith("." + entry) for entry in entries)


def targeted_parameters(module: nn.Module, path: str, config: LoraConfig) -> tuple[str, ...]:
    """The names of ``module``'s own parameters that ``config.target_parameters`` selects, in the module's
    registration order (the order peft nests its wrappers in)."""
    entries = config.target_parameters or ()
    if not entries or not path:
        return ()
    return tuple(
        name for name, _ in module.named_parameters(recurse=False) if name_matches(entries, f"{path}.{name}")
    )


def plan_parameters(model: nn.Module, config: LoraConfig) -> dict[str, tuple[str, ...]]:
    """``{module path: the names of its targeted parameters}`` for every module with one.

    An entry that selects nothing is reported with a :class:`~loragen.config.TargetWarning` (with some of
    the model's 2-D/3-D parameter names), as a ``target_modules`` entry is: peft converts with the other
    entries, and its own ``all-linear`` conversion writes entries a model may not have (a model whose
    layers are all dense).

    Raises:
        LoraConversionError: an entry of ``target_parameters`` selects nothing, with
            ``strict_targets=True`` or where nothing else is targeted; a parameter of the top-level module
            is selected (peft refuses it too); a selected parameter is not 2-D or 3-D.
    """
    entries = config.target_parameters or ()
    if not entries:
        return {}
    planned: dict[str, tuple[str, ...]] = {}
    used: set[str] = set()
    for path, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            key = f"{path}.{name}" if path else name
            hits = [entry for entry in entries if key == entry or key.endswith("." + entry)]
            if not hits:
                continue
            used.update(hits)
            if not path:
                raise LoraConversionError(
                    f"target_parameters selects {key!r}, a parameter of the top-level "
                    f"{type(model).__name__} itself; only parameters of submodules can be adapted"
                )
            if param.dim() not in (2, 3):
                raise LoraConversionError(
                    f"target_parameters selects {key} of shape {list(param.shape)}: only 2-D (out, in) weights "
                    "and 3-D expert stacks (num_experts, out, in) can take LoRA factors"
                )
            planned.setdefault(path, ())
            planned[path] += (name,)
    unused = [entry for entry in entries if entry not in used]
    if unused:
        where = (
            f"match no parameter of {type(model).__name__}; an entry matches a parameter's full name or its "
            f"dotted suffix. Its 2-D and 3-D parameters include: {_parameter_sample(model)}"
        )
        if config.strict_targets or (not planned and config.target_modules is None):  # nothing to adapt
            strict = " (strict_targets=True)" if config.strict_targets else ""
            raise LoraConversionError(f"target_parameters entries {unused!r} {where}{strict}")
        for entry in unused:  # as target_modules entries: peft converts with the others, silently
            warnings.warn(
                f"target_parameters entry {entry!r} {where}. LoraConfig(strict_targets=True) makes this an error",
                TargetWarning,
                stacklevel=4,
            )
    return planned


def _parameter_sample(model: nn.Module) -> str:
    names = [name for name, p in model.named_parameters() if p.dim() in (2, 3)]
    shown = ", ".join(names[:_SHOWN])
    return (
        shown + (f", ... ({len(names) - _SHOWN} more)" if len(names) > _SHOWN else "") if names else "(none)"
    )


def peft_infix(names: Mapping[str, object] | Iterable[str], name: str) -> str:
    """The ``.base_layer`` infix peft's key of parameter ``name`` carries among the targeted ``names`` of one
    module (in registration order): ``""`` for the last (outermost wrapper), one more per earlier one."""
    order = list(names)
    return "base_layer." * (len(order) - 1 - order.index(name))


# transformers' checkpoint-conversion families whose experts and router were nn.Linear layers before
# transformers 5 (peft converts these for ``all-linear``); each family's own model type belongs to it.
_FUSED_FAMILIES = ("mixtral", "qwen2_moe")
# (parameter entry, how many transformers 4 linears it fuses): the router's weight, the experts' stacks.
_FUSED_ENTRIES = (("gate.weight", 1), ("gate_up_proj", 2), ("down_proj", 1))
# the transformers 4 module names peft's conversion moves from target_modules to those parameters, for
# every module so named: dense layers' and shared experts' linears of these names drop out in peft
_MOVED_NAMES = {
    "mixtral": ("gate", "w1", "w2", "w3"),
    "qwen2_moe": ("gate", "gate_proj", "up_proj", "down_proj"),
}


def fused_expert_family(model: nn.Module) -> str | None:
    """The transformers conversion family (``"mixtral"`` or ``"qwen2_moe"``) of ``model`` when it is a
    transformers 5 MoE model whose experts and router were linear layers before, else None.

    Read from ``model.config.model_type`` and transformers' own conversion table (the table peft reads),
    where a family's own model type belongs to it too (see the module docstring); None when transformers
    is not imported (then the model is not a transformers model).
    """
    model_type = _model_type(model)
    if model_type in _FUSED_FAMILIES:
        return model_type
    return _table_family(model_type)


def _model_type(model: nn.Module) -> str | None:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return model_type if isinstance(model_type, str) and "transformers" in sys.modules else None


def _table_family(model_type: str | None) -> str | None:
    """The fused family transformers' conversion table gives ``model_type`` (None if none, or no table)."""
    if model_type is None:
        return None
    try:
        from transformers.conversion_mapping import _MODEL_TO_CONVERSION_PATTERN as table
    except ImportError:  # a transformers without the table (4.x) has no fused experts either
        return None
    family = table.get(model_type)
    return family if family in _FUSED_FAMILIES else None


def _peft_converts(model: nn.Module) -> bool:
    """Whether peft's own ``all-linear`` conversion runs on ``model`` (and moves the linears of
    ``_MOVED_NAMES`` to the experts). peft looks the model type up in transformers' table, to which it adds
    ``mixtral`` only: Qwen2-MoE's own model type is not converted by peft 0.21, and its linears stay module
    targets there."""
    model_type = _model_type(model)
    return model_type == "mixtral" or _table_family(model_type) is not None


def all_linear_parameters(model: nn.Module, linear_paths: Collection[str]) -> tuple[tuple[str, int], ...]:
    """``(target_parameters entry, fused count)`` that ``all-linear`` adds on ``model`` (see the module
    docstring): an entry is listed when it selects a 2-D or 3-D parameter of a module that is not already
    one of the ``linear_paths`` ``all-linear`` adapts as a module. Empty for every other model."""
    if fused_expert_family(model) is None:
        return ()
    found: dict[str, int] = {}
    for path, module in model.named_modules():
        if not path or path in linear_paths:
            continue
        for name, param in module.named_parameters(recurse=False):
            key = f"{path}.{name}"
            for entry, count in _FUSED_ENTRIES:
                if param.dim() in (2, 3) and name_matches((entry,), key):
                    found[entry] = count
    return tuple((entry, count) for entry, count in _FUSED_ENTRIES if entry in found)


def expand_all_linear(model: nn.Module, config: LoraConfig, linear_paths: Collection[str]) -> LoraConfig:
    """``config`` with the parameters peft's ``all-linear`` adds on ``model`` made explicit.

    The entries of :func:`all_linear_parameters` join ``target_parameters``; a parameter fusing ``k``
    linears gets ``rank_pattern`` / ``alpha_pattern`` entries ``r * k`` / ``lora_alpha * k`` under the key
    peft writes (``.*\\.gate_up_proj``), after the user's own keys (which keep precedence). The result
    written to ``adapter_config.json`` converts the same way again, in loragen and in peft. Any other
    config (not ``all-linear``, not such a model, or already expanded) is returned unchanged.

    loragen keeps the linear layers peft's conversion drops from ``all-linear`` (a dense first layer's or
    the shared experts' ``gate_proj`` / ``up_proj`` / ``down_proj``): their weights are listed by full name
    (``model.layers.0.mlp.gate_proj.weight``) too, which peft adapts with the same keys, shapes and
    outputs as loragen's ``LoraLinear`` there; loragen converts them as modules
    (:func:`linear_weight_only`). Where peft's conversion does not run (Qwen2-MoE's own model type) they
    stay module targets in both and are not listed.

    Where the config cannot adapt parameters (``lora_dropout``, ``use_dora``, ``fan_in_fan_out``) on a model
    type peft's own conversion leaves alone (Qwen2-MoE), the config is returned unchanged, with a
    :class:`~loragen.config.LoraConfigWarning`: the experts stay out, as in peft.

    Raises:
        LoraConfigError: the config cannot adapt parameters (``lora_dropout``, ``use_dora``,
            ``fan_in_fan_out``; peft refuses these too); the message says what ``all-linear`` adds here.
    """
    if config.target_modules != "all-linear":
        return config
    added = all_linear_parameters(model, linear_paths)
    if not added:
        return config
    entries = list(config.target_parameters or ())
    # listed by name where peft's conversion drops them from target_modules; elsewhere both adapt them as
    # modules (listing them too would target one layer twice, which peft refuses when it loads the adapter)
    moved = _MOVED_NAMES[fused_expert_family(model) or "mixtral"] if _peft_converts(model) else ()
    for path in sorted(linear_paths):
        if path.rpartition(".")[2] in moved and f"{path}.weight" not in entries:
            entries.append(f"{path}.weight")
    ranks = dict(config.rank_pattern)
    alphas = dict(config.alpha_pattern)
    for entry, count in added:
        if entry not in entries:
            entries.append(entry)
        if count > 1:
            key = rf".*\.{entry}"
            ranks.setdefault(key, config.r * count)
            alphas.setdefault(key, config.lora_alpha * count)
    if (
        tuple(entries) == tuple(config.target_parameters or ())
        and ranks == dict(config.rank_pattern)
        and alphas == dict(config.alpha_pattern)
    ):
        return config
    conflict = parameter_target_conflict(config, str([entry for entry, _ in added]))
    if conflict is None:
        return config.replace(target_parameters=entries, rank_pattern=ranks, alpha_pattern=alphas)
    family = fused_expert_family(model)
    if not _peft_converts(model):  # peft's all-linear leaves them out here: so does loragen, when it must
        warnings.warn(
            f"target_modules='all-linear' on {type(model).__name__} leaves the fused expert parameters "
            f"{[entry for entry, _ in added]} out, as peft does on this model type: {conflict}",
            LoraConfigWarning,
            stacklevel=5,
        )
        return config
    raise LoraConfigError(
        f"target_modules='all-linear' on {type(model).__name__} (a {family}-family MoE model) also adapts the "
        f"fused expert parameters {[entry for entry, _ in added]}, as peft does: {conflict}. Or list the "
        "linear modules to adapt instead of 'all-linear' (the experts are then left out)"
    )


def linear_weight_only(module: nn.Module, config: LoraConfig, names: tuple[str, ...]) -> bool:
    """Whether the targeted parameters ``names`` of ``module`` are a linear layer's ``weight`` that
    ``all-linear`` adapts as a module anyway (:func:`expand_all_linear` lists such weights for peft): the
    same adapter either way, converted as a module."""
    spec = spec_for(module)
    return config.target_modules == "all-linear" and names == ("weight",) and spec is not None and spec.linear
