"""``loragen bench``: the side-by-side benchmarks (loragen vs peft vs the frozen base).

The benchmarks ship in the wheel as ``loragen._benchmarks`` (a source checkout's ``benchmarks/`` otherwise);
a run too small or too short to be representative says so in its output.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import textwrap
import time
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

from loragen.atomic import atomic_write_text
from loragen.cli import SUBCOMMANDS

__all__ = [
    "BENCHMARKS",
    "REQUIREMENTS",
    "Benchmark",
    "BenchmarksNotFound",
    "caveats",
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


# wall-clock durations on a 2-core CPU, start-up included
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

# below these a run's figures are not representative: medians move with the load, steps are overhead
MIN_ROUNDS = 5
MIN_STEP_SECONDS = 0.010

# What every benchmark imports besides loragen: the contestant (peft) and the Llama models.
REQUIREMENTS = ("peft", "transformers")

DESCRIPTION = """\
Time loragen, peft and the frozen base (plus loragen's plain-autograd path, and full training where it
applies) in one process, interleaved round by round, and print medians, ratios and the bytes autograd
saves for backward (parameters and buffers left out; the frozen base is measured the same way, and a
"saved / X" column appears only where X saves something). Not a test: figures depend on the machine and
its load. A progress line per round goes to stderr, with the time left.

Needs peft and transformers: pip install -e '.[bench]' (from the loragen checkout).

--quick runs tiny sizes for 3 rounds: a check that the benchmark runs, whose ratios mean nothing (its
output says so, as does any run of fewer than {min_rounds} rounds or of steps under {min_ms:.0f} ms).

benchmarks (expected wall-clock duration on a 2-core CPU, start-up included: at the default sizes on
an idle machine -- a loaded one takes several times longer, the progress lines say how long):
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
        help=SUBCOMMANDS["bench"][2],
        description=DESCRIPTION.format(table=table, min_rounds=MIN_ROUNDS, min_ms=MIN_STEP_SECONDS * 1e3),
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
        try:  # the benchmark module's own options; without the modules only the common ones
            load_benchmark(name).add_arguments(sub)
        except (BenchmarksNotFound, ImportError):
            sub.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
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


_QUICK_CAVEAT = (
    "--quick is a smoke test, not a measurement: it runs each benchmark at tiny sizes for 3 rounds to check "
    "that every variant runs. At these sizes a step's time is Python and dispatch overhead, not the "
    "arithmetic the fused op saves, so the ratios to peft say nothing about a real model (loragen can look "
    "several times slower or faster). Run without --quick for the figures BENCHMARKS.md reports."
)


def caveats(quick: bool, tables: list[Any]) -> list[str]:
    """Why a run's figures are not representative (``--quick``, tables of fewer than :data:`MIN_ROUNDS`
    rounds, variants whose median step is under :data:`MIN_STEP_SECONDS`); ``tables`` are the run's
    recorded ``benchmarks.harness.Table`` objects. Empty when none applies."""
    notes = [_QUICK_CAVEAT] if quick else []
    for number, table in enumerate(tables, 1):
        data = table.to_json()
        if not quick and data["rounds"] < MIN_ROUNDS:
            notes.append(
                f"table {number}: medians of {data['rounds']} rounds move with the machine's load; "
                f"use --rounds {MIN_ROUNDS} or more"
            )
        short = [v["name"] for v in data["variants"] if v["median_s"] < MIN_STEP_SECONDS]
        if short and not quick:
            notes.append(
                f"table {number}: {', '.join(short)} step in under {MIN_STEP_SECONDS * 1e3:.0f} ms, where "
                "per-call overhead, not the arithmetic, sets the time; use larger sizes"
            )
    return notes


_IMPORTED = time.perf_counter()  # the fallback start: when the CLI imported this module


def _elapsed() -> float:
    """Wall-clock seconds since this process started (from /proc on Linux; else since this import)."""
    try:
        stat = Path("/proc/self/stat").read_text()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        start_ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, starttime, after pid and (comm)
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _IMPORTED


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
    quick = bool(getattr(args, "quick", False))
    expected = bench.quick_duration if quick else bench.duration
    print(f"loragen bench {args.benchmark}: expected on a 2-core CPU: {expected}", file=sys.stderr)
    startup = _elapsed()
    with harness.recording(progress=sys.stderr) as record:
        text = module.run(args)
    seconds = _elapsed()
    notes = caveats(quick, record.tables)
    listed = "\n".join(
        textwrap.fill(note, width=100, initial_indent="- ", subsequent_indent="  ") for note in notes
    )
    if notes:
        text += "\n\nNot representative:\n" + listed
    text += (
        f"\n\n(loragen bench {args.benchmark}: {seconds:.1f} s wall-clock from process start, of which "
        f"{startup:.1f} s start-up: Python, torch, transformers and peft imported)"
    )
    if args.json != "-":
        print(text)
    elif notes:
        print("loragen bench: not representative:\n" + listed, file=sys.stderr)
    if args.output:
        atomic_write_text(args.output, text + "\n")
    if args.json is not None:
        report = {
            "benchmark": args.benchmark,
            "options": {k: v for k, v in vars(args).items() if k not in ("func", "command", "benchmark")},
            "machine": record.machine,
            "seconds": seconds,
            "startup_seconds": startup,
            "representative": not notes,
            "caveats": notes,
            "tables": [table.to_json() for table in record.tables],
        }
        payload = json.dumps(report, indent=1)
        if args.json == "-":
            print(payload)
        else:
            atomic_write_text(args.json, payload + "\n")
    return 0
