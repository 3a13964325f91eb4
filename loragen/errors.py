"""Every error loragen raises for a user's mistake derives from :class:`LoraError`.

Catch ``loragen.LoraError`` to catch them all, or one of the subclasses below; each also derives from
the built-in exception it replaced (``ValueError``, ``TypeError``, ``RuntimeError``). Messages name what
was wrong (module path, config field, adapter key or ``file:line``) and what would be accepted.
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
    """A LoRA configuration value is invalid; the message names the field and the value."""


class LoraConversionError(LoraError, ValueError):
    """A model cannot be converted as asked; the message names the module paths involved."""


class LoraMergeError(LoraError, RuntimeError):
    """A layer cannot be merged exactly (e.g. an Embedding with ``max_norm``); names the reason."""


class LoraConvertError(LoraError, TypeError):
    """``@lora_convert`` cannot expand a class; the message names the class and ``file:line``."""


class ScanError(LoraError, ValueError):
    """The source cannot be scanned (it is not valid Python); the message starts with ``file:line:``."""

    def __init__(self, message: str, *, filename: str, line: int, column: int = 0) -> None:
        super().__init__(f"{filename}:{line}: {message}")
        self.filename = filename
        self.line = line
        self.column = column
        self.reason = message


class AdapterError(LoraError, ValueError):
    """An adapter folder cannot be read, or does not fit the model; the message names the file or key."""


class MergeError(LoraError, ValueError):
    """An adapter does not fit a checkpoint, or the merged output cannot be written; names keys and paths."""


class TrainingSetupError(LoraError, ValueError):
    """A training helper cannot be set up for this model; the message says why and what to change."""


class AdapterNameError(LoraError, ValueError):
    """A named adapter does not exist (the message lists the ones that do), or exists already."""


class AdapterMixError(LoraError, ValueError):
    """Adapters cannot be combined by ``add_weighted_adapter``; names the adapters and what differs."""


class MixedBatchError(LoraError, ValueError):
    """``mixed_batch`` was given names that do not fit the batch (its length) or the model (unknown names)."""


class RequantizationWarning(UserWarning):
    """A merge into a quantized weight had to quantize the merged weight again; the message gives the
    largest absolute difference to the exact ``W + scaling * B @ A`` (filter it with ``warnings``)."""
