"""The whole job: every stage in order, each reported as it runs, the outputs written under one folder."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TextIO

import torch

from loragen.atomic import atomic_write_text
from loragen.convert import count_parameters

from .checks import MATCH_TOLERANCE, check_adapter_roundtrip, check_rewritten_model
from .data import load_digits_domains
from .model_file import bundled_model_file, load_model_class, rewrite_model_file
from .options import TARGET_MODULES, DemoError, DemoOptions, demo_config
from .plot import FIGURE_NAME, plot_training
from .report import DemoResult, metrics_record, summary_table
from .training import evaluate, finetune_lora, pretrain_base

__all__ = ["resolve_device", "run_demo"]


def resolve_device(name: str) -> torch.device:
    """The device named by ``--device`` (``auto``: CUDA when available, else the CPU).

    Raises:
        DemoError: a CUDA device is named but CUDA is not available.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DemoError(f"--device {name}: CUDA is not available here; use --device cpu")
    return device


def run_demo(options: DemoOptions, out: TextIO | None = None, progress: TextIO | None = None) -> DemoResult:
    """Run every stage; write ``summary.md``, ``training_curves.png``, ``metrics.json``, the rewritten model
    file and ``adapter/`` under ``options.output``.

    Args:
        options: the run's settings.
        out: receives a report of each stage (nothing is reported when it is ``None``).
        progress: receives the training progress when ``options.progress`` is set (default ``sys.stderr``):
            a bar on a terminal, plain lines otherwise.

    Raises:
        DemoError: a stage failed (scikit-learn or matplotlib missing, rewrite failed, CUDA unavailable).
        loragen.errors.LoraConfigError: ``options`` holds an invalid rank, alpha or dropout.
    """

    def say(text: str) -> None:
        if out is not None:
            out.write(text + "\n")
            out.flush()

    progress = sys.stderr if progress is None else progress
    device = resolve_device(options.device)
    config = demo_config(options)
    output = Path(options.output)
    output.mkdir(parents=True, exist_ok=True)

    model_path = bundled_model_file()
    say(
        f"== 1. loragen rewrite {model_path.name} "
        f"(r={options.r}, lora_alpha={options.alpha:g}, target_modules={','.join(TARGET_MODULES)})"
    )
    base_cls = load_model_class(
        model_path.read_text(encoding="utf-8"), "loragen_demo_digits_model", str(model_path)
    )
    new_code, diff = rewrite_model_file(model_path, config)
    say(diff)
    rewritten_path = output / f"{model_path.stem}_lora.py"
    atomic_write_text(rewritten_path, new_code)
    rewritten_cls = load_model_class(new_code, "loragen_demo_digits_model_lora", str(rewritten_path))

    data = load_digits_domains(options.seed).to(device)
    say(
        f"== 2. data: scikit-learn digits, {len(data.train_y)} train / {len(data.test_y)} test; "
        "shifted domain = rotated 90 degrees"
    )

    say(f"== 3. pretrain the base on upright digits ({options.base_steps} steps)")
    base, base_log = pretrain_base(base_cls, data, options, device, progress)
    base_source = evaluate(base, data.test_x, data.test_y)
    base_shifted = evaluate(base, data.shifted_test_x, data.test_y)
    say(f"   base accuracy: upright {base_source.accuracy:.1%}, rotated {base_shifted.accuracy:.1%}")
    base_state = {key: value.detach().clone() for key, value in base.state_dict().items()}

    say(f"== 4. LoRA fine-tune on rotated digits ({options.finetune_steps} steps)")
    model, lora_log = finetune_lora(base, data, config, options, progress)
    trainable, total = count_parameters(model.parameters())
    lora_shifted = evaluate(model, data.shifted_test_x, data.test_y)
    lora_source = evaluate(model, data.test_x, data.test_y)
    say(f"   trainable parameters: {trainable:,} of {total:,} ({100.0 * trainable / total:.2f}%)")
    say(
        f"   rotated-digit accuracy: {base_shifted.accuracy:.1%} -> {lora_shifted.accuracy:.1%} "
        f"(loss {base_shifted.loss:.3f} -> {lora_shifted.loss:.3f}); {lora_log.steps_per_second:.1f} steps/s"
    )

    say("== 5. save the adapter (peft format), reload into a fresh base, merge")
    adapter = check_adapter_roundtrip(model, base_cls, base_state, output / "adapter", data.shifted_test_x)
    say(
        f"   {adapter.adapter_dir}: reload max diff {adapter.reload_max_diff:.2e}, "
        f"merged vs unmerged {adapter.merge_max_diff:.2e} -> {'OK' if adapter.ok else 'MISMATCH'}"
    )

    say("== 6. the rewritten model file + base checkpoint + adapter")
    rewritten_diff = check_rewritten_model(
        rewritten_cls, model, base_state, adapter.adapter_dir, data.shifted_test_x
    )
    say(
        f"   max diff vs the trained model {rewritten_diff:.2e} -> "
        f"{'OK' if rewritten_diff <= MATCH_TOLERANCE else 'MISMATCH'}"
    )

    plot_path = plot_training(base_log, lora_log, options, output / FIGURE_NAME)
    result = DemoResult(
        base_source=base_source,
        base_shifted=base_shifted,
        lora_shifted=lora_shifted,
        lora_source=lora_source,
        trainable=trainable,
        total=total,
        pretrain_log=base_log,
        train_log=lora_log,
        adapter=adapter,
        rewritten_max_diff=rewritten_diff,
        diff=diff,
        summary_path=output / "summary.md",
        plot_path=plot_path,
    )
    table = summary_table(result, options)
    atomic_write_text(result.summary_path, "# loragen demo\n\n" + table)
    metrics_path = output / "metrics.json"
    atomic_write_text(metrics_path, json.dumps(metrics_record(result, options), indent=1) + "\n")
    say("== 7. summary")
    say(table)
    say(f"wrote {result.summary_path}, {plot_path}, {metrics_path}, {rewritten_path}, {adapter.adapter_dir}/")
    return result
