"""Tests for loragen demo: each stage on its own, progress reporting, a shortened end-to-end run with
typed metrics.json and the figure, and determinism."""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")

import loragen
from loragen._examples.demo import (
    FIGURE_NAME,
    DemoError,
    DemoOptions,
    Progress,
    bundled_model_file,
    demo_config,
    load_digits_domains,
    load_model_class,
    rewrite_model_file,
    rotate,
    run_demo,
)
from loragen.cli import demo as demo_command


def _demo_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loragen")
    demo_command.register(parser.add_subparsers())
    return parser


# --- stages ------------------------------------------------------------------------------------------


def test_bundled_model_file_defines_a_working_classifier() -> None:
    path = bundled_model_file()
    assert path.name == "digits_model.py"
    model = load_model_class(path.read_text(encoding="utf-8"), "digits_model_under_test", str(path))()
    assert model(torch.zeros(3, 1, 8, 8)).shape == (3, 10)


def test_load_model_class_reports_a_missing_class() -> None:
    with pytest.raises(DemoError, match=r"x\.py: defines no nn\.Module class 'DigitsNet'"):
        load_model_class("VALUE = 1\n", "no_model_here", "x.py")


def test_rewrite_stage_turns_the_targets_into_lora_layers_keeping_base_keys() -> None:
    path = bundled_model_file()
    new_code, diff = rewrite_model_file(path, demo_config(DemoOptions(r=4)))
    assert "-        self.fc = nn.Linear(2 * width * 4 * 4, hidden)" in diff
    assert "+        self.conv1 = LoraConv2d(1, width, kernel_size=3, padding=1, r=4, lora_alpha=8)" in diff
    base = load_model_class(path.read_text(encoding="utf-8"), "digits_base", str(path))()
    lora = load_model_class(new_code, "digits_lora", "<rewritten>")()
    assert isinstance(lora.conv1, loragen.LoraConv2d) and isinstance(lora.fc, loragen.LoraLinear)
    assert type(lora.head) is torch.nn.Linear  # modules_to_save are not rewritten
    result = lora.load_state_dict(base.state_dict(), strict=False)
    assert not result.unexpected_keys and all(".lora_" in key for key in result.missing_keys)
    assert len(result.missing_keys) == 6


def test_rewrite_stage_refuses_a_file_without_targets(tmp_path: Path) -> None:
    plain = tmp_path / "plain.py"
    plain.write_text("from torch import nn\n\nclass DigitsNet(nn.Module):\n    pass\n", encoding="utf-8")
    with pytest.raises(DemoError, match=r"plain\.py changed nothing; expected conv1, conv2, fc"):
        rewrite_model_file(plain, demo_config(DemoOptions(r=4)))


def test_demo_config_takes_peft_fields_with_alpha_defaulting_to_twice_r() -> None:
    config = demo_config(DemoOptions(r=4, lora_dropout=0.1))
    assert (config.r, config.lora_alpha, config.lora_dropout) == (4, 8, 0.1)
    assert demo_config(DemoOptions(r=4, lora_alpha=3.0)).lora_alpha == 3.0
    with pytest.raises(loragen.LoraConfigError, match=r"lora_dropout=1\.5"):
        demo_config(DemoOptions(lora_dropout=1.5))


def test_digits_domains_are_a_seeded_split_and_a_rotation() -> None:
    data = load_digits_domains(seed=3)
    assert data.train_x.shape == (1348, 1, 8, 8) and data.test_x.shape == (449, 1, 8, 8)
    assert 0.0 <= float(data.train_x.min()) and float(data.train_x.max()) <= 1.0
    assert torch.equal(data.shifted_train_x, rotate(data.train_x))
    assert torch.equal(torch.rot90(data.shifted_test_x, -1, dims=(-2, -1)), data.test_x)
    again = load_digits_domains(seed=3)
    assert torch.equal(again.test_y, data.test_y)
    assert not torch.equal(load_digits_domains(seed=4).test_y, data.test_y)


