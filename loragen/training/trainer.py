"""``LoraTrainerCallback``: a peft adapter in every transformers ``Trainer`` checkpoint.

Trainer knows how to save peft models, not loragen ones: for a loragen model it writes the whole model
(``model.safetensors``: the base weights and the LoRA factors under their parameter names) into each
``checkpoint-<step>`` folder, and ``trainer.save_model()`` does the same into the output folder. The
callback adds the adapter in peft's format (``adapter_config.json`` + ``adapter_model.safetensors``, what
``loragen.save_adapter`` writes) next to Trainer's files in every checkpoint, so each checkpoint can be
loaded with ``loragen.load_adapter`` or ``peft.PeftModel.from_pretrained``.

On a transformers model ``save_pretrained`` writes the adapter (peft's semantics,
:mod:`loragen.training.transformers_adapters`), so Trainer's own save of a checkpoint and
``trainer.save_model()`` write the adapter only, as for a peft model; the callback adds the full-model
weights (``model.safetensors`` and ``config.json``, as Trainer wrote them before) to every checkpoint, which
``resume_from_checkpoint`` needs. Without the callback a checkpoint holds only the adapter, from which
Trainer cannot resume a model that is not a ``PeftModel``.

With ``adapter_only=True`` checkpoints stay small: the callback writes a ``model.safetensors`` that holds
only what trains (the LoRA factors, ``modules_to_save``, trained biases) under the model's own parameter
names. The optimizer, scheduler and trainer state stay as Trainer wrote them.
``trainer.train(resume_from_checkpoint=...)`` works either way: Trainer loads the weights file it finds
(non-strictly, so the frozen base weights the small file leaves out stay as they are in the model). Trainer
then warns that those keys are missing; the callback drops that one warning when the resume is exact (every
missing key is a frozen tensor of the model, no trainable one is missing) and lets it through otherwise.

transformers is imported when the callback class is first used, so ``import loragen`` does not need it.
"""

from __future__ import annotations

import ast
import json
import logging
import weakref
from pathlib import Path
from typing import Any

from safetensors.torch import save_file
from torch import nn

from loragen.adapters.save import save_adapter
from loragen.atomic import atomic_file
from loragen.errors import TrainingSetupError
from loragen.training.distributed import unwrap_model
from loragen.training.transformers_adapters import LoragenAdapterMethods

# LoraTrainerCallback itself is made on first access (module __getattr__ below)
__all__ = ["make_trainer_callback_class"]

# Trainer's names for the full-model weight files of a checkpoint (transformers.utils constants)
_MODEL_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def _checkpoint_dir(output_dir: str, step: int) -> Path:
    return Path(output_dir) / f"checkpoint-{step}"


def _keep_only_trainable_weights(folder: Path, model: nn.Module) -> None:
    """Replace Trainer's full-model weight files in ``folder`` with the trainable tensors only."""
    for name in _MODEL_WEIGHT_FILES:
        path = folder / name
        if name.endswith(".index.json") and path.is_file():
            for shard in set(json.loads(path.read_text()).get("weight_map", {}).values()):
                (folder / shard).unlink(missing_ok=True)
        path.unlink(missing_ok=True)
    trainable = {
        name: p.detach().cpu().contiguous() for name, p in model.named_parameters() if p.requires_grad
    }
    with atomic_file(folder / "model.safetensors") as tmp:
        save_file(trainable, str(tmp), metadata={"format": "pt"})


_MISSING_PREFIX = (
    "There were missing keys in the checkpoint model loaded: "  # Trainer._issue_warnings_after_load
)
_TRAINER_LOGGER = "transformers.trainer"


class _ExactResumeFilter(logging.Filter):
    """Drops Trainer's "missing keys" warning when every missing key is a frozen tensor of the model (an
    ``adapter_only`` checkpoint leaves exactly those out on purpose); any other record passes."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self._model = weakref.ref(model)

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        model = self._model()
        if model is None or not message.startswith(_MISSING_PREFIX):
            return True
        try:
            missing = ast.literal_eval(message[len(_MISSING_PREFIX) :].rstrip("."))
        except (ValueError, SyntaxError):
            return True
        if not isinstance(missing, (list, set, tuple)) or not missing:
            return True
        trainable = {name for name, p in model.named_parameters() if p.requires_grad}
        frozen = set(model.state_dict()) - trainable
        return not all(isinstance(key, str) and key in frozen for key in missing)


def _lora_model(model: nn.Module | None) -> nn.Module:
    if model is None:
        raise TrainingSetupError("LoraTrainerCallback: the Trainer passed no model to the callback")
    return unwrap_model(model)


def make_trainer_callback_class() -> type:
    """The callback class, built on transformers' ``TrainerCallback`` (imported here, on first use).

    Raises:
        ImportError: transformers is not installed.
    """
    from transformers import TrainerCallback

    class LoraTrainerCallback(TrainerCallback):
        """Writes the peft adapter into every Trainer checkpoint (see :mod:`loragen.training.trainer`).

        Args:
            adapter_only: keep each checkpoint small: its model weights file holds only what trains.
        """

        def __init__(self, adapter_only: bool = False) -> None:
            self.adapter_only = bool(adapter_only)
            self._filter: _ExactResumeFilter | None = None

        def on_init_end(
            self, args: Any, state: Any, control: Any, model: nn.Module | None = None, **kwargs: Any
        ) -> None:
            if self.adapter_only and model is not None and self._filter is None:
                self._filter = _ExactResumeFilter(unwrap_model(model))
                logging.getLogger(_TRAINER_LOGGER).addFilter(self._filter)

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self._filter is not None:
                logging.getLogger(_TRAINER_LOGGER).removeFilter(self._filter)
                self._filter = None

        def on_save(
            self, args: Any, state: Any, control: Any, model: nn.Module | None = None, **kwargs: Any
        ) -> None:
            if not state.is_world_process_zero:
                return
            folder = _checkpoint_dir(args.output_dir, state.global_step)
            lora_model = _lora_model(model)
            save_adapter(lora_model, folder)
            if self.adapter_only:
                _keep_only_trainable_weights(folder, lora_model)
            elif not any((folder / name).is_file() for name in _MODEL_WEIGHT_FILES):
                # save_pretrained wrote the adapter (peft's semantics): add the full model Trainer resumes from
                if isinstance(lora_model, LoragenAdapterMethods):
                    lora_model.save_pretrained(folder, full_model=True)

    LoraTrainerCallback.__module__ = "loragen"
    LoraTrainerCallback.__qualname__ = "LoraTrainerCallback"
    return LoraTrainerCallback


_class: type | None = None


def __getattr__(name: str) -> Any:
    global _class
    if name == "LoraTrainerCallback":
        if _class is None:
            _class = make_trainer_callback_class()
        return _class
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
