"""``LoraConv1d``, ``LoraConv2d`` and ``LoraConv3d``: convolutions with a LoRA adapter that honours every base
setting."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from loragen.config import InitMode
from loragen.layers.adapter_set import LoraAdapter
from loragen.layers.base import LoraLayer
from loragen.layers.variants import CONV_DORA, Variant

__all__ = ["LoraConv1d", "LoraConv2d", "LoraConv3d"]

PaddingMode = Literal["zeros", "reflect", "replicate", "circular"]


class _LoraConvNd(LoraLayer):
    """Shared code of :class:`LoraConv1d`, :class:`LoraConv2d` and :class:`LoraConv3d` (mixed into the torch conv
    class)."""

    _conv = staticmethod(F.conv2d)
    dora_variant: ClassVar[Variant | None] = CONV_DORA
    # methods of the torch convolution that a subclass must keep to be converted (see subclass_refusal)
    refused_overrides: ClassVar[tuple[str, ...]] = ("forward", "_conv_forward")

    in_channels: int
    out_channels: int
    kernel_size: tuple[int, ...]
    groups: int
    bias: Tensor | None
    lora_A: nn.Parameter
    lora_B: nn.Parameter
    _conv_forward: Callable[[Tensor, Tensor, Tensor | None], Tensor]  # the torch conv class's

    def _lora_conv_init(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, ...],
        stride: int | tuple[int, ...] = 1,
        padding: str | int | tuple[int, ...] = 0,
        dilation: int | tuple[int, ...] = 1,
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
        """The torch conv's constructor plus the LoRA keywords."""
        base = (in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, padding_mode)
        self.base_class.__init__(self, *base, device, dtype)
        self._setup_lora(r, lora_alpha, lora_dropout, use_rslora, init_lora_weights, use_dora)

    @classmethod
    def subclass_refusal(cls, base_type: type[nn.Module]) -> str | None:
        """Why a subclass ``base_type`` of this class's torch convolution gets no LoRA class, or None.

        A subclass that keeps the torch ``forward`` and ``_conv_forward`` converts. One that replaces them is
        refused: peft builds such a layer's LoRA factors as layers of the subclass itself (so its forward, and
        any parameters its constructor adds, act on the factors too), which plain factor convolutions cannot
        reproduce; loading or saving such an adapter could not match peft's.
        """
        if issubclass(base_type, LoraLayer):
            return None
        torch_conv = cls.base_class
        overridden = [m for m in cls.refused_overrides if getattr(base_type, m) is not getattr(torch_conv, m)]
        if not overridden:
            return None
        return (
            f"it overrides {torch_conv.__name__}.{overridden[0]}, and peft builds the LoRA factors of such a "
            f"layer as {base_type.__name__} layers, so that method (and any parameter its constructor adds) "
            "acts on the factors too; loragen's factors are plain convolutions and could not give peft's outputs "
            "or files"
        )

    def _factor_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        a_shape = (self.r, self.in_channels // self.groups, *self.kernel_size)
        return a_shape, (self.out_channels, self.r, *(1,) * len(self.kernel_size))

    def _adapter_output(self, x: Tensor, adapter: LoraAdapter) -> Tensor:
        x_lora = x.to(adapter.factor_a.dtype)
        if adapter.lora_dropout_p > 0:
            x_lora = F.dropout(x_lora, adapter.lora_dropout_p, self.training)
        return self._unscaled_term(x_lora, adapter) * adapter.scaling

    def _lora_conv_repr(self) -> str:
        """The torch conv's repr, then the LoRA settings."""
        return f"{self.base_class.extra_repr(self)}, {self.lora_extra_repr()}"

    def _unscaled_term(self, x_lora: Tensor, adapter: LoraAdapter) -> Tensor:
        """``B A x_lora`` (unscaled) with every base setting."""
        a, b = adapter.factor_a, adapter.factor_b
        if self.groups == 1:
            # A with every base setting, then B as a 1x1 conv: convolving with B @ A through r channels
            return self._conv(self._conv_forward(x_lora, a, None), b)
        # a grouped weight cannot be factored through r channels: the composed B @ A, as merging adds it
        composed = (b.flatten(1) @ a.flatten(1)).view(self.out_channels, *a.shape[1:])
        return self._conv_forward(x_lora, composed, None)


class LoraConv1d(nn.Conv1d, _LoraConvNd):
    """``nn.Conv1d`` with a LoRA adapter. Shapes: x (N, C_in, L) -> y (N, C_out, L_out)."""

    _conv = staticmethod(F.conv1d)
    base_class = nn.Conv1d
    # the torch conv class comes first in the MRO: take the LoRA constructor, forward and repr explicitly
    __init__ = _LoraConvNd._lora_conv_init
    forward = LoraLayer.forward
    extra_repr = _LoraConvNd._lora_conv_repr


class LoraConv2d(nn.Conv2d, _LoraConvNd):
    """``nn.Conv2d`` with a LoRA adapter. Shapes: x (N, C_in, H, W) -> y (N, C_out, H_out, W_out)."""

    _conv = staticmethod(F.conv2d)
    base_class = nn.Conv2d
    __init__ = _LoraConvNd._lora_conv_init
    forward = LoraLayer.forward
    extra_repr = _LoraConvNd._lora_conv_repr


class LoraConv3d(nn.Conv3d, _LoraConvNd):
    """``nn.Conv3d`` with a LoRA adapter (a video model's patch embedding). Shapes: x (N, C_in, D, H, W) ->
    y (N, C_out, D_out, H_out, W_out); lora_A (r, C_in // groups, kD, kH, kW), lora_B (C_out, r, 1, 1, 1)."""

    _conv = staticmethod(F.conv3d)
    base_class = nn.Conv3d
    __init__ = _LoraConvNd._lora_conv_init
    forward = LoraLayer.forward
    extra_repr = _LoraConvNd._lora_conv_repr
