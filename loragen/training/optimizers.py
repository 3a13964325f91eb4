"""``make_optimizer``: AdamW (fp32 or :class:`~loragen.training.adamw8bit.AdamW8bit`) over only what trains."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from loragen.training.adamw8bit import AdamW8bit

__all__ = ["make_optimizer", "optimizer_state_bytes", "trainable_parameters"]


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held by any torch optimizer's per-parameter state tensors (and :class:`AdamW8bit`'s tables)."""
    tensors = [v for entry in optimizer.state.values() for v in entry.values() if torch.is_tensor(v)]
    if isinstance(optimizer, AdamW8bit):
        tensors += [t for tables in optimizer._codes.values() for t in tables]
    return sum(t.numel() * t.element_size() for t in tensors)


def trainable_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` for every parameter of ``model`` with ``requires_grad``, in module order.

    Parameters shared between modules appear once (under their first name).
    """
    return [(name, param) for name, param in model.named_parameters() if param.requires_grad]


def make_optimizer(
    model: nn.Module,
    lr: float,
    *,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    eight_bit: bool = False,
    decay_1d: bool = False,
    **eight_bit_options: Any,
) -> torch.optim.Optimizer:
    """AdamW over only the trainable parameters of ``model`` (fp32 states, or 8-bit with ``eight_bit``).

    Args:
        model: a model after ``get_lora_model`` (or any module; frozen parameters are left out).
        lr, weight_decay, betas, eps: AdamW hyper-parameters.
        eight_bit: build :class:`AdamW8bit` instead of ``torch.optim.AdamW``.
        decay_1d: also decay parameters of dimension <= 1 (biases, norms), which otherwise go to a group
            without weight decay.
        **eight_bit_options: ``block_size`` / ``min_8bit_size`` for :class:`AdamW8bit`.

    Raises:
        ValueError: ``model`` has no trainable parameter (e.g. nothing matched ``target_modules``), or
            8-bit options are given without ``eight_bit=True``.
    """
    named = trainable_parameters(model)
    if not named:
        total = sum(1 for _ in model.parameters())
        raise ValueError(
            f"make_optimizer: {type(model).__name__} has no trainable parameter ({total} parameters, all "
            "frozen); convert it with loragen.get_lora_model and check that target_modules matched a layer"
        )
    if eight_bit_options and not eight_bit:
        raise ValueError(
            f"make_optimizer: {sorted(eight_bit_options)} only apply with eight_bit=True "
            "(accepted: block_size, min_8bit_size)"
        )
    unknown = set(eight_bit_options) - {"block_size", "min_8bit_size"}
    if unknown:
        raise ValueError(
            f"make_optimizer: unknown 8-bit option(s) {sorted(unknown)}; accepted: block_size, min_8bit_size"
        )
    params = [p for _, p in named]
    groups: list[dict[str, Any]] = [{"params": params, "weight_decay": weight_decay}]
    if weight_decay > 0 and not decay_1d:
        groups = [
            {"params": [p for p in params if p.ndim > 1], "weight_decay": weight_decay},
            {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0},
        ]
        groups = [g for g in groups if g["params"]]
    if eight_bit:
        return AdamW8bit(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **eight_bit_options)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
