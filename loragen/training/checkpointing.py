"""Gradient checkpointing for LoRA models.

* :func:`enable_input_require_grads` — reentrant gradient checkpointing only back-propagates into a
  checkpointed block if one of its *inputs* requires grad. With a frozen embedding nothing does, the
  LoRA weights inside the blocks silently get no gradient (torch only warns "None of the inputs have
  requires_grad=True"). The hook makes the embedding output require grad.
* :func:`checkpoint_modules` — gradient checkpointing for any ``nn.Module`` (transformers models have
  ``gradient_checkpointing_enable()``; plain torch models do not).
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn
from torch.utils.hooks import RemovableHandle

from loragen.errors import TrainingSetupError

__all__ = ["checkpoint_modules", "enable_input_require_grads"]


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
