"""loragen's CUDA path: LoRA kernels rendered from Jinja templates, compiled by NVRTC, launched on
PyTorch's current stream.

========== ========================================================================================
module     concern
========== ========================================================================================
kernels    the kernel variants, their tiles, parameter lists and grids, and the op's four passes
build      kernels/*.cu.j2 -> CUDA C (Jinja) -> cubin (NVRTC), kept in memory and on disk
launch     the driver side: modules and launches in PyTorch's primary context and current stream
selfcheck  each variant checked on first use per device (in a child process on a GPU); the torch
           products a failing variant falls back to
linear_op  :func:`lora_linear_cuda`: the one dispatcher, its checks, what it caches between calls, the
           autograd Function and the custom ops for ``torch.compile``
optim      the 8-bit AdamW step (:func:`loragen.training.adamw8bit.adamw8bit_update_` on CUDA tensors)
========== ========================================================================================

cuda-python is an optional extra (``pip install -e '.[cuda]'`` from the loragen checkout). Nothing here imports
``cuda.bindings`` or touches the driver unless :func:`is_available` is true and a CUDA tensor arrives;
compiling (``nvrtc``) needs no GPU and no driver.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

import torch

__all__ = [
    "CudaLoraError",
    "KernelCompileError",
    "is_available",
    "lora_linear_cuda",
    "unsupported_reason",
]

_LAZY = {
    "lora_linear_cuda": "loragen.cuda.linear_op",
    "unsupported_reason": "loragen.cuda.linear_op",
    "CudaLoraError": "loragen.cuda.linear_op",
    "KernelCompileError": "loragen.cuda.build",
}

if TYPE_CHECKING:  # pragma: no cover
    from loragen.cuda.build import KernelCompileError
    from loragen.cuda.linear_op import CudaLoraError, lora_linear_cuda, unsupported_reason


_available: bool | None = None


def is_available() -> bool:
    """True when PyTorch sees a CUDA device and cuda-python's bindings are installed (PyTorch is asked
    first, so without a GPU nothing from ``cuda.bindings`` is imported); computed once per process."""
    global _available
    if _available is None:
        try:
            _available = torch.cuda.is_available() and importlib.util.find_spec("cuda.bindings") is not None
        except (ImportError, ValueError):  # a namespace "cuda" without the bindings
            _available = False
    return _available


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'loragen.cuda' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
