"""Gradient checkpointing for LoRA models, and the preparation of a 4-bit / 8-bit model for LoRA training.

* :func:`enable_input_require_grads` — reentrant gradient checkpointing only back-propagates into a
  checkpointed block if one of its *inputs* requires grad. With a frozen embedding nothing does, the
  LoRA weights inside the blocks silently get no gradient (torch only warns "None of the inputs have
  requires_grad=True"). The hook makes the embedding output require grad.
* :func:`checkpoint_modules` — gradient checkpointing for any ``nn.Module`` (transformers models have
  ``gradient_checkpointing_enable()``; plain torch models do not).
* :func:`prepare_model_for_kbit_training` — peft's steps, with peft's semantics, for a model loaded with
  transformers' ``BitsAndBytesConfig`` (or any model holding bitsandbytes' quantized weights):

  1. freeze every parameter (LoRA factors are added and made trainable afterwards by ``get_lora_model``);
  2. cast every float16 / bfloat16 parameter that is not a quantized weight to float32: norms,
     embeddings, the output head and biases then run in float32, which keeps training stable;
  3. with gradient checkpointing asked for on a quantized model: make the input embeddings' output
     require gradients (reentrant checkpointing, transformers' default, needs it, as above), then turn
     checkpointing on with transformers' ``activation_checkpointing_enable``
     (``gradient_checkpointing_enable`` before transformers 5), with transformers' default options unless
     ``gradient_checkpointing_kwargs`` says.

loragen's LoRA op draws its dropout seed from torch's CPU generator, which checkpointing restores before
recomputing a segment: the recomputed forward uses the same dropout mask.
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
    """Make the output of ``module`` (default: ``model.get_input_embeddings()``) require grad.

    Needed for *reentrant* gradient checkpointing (``use_reentrant=True``, e.g.
    ``gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})``) on a
    model whose input embedding is frozen, which is every LoRA model that does not train its embedding.

    Args:
        model: the (LoRA) model.
        module: the module whose output feeds the checkpointed blocks; defaults to the model's input
            embedding as transformers defines it.

    Returns:
        The hook handle; ``handle.remove()`` undoes it.

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
        # Reentrant checkpointing takes positional inputs only; keyword arguments (attention masks,
        # position ids) are bound to the function instead, as transformers does.
        return torch.utils.checkpoint.checkpoint(
            functools.partial(forward, **kwargs), *args, use_reentrant=True
        )
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=use_reentrant, **kwargs)


def checkpoint_modules(model: nn.Module, names: Iterable[str], *, use_reentrant: bool = False) -> list[str]:
    """Run each named submodule under ``torch.utils.checkpoint`` (activations recomputed in backward).

    Args:
        model: the model; it is changed in place (each selected module's ``forward`` is wrapped).
        names: submodule paths as in ``model.named_modules()`` (``"blocks.0"``, ``"blocks.1"``, ...).
        use_reentrant: the checkpoint flavour. With ``True``, call :func:`enable_input_require_grads`
            on the layer feeding the first checkpointed module if that layer is frozen; keyword
            arguments of the wrapped forward are then bound to it (reentrant checkpointing passes only
            positional inputs), so gradients flow only through the positional ones.

    A checkpointed module runs its forward twice (again during backward), so it must not mutate state
    across calls: turn key/value caches off while training (``use_cache=False`` for transformers models).

    Returns:
        The paths that were wrapped, in the order given.

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
    where the model has it, else :func:`enable_input_require_grads`)."""
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
    """transformers' method that turns checkpointing on, and its keyword for ``torch.utils.checkpoint``'s
    options: ``activation_checkpointing_enable``, or ``gradient_checkpointing_enable`` before transformers 5.

    Raises:
        TrainingSetupError: the model has neither.
    """
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
        enable_checkpointing, keyword = _checkpointing_switch(model)
        if kwargs.get("use_reentrant", True):
            _enable_input_grads(model)
        enable_checkpointing(**{keyword: kwargs or None})
    if find_lora_layers(model):
        mark_trainable(model)
    return model
