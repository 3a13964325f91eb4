"""``AdamW8bit``: AdamW with both moments kept as one byte per element, and the quantization that stores them.

The state format is bitsandbytes' block-wise dynamic 8-bit quantization (Dettmers et al., 2022): each
block of ``block_size`` elements stores one fp32 scale (its largest magnitude) and one byte per element,
an index into a fixed 256-entry table whose spacing is dynamic (each of seven decades gets twice the
entries of the one below), so small values keep their relative precision. A step dequantizes the moments,
runs the AdamW update in fp32 and quantizes them again; tensors under ``min_8bit_size`` elements keep fp32
moments. On CUDA one fused kernel (``kernels/adamw8bit.cu.j2``) reproduces the torch path's codes exactly.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from loragen import cuda

__all__ = [
    "AdamW8bit",
    "adamw8bit_update_",
    "dequantize_blockwise",
    "dynamic_code",
    "dynamic_kind",
    "quantize_blocks",
    "quantize_blockwise",
]

# ---- block-wise dynamic 8-bit quantization ----------------------------------------------------------------

_DECADES = 7  # the dynamic table spans magnitudes from about 1e-7 to 1


def dynamic_code(signed: bool) -> torch.Tensor:
    """The 256-entry dynamic quantization table, sorted ascending, float32.

    Decade ``d`` (0 = smallest) holds magnitudes ``10**(d - 6) * f``, ``f`` the centres of an even split of
    ``[0.1, 1]`` into ``2**d`` parts (``2**(d + 1)`` unsigned), plus exactly ``0`` and ``1``. ``signed``:
    values in ``[-1, 1]`` (first moment), else ``[0, 1]`` (second moment). Returns a new ``(256,)`` tensor.
    """
    return _build_dynamic_code(signed).clone()


@functools.cache
def _build_dynamic_code(signed: bool) -> torch.Tensor:
    magnitudes: list[float] = []
    for decade in range(_DECADES):
        parts = 2**decade if signed else 2 ** (decade + 1)
        edges = torch.linspace(0.1, 1.0, parts + 1, dtype=torch.float64)
        centres = (edges[:-1] + edges[1:]) / 2
        magnitudes.extend((centres * 10.0 ** (decade - _DECADES + 1)).tolist())
    values = [*magnitudes, 0.0, 1.0]
    if signed:
        values += [-m for m in magnitudes]
    return torch.tensor(sorted(values), dtype=torch.float32)


_LUT_SHIFT = 15  # buckets of 2**15 float32 bit patterns: relative width 2**-8, below the table's spacing
_LUT_MASK = (1 << (32 - _LUT_SHIFT)) - 1  # keeps the sign bit as the bucket number's top bit


@functools.cache
def _lookup(signed: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(first, midpoints)`` on ``device``: for each bucket of float32 bit patterns (top bits), the nearest
    :func:`dynamic_code` entry of its lowest value (int32), and the table's midpoints padded with ``inf``.
    A bucket is narrower than the gap between two midpoints, so a value's nearest entry is ``first`` or the
    next one up: one comparison with the midpoint decides.
    """
    code = _build_dynamic_code(signed)
    midpoints = torch.cat(((code[1:] + code[:-1]) / 2, torch.tensor([math.inf])))
    patterns = torch.arange(_LUT_MASK + 1, dtype=torch.int64) << _LUT_SHIFT
    lowest = patterns.to(torch.int32).view(torch.float32)  # a bucket's first pattern: its smallest magnitude
    highest = (patterns + (1 << _LUT_SHIFT) - 1).to(torch.int32).view(torch.float32)
    lower, upper = torch.minimum(lowest, highest), torch.maximum(lowest, highest)
    usable = torch.minimum(lower.abs(), upper.abs()) <= 1.0  # the others hold no normalized value
    first = torch.where(usable, torch.bucketize(lower, midpoints[:-1]), torch.zeros((), dtype=torch.int64))
    spans = torch.bucketize(upper, midpoints[:-1]) - first
    if int(spans[usable].max()) > 1:
        raise RuntimeError("internal error: a lookup bucket spans two midpoints of the dynamic table")
    return first.to(device=device, dtype=torch.int32), midpoints.to(device)


