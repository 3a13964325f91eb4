"""One tiny-Llama decoder layer, forward + backward: frozen vs peft vs loragen vs loragen's plain
composition, side by side.

The layer of ``bench_llama`` (hidden 512, intermediate 1376, 8 heads; batch 4 x seq 256, fp32; LoRA r=16,
alpha 32 on q, k, v, o, gate, up, down), without the embedding, the head and the optimizer. A step is
~0.1 s instead of ~0.6 s, so many more interleaved rounds fit in a minute and differences of a few
milliseconds stand out of a shared machine's noise.

    python -m benchmarks.bench_decoder            # dropout 0, 100 rounds
    loragen bench decoder [...]                   # the same through the CLI
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

from .bench_llama import TARGETS
from .harness import (
    Variant,
    add_timing_arguments,
    benchmark_main,
    dropout_tables,
    module_tensors,
    plain_composition,
)

__all__ = ["add_arguments", "build_variants", "main", "run"]


class _Layer(nn.Module):
    """A decoder layer with its rotary embeddings fixed: ``forward(x) -> hidden states``."""

    def __init__(self, layer: nn.Module, position_embeddings: tuple[Tensor, Tensor]) -> None:
        super().__init__()
        self.layer = layer
        self.position_embeddings = position_embeddings

    def forward(self, x: Tensor) -> Tensor:
        out = self.layer(x, position_embeddings=self.position_embeddings, attention_mask=None)
        return out[0] if isinstance(out, tuple) else out


def build_variants(
    *,
    hidden: int = 512,
    intermediate: int = 1376,
    heads: int = 8,
    batch: int = 4,
    seq: int = 256,
    dropout: float = 0.0,
    r: int = 16,
    alpha: float = 32,
) -> list[Variant]:
    """The contestants, each on its own copy of one randomly initialised decoder layer."""
    import peft
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    import loragen

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=seq,
    )
    config._attn_implementation = "sdpa"
    x = torch.randn(batch, seq, hidden)
    rotary = LlamaRotaryEmbedding(config)
    position_embeddings = rotary(x, torch.arange(seq)[None].expand(batch, -1))
    base = _Layer(LlamaDecoderLayer(config, 0).train(), position_embeddings)
    grad_out = torch.randn(batch, seq, hidden, generator=torch.Generator().manual_seed(1))

    def make(name: str, model: nn.Module) -> Variant:
        def forward() -> Tensor:
            return model(x.detach().requires_grad_(True))

        def step() -> None:
            for p in model.parameters():
                p.grad = None
            forward().backward(grad_out)

        return Variant(name, step, forward, module_tensors(model))

    config_kwargs = {"r": r, "lora_alpha": alpha, "lora_dropout": dropout, "target_modules": TARGETS}
    lora = loragen.get_lora_model(copy.deepcopy(base), loragen.LoraConfig(**config_kwargs))
    return [
        make("frozen", copy.deepcopy(base).requires_grad_(False)),
        make("peft", peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(**config_kwargs))),
        make("loragen", lora),
        make("loragen unfused", plain_composition(lora)),
    ]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of this benchmark (shared with ``loragen bench decoder``)."""
    add_timing_arguments(parser, rounds=100, warmup=3, quick="hidden 32, seq 8 and 3 rounds", dropout=[0.0])


def _title(shape: Mapping[str, int], p: float) -> str:
    return (
        f"one Llama decoder layer (hidden {shape['hidden']}, intermediate {shape['intermediate']}, "
        f"batch {shape['batch']} x seq {shape['seq']}), fp32, r=16, alpha 32, dropout {p:g}: "
        f"forward + backward"
    )


def run(args: argparse.Namespace) -> str:
    """Run the benchmark for every dropout value; returns the Markdown tables."""
    return dropout_tables(
        args,
        build_variants,
        sizes={"hidden": 512, "intermediate": 1376, "heads": 8, "batch": 4, "seq": 256},
        quick_sizes={"hidden": 32, "intermediate": 64, "heads": 4, "batch": 2, "seq": 8},
        title=_title,
        ratio_to=["frozen", "peft"],
    )


def main(argv: Sequence[str] | None = None) -> int:
    return benchmark_main(
        argv,
        prog="python -m benchmarks.bench_decoder",
        description=__doc__.splitlines()[0],
        add_arguments=add_arguments,
        run=run,
    )


if __name__ == "__main__":
    raise SystemExit(main())
