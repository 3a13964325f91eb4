"""``LoraTrainerCallback``: a peft adapter in every transformers ``Trainer`` checkpoint.

Trainer knows how to save peft models, not loragen ones: for a loragen model it writes the whole model
(``model.safetensors``: the base weights and the LoRA factors under their parameter names) into each
``checkpoint-<step>`` folder, and ``trainer.save_model()`` does the same into the output folder. The
callback adds the adapter in peft's format (``adapter_config.json`` + ``adapter_model.safetensors``, what
``loragen.save_adapter`` writes) next to Trainer's files in every checkpoint, so each checkpoint can be
loaded with ``loragen.load_adapter`` or ``peft.PeftModel.from_pretrained``.

With ``adapter_only=True`` checkpoints stay small: the callback replaces the full-model weights Trainer
wrote into the checkpoint with a ``model.safetensors`` that holds only what trains (the LoRA factors,
``modules_to_save``, trained biases) under the model's own parameter names. The optimizer, scheduler and
trainer state stay as Trainer wrote them. ``trainer.train(resume_from_checkpoint=...)`` works either way:
Trainer loads the weights file it finds (non-strictly, so the frozen base weights the small file leaves
out stay as they are in the model).

transformers is imported when the callback class is first used, so ``import loragen`` does not need it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors.torch import save_file
from torch import nn

from loragen.adapters.save import save_adapter
from loragen.atomic import atomic_file
from loragen.errors import TrainingSetupError
from loragen.training.distributed import unwrap_model

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

        def on_save(
            self, args: Any, state: Any, control: Any, model: nn.Module | None = None, **kwargs: Any
        ) -> None:
            if not state.is_world_process_zero:
                return
            folder = _checkpoint_dir(args.output_dir, state.global_step)
            save_adapter(_lora_model(model), folder)
            if self.adapter_only:
                _keep_only_trainable_weights(folder, _lora_model(model))

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
