"""LoRA on linear layers: ``nn.Linear``, its subclasses, layers that behave like a Linear, and transformers'
``Conv1D`` (:class:`LoraConv1D`, built on first use: transformers is optional and slow to import).

:class:`LoraLinearMixin` is the LoRA behaviour of every layer with a Linear weight (``(out, in)``, or
``(in, out)`` in ``Conv1D``'s TRANSPOSED layout). When the base's ``forward`` is ``nn.Linear``'s own (or
``Conv1D``'s), the whole layer runs as loragen's fused op (:func:`loragen.ops.lora_linear`,
:func:`loragen.ops.dora_linear`); any other ``forward`` (Falcon's ``FalconLinear``, a quantized layer, a
user's layer) gives the base output, and :func:`loragen.reference.lora_term` is added to it.
"""

from __future__ import annotations

from typing import ClassVar, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from loragen.config import InitMode
from loragen.errors import LoraMergeError
from loragen.layers.adapter_set import LoraAdapter
from loragen.layers.base import LoraLayer
from loragen.layers.variants import LINEAR_DORA, LORA, Variant
from loragen.layouts import TransposedLayout
from loragen.ops import dora_linear, lora_linear
from loragen.reference import lora_term

__all__ = ["LoraLinear", "LoraLinearMixin", "build_lora_conv1d"]


class LoraLinearMixin(LoraLayer):
    """LoRA on a layer whose weight is a Linear weight. Shapes: x (..., in) -> y (..., out); lora_A (r, in),
    lora_B (out, r). ``fused = False`` on a layer runs peft's plain composition instead of the fused op."""

    lora_A: nn.Parameter
    lora_B: nn.Parameter

    dora_variant: ClassVar[Variant | None] = LINEAR_DORA
    linear_term = True
    # whether the base class's forward is one known to compute exactly x W^T + b (the fused op replaces it)
    fused_base: ClassVar[bool] = True
    linear_forwards: ClassVar[set[object]] = {nn.Linear.forward}

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        base = [
            vars(c)["forward"] for c in cls.__mro__ if "forward" in vars(c) and not issubclass(c, LoraLayer)
        ]
        cls.fused_base = bool(base) and base[0] in LoraLinearMixin.linear_forwards

    def _features(self) -> tuple[int, int]:
        """``(in_features, out_features)``: the base's attributes, else read from the weight."""
        in_features = getattr(self, "in_features", None)
        out_features = getattr(self, "out_features", None)
        if isinstance(in_features, int) and isinstance(out_features, int):
            return in_features, out_features
        rows, cols = self.weight.shape[:2]
        return (rows, cols) if isinstance(self.layout, TransposedLayout) else (cols, rows)

    def _factor_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        in_features, out_features = self._features()
        return (self.r, in_features), (out_features, self.r)

    def _adapter_output(self, x: Tensor, adapter: LoraAdapter) -> Tensor:
        return lora_term(
            x, adapter.factor_a, adapter.factor_b, adapter.scaling, adapter.lora_dropout_p, self.training
        )

    def _adapted_output(self, x: Tensor, adapter: LoraAdapter) -> Tensor:
        """The fused op (DoRA: the fused DoRA op) when the base is exactly ``x W^T + b`` and :attr:`fused` is on;
        else the base's own output plus the term."""
        if not (self.fused and self.fused_base):
            return super()._adapted_output(x, adapter)
        fan_in_fan_out = isinstance(adapter.layout, TransposedLayout)  # Conv1D stores W as (in, out)
        weights = (self.weight, cast("Tensor | None", self.bias), adapter.factor_a, adapter.factor_b)
        settings = (adapter.scaling, adapter.lora_dropout_p, self.training)
        if adapter.variant is LORA:
            return lora_linear(x, *weights, *settings, fan_in_fan_out=fan_in_fan_out)
        return dora_linear(x, *weights, adapter.magnitude, *settings, fan_in_fan_out=fan_in_fan_out)

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
            actual = self._base_output(probe)
            transposed = isinstance(self.layout, TransposedLayout)
            expected = F.linear(probe, weight.t() if transposed else weight, cast("Tensor | None", self.bias))
        if actual.shape != expected.shape or not torch.allclose(actual, expected, rtol=1e-3, atol=1e-4):
            raise LoraMergeError(
                f"cannot merge into {type(self).__qualname__}: its forward does not compute x W^T + b from its "
                "stored weight (checked on a probe input), so adding B A to the weight would change what the "
                "layer computes. Keep the adapter unmerged"
            )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {self.lora_extra_repr()}"


class LoraLinear(LoraLinearMixin, nn.Linear):
    """``nn.Linear`` with a LoRA adapter: ``nn.Linear(i, o)`` -> ``LoraLinear(i, o, r=8)``.
    Shapes: x (..., in) -> y (..., out)."""

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


def build_lora_conv1d() -> type[LoraLayer]:
    """The ``LoraConv1D`` class (built once, on first use, by :mod:`loragen.layers`).

    Raises:
        ImportError: transformers is not installed.
    """
    try:
        from transformers.pytorch_utils import Conv1D as HFConv1D
    except ImportError as exc:
        raise ImportError(
            "LoraConv1D wraps transformers' Conv1D: install transformers (pip install transformers)"
        ) from exc

    # Conv1D.forward is addmm(b, x, W) with W stored (in, out): x W^T + b in the TRANSPOSED layout
    LoraLinearMixin.linear_forwards.add(HFConv1D.forward)

    class LoraConv1D(LoraLinearMixin, HFConv1D):  # type: ignore[misc]
        """transformers' ``Conv1D`` (GPT-2's c_attn, c_proj, c_fc) with a LoRA adapter: the weight is
        (nx, nf) = (in, out), the factors keep peft's Linear orientation, A (r, nx) and B (nf, r)."""

        base_class = HFConv1D

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
            use_dora: bool = False,
        ) -> None:
            super().__init__(nf, nx)
            self._setup_lora(r, lora_alpha, lora_dropout, use_rslora, init_lora_weights, use_dora)

        @property
        def in_features(self) -> int:
            return int(self.nx)

        @property
        def out_features(self) -> int:
            return int(self.nf)

        __repr__ = nn.Module.__repr__  # Conv1D's own __repr__ would hide the LoRA settings

        def extra_repr(self) -> str:
            return f"nf={self.nf}, nx={self.nx}, {self.lora_extra_repr()}"

    LoraConv1D.__module__ = "loragen.layers"
    LoraConv1D.__qualname__ = "LoraConv1D"
    return LoraConv1D
