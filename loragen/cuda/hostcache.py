"""What the CUDA LoRA op keeps between calls, so that a call does only what changed.

* launcher handles: a custom op takes only tensors and scalars, so the launcher travels as an int;
* plans: the kernel variant and the routed launcher per (sizes, dtype, device, launcher, switch);
* factors: A and B^T as the kernels read them -- float32, padded to the rank bucket -- one buffer per
  parameter, refreshed only when the parameter's ``_version``, data pointer or rank changes, after every
  optimizer step (:func:`optimizer_steps`), and on every call inside a CUDA-graph capture (so that each
  replay copies the parameters' current values). A parameter that a capture has read is copied on every
  call after it too: a replay changes parameters in place (a captured optimizer step) without moving
  their version counters, so the counter no longer tells. And work queued inside a capture runs only when
  the graph replays, so a buffer is zeroed again by every call until one outside a capture has done it.
  Buffers are made outside inference mode (one made under ``torch.inference_mode`` could never be
  written again outside it);
* dropout constants per probability.

Shapes as in :mod:`loragen.cuda.linear_op`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.optim.optimizer import register_optimizer_step_post_hook

from loragen import philox, switches
from loragen.cuda.launch import KernelLauncher
from loragen.cuda.op_inputs import CudaLoraError
from loragen.cuda.passes import Plan
from loragen.cuda.selfcheck import default_checker

__all__ = [
    "dropout_args",
    "dropout_constants",
    "factor",
    "MAX_PLANS",
    "launcher_handle",
    "new_buffer",
    "optimizer_steps",
    "plan",
    "watch_optimizer_steps",
]


# A custom op takes only tensors and scalars, so the launcher travels as an int: 0 is the default
# self-checked driver launcher, others are launchers callers passed in (tests, the null driver).
_launchers: list[KernelLauncher | None] = [None]
_handles: dict[int, int] = {}


def launcher_handle(launcher: KernelLauncher | None) -> int:
    """The int that stands for ``launcher`` in the custom op's arguments (0: the default launcher).

    A launcher passed once is kept for the life of the process. Under ``torch.compile`` the table is
    only read: the compiled graph runs the custom op before the tracer's own updates of module state
    are replayed, so a launcher first seen while tracing could not be found by the op.

    Raises:
        CudaLoraError: ``launcher`` is first seen while ``torch.compile`` traces (call the op with it
            once outside compilation first).
    """
    if launcher is None:
        return 0
    handle = _handles.get(id(launcher))
    if handle is not None and _launchers[handle] is launcher:
        return handle
    if torch.compiler.is_compiling():
        raise CudaLoraError(
            f"lora_linear_cuda: launcher={type(launcher).__name__} is first used inside torch.compile; "
            "call the op with it once outside compilation first (the compiled graph looks launchers up in "
            "a table it cannot fill while tracing)"
        )
    handle = _handles[id(launcher)] = len(_launchers)
    _launchers.append(launcher)
    return handle


def launcher(handle: int) -> KernelLauncher:
    launcher = _launchers[handle]
    return default_checker() if launcher is None else launcher


_plans: dict[tuple[Any, ...], Plan] = {}
# Plans are kept per shape: a run whose batches take ever new sequence lengths would add one per length
# and layer shape for good. Past this many the table starts again (a plan is rebuilt in microseconds, and
# the self-check's routing it reads is kept elsewhere); calls in flight keep the plans they hold.
MAX_PLANS = 4096


def plan(x2: Tensor, out_features: int, rank: int, handle: int) -> Plan:
    """The cached :class:`Plan` for these sizes, dtype, device, launcher and kernel switch.

    The routed launcher it holds stays right when a variant fails later: the self-check's guarded
    launcher moves its launches to the torch path itself.
    """
    key = (x2.shape, x2.dtype, x2.device, out_features, rank, handle, switches.cuda_kernels.get())
    found = _plans.get(key)
    if found is None:
        if len(_plans) >= MAX_PLANS:
            _plans.clear()
        found = _plans[key] = Plan(x2, out_features, rank, launcher(handle))
    return found


# Optimizer steps taken in this process, counted by torch.optim's global step hook from the first cached
# factor on. Some optimizers write parameters without moving their version counters (bitsandbytes' 8-bit
# optimizers and other kernels that write through a raw pointer; FSDP2 copies gathered values into its
# parameters with the counter kept), so a cached factor is copied again after every step as well. That
# costs nothing more in training, where a torch optimizer's in-place update moves the counter anyway, and
# nothing in inference, where no step is taken.
_steps = 0
_step_listeners: list[Callable[[], object]] = []
_step_hook: list[Any] = []


def _stepped(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    global _steps
    _steps += 1
    for listener in _step_listeners:
        listener()


def watch_optimizer_steps(listener: Callable[[], object] | None = None) -> None:
    """Count optimizer steps from now on (:func:`optimizer_steps`; the hook is registered once per
    process), and call ``listener`` after each one too (the C++ host path's own factor cache)."""
    if not _step_hook:
        _step_hook.append(register_optimizer_step_post_hook(_stepped))
    if listener is not None and listener not in _step_listeners:
        _step_listeners.append(listener)


def optimizer_steps() -> int:
    """How many ``torch.optim.Optimizer`` steps this process has taken since :func:`watch_optimizer_steps`."""
    return _steps


class _Factor:
    """A LoRA factor as the kernels read it -- float32, (R, features), rows r..R-1 zero -- kept in one
    buffer per parameter and refreshed only when the parameter changed (``_version``, data pointer,
    rank), after an optimizer step (``steps``), or on every call once a CUDA-graph capture has read it
    (``captured``); ``zeroed``: the padding rows' zeros have been written outside a capture."""

    __slots__ = ("buffer", "captured", "data_ptr", "rank", "source", "steps", "version", "zeroed")

    def __init__(self, source: Tensor, buffer: Tensor) -> None:
        self.source = weakref.ref(source)
        self.buffer = buffer
        self.version = -1
        self.data_ptr = -1
        self.rank = -1
        self.steps = -1
        self.captured = False
        self.zeroed = False


_factors: dict[tuple[int, bool], _Factor] = {}


def factor(t: Tensor, plan: Plan, transpose: bool, in_capture: bool) -> Tensor:
    """``t`` (lora_A (r, in), or lora_B (out, r) transposed) as float32 (R, features), padded with zero
    rows to the rank bucket and 16-byte aligned, from the per-parameter cache; ``in_capture``: the call
    is being captured into a CUDA graph (:func:`loragen.cuda.streams.capturing`, asked once per call)."""
    bucket = plan.variant.rank_bucket
    if not transpose and t.dtype == torch.float32 and t.shape[0] == bucket and t.is_contiguous():
        if not plan.variant.aligned or t.data_ptr() % 16 == 0:
            return t  # already what the kernels read: no copy (the op runs without autograd: no detach)
    key = (id(t), transpose)
    entry = _factors.get(key)
    features = t.shape[0] if transpose else t.shape[1]
    if (
        entry is None
        or entry.source() is not t
        or entry.buffer.shape[1] != features
        or entry.buffer.shape[0] != bucket
        or entry.buffer.device != t.device
    ):
        entry = _factors[key] = _Factor(t, new_buffer(bucket, features, device=t.device))
        weakref.finalize(t, _factors.pop, key, None)
        watch_optimizer_steps()
    rank = t.shape[1] if transpose else t.shape[0]
    if (
        in_capture
        or entry.captured
        or entry.version != t._version
        or entry.data_ptr != t.data_ptr()
        or entry.steps != _steps
        or entry.rank != rank
    ):
        with torch.no_grad():
            if not entry.zeroed or rank < entry.rank:  # a zero_ inside a capture writes only on replay
                entry.buffer.zero_()
                entry.zeroed = not in_capture
            entry.buffer[:rank].copy_(t.t() if transpose else t)
        entry.version = t._version
        entry.data_ptr = t.data_ptr()
        entry.steps = _steps
        entry.rank = rank
        entry.captured = entry.captured or in_capture
    return entry.buffer


def new_buffer(*shape: int, device: torch.device) -> Tensor:
    """A fresh float32 buffer for the caches (16-byte aligned, as every fresh allocation), made outside
    inference mode: a tensor made under ``torch.inference_mode`` can never be written again outside it,
    so a cache first filled during an evaluation would break the next training step."""
    with torch.inference_mode(False):
        return torch.empty(*shape, dtype=torch.float32, device=device)


# (threshold, keep_scale) per dropout probability that a call has validated and passed to dropout_args: a
# probability found here is one the op's checks accept
dropout_constants: dict[float, tuple[int, float]] = {0.0: (0, 1.0)}


def dropout_args(rng: Tensor | None, p: float) -> tuple[Tensor | None, int, float]:
    """The kernels' dropout arguments ``(rng, threshold, keep_scale)`` (p validated by the caller)."""
    constants = dropout_constants.get(p)
    if constants is None:
        constants = dropout_constants[p] = (philox.keep_threshold(p), philox.keep_scale(p))
    return (rng if constants[0] else None, *constants)