def _dynamic_indices(normalized: torch.Tensor, signed: bool, keep_nonzero: bool) -> torch.Tensor:
    """Index of the nearest :func:`dynamic_code` entry for each value of ``normalized`` (in [-1, 1])."""
    first, midpoints = _lookup(signed, normalized.device)
    buckets = ((normalized.view(torch.int32) >> _LUT_SHIFT) & _LUT_MASK).view(-1)
    below = torch.index_select(first, 0, buckets)  # index_select: much faster than t[idx] on a CPU
    nearest = below + (normalized.view(-1) > torch.index_select(midpoints, 0, below))
    if keep_nonzero:
        # A second moment rounded to zero under a non-zero first moment would make the step m / eps.
        zero = 127 if signed else 0
        values = normalized.view(-1)
        step = (values > 0).to(torch.int32) - (values < 0).to(torch.int32)
        nearest = torch.where(nearest == zero, nearest + step, nearest)
    return nearest.view(normalized.shape)


def dynamic_kind(code: torch.Tensor) -> bool | None:
    """``True`` / ``False`` when ``code`` is the signed / unsigned :func:`dynamic_code`, else ``None``."""
    table = code.detach().cpu()
    for signed in (True, False):
        if torch.equal(table, _build_dynamic_code(signed)):
            return signed
    return None


