"""DoRA training step on the tiny Llama: frozen model vs peft's DoRA vs loragen's fused DoRA op (and
loragen's plain composition of the same math), side by side.

The model and step are those of :mod:`benchmarks.bench_llama` (hidden 512, intermediate 1376, 4 layers,
batch 4 x seq 256, fp32, r=16, alpha 32 on q, k, v, o, gate, up, down; AdamW on what trains), with
``use_dora=True``. The frozen model trains nothing and takes gradients to its input embeddings only: it is
the floor.

    python -m benchmarks.bench_dora                     # dropout 0 and 0.05
    python -m benchmarks.bench_dora --quick             # tiny sizes, a smoke test
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Sequence

import torch
from torch import nn

from .bench_llama import QUICK, QUICK_SIZES, SIZES, TARGETS, _llama, llama_title
from .harness import (
    Variant,
    add_timing_arguments,
    benchmark_main,
    causal_lm_training_variant,
    dropout_tables,
    plain_composition,
)

__all__ = ["build_variants", "main", "run"]


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

    def make(name: str, model: nn.Module) -> Variant:
        return causal_lm_training_variant(name, model, ids)

    frozen = copy.deepcopy(base).requires_grad_(False)
    frozen.enable_input_require_grads()  # gradients flow to the input embeddings and nowhere else
    peft_model = peft.get_peft_model(
        copy.deepcopy(base),
        peft.LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=TARGETS, use_dora=True),
    )
    config = loragen.LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=TARGETS, use_dora=True
    )
    fused = loragen.get_lora_model(copy.deepcopy(base), config)
    return [
        make("frozen", frozen),
        make("peft DoRA", peft_model),
        make("loragen DoRA", fused),
        make("loragen DoRA unfused", plain_composition(fused)),
    ]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of this benchmark."""
    add_timing_arguments(parser, rounds=10, quick=QUICK, dropout=[0.0, 0.05])


def run(args: argparse.Namespace) -> str:
    """Run the benchmark for every dropout value; returns the Markdown tables."""
    return dropout_tables(
        args,
        build_variants,
        sizes=SIZES,
        quick_sizes=QUICK_SIZES,
        title=lambda shape, p: llama_title(shape, f"DoRA r=16, alpha 32, dropout {p:g}"),
        ratio_to=["frozen", "peft DoRA"],
    )


def main(argv: Sequence[str] | None = None) -> int:
    return benchmark_main(
        argv,
        prog="python -m benchmarks.bench_dora",
        description=__doc__.splitlines()[0],
        add_arguments=add_arguments,
        run=run,
    )


if __name__ == "__main__":
    raise SystemExit(main())
