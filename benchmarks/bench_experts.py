"""One Mixtral MoE block (experts as 3-D parameters), forward + backward: frozen vs peft vs loragen, LoRA on
``experts.gate_up_proj`` and ``experts.down_proj`` through ``target_parameters``.

The block of transformers' ``MixtralSparseMoeBlock`` (hidden 512, expert intermediate 1024, 8 experts,
top-2; batch 4 x seq 128, fp32; r=16, alpha 32), its experts run by transformers' default implementation
(``grouped_mm``; ``--implementation`` picks another). Variants, each on its own copy of one block:

* ``frozen``: the block without LoRA (what backward through it costs anyway);
* ``peft``: peft 0.21's ``ParamWrapper`` (a parametrization folding ``W + s B_e A_e`` with one ``baddbmm``);
* ``loragen``: the same update made by one ``baddbmm``, the effective weights rebuilt in the backward
  instead of held (``switches.fused`` on, the default);
* ``loragen unfused``: the same with ``switches.fused`` off (autograd holds the effective weights, as peft).

    python -m benchmarks.bench_experts                # 40 interleaved rounds
    python -m benchmarks.bench_experts --quick        # a smoke test
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from .harness import (
    Variant,
    add_timing_arguments,
    benchmark_main,
    format_table,
    machine_summary,
    module_tensors,
    run_variants,
    timing,
)

__all__ = ["add_arguments", "build_variants", "main", "run"]

TARGETS = ["experts.gate_up_proj", "experts.down_proj"]


class _Block(nn.Module):
    """The MoE block with its router output dropped: ``forward(x) -> hidden states``."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: Tensor) -> Tensor:
        out = self.block(x)
        return out[0] if isinstance(out, tuple) else out


def build_variants(
    *,
    hidden: int = 512,
    intermediate: int = 1024,
    experts: int = 8,
    top_k: int = 2,
    batch: int = 4,
    seq: int = 128,
    r: int = 16,
    alpha: float = 32,
    implementation: str = "grouped_mm",
) -> list[Variant]:
    """The contestants, each on its own copy of one randomly initialised MoE block."""
    import peft
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    import loragen

    torch.manual_seed(0)
    config = MixtralConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_local_experts=experts,
        num_experts_per_tok=top_k,
        num_hidden_layers=1,
        num_attention_heads=8,
        num_key_value_heads=8,
    )
    config._experts_implementation = implementation
    block = MixtralSparseMoeBlock(config)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.02)
    base = _Block(block.train())
    x = torch.randn(batch, seq, hidden)
    grad_out = torch.randn(batch, seq, hidden, generator=torch.Generator().manual_seed(1))

    def make(name: str, model: nn.Module, fused: bool = True) -> Variant:
        def forward() -> Tensor:
            with loragen.switches.fused.using(fused):
                return model(x.detach().requires_grad_(True))

        def step() -> None:
            for p in model.parameters():
                p.grad = None
            with loragen.switches.fused.using(fused):
                forward().backward(grad_out)

        return Variant(name, step, forward, module_tensors(model))

    kwargs = {
        "r": r,
        "lora_alpha": alpha,
        "target_modules": [],
        "target_parameters": TARGETS,
        "init_lora_weights": False,
    }
    lora = loragen.get_lora_model(copy.deepcopy(base), loragen.LoraConfig(**kwargs))  # type: ignore[arg-type]
    twin = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(**kwargs))  # type: ignore[arg-type]
    return [
        make("frozen", copy.deepcopy(base).requires_grad_(False)),
        make("peft", twin),
        make("loragen", lora),
        make("loragen unfused", copy.deepcopy(lora), fused=False),
    ]


QUICK_SIZES = {"hidden": 32, "intermediate": 48, "experts": 4, "batch": 2, "seq": 8}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of this benchmark."""
    add_timing_arguments(parser, rounds=40, warmup=3, quick="hidden 32, 4 experts, seq 8 and 3 rounds")
    parser.add_argument(
        "--implementation",
        default="grouped_mm",
        choices=["eager", "batched_mm", "grouped_mm"],
        help="transformers' experts implementation (default grouped_mm, transformers' default)",
    )


def run(args: argparse.Namespace) -> str:
    """Run the benchmark; returns the Markdown table."""
    sizes = QUICK_SIZES if args.quick else {}
    shape = {"hidden": 512, "intermediate": 1024, "experts": 8, "batch": 4, "seq": 128, **sizes}
    results = run_variants(build_variants(implementation=args.implementation, **sizes), *timing(args))
    title = (
        f"one Mixtral MoE block (hidden {shape['hidden']}, expert intermediate {shape['intermediate']}, "
        f"{shape['experts']} experts, top-2, batch {shape['batch']} x seq {shape['seq']}, experts "
        f"'{args.implementation}'), fp32, LoRA r=16 alpha 32 on gate_up_proj and down_proj: forward + backward"
    )
    return "\n\n".join(
        [f"machine: {machine_summary()}", format_table(results, title, ratio_to=["frozen", "peft"])]
    )


def main(argv: Sequence[str] | None = None) -> int:
    return benchmark_main(
        argv,
        prog="python -m benchmarks.bench_experts",
        description=__doc__.splitlines()[0],
        add_arguments=add_arguments,
        run=run,
    )


if __name__ == "__main__":
    raise SystemExit(main())
