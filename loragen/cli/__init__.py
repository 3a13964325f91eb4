"""The ``loragen`` command line: the parser, the flags the subcommands share, and how a command ends.

:data:`SUBCOMMANDS` names each command's module and ``register`` function, which adds the command's parser
with ``func``: the parsed arguments -> the exit status. Only the command named is imported (``loragen
--help`` and ``loragen rewrite`` import no torch). Exit statuses, as docs/cli.md says: 0 success, 1 an
input error (a missing or unreadable file, an invalid adapter or source), 2 a usage error (the command
line itself), 141 when the output pipe closes early (``loragen inspect --json | head``: quietly, as a Unix
tool that SIGPIPE ends).
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import math
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from loragen import __version__
from loragen.config import LoraConfig, check_dropout
from loragen.errors import LoraConfigError

__all__ = [
    "EXIT_INPUT",
    "EXIT_OK",
    "EXIT_USAGE",
    "SUBCOMMANDS",
    "add_lora_arguments",
    "build_parser",
    "command_parser",
    "error",
    "finite_float",
    "flag_hints",
    "main",
    "positive_int",
    "probability",
]

EXIT_OK = 0
EXIT_INPUT = 1  # an error in the input: a missing or unreadable file, an invalid adapter or source
EXIT_USAGE = 2  # an error in the command line
EXIT_BROKEN_PIPE = 128 + 13  # what a shell reports for a command SIGPIPE ended

# command -> (module in loragen.cli, its register function, the one-line help `loragen --help` shows)
SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "rewrite": (
        "rewrite",
        "register",
        "rewrite model source files so that targeted layers become LoRA layers",
    ),
    "merge": (
        "adapters",
        "register_merge",
        "merge a peft/loragen adapter into a safetensors checkpoint (file or shard folder)",
    ),
    "inspect": (
        "adapters",
        "register_inspect",
        "show the target modules, ranks, alphas, scales, sizes and dtypes of an adapter",
    ),
    "bench": ("bench", "register", "run the side-by-side benchmarks (loragen vs peft vs the frozen base)"),
    "demo": ("demo", "register", "run the main job end to end on scikit-learn's digits"),
}


def error(command: str, message: str, status: int = EXIT_INPUT) -> int:
    """Print ``loragen COMMAND: error: MESSAGE`` (one line per line of it) on stderr; returns ``status``."""
    for line in message.splitlines() or [""]:
        print(f"loragen {command}: error: {line}", file=sys.stderr)
    return status


# ---- flag types and the LoRA flags, so that every command spells them alike ----------------------------


def positive_int(text: str) -> int:
    """An ``argparse`` type: a positive integer (else ``argparse.ArgumentTypeError``)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def finite_float(text: str) -> float:
    """An ``argparse`` type: a finite number (else ``argparse.ArgumentTypeError``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def probability(text: str) -> float:
    """An ``argparse`` type: a dropout probability ``0 <= p < 1`` (else ``argparse.ArgumentTypeError``)."""
    value = finite_float(text)
    try:
        return check_dropout(value)
    except LoraConfigError:
        raise argparse.ArgumentTypeError(f"expected a probability with 0 <= p < 1, got {text!r}") from None


def add_lora_arguments(
    parser: argparse.ArgumentParser,
    *,
    r_default: int | None,
    alpha_help: str,
    dropout_default: float | None,
    unset_help: str = "",
) -> None:
    """Add ``--r``, ``--lora-alpha`` and ``--lora-dropout`` (peft's field names) to ``parser``, with these
    defaults (``None``: ``LoraConfig``'s, or where ``unset_help`` says) and ``alpha_help`` saying what
    ``--lora-alpha`` defaults to."""

    r_text = f"{LoraConfig.r}{unset_help}" if r_default is None else str(r_default)
    dropout = (
        f"{LoraConfig.lora_dropout:g}{unset_help}" if dropout_default is None else f"{dropout_default:g}"
    )
    parser.add_argument(
        "--r", type=positive_int, default=r_default, metavar="N", help=f"LoRA rank (default {r_text})"
    )
    parser.add_argument(
        "--lora-alpha", type=finite_float, default=None, metavar="A", help=f"LoRA alpha ({alpha_help})"
    )
    parser.add_argument(
        "--lora-dropout",
        type=probability,
        default=dropout_default,
        metavar="P",
        help=f"dropout on the LoRA branch's input (default {dropout})",
    )


# ---- the parser -----------------------------------------------------------------------------------------


def command_parser(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.ArgumentParser:
    """The innermost (sub)command parser ``argv`` selects (``loragen bench llama ...``: bench's ``llama``)."""
    for token in argv:
        actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if actions and token in actions[0].choices:
            parser = actions[0].choices[token]
    return parser


def flag_hints(parser: argparse.ArgumentParser, tokens: Sequence[str]) -> str:
    """``"; --rank: did you mean --r?"`` for each flag in ``tokens`` that is not one of ``parser``'s options
    but close to one; ``""`` when there is none."""
    options = [o for action in parser._actions for o in action.option_strings if o.startswith("--")]
    hints = []
    for token in tokens:
        if not token.startswith("--") or token == "--":
            continue
        name = token.split("=", 1)[0]
        if name in options:
            continue
        close = difflib.get_close_matches(name, options, n=2, cutoff=0.6)
        if close:
            hints.append(f"{name}: did you mean {' or '.join(close)}?")
    return "".join(f"; {hint}" for hint in dict.fromkeys(hints))


class _Parser(argparse.ArgumentParser):
    """An argument parser (and, through argparse, its subcommands') that takes no abbreviated flags and
    whose errors name the option an unknown flag was probably meant to be."""

    _given: tuple[str, ...] = ()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)  # --target-module is a typo, not --target-modules
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self._given = tuple(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        super().error(message + flag_hints(self, self._given))


def build_parser(commands: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The ``loragen`` argument parser with the subcommands ``commands`` registered in full (None: every one);
    the others are listed with their one-line help only, so that their modules are not imported."""
    parser = _Parser(
        prog="loragen",
        description="Convert PyTorch models into LoRA models, train them fast, read and write peft adapters.",
    )
    parser.add_argument("--version", action="version", version=f"loragen {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command, (module_name, register, help_text) in SUBCOMMANDS.items():
        if commands is None or command in commands:
            module = importlib.import_module(f"loragen.cli.{module_name}")
            getattr(module, register)(subparsers)
        else:
            subparsers.add_parser(command, help=help_text)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``loragen`` command line; returns the exit status."""
    tokens = sys.argv[1:] if argv is None else list(argv)
    first = tokens[0] if tokens else None
    if first is not None and not first.startswith("-") and first not in SUBCOMMANDS:
        close = difflib.get_close_matches(first, list(SUBCOMMANDS), n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        build_parser(()).error(f"unknown command {first!r} (choose from {', '.join(SUBCOMMANDS)}){hint}")
    parser = build_parser([first] if first in SUBCOMMANDS else ())
    args, extras = parser.parse_known_args(tokens)
    if extras:
        # argparse reports a subcommand's unknown flag with the top-level usage: report it with the
        # subcommand's own usage, and the option it was probably meant to be
        command_parser(parser, tokens).error(f"unrecognized arguments: {' '.join(extras)}")
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        status = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's last flush
        return status
    except BrokenPipeError:
        # the reader went away (``| head``): stdout to /dev/null, so that the interpreter's final flush
        # does not fail again, and end as a tool that SIGPIPE ends
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_BROKEN_PIPE

    except KeyboardInterrupt:
        print("loragen: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
