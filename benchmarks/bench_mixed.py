"""A mixed batch of 4 adapters at inference on the tiny Llama: frozen base vs peft (``adapter_names=``)
vs loragen (``loragen.mixed_batch``), side by side.

Model from config (no download): hidden 512, intermediate 1376, 4 layers, 8 heads, vocab 1000; batch
4 x seq 256, fp32, eval mode, no grad; 4 adapters, r=16, alpha 32 on q, k, v, o, gate, up, down, with the
same factors in peft and loragen; row i of the batch uses adapter i. peft runs each LoRA layer's adapters
one after another on their rows (gather, two GEMMs, scatter); loragen runs all of them in two GEMMs
(:mod:`loragen.layers.mixed_batch`). The frozen base is the floor: what is left above it is the cost of
the adapters. For context, both libraries with one adapter active for the whole batch.

    python -m benchmarks.bench_mixed              # the tiny Llama, 15 rounds
    python -m benchmarks.bench_mixed --quick      # tiny sizes, a smoke test
"""

from __future__ import annotations

import argparse
import copy
import warnings
from collections.abc import Sequence

import torch
from torch import nn

from .bench_llama import QUICK, QUICK_SIZES, SIZES, TARGETS, _llama
from .harness import (
    Result,
    Variant,
    add_timing_arguments,
    benchmark_main,
    format_table,
    machine_summary,
    run_variants,
    timing,
)

__all__ = ["ADAPTERS", "TARGETS", "build_variants", "main", "run"]

ADAPTERS = ["default", "a1", "a2", "a3"]


def build_variants(
    *,
    hidden: int = 512,
    intermediate: int = 1376,
    layers: int = 4,
    heads: int = 8,
    vocab: int = 1000,
    batch: int = 4,
    seq: int = 256,
    r: int = 16,
    alpha: float = 32,
) -> list[Variant]:
    """The contestants, each on its own copy of one randomly initialised model."""
    import peft

    import loragen

    torch.manual_seed(0)
    base = _llama(hidden, intermediate, layers, heads, vocab, seq).eval()
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))
    rows = [ADAPTERS[i % len(ADAPTERS)] for i in range(batch)]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = peft.get_peft_model(
            copy.deepcopy(base),
            peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=TARGETS, init_lora_weights=False),
        )
        for name in ADAPTERS[1:]:
            peft_model.add_adapter(
                name, peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=TARGETS, init_lora_weights=False)
            )
    peft_model.eval()
    ours = copy.deepcopy(base)
    config = loragen.LoraConfig(r=r, lora_alpha=alpha, target_modules=TARGETS)
    for name in ADAPTERS:
        loragen.add_adapter(ours, config, name)
    ours.eval()
    with torch.no_grad():  # the same factors on both sides (docs/adapters.md: the parameter names)
        for path in loragen.convert.find_lora_layers(ours):
            theirs = peft_model.base_model.model.get_submodule(path)
            for name in ADAPTERS:
                prefix = path if name == ADAPTERS[0] else f"{path}.lora_adapters.{name}"
                ours.get_parameter(f"{prefix}.lora_A").copy_(theirs.lora_A[name].weight)
                ours.get_parameter(f"{prefix}.lora_B").copy_(theirs.lora_B[name].weight)

    def make(label: str, model: nn.Module, run: object) -> Variant:
        def forward() -> torch.Tensor:
            with torch.no_grad():
                return run()  # type: ignore[operator,no-any-return]

        return Variant(label, forward, forward)

    def peft_mixed() -> torch.Tensor:
        return peft_model(input_ids=ids, adapter_names=rows).logits

    def loragen_mixed() -> torch.Tensor:
        with loragen.mixed_batch(ours, rows):
            return ours(input_ids=ids).logits

    with torch.no_grad():  # the two agree before anything is timed
        torch.testing.assert_close(loragen_mixed(), peft_mixed(), atol=1e-4, rtol=1e-4)
    return [
        make("frozen", base, lambda: base(input_ids=ids).logits),
        make("peft, mixed batch of 4", peft_model, peft_mixed),
        make("loragen, mixed batch of 4", ours, loragen_mixed),
        make("peft, one adapter", peft_model, lambda: peft_model(input_ids=ids).logits),
        make("loragen, one adapter", ours, lambda: ours(input_ids=ids).logits),
    ]


def _above_floor(results: list[Result]) -> str:
    by_name = {r.name: r.median for r in results}
    floor = by_name["frozen"]
    peft_extra = by_name["peft, mixed batch of 4"] - floor
    ours_extra = by_name["loragen, mixed batch of 4"] - floor
    ratio = ours_extra / peft_extra if peft_extra > 0 else float("nan")
    return (
        f"Above the frozen floor ({floor * 1e3:.1f} ms): peft's mixed batch adds {peft_extra * 1e3:.1f} ms, "
        f"loragen's {ours_extra * 1e3:.1f} ms ({ratio:.3f}x)."
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of this benchmark."""
    add_timing_arguments(parser, rounds=15, quick=QUICK)


def run(args: argparse.Namespace) -> str:
    """Run the benchmark; returns the Markdown table."""
    sizes = {**QUICK_SIZES, "batch": len(ADAPTERS)} if args.quick else {}
    shape = {**SIZES, **sizes}
    results = run_variants(build_variants(**sizes), *timing(args))
    title = (
        f"tiny Llama (hidden {shape['hidden']}, intermediate {shape['intermediate']}, {shape['layers']} layers, "
        f"batch {shape['batch']} x seq {shape['seq']}), fp32, inference: 4 adapters r=16 on all 7 linears, "
        "row i uses adapter i"
    )
    table = format_table(results, title, ratio_to=["frozen", "peft, mixed batch of 4"])
    return "\n\n".join([f"machine: {machine_summary()}", table, _above_floor(results)])


def main(argv: Sequence[str] | None = None) -> int:
    return benchmark_main(
        argv,
        prog="python -m benchmarks.bench_mixed",
        description=__doc__.splitlines()[0],
        add_arguments=add_arguments,
        run=run,
    )


if __name__ == "__main__":
    raise SystemExit(main())