def quantize_blocks(
    blocks: torch.Tensor, code: torch.Tensor, dynamic: bool | None, keep_nonzero: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``(n_blocks, block_size)`` values; ``dynamic`` is :func:`dynamic_kind` of ``code``."""
    absmax = blocks.abs().amax(dim=1)
    scale = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    normalized = blocks / scale[:, None]
    if dynamic is not None:
        codes = _dynamic_indices(normalized, dynamic, keep_nonzero)
    else:  # any other sorted table: nearest entry by comparing with the midpoints between entries
        codes = torch.bucketize(normalized, (code[1:] + code[:-1]) / 2)
        if keep_nonzero:
            zero = int(torch.argmin(code.abs()))
            codes = torch.where((codes == zero) & (normalized != 0), codes + normalized.sign().long(), codes)
    return codes.to(torch.uint8), absmax


def quantize_blockwise(
    values: torch.Tensor, code: torch.Tensor, block_size: int, *, keep_nonzero: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``values`` (any shape; flattened, zero-padded to whole blocks) block by block to indices of
    the nearest entries of ``code`` (a sorted table of 256 values in ``[-1, 1]`` on ``values``' device).
    ``keep_nonzero`` rounds non-zero values nearest to ``0.0`` to the smallest entry of their sign instead.

    Returns:
        ``(codes, absmax)``: uint8 ``(n_blocks, block_size)`` and each block's largest magnitude, float32
        ``(n_blocks,)``.

    Raises:
        ValueError: ``block_size`` is not positive.
    """
    if block_size <= 0:
        raise ValueError(f"quantize_blockwise: block_size must be a positive integer, got {block_size}")
    flat = values.detach().reshape(-1).float()
    padding = (-flat.numel()) % block_size
    if padding:
        flat = torch.nn.functional.pad(flat, (0, padding))
    return quantize_blocks(flat.view(-1, block_size), code, dynamic_kind(code), keep_nonzero)


def dequantize_blockwise(
    codes: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, shape: torch.Size | None = None
) -> torch.Tensor:
    """Inverse of :func:`quantize_blockwise`: float32 ``(n_blocks, block_size)`` from uint8 ``codes`` of that
    shape, float32 ``absmax`` ``(n_blocks,)`` and their table ``code``; with ``shape``, the padding is dropped
    and the result reshaped to it."""

    blocks = (
        torch.index_select(code, 0, codes.reshape(-1).to(torch.int32)).view(codes.shape) * absmax[:, None]
    )
    if shape is None:
        return blocks
    numel = math.prod(shape)
    return blocks.reshape(-1)[:numel].reshape(shape)


# ---- the optimizer -----------------------------------------------------------------------------------

_CHUNK_ELEMENTS = 1 << 20  # elements per chunk of an 8-bit update (bounds the fp32 temporaries)


def adamw8bit_update_(
    param: torch.Tensor,
    grad: torch.Tensor,
    state: dict[str, Any],
    *,
    signed_code: torch.Tensor,
    unsigned_code: torch.Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
) -> None:
    """One AdamW step for ``param`` with block-wise 8-bit moments, in place.

    ``state`` holds ``exp_avg_codes`` / ``exp_avg_sq_codes`` (uint8, ``(n_blocks, block_size)``) and
    ``exp_avg_absmax`` / ``exp_avg_sq_absmax`` (float32, ``(n_blocks,)``), updated in place. The
    parameter update uses the fp32 moments before requantization. CUDA tensors the kernel takes
    (:func:`loragen.cuda.optim.adamw8bit_update_cuda`) run as one launch.
    """
    if param.is_cuda:
        from loragen.cuda.optim import adamw8bit_update_cuda  # NVRTC machinery: only for CUDA tensors

        if cuda.is_available() and adamw8bit_update_cuda(
            param,
            grad,
            state,
            signed_code=signed_code,
            unsigned_code=unsigned_code,
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            eps=eps,
            weight_decay=weight_decay,
            step=step,
        ):
            return
    m_codes, m_absmax = state["exp_avg_codes"], state["exp_avg_absmax"]
    v_codes, v_absmax = state["exp_avg_sq_codes"], state["exp_avg_sq_absmax"]
    n_blocks, block_size = m_codes.shape
    numel = param.numel()
    in_place = param.dtype == torch.float32 and param.is_contiguous()
    flat_param = param.detach().view(-1) if in_place else param.detach().reshape(-1).float()
    flat_grad = grad.detach().reshape(-1)
    step_size = lr / (1.0 - beta1**step)
    sqrt_correction2 = math.sqrt(1.0 - beta2**step)
    chunk = max(1, _CHUNK_ELEMENTS // block_size)
    signed_dynamic, unsigned_dynamic = dynamic_kind(signed_code), dynamic_kind(unsigned_code)
    for first in range(0, n_blocks, chunk):
        last = min(first + chunk, n_blocks)
        start, stop = first * block_size, min(last * block_size, numel)
        g = flat_grad[start:stop].float()
        padding = (last - first) * block_size - g.numel()
        if padding:
            g = torch.nn.functional.pad(g, (0, padding))
        g = g.view(-1, block_size)
        m = dequantize_blockwise(m_codes[first:last], m_absmax[first:last], signed_code)
        v = dequantize_blockwise(v_codes[first:last], v_absmax[first:last], unsigned_code)
        m.lerp_(g, 1.0 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        update = (m / (v.sqrt() / sqrt_correction2).add_(eps)).view(-1)[: stop - start]
        target = flat_param[start:stop]
        if weight_decay:
            target.mul_(1.0 - lr * weight_decay)
        target.add_(update, alpha=-step_size)
        m_codes[first:last], m_absmax[first:last] = quantize_blocks(m, signed_code, signed_dynamic)
        v_codes[first:last], v_absmax[first:last] = quantize_blocks(
            v, unsigned_code, unsigned_dynamic, keep_nonzero=True
        )
    if not in_place:
        with torch.no_grad():
            param.copy_(flat_param.view(param.shape))


def _adamw_fp32_update_(param: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], **hyper: Any) -> None:
    lr, beta1, beta2, step = hyper["lr"], hyper["beta1"], hyper["beta2"], hyper["step"]
    eps, weight_decay = hyper["eps"], hyper["weight_decay"]
    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
    grad32 = grad.float()
    exp_avg.lerp_(grad32, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad32, grad32, value=1.0 - beta2)
    bias_correction1 = 1.0 - beta1**step
    bias_correction2 = 1.0 - beta2**step
    denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(eps)
    with torch.no_grad():
        work = param.float() if param.dtype != torch.float32 else param
        if weight_decay:
            work.mul_(1.0 - lr * weight_decay)
        work.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
        if work is not param:
            param.copy_(work)


class AdamW8bit(torch.optim.Optimizer):
    """AdamW whose two moments are stored block-wise quantized to 8 bits (see the module docstring); a
    drop-in for ``torch.optim.AdamW`` (same hyper-parameters and defaults).

    Args:
        params: parameters or parameter groups, as for any torch optimizer.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``.
        block_size: elements per quantization block (one fp32 scale each).
        min_8bit_size: parameters with fewer elements keep fp32 moments.

    Raises:
        ValueError: a hyper-parameter is out of range (the message names it and the accepted range).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        block_size: int = 256,
        min_8bit_size: int = 4096,
    ) -> None:
        if not lr >= 0.0:
            raise ValueError(f"AdamW8bit: lr must be >= 0, got {lr}")
        if not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"AdamW8bit: betas must each lie in [0, 1), got {betas}")
        if not eps >= 0.0:
            raise ValueError(f"AdamW8bit: eps must be >= 0, got {eps}")
        if not weight_decay >= 0.0:
            raise ValueError(f"AdamW8bit: weight_decay must be >= 0, got {weight_decay}")
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"AdamW8bit: block_size must be a positive integer, got {block_size!r}")
        if not isinstance(min_8bit_size, int) or min_8bit_size < 0:
            raise ValueError(
                f"AdamW8bit: min_8bit_size must be a non-negative integer, got {min_8bit_size!r}"
            )
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.block_size = block_size
        self.min_8bit_size = min_8bit_size
        self._codes: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._codes:
            self._codes[device] = (dynamic_code(True).to(device), dynamic_code(False).to(device))
        return self._codes[device]

    def _init_state(self, param: torch.Tensor, state: dict[str, Any]) -> None:
        if type(param).__name__ == "DTensor" or type(param.data).__name__ == "DTensor":
            raise TypeError(
                "AdamW8bit does not support sharded (DTensor) parameters such as FSDP2's: its blocks "
                "would straddle shards. Use torch.optim.AdamW (make_optimizer(..., eight_bit=False))"
            )
        state["step"] = 0
        n_blocks = -(-param.numel() // self.block_size)
        for name in ("exp_avg", "exp_avg_sq"):
            if param.numel() < self.min_8bit_size:
                state[name] = torch.zeros_like(
                    param, dtype=torch.float32, memory_format=torch.preserve_format
                )
                continue
            # an all-zero block has scale 0, so any code decodes to 0
            state[f"{name}_codes"] = torch.zeros(
                n_blocks, self.block_size, dtype=torch.uint8, device=param.device
            )
            state[f"{name}_absmax"] = torch.zeros(n_blocks, dtype=torch.float32, device=param.device)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One optimization step; ``closure`` re-evaluates the loss. Raises RuntimeError on a sparse gradient."""

        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise RuntimeError(
                        "AdamW8bit does not support sparse gradients; use torch.optim.SparseAdam"
                    )
                state = self.state[param]
                if not state:
                    self._init_state(param, state)
                state["step"] += 1
                hyper = {
                    "lr": group["lr"],
                    "beta1": beta1,
                    "beta2": beta2,
                    "eps": group["eps"],
                    "weight_decay": group["weight_decay"],
                    "step": state["step"],
                }
                if "exp_avg" in state:
                    _adamw_fp32_update_(param, param.grad, state, **hyper)
                else:
                    signed, unsigned = self._tables(param.device)
                    adamw8bit_update_(
                        param, param.grad, state, signed_code=signed, unsigned_code=unsigned, **hyper
                    )
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by :meth:`state_dict`, keeping the saved dtypes (torch's casts them)."""

        saved_state = {index: dict(entry) for index, entry in state_dict["state"].items()}
        saved_ids = [index for group in state_dict["param_groups"] for index in group["params"]]
        super().load_state_dict(state_dict)
        params = [param for group in self.param_groups for param in group["params"]]
        for index, param in zip(saved_ids, params):
            for key, value in saved_state.get(index, {}).items():
                self.state[param][key] = value.to(device=param.device) if torch.is_tensor(value) else value
