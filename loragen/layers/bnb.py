"""LoRA on bitsandbytes' quantized linears (QLoRA): ``Linear4bit`` (nf4 / fp4, double quantization or not,
any compute dtype) and ``Linear8bitLt``; imported only when a model holds one (extra ``loragen[bnb]``).

Forward: bitsandbytes' forward gives the base output and :func:`loragen.ops.lora_branch` adds the term
onto it in place; as in peft the term runs in the adapter's float32, is cast to the output's dtype,
scaled and added. Merging dequantizes, adds ``scaling * B @ A`` and re-quantizes as peft does, warning
what the rounding cost (:class:`loragen.errors.RequantizationWarning`); unmerging puts the original
quantized weight back bit for bit (peft re-quantizes a second time).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import bitsandbytes as bnb
import torch
from torch import Tensor

from loragen.config import InitMode
from loragen.errors import LoraMergeError, RequantizationWarning
from loragen.layers.adapter_set import LoraAdapter
from loragen.layers.base import LoraLayer
from loragen.layers.linear import LoraLinearMixin
from loragen.layers.variants import LORA
from loragen.ops import lora_branch
from loragen.reference import lora_term

__all__ = ["LoraLinear4bit", "LoraLinear8bitLt", "QuantizedLoraMixin", "RequantizationWarning"]


class QuantizedLoraMixin(LoraLinearMixin):
    """LoRA on a quantized linear; subclasses say how their weight is dequantized and quantized again."""

    _lora_attributes = (*LoraLinearMixin._lora_attributes, "_unmerged_state")

    # what unmerge() restores: the original quantized weight's state, while merged
    _unmerged_state: tuple[Any, ...] | None = None

    def _adapter_output(self, x: Tensor, adapter: LoraAdapter) -> Tensor:
        # peft's order: the term in the adapter's dtype, cast to the output's (x's) dtype, then scaled
        a, b, s, p = adapter.factor_a, adapter.factor_b, adapter.scaling, adapter.lora_dropout_p
        return lora_term(x, a, b, s, p, self.training, dtype=x.dtype)

    def _adapted_output(self, x: Tensor, adapter: LoraAdapter) -> Tensor:
        """bitsandbytes' forward plus the term added in place (:func:`loragen.ops.lora_branch`); with
        :attr:`fused` off or a DoRA adapter, peft's composition."""
        if not (self.fused and adapter.variant is LORA):
            return LoraLayer._adapted_output(self, x, adapter)
        a, b, s, p = adapter.factor_a, adapter.factor_b, adapter.scaling, adapter.lora_dropout_p
        return lora_branch(self._base_output(x), x, a, b, s, p, self.training)

    def dequantized_weight(self) -> Tensor:
        """The weight as bitsandbytes' kernels see it: (out, in), float32."""
        raise NotImplementedError

    def _snapshot(self) -> tuple[Any, ...]:
        """What :meth:`_restore` needs to put the current quantized weight back exactly."""
        raise NotImplementedError

    def _restore(self, snapshot: tuple[Any, ...]) -> None:
        raise NotImplementedError

    def _quantize_into(self, dense: Tensor) -> None:
        """Replace the weight with ``dense`` (out, in) quantized in the layer's own format."""
        raise NotImplementedError

    def quantization_name(self) -> str:
        """The format in words, for messages (``"nf4 (double quantization)"``, ``"int8"``)."""
        raise NotImplementedError

    def _check_mergeable(self) -> None:
        LoraLayer._check_mergeable(self)  # the probe of LoraLinearMixin cannot read a quantized weight

    def _merge_adapter(self, adapter: LoraAdapter) -> None:
        """Dequantize, add ``scaling * B @ A`` in float32 and quantize again in the layer's format; warns
        (:class:`RequantizationWarning`) with the rounding that adds. Unmerging restores the original."""
        snapshot = self._snapshot()
        delta = self.delta_weight_of(adapter).float()
        exact = self.dequantized_weight().add_(delta)
        self._quantize_into(exact)
        error = (self.dequantized_weight() - exact).abs().max().item() if exact.numel() else 0.0
        self._unmerged_state = snapshot
        self.merged = True  # before warning: a warning raised as an error leaves a merged layer
        update = delta.abs().max().item() if delta.numel() else 0.0
        in_features, out_features = self._features()
        warnings.warn(
            f"merging LoRA into {type(self).__qualname__} ({out_features}x{in_features}, "
            f"{self.quantization_name()}) re-quantizes the merged weight: it differs from the exact "
            f"W + scaling * B @ A by up to {error:.3g} (max abs error; the LoRA update's largest entry is "
            f"{update:.3g}). Merged outputs differ from unmerged ones by that rounding; unmerge() restores "
            "the original quantized weight exactly",
            RequantizationWarning,
            stacklevel=5,  # the caller of merge(), past no_grad and the merge guard
        )

    def _unmerge_adapter(self, name: str) -> None:
        """Put back the quantized weight held before merging, bit for bit (peft instead re-quantizes the
        merged weight minus the update, a second rounding)."""
        if self._unmerged_state is None:
            raise LoraMergeError(
                f"cannot unmerge {type(self).__qualname__}: the weight was merged before this layer held it "
                "(the original quantized weight is not known); reload the base model instead"
            )
        self._restore(self._unmerged_state)
        self._unmerged_state = None


