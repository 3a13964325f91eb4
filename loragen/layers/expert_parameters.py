"""LoRA on parameters a module reads itself (``LoraConfig.target_parameters``): MoE expert stacks such as
transformers 5's ``gate_up_proj (E, 2*I, H)`` / ``down_proj (E, H, I)``, with peft's math and format.

The converted module is the experts module itself, of a LoRA class derived from its own class (keys,
attributes and ``forward`` stay), with one :class:`ParameterLora` per targeted parameter under
``lora_targets.<name>``. During the forward the module reads each one as ``W + scaling * B_e @ A_e``, all
experts in one ``baddbmm`` (:func:`effective_weight`; no dropout, as in peft), so every experts
implementation works without routing code of loragen's; merging adds the same update. With
:data:`loragen.switches.fused` on, :func:`recompute_on_backward` saves ``W``, ``A``, ``B`` in place of the
effective weight and rebuilds it once in the backward. In an adapter file the factors of a module's
``k``-th of ``n`` targets are ``<module>.{"base_layer." * (n-1-k)}lora_A.weight``, as peft's nested
``ParamWrapper`` saves them.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize
from typing_extensions import Self

from loragen import switches
from loragen.config import InitMode, check_lora_args
from loragen.errors import LoraConversionError, LoraMergeError, MixedBatchError
from loragen.layers.adapter_set import DEFAULT_ADAPTER, LoraAdapter, adapter_dtype_for, lora_scaling
from loragen.layers.base import LoraLayer, clone_as, reading
from loragen.layers.registration import derive_lora_class
from loragen.layers.variants import LORA, Variant
from loragen.layouts import EXPERTS, EXPERTS_TRANSPOSED, PLAIN, Layout, ParameterLayout

__all__ = [
    "LoraParametersLayer",
    "ParameterLora",
    "effective_weight",
    "lora_parameters_class",
    "recompute_on_backward",
    "scaling_owners",
]

TARGETS = "lora_targets"


class ParameterLora(nn.Module):
    """The LoRA factors of one targeted parameter: ``lora_A (r*E, in)``, ``lora_B (out, r*E)``, with its own
    ``r``, ``lora_alpha``, ``use_rslora``, ``scaling``, ``layout`` and ``num_experts`` (1 for a 2-D one)."""

    def __init__(
        self,
        name: str,
        weight: Tensor,
        layout: ParameterLayout,
        r: int,
        lora_alpha: float,
        use_rslora: bool,
        init_lora_weights: InitMode,
    ) -> None:
        super().__init__()
        check_lora_args(r, lora_alpha, 0.0, use_rslora, init_lora_weights)
        self.parameter_name = name
        self.layout = layout
        self.num_experts = layout.features(tuple(weight.shape))[0]
        self.r, self.lora_alpha, self.use_rslora = r, lora_alpha, bool(use_rslora)
        self.scaling = lora_scaling(r, lora_alpha, use_rslora)
        a_shape, b_shape = layout.factor_shapes(tuple(weight.shape), r)
        kwargs: dict[str, Any] = {"device": weight.device, "dtype": adapter_dtype_for(weight.dtype)}
        self.lora_A = nn.Parameter(torch.empty(a_shape, **kwargs))
        self.lora_B = nn.Parameter(torch.empty(b_shape, **kwargs))
        if weight.device.type != "meta":
            self.reset(init_lora_weights)

    @torch.no_grad()
    def reset(self, init_lora_weights: InitMode = True) -> None:
        """(Re)initialise as peft does (A kaiming-uniform or ``"gaussian"``, B zeros; ``False``: both random)."""
        PLAIN.init_factors(self.lora_A, self.lora_B, self.r, init_lora_weights)

    def delta(self, weight: Tensor) -> Tensor:
        """``scaling * B_e @ A_e`` shaped like ``weight``, in float32 (float64 for a float64 weight)."""
        dtype = torch.promote_types(weight.dtype, torch.float32)
        return (
            self.layout.delta(self.lora_A.to(dtype), self.lora_B.to(dtype), tuple(weight.shape))
            * self.scaling
        )

    def extra_repr(self) -> str:
        return (
            f"{self.parameter_name}: experts={self.num_experts}, r={self.r}, "
            f"lora_alpha={self.lora_alpha:g}, scaling={self.scaling:g}"
        )


class LoraParametersLayer(LoraLayer):
    """A module whose targeted parameters carry LoRA factors (mixed into the module's own class).

    It holds one adapter, itself (:func:`loragen.layers.adapter_set.adapter_factors` returns it); its
    ``r``, ``lora_alpha``, ``scaling`` and ``use_rslora`` are its first target's (``rank_pattern`` /
    ``alpha_pattern`` can give each target its own, keyed by the parameter's full name).
    """

    # its one adapter's settings, plain attributes here (a factor layer reads them from its first adapter)
    r: int = 0
    lora_alpha: float = 0.0
    scaling: float = 0.0
    lora_dropout_p: float = 0.0
    use_rslora: bool = False
    adapter_name: str = DEFAULT_ADAPTER
    variant: Variant = LORA  # plain LoRA in weight space
    _lora_modules = (TARGETS,)

    # one adapter only, itself, with factors per target: the single-adapter contract refuses
    def _factor_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        raise self._one_adapter_only()

    def _adapter_output(self, x: Tensor, adapter: LoraAdapter) -> Tensor:
        raise self._one_adapter_only()

    @property
    def factor_a(self) -> nn.Parameter:
        raise self._one_adapter_only()

    factor_b = factor_a

    def _one_adapter_only(self) -> LoraConversionError:
        return LoraConversionError(
            f"{type(self).__qualname__} holds LoRA on parameters ({', '.join(self.parameter_targets)}), one "
            "adapter only: a further named adapter cannot target them"
        )

    @property
    def layout(self) -> Layout:
        """PLAIN: the factors' names and peft suffixes (each target has its own layout for the maths)."""
        return PLAIN

    @property
    def parameter_targets(self) -> dict[str, ParameterLora]:
        """``{parameter name: its factors}`` in the module's registration order."""
        holders = cast(nn.ModuleDict, self._modules[TARGETS])
        return {name: cast(ParameterLora, holder) for name, holder in holders.items()}

    @classmethod
    def from_parameters(
        cls,
        base: nn.Module,
        targets: dict[str, tuple[int, float]],
        *,
        use_rslora: bool = False,
        init_lora_weights: InitMode = True,
    ) -> Self:
        """The LoRA module for ``base`` with factors on the parameters ``targets`` names, ``{name: (r, lora_alpha)}``,
        taking over ``base``'s state.

        Raises:
            LoraConversionError: a name is not a 2-D or 3-D parameter of ``base``.
        """
        layer = clone_as(base, cls)
        layer._init_lora_state()
        layout = EXPERTS_TRANSPOSED if getattr(base, "is_transposed", False) is True else EXPERTS
        holders = nn.ModuleDict()
        for name in (n for n, _ in base.named_parameters(recurse=False) if n in targets):
            weight = base._parameters[name]
            if weight is None or weight.dim() not in (2, 3):
                raise LoraConversionError(
                    f"{name} of {type(base).__qualname__} is not a 2-D or 3-D parameter"
                )
            r, alpha = targets[name]
            holders[name] = ParameterLora(name, weight, layout, r, alpha, use_rslora, init_lora_weights)
        missing = sorted(set(targets) - set(holders))
        if missing:
            raise LoraConversionError(f"{type(base).__qualname__} has no parameter {', '.join(missing)}")
        layer._modules[TARGETS] = holders
        first = cast(ParameterLora, next(iter(holders.values())))
        layer.r, layer.lora_alpha, layer.scaling = first.r, first.lora_alpha, first.scaling
        layer.use_rslora, layer.lora_dropout_p = bool(use_rslora), 0.0
        return layer

    def lora_parameters(self) -> dict[str, nn.Parameter]:
        """``{"lora_targets.<name>.lora_A": ..., ...}``: the factors by their keys below this module."""
        return {
            f"{TARGETS}.{name}.{attr}": getattr(target, attr)
            for name, target in self.parameter_targets.items()
            for attr in ("lora_A", "lora_B")
        }

    def peft_key_suffixes(self) -> dict[str, str]:
        """Attribute path -> peft's key suffix, ``[base_layer.]*lora_A.weight`` (module docstring)."""
        names = list(self.parameter_targets)
        return {
            f"{TARGETS}.{name}.{attr}": "base_layer." * (len(names) - 1 - i) + f"{attr}.weight"
            for i, name in enumerate(names)
            for attr in ("lora_A", "lora_B")
        }

    def reset_lora_parameters(self, init_lora_weights: InitMode = True) -> None:
        """(Re)initialise every target's factors (see :meth:`ParameterLora.reset`)."""
        for target in self.parameter_targets.values():
            target.reset(init_lora_weights)

    @reading
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The module's own forward, reading ``W + scaling * B_e @ A_e`` for each targeted parameter ``W`` (merged,
        disabled or another adapter's turn: the stored parameters).

        Raises:
            MixedBatchError: inside ``loragen.mixed_batch`` (rows cannot take different weight updates).
        """
        if self.mixed_route is not None:
            raise MixedBatchError(
                f"{type(self).__qualname__}: a mixed batch (loragen.mixed_batch) cannot route rows through LoRA on "
                "parameters, whose update applies to the whole weight (peft refuses it too); run one adapter per batch"
            )
        if self.running_adapter() is None:
            return self.base_class.forward(self, *args, **kwargs)
        recipes = {
            name: (cast(Tensor, self._parameters[name]), t.lora_A, t.lora_B, t.scaling, t.layout)
            for name, t in self.parameter_targets.items()
        }
        made = {name: effective_weight(*recipe) for name, recipe in recipes.items()}
        saving = (
            recompute_on_backward({made[name]: recipe for name, recipe in recipes.items()})
            if switches.fused.get()
            else contextlib.nullcontext()
        )
        with saving, _shadowed(self, made):
            return self.base_class.forward(self, *args, **kwargs)

    def _check_mergeable(self) -> None:
        for name in self.parameter_targets:
            weight = self._parameters[name]
            if (
                parametrize.is_parametrized(self, name)
                or weight is None
                or not weight.dtype.is_floating_point
            ):
                raise LoraMergeError(
                    f"cannot merge into {name} of this {type(self).__qualname__}: it is not a stored floating-point "
                    "parameter (a parametrization computes it, or it is quantized)"
                )

    def running_adapter(self) -> Any:
        """Itself, its one adapter, when that is active and not merged; else None."""
        return None if self.merged or self.active_adapter != self.adapter_name else self

    def _merge_adapter(self, adapter: Any) -> None:
        self._add_deltas(1.0)

    def _unmerge_adapter(self, name: str) -> None:
        self._add_deltas(-1.0)

    def _add_deltas(self, sign: float) -> None:
        for name, target in self.parameter_targets.items():
            w = cast(Tensor, self._parameters[name])
            w.copy_((w.to(torch.promote_types(w.dtype, torch.float32)) + sign * target.delta(w)).to(w.dtype))

    def extra_repr(self) -> str:
        own = super().extra_repr()
        return f"{own}, merged" if own and self.merged else own or ("merged" if self.merged else "")


@contextlib.contextmanager
def _shadowed(module: nn.Module, values: dict[str, Tensor]) -> Iterator[None]:
    """While active, ``module.<name>`` reads ``values[name]`` (from the instance ``__dict__``, which lookup reads
    before ``nn.Module.__getattr__``); the registered parameter and the state dict are untouched."""
    for name, value in values.items():
        object.__setattr__(module, name, value)
    try:
        yield
    finally:
        for name in values:
            module.__dict__.pop(name, None)


def lora_parameters_class(base_type: type[nn.Module]) -> type[LoraParametersLayer]:
    """``class Lora<Base>(LoraParametersLayer, base_type)``, made once per base class
    (:func:`loragen.layers.registration.derive_lora_class`)."""
    if issubclass(base_type, LoraParametersLayer):
        return base_type
    return cast(type[LoraParametersLayer], derive_lora_class(LoraParametersLayer, base_type))


def scaling_owners(path: str, layer: Any) -> Sequence[tuple[str, Any]]:
    """``(config key, owner of r / lora_alpha / use_rslora / scaling)`` for each adapted part of the layer at
    ``path``: the layer, or each targeted parameter (keyed ``<path>.<name>``, as ``rank_pattern`` matches)."""
    if isinstance(layer, LoraParametersLayer):
        return [(f"{path}.{name}", target) for name, target in layer.parameter_targets.items()]
    return [(path, layer)]


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


def _recipe(
    weight: Tensor, a: Tensor, b: Tensor, scaling: float, layout: ParameterLayout
) -> Callable[[], Tensor]:
    """How to rebuild one effective weight in the backward (once, then shared by every saved view)."""
    args = (weight.detach(), a.detach(), b.detach(), scaling, layout)
    return functools.cache(torch.no_grad()(functools.partial(effective_weight, *args)))


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
        w.untyped_storage().data_ptr(): (w.dtype, w.storage_offset(), _recipe(*args))
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
        value = recipe()
        return value.as_strided(size, stride, value.storage_offset() + offset)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
