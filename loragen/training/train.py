"""Small helpers for training LoRA models the way users train them.

* :func:`enable_input_require_grads` — reentrant gradient checkpointing only back-propagates into a
  checkpointed block if one of its *inputs* requires grad. With a frozen embedding nothing does, the
  LoRA weights inside the blocks silently get no gradient (torch only warns "None of the inputs have
  requires_grad=True"). The hook makes the embedding output require grad.
* :func:`checkpoint_modules` — gradient checkpointing for any ``nn.Module`` (transformers models have
  ``gradient_checkpointing_enable()``; plain torch models do not).
* :func:`wrap_ddp` — ``DistributedDataParallel`` for a LoRA model: checks that something trains, keeps
  ``find_unused_parameters=False`` (frozen base parameters are not part of DDP's reducer, so LoRA plus
  ``modules_to_save`` needs no unused-parameter search), and declares a static graph when reentrant
  checkpointing is on (otherwise DDP sees each checkpointed parameter "ready twice").
* :func:`unwrap_model`, :func:`is_main_process`, :func:`save_adapter_main_process` — saving once, from
  rank 0, from a wrapped model.
"""

from __future__ import annotations

import difflib
import functools
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import nn
from torch.utils.hooks import RemovableHandle

from loragen.errors import TrainingSetupError

__all__ = [
    "TrainingSetupError",
    "checkpoint_modules",
    "enable_input_require_grads",
    "is_main_process",
    "save_adapter_main_process",
    "unwrap_model",
    "wrap_ddp",
]


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


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's model inside DDP / ``torch.compile`` wrappers (``.module``, ``._orig_mod``), repeatedly."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel | nn.DataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        else:
            return model


def is_main_process() -> bool:
    """True outside ``torch.distributed`` and on rank 0 inside it."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def wrap_ddp(
    model: nn.Module, *, reentrant_checkpointing: bool = False, **ddp_kwargs: Any
) -> nn.parallel.DistributedDataParallel:
    """Wrap a LoRA model in ``DistributedDataParallel`` with settings that work for LoRA training.

    Frozen parameters are skipped by DDP, so only LoRA weights, ``modules_to_save`` and trained biases
    are synchronized, and ``find_unused_parameters`` stays ``False`` (the default here) unless the
    caller's forward really skips a trainable module.

    Args:
        model: the converted model, already on its device; ``torch.distributed`` must be initialized.
        reentrant_checkpointing: set when the model uses ``use_reentrant=True`` checkpointing; the
            graph is then declared static so that each parameter is reduced once per step.
        **ddp_kwargs: passed to ``DistributedDataParallel`` (``device_ids``, ``find_unused_parameters``...).

    Raises:
        TrainingSetupError: ``torch.distributed`` is not initialized, or nothing in ``model`` trains.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise TrainingSetupError(
            "wrap_ddp: torch.distributed is not initialized; call "
            "torch.distributed.init_process_group(...) first (backend 'gloo' on CPU, 'nccl' on GPUs)"
        )
    if not any(p.requires_grad for p in model.parameters()):
        raise TrainingSetupError(
            f"wrap_ddp: {type(model).__name__} has no trainable parameter; convert it with "
            "loragen.get_lora_model before wrapping"
        )
    ddp_kwargs.setdefault("find_unused_parameters", False)
    if reentrant_checkpointing:
        ddp_kwargs.setdefault("static_graph", True)
    return nn.parallel.DistributedDataParallel(model, **ddp_kwargs)


def _fsdp2_modules(model: nn.Module) -> list[nn.Module]:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _gather_trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) CPU copies of the trainable tensors of an FSDP2 model; a collective call."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    return get_model_state_dict(model, options=options)


def save_adapter_main_process(
    model: nn.Module, path: str | os.PathLike[str], **save_kwargs: Any
) -> Path | None:
    """Save the adapter with :func:`loragen.save_adapter` from rank 0 only, then wait for all ranks.

    Call it on every rank (it also works outside ``torch.distributed``). DDP / ``torch.compile`` wrappers
    are removed with :func:`unwrap_model`. For an FSDP2 (``fully_shard``) model the trainable tensors are
    first gathered to full size on every rank (a collective), and rank 0 writes them under the same peft
    keys. Ranks other than 0 write nothing and return ``None``; every rank returns only after the folder
    is complete, so a load that follows on any rank sees it.

    Returns:
        The adapter folder on rank 0, ``None`` elsewhere.

    Raises:
        TrainingSetupError: on ranks other than 0 when rank 0 failed to save (rank 0 raises its own
            error); ``save_kwargs`` given for an FSDP2 model.
    """
    import loragen  # imported here: the adapter I/O sits above this module in the package layout

    inner = unwrap_model(model)
    sharded = bool(_fsdp2_modules(inner))
    if sharded and save_kwargs:
        raise TrainingSetupError(
            f"save_adapter_main_process: options {sorted(save_kwargs)} are not supported for FSDP2 models"
        )
    gathered = _gather_trainable_state(inner) if sharded else None
    target: Path | None = None
    failure: BaseException | None = None
    if is_main_process():
        target = Path(path)
        try:
            if gathered is None:
                loragen.save_adapter(inner, target, **save_kwargs)
            else:
                loragen.save_adapter(inner, target, state_dict=gathered)
        except Exception as exc:  # noqa: BLE001 - reported to every rank below, then raised here
            failure = exc
    if dist.is_available() and dist.is_initialized():
        # Tell every rank whether rank 0 succeeded, instead of leaving them waiting at a barrier.
        message = [f"{type(failure).__name__}: {failure}" if failure is not None else None]
        dist.broadcast_object_list(message, src=0)
        if failure is None and message[0] is not None:
            raise TrainingSetupError(f"save_adapter_main_process: rank 0 failed to save {path}: {message[0]}")
    if failure is not None:
        raise failure
    return target