def test_cuda_device_without_cuda_is_a_clear_error(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(DemoError, match="--device cuda: CUDA is not available here; use --device cpu"):
        run_demo(DemoOptions(device="cuda", output=tmp_path, progress=False))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "0"], "expected a positive integer, got '0'"),
        (["--r", "0"], "expected a positive integer, got '0'"),
        (["--lora-dropout", "1"], "expected a probability with 0 <= p < 1, got '1'"),
        (["--lora-alpha", "nan"], "expected a finite number, got 'nan'"),
        (["--rank", "4"], "unrecognized arguments: --rank 4"),
    ],
)
def test_cli_rejects_bad_flags(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit):
        _demo_parser().parse_args(["demo", *argv])
    assert message in capsys.readouterr().err


def test_cli_lora_flags_have_peft_names() -> None:
    args = _demo_parser().parse_args(["demo", "--r", "4", "--lora-alpha", "6", "--lora-dropout", "0.05"])
    assert (args.r, args.lora_alpha, args.lora_dropout) == (4, 6.0, 0.05)
    defaults = _demo_parser().parse_args(["demo"])
    assert (defaults.r, defaults.lora_alpha, defaults.lora_dropout) == (8, None, 0.0)


# --- progress ---------------------------------------------------------------------------------------


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_in_a_log_is_a_plain_line_every_tenth() -> None:
    stream = io.StringIO()  # not a terminal: a pipe or a file
    with Progress("phase", 95, stream) as progress:
        for step in range(1, 96):
            progress.update(step, 1.0 / step)
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue()
    assert [line.split(" (")[0] for line in lines] == [
        f"phase: step {s}/95" for s in (*range(10, 95, 10), 95)
    ]
    assert lines[-1].startswith("phase: step 95/95 (100%), loss 0.0105, ") and lines[-1].endswith(" s left")


def test_progress_bar_postfix_does_not_force_redraws() -> None:
    stream = _Terminal()
    # with an hour between timed redraws, only opening and closing the bar may draw it
    with Progress("phase", 100, stream, min_interval=3600.0) as progress:
        for step in range(1, 101):
            progress.update(step, 1.0 / step)
    assert 1 <= stream.getvalue().count("\r") <= 3
    assert "100/100" in stream.getvalue()


def test_progress_to_nowhere_writes_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    # even asked for a bar: a bar without a stream would be tqdm's default, stderr
    with Progress("phase", 10, None, interactive=True) as progress:
        for step in range(1, 11):
            progress.update(step, 0.5)
    assert capsys.readouterr() == ("", "")


