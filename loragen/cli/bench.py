"""``loragen bench``: the side-by-side benchmarks (loragen vs peft vs the frozen base).

The benchmark code lives in the repository's ``benchmarks/`` folder and ships in the wheel as
``loragen._benchmarks``; a source checkout's ``benchmarks/`` is used when the package has none. peft
and transformers come with the ``bench`` extra (``pip install -e '.[bench]'`` from the loragen checkout).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import textwrap
import time
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

from loragen.atomic import atomic_write_text

__all__ = [
    "BENCHMARKS",
    "REQUIREMENTS",
    "Benchmark",
    "BenchmarksNotFound",
    "load_benchmark",
    "missing_requirements",
    "register",
    "run",
]


class Benchmark(NamedTuple):
    """What a benchmark measures, and how long it takes at its default sizes and with ``--quick``."""

    summary: str
    duration: str
    quick_duration: str


# Wall-clock durations on a 2-core CPU, start-up included (importing torch, transformers and peft takes
# 10-20 s on an idle machine). Default sizes: BENCHMARKS.md's runs on an idle machine scaled to the default
# rounds. --quick: measured (`loragen bench NAME --quick`), 27-47 s with the two cores loaded, 2-4 min with
# them shared by many processes (load ~15), of which the benchmark itself took 30-70 s.
_QUICK = "under 1 min on an idle machine, up to 4 min on a heavily shared one"
BENCHMARKS: dict[str, Benchmark] = {
    "layer": Benchmark(
        "one nn.Linear(4096, 4096), 4096 tokens, dropout 0 and 0.1: forward + backward",
        "about 6 min",
        _QUICK,
    ),
    "llama": Benchmark(
        "tiny Llama from config, batch 4 x 256, r=16 on q,k,v,o,gate,up,down: AdamW training step",
        "about 3 min",
        _QUICK,
    ),
    "decoder": Benchmark(
        "one decoder layer of that Llama: forward + backward",
        "about 2 min",
        _QUICK,
    ),
}

# What every benchmark imports besides loragen: the contestant (peft) and the Llama models.
REQUIREMENTS = ("peft", "transformers")

DESCRIPTION = """\
Time loragen, peft and the frozen base (plus loragen's plain-autograd path, and full training where it
applies) in one process, interleaved round by round, and print medians, ratios and the bytes autograd
saves for backward (parameters and buffers left out; the frozen base is measured the same way, and a
"saved / X" column appears only where X saves something). Not a test: figures depend on the machine and
its load. A progress line per round goes to stderr, with the time left.

Needs peft and transformers: pip install -e '.[bench]' (from the loragen checkout).

