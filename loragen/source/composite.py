"""Sub-models of a rewritten composite model, built at run time: :func:`lora_auto_class`.

A rewritten composite file builds its sub-models through ``LoraAutoModel = lora_auto_class(AutoModel,
[Gemma3TextModel], LORA_CONFIG)`` instead of transformers' ``AutoModel``. Its ``from_config`` builds the
file's own (rewritten) class when ``AutoModel`` would pick it, and otherwise builds transformers' class and
converts the layers the config targets in it, as :func:`loragen.get_lora_model` would (docs/ways-in.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from loragen.config import LoraConfig
from loragen.convert import apply_plan, initialise_when_loaded
from loragen.plan import resolve

__all__ = ["convert_sub_model", "lora_auto_class"]


def convert_sub_model(model: nn.Module, config: LoraConfig) -> nn.Module:
    """Convert the layers ``config`` targets in ``model`` (a sub-model of a composite) in place; a model in
    which the config targets nothing is left as it is. Parameters are not frozen (the composite's
    ``loragen.mark_trainable`` does that).

    Raises:
        LoraConversionError: as :func:`loragen.get_lora_model` (a targeted module of an unsupported type, ...).
    """
    plan = resolve(model, config, optional=True)
    if not plan.entries:
        return model
    apply_plan(model, plan)
    initialise_when_loaded(model, config, always=True)
    return model


def _mapped_class(auto_class: type, config: Any) -> type | None:
    """The model class ``auto_class`` maps ``config``'s type to, or None."""
    mapping = getattr(auto_class, "_model_mapping", None)
    try:
        found = mapping[type(config)] if mapping is not None else None
    except (KeyError, ValueError):
        return None
    if isinstance(found, (list, tuple)):
        found = found[0] if found else None
    return found if isinstance(found, type) else None


def lora_auto_class(auto_class: type, classes: Sequence[type], config: LoraConfig) -> type:
    """An auto class like ``auto_class`` (transformers' ``AutoModel``, ``AutoModelForCausalLM``, ...) whose
    ``from_config`` builds the given classes of a rewritten file for their configs, and converts any other
    model it builds with ``config`` (see the module docstring).

    Raises:
        TypeError: ``config`` is not a :class:`~loragen.config.LoraConfig`.
    """
    if not isinstance(config, LoraConfig):
        raise TypeError(f"config must be a loragen.LoraConfig, got {type(config).__name__}")
    own = {cls.__name__: cls for cls in classes}
    lora_config = config

    def from_config(cls: type, config: Any, **kwargs: Any) -> nn.Module:
        mapped = _mapped_class(auto_class, config)
        local = own.get(mapped.__name__) if mapped is not None else None
        if local is not None:
            model: nn.Module = local._from_config(config, **kwargs)  # type: ignore[attr-defined]
            return model
        model = auto_class.from_config(config, **kwargs)  # type: ignore[attr-defined]
        return convert_sub_model(model, lora_config)

    from_config.__doc__ = (
        f"``{auto_class.__name__}.from_config``, building {', '.join(own) or 'no class'} of the rewritten file "
        "for their configs and converting any other model with the file's LoRA config."
    )
    name = f"Lora{auto_class.__name__}"
    return type(
        name,
        (),
        {
            "__doc__": f"{auto_class.__name__} for a rewritten file (made by loragen.source.composite.lora_auto_class).",
            "__qualname__": name,
            "__module__": __name__,
            "from_config": classmethod(from_config),
            "auto_class": auto_class,
            "classes": tuple(classes),
            "lora_config": lora_config,
        },
    )
