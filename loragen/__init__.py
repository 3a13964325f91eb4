"""loragen: convert PyTorch models into LoRA models and train them fast, in peft's format.

Three ways in, one core:

* ``get_lora_model(model, config)`` converts any ``nn.Module`` at run time;
* ``@lora_convert`` generates explicit conversion code for a class from its source;
* ``loragen rewrite`` (``rewrite_source``) rewrites a model's source file into a LoRA model file.

Adapters are read and written in peft's on-disk format (``save_adapter`` / ``load_adapter``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from loragen.config import LoraConfig
from loragen.convert import (
    get_lora_model,
    mark_trainable,
    merge_adapter,
    merge_and_unload,
    print_trainable_parameters,
    unmerge_adapter,
)
from loragen.errors import (
    AdapterError,
    AdapterMixError,
    AdapterNameError,
    LoraConfigError,
    LoraConversionError,
    LoraError,
    LoraMergeError,
    MergeError,
    MixedBatchError,
)
from loragen.layers import LoraConv1d, LoraConv2d, LoraEmbedding, LoraLayer, LoraLinear, register_layer

# registers the hook that gives converted transformers models loragen's adapter methods (light: it imports
# transformers only for a model that is a transformers model already)
from loragen.training import transformers_adapters as _transformers_adapters  # noqa: F401

__version__ = "0.1.0"

# Heavier entry points (libcst, jinja2, safetensors) are imported on first use.
_LAZY = {
    "LoraConv1D": "loragen.layers",  # imports transformers
    "make_optimizer": "loragen.training.optimizers",
    "checkpoint_modules": "loragen.training.checkpointing",
    "enable_input_require_grads": "loragen.training.checkpointing",
    "wrap_ddp": "loragen.training.distributed",
    "save_adapter_main_process": "loragen.training.distributed",
    "AdamW8bit": "loragen.training.adamw8bit",
    "save_adapter": "loragen.adapters.save",
    "load_adapter": "loragen.adapters.load",
    "lora_convert": "loragen.source.decorator",
    "rewrite_source": "loragen.source.rewriter",
    "RewriteResult": "loragen.source.rewriter",
    "LoraTrainerCallback": "loragen.training.trainer",  # imports transformers
    # several named adapters
    "add_adapter": "loragen.adapters.named",
    "set_adapter": "loragen.adapters.named",
    "delete_adapter": "loragen.adapters.named",
    "disable_adapter": "loragen.adapters.named",
    "list_adapters": "loragen.adapters.named",
    "active_adapter": "loragen.adapters.named",
    "add_weighted_adapter": "loragen.adapters.weighted",
    "mixed_batch": "loragen.layers.mixed_batch",
    "prepare_model_for_kbit_training": "loragen.training.kbit",
    "RequantizationWarning": "loragen.errors",
}

__all__ = [
    "LoraConfig",
    "LoraError",
    "LoraConfigError",
    "LoraConversionError",
    "LoraMergeError",
    "AdapterError",
    "MergeError",
    "LoraLayer",
    "LoraLinear",
    "LoraEmbedding",
    "LoraConv1d",
    "LoraConv2d",
    "get_lora_model",
    "mark_trainable",
    "merge_adapter",
    "unmerge_adapter",
    "merge_and_unload",
    "print_trainable_parameters",
    "register_layer",
    "LoraConv1D",
    "make_optimizer",
    "checkpoint_modules",
    "enable_input_require_grads",
    "wrap_ddp",
    "save_adapter_main_process",
    "AdamW8bit",
    "save_adapter",
    "load_adapter",
    "lora_convert",
    "rewrite_source",
    "RewriteResult",
    "LoraTrainerCallback",
    "add_adapter",
    "set_adapter",
    "delete_adapter",
    "disable_adapter",
    "list_adapters",
    "active_adapter",
    "add_weighted_adapter",
    "mixed_batch",
    "AdapterNameError",
    "AdapterMixError",
    "MixedBatchError",
    "prepare_model_for_kbit_training",
    "RequantizationWarning",
]

if TYPE_CHECKING:  # pragma: no cover
    from loragen.adapters.load import load_adapter
    from loragen.adapters.named import (
        active_adapter,
        add_adapter,
        delete_adapter,
        disable_adapter,
        list_adapters,
        set_adapter,
    )
    from loragen.adapters.save import save_adapter
    from loragen.adapters.weighted import add_weighted_adapter
    from loragen.errors import RequantizationWarning
    from loragen.layers import LoraConv1D
    from loragen.layers.mixed_batch import mixed_batch
    from loragen.source.decorator import lora_convert
    from loragen.source.rewriter import RewriteResult, rewrite_source
    from loragen.training.adamw8bit import AdamW8bit
    from loragen.training.checkpointing import checkpoint_modules, enable_input_require_grads
    from loragen.training.distributed import save_adapter_main_process, wrap_ddp
    from loragen.training.kbit import prepare_model_for_kbit_training
    from loragen.training.optimizers import make_optimizer
    from loragen.training.trainer import LoraTrainerCallback


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'loragen' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
