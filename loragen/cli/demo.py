"""``loragen demo``: rewrite, pretrain, LoRA fine-tune, save, reload and merge, on scikit-learn's digits.

The demo's code ships with the examples (``examples/demo/``, installed as ``loragen._examples.demo``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from loragen.cli import EXIT_INPUT, EXIT_OK, SUBCOMMANDS, add_lora_arguments, positive_int
from loragen.errors import LoraConfigError

__all__ = ["register", "run"]

DESCRIPTION = """\
The main job end to end, offline. On a 2-core CPU it takes about 5 minutes (--quick: about 2); a heavily
loaded machine takes several times longer. The progress lines on stderr say how long is left. It will:
rewrite the bundled model file (examples/digits_model.py) with `loragen rewrite` and show the diff;
pretrain it on upright handwritten digits (scikit-learn's dataset); LoRA-fine-tune it on the same
digits rotated by 90 degrees (LoRA on the convolutions and hidden layer, the head trained fully);
save the adapter in peft's format, reload it into a fresh base, merge and compare. Writes
summary.md, training_curves.png (loss and accuracy over both phases), metrics.json and adapter/
to --output.

Stage reports go to stdout; training progress to stderr (a bar on a terminal, a plain line every
tenth of a phase when stderr is a pipe or a file). Exit status 0 when the fine-tune improved the
rotated-digit accuracy and every check passed, 1 otherwise.
Needs scikit-learn and matplotlib: pip install -e '.[demo]' (from the loragen checkout).
"""


def register(subparsers: Any) -> None:
    """Add the ``demo`` subcommand to the ``loragen`` parser."""
    parser = subparsers.add_parser(
        "demo",
        help=SUBCOMMANDS["demo"][2],
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--steps",
        type=positive_int,
        default=None,
        help="LoRA fine-tuning steps (default 300, 100 with --quick)",
    )
    parser.add_argument(
        "--pretrain-steps",
        type=positive_int,
        default=None,
        help="pretraining steps of the base (default 400, 150 with --quick)",
    )
    add_lora_arguments(parser, r_default=8, alpha_help="default 2 * r", dropout_default=0.0)
    parser.add_argument(
        "--output",
        "-o",
        type=Path,
        default=Path("loragen-demo"),
        help="output folder (default ./loragen-demo)",
    )
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (default cpu)")
    parser.add_argument("--seed", type=int, default=0, help="random seed; the same seed gives the same run")
    parser.add_argument(
        "--lr", type=float, default=3e-3, help="learning rate for both trainings (default 3e-3)"
    )
    parser.add_argument("--eight-bit", action="store_true", help="fine-tune with loragen's 8-bit AdamW")
    parser.add_argument("--quick", action="store_true", help="a shortened run (CI)")
    parser.add_argument("--no-progress", action="store_true", help="no training progress on stderr")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the demo; exit status 0 when the metric improved and every check passed, 1 otherwise."""
    from loragen._examples.demo import DemoError, DemoOptions, run_demo

    given = {f.name for f in dataclasses.fields(DemoOptions)} & set(vars(args))
    options = DemoOptions(**{name: getattr(args, name) for name in given}, progress=not args.no_progress)
    try:
        result = run_demo(options, out=sys.stdout, progress=sys.stderr)
    except (DemoError, LoraConfigError) as exc:
        print(f"loragen demo: {exc}", file=sys.stderr)
        return EXIT_INPUT
    if not result.ok:
        print("loragen demo: the run finished but a check failed (see the summary above)", file=sys.stderr)
        return EXIT_INPUT
    return EXIT_OK
