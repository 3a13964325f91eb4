"""LoRA on targeted parameters (MoE expert stacks) in weight space: the module reads ``W_e + s * B_e @ A_e``.

One ``baddbmm`` makes all ``E`` effective weights, the experts' own backward gives ``dL/dW'`` and two
batched products the factor gradients, so every experts implementation (eager loop, ``batched_mm``,
``grouped_mm``) works without routing code of loragen's. With :data:`loragen.switches.fused` on,
:func:`recompute_on_backward` saves a recipe (``W``, ``A``, ``B``, ``s``) in place of ``W'`` and rebuilds it
once when the backward needs it: no copy of every adapted stack lives from forward to backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from loragen.registry import ParameterLayout

__all__ = ["effective_weight", "recompute_on_backward"]


def effective_weight(weight: Tensor, a: Tensor, b: Tensor, scaling: float, layout: ParameterLayout) -> Tensor:
    """``W + scaling * B_e @ A_e`` for every expert of ``weight`` (2-D or 3-D), in ``weight``'s dtype (factors
    cast first, as peft does; autocast off: the module must see its parameter's own dtype)."""
    shape = tuple(weight.shape)
    experts = layout.features(shape)[0]
    left, right = layout.expert_factors(a.to(weight.dtype), b.to(weight.dtype), experts, weight.dim())
    stacked = weight if weight.dim() == 3 else weight.unsqueeze(0)
    with torch.autocast(device_type=weight.device.type, enabled=False):
        out = torch.baddbmm(stacked, left, right, alpha=scaling)
    return out.view(shape)


class _Recipe:
    """How to rebuild one effective weight in the backward (once, then shared by every saved view)."""

    def __init__(self, weight: Tensor, a: Tensor, b: Tensor, scaling: float, layout: ParameterLayout):
        self.args = (weight.detach(), a.detach(), b.detach(), scaling, layout)
        self.value: Tensor | None = None

    def get(self) -> Tensor:
        if self.value is None:
            with torch.no_grad():
                self.value = effective_weight(*self.args)
        return self.value


class _Outer:
    """A tensor packed by the saved-tensor hooks that were active around :func:`recompute_on_backward`."""

    __slots__ = ("packed",)

    def __init__(self, packed: Any) -> None:
        self.packed = packed


def _outer_hooks() -> tuple[Callable[[Tensor], Any], Callable[[Any], Tensor]] | None:
    """The saved-tensor hooks active now (activation checkpointing's, ``save_on_cpu``'s), or None."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    try:
        return top(False) if top is not None else None
    except TypeError:  # older signature
        return None


@contextlib.contextmanager
def recompute_on_backward(
    recipes: dict[Tensor, tuple[Tensor, Tensor, Tensor, float, ParameterLayout]],
) -> Iterator[None]:
    """While active, tensors autograd saves that live in the storage of one of the effective weights
    (``recipes``' keys, each mapped to the :func:`effective_weight` arguments that made it) are saved as a
    recipe and rebuilt when the backward unpacks them. Every other saved tensor goes to the hooks active
    outside (activation checkpointing still drops it), or is saved as usual. The factors must not change
    between forward and backward, as with activation checkpointing.
    """
    # no reference to the effective weights themselves: autograd keeps the hooks with what it saved
    by_storage = {
        w.untyped_storage().data_ptr(): (w.dtype, w.storage_offset(), _Recipe(*args))
        for w, args in recipes.items()
    }
    outer = _outer_hooks()

    def pack(t: Tensor) -> Any:
        found = None
        if t.layout == torch.strided and t.device.type != "meta":
            found = by_storage.get(t.untyped_storage().data_ptr())
        if found is None or t.dtype != found[0]:
            return t if outer is None else _Outer(outer[0](t))
        return (found[2], tuple(t.shape), tuple(t.stride()), t.storage_offset() - found[1])

    def unpack(packed: Any) -> Tensor:
        if isinstance(packed, _Outer):
            return outer[1](packed.packed) if outer is not None else packed.packed
        if not isinstance(packed, tuple):
            return packed
        recipe, size, stride, offset = packed
        value = recipe.get()
        return value.as_strided(size, stride, value.storage_offset() + offset)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
