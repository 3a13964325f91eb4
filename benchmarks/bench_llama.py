"""A tiny Llama training step: frozen model vs peft vs loragen (fused op, and the plain composition) vs
full fine-tuning, side by side.

Model from config (no download): hidden 512, intermediate 1376, 4 layers, 8 heads, vocab 1000; batch
4 x seq 256, fp32; LoRA r=16, alpha 32 on q, k, v, o, gate, up, down; AdamW step on what trains. The
frozen model trains nothing and takes gradients to its input embeddings only.

    python -m benchmarks.bench_llama                  # dropout 0 and 0.05
    python -m benchmarks.bench_llama --quick          # tiny sizes, a smoke test
    loragen bench llama [...]                         # the same through the CLI
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from .harness import (
    Variant,
    add_timing_arguments,
    benchmark_main,
    causal_lm_training_variant,
    dropout_tables,
    plain_composition,
)

__all__ = [
    "QUICK",
    "QUICK_SIZES",
    "SIZES",
    "TARGETS",
    "add_arguments",
    "build_variants",
    "main",
    "run",
    "llama_title",
]

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
#: The tiny Llama's sizes (:func:`build_variants`' defaults), and those of ``--quick`` (:data:`QUICK`).
SIZES = {"hidden": 512, "intermediate": 1376, "layers": 4, "heads": 8, "vocab": 1000, "batch": 4, "seq": 256}
QUICK_SIZES = {"hidden": 32, "intermediate": 64, "layers": 2, "heads": 4, "vocab": 100, "batch": 2, "seq": 16}
QUICK = "a 2-layer hidden-32 model and 3 rounds"


def _llama(hidden: int, intermediate: int, layers: int, heads: int, vocab: int, seq: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        vocab_size=vocab,
        max_position_embeddings=max(seq, 16),
    )
    return LlamaForCausalLM(config)


def build_variants(
    *,
    hidden: int = 512,
    intermediate: int = 1376,
    layers: int = 4,
    heads: int = 8,
    vocab: int = 1000,
    batch: int = 4,
    seq: int = 256,
    dropout: float = 0.0,
    r: int = 16,
    alpha: float = 32,
) -> list[Variant]:
    """The contestants, each on its own copy of one randomly initialised model."""
    import peft

    import loragen

    torch.manual_seed(0)
    base = _llama(hidden, intermediate, layers, heads, vocab, seq).train()
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))

    frozen = copy.deepcopy(base).requires_grad_(False)
    frozen.enable_input_require_grads()  # gradients flow to the input embeddings and nowhere else
    peft_model = peft.get_peft_model(
        copy.deepcopy(base),
        peft.LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=TARGETS),
    )
    config = loragen.LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=TARGETS)
    fused = loragen.get_lora_model(copy.deepcopy(base), config)
    return [
        causal_lm_training_variant("frozen", frozen, ids),
        causal_lm_training_variant("peft", peft_model, ids),
        causal_lm_training_variant("loragen", fused, ids),
        causal_lm_training_variant("loragen unfused", plain_composition(fused), ids),
        causal_lm_training_variant("full fine-tuning", copy.deepcopy(base), ids),
    ]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of this benchmark (shared with ``loragen bench llama``)."""
    add_timing_arguments(parser, rounds=15, quick=QUICK, dropout=[0.0, 0.05])


def llama_title(shape: Mapping[str, int], what: str) -> str:
    """The tiny Llama's table title: its ``shape`` (:data:`SIZES`' keys) and ``what`` trains."""
    return (
        f"tiny Llama (hidden {shape['hidden']}, intermediate {shape['intermediate']}, {shape['layers']} "
        f"layers, batch {shape['batch']} x seq {shape['seq']}), fp32, {what}: training step with AdamW"
    )


def run(args: argparse.Namespace) -> str:
    """Run the benchmark for every dropout value; returns the Markdown tables."""
    return dropout_tables(
        args,
        build_variants,
        sizes=SIZES,
        quick_sizes=QUICK_SIZES,
        title=lambda shape, p: llama_title(shape, f"r=16, alpha 32, dropout {p:g}"),
        ratio_to=["frozen", "peft"],
    )


def main(argv: Sequence[str] | None = None) -> int:
    return benchmark_main(
        argv,
        prog="python -m benchmarks.bench_llama",
        description=__doc__.splitlines()[0],
        add_arguments=add_arguments,
        run=run,
    )


if __name__ == "__main__":
    raise SystemExit(main())
