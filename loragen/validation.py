"""Checks of LoRA hyperparameters, shared by :class:`~loragen.LoraConfig` and every LoRA layer's
constructor; each raises :class:`~loragen.errors.LoraConfigError` naming the field, the value and what
would be accepted.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from loragen.errors import LoraConfigError

__all__ = [
    "InitMode",
    "INIT_MODES",
    "check_rank",
    "check_alpha",
    "check_dropout",
    "check_flag",
    "check_init",
    "check_lora_args",
    "check_parameter_targets",
]

InitMode = bool | Literal["gaussian"]
INIT_MODES: tuple[InitMode, ...] = (True, False, "gaussian")


def check_rank(value: Any, field: str = "r") -> int:
    """A rank: a positive integer (``bool`` is refused)."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise LoraConfigError(f"{field}={value!r}: the rank must be a positive integer")
    return value


def check_alpha(value: Any, field: str = "lora_alpha") -> float:
    """A LoRA alpha: a finite number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise LoraConfigError(f"{field}={value!r}: expected a finite number")
    return value


def check_dropout(value: Any, field: str = "lora_dropout") -> float:
    """A dropout probability ``p`` with ``0 <= p < 1``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise LoraConfigError(f"{field}={value!r}: expected a probability with 0 <= p < 1")
    return float(value)


def check_flag(value: Any, field: str) -> bool:
    """A switch field: exactly ``True`` or ``False``."""
    if not isinstance(value, bool):
        raise LoraConfigError(f"{field}={value!r}: expected True or False")
    return value


def check_init(value: Any, field: str = "init_lora_weights") -> InitMode:
    """An init scheme loragen implements: ``True``, ``False`` or ``"gaussian"``."""
    if not isinstance(value, (bool, str)) or value not in INIT_MODES:
        raise LoraConfigError(
            f"{field}={value!r}: expected True, False or 'gaussian' "
            "(peft's other schemes - pissa, olora, loftq, eva, corda - are not supported)"
        )
    return value


def check_lora_args(
    r: Any, lora_alpha: Any, lora_dropout: Any, use_rslora: Any, init_lora_weights: Any
) -> None:
    """Check the LoRA arguments every LoRA layer takes (the same fields as the config)."""
    check_rank(r)
    check_alpha(lora_alpha)
    check_dropout(lora_dropout)
    check_flag(use_rslora, "use_rslora")
    check_init(init_lora_weights)


def check_parameter_targets(value: Any) -> tuple[str, ...] | None:
    """``target_parameters``: None or a list of parameter names (no regex string, as in peft), as a tuple."""
    field = "target_parameters"
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, (list, tuple, set, frozenset)):
        raise LoraConfigError(
            f"{field}={value!r}: expected a list of parameter names such as ['experts.gate_up_proj'] "
            "(a regex string is not accepted, as in peft)"
        )
    names = sorted(value) if isinstance(value, (set, frozenset)) else list(value)
    for name in names:
        if not isinstance(name, str) or not name or name.startswith(".") or name.endswith("."):
            raise LoraConfigError(
                f"{field}: {name!r} is not a parameter name (expected e.g. 'experts.down_proj')"
            )
    return tuple(names)
