"""An unknown flag gets the subcommand's own usage and a "did you mean", for every subcommand."""

from __future__ import annotations

import argparse

import pytest

from loragen.cli import SUBCOMMANDS, build_parser, main


def _commands() -> list[tuple[list[str], argparse.ArgumentParser]]:
    """``(command words, parser)`` for every subcommand and every ``bench`` benchmark."""
    found = []

    def walk(words: list[str], parser: argparse.ArgumentParser) -> None:
        subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if words:
            found.append((words, parser))
        for action in subparsers:
            for name, sub in action.choices.items():
                walk([*words, name], sub)

    walk([], build_parser())
    return found


def _option(parser: argparse.ArgumentParser) -> str | None:
    return next(
        (o for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"), None
    )


COMMANDS = _commands()
WITH_OPTIONS = [(words, parser) for words, parser in COMMANDS if _option(parser) is not None]


def test_every_subcommand_is_covered() -> None:
    assert {words[0] for words, _ in COMMANDS} == set(SUBCOMMANDS)
    # every command but bench's group (which only picks a benchmark) has options of its own
    assert {" ".join(w) for w, _ in COMMANDS} - {" ".join(w) for w, _ in WITH_OPTIONS} == {"bench"}


@pytest.mark.parametrize(("words", "parser"), WITH_OPTIONS, ids=[" ".join(w) for w, _ in WITH_OPTIONS])
def test_a_misspelt_flag_gets_the_subcommands_usage_and_a_suggestion(
    words: list[str], parser: argparse.ArgumentParser, capsys: pytest.CaptureFixture[str]
) -> None:
    option = _option(parser)
    assert option is not None
    misspelt = option + "x"  # not a prefix of any option, close to this one
    with pytest.raises(SystemExit) as exit_info:
        main([*words, misspelt])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: loragen {' '.join(words)} ")
    assert f"{misspelt}: did you mean {option}" in err


def test_rewrite_rank_suggests_r(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["rewrite", "--rank", "8", "model.py"])
    err = capsys.readouterr().err
    assert err.startswith("usage: loragen rewrite ")
    assert "loragen rewrite: error: unrecognized arguments: --rank; --rank: did you mean --r?" in err


def test_a_flag_far_from_every_option_gets_no_guess(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["inspect", "--zzzzzzzz", "folder"])
    err = capsys.readouterr().err
    assert "unrecognized arguments: --zzzzzzzz" in err and "did you mean" not in err
