"""``LoraLinear``: ``nn.Linear`` with a LoRA adapter, running the fused LoRA op."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from loragen.layers.base import InitMode, LoraLayer, plain_copy, share_base_params
from loragen.ops import lora_linear, lora_linear_reference, siblings
from loragen.registry import PLAIN, LayerSpec, register

__all__ = ["LoraLinear"]


class LoraLinear(nn.Linear, LoraLayer):
    """``nn.Linear`` with a LoRA adapter. Shapes: x (..., in) -> y (..., out).

    The forward runs the fused LoRA op (:func:`loragen.ops.lora_linear`), sharing the rank-r
    down-projection with sibling layers that read the same input (:mod:`loragen.ops.siblings`); set
    ``fused = False`` to run the plain-autograd reference instead.
    """

    fused: bool = True

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
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._setup_lora(r, lora_alpha, lora_dropout, use_rslora, init_lora_weights)

    def _factor_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (self.r, self.in_features), (self.out_features, self.r)

    @classmethod
    def from_module(
        cls,
        base: nn.Linear,
        *,
        r: int = 8,
        lora_alpha: float = 8,
        lora_dropout: float = 0.0,
        use_rslora: bool = False,
        init_lora_weights: InitMode = True,
    ) -> LoraLinear:
        """Wrap an existing ``nn.Linear``, sharing its weight and bias parameters."""
        with torch.device("meta"):
            layer = cls(base.in_features, base.out_features, bias=base.bias is not None, r=r)
        share_base_params(layer, base)
        layer._setup_lora(r, lora_alpha, lora_dropout, use_rslora, init_lora_weights)
        return layer

    def forward(self, x: Tensor) -> Tensor:
        if self.merged:
            return F.linear(x, self.weight, self.bias)
        if self.fused:
            y = siblings.forward(self, x)  # shares its down-projection with siblings reading x
            if y is not None:
                return y
        fn = lora_linear if self.fused else lora_linear_reference
        return fn(
            x, self.weight, self.bias, self.lora_A, self.lora_B, self.scaling, self.lora_dropout_p, self.training
        )

    def to_base(self) -> nn.Linear:
        return plain_copy(nn.Linear, self, self.in_features, self.out_features, bias=self.bias is not None)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {self.lora_extra_repr()}"


register(
    LayerSpec(
        "torch.nn.Linear", "loragen.layers.LoraLinear", ("torch.nn.modules.linear.Linear",), PLAIN, linear=True,
        lora_class=LoraLinear,
    )
)
