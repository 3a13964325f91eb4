"""``LoraConv1d`` and ``LoraConv2d``: convolutions with a LoRA adapter that honours every base setting."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from loragen.layers import adapter_routing, dora
from loragen.layers.adapter_set import Factors
from loragen.layers.base import InitMode, LoraLayer
from loragen.registry import PLAIN, LayerSpec, register

__all__ = ["LoraConv1d", "LoraConv2d"]

PaddingMode = Literal["zeros", "reflect", "replicate", "circular"]


class _LoraConvNd(LoraLayer):
    """Shared code of :class:`LoraConv1d` and :class:`LoraConv2d` (mixed into the torch conv class)."""

    _conv = staticmethod(F.conv2d)
    supports_dora = True  # loragen.layers.dora

    in_channels: int
    out_channels: int
    kernel_size: tuple[int, ...]
    groups: int
    bias: Tensor | None
    lora_A: nn.Parameter
    lora_B: nn.Parameter
    lora_magnitude_vector: nn.Parameter  # with use_dora only: (1, cout, 1, ...)
    _conv_forward: Callable[[Tensor, Tensor, Tensor | None], Tensor]  # the torch conv class's

    def _factor_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        ones = (1,) * len(self.kernel_size)
        return (self.r, self.in_channels // self.groups, *self.kernel_size), (
            self.out_channels,
            self.r,
            *ones,
        )

    def _composed_weight(self, factors: Factors | None = None) -> Tensor:
        """``B @ A`` (of ``factors``, default the layer's own) reshaped to the base weight's shape
        (cout, cin // groups, *k), in the adapter dtype."""
        a, b = (self.lora_A, self.lora_B) if factors is None else (factors.factor_a, factors.factor_b)
        return (b.flatten(1) @ a.flatten(1)).view(self.out_channels, *a.shape[1:])

    def forward(self, input: Tensor) -> Tensor:
        x = input
        if self._lora_detour:  # another adapter active, adapters off, or a mixed batch
            return adapter_routing.forward(self, x)
        result = self._conv_forward(x, self.weight, self.bias)
        if self.merged:
            return result
        if self.use_dora:
            return self._dora_output(x, self, result)
        return (result + self._lora_term(x, self)).to(result.dtype)

    def _lora_term(self, x: Tensor, factors: Factors) -> Tensor:
        x_lora = x.to(factors.factor_a.dtype)
        if factors.lora_dropout_p > 0:
            x_lora = F.dropout(x_lora, factors.lora_dropout_p, self.training)
        return self._branch(x_lora, factors) * factors.scaling

    def _branch(self, x_lora: Tensor, factors: Factors) -> Tensor:
        """``B A x_lora`` (unscaled) with every base setting."""
        if self.groups == 1:
            # A with every base setting (stride, padding, dilation, padding mode), then B as a 1x1 conv:
            # the same linear map as convolving with B @ A, through an r-channel bottleneck.
            hidden = self._conv_forward(x_lora, factors.factor_a, None)
            return self._conv(hidden, factors.factor_b)
        # A grouped weight cannot be factored through r channels; convolve with the composed weight.
        return self._conv_forward(x_lora, self._composed_weight(factors), None)

    def _dora_output(self, x: Tensor, factors: Factors, result: Tensor) -> Tensor:
        """peft's DoRA for convolutions: ``result + (c - 1) * base + c * s * lora`` with
        ``c = m / ||W + s B A||`` per output channel (detached), shaped (1, cout, 1, ...); ``base`` is the
        convolution without bias of the input, or of the dropped-out input with dropout."""
        x_lora = x.to(factors.factor_a.dtype)
        dropout = factors.lora_dropout_p > 0 and self.training
        if dropout:
            x_lora = F.dropout(x_lora, factors.lora_dropout_p, True)
        lora = self._branch(x_lora, factors)
        c = getattr(factors, dora.MAGNITUDE) / dora.weight_norm(self, factors)
        if dropout:
            base = self._conv_forward(x_lora, self.weight.to(x_lora.dtype), None)
        elif self.bias is not None:
            base = result - self.bias.view(1, -1, *([1] * (result.dim() - 2)))
        else:
            base = result
        return (result + (c - 1) * base + c * lora * factors.scaling).to(result.dtype)


class LoraConv1d(nn.Conv1d, _LoraConvNd):
    """``nn.Conv1d`` with a LoRA adapter. Shapes: x (N, C_in, L) -> y (N, C_out, L_out)."""

    _conv = staticmethod(F.conv1d)
    base_class = nn.Conv1d

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int],
        stride: int | tuple[int] = 1,
        padding: str | int | tuple[int] = 0,
        dilation: int | tuple[int] = 1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: PaddingMode = "zeros",
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
        super().__init__(
            in_channels,
            out_channels,
            kernel_size,
            stride,
            padding,
            dilation,
            groups,
            bias,
            padding_mode,
            device,
            dtype,
        )
        self._setup_lora(r, lora_alpha, lora_dropout, use_rslora, init_lora_weights, use_dora)

    # the torch conv class comes first in the MRO; take the LoRA forward explicitly
    forward = _LoraConvNd.forward

    def extra_repr(self) -> str:
        return f"{nn.Conv1d.extra_repr(self)}, {self.lora_extra_repr()}"


class LoraConv2d(nn.Conv2d, _LoraConvNd):
    """``nn.Conv2d`` with a LoRA adapter. Shapes: x (N, C_in, H, W) -> y (N, C_out, H_out, W_out)."""

    _conv = staticmethod(F.conv2d)
    base_class = nn.Conv2d

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int],
        stride: int | tuple[int, int] = 1,
        padding: str | int | tuple[int, int] = 0,
        dilation: int | tuple[int, int] = 1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: PaddingMode = "zeros",
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
        super().__init__(
            in_channels,
            out_channels,
            kernel_size,
            stride,
            padding,
            dilation,
            groups,
            bias,
            padding_mode,
            device,
            dtype,
        )
        self._setup_lora(r, lora_alpha, lora_dropout, use_rslora, init_lora_weights, use_dora)

    # the torch conv class comes first in the MRO; take the LoRA forward explicitly
    forward = _LoraConvNd.forward

    def extra_repr(self) -> str:
        return f"{nn.Conv2d.extra_repr(self)}, {self.lora_extra_repr()}"


register(
    LayerSpec(
        "torch.nn.Conv1d",
        "loragen.layers.LoraConv1d",
        ("torch.nn.modules.conv.Conv1d",),
        PLAIN,
        lora_class=LoraConv1d,
    )
)
register(
    LayerSpec(
        "torch.nn.Conv2d",
        "loragen.layers.LoraConv2d",
        ("torch.nn.modules.conv.Conv2d",),
        PLAIN,
        lora_class=LoraConv2d,
    )
)
