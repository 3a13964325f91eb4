"""Turning an existing module into a LoRA layer, and back, without copying or renaming anything.

A LoRA layer *is* its base layer with LoRA factors added: :func:`clone_as` makes a new object of the LoRA
class that holds the base module's own state — the same parameter and buffer objects under the same
names (so checkpoint keys do not change), its submodules, its hooks and every other attribute (a
subclass's extra settings, bitsandbytes' quantization state). Only the containers that the LoRA layer adds
entries to are new dictionaries; the values in them are shared. :func:`strip_to` goes the other way,
for ``merge_and_unload``.

Two things on an instance can make a clone compute something else than the class says:

* an instance-level ``forward`` (what accelerate's ``add_hook_to_module`` installs): the wrapper is bound
  to the old object. accelerate's hook is moved onto the clone with accelerate's own function; any other
  instance-level ``forward`` is refused, because loragen cannot know what it computes.
* a module whose parametrization (``torch.nn.utils.parametrize``) computes ``weight``: training works, but
  merging into a computed weight is refused by the layer itself.
"""

from __future__ import annotations

from typing import Any, TypeVar

from torch import nn

from loragen.errors import LoraConversionError

__all__ = ["clone_as", "strip_to"]

M = TypeVar("M", bound=nn.Module)

# The containers of nn.Module state that a LoRA layer adds to (or removes from): copied, not shared.
_OWN_CONTAINERS = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set")
# What accelerate's add_hook_to_module puts on an instance.
_ACCELERATE_ATTRS = ("forward", "_old_forward", "_hf_hook")


def clone_as(module: nn.Module, cls: type[M]) -> M:
    """A new ``cls`` object holding ``module``'s state (parameters, buffers, submodules, hooks and
    attributes shared, not copied).

    ``cls`` must be ``type(module)`` itself, a subclass of it, or a class with the same instance layout
    (a LoRA class built on the module's class, or the reverse for :func:`strip_to`).

    Raises:
        LoraConversionError: the module's ``forward`` is replaced on the instance by something other than
            accelerate's hook.
    """
    state = dict(module.__dict__)
    hook = state.get("_hf_hook")
    if "forward" in state and hook is None:
        raise LoraConversionError(
            f"{type(module).__qualname__} has an instance-level forward ({state['forward']!r}) in place of "
            "its class's forward; loragen cannot tell what it computes. Remove the override before converting"
        )
    if hook is not None:
        for name in _ACCELERATE_ATTRS:
            state.pop(name, None)
    for name in _OWN_CONTAINERS:
        if name in state:
            state[name] = type(state[name])(state[name])
    clone = cls.__new__(cls)
    clone.__dict__.update(state)
    if hook is not None:
        _move_accelerate_hook(clone, hook)
    return clone


def _move_accelerate_hook(module: nn.Module, hook: Any) -> None:
    """Install accelerate's ``hook`` on ``module`` the way accelerate does (it wraps the class forward)."""
    from accelerate.hooks import add_hook_to_module  # present: the hook came from it

    add_hook_to_module(module, hook)


def strip_to(
    layer: nn.Module,
    cls: type[M],
    parameters: tuple[str, ...],
    modules: tuple[str, ...],
    attributes: tuple[str, ...],
) -> M:
    """A ``cls`` object with ``layer``'s state minus the named LoRA ``parameters``, ``modules`` and
    ``attributes``: the base layer a LoRA layer was made from, sharing its weight and every other state."""
    base = clone_as(layer, cls)
    for name in parameters:
        base._parameters.pop(name, None)
    for name in modules:
        base._modules.pop(name, None)
    for name in attributes:
        base.__dict__.pop(name, None)
    return base
