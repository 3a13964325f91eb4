"""Gradient checkpointing for LoRA models, and the preparation of a 4-bit / 8-bit model for LoRA training.

Reentrant checkpointing only back-propagates into a block if one of its inputs requires grad; with a
frozen embedding none does and the LoRA weights inside silently get no gradient, hence
:func:`enable_input_require_grads`. :func:`checkpoint_modules` checkpoints any ``nn.Module``'s blocks, and
:func:`prepare_model_for_kbit_training` is peft's function of that name. The LoRA op's dropout seed comes
from torch's CPU generator, which checkpointing restores: a recomputed forward draws the same mask.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
import torch.utils.checkpoint
from torch import nn
from torch.utils.hooks import RemovableHandle

from loragen.convert import find_lora_layers, mark_trainable
from loragen.errors import TrainingSetupError

__all__ = [
    "checkpoint_modules",
    "enable_input_require_grads",
    "is_quantized",
    "prepare_model_for_kbit_training",
]

M = TypeVar("M", bound=nn.Module)


def _make_output_require_grad(module: nn.Module, inputs: Any, output: Any) -> None:
    del module, inputs
    if isinstance(output, torch.Tensor) and output.is_floating_point():
        output.requires_grad_(True)


def enable_input_require_grads(model: nn.Module, module: nn.Module | None = None) -> RemovableHandle:
    """Make the output of ``module`` (default: ``model.get_input_embeddings()``) require grad, as reentrant
    gradient checkpointing needs on a model whose input embedding is frozen; returns the hook's handle.

    Raises:
        TrainingSetupError: no ``module`` was given and ``model`` has no ``get_input_embeddings()``.
    """
    if module is None:
        getter = getattr(model, "get_input_embeddings", None)
        module = getter() if callable(getter) else None
        if not isinstance(module, nn.Module):
            raise TrainingSetupError(
                f"enable_input_require_grads: {type(model).__name__} has no get_input_embeddings(); pass "
                "module=<the layer whose output enters the checkpointed blocks>, e.g. model.embed"
            )
    return module.register_forward_hook(_make_output_require_grad)


def _checkpointed_forward(forward: Callable[..., Any], use_reentrant: bool, *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    if use_reentrant and kwargs:
        # reentrant checkpointing takes positional inputs only: bind the others, as transformers does
        forward, kwargs = functools.partial(forward, **kwargs), {}
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=use_reentrant, **kwargs)


def checkpoint_modules(model: nn.Module, names: Iterable[str], *, use_reentrant: bool = False) -> list[str]:
    """Run each named submodule under ``torch.utils.checkpoint``, in place (its forward runs again in
    backward, so it must not mutate state: ``use_cache=False`` for transformers models).

    Args:
        model: the model.
        names: submodule paths as in ``model.named_modules()`` (``"blocks.0"``, ...); returned as wrapped.
        use_reentrant: the checkpoint flavour. With ``True``, call :func:`enable_input_require_grads`
            on the frozen layer feeding the first checkpointed module; gradients then flow only through
            positional inputs (keyword arguments are bound to the forward).

    Raises:
        TrainingSetupError: a name is not a submodule of ``model`` (the message lists close names), or a
            module is already checkpointed.
    """
    modules = dict(model.named_modules())
    wrapped: list[str] = []
    for name in names:
        if name not in modules or name == "":
            nearby = difflib.get_close_matches(name, [n for n in modules if n], n=5, cutoff=0.6)
            raise TrainingSetupError(
                f"checkpoint_modules: {type(model).__name__} has no submodule {name!r}"
                + (f"; did you mean one of {nearby}?" if nearby else "")
            )
        module = modules[name]
        if getattr(module, "_loragen_checkpointed", False):
            raise TrainingSetupError(f"checkpoint_modules: {name!r} is already checkpointed")
        module.forward = functools.partial(_checkpointed_forward, module.forward, use_reentrant)
        module._loragen_checkpointed = True
        wrapped.append(name)
    return wrapped


# bitsandbytes' parameter classes for quantized weights, by name: no import of bitsandbytes needed
_QUANTIZED_PARAMETER_TYPES = ("Params4bit", "Int8Params")


def _is_quantized_parameter(param: torch.Tensor) -> bool:
    return type(param).__name__ in _QUANTIZED_PARAMETER_TYPES


def is_quantized(model: nn.Module) -> bool:
    """Whether ``model`` was loaded in 4 or 8 bits (transformers' ``is_loaded_in_4bit`` /
    ``is_loaded_in_8bit``) or holds a bitsandbytes quantized weight."""
    if getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False):
        return True
    return any(_is_quantized_parameter(p) for p in model.parameters())


def _enable_input_grads(model: nn.Module) -> None:
    """transformers' ``enable_input_require_grads`` where the model has it, else ours."""
    enable = getattr(model, "enable_input_require_grads", None)
    if callable(enable):
        enable()
        return
    try:
        enable_input_require_grads(model)
    except TrainingSetupError:
        raise TrainingSetupError(
            f"prepare_model_for_kbit_training: {type(model).__name__} has no enable_input_require_grads() "
            "and no get_input_embeddings(); reentrant gradient checkpointing needs inputs that require "
            "gradients. Pass gradient_checkpointing_kwargs={'use_reentrant': False}, or "
            "use_gradient_checkpointing=False"
        ) from None


def _checkpointing_switch(model: nn.Module) -> tuple[Callable[..., Any], str]:
    """transformers' method that turns checkpointing on (``gradient_checkpointing_enable`` before
    transformers 5), and its keyword for ``torch.utils.checkpoint``'s options."""
    for method, keyword in (
        ("activation_checkpointing_enable", "activation_checkpointing_kwargs"),
        ("gradient_checkpointing_enable", "gradient_checkpointing_kwargs"),
    ):
        enable = getattr(model, method, None)
        if callable(enable):
            return enable, keyword
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
    """Prepare a 4-bit / 8-bit model for LoRA training, in place, as peft's function of that name does;
    returns the same model. Call it before :func:`loragen.get_lora_model`.

    It freezes every parameter, casts each float16 / bfloat16 parameter that is not a quantized weight to
    float32 (norms, embeddings, head and biases: stable training) and, for a quantized model with
    ``use_gradient_checkpointing``, turns transformers' checkpointing on with
    ``gradient_checkpointing_kwargs`` (after making the input embeddings' output require grad, unless
    ``use_reentrant`` is false). On a model with LoRA layers already, their factors train again.

    Raises:
        TrainingSetupError: checkpointing is asked for and the model has no ``gradient_checkpointing_enable``
            (not a transformers model), or reentrant checkpointing is asked for and the model exposes no
            input embeddings.
    """
    kwargs = dict(gradient_checkpointing_kwargs or {})
    for param in model.parameters():
        param.requires_grad_(False)
        if param.dtype in (torch.float16, torch.bfloat16) and not _is_quantized_parameter(param):
            param.data = param.data.to(torch.float32)
    if use_gradient_checkpointing and is_quantized(model):
        enable_checkpointing, keyword = _checkpointing_switch(model)
        if kwargs.get("use_reentrant", True):
            _enable_input_grads(model)
        enable_checkpointing(**{keyword: kwargs or None})
    if find_lora_layers(model):
        mark_trainable(model)
    return model
