"""LoRA on linear layers: ``nn.Linear``, its subclasses, and layers that behave like a Linear.

:class:`LoraLinearMixin` holds the LoRA behaviour of every layer whose weight is a Linear weight (stored
``(out, in)``, or ``(in, out)`` for the TRANSPOSED layout of transformers' ``Conv1D``); a LoRA class is the
mixin plus the base class. Two kinds of base, told apart once per class (:attr:`LoraLinearMixin.fused_base`):

* the base's ``forward`` is ``nn.Linear``'s own (or ``Conv1D``'s): the whole layer runs as loragen's
  fused LoRA op (:func:`loragen.ops.lora_linear`), which computes ``x W^T + b`` and the LoRA term together
  and shares the rank-r down-projection with siblings that read the same input;
* any other ``forward`` (a subclass such as Falcon's ``FalconLinear``, a quantized layer, a user's layer):
  the base output is the base's own ``forward``, and the LoRA term ``scaling * B A dropout(x)`` is added
  to it.
"""

from __future__ import annotations

from typing import ClassVar, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from loragen.errors import LoraMergeError
from loragen.layers import adapter_routing
from loragen.layers.adapter_set import Factors
from loragen.layers.base import InitMode, LoraLayer
from loragen.layers.dora import MAGNITUDE
from loragen.ops import lora_linear, lora_linear_reference, siblings
from loragen.ops.dora import dora_linear, dora_linear_reference
from loragen.registry import PLAIN, TRANSPOSED, LayerSpec, register

__all__ = ["LoraLinear", "LoraLinearMixin"]