# --- end to end -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_quick_demo_improves_the_metric_and_checks_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = _demo_parser().parse_args(["demo", "--quick", "--output", str(tmp_path), "--r", "4"])
    assert args.func(args) == 0
    captured = capsys.readouterr()
    printed = captured.out
    assert "+        self.fc = LoraLinear(2 * width * 4 * 4, hidden, r=4, lora_alpha=8)" in printed
    assert "-> OK" in printed and "MISMATCH" not in printed
    # stderr is not a terminal here: plain progress lines, ten per phase, no carriage returns
    assert "\r" not in captured.err
    progress = [line.split(", loss ")[0] for line in captured.err.splitlines()]
    assert progress == [
        f"pretrain (upright): step {s}/150 ({s * 100 // 150}%)" for s in range(15, 151, 15)
    ] + [f"LoRA fine-tune (rotated): step {s}/100 ({s}%)" for s in range(10, 101, 10)]

    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["base_source"]["accuracy"] > 0.9  # a genuinely trained base
    assert metrics["base_shifted"]["accuracy"] < 0.4  # which the rotation breaks
    assert metrics["lora_shifted"]["accuracy"] > metrics["base_shifted"]["accuracy"] + 0.4
    assert metrics["lora_shifted"]["loss"] < metrics["base_shifted"]["loss"]
    assert 0 < metrics["trainable"] < 0.1 * metrics["total"]
    assert len(metrics["finetune_losses"]) == 100 and len(metrics["pretrain_losses"]) == 150
    assert metrics["ok"] is True and metrics["improved"] is True
    assert metrics["checks"]["adapter_ok"] is True and metrics["checks"]["rewritten_ok"] is True

    # typed values: numbers as numbers, booleans as booleans, defaults resolved
    options = metrics["options"]
    assert options["r"] == 4 and type(options["r"]) is int
    assert options["lora_alpha"] == 8 and options["lora_dropout"] == 0.0
    assert options["steps"] == 100 and options["pretrain_steps"] == 150
    assert options["lr"] == 3e-3 and options["seed"] == 0 and options["batch_size"] == 64
    assert options["eight_bit"] is False and options["quick"] is True and options["progress"] is True
    assert options["output"] == str(tmp_path) and options["device"] == "cpu"

    # test accuracy every few steps of both phases: the rotated curve rises during the fine-tune
    for phase, steps in (("pretrain", 150), ("finetune", 100)):
        evals = metrics[phase]["evals"]
        assert evals[0]["step"] == 0 and evals[-1]["step"] == steps and len(evals) >= 20
        assert all(type(e["step"]) is int and 0.0 <= e["rotated"]["accuracy"] <= 1.0 for e in evals)
    # (the curves evaluate both test sets in one batch: the same figures up to rounding)
    finetune = metrics["finetune"]["evals"]
    assert finetune[0]["rotated"]["accuracy"] == pytest.approx(metrics["base_shifted"]["accuracy"], abs=0.01)
    assert finetune[-1]["rotated"]["accuracy"] == pytest.approx(metrics["lora_shifted"]["accuracy"], abs=0.01)
    assert metrics["pretrain"]["evals"][-1]["upright"]["accuracy"] == pytest.approx(
        metrics["base_source"]["accuracy"], abs=0.01
    )

    summary = (tmp_path / "summary.md").read_text()
    assert "| LoRA, rotated test digits |" in summary and "trainable parameters" in summary
    assert "| LoRA r / lora_alpha / lora_dropout | 4 / 8 / 0 on conv1, conv2, fc" in summary
    assert (tmp_path / FIGURE_NAME).read_bytes().startswith(b"\x89PNG")
    assert (tmp_path / "digits_model_lora.py").read_text().count("LoraConv2d(") == 2
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["modules_to_save"] == ["head"]
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.slow
def test_demo_is_deterministic_for_a_seed(tmp_path: Path) -> None:
    def losses(seed: int, name: str) -> tuple[list[float], list[float], float]:
        options = DemoOptions(steps=15, pretrain_steps=20, seed=seed, output=tmp_path / name, progress=False)
        result = run_demo(options)
        metrics = json.loads((tmp_path / name / "metrics.json").read_text())
        return metrics["pretrain_losses"], metrics["finetune_losses"], result.lora_shifted.accuracy

    first, second, other = losses(5, "a"), losses(5, "b"), losses(6, "c")
    assert first == second
    assert other[0] != first[0] and other[1] != first[1]


def test_the_summary_explains_a_fine_tune_slower_per_step_than_full_training() -> None:
    from types import SimpleNamespace

    from loragen._examples.demo.report import speed_note
    from loragen._examples.demo.training import TrainLog

    def log(steps_per_second: float) -> TrainLog:
        return TrainLog([0.5] * 10, [], 10 / steps_per_second, 0)

    slower = speed_note(SimpleNamespace(pretrain_log=log(3.8), train_log=log(1.8)))  # type: ignore[arg-type]
    assert slower.startswith("The fine-tune ran at 47% of full training's steps/s.")
    assert "two small convolutions" in slower and "loragen bench llama" in slower
    assert speed_note(SimpleNamespace(pretrain_log=log(2.0), train_log=log(2.5))) == ""  # type: ignore[arg-type]
