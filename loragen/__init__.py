"""loragen: convert PyTorch models into LoRA models and train them fast, in peft's format.

Three ways in, one core:

* ``get_lora_model(model, config)`` converts any ``nn.Module`` at run time;
* ``@lora_convert`` generates explicit conversion code for a class from its source;
* ``loragen rewrite`` (``rewrite_source``) rewrites a model's source file into a LoRA model file.

Adapters are read and written in peft's on-disk format (``save_adapter`` / ``load_adapter``).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import TYPE_CHECKING, Any

from loragen.config import LoraConfig
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

__version__ = "0.1.0"

# Everything that needs torch (and the heavier libcst, jinja2, safetensors) is imported on first use, so that
# ``loragen rewrite`` and ``rewrite_source``, which read and write source text only, never import torch.
_LAZY = {
    "get_lora_model": "loragen.convert",
    "mark_trainable": "loragen.convert",
    "merge_adapter": "loragen.convert",
    "unmerge_adapter": "loragen.convert",
    "merge_and_unload": "loragen.convert",
    "print_trainable_parameters": "loragen.convert",
    "LoraLayer": "loragen.layers",
    "LoraLinear": "loragen.layers",
    "LoraEmbedding": "loragen.layers",
    "LoraConv1d": "loragen.layers",
    "LoraConv2d": "loragen.layers",
    "LoraConv3d": "loragen.layers",
    "register_layer": "loragen.layers",
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
    "LoraTrainerCallback": "loragen.training.transformers_integration",  # imports transformers
    # several named adapters
    "add_adapter": "loragen.adapters.named",
    "set_adapter": "loragen.adapters.named",
    "delete_adapter": "loragen.adapters.named",
    "disable_adapter": "loragen.adapters.named",
    "list_adapters": "loragen.adapters.named",
    "active_adapter": "loragen.adapters.named",
    "add_weighted_adapter": "loragen.adapters.named",
    "mixed_batch": "loragen.layers.mixed_batch",
    "prepare_model_for_kbit_training": "loragen.training.checkpointing",
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
    "LoraConv3d",
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
        add_weighted_adapter,
        delete_adapter,
        disable_adapter,
        list_adapters,
        set_adapter,
    )
    from loragen.adapters.save import save_adapter
    from loragen.convert import (
        get_lora_model,
        mark_trainable,
        merge_adapter,
        merge_and_unload,
        print_trainable_parameters,
        unmerge_adapter,
    )
    from loragen.errors import RequantizationWarning
    from loragen.layers import (
        LoraConv1D,
        LoraConv1d,
        LoraConv2d,
        LoraConv3d,
        LoraEmbedding,
        LoraLayer,
        LoraLinear,
        register_layer,
    )
    from loragen.layers.mixed_batch import mixed_batch
    from loragen.source.decorator import lora_convert
    from loragen.source.rewriter import RewriteResult, rewrite_source
    from loragen.training.adamw8bit import AdamW8bit
    from loragen.training.checkpointing import (
        checkpoint_modules,
        enable_input_require_grads,
        prepare_model_for_kbit_training,
    )
    from loragen.training.distributed import save_adapter_main_process, wrap_ddp
    from loragen.training.optimizers import make_optimizer
    from loragen.training.transformers_integration import LoraTrainerCallback


def _load_torch_part() -> None:
    """Import the torch-backed core: the conversion, the layer types (which register themselves) and the
    hook that gives converted transformers models loragen's adapter methods."""
    import loragen.convert
    import loragen.layers
    import loragen.training.transformers_integration  # noqa: F401


# with torch imported already the core costs nothing: load it now, so transformers' adapter methods are registered
if "torch" in sys.modules:
    _load_torch_part()


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        # a subpackage (``loragen.layers.LoraLinear`` after ``import loragen``, ``from loragen import cuda``)
        if name.startswith("_") or importlib.util.find_spec(f"{__name__}.{name}") is None:
            raise AttributeError(f"module 'loragen' has no attribute {name!r}")
        return importlib.import_module(f"{__name__}.{name}")
    if module != "loragen.errors":
        _load_torch_part()
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
