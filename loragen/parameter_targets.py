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
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from torch import nn

from loragen.config import LoraConfig
from loragen.errors import LoraConversionError

__all__ = ["name_matches", "targeted_parameters", "plan_parameters", "peft_infix"]

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

    Raises:
        LoraConversionError: an entry of ``target_parameters`` selects nothing (every such entry is named,
            with some of the model's 2-D/3-D parameter names); a parameter of the top-level module is
            selected (peft refuses it too); a selected parameter is not 2-D or 3-D.
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
        raise LoraConversionError(
            f"target_parameters entries {unused!r} match no parameter of {type(model).__name__}; "
            f"an entry matches a parameter's full name or its dotted suffix. Its 2-D and 3-D parameters "
            f"include: {_parameter_sample(model)}"
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
