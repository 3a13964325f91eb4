"""loragen's CUDA path: LoRA kernels rendered from Jinja templates, compiled by NVRTC, launched on
PyTorch's current stream.

=============== =============================================================================
module          concern
=============== =============================================================================
kernel_variants the variants (dtype, rank bucket, alignment) and each kernel's tiles
specs           the kernels' parameters and grids
render          kernels/*.cu.j2 -> CUDA C (Jinja, StrictUndefined; every decision in specs)
nvrtc           CUDA C -> cubin per architecture; errors carry the kernel, parameters and log
cache           cubins in memory and on disk (atomic entries, checksummed, rebuilt if corrupt)
isolated        the self-check of a variant in a child process (a faulting kernel cannot take the
                caller's CUDA context with it)
launch          the driver side: module loading and launches in PyTorch's primary context, on
                PyTorch's current stream, from prebuilt parameter blocks
passes          the four kernel passes of the op: argument lists, grids, partial sums
hostcache       what the op keeps between calls: plans, padded factors, launcher handles
selfcheck       each variant checked on first use per device; failures -> one warning and the torch path
check_numerics  what the self-check computes under: full float32 products and no autocast, whatever
                the caller set (and its settings back as found)
torch_kernels   the torch path: each kernel's computation as torch products (cuBLAS), same outputs
torch_path      the eager op on the torch path: one composition with torch's autograd, and its routing
torch_dropout   the torch path's Philox keep-mask (jiterator kernels on a GPU)
op_inputs       what the op accepts (checks, fallback reasons) and its dropout rng tensors
linear_op       the custom ops, the eager autograd Function and :func:`lora_linear_cuda`
group_op        sibling LoRA layers reading one input (q/k/v, gate/up) as one autograd node: one
                lora_down and one lora_grad_in launch for the whole group
optim           the 8-bit AdamW step (:func:`loragen.training.adamw8bit.adamw8bit_update_` on CUDA tensors)
=============== =============================================================================

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
    "unsupported_reason": "loragen.cuda.op_inputs",
    "CudaLoraError": "loragen.cuda.op_inputs",
    "KernelCompileError": "loragen.cuda.nvrtc",
}

if TYPE_CHECKING:  # pragma: no cover
    from loragen.cuda.linear_op import lora_linear_cuda
    from loragen.cuda.nvrtc import KernelCompileError
    from loragen.cuda.op_inputs import CudaLoraError, unsupported_reason


_available: bool | None = None


def is_available() -> bool:
    """True when PyTorch sees a CUDA device and cuda-python's bindings are installed.

    Checks PyTorch first, so on a machine without a GPU nothing from ``cuda.bindings`` is imported. The
    answer is computed once per process (neither changes while it runs).
    """
    global _available
    if _available is None:
        _available = _probe()
    return _available


def _probe() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        return importlib.util.find_spec("cuda.bindings") is not None
    except (ImportError, ValueError):  # a namespace "cuda" without the bindings
        return False


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'loragen.cuda' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
