"""Stage 7: what a demo run measured (:class:`DemoResult`), as a Markdown summary and as ``metrics.json``
(typed values: numbers as numbers, booleans as booleans)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from .checks import MATCH_TOLERANCE, AdapterCheck
from .options import MODULES_TO_SAVE, TARGET_MODULES, DemoOptions
from .training import Metrics, TrainLog

__all__ = ["DemoResult", "metrics_record", "speed_note", "summary_table"]


@dataclasses.dataclass(frozen=True)
class DemoResult:
    """What :func:`~loragen._examples.demo.run_demo` measured and wrote."""

    base_source: Metrics
    base_shifted: Metrics
    lora_shifted: Metrics
    lora_source: Metrics
    trainable: int
    total: int
    pretrain_log: TrainLog
    train_log: TrainLog
    adapter: AdapterCheck
    rewritten_max_diff: float
    diff: str
    summary_path: Path
    plot_path: Path

    @property
    def improved(self) -> bool:
        """The fine-tune raised the accuracy on the rotated test digits."""
        return self.lora_shifted.accuracy > self.base_shifted.accuracy

    @property
    def ok(self) -> bool:
        """The fine-tune improved the shifted-domain accuracy and every consistency check passed."""
        return self.improved and self.adapter.ok and self.rewritten_max_diff <= MATCH_TOLERANCE


def summary_table(result: DemoResult, options: DemoOptions) -> str:
    """A short Markdown summary of a demo run."""
    share = 100.0 * result.trainable / result.total
    rows = [
        ("base, upright test digits", result.base_source),
        ("base, rotated test digits", result.base_shifted),
        ("LoRA, rotated test digits", result.lora_shifted),
        ("LoRA, upright test digits", result.lora_source),
    ]
    lines = [
        "| model, data | accuracy | loss |",
        "|---|---:|---:|",
        *(f"| {name} | {m.accuracy:.1%} | {m.loss:.4f} |" for name, m in rows),
        "",
        "| run | value |",
        "|---|---|",
        (
            f"| LoRA r / lora_alpha / lora_dropout | {options.r} / {options.alpha:g} / {options.lora_dropout:g} "
            f"on {', '.join(TARGET_MODULES)}; {', '.join(MODULES_TO_SAVE)} trained fully |"
        ),
        f"| trainable parameters | {result.trainable:,} of {result.total:,} ({share:.2f}%) |",
        (
            f"| pretraining / fine-tune | {len(result.pretrain_log.losses)} steps, "
            f"{result.pretrain_log.steps_per_second:.1f} steps/s / {len(result.train_log.losses)} steps, "
            f"{result.train_log.steps_per_second:.1f} steps/s |"
        ),
        (
            f"| optimizer state (fine-tune) | {result.train_log.optimizer_state_bytes:,} bytes "
            f"({'8-bit AdamW' if options.eight_bit else 'AdamW'}) |"
        ),
        f"| adapter reloaded into a fresh base, max abs diff | {result.adapter.reload_max_diff:.2e} |",
        f"| merged vs unmerged, max abs diff | {result.adapter.merge_max_diff:.2e} |",
        f"| rewritten model file vs runtime conversion, max abs diff | {result.rewritten_max_diff:.2e} |",
        f"| seed / device | {options.seed} / {options.device} |",
    ]
    note = speed_note(result)
    return "\n".join(lines) + "\n" + (f"\n{note}\n" if note else "")


def speed_note(result: DemoResult) -> str:
    """Why the fine-tune's steps/s trails full training's on this model, when it does (else ``""``).

    Measured on this model (a profile of one step): each adapted convolution adds two convolutions to the
    step (the k x k one to ``r`` channels and the 1 x 1 one back) forward and backward, and the frozen
    base still runs its forward and the backward to its input; full training's extra work, the weight
    gradients of the frozen layers, is small at these sizes. Every call carries about the same fixed
    cost whatever its size, so on a model this small the call count decides.
    """
    full, lora = result.pretrain_log.steps_per_second, result.train_log.steps_per_second
    if not (0 < lora < full):
        return ""
    return (
        f"The fine-tune ran at {lora / full:.0%} of full training's steps/s. That is the size of this model, "
        "not LoRA's cost at scale: every adapted convolution adds two small convolutions to each step "
        "(k x k to r channels, 1 x 1 back), forward and backward, while the frozen base still runs its "
        "forward and the backward to its input. On layers this small each call costs about the same fixed "
        "time whatever its size, so the extra calls outweigh the weight gradients LoRA saves. On large "
        "layers LoRA's step is the cheaper one (`loragen bench llama` at its default sizes compares it with full fine-tuning), and its "
        "trainable parameters and optimizer state (above) are a small fraction at any size."
    )


def _log_record(log: TrainLog) -> dict[str, Any]:
    return {
        "steps": len(log.losses),
        "seconds": log.seconds,
        "steps_per_second": log.steps_per_second,
        "optimizer_state_bytes": log.optimizer_state_bytes,
        "losses": log.losses,
        "evals": [dataclasses.asdict(point) for point in log.evals],
    }


def metrics_record(result: DemoResult, options: DemoOptions) -> dict[str, Any]:
    """``metrics.json``'s content: every figure of the run as a JSON number or boolean, the options typed.

    Keys: ``base_source``, ``base_shifted``, ``lora_shifted``, ``lora_source`` (``{"loss", "accuracy"}``;
    source = upright, shifted = rotated test digits), ``trainable``, ``total``, ``pretrain`` and
    ``finetune`` (steps, seconds, losses per step, test metrics every few steps as ``evals``),
    ``pretrain_losses`` / ``finetune_losses`` / ``optimizer_state_bytes`` (the fine-tune's), ``checks``
    (max abs diffs, the tolerance, ``ok`` per check), ``improved``, ``ok`` and ``options``.
    """
    return {
        "base_source": dataclasses.asdict(result.base_source),
        "base_shifted": dataclasses.asdict(result.base_shifted),
        "lora_shifted": dataclasses.asdict(result.lora_shifted),
        "lora_source": dataclasses.asdict(result.lora_source),
        "trainable": result.trainable,
        "total": result.total,
        "pretrain": _log_record(result.pretrain_log),
        "finetune": _log_record(result.train_log),
        "pretrain_losses": result.pretrain_log.losses,
        "finetune_losses": result.train_log.losses,
        "optimizer_state_bytes": result.train_log.optimizer_state_bytes,
        "checks": {
            "tolerance": MATCH_TOLERANCE,
            "adapter_reload_max_diff": result.adapter.reload_max_diff,
            "merge_max_diff": result.adapter.merge_max_diff,
            "adapter_ok": result.adapter.ok,
            "rewritten_max_diff": result.rewritten_max_diff,
            "rewritten_ok": result.rewritten_max_diff <= MATCH_TOLERANCE,
        },
        "improved": result.improved,
        "ok": result.ok,
        "options": options.as_record(),
    }