class LoraLinearMixin(LoraLayer):
    """LoRA on a layer whose weight is a Linear weight. Shapes: x (..., in) -> y (..., out);
    lora_A (r, in), lora_B (out, r).

    ``in_features`` / ``out_features`` are the base's attributes when it has them, else read from the
    weight (``(out, in)``; ``(in, out)`` in the TRANSPOSED layout). Set ``fused = False`` on a layer to
    run peft's plain composition instead of the fused op.
    """

    lora_A: nn.Parameter
    lora_B: nn.Parameter
    lora_magnitude_vector: nn.Parameter  # with use_dora only

    fused: bool = True
    supports_dora = True  # loragen.layers.dora
    # True when the base class's forward is exactly x W^T + b as nn.Linear (or Conv1D) computes it
    fused_base: ClassVar[bool] = True
    # base forwards known to compute exactly x W^T + b (the fused op replaces them)
    linear_forwards: ClassVar[set[object]] = {nn.Linear.forward}

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        base_forward = next(
            (
                vars(c)["forward"]
                for c in cls.__mro__
                if "forward" in vars(c) and not issubclass(c, LoraLayer)
            ),
            None,
        )
        cls.fused_base = base_forward in LoraLinearMixin.linear_forwards

    def _bias(self) -> Tensor | None:
        return cast("Tensor | None", self.bias)

    def _features(self) -> tuple[int, int]:
        """``(in_features, out_features)``."""
        in_features = getattr(self, "in_features", None)
        out_features = getattr(self, "out_features", None)
        if isinstance(in_features, int) and isinstance(out_features, int):
            return in_features, out_features
        rows, cols = self.weight.shape[:2]
        return (rows, cols) if self.layout is TRANSPOSED else (cols, rows)

    def _factor_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        in_features, out_features = self._features()
        return (self.r, in_features), (out_features, self.r)

    def forward(self, x: Tensor) -> Tensor:
        if self._lora_detour:  # another adapter active, adapters off, or a mixed batch
            return adapter_routing.forward(self, x)
        if not self.fused_base:
            return self._forward_with_branch(x)
        transposed = self.layout is TRANSPOSED
        if self.merged:
            return F.linear(x, self.weight.t() if transposed else self.weight, self._bias())
        if self.use_dora:  # DoRA: the fused DoRA op (loragen.ops.dora), or peft's composition
            dora = dora_linear if self.fused else dora_linear_reference
            return dora(
                x,
                self.weight,
                self._bias(),
                self.lora_A,
                self.lora_B,
                self.lora_magnitude_vector,
                self.scaling,
                self.lora_dropout_p,
                self.training,
                fan_in_fan_out=transposed,
            )
        if self.fused:
            y = siblings.forward(self, x)  # shares its down-projection with siblings reading x
            if y is not None:
                return y
        fn = lora_linear if self.fused else lora_linear_reference
        return fn(
            x,
            self.weight,
            self._bias(),
            self.lora_A,
            self.lora_B,
            self.scaling,
            self.lora_dropout_p,
            self.training,
            fan_in_fan_out=transposed,
        )

    def _forward_with_branch(self, x: Tensor) -> Tensor:
        """The base's own forward plus ``scaling * B A dropout(x)``, the LoRA term in the adapter's dtype."""
        result: Tensor = super().forward(x)  # the base class's forward, next in the MRO
        if self.merged:
            return result
        if self.use_dora:  # peft's DoRA on the base's own output
            return self._dora_output(x, self, result)
        return (result + self._lora_term(x, self)).to(result.dtype)

    def _lora_term(self, x: Tensor, factors: Factors) -> Tensor:
        x_lora = x.to(factors.factor_a.dtype)
        if factors.lora_dropout_p > 0 and self.training:
            x_lora = F.dropout(x_lora, factors.lora_dropout_p, True)
        return F.linear(F.linear(x_lora, factors.factor_a), factors.factor_b) * factors.scaling

    def _dora_output(self, x: Tensor, factors: Factors, result: Tensor) -> Tensor:
        """peft's DoRA composition on the base output ``result`` (a base with its own forward)."""
        return dora_linear_reference(
            x,
            self.weight,
            self._bias(),
            factors.factor_a,
            factors.factor_b,
            getattr(factors, MAGNITUDE),
            factors.scaling,
            factors.lora_dropout_p,
            self.training,
            fan_in_fan_out=self.layout is TRANSPOSED,
            result=result,
        )

    def _check_mergeable(self) -> None:
        super()._check_mergeable()
        if self.fused_base:
            return
        # A base with its own forward: merging is exact only if that forward is x W^T + b of the stored
        # weight. Check on a small probe rather than assume it.
        weight = self.weight
        if not weight.dtype.is_floating_point:
            raise LoraMergeError(
                f"cannot merge into {type(self).__qualname__}: its weight is stored as {weight.dtype}, not as "
                "floating-point values an update can be added to"
            )
        in_features, _ = self._features()
        probe = torch.randn(3, in_features, generator=torch.Generator().manual_seed(0)).to(weight)
        with torch.no_grad():
            merged = self.merged
            self.merged = True  # the base forward alone
            try:
                actual = self._forward_with_branch(probe)
            finally:
                self.merged = merged
            expected = F.linear(probe, weight.t() if self.layout is TRANSPOSED else weight, self._bias())
        if actual.shape != expected.shape or not torch.allclose(actual, expected, rtol=1e-3, atol=1e-4):
            raise LoraMergeError(
                f"cannot merge into {type(self).__qualname__}: its forward does not compute x W^T + b from its "
                "stored weight (checked on a probe input), so adding B A to the weight would change what the "
                "layer computes. Keep the adapter unmerged"
            )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {self.lora_extra_repr()}"


class LoraLinear(LoraLinearMixin, nn.Linear):
    """``nn.Linear`` with a LoRA adapter. Shapes: x (..., in) -> y (..., out).

    The constructor is ``nn.Linear``'s plus the LoRA keywords: ``nn.Linear(i, o)`` ->
    ``LoraLinear(i, o, r=8)``. The forward runs the fused LoRA op (:func:`loragen.ops.lora_linear`),
    sharing the rank-r down-projection with sibling layers that read the same input
    (:mod:`loragen.ops.siblings`).
    """

    base_class = nn.Linear

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        r: int = 8,
        lora_alpha: float = 8,
        lora_dropout: float = 0.0,
        use_rslora: bool = False,
        init_lora_weights: InitMode = True,
        use_dora: bool = False,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._setup_lora(r, lora_alpha, lora_dropout, use_rslora, init_lora_weights, use_dora)


register(
    LayerSpec(
        "torch.nn.Linear",
        "loragen.layers.LoraLinear",
        ("torch.nn.modules.linear.Linear",),
        PLAIN,
        linear=True,
        subclasses=True,
        lora_class=LoraLinear,
    )
)
