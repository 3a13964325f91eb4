"""Stages 3 and 4: pretrain the plain model on upright digits, then LoRA-fine-tune it on rotated digits.

Both phases record the training loss of every step and, every few steps, the test accuracy on both
domains (the curves in the demo's figure). Evaluation runs in eval mode and draws no random numbers,
so it does not change what trains.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TextIO

import torch
from torch import nn
from torch.nn import functional as F

from loragen import LoraConfig, get_lora_model, make_optimizer
from loragen.training.optimizers import optimizer_state_bytes

from .data import DigitsData
from .options import DemoOptions
from .progress import Progress

__all__ = [
    "EVAL_POINTS",
    "EvalPoint",
    "Metrics",
    "TrainLog",
    "evaluate",
    "finetune_lora",
    "pretrain_base",
    "train",
]

# Test-set evaluations per phase (plus one before the first step): enough points for a smooth curve.
EVAL_POINTS = 25


@dataclasses.dataclass(frozen=True)
class Metrics:
    """Mean cross-entropy loss and accuracy (0..1) of a model on one test set."""

    loss: float
    accuracy: float


@dataclasses.dataclass(frozen=True)
class EvalPoint:
    """Test metrics on both domains after ``step`` steps of a phase."""

    step: int
    upright: Metrics
    rotated: Metrics


@dataclasses.dataclass(frozen=True)
class TrainLog:
    """One phase: per-step training losses, test metrics every few steps, training wall time (evaluation
    excluded) and the optimizer's state size in bytes."""

    losses: list[float]
    evals: list[EvalPoint]
    seconds: float
    optimizer_state_bytes: int

    @property
    def steps_per_second(self) -> float:
        """Training throughput."""
        return len(self.losses) / self.seconds if self.seconds > 0 else float("inf")


@torch.no_grad()
def evaluate(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> Metrics:
    """Loss and accuracy of ``model`` in eval mode (its training mode is restored afterwards)."""
    was_training = model.training
    model.eval()
    logits = model(images)
    model.train(was_training)
    return Metrics(F.cross_entropy(logits, labels).item(), (logits.argmax(1) == labels).float().mean().item())


@torch.no_grad()
def _eval_point(model: nn.Module, data: DigitsData, step: int) -> EvalPoint:
    """Both domains' test metrics from one forward over both test sets (what :func:`evaluate` computes)."""
    was_training = model.training
    model.eval()
    logits = model(torch.cat([data.test_x, data.shifted_test_x])).chunk(2)  # (N, 10) per domain
    model.train(was_training)
    upright, rotated = (
        Metrics(F.cross_entropy(z, data.test_y).item(), (z.argmax(1) == data.test_y).float().mean().item())
        for z in logits
    )
    return EvalPoint(step, upright, rotated)


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: DigitsData,
    *,
    rotated: bool,
    steps: int,
    batch_size: int,
    seed: int,
    progress: Progress,
) -> TrainLog:
    """Train ``model`` for ``steps`` steps on random batches (seeded) of one domain's training set.

    Args:
        rotated: train on the rotated digits (else the upright ones).
        progress: receives every step's loss.
    """
    images = data.shifted_train_x if rotated else data.train_x
    labels = data.train_y
    generator = torch.Generator().manual_seed(seed)
    eval_every = max(1, -(-steps // EVAL_POINTS))
    evals = [_eval_point(model, data, 0)]
    losses: list[float] = []
    seconds = 0.0
    model.train()
    with progress:
        for step in range(1, steps + 1):
            start = time.perf_counter()
            index = torch.randint(0, len(labels), (batch_size,), generator=generator).to(labels.device)
            loss = F.cross_entropy(model(images[index]), labels[index])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            seconds += time.perf_counter() - start
            progress.update(step, losses[-1])
            if step % eval_every == 0 or step == steps:
                evals.append(_eval_point(model, data, step))
    return TrainLog(losses, evals, seconds, optimizer_state_bytes(optimizer))


def _progress(description: str, steps: int, options: DemoOptions, stream: TextIO | None) -> Progress:
    return Progress(description, steps, stream if options.progress else None)


def pretrain_base(
    model_cls: type[nn.Module],
    data: DigitsData,
    options: DemoOptions,
    device: torch.device,
    progress: TextIO | None = None,
) -> tuple[nn.Module, TrainLog]:
    """Train a fresh ``model_cls()`` fully on the upright digits; returns it (in train mode) and its log.

    Progress goes to ``progress`` when ``options.progress`` is set.
    """
    torch.manual_seed(options.seed)
    model = model_cls().to(device)
    optimizer = make_optimizer(model, lr=options.lr)
    log = train(
        model,
        optimizer,
        data,
        rotated=False,
        steps=options.base_steps,
        batch_size=options.batch_size,
        seed=options.seed,
        progress=_progress("pretrain (upright)", options.base_steps, options, progress),
    )
    return model, log


def finetune_lora(
    base: nn.Module,
    data: DigitsData,
    config: LoraConfig,
    options: DemoOptions,
    progress: TextIO | None = None,
) -> tuple[nn.Module, TrainLog]:
    """Convert ``base`` in place with ``get_lora_model`` and fine-tune it on the rotated digits.

    Uses ``make_optimizer`` (AdamW over the trainable parameters; 8-bit states with ``eight_bit``).
    Progress goes to ``progress`` when ``options.progress`` is set.
    """
    torch.manual_seed(options.seed + 1)
    model = get_lora_model(base, config)
    optimizer = make_optimizer(model, lr=options.lr, eight_bit=options.eight_bit)
    log = train(
        model,
        optimizer,
        data,
        rotated=True,
        steps=options.finetune_steps,
        batch_size=options.batch_size,
        seed=options.seed + 1,
        progress=_progress("LoRA fine-tune (rotated)", options.finetune_steps, options, progress),
    )
    return model, log
