"""The settings of one demo run, the demo's error, and the adapter it trains."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from loragen.config import LoraConfig

__all__ = ["DemoError", "DemoOptions", "MODULES_TO_SAVE", "TARGET_MODULES", "demo_config"]

# LoRA on the feature extractor and the hidden layer; the classifier head is trained fully.
TARGET_MODULES = ("conv1", "conv2", "fc")
MODULES_TO_SAVE = ("head",)


class DemoError(RuntimeError):
    """A demo stage failed; the message names the stage and what went wrong."""


@dataclasses.dataclass(frozen=True)
class DemoOptions:
    """Settings of one demo run. ``quick`` shortens both trainings (for CI) unless steps are given.

    ``r``, ``lora_alpha`` and ``lora_dropout`` are peft's fields; ``lora_alpha=None`` means ``2 * r``.
    """

    steps: int | None = None
    pretrain_steps: int | None = None
    r: int = 8
    lora_alpha: float | None = None
    lora_dropout: float = 0.0
    output: Path = Path("loragen-demo")
    device: str = "cpu"
    seed: int = 0
    batch_size: int = 64
    lr: float = 3e-3
    eight_bit: bool = False
    quick: bool = False
    progress: bool = True

    @property
    def finetune_steps(self) -> int:
        """LoRA fine-tuning steps actually run."""
        return self.steps if self.steps is not None else (100 if self.quick else 300)

    @property
    def base_steps(self) -> int:
        """Pretraining steps actually run."""
        return self.pretrain_steps if self.pretrain_steps is not None else (150 if self.quick else 400)

    @property
    def alpha(self) -> float:
        """The LoRA alpha actually used: ``lora_alpha``, or ``2 * r`` when it is ``None``."""
        return 2 * self.r if self.lora_alpha is None else self.lora_alpha

    def as_record(self) -> dict[str, Any]:
        """The settings as JSON-ready typed values, with the defaults resolved (steps, alpha)."""
        record = dataclasses.asdict(self)
        record.update(
            steps=self.finetune_steps,
            pretrain_steps=self.base_steps,
            lora_alpha=self.alpha,
            output=str(self.output),
        )
        return record


def demo_config(options: DemoOptions) -> LoraConfig:
    """The demo's adapter: ``options``' rank, alpha and dropout on conv1, conv2 and fc; head trained fully.

    Raises:
        loragen.errors.LoraConfigError: the rank, alpha or dropout is invalid.
    """
    return LoraConfig(
        r=options.r,
        lora_alpha=options.alpha,
        lora_dropout=options.lora_dropout,
        target_modules=list(TARGET_MODULES),
        modules_to_save=list(MODULES_TO_SAVE),
    )
