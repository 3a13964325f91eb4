"""``LoraTrainerCallback``: a transformers ``Trainer`` checkpoint of a loragen model holds its peft adapter.

On a transformers model ``save_pretrained`` writes the adapter (peft's semantics,
:mod:`loragen.training.transformers_adapters`), so Trainer's own save of a checkpoint and
``trainer.save_model()`` write the adapter, as for a peft model. Trainer resumes a model that is not a
``PeftModel`` only from a model weights file, though; the callback adds one to every ``checkpoint-<step>``:

* by default (as a peft user's checkpoints are), a ``model.safetensors`` that holds only what trains (the
  LoRA factors, ``modules_to_save``, trained biases) under the model's own parameter names, beside the
  adapter (``adapter_config.json`` + ``adapter_model.safetensors``, what ``loragen.save_adapter`` writes);
* with ``full_model=True``, the whole model as transformers writes it (``model.safetensors`` and
  ``config.json``), beside the adapter.

The optimizer, scheduler and trainer state stay as Trainer wrote them, and
``trainer.train(resume_from_checkpoint=...)`` is exact either way: Trainer loads the weights file it finds
non-strictly, so the frozen base weights the small file leaves out stay as they are in the model. Trainer
then warns that those keys are missing; the callback drops that one warning when every missing key is a
frozen tensor of the model (no trainable one is missing) and lets it through otherwise.

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

from loragen.adapters.named import active_adapter
from loragen.adapters.save import save_adapter
from loragen.atomic import atomic_file
from loragen.errors import TrainingSetupError
from loragen.layers.adapter_set import DEFAULT_ADAPTER
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
    """Drops Trainer's "missing keys" warning when every missing key is a frozen tensor of the model (a
    checkpoint without ``full_model`` leaves exactly those out on purpose); any other record passes."""

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
        """Writes the peft adapter, and what resuming needs, into every Trainer checkpoint (see
        :mod:`loragen.training.trainer`).

        Args:
            full_model: write the whole model into each checkpoint; by default a checkpoint holds only what
                trains (the adapter, and the trainable tensors under the model's names for resuming).
        """

        def __init__(self, full_model: bool = False) -> None:
            self.full_model = bool(full_model)
            self._filter: _ExactResumeFilter | None = None

        def on_init_end(
            self, args: Any, state: Any, control: Any, model: nn.Module | None = None, **kwargs: Any
        ) -> None:
            if not self.full_model and model is not None and self._filter is None:
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
            save_adapter(lora_model, folder, root_adapter=active_adapter(lora_model) or DEFAULT_ADAPTER)
            if not self.full_model:
                _keep_only_trainable_weights(folder, lora_model)
            elif not any((folder / name).is_file() for name in _MODEL_WEIGHT_FILES):
                # save_pretrained wrote the adapter (peft's semantics): add the full model
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
