"""A small transformer block written the way people write models: the golden input of the code generators.

scripts/regen_golden.py rewrites this file (user_model.rewritten.py) and expands the Block class with
@lora_convert (user_model.Block.expansion.py); tests/source/test_rewrite.py and test_decorator.py check
that the generated code still matches.
"""

import math

import torch
from torch import nn
from torch.nn import Linear as Dense

from loragen import LoraConfig
from loragen.layers import LoraEmbedding, LoraLinear

# Added by loragen rewrite: the LoRA config this file's LoRA layers were written with.
# Classes holding them carry it as `loragen_config` (read by loragen.mark_trainable).
LORA_CONFIG = LoraConfig(
    lora_alpha=16,
    lora_dropout=0.05,
    target_modules=r"(.*\.)?(q_proj|v_proj|fc1|emb|experts\.\d+)",
    rank_pattern={"fc1": 4},
)


class Attention(nn.Module):
    """Multi-head self-attention with separate projections."""

    loragen_config = LORA_CONFIG  # added by loragen rewrite

    def __init__(self, dim: int, heads: int, *, bias: bool = False) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj = LoraLinear(dim, dim, bias=bias, r=8, lora_alpha=16, lora_dropout=0.05)  # queries
        self.k_proj = nn.Linear(dim, dim, bias=bias)
        self.v_proj = LoraLinear(
            dim,
            dim,
            bias=bias,
            r=8,
            lora_alpha=16,
            lora_dropout=0.05,
        )
        self.out_proj = torch.nn.Linear(
            dim, dim
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (p(x).view(b, t, self.heads, d // self.heads).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)  # (B, H, T, T)
        y = att.softmax(-1) @ v
        return self.out_proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Embedding, attention and a gated MLP; the experts are a ModuleList built by a comprehension."""

    loragen_config = LORA_CONFIG  # added by loragen rewrite

    def __init__(self, vocab: int, dim: int, heads: int, experts: int = 2, gated: bool = True) -> None:
        super().__init__()
        self.emb = LoraEmbedding(vocab, dim, r=8, lora_alpha=16, lora_dropout=0.05)
        self.attn = Attention(dim, heads)
        self.experts = nn.ModuleList([LoraLinear(dim, dim, r=8, lora_alpha=16, lora_dropout=0.05) for _ in range(experts)])
        if gated:
            self.fc1 = LoraLinear(dim, 2 * dim, r=4, lora_alpha=16, lora_dropout=0.05)  # value and gate
        else:
            self.fc1 = LoraLinear(dim, dim, r=4, lora_alpha=16, lora_dropout=0.05)
        self.fc2 = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.gated = gated

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        x = x + self.attn(self.norm(x))
        h = self.fc1(x)
        if self.gated:
            value, gate = h.chunk(2, dim=-1)
            h = value * torch.sigmoid(gate)
        x = x + self.fc2(h) + sum(expert(x) for expert in self.experts)
        return self.head(x)
