"""The command line's conventions, for every command: an unknown flag or command gets its usage and a "did
you mean"; flags are never abbreviated; exit statuses as docs/cli.md says (1 input error, 2 usage error); a
closed output pipe ends a command quietly; ``loragen --help`` imports no torch; ``loragen inspect`` reports
every adapter of a folder."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
from torch import nn

import loragen
from loragen.cli import EXIT_INPUT, EXIT_USAGE, SUBCOMMANDS, build_parser, main


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


# ---- commands, abbreviations, exit statuses, pipes ----------------------------------------------------

SOURCE = (
    "from torch import nn\n\n\nclass M(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
)


def _run(*args: str, read: int | None = None) -> subprocess.CompletedProcess[str]:
    """``loragen ARGS`` in a fresh interpreter; ``read``: close the output pipe after that many bytes."""
    command = [sys.executable, "-c", "import sys; from loragen.cli import main; sys.exit(main())", *args]
    if read is None:
        return subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as process:
        assert process.stdout is not None and process.stderr is not None
        head = process.stdout.read(read)
        process.stdout.close()
        stderr = process.stderr.read()
        status = process.wait(timeout=300)
    return subprocess.CompletedProcess(command, status, head, stderr)


def test_a_misspelt_command_gets_a_suggestion(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["mrege", "--base", "b"])
    assert exit_info.value.code == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("usage: loragen ") and "unknown command 'mrege'" in err
    assert "did you mean 'merge'?" in err


def test_an_abbreviated_flag_is_not_taken_for_the_flag(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    source = tmp_path / "m.py"
    source.write_text(SOURCE + "        self.q = nn.Linear(2, 2)\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["rewrite", str(source), "--target-module", "q", "--diff"])
    assert exit_info.value.code == EXIT_USAGE
    assert "--target-module: did you mean --target-modules" in capsys.readouterr().err
    assert main(["rewrite", str(source), "--target-modules", "q", "--diff"]) == 0


@pytest.mark.parametrize(
    "args",
    [
        ["rewrite", "{missing}", "--target-modules", "q"],
        ["merge", "--base", "{missing}", "--adapter", "{missing}", "-o", "{out}"],
        ["inspect", "{missing}"],
    ],
    ids=["rewrite", "merge", "inspect"],
)
def test_a_missing_path_is_an_input_error_for_every_command(
    args: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "missing"
    filled = [a.format(missing=missing, out=tmp_path / "out") for a in args]
    assert main(filled) == EXIT_INPUT
    err = capsys.readouterr().err
    assert err.startswith(f"loragen {args[0]}: error: ") and str(missing) in err


def test_a_usage_error_is_2_for_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    for command in SUBCOMMANDS:
        with pytest.raises(SystemExit) as exit_info:
            main([command, "--no-such-flag-at-all"])
        assert exit_info.value.code == EXIT_USAGE, command
    capsys.readouterr()


def test_help_imports_no_torch() -> None:
    script = (
        "import sys\nfrom loragen.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print('torch' in sys.modules, 'libcst' in sys.modules, file=sys.stderr)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "merge" in done.stdout and "inspect" in done.stdout
    assert done.stderr.strip().splitlines()[-1] == "False False"


def test_rewrite_diff_into_a_closed_pipe_exits_quietly(tmp_path: Path) -> None:
    source = tmp_path / "wide.py"
    source.write_text(SOURCE + "".join(f"        self.q{i} = nn.Linear(2, 2)\n" for i in range(2000)))
    done = _run("rewrite", str(source), "--target-modules", "all-linear", "--diff", "-q", read=100)
    assert done.stdout.startswith("---")
    assert done.returncode == 141 and "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr


def _named_adapters(folder: Path, names: list[str], count: int = 4) -> None:
    torch_model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(count)])
    for name in names:
        loragen.add_adapter(torch_model, loragen.LoraConfig(r=1, target_modules="all-linear"), name)
    loragen.save_adapter(torch_model, folder)


def test_inspect_json_into_a_closed_pipe_exits_quietly(tmp_path: Path) -> None:
    _named_adapters(tmp_path / "adapter", ["default"], count=600)
    done = _run("inspect", str(tmp_path / "adapter"), "--json", read=100)
    assert done.stdout.startswith("{")
    assert done.returncode == 141 and "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr


@pytest.mark.parametrize("names", [["default", "b"], ["x", "y"]], ids=["root-and-named", "named-only"])
def test_inspect_reports_every_named_adapter(
    names: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _named_adapters(tmp_path / "adapter", names)
    assert main(["inspect", str(tmp_path / "adapter")]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"2 adapters in {tmp_path / 'adapter'}: {', '.join(names)}\n")
    for name in names:
        assert f"== adapter {name!r} ==" in text
    assert main(["inspect", str(tmp_path / "adapter"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert sorted(report["adapters"]) == sorted(names)
    assert all(r["totals"]["modules"] == 4 for r in report["adapters"].values())


def test_inspect_names_the_root_adapter_apart_from_a_default_subfolder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _named_adapters(tmp_path / "adapter", ["default", "b"])
    (tmp_path / "adapter" / "b").rename(tmp_path / "moved")
    (tmp_path / "adapter" / "default").mkdir()
    for item in (tmp_path / "adapter").iterdir():
        if item.is_file():
            item.rename(tmp_path / "adapter" / "default" / item.name)
    for item in (tmp_path / "moved").iterdir():
        item.rename(tmp_path / "adapter" / item.name)
    # b at the root (save_pretrained's layout when b is active), "default" in its subfolder
    assert main(["inspect", str(tmp_path / "adapter"), "--json"]) == 0
    assert sorted(json.loads(capsys.readouterr().out)["adapters"]) == ["(root)", "default"]


def test_inspect_of_a_single_adapter_keeps_its_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _named_adapters(tmp_path / "adapter", ["default"])
    assert main(["inspect", str(tmp_path / "adapter"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["totals"]["modules"] == 4
