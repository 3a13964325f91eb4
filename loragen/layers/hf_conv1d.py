"""``LoraConv1D``: transformers' ``Conv1D`` (weight stored (in, out)) with a LoRA adapter.

transformers is optional and slow to import, so the class is built on first use.
"""

from __future__ import annotations

from torch import nn

from loragen.layers.base import InitMode, LoraLayer
from loragen.layers.linear import LoraLinearMixin

__all__ = ["build_lora_conv1d"]


def build_lora_conv1d() -> type[LoraLayer]:
    """The ``LoraConv1D`` class (built once by :mod:`loragen.layers` on first use).

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
        """transformers' ``Conv1D`` (GPT-2's c_attn, c_proj, c_fc) with a LoRA adapter.

        ``Conv1D(nf, nx)`` stores its weight as (nx, nf) = (in, out); the LoRA factors keep the Linear
        orientation, A (r, nx) and B (nf, r), as peft does, so adapters are interchangeable with peft.
        """

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
