"""``LoraConv1D``: transformers' ``Conv1D`` (weight stored (in, out)) with a LoRA adapter.

transformers is optional and slow to import, so the class is built on first use.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from loragen.layers.base import InitMode, LoraLayer, plain_copy, share_base_params
from loragen.ops import lora_linear, lora_linear_reference, siblings

__all__ = ["build_lora_conv1d"]


def build_lora_conv1d() -> type[LoraLayer]:
    try:
        from transformers.pytorch_utils import Conv1D as HFConv1D
    except ImportError as exc:
        raise ImportError(
            "LoraConv1D wraps transformers' Conv1D: install transformers (pip install transformers)"
        ) from exc

    class LoraConv1D(HFConv1D, LoraLayer):  # type: ignore[valid-type,misc]
        """transformers' ``Conv1D`` (GPT-2's c_attn, c_proj, c_fc) with a LoRA adapter.

        ``Conv1D(nf, nx)`` stores its weight as (nx, nf) = (in, out); the LoRA factors keep the Linear
        orientation, A (r, nx) and B (nf, r), as peft does, so adapters are interchangeable with peft.
        """

        fused: bool = True

        def __init__(
            self,
            nf: int,
            nx: int,
            *,
            r: int = 8,
            lora_alpha: float = 8,
            lora_dropout: float = 0.0,
            use_rslora: bool = False,
            init_lora_weights: InitMode = True,
        ) -> None:
            super().__init__(nf, nx)
            self._setup_lora(r, lora_alpha, lora_dropout, use_rslora, init_lora_weights)

        @property
        def in_features(self) -> int:
            return self.nx

        @property
        def out_features(self) -> int:
            return self.nf

        def _factor_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
            return (self.r, self.in_features), (self.out_features, self.r)

        @classmethod
        def from_module(
            cls,
            base: nn.Module,
            *,
            r: int = 8,
            lora_alpha: float = 8,
            lora_dropout: float = 0.0,
            use_rslora: bool = False,
            init_lora_weights: InitMode = True,
        ) -> LoraConv1D:
            """Wrap an existing transformers ``Conv1D``, sharing its weight and bias parameters."""
            nx, nf = base.weight.shape
            with torch.device("meta"):
                layer = cls(nf, nx, r=r)
            share_base_params(layer, base)
            layer._setup_lora(r, lora_alpha, lora_dropout, use_rslora, init_lora_weights)
            return layer

        def forward(self, x: Tensor) -> Tensor:
            if self.merged:
                return HFConv1D.forward(self, x)
            if self.fused:
                y = siblings.forward(self, x)
                if y is not None:
                    return y
            fn = lora_linear if self.fused else lora_linear_reference
            return fn(
                x, self.weight, self.bias, self.lora_A, self.lora_B, self.scaling, self.lora_dropout_p,
                self.training, fan_in_fan_out=True,
            )

        def to_base(self) -> nn.Module:
            nx, nf = self.weight.shape
            return plain_copy(HFConv1D, self, nf, nx)

        __repr__ = nn.Module.__repr__  # Conv1D's own __repr__ would hide the LoRA settings

        def extra_repr(self) -> str:
            return f"nf={self.nf}, nx={self.nx}, {self.lora_extra_repr()}"

    LoraConv1D.__module__ = "loragen.layers"
    LoraConv1D.__qualname__ = "LoraConv1D"
    return LoraConv1D
