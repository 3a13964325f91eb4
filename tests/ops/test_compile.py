"""``torch.compile(fullgraph=True)`` over a LoRA model on the CPU: forward and backward trace without a
graph break and give eager's values and gradients (the fused op without dropout, peft's composition with
dropout -- see :func:`loragen.ops.fallback_reason`)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import loragen


class _Tiny(nn.Module):
    """An attention-like block: q, k and v read one input (a sibling group), then an MLP."""

    def __init__(self, d: int = 12) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d, bias=False)
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q(x)
        k = self.k(x)
        v = self.v(x)
        attention = torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v
        return self.down(torch.relu(self.up(attention + x)))


def _model(dropout: float, use_dora: bool) -> nn.Module:
    torch.manual_seed(0)
    config = loragen.LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=dropout,
        target_modules=["q", "k", "v", "up", "down"],
        use_dora=use_dora,
    )
    model = loragen.get_lora_model(_Tiny(), config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.3)  # B = 0 at init would hide the LoRA terms
    return model


def _step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    y = model(x)
    model = getattr(model, "_orig_mod", model)  # what torch.compile wraps: its parameters' own names
    (y * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
    return y.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(("dropout", "use_dora"), [(0.0, False), (0.1, False), (0.1, True)])
def test_a_lora_model_compiles_in_one_graph_and_matches_eager(dropout: float, use_dora: bool) -> None:
    """Before, the first fallback under compile logged its reason: a graph break, which fullgraph refuses."""
    eager = _model(dropout, use_dora)
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, backend="aot_eager", fullgraph=True)
    x = torch.randn(2, 5, 12, generator=torch.Generator().manual_seed(1))
    if dropout:  # the random masks differ between eager and compiled: compare in eval, train runs
        eager.eval(), compiled_model.eval()
    for _ in range(2):  # the second call runs the cached graph
        y_c, grads_c = _step(compiled, x)
        y_e, grads_e = _step(eager, x)
        torch.testing.assert_close(y_c, y_e, rtol=1e-5, atol=1e-5)
        assert grads_c.keys() == grads_e.keys() and any("lora_A" in n for n in grads_c)
        for name, grad in grads_e.items():
            torch.testing.assert_close(grads_c[name], grad, rtol=1e-5, atol=1e-5, msg=name)
    if dropout:
        compiled_model.train()
        y, grads = _step(compiled, x)  # dropout in training traces too (peft's composition)
        assert torch.isfinite(y).all() and all(torch.isfinite(g).all() for g in grads.values())
