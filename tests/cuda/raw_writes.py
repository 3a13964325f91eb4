"""An optimizer that writes parameters as kernels writing through a raw pointer do (bitsandbytes' 8-bit
optimizers): in place, without moving their version counters, so only its step tells a cache."""

from __future__ import annotations

import torch


class RawWriteSGD(torch.optim.Optimizer):
    """Plain SGD, written through ``.data``."""

    def __init__(self, params: list[torch.Tensor], lr: float = 0.5) -> None:
        super().__init__(params, {"lr": lr})

    def step(self, closure: None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                p.data.add_(p.grad, alpha=-group["lr"])
