"""The LoRA linear op on CUDA: :func:`lora_linear_cuda`, its one dispatcher, and the op it runs.

Routes, chosen per call: loragen's four kernels for the rank-r part and cuBLAS for the base GEMMs,
through :class:`_LoraLinearFunction` (eager) or the custom ops ``loragen::lora_linear`` and
``loragen::lora_linear_backward`` (under ``torch.compile``); or the torch composition
(:func:`loragen.reference.lora_linear_reference`) for inputs the kernels do not take
(:func:`unsupported_reason`) and variants on the torch route, where dropout keeps the kernels' Philox mask.

forward   h   = lora_down(x)                  one pass over x, Philox mask regenerated
          y   = x W^T                         cuBLAS, written in x's dtype
          y   = round(y + (bias + s h B^T))   lora_up: adds bias and the rank-r term in float32 in place
backward  dh, dB = lora_grad_out(g)           one pass over g (dh carries s)
          gx, dA = lora_grad_in(x, dh)        one pass over x, mask regenerated
          gx += g W                           cuBLAS, beta = 1
          dW = g^T x, db = sum(g)             only when the base is trainable

h is (N, R) float32, R the rank bucket (columns past r are 0). Dropout's seed and offset are drawn per
forward on the device (:func:`draw_rng`), so ``torch.manual_seed`` reproduces a run, checkpointing
recomputes the mask and a captured CUDA graph draws a fresh one per replay.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.optim.optimizer import register_optimizer_step_post_hook

from loragen import philox, switches
from loragen.cuda import kernels, launch
from loragen.cuda.kernels import DTYPE_NAMES, KernelLauncher, Plan
from loragen.cuda.selfcheck import TorchKernels, default_checker
from loragen.errors import LoraError
from loragen.philox import rng_tensor
from loragen.reference import lora_linear_reference

__all__ = [
    "CudaLoraError",
    "MAX_PLANS",
    "draw_rng",
    "dropout_args",
    "factor",
    "launcher_handle",
    "lora_linear_cuda",
    "plan_for",
    "seed_rng",
    "unsupported_reason",
]

# ---- what the op accepts ---------------------------------------------------------------------------

_WHERE = "loragen.cuda.lora_linear_cuda"


class CudaLoraError(LoraError, ValueError):
    """Inputs the CUDA LoRA op cannot take; the message names the argument and what is accepted."""


def unsupported_reason(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    lora_A: Tensor,
    lora_B: Tensor,
    *,
    fan_in_fan_out: bool = False,
) -> str | None:
    """Why the CUDA kernels cannot run on these inputs (:func:`lora_linear_cuda` then runs the torch
    composition), or None when they can."""
    if x.dtype not in DTYPE_NAMES:
        return f"x dtype {x.dtype} (kernels exist for float32, float16, bfloat16)"
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        return f"base weight/bias dtype differs from x ({x.dtype})"
    if lora_A.dtype not in DTYPE_NAMES or lora_B.dtype not in DTYPE_NAMES:
        return f"LoRA dtype {lora_A.dtype}/{lora_B.dtype} (expected float32, float16 or bfloat16)"
    if not 1 <= lora_A.shape[0] <= kernels.MAX_RANK:
        return f"rank r={lora_A.shape[0]} (the kernels take 1 <= r <= {kernels.MAX_RANK})"
    features = (x.shape[-1], weight.shape[0], weight.shape[1])
    if max(features) >= 2**31:
        return "a feature dimension of 2**31 or more"
    if 0 in features:
        return "a feature dimension of 0 (no grid to launch)"
    if x.numel() // max(x.shape[-1], 1) >= 2**31:
        return "2**31 or more rows (the kernels take row counts as 32-bit int)"
    return None


def _check_inputs(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    lora_A: Tensor,
    lora_B: Tensor,
    fan_in_fan_out: bool,
    p: float,
    require_cuda: bool,
) -> None:
    """Raise :class:`CudaLoraError` naming the first bad argument."""
    if not 0.0 <= p < 1.0:
        raise CudaLoraError(f"{_WHERE}: dropout_p={p!r}; expected 0 <= p < 1")
    device = x.device
    if (
        (require_cuda and device.type != "cuda")
        or weight.device != device
        or lora_A.device != device
        or lora_B.device != device
        or (bias is not None and bias.device != device)
    ):
        tensors = zip(("x", "weight", "bias", "lora_A", "lora_B"), (x, weight, bias, lora_A, lora_B))
        devices = ", ".join(f"{n}: {t.device}" for n, t in tensors if t is not None)
        raise CudaLoraError(f"{_WHERE}: all tensors must be on one CUDA device, got {devices}")
    in_features = x.shape[-1]
    if weight.dim() != 2 or weight.shape[0 if fan_in_fan_out else 1] != in_features:
        layout = "(in, out) with fan_in_fan_out" if fan_in_fan_out else "(out, in)"
        raise CudaLoraError(
            f"{_WHERE}: weight {tuple(weight.shape)} is not {layout} for x (..., {in_features})"
        )
    out_features = weight.shape[1 if fan_in_fan_out else 0]
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != out_features):
        raise CudaLoraError(f"{_WHERE}: bias {tuple(bias.shape)}; expected ({out_features},)")
    r = lora_A.shape[0]
    if lora_A.dim() != 2 or lora_A.shape[1] != in_features:
        raise CudaLoraError(f"{_WHERE}: lora_A {tuple(lora_A.shape)}; expected (r, {in_features})")
    if lora_B.dim() != 2 or lora_B.shape[0] != out_features or lora_B.shape[1] != r:
        raise CudaLoraError(
            f"{_WHERE}: lora_B {tuple(lora_B.shape)}; expected ({out_features}, {r}) for r={r}"
        )


# whether autocast is on for any device: torch's argument-free check, cheap in the common case
_autocast_anywhere = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)


def _autocast_dtype(x: Tensor) -> torch.dtype | None:
    """The dtype autocast on x's device casts ``F.linear``'s inputs to, or None (CPU tensors follow the
    CPU's autocast, meta tensors have none)."""
    if not _autocast_anywhere() or x.device.type not in ("cuda", "cpu"):
        return None
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


def draw_rng(device: torch.device) -> Tensor:
    """A fresh (seed, offset) pair for one forward's dropout mask: int64 (2,) on ``device``, drawn by
    that device's torch generator (safe inside CUDA-graph capture, fresh values on every replay)."""
    return torch.randint(0, (1 << 63) - 1, (2,), dtype=torch.int64, device=device)


def seed_rng(seed: int, device: torch.device, offset: int = 0) -> Tensor:
    """The rng tensor for an explicit unsigned 64-bit ``seed`` and ``offset`` (stored as int64 bits),
    filled on ``device`` (no host-to-device copy).

    Raises:
        CudaLoraError: ``seed`` or ``offset`` is not an unsigned 64-bit integer.
    """
    for name, value in (("seed", seed), ("offset", offset)):
        if not 0 <= value < 1 << 64:
            raise CudaLoraError(f"{_WHERE}: {name}={value}; expected an unsigned 64-bit integer")
    return rng_tensor(seed, offset, device)


# ---- what the op keeps between calls ---------------------------------------------------------------

# A custom op takes only tensors and scalars, so the launcher travels as an int (0: the default).
_launchers: list[KernelLauncher | None] = [None]
_handles: dict[int, int] = {}


def launcher_handle(launcher: KernelLauncher | None) -> int:
    """The int that stands for ``launcher`` in the custom op's arguments (0: the default launcher), kept
    for the life of the process.

    Raises:
        CudaLoraError: ``launcher`` is first seen while ``torch.compile`` traces (the compiled graph
            runs the op before the tracer's updates of module state are replayed).
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


_plans: dict[tuple[Any, ...], Plan] = {}
# past this many plans (ever new sequence lengths) the table starts again; a plan is cheap to rebuild
MAX_PLANS = 4096


def plan_for(x2: Tensor, out_features: int, rank: int, handle: int) -> Plan:
    """The cached :class:`Plan` for these sizes, dtype, device, launcher and kernel switch."""
    key = (x2.shape, x2.dtype, x2.device, out_features, rank, handle, switches.cuda_kernels.get())
    found = _plans.get(key)
    if found is None:
        if len(_plans) >= MAX_PLANS:
            _plans.clear()
        launcher = _launchers[handle]
        found = _plans[key] = Plan(x2, out_features, rank, launcher or default_checker())
    return found


# Optimizer steps, counted from the first cached factor on: a cached factor is copied again after each
# (some optimizers write parameters without moving their version counters).
_steps = 0
_step_hook: list[Any] = []


def _stepped(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    global _steps
    _steps += 1


@dataclass(slots=True)
class _Factor:
    """A LoRA factor as the kernels read it -- float32, (R, features), rows r..R-1 zero -- refreshed when
    the parameter changed (``_version``, data pointer, rank), after an optimizer step, or on every call
    once a CUDA-graph capture has read it; ``zeroed``: the padding was zeroed outside a capture."""

    source: weakref.ref[Tensor]
    buffer: Tensor
    rank: int = -1
    seen: tuple[int, int, int] = (-1, -1, -1)  # the parameter's _version and data pointer, the step count
    captured: bool = False
    zeroed: bool = False


_factors: dict[tuple[int, bool], _Factor] = {}


def factor(t: Tensor, plan: Plan, transpose: bool, in_capture: bool) -> Tensor:
    """``t`` (lora_A (r, in), or lora_B (out, r) transposed) as float32 (R, features), padded with zero
    rows to the rank bucket and 16-byte aligned, from the per-parameter cache; ``in_capture``: the call
    is being captured into a CUDA graph (:func:`loragen.cuda.launch.capturing`, asked once per call)."""
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
        or entry.buffer.shape != (bucket, features)
        or entry.buffer.device != t.device
    ):
        # made outside inference mode: such a tensor could never be written again outside it
        with torch.inference_mode(False):
            buffer = torch.empty(bucket, features, dtype=torch.float32, device=t.device)
        entry = _factors[key] = _Factor(weakref.ref(t), buffer)
        weakref.finalize(t, _factors.pop, key, None)
        if not _step_hook:
            _step_hook.append(register_optimizer_step_post_hook(_stepped))
    rank = t.shape[1] if transpose else t.shape[0]
    seen = (t._version, t.data_ptr(), _steps)
    if in_capture or entry.captured or entry.seen != seen or entry.rank != rank:
        with torch.no_grad():
            if not entry.zeroed or rank < entry.rank:  # a zero_ inside a capture writes only on replay
                entry.buffer.zero_()
                entry.zeroed = not in_capture
            entry.buffer[:rank].copy_(t.t() if transpose else t)
        entry.seen, entry.rank = seen, rank
        entry.captured = entry.captured or in_capture
    return entry.buffer


# (threshold, keep_scale) per dropout probability the op has validated
_dropout_constants: dict[float, tuple[int, float]] = {0.0: (0, 1.0)}


def dropout_args(rng: Tensor | None, p: float) -> tuple[Tensor | None, int, float]:
    """The kernels' dropout arguments ``(rng, threshold, keep_scale)`` (p validated by the caller)."""
    constants = _dropout_constants.get(p)
    if constants is None:
        constants = _dropout_constants[p] = (philox.keep_threshold(p), philox.keep_scale(p))
    return (rng if constants[0] else None, *constants)


# ---- the custom ops --------------------------------------------------------------------------------

_NO_CONTEXT = contextlib.nullcontext()  # stateless: one instance serves every call

# what an eager forward hands its backward: the plan, A and B^T as the kernels read them, x's shape
_Prepared = tuple[kernels.Plan, Tensor, Tensor, torch.Size]
_Scalars = tuple[float, float, bool, int]  # scaling, dropout_p, fan_in_fan_out, launcher handle


def _without_autocast(x: Tensor) -> contextlib.AbstractContextManager[Any]:
    """Autocast off inside the op: the kernels run in the dtypes they are given."""
    return _NO_CONTEXT if _autocast_dtype(x) is None else torch.autocast(x.device.type, enabled=False)


def _lora_linear_impl(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    lora_A: Tensor,
    lora_B: Tensor,
    rng: Tensor | None,
    scaling: float,
    dropout_p: float,
    fan_in_fan_out: bool,
    launcher: int,
) -> tuple[Tensor, Tensor]:
    """y (..., out) in x's dtype and h (N, R) float32 (saved for backward)."""
    with _without_autocast(x):
        out, h, _, _ = _forward(
            x, weight, bias, lora_A, lora_B, rng, (scaling, dropout_p, fan_in_fan_out, launcher)
        )
    return out, h


_lora_linear_op = torch.library.custom_op("loragen::lora_linear", _lora_linear_impl, mutates_args=())


def _forward(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    lora_A: Tensor,
    lora_B: Tensor,
    rng: Tensor | None,
    args: _Scalars,
) -> tuple[Tensor, Tensor, Tensor, _Prepared]:
    """y, h, the 2-D x the kernels read, and what backward reuses."""
    scaling, dropout_p, fan_in_fan_out, launcher = args
    out_features = weight.shape[1] if fan_in_fan_out else weight.shape[0]
    x2 = x.reshape(-1, x.shape[-1])
    plan = plan_for(x2, out_features, lora_A.shape[0], launcher)
    x2 = plan.prepare(x2)
    in_capture = launch.capturing(x2.device)
    a32 = factor(lora_A, plan, False, in_capture)
    bt32 = factor(lora_B, plan, True, in_capture)
    h = kernels.down(plan, x2, a32, dropout_args(rng, dropout_p))
    out = torch.empty(*x.shape[:-1], out_features, dtype=x.dtype, device=x.device)
    out2 = out.view(plan.rows, out_features)
    # the base product in x's dtype (rounded as peft's base layer rounds it), then lora_up adds
    # bias + s h B^T in float32 and rounds once more: no float32 (N, out) temporary
    torch.mm(x2, weight if fan_in_fan_out else weight.t(), out=out2)
    kernels.up(plan, h, bt32, bias, scaling, out2)
    return out, h, x2, (plan, a32, bt32, x.shape)


@_lora_linear_op.register_fake
def _lora_linear_fake(
    x: Tensor, weight: Tensor, bias: Tensor | None, lora_A: Tensor, lora_B: Tensor, *scalars: Any
) -> tuple[Tensor, Tensor]:
    """The outputs' shapes, for ``torch.compile``."""
    out = x.new_empty((*x.shape[:-1], lora_B.shape[0]))
    h = x.new_empty((math.prod(x.shape[:-1]), kernels.rank_bucket(lora_A.shape[0])), dtype=torch.float32)
    return out, h


def _lora_linear_backward_impl(
    grad_out: Tensor,
    x: Tensor,
    weight: Tensor,
    lora_A: Tensor,
    lora_B: Tensor,
    h: Tensor,
    rng: Tensor | None,
    scaling: float,
    dropout_p: float,
    fan_in_fan_out: bool,
    needs: list[bool],
    launcher: int,
) -> list[Tensor]:
    """The gradients of (x, weight, bias, lora_A, lora_B) flagged in ``needs``, in that order."""
    saved = (x, weight, lora_A, lora_B, h, rng)
    with _without_autocast(x):
        return _backward(grad_out, saved, (scaling, dropout_p, fan_in_fan_out, launcher), needs, None)


_lora_linear_backward_op = torch.library.custom_op(
    "loragen::lora_linear_backward", _lora_linear_backward_impl, mutates_args=()
)


def _backward(
    grad_out: Tensor, saved: tuple[Any, ...], args: _Scalars, needs: list[bool], prepared: _Prepared | None
) -> list[Tensor]:
    """The gradients flagged in ``needs``. ``saved``: (x, weight, lora_A, lora_B, h, rng). ``prepared``: what the eager forward worked out, ``x``
    then being the 2-D x the kernels read; None: ``x`` as the op took it (the traced backward)."""
    x, weight, lora_A, lora_B, h, rng = saved
    scaling, dropout_p, fan_in_fan_out, launcher = args
    need_x, need_w, need_b, need_a, need_bb = needs
    out_features = weight.shape[1] if fan_in_fan_out else weight.shape[0]
    if prepared is None:
        x_shape = x.shape
        x2 = x.reshape(-1, x.shape[-1])
        plan = plan_for(x2, out_features, lora_A.shape[0], launcher)
        x2 = plan.prepare(x2)
        a32 = bt32 = None
    else:
        plan, a32, bt32, x_shape = prepared
        x2 = x
    g2 = grad_out.reshape(plan.rows, out_features)
    g2 = plan.prepare(g2 if g2.dtype == x2.dtype else g2.to(x2.dtype))
    grad_x = grad_a = grad_bb = None
    if plan.rows == 0:
        grad_a = torch.zeros_like(lora_A) if need_a else None
        grad_bb = torch.zeros_like(lora_B) if need_bb else None
        grad_x = x2.new_zeros(x_shape) if need_x else None
    elif need_x or need_a or need_bb:  # grad_x always has a LoRA term, frozen adapter or not
        # asked only where forward handed over no factors (the custom op's backward): both are None then
        in_capture = bt32 is None and launch.capturing(x2.device)
        if bt32 is None:
            bt32 = factor(lora_B, plan, True, in_capture)
        dh, db = kernels.grad_out(plan, g2, h, bt32, scaling)
        if need_bb:  # columns past the rank only when the rank is not a bucket; at most one copy
            grad_bb = (db if plan.rank == db.shape[1] else db[:, : plan.rank].contiguous()).to(lora_B.dtype)
        if need_x or need_a:
            if a32 is None:
                a32 = factor(lora_A, plan, False, in_capture)
            gx, da = kernels.grad_in(plan, x2, dh, a32, dropout_args(rng, dropout_p), need_x)
            if need_a:  # rows past the rank only when the rank is not a bucket
                grad_a = (da if plan.rank == da.shape[0] else da[: plan.rank]).to(lora_A.dtype)
            if gx is not None:
                gx.addmm_(g2, weight.t() if fan_in_fan_out else weight)
                grad_x = gx.view(x_shape)
    grad_w = None
    if need_w:
        grad_w = torch.mm(x2.t(), g2) if fan_in_fan_out else torch.mm(g2.t(), x2)
    grad_b = g2.sum(0) if need_b else None
    return [g for g in (grad_x, grad_w, grad_b, grad_a, grad_bb) if g is not None]


@_lora_linear_backward_op.register_fake
def _lora_linear_backward_fake(
    grad_out: Tensor, x: Tensor, weight: Tensor, lora_A: Tensor, lora_B: Tensor, *rest: Any
) -> list[Tensor]:
    """The gradients' shapes, for ``torch.compile``; ``needs`` is ``rest``'s second to last."""
    shapes = (x, weight, x.new_empty((lora_B.shape[0],)), lora_A, lora_B)
    return [torch.empty_like(t, memory_format=torch.contiguous_format) for t, n in zip(shapes, rest[-2]) if n]


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    x, weight, bias, lora_A, lora_B, rng, scaling, dropout_p, fan_in_fan_out, launcher = inputs
    ctx.save_for_backward(x, weight, lora_A, lora_B, output[1], rng)
    ctx.args = (scaling, dropout_p, fan_in_fan_out, launcher)
    ctx.has_bias = bias is not None
    ctx.mark_non_differentiable(output[1])


def _gradients(ctx: Any, grad_out: Tensor, traced: bool) -> tuple[Tensor | None, ...]:
    """The autograd formula shared by the custom op (``traced``: through the backward custom op, what
    torch.compile traces) and the eager Function (reusing what its forward prepared)."""
    needs = list(ctx.needs_input_grad[:5])
    needs[2] = needs[2] and ctx.has_bias
    if traced:
        grads = _lora_linear_backward_op(grad_out, *ctx.saved_tensors, *ctx.args[:3], needs, ctx.args[3])
    else:
        with _without_autocast(grad_out):
            grads = _backward(grad_out, ctx.saved_tensors, ctx.args, needs, ctx.prepared)
    found = iter(grads)
    return (*[next(found) if needed else None for needed in needs], None, None, None, None, None)


def _autograd_backward(ctx: Any, grad_out: Tensor, grad_h: Tensor | None) -> tuple[Tensor | None, ...]:
    return _gradients(ctx, grad_out, traced=True)


_lora_linear_op.register_autograd(_autograd_backward, setup_context=_setup_context)


class _LoraLinearFunction(torch.autograd.Function):
    """The eager path: the same forward, backward and saved tensors as ``loragen::lora_linear``, without
    the custom-op dispatch's host time. The scalars travel as one tuple (fewer arguments for autograd)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        lora_A: Tensor,
        lora_B: Tensor,
        rng: Tensor | None,
        args: _Scalars,
    ) -> Tensor:
        with _without_autocast(x):
            out, h, x2, ctx.prepared = _forward(x, weight, bias, lora_A, lora_B, rng, args)
        ctx.save_for_backward(x2, weight, lora_A, lora_B, h, rng)
        ctx.args = args
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        return _gradients(ctx, grad_out, traced=False)[:7]


def lora_linear_cuda(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    lora_A: Tensor,
    lora_B: Tensor,
    scaling: float,
    dropout_p: float,
    training: bool,
    *,
    fan_in_fan_out: bool = False,
    seed: int | None = None,
    launcher: KernelLauncher | None = None,
) -> Tensor:
    """LoRA linear ``x W^T + b + scaling * B A dropout(x)`` with loragen's CUDA kernels.

    Same semantics as :func:`loragen.ops.lora_linear`: x (..., in), weight (out, in) -- (in, out) with
    ``fan_in_fan_out`` --, bias (out,) or None, lora_A (r, in), lora_B (out, r) -> (..., out) in x's
    dtype; dropout (only when ``training``) on the LoRA branch, with the Philox mask of
    :mod:`loragen.philox`. Under autocast, x, weight and bias are cast as ``F.linear`` would. Inputs the
    kernels do not take (:func:`unsupported_reason`) run through
    :func:`loragen.reference.lora_linear_reference`. Works in CUDA-graph capture and ``torch.compile``.

    Args:
        seed: fixes the dropout mask (unsigned 64-bit, offset 0); None draws it (:func:`draw_rng`).
        launcher: runs the kernels (default: :func:`loragen.cuda.selfcheck.default_checker`); loragen's
            CPU tests pass an emulator or a null driver.

    Raises:
        CudaLoraError: tensors not on one device, or not on a CUDA device when no launcher is given;
            mismatched shapes; ``dropout_p`` outside [0, 1); ``seed`` not unsigned 64-bit.
    """
    _check_inputs(x, weight, bias, lora_A, lora_B, fan_in_fan_out, dropout_p, require_cuda=launcher is None)
    cast = _autocast_dtype(x)
    if cast is not None:
        x, weight = x.to(cast), weight.to(cast)
        bias = None if bias is None else bias.to(cast)
    reason = unsupported_reason(x, weight, bias, lora_A, lora_B, fan_in_fan_out=fan_in_fan_out)
    if reason is not None:
        return lora_linear_reference(
            x, weight, bias, lora_A, lora_B, scaling, dropout_p, training, fan_in_fan_out=fan_in_fan_out
        )
    p = float(dropout_p) if training else 0.0
    rng = None
    if p > 0:
        rng = draw_rng(x.device) if seed is None else seed_rng(seed, x.device)
    scalars = (float(scaling), p, fan_in_fan_out, launcher_handle(launcher))
    if torch.compiler.is_compiling():
        return _lora_linear_op(x, weight, bias, lora_A, lora_B, rng, *scalars)[0]
    if _on_torch_route(x, lora_B.shape[0], lora_A.shape[0], scalars[3]):  # the kernels' mask
        keep = None
        if rng is not None:
            keep = philox.rng_keep_mask(rng, 0, x.numel(), dropout_args(rng, p)[1]).view(x.shape)
        with _NO_CONTEXT if cast is None else torch.autocast(x.device.type, enabled=False):
            return lora_linear_reference(
                x, weight, bias, lora_A, lora_B, scaling, p, True, fan_in_fan_out=fan_in_fan_out, keep=keep
            )
    return _LoraLinearFunction.apply(x, weight, bias, lora_A, lora_B, rng, scalars)


# (x dtype, device, in, out, rank, launcher handle, kernel switch) -> whether the call takes the torch route
_routes: dict[tuple[Any, ...], bool] = {}


def _on_torch_route(x: Tensor, out_features: int, rank: int, handle: int) -> bool:
    """Whether the first call's plan routed this variant to a whole-op :class:`TorchKernels` (the
    self-check of a new variant raises RuntimeError inside a CUDA-graph capture)."""
    key = (x.dtype, x.device, x.shape[-1], out_features, rank, handle, switches.cuda_kernels.get())
    found = _routes.get(key)
    if found is None:
        routed = plan_for(x.reshape(-1, x.shape[-1]), out_features, rank, handle).launcher
        found = _routes[key] = isinstance(routed, TorchKernels) and routed.whole_op
    return found
