"""The ``loragen`` command line: one subcommand per module in :mod:`loragen.cli` (:data:`SUBCOMMANDS`
maps each command to its module; ``inspect`` lives in ``inspect_adapter``, not to shadow the stdlib).

Each subcommand module defines ``register(subparsers)``, which adds its parser and sets
``func=run``, and ``run(args) -> int`` (the exit status).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from loragen import __version__

__all__ = ["main", "build_parser", "SUBCOMMANDS"]

# command -> module in loragen.cli
SUBCOMMANDS: dict[str, str] = {
    "rewrite": "rewrite",
    "merge": "merge",
    "inspect": "inspect_adapter",
    "bench": "bench",
    "demo": "demo",
}


def build_parser() -> argparse.ArgumentParser:
    """The ``loragen`` argument parser with every available subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="loragen",
        description="Convert PyTorch models into LoRA models, train them fast, read and write peft adapters.",
    )
    parser.add_argument("--version", action="version", version=f"loragen {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in SUBCOMMANDS.values():
        module = importlib.import_module(f"loragen.cli.{module_name}")
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``loragen`` command line; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("loragen: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
