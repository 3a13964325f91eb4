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

from .bench_llama import TARGETS, _llama
from .harness import (
    Variant,
    causal_lm_training_variant,
    format_table,
    machine_summary,
    plain_composition,
    run_variants,
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
    parser.add_argument("--dropout", type=float, nargs="+", default=[0.0, 0.05], help="LoRA dropout values")
    parser.add_argument("--rounds", type=int, default=10, help="timed interleaved rounds (default 10)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default 2)")
    parser.add_argument(
        "--quick", action="store_true", help="a 2-layer hidden-32 model and 3 rounds: a smoke test"
    )


def run(args: argparse.Namespace) -> str:
    """Run the benchmark for every dropout value; returns the Markdown tables."""
    sizes: dict[str, int] = {}
    rounds, warmup = args.rounds, args.warmup
    if args.quick:
        sizes = {
            "hidden": 32,
            "intermediate": 64,
            "layers": 2,
            "heads": 4,
            "vocab": 100,
            "batch": 2,
            "seq": 16,
        }
        rounds, warmup = 3, 1
    shape = sizes or {
        "hidden": 512,
        "intermediate": 1376,
        "layers": 4,
        "heads": 8,
        "vocab": 1000,
        "batch": 4,
        "seq": 256,
    }
    tables = [f"machine: {machine_summary()}"]
    for p in args.dropout:
        results = run_variants(build_variants(dropout=p, **sizes), rounds, warmup)
        title = (
            f"tiny Llama (hidden {shape['hidden']}, intermediate {shape['intermediate']}, {shape['layers']} "
            f"layers, batch {shape['batch']} x seq {shape['seq']}), fp32, DoRA r=16, alpha 32, dropout {p:g}: "
            f"training step with AdamW"
        )
        tables.append(format_table(results, title, ratio_to=["frozen", "peft DoRA"]))
    return "\n\n".join(tables)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_dora", description=__doc__.splitlines()[0]
    )
    add_arguments(parser)
    print(run(parser.parse_args(argv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
