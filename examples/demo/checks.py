"""Stages 5 and 6: the adapter round trip (save in peft's format, reload into a fresh base, merge) and the
rewritten model file (base checkpoint + adapter) must reproduce the trained model's outputs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn

from loragen import load_adapter, merge_adapter, save_adapter

from .options import DemoError

__all__ = ["MATCH_TOLERANCE", "AdapterCheck", "check_adapter_roundtrip", "check_rewritten_model"]

# Outputs of two computations of the same model in fp32 agree to rounding; this is far above it.
MATCH_TOLERANCE = 1e-4


@dataclasses.dataclass(frozen=True)
class AdapterCheck:
    """Largest output differences (logits, max-abs) found by :func:`check_adapter_roundtrip`."""

    adapter_dir: Path
    reload_max_diff: float
    merge_max_diff: float

    @property
    def ok(self) -> bool:
        """Both differences are within :data:`MATCH_TOLERANCE`."""
        return max(self.reload_max_diff, self.merge_max_diff) <= MATCH_TOLERANCE


@torch.no_grad()
def _max_diff(a: nn.Module, b: nn.Module, images: torch.Tensor) -> float:
    a.eval()
    b.eval()
    return (a(images) - b(images)).abs().max().item()


def check_adapter_roundtrip(
    trained: nn.Module,
    model_cls: type[nn.Module],
    base_state: dict[str, torch.Tensor],
    adapter_dir: Path,
    images: torch.Tensor,
) -> AdapterCheck:
    """Save ``trained``'s adapter (peft format), load it into a fresh base, merge, and compare outputs.

    Args:
        trained: the fine-tuned LoRA model.
        model_cls: the plain model class; a fresh instance receives ``base_state`` and the adapter.
        base_state: the pretrained base's state dict (before conversion).
        adapter_dir: where the adapter folder is written (replaced atomically).
        images: inputs ``(N, 1, 8, 8)`` on which outputs are compared.
    """
    save_adapter(trained, adapter_dir)
    fresh = model_cls().to(images.device)
    fresh.load_state_dict(base_state)
    load_adapter(fresh, adapter_dir)
    reload_diff = _max_diff(trained, fresh, images)
    with torch.no_grad():
        unmerged = fresh(images)
        merge_adapter(fresh)
        merged = fresh(images)
    return AdapterCheck(adapter_dir, reload_diff, (merged - unmerged).abs().max().item())


def check_rewritten_model(
    rewritten_cls: type[nn.Module],
    trained: nn.Module,
    base_state: dict[str, torch.Tensor],
    adapter_dir: Path,
    images: torch.Tensor,
) -> float:
    """Largest output difference between ``trained`` and the rewritten file's model given the same weights.

    The rewritten model's LoRA layers keep the base keys, so the base checkpoint loads into it
    unchanged (only the LoRA keys are missing); the adapter then fills them in.

    Raises:
        DemoError: the base checkpoint does not load into the rewritten model as the contract says.
    """
    model = rewritten_cls().to(images.device)
    result = model.load_state_dict(base_state, strict=False)
    not_lora = [key for key in result.missing_keys if ".lora_" not in key]
    if result.unexpected_keys or not_lora:
        raise DemoError(
            "the base checkpoint does not fit the rewritten model: "
            f"missing {not_lora}, unexpected {result.unexpected_keys}"
        )
    load_adapter(model, adapter_dir)
    return _max_diff(trained, model, images)
