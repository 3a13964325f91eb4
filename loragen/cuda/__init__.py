"""loragen's CUDA path: LoRA kernels rendered from Jinja templates, compiled by NVRTC, launched on
PyTorch's current stream.

Modules: ``kernels`` (variants, tiles, parameter lists, grids, the op's four passes), ``build``
(template -> CUDA C -> cubin, cached), ``launch`` (the driver side), ``selfcheck`` (each variant checked
on first use; the torch products it falls back to), ``linear_op`` (:func:`lora_linear_cuda`, its
autograd Function and custom ops), ``optim`` (the 8-bit AdamW step).

cuda-python is an optional extra (``pip install -e '.[cuda]'``). Nothing here imports ``cuda.bindings``
unless :func:`is_available` is true and a CUDA tensor arrives; compiling needs no GPU and no driver.
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
