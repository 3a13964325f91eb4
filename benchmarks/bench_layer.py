"""One ``nn.Linear``: frozen base vs peft vs loragen (fused op and plain composition) vs a trainable base.

Each step is forward + backward with gradients to the input (as inside a network) and to whatever
trains: nothing for the frozen base, A and B for the LoRA variants, weight and bias for "full".

    python -m benchmarks.bench_layer                  # 4096 x 4096, 4096 tokens, dropout 0 and 0.1
    python -m benchmarks.bench_layer --quick          # tiny sizes, a smoke test
    python -m benchmarks.bench_layer --cpu-paths numpy avx2 avx512
                                                      # one loragen row per dropout path, interleaved
    loragen bench layer [...]                         # the same through the CLI
"""

from __future__ import annotations

import argparse
import contextlib
import copy
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from .harness import Variant, format_table, machine_summary, module_tensors, run_variants

__all__ = ["add_arguments", "build_variants", "main", "run"]


class _Holder(nn.Module):
    """peft targets modules by name: the layer lives under ``layer``."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


CPU_PATHS = ("numpy", "avx2", "avx512")


@contextlib.contextmanager
def _cpu_path(path: str | None) -> Iterator[None]:
    """The CPU dropout path in force: "numpy" (the compiled kernels off), a kernel variant, or None
    (whatever the environment chose)."""
    from loragen import switches
    from loragen.ops import cpu_kernels

    if path is None:
        yield
    elif path == "numpy":
        with switches.cpu_kernels.using(False):
            yield
    else:
        with switches.cpu_kernels.using(True), switches.cpu_kernel_variant.using(path):
            if not cpu_kernels.available():
                raise SystemExit(f"--cpu-paths {path}: {cpu_kernels.status()}")
            yield


def build_variants(
    features: int,
    tokens: int,
    dropout: float,
    r: int = 16,
    alpha: float = 32,
    cpu_paths: Sequence[str] = (),
) -> list[Variant]:
    """The contestants on one (features x features) layer and a (tokens, features) input; with
    ``cpu_paths`` (names from :data:`CPU_PATHS`) one fused loragen row per CPU dropout path."""
    import peft

    from loragen import LoraLinear

    torch.manual_seed(0)
    base = nn.Linear(features, features)
    x = torch.randn(tokens, features, requires_grad=True)
    grad = torch.randn(tokens, features)
    a = torch.randn(r, features) / features**0.5
    b = torch.randn(features, r) / r**0.5  # nonzero B: every GEMM does real work

    def make_step(layer: nn.Module, trainable: list[torch.Tensor], path: str | None = None) -> Variant:
        def forward() -> torch.Tensor:
            with _cpu_path(path):
                return layer(x)

        def step() -> None:
            for t in (x, *trainable):
                t.grad = None
            with _cpu_path(path):
                layer(x).backward(grad)

        return Variant("", step, forward, module_tensors(layer))

    frozen = copy.deepcopy(base).requires_grad_(False)
    full = copy.deepcopy(base)
    config = peft.LoraConfig(target_modules=["layer"], r=r, lora_alpha=alpha, lora_dropout=dropout)
    peft_layer = peft.get_peft_model(_Holder(copy.deepcopy(base)), config).base_model.model.layer
    with torch.no_grad():
        peft_layer.lora_A["default"].weight.copy_(a)
        peft_layer.lora_B["default"].weight.copy_(b)
    fused, unfused = (
        LoraLinear.from_module(copy.deepcopy(base), r=r, lora_alpha=alpha, lora_dropout=dropout)
        for _ in range(2)
    )
    unfused.fused = False
    for layer in (fused, unfused):
        layer.weight.requires_grad_(False)
        layer.bias.requires_grad_(False)
        with torch.no_grad():
            layer.lora_A.copy_(a)
            layer.lora_B.copy_(b)
    peft_params = [p for p in peft_layer.parameters() if p.requires_grad]
    fused_rows: dict[str, Variant] = {
        f"loragen ({path})": make_step(fused, [fused.lora_A, fused.lora_B], path) for path in cpu_paths
    } or {"loragen": make_step(fused, [fused.lora_A, fused.lora_B])}
    variants = {
        "frozen": make_step(frozen, []),
        "peft": make_step(peft_layer, peft_params),
        **fused_rows,
        "loragen unfused": make_step(unfused, [unfused.lora_A, unfused.lora_B]),
        "full": make_step(full, list(full.parameters())),
    }
    for name, variant in variants.items():
        variant.name = name
    return list(variants.values())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of this benchmark (shared with ``loragen bench layer``)."""
    parser.add_argument("--features", type=int, default=4096, help="in = out features (default 4096)")
    parser.add_argument("--tokens", type=int, default=4096, help="rows of the input (default 4096)")
    parser.add_argument("--dropout", type=float, nargs="+", default=[0.0, 0.1], help="LoRA dropout values")
    parser.add_argument("--rounds", type=int, default=15, help="timed interleaved rounds (default 15)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default 2)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes and 3 rounds: a smoke test")
    parser.add_argument(
        "--cpu-paths",
        nargs="+",
        choices=CPU_PATHS,
        default=[],
        help="one loragen row per CPU dropout path: numpy (compiled kernels off) or a kernel variant",
    )


def run(args: argparse.Namespace) -> str:
    """Run the benchmark for every dropout value; returns the Markdown tables."""
    features, tokens, rounds, warmup = args.features, args.tokens, args.rounds, args.warmup
    if args.quick:
        features, tokens, rounds, warmup = 64, 128, 3, 1
    tables = [f"machine: {machine_summary()}"]
    for p in args.dropout:
        results = run_variants(build_variants(features, tokens, p, cpu_paths=args.cpu_paths), rounds, warmup)
        title = f"nn.Linear({features}, {features}), {tokens} tokens, fp32, r=16, dropout {p:g}: forward + backward"
        tables.append(format_table(results, title, ratio_to=["frozen", "peft"]))
    return "\n\n".join(tables)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_layer", description=__doc__.splitlines()[0]
    )
    add_arguments(parser)
    print(run(parser.parse_args(argv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
