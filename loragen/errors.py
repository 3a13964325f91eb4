"""The errors loragen raises for a user's mistake: all derive from :class:`LoraError` and from a built-in
exception (``ValueError``, ``TypeError``, ``RuntimeError``); messages name what was wrong (module path,
config field, adapter key or ``file:line``) and what would be accepted.
"""

from __future__ import annotations

__all__ = [
    "LoraError",
    "LoraConfigError",
    "LoraConversionError",
    "LoraMergeError",
    "LoraConvertError",
    "ScanError",
    "AdapterError",
    "MergeError",
    "TrainingSetupError",
    "AdapterNameError",
    "AdapterMixError",
    "MixedBatchError",
    "RequantizationWarning",
]


class LoraError(Exception):
    """Base of every error loragen raises for a user's mistake."""


class LoraConfigError(LoraError, ValueError):
    """A LoRA configuration value is invalid."""


class LoraConversionError(LoraError, ValueError):
    """A model cannot be converted as asked."""


class LoraMergeError(LoraError, RuntimeError):
    """A layer cannot be merged exactly (e.g. an Embedding with ``max_norm``)."""


class LoraConvertError(LoraError, TypeError):
    """``@lora_convert`` cannot expand a class."""


class ScanError(LoraError, ValueError):
    """The source cannot be scanned (it is not valid Python); the message starts with ``file:line:``."""

    def __init__(self, message: str, *, filename: str, line: int, column: int = 0) -> None:
        super().__init__(f"{filename}:{line}: {message}")
        self.filename = filename
        self.line = line
        self.column = column
        self.reason = message


class AdapterError(LoraError, ValueError):
    """An adapter folder cannot be read, or does not fit the model."""


class MergeError(LoraError, ValueError):
    """An adapter does not fit a checkpoint, or the merged output cannot be written."""


class TrainingSetupError(LoraError, ValueError):
    """A training helper cannot be set up for this model."""


class AdapterNameError(LoraError, ValueError):
    """A named adapter does not exist (the message lists the ones that do), or exists already."""


class AdapterMixError(LoraError, ValueError):
    """Adapters cannot be combined by ``add_weighted_adapter``."""


class MixedBatchError(LoraError, ValueError):
    """``mixed_batch`` was given names that do not fit the batch (its length) or the model (unknown names)."""


class RequantizationWarning(UserWarning):
    """A merge into a quantized weight had to quantize the merged weight again; the message gives the
    largest absolute difference to the exact ``W + scaling * B @ A`` (filter it with ``warnings``)."""
