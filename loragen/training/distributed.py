"""Distributed training of LoRA models: ``DistributedDataParallel`` with settings that suit LoRA, and saving
the adapter once, from rank 0, from a wrapped model (DDP, ``torch.compile``, FSDP2)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from loragen.adapters.save import save_adapter
from loragen.errors import TrainingSetupError

if dist.is_available():
    # Imported before any process group exists: torch.distributed.nn.functional binds group.WORLD as
    # default arguments on first import, and imported later (by FSDP2's saving) they would keep the default
    # group alive past destroy_process_group, so that a rank may abort at interpreter exit.
    import torch.distributed.nn

__all__ = [
    "is_main_process",
    "save_adapter_main_process",
    "unwrap_model",
    "wrap_ddp",
]


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
    """Wrap ``model`` (converted, on its device) in ``DistributedDataParallel``, which synchronizes only what
    trains, with ``find_unused_parameters=False`` unless ``ddp_kwargs`` say; ``reentrant_checkpointing``
    (the model uses ``use_reentrant=True``) declares the graph static, so each parameter is reduced once.

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


def _is_fsdp2(model: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


def _gather_trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) CPU copies of the trainable tensors of an FSDP2 model; a collective call."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    state = get_model_state_dict(model, options=options)
    return {name: value for name, value in state.items() if isinstance(value, torch.Tensor)}


def save_adapter_main_process(
    model: nn.Module, path: str | os.PathLike[str], **save_kwargs: Any
) -> Path | None:
    """Save the adapter with :func:`loragen.save_adapter` from rank 0 only; call it on every rank (or
    outside ``torch.distributed``). Wrappers are removed with :func:`unwrap_model`; an FSDP2 model's
    trainable tensors are gathered first (a collective). Every rank returns once the folder is complete.

    Returns:
        The adapter folder on rank 0, ``None`` elsewhere.

    Raises:
        TrainingSetupError: on ranks other than 0 when rank 0 failed to save (rank 0 raises its own
            error); ``save_kwargs`` given for an FSDP2 model.
    """
    inner = unwrap_model(model)
    if _is_fsdp2(inner):
        if save_kwargs:
            raise TrainingSetupError(
                f"save_adapter_main_process: options {sorted(save_kwargs)} are not supported for FSDP2 models"
            )
        save_kwargs = {"state_dict": _gather_trainable_state(inner)}
    target: Path | None = None
    failure: BaseException | None = None
    if is_main_process():
        target = Path(path)
        try:
            save_adapter(inner, target, **save_kwargs)
        except Exception as exc:
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
