"""``AdamW8bit``: AdamW with both moments kept as one byte per element (block-wise dynamic
quantization, :mod:`loragen.training.quantization`).

A step dequantizes a parameter's moments to fp32, runs the ordinary AdamW update with them, and
quantizes the new moments again (nearest table entry). Tensors smaller than ``min_8bit_size`` elements
(biases, norms, small LoRA factors) keep fp32 moments, as in bitsandbytes: they cost little and
quantizing them saves little.

The update runs in plain torch ops on any device; on CUDA, :func:`adamw8bit_update_` hands supported
tensors to one fused kernel (``kernels/adamw8bit.cu.j2``, compiled by NVRTC like the LoRA kernels) that
reproduces the torch path's codes exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from loragen import cuda
from loragen.training.quantization import dequantize_blockwise, dynamic_code, dynamic_kind, quantize_blocks

__all__ = ["AdamW8bit", "adamw8bit_update_"]

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
    parameter update uses the fp32 moments *before* requantization, so the rounding only affects later
    steps. Work proceeds in chunks of blocks, so the fp32 temporaries stay small for large parameters.
    On a CUDA device with loragen's kernels available, one kernel launch does the update
    (:func:`loragen.cuda.optim.adamw8bit_update_cuda`); inputs it does not take run the torch code below.
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


def _adamw_fp32_update_(
    param: torch.Tensor,
    grad: torch.Tensor,
    state: dict[str, Any],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
) -> None:
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
    """AdamW whose two moments are stored block-wise quantized to 8 bits (see the module docstring).

    Drop-in for ``torch.optim.AdamW`` (same hyper-parameters and defaults, decoupled weight decay, bias
    correction). Per quantized parameter element it stores 2 bytes plus ``8 / block_size`` bytes of block
    scales, against 8 bytes for fp32 AdamW: about 74% less with the default ``block_size=256``.

    Args:
        params: parameters or parameter groups, as for any torch optimizer.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW`` (``weight_decay`` defaults to 0.01 there too).
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
        if param.numel() < self.min_8bit_size:
            state["exp_avg"] = torch.zeros_like(
                param, dtype=torch.float32, memory_format=torch.preserve_format
            )
            state["exp_avg_sq"] = torch.zeros_like(
                param, dtype=torch.float32, memory_format=torch.preserve_format
            )
            return
        n_blocks = -(-param.numel() // self.block_size)
        for name in ("exp_avg", "exp_avg_sq"):
            # Code index of 0.0 in each table; an all-zero block has scale 0, so any index decodes to 0.
            state[f"{name}_codes"] = torch.zeros(
                n_blocks, self.block_size, dtype=torch.uint8, device=param.device
            )
            state[f"{name}_absmax"] = torch.zeros(n_blocks, dtype=torch.float32, device=param.device)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Perform one optimization step; ``closure`` re-evaluates the loss, as for any torch optimizer.

        Raises:
            RuntimeError: a parameter has a sparse gradient (not supported).
        """
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
                    signed_code, unsigned_code = self._tables(param.device)
                    adamw8bit_update_(
                        param,
                        param.grad,
                        state,
                        signed_code=signed_code,
                        unsigned_code=unsigned_code,
                        **hyper,
                    )
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by :meth:`state_dict`, keeping the saved dtypes.

        ``torch.optim.Optimizer.load_state_dict`` casts every floating or integer state tensor to the
        parameter's dtype, which would turn the uint8 codes into floats and round the fp32 block scales
        of a bf16 parameter; the saved tensors are put back with their own dtypes afterwards.
        """
        saved_state = {index: dict(entry) for index, entry in state_dict["state"].items()}
        saved_ids = [index for group in state_dict["param_groups"] for index in group["params"]]
        super().load_state_dict(state_dict)
        params = [param for group in self.param_groups for param in group["params"]]
        for index, param in zip(saved_ids, params):
            for key, value in saved_state.get(index, {}).items():
                if torch.is_tensor(value):
                    self.state[param][key] = value.to(device=param.device)
                else:
                    self.state[param][key] = value