benchmarks (expected wall-clock duration on a 2-core CPU, start-up included: at the default sizes on
an idle machine -- a loaded one takes several times longer, the progress lines say how long; --quick:
tiny sizes, 3 rounds):
{table}
"""


class BenchmarksNotFound(RuntimeError):
    """The benchmark modules are neither installed nor in a source checkout next to the package."""


def load_benchmark(name: str) -> ModuleType:
    """Import benchmark ``name`` ("layer", "llama" or "decoder").

    Raises:
        BenchmarksNotFound: neither ``loragen._benchmarks`` nor ``<checkout>/benchmarks`` exists.
    """
    try:
        return importlib.import_module(f"loragen._benchmarks.bench_{name}")
    except ModuleNotFoundError as exc:
        if exc.name not in ("loragen._benchmarks", f"loragen._benchmarks.bench_{name}"):
            raise  # the benchmark is there but something it imports is not
    root = Path(__file__).resolve().parents[2]
    if not (root / "benchmarks" / f"bench_{name}.py").is_file():
        raise BenchmarksNotFound(
            f"loragen bench: benchmarks/bench_{name}.py not found next to the package ({root}); "
            "reinstall loragen, or run it from a loragen source checkout (pip install -e .)"
        )
    if str(root) not in sys.path:
        sys.path.append(str(root))  # last: the checkout must not shadow installed modules
    module = importlib.import_module(f"benchmarks.bench_{name}")
    if Path(module.__file__ or "").resolve().parent != root / "benchmarks":
        raise BenchmarksNotFound(
            f"loragen bench: 'benchmarks' resolves to {module.__file__}, not to {root / 'benchmarks'}"
        )
    return module


def missing_requirements() -> list[str]:
    """The :data:`REQUIREMENTS` that cannot be imported, each with the reason."""
    missing = []
    for name in REQUIREMENTS:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            missing.append(f"{name} ({exc})")
    return missing


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``bench`` subcommand with one sub-subcommand per benchmark."""
    table = "\n".join(
        f"  {name:<8} {b.summary}\n  {'':<8} {b.duration}; --quick {b.quick_duration}"
        for name, b in BENCHMARKS.items()
    )
    parser = subparsers.add_parser(
        "bench",
        help="run the side-by-side benchmarks (loragen vs peft vs the frozen base)",
        description=DESCRIPTION.format(table=table),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    kinds = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    for name, bench in BENCHMARKS.items():
        sub = kinds.add_parser(
            name,
            help=f"{bench.summary} ({bench.duration}; --quick {bench.quick_duration})",
            description=textwrap.fill(
                f"{bench.summary}. Expected wall-clock duration on a 2-core CPU, start-up included: "
                f"{bench.duration} at the default sizes on an idle machine (a loaded one takes several times "
                f"longer); with --quick {bench.quick_duration}. A progress line per round goes to stderr, "
                "with the time left. Needs peft and transformers: "
                "pip install -e '.[bench]' (from the loragen checkout).",
                width=100,
            ),
        )
        _add_benchmark_arguments(name, sub)
        sub.add_argument(
            "--threads", type=int, default=None, help="torch intra-op threads (default: torch's)"
        )
        sub.add_argument("-o", "--output", default=None, help="also write the tables to this Markdown file")
        sub.add_argument(
            "--json",
            nargs="?",
            const="-",
            default=None,
            metavar="FILE",
            help="machine-readable results: on stdout (instead of the tables) without FILE, else to FILE",
        )
        sub.set_defaults(func=run)


def _add_benchmark_arguments(name: str, parser: argparse.ArgumentParser) -> None:
    # the options are the benchmark module's own; without the modules only the common ones exist
    try:
        load_benchmark(name).add_arguments(parser)
    except (BenchmarksNotFound, ImportError):
        parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")


def _report(
    args: argparse.Namespace, tables: list[Any], machine: str | None, seconds: float
) -> dict[str, Any]:
    options = {k: v for k, v in vars(args).items() if k not in ("func", "command", "benchmark")}
    return {
        "benchmark": args.benchmark,
        "options": options,
        "machine": machine,
        "seconds": seconds,
        "tables": [table.to_json() for table in tables],
    }


def run(args: argparse.Namespace) -> int:
    """Run ``loragen bench BENCHMARK``; returns 0, or 1 when peft, transformers or the benchmark modules
    are missing (the message on stderr names the ``bench`` extra)."""
    missing = missing_requirements()
    if missing:
        print(
            f"loragen bench needs peft and transformers; missing: {', '.join(missing)}.\n"
            "Install them with: pip install -e '.[bench]' (from the loragen checkout)",
            file=sys.stderr,
        )
        return 1
    try:
        module = load_benchmark(args.benchmark)
    except BenchmarksNotFound as exc:
        print(exc, file=sys.stderr)
        return 1
    import torch

    harness = importlib.import_module(f"{module.__package__}.harness")  # the one the benchmark reports to
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    bench = BENCHMARKS[args.benchmark]
    expected = bench.quick_duration if getattr(args, "quick", False) else bench.duration
    print(f"loragen bench {args.benchmark}: expected on a 2-core CPU: {expected}", file=sys.stderr)
    start = time.perf_counter()
    with harness.recording(progress=sys.stderr) as record:
        text = module.run(args)
    seconds = time.perf_counter() - start
    text += f"\n\n(loragen bench {args.benchmark}: {seconds:.0f} s)"
    if args.json != "-":
        print(text)
    if args.output:
        atomic_write_text(args.output, text + "\n")
    if args.json is not None:
        payload = json.dumps(_report(args, record.tables, record.machine, seconds), indent=1)
        if args.json == "-":
            print(payload)
        else:
            atomic_write_text(args.json, payload + "\n")
    return 0
