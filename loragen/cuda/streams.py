"""PyTorch's current CUDA stream as the driver sees it: its raw handle, and whether the work queued on it
is being captured into a CUDA graph.

One place for both questions, which the launcher, the torch path's dropout, the factor caches and the
self-check ask; the CPU tests patch :func:`capturing` here to make a call look captured.
"""

from __future__ import annotations

import torch

__all__ = ["capturing", "current_handle", "raw_handle"]


def raw_handle(index: int) -> int:
    """PyTorch's current stream on CUDA device ``index`` as the driver's handle (an int), without building
    a ``torch.cuda.Stream`` object where PyTorch offers the raw handle."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return int(raw(index))
    return int(torch.cuda.current_stream(index).cuda_stream)


def current_handle(device: torch.device) -> int:
    """:func:`raw_handle` of ``device`` (its index, or the current device's), 0 for a CPU device."""
    if device.type != "cuda":
        return 0
    return raw_handle(device.index if device.index is not None else torch.cuda.current_device())


def capturing(device: torch.device) -> bool:
    """Whether work queued on ``device``'s current stream is being captured into a CUDA graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()
