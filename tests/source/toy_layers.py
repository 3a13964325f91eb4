"""A layer type loragen does not know, with a LoRA class of its own, both defined in a user's module
(this one): the decorator and the rewriter must import the LoRA class from here (the registry's
``lora_module``) and take its keyword defaults from its signature. Registered by the tests that use it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loragen import LoraLayer
from loragen.layers.adapter_set import LoraAdapter


class ToyLinear(nn.Module):
    """``x @ weight.T``, with the weight stored ``(out, in)`` like a Linear's, and no bias."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in) / d_in**0.5)
        self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t()


class ToyLoraLinear(LoraLayer, ToyLinear):
    """``ToyLinear`` with a LoRA branch. Its defaults differ from loragen's (rank 4, dropout 0.1).

    It provides what :class:`loragen.LoraLayer` asks of a layer type, the factors' shapes and the adapter
    term, and nothing else: the forward, several adapters, merging and disabling are loragen's."""

    def __init__(
        self,
        d_in: int,
        d_out: int,
        *,
        r: int = 4,
        lora_alpha: float = 8,
        lora_dropout: float = 0.1,
        use_rslora: bool = False,
        init_lora_weights: bool | str = True,
    ) -> None:
        ToyLinear.__init__(self, d_in, d_out)
        self._setup_lora(r, lora_alpha, lora_dropout, use_rslora, init_lora_weights)  # type: ignore[arg-type]

    def _factor_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        d_out, d_in = self.weight.shape
        return (self.r, d_in), (d_out, self.r)

    def _adapter_output(self, x: torch.Tensor, adapter: LoraAdapter) -> torch.Tensor:
        x = F.dropout(x, adapter.lora_dropout_p, self.training)
        return F.linear(F.linear(x, adapter.factor_a), adapter.factor_b) * adapter.scaling