class LoraLinear4bit(QuantizedLoraMixin, bnb.nn.Linear4bit):
    """``bitsandbytes.nn.Linear4bit`` with a LoRA adapter: ``Linear4bit``'s constructor plus the LoRA keywords.
    Shapes: x (..., in) -> y (..., out); lora_A (r, in), lora_B (out, r), float32."""

    base_class = bnb.nn.Linear4bit

    def __init__(
        self,
        input_features: int,
        output_features: int,
        bias: bool = True,
        compute_dtype: torch.dtype | None = None,
        compress_statistics: bool = True,
        quant_type: str = "fp4",
        quant_storage: torch.dtype = torch.uint8,
        device: torch.device | str | None = None,
        *,
        r: int = 8,
        lora_alpha: float = 8,
        lora_dropout: float = 0.0,
        use_rslora: bool = False,
        init_lora_weights: InitMode = True,
    ) -> None:
        super().__init__(
            input_features,
            output_features,
            bias,
            compute_dtype,
            compress_statistics,
            quant_type,
            quant_storage,
            device,
        )
        self._setup_lora(r, lora_alpha, lora_dropout, use_rslora, init_lora_weights)

    def _quant_state(self) -> Any:
        state = getattr(self.weight, "quant_state", None) or getattr(self, "quant_state", None)
        if state is None:
            raise LoraMergeError(
                f"cannot merge into {type(self).__qualname__}: its weight is not quantized yet (no quant_state); "
                "move the layer to a device first, as bitsandbytes requires"
            )
        return state

    def _packed(self) -> tuple[Tensor, Any]:
        """The packed weight and its quant state in bitsandbytes' canonical layout."""
        data, state = self.weight.data, self._quant_state()
        if getattr(state, "packing_format_for_cpu", False):
            # bitsandbytes repacks a weight in place for AVX512-BF16 CPUs at its first no-grad eval forward;
            # its inverse rewrites the state it is given, so it gets a copy
            from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse

            data, state = _convert_weight_packed_for_cpu_inverse(data, copy.deepcopy(state))
        return data, state

    def dequantized_weight(self) -> Tensor:
        data, state = self._packed()
        return bnb.functional.dequantize_4bit(data, state).float()

    def quantization_name(self) -> str:
        state = self._quant_state()
        return f"{state.quant_type}" + (" (double quantization)" if state.nested else "")

    def _snapshot(self) -> tuple[Any, ...]:
        return (self.weight,)

    def _restore(self, snapshot: tuple[Any, ...]) -> None:
        (weight,) = snapshot
        self.weight = weight
        self.quant_state = weight.quant_state

    def _quantize_into(self, dense: Tensor) -> None:
        data, state = self._packed()
        settings: dict[str, Any] = {
            "blocksize": state.blocksize,
            "compress_statistics": state.nested,
            "quant_type": state.quant_type,
            "quant_storage": getattr(self.weight, "quant_storage", data.dtype),
        }
        dense = dense.to(data.device, state.dtype)  # the dtype the weight was quantized from
        packed, new_state = bnb.functional.quantize_4bit(dense, **settings)
        self.weight = bnb.nn.Params4bit(
            packed, requires_grad=False, quant_state=new_state, module=self, bnb_quantized=True, **settings
        )
        self.quant_state = new_state


class LoraLinear8bitLt(QuantizedLoraMixin, bnb.nn.Linear8bitLt):
    """``bitsandbytes.nn.Linear8bitLt`` (LLM.int8()) with a LoRA adapter: its constructor plus the LoRA
    keywords. Shapes: x (..., in) -> y (..., out); lora_A (r, in), lora_B (out, r), float32."""

    base_class = bnb.nn.Linear8bitLt

    def __init__(
        self,
        input_features: int,
        output_features: int,
        bias: bool = True,
        has_fp16_weights: bool = True,
        threshold: float = 0.0,
        index: Any = None,
        device: torch.device | str | None = None,
        *,
        r: int = 8,
        lora_alpha: float = 8,
        lora_dropout: float = 0.0,
        use_rslora: bool = False,
        init_lora_weights: InitMode = True,
    ) -> None:
        super().__init__(input_features, output_features, bias, has_fp16_weights, threshold, index, device)
        self._setup_lora(r, lora_alpha, lora_dropout, use_rslora, init_lora_weights)

    def _int8(self) -> tuple[Tensor, Tensor]:
        """The int8 weight (out, in) and its per-row scales (out,)."""
        weight = self.weight
        if weight.dtype != torch.int8:
            raise LoraMergeError(
                f"cannot merge into {type(self).__qualname__}: its weight is {weight.dtype}, not int8 "
                "(has_fp16_weights=True, or not moved to a device yet); loragen merges into quantized "
                "weights only"
            )
        scales = self.state.SCB if self.state.SCB is not None else getattr(weight, "SCB", None)
        if scales is None:
            raise LoraMergeError(
                f"cannot merge into {type(self).__qualname__}: its int8 weight has no scales (SCB)"
            )
        return weight.data, scales

    def dequantized_weight(self) -> Tensor:
        data, scales = self._int8()
        return bnb.functional.int8_vectorwise_dequant(data, scales.to(data.device)).float()

    def quantization_name(self) -> str:
        return "int8"

    def _snapshot(self) -> tuple[Any, ...]:
        return self._int8()

    def _restore(self, snapshot: tuple[Any, ...]) -> None:
        self._set_int8(*snapshot)

    def _set_int8(self, data: Tensor, scales: Tensor) -> None:
        self.weight = bnb.nn.Int8Params(
            data, requires_grad=False, has_fp16_weights=False, CB=data, SCB=scales
        )
        self.state.reset_grads()  # forward moves CB/SCB from the new weight into the state

    def _quantize_into(self, dense: Tensor) -> None:
        data, _ = self._int8()
        # as Int8Params quantizes a weight it is given: through float16, row-wise absmax scales
        quantized, scales, _ = bnb.functional.int8_vectorwise_quant(
            dense.to(device=data.device, dtype=torch.float16)
        )
        self._set_int8(quantized, scales)
