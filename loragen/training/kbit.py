"""``prepare_model_for_kbit_training``: the usual preparation of a 4-bit / 8-bit model for LoRA training.

The steps users know from peft, with the same semantics, for a model loaded with transformers'
``BitsAndBytesConfig`` (or any model holding bitsandbytes' quantized weights):

1. freeze every parameter (LoRA factors are added and made trainable afterwards by ``get_lora_model``);
2. cast every float16 / bfloat16 parameter that is not a quantized weight to float32: norms, embeddings,
   the output head and biases then run in float32, which keeps training stable;
3. with gradient checkpointing asked for on a quantized model: make the input embeddings' output require
   gradients (reentrant checkpointing, transformers' default, passes gradients only through segments
   whose inputs require them, and with a frozen embedding none does), then turn checkpointing on with
   transformers' ``activation_checkpointing_enable`` (``gradient_checkpointing_enable`` before
   transformers 5), with transformers' default options unless ``gradient_checkpointing_kwargs`` says.

loragen's LoRA op draws its dropout seed from torch's CPU generator, which checkpointing restores
before recomputing a segment: the recomputed forward uses the same dropout mask.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

from loragen.convert import find_lora_layers, mark_trainable
from loragen.errors import TrainingSetupError

__all__ = ["is_quantized", "prepare_model_for_kbit_training"]

M = TypeVar("M", bound=nn.Module)

# bitsandbytes' parameter classes for quantized weights, by name: no import of bitsandbytes needed
_QUANTIZED_PARAMETER_TYPES = ("Params4bit", "Int8Params")
_HALF_DTYPES = (torch.float16, torch.bfloat16)


def _is_quantized_parameter(param: torch.Tensor) -> bool:
    return type(param).__name__ in _QUANTIZED_PARAMETER_TYPES


def is_quantized(model: nn.Module) -> bool:
    """Whether ``model`` was loaded in 4 or 8 bits (transformers' ``is_loaded_in_4bit`` /
    ``is_loaded_in_8bit``) or holds a bitsandbytes quantized weight."""
    if getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False):
        return True
    return any(_is_quantized_parameter(p) for p in model.parameters())


def _enable_input_grads(model: nn.Module) -> None:
    """Make the input embeddings' output require gradients (transformers' ``enable_input_require_grads``
    where the model has it, else a forward hook on ``get_input_embeddings()``)."""
    enable = getattr(model, "enable_input_require_grads", None)
    if callable(enable):
        enable()
        return
    get_embeddings = getattr(model, "get_input_embeddings", None)
    embeddings = get_embeddings() if callable(get_embeddings) else None
    if not isinstance(embeddings, nn.Module):
        raise TrainingSetupError(
            f"prepare_model_for_kbit_training: {type(model).__name__} has no enable_input_require_grads() "
            "and no get_input_embeddings(); reentrant gradient checkpointing needs inputs that require "
            "gradients. Pass gradient_checkpointing_kwargs={'use_reentrant': False}, or "
            "use_gradient_checkpointing=False"
        )

    def require_grads(module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
        output.requires_grad_(True)

    embeddings.register_forward_hook(require_grads)


def _call_with(function: Callable[..., Any], keyword: str, value: Any) -> None:
    function(**{keyword: value})


def _checkpointing_switch(model: nn.Module) -> Callable[[dict[str, Any] | None], None]:
    """A function that turns on transformers' checkpointing with the given ``torch.utils.checkpoint``
    options (None: transformers' default): ``activation_checkpointing_enable``, or
    ``gradient_checkpointing_enable`` before transformers 5.

    Raises:
        TrainingSetupError: the model has neither.
    """
    for method, keyword in (
        ("activation_checkpointing_enable", "activation_checkpointing_kwargs"),
        ("gradient_checkpointing_enable", "gradient_checkpointing_kwargs"),
    ):
        enable = getattr(model, method, None)
        if callable(enable):
            return functools.partial(_call_with, enable, keyword)
    raise TrainingSetupError(
        f"prepare_model_for_kbit_training: {type(model).__name__} has no gradient_checkpointing_enable() "
        "(a transformers model has); pass use_gradient_checkpointing=False and wrap its blocks in "
        "torch.utils.checkpoint yourself"
    )


def prepare_model_for_kbit_training(
    model: M,
    use_gradient_checkpointing: bool = True,
    gradient_checkpointing_kwargs: dict[str, Any] | None = None,
) -> M:
    """Prepare a 4-bit / 8-bit model for LoRA training, in place, as peft's function of the same name
    does (the steps are in the module docstring); returns the same model.

    Call it before :func:`loragen.get_lora_model`. Called on a model that has LoRA layers already, it
    freezes the base as usual and then makes the LoRA parameters (and what the model's config trains)
    trainable again.

    Args:
        model: the loaded model (a transformers model for gradient checkpointing).
        use_gradient_checkpointing: turn on gradient checkpointing (only for a quantized model, as peft).
        gradient_checkpointing_kwargs: passed to ``gradient_checkpointing_enable`` (for example
            ``{"use_reentrant": False}``, which needs no input gradients and so skips step 3's hook).

    Raises:
        TrainingSetupError: checkpointing is asked for and the model has no ``gradient_checkpointing_enable``
            (not a transformers model), or reentrant checkpointing is asked for and the model exposes no
            input embeddings.
    """
    kwargs = dict(gradient_checkpointing_kwargs or {})
    for param in model.parameters():
        param.requires_grad_(False)
    for param in model.parameters():
        if param.dtype in _HALF_DTYPES and not _is_quantized_parameter(param):
            param.data = param.data.to(torch.float32)
    if use_gradient_checkpointing and is_quantized(model):
        enable_checkpointing = _checkpointing_switch(model)
        if kwargs.get("use_reentrant", True):
            _enable_input_grads(model)
        enable_checkpointing(kwargs or None)
    if find_lora_layers(model):
        mark_trainable(model)
    return model
