"""``loragen bench``: the side-by-side benchmarks (loragen vs peft vs the frozen base).

The benchmark code lives in the repository's ``benchmarks/`` folder (``benchmarks.bench_layer``,
``benchmarks.bench_llama``, ``benchmarks.bench_decoder``); a wheel that ships it as ``loragen._benchmarks`` is used first.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path
from types import ModuleType

__all__ = ["BENCHMARKS", "BenchmarksNotFound", "load_benchmark", "register", "run"]

BENCHMARKS: dict[str, str] = {
    "layer": "one nn.Linear(4096, 4096), 4096 tokens, dropout 0 and 0.1: forward + backward",
    "llama": "tiny Llama from config, batch 4 x 256, r=16 on q,k,v,o,gate,up,down: AdamW training step",
    "decoder": "one decoder layer of that Llama: forward + backward, with and without sibling fusion",
}


class BenchmarksNotFound(RuntimeError):
    """The benchmark modules are neither installed nor in a source checkout next to the package."""


def load_benchmark(name: str) -> ModuleType:
    """Import benchmark ``name`` ("layer", "llama" or "decoder").

    Raises:
        BenchmarksNotFound: neither ``loragen._benchmarks`` nor ``<checkout>/benchmarks`` exists.
    """
    try:
        return importlib.import_module(f"loragen._benchmarks.bench_{name}")
    except ModuleNotFoundError:
        pass
    root = Path(__file__).resolve().parents[2]
    if not (root / "benchmarks" / f"bench_{name}.py").is_file():
        raise BenchmarksNotFound(
            f"loragen bench: benchmarks/bench_{name}.py not found next to the package ({root}); "
            "run it from a loragen source checkout (pip install -e .)"
        )
    if str(root) not in sys.path:
        sys.path.append(str(root))  # last: the checkout must not shadow installed modules
    module = importlib.import_module(f"benchmarks.bench_{name}")
    if Path(module.__file__ or "").resolve().parent != root / "benchmarks":
        raise BenchmarksNotFound(
            f"loragen bench: 'benchmarks' resolves to {module.__file__}, not to {root / 'benchmarks'}"
        )
    return module


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``bench`` subcommand with one sub-subcommand per benchmark."""
    parser = subparsers.add_parser(
        "bench",
        help="run the side-by-side benchmarks (loragen vs peft vs the frozen base)",
        description=(
            "Time loragen, peft and the frozen base (plus loragen's plain-autograd path and full training) "
            "in one process, interleaved round by round, and print medians, ratios and the bytes autograd "
            "saves for backward. Not a test: figures depend on the machine and its load."
        ),
    )
    kinds = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    for name, help_text in BENCHMARKS.items():
        sub = kinds.add_parser(name, help=help_text, description=help_text)
        _add_benchmark_arguments(name, sub)
        sub.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
        sub.add_argument("-o", "--output", default=None, help="also write the tables to this Markdown file")
        sub.set_defaults(func=run)


def _add_benchmark_arguments(name: str, parser: argparse.ArgumentParser) -> None:
    # the options are the benchmark module's own; without the modules only the common ones exist
    try:
        load_benchmark(name).add_arguments(parser)
    except BenchmarksNotFound:
        parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")


def run(args: argparse.Namespace) -> int:
    """Run ``loragen bench BENCHMARK``; returns 0, or 1 when the benchmark modules are missing."""
    try:
        module = load_benchmark(args.benchmark)
    except BenchmarksNotFound as exc:
        print(exc, file=sys.stderr)
        return 1
    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    text = module.run(args)
    text += f"\n\n(loragen bench {args.benchmark}: {time.perf_counter() - start:.0f} s)"
    print(text)
    if args.output:
        from loragen.atomic import atomic_write_text

        atomic_write_text(args.output, text + "\n")
    return 0
