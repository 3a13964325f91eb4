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
from typing import Any, NoReturn

from loragen import __version__
from loragen.cli.flags import command_parser, flag_hints

__all__ = ["main", "build_parser", "SUBCOMMANDS"]

# command -> module in loragen.cli
SUBCOMMANDS: dict[str, str] = {
    "rewrite": "rewrite",
    "merge": "merge",
    "inspect": "inspect_adapter",
    "bench": "bench",
    "demo": "demo",
}


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors name the option an unknown flag was probably meant to be.

    Subcommand parsers are made with the parent's class, so every subcommand gets it; each remembers the
    arguments it was given to find the unknown flags when it reports an error (a missing required option
    is often a misspelt one).
    """

    _given: tuple[str, ...] = ()

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self._given = tuple(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        super().error(message + flag_hints(self, self._given))


def build_parser(commands: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The ``loragen`` argument parser with the subcommands ``commands`` registered (None: every one).

    Registering a subcommand imports its module, and some need torch to describe their options
    (``bench`` reads them from the benchmarks): ``loragen rewrite`` registers only itself and imports no
    torch.
    """
    parser = _Parser(
        prog="loragen",
        description="Convert PyTorch models into LoRA models, train them fast, read and write peft adapters.",
    )
    parser.add_argument("--version", action="version", version=f"loragen {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command, module_name in SUBCOMMANDS.items():
        if commands is not None and command not in commands:
            continue
        module = importlib.import_module(f"loragen.cli.{module_name}")
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``loragen`` command line; returns the exit status."""
    tokens = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(tokens[:1] if tokens and tokens[0] in SUBCOMMANDS else None)
    args, extras = parser.parse_known_args(tokens)
    if extras:
        # argparse reports a subcommand's unknown flag with the top-level usage: report it with the
        # subcommand's own usage, and the option it was probably meant to be
        command = command_parser(parser, tokens)
        command.error(f"unrecognized arguments: {' '.join(extras)}")
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
