"""Flag types and the LoRA flags shared by the subcommands, so that every command spells them alike.

The LoRA flags carry peft's field names (``--r``, ``--lora-alpha``, ``--lora-dropout``,
``--target-modules``), checked by :mod:`loragen.validation`, so a bad value gets the message a bad
:class:`~loragen.LoraConfig` field would get.
"""

from __future__ import annotations

import argparse
import difflib
import math
from collections.abc import Sequence

from loragen.errors import LoraConfigError
from loragen.validation import check_dropout

__all__ = [
    "add_lora_arguments",
    "finite_float",
    "positive_int",
    "probability",
    "command_parser",
    "flag_hints",
]


def positive_int(text: str) -> int:
    """An ``argparse`` type: a positive integer.

    Raises:
        argparse.ArgumentTypeError: ``text`` is not an integer, or not positive.
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def finite_float(text: str) -> float:
    """An ``argparse`` type: a finite number.

    Raises:
        argparse.ArgumentTypeError: ``text`` is not a number, or is infinite or NaN.
    """
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def probability(text: str) -> float:
    """An ``argparse`` type: a dropout probability ``0 <= p < 1``.

    Raises:
        argparse.ArgumentTypeError: ``text`` is not a number in that range.
    """
    value = finite_float(text)
    try:
        return check_dropout(value)
    except LoraConfigError:
        raise argparse.ArgumentTypeError(f"expected a probability with 0 <= p < 1, got {text!r}") from None


def add_lora_arguments(
    parser: argparse.ArgumentParser, *, r_default: int | None, alpha_help: str, dropout_default: float | None
) -> None:
    """Add ``--r``, ``--lora-alpha`` and ``--lora-dropout`` (peft's field names) to ``parser``.

    Args:
        parser: the subcommand's parser.
        r_default: the default rank (``None``: the command works it out, e.g. from a config file).
        alpha_help: what ``--lora-alpha`` defaults to, in words.
        dropout_default: the default dropout (``None``: the command works it out).
    """
    r_text = "" if r_default is None else f" (default {r_default})"
    dropout_text = "" if dropout_default is None else f" (default {dropout_default:g})"
    parser.add_argument("--r", type=positive_int, default=r_default, metavar="N", help=f"LoRA rank{r_text}")
    parser.add_argument(
        "--lora-alpha", type=finite_float, default=None, metavar="A", help=f"LoRA alpha ({alpha_help})"
    )
    parser.add_argument(
        "--lora-dropout",
        type=probability,
        default=dropout_default,
        metavar="P",
        help=f"dropout on the LoRA branch's input{dropout_text}",
    )


def command_parser(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.ArgumentParser:
    """The innermost (sub)command parser ``argv`` selects (``loragen bench llama ...``: bench's ``llama``)."""
    tokens = list(argv)
    while True:
        subcommands = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        chosen = None
        for action in subcommands:
            for index, token in enumerate(tokens):
                if token in action.choices:
                    chosen = action.choices[token]
                    tokens = tokens[index + 1 :]
                    break
            if chosen is not None:
                break
        if chosen is None:
            return parser
        parser = chosen


def flag_hints(parser: argparse.ArgumentParser, tokens: Sequence[str]) -> str:
    """``"; --rank: did you mean --r?"`` for each flag in ``tokens`` that is not one of ``parser``'s options
    (nor an abbreviation argparse accepts) but close to one (difflib); ``""`` when there is none."""
    options = [o for action in parser._actions for o in action.option_strings if o.startswith("--")]
    hints = []
    for token in tokens:
        if not token.startswith("--") or token == "--":
            continue
        name = token.split("=", 1)[0]
        if any(option.startswith(name) for option in options):
            continue  # an option, or a prefix argparse expands
        close = difflib.get_close_matches(name, options, n=2, cutoff=0.6)
        if close:
            hints.append(f"{name}: did you mean {' or '.join(close)}?")
    return "".join(f"; {hint}" for hint in dict.fromkeys(hints))
