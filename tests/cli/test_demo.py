"""Tests for loragen demo: each stage on its own, a shortened end-to-end run, and determinism."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")

import loragen
from loragen.cli import demo as demo_command
from loragen._examples.demo import (
    DemoError,
    DemoOptions,
    bundled_model_file,
    demo_config,
    load_digits_domains,
    load_model_class,
    rewrite_model_file,
    rotate,
    run_demo,
)


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
    new_code, diff = rewrite_model_file(path, demo_config(4))
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
    with pytest.raises(DemoError, match="plain.py changed nothing; expected conv1, conv2, fc"):
        rewrite_model_file(plain, demo_config(4))


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


def test_cli_rejects_bad_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _demo_parser().parse_args(["demo", "--steps", "0"])
    assert "expected a positive integer, got 0" in capsys.readouterr().err


# --- end to end -------------------------------------------------------------------------------------


def test_quick_demo_improves_the_metric_and_checks_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = _demo_parser().parse_args(
        ["demo", "--quick", "--no-progress", "--output", str(tmp_path), "--rank", "4"]
    )
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert "+        self.fc = LoraLinear(2 * width * 4 * 4, hidden, r=4, lora_alpha=8)" in printed
    assert "-> OK" in printed and "MISMATCH" not in printed

    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["base_source"]["accuracy"] > 0.9  # a genuinely trained base
    assert metrics["base_shifted"]["accuracy"] < 0.4  # which the rotation breaks
    assert metrics["lora_shifted"]["accuracy"] > metrics["base_shifted"]["accuracy"] + 0.4
    assert metrics["lora_shifted"]["loss"] < metrics["base_shifted"]["loss"]
    assert 0 < metrics["trainable"] < 0.1 * metrics["total"]
    assert len(metrics["finetune_losses"]) == 100 and len(metrics["pretrain_losses"]) == 150

    summary = (tmp_path / "summary.md").read_text()
    assert "| LoRA, rotated test digits |" in summary and "trainable parameters" in summary
    assert (tmp_path / "loss_curve.png").read_bytes().startswith(b"\x89PNG")
    assert (tmp_path / "digits_model_lora.py").read_text().count("LoraConv2d(") == 2
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["modules_to_save"] == ["head"]
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()


def test_demo_is_deterministic_for_a_seed(tmp_path: Path) -> None:
    def losses(seed: int, name: str) -> tuple[list[float], list[float], float]:
        options = DemoOptions(steps=15, pretrain_steps=20, seed=seed, output=tmp_path / name, progress=False)
        result = run_demo(options)
        metrics = json.loads((tmp_path / name / "metrics.json").read_text())
        return metrics["pretrain_losses"], metrics["finetune_losses"], result.lora_shifted.accuracy

    first, second, other = losses(5, "a"), losses(5, "b"), losses(6, "c")
    assert first == second
    assert other[0] != first[0] and other[1] != first[1]
