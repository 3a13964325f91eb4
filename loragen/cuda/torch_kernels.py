"""The torch path: what each LoRA kernel computes, with torch products (cuBLAS on a GPU) instead.

:class:`TorchKernels` is a :class:`~loragen.cuda.launch.KernelLauncher`: it takes a kernel's launch
exactly as :mod:`loragen.cuda.passes` makes it -- the same argument list, read by parameter name -- and
writes the same outputs, so the autograd Function and its hand-written backward run unchanged on it. It
is what a kernel variant runs on when it fails its self-check (:mod:`loragen.cuda.selfcheck`), what
``LORAGEN_CUDA_KERNELS=torch`` selects, and the reference the self-check compares the kernels with.

Products are taken in float32 (x, g cast up per row block), every output is rounded once into its dtype,
and the dropout mask is the Philox mask of :mod:`loragen.philox`, generated on the tensors' device: a
variant that falls back keeps the exact masks the kernels would have drawn. Split reductions write the
whole sum into partial 0 and zeros into the other partials, whose sum is all the caller reads.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from loragen import philox
from loragen.cuda.specs import KernelSpec, Variant

__all__ = ["TorchKernels", "keep_mask", "rng_values"]

_MASK32 = 0xFFFFFFFF
_MASK64 = (1 << 64) - 1
_BLOCK_ELEMS = 1 << 22  # elements per row block: float32 temporaries and mask words stay small


def keep_mask(start: int, numel: int, threshold: int, seed: int, offset: int, device: torch.device) -> Tensor:
    """Flat elements ``start .. start + numel - 1`` of the Philox keep-mask (:mod:`loragen.philox`'s
    layout), as bool on ``device``; ``threshold`` is :func:`loragen.philox.keep_threshold` of p."""
    if threshold == 0:
        return torch.ones(numel, dtype=torch.bool, device=device)
    per_call = philox.ELEMENTS_PER_CALL
    first, last = start // per_call, (start + numel + per_call - 1) // per_call
    q = torch.arange(first, last, dtype=torch.int64, device=device)
    counter = torch.stack(
        [q & _MASK32, q >> 32, torch.full_like(q, offset & _MASK32), torch.full_like(q, offset >> 32)], dim=-1
    )
    words = philox.philox4x32_10(counter, (seed & _MASK32, seed >> 32))
    lane_word = torch.arange(per_call, device=device) // 2
    lane_shift = torch.tensor([0, 16] * (per_call // 2), dtype=torch.int64, device=device)
    bits16 = (words[:, lane_word] >> lane_shift) & 0xFFFF
    skip = start - first * per_call
    return (bits16 >= threshold).reshape(-1)[skip : skip + numel]


def rng_values(rng: Tensor) -> tuple[int, int]:
    """The (seed, offset) pair the kernels read through their ``rng`` pointer, as unsigned 64-bit ints.

    ``rng`` is the op's int64 tensor of two elements (device memory); reading it synchronizes with the
    device, so the torch path with dropout cannot run inside a CUDA-graph capture (the kernels can).
    """
    seed, offset = rng.tolist()
    return seed & _MASK64, offset & _MASK64


def _row_blocks(rows: int, cols: int) -> Iterator[tuple[int, int]]:
    step = max(1, _BLOCK_ELEMS // max(cols, 1))
    for begin in range(0, rows, step):
        yield begin, min(rows, begin + step)


def _scaled_mask(v: dict, begin: int, end: int, device: torch.device) -> Tensor | None:
    """The keep-mask of rows ``begin:end`` of an x-shaped tensor times 1 / (1 - p), float32; None
    without dropout."""
    if not v["threshold"]:
        return None
    cols = v["cols"]
    seed, offset = rng_values(v["rng"])
    keep = keep_mask(begin * cols, (end - begin) * cols, v["threshold"], seed, offset, device)
    return keep.view(end - begin, cols).float().mul_(v["keep_scale"])


def _dropped(v: dict, x: Tensor, begin: int, end: int) -> Tensor:
    """Rows ``begin:end`` of x in float32, masked and scaled as the kernels do."""
    block = x[begin:end].to(torch.float32, copy=True)  # never a view of x: it is scaled in place
    mask = _scaled_mask(v, begin, end, x.device)
    return block if mask is None else block.mul_(mask)


def _first_partial(parts: Tensor) -> Tensor:
    """Zero every partial but the first, and return the first (which then holds the whole sum)."""
    parts[1:].zero_()
    return parts[0]


def _down(v: dict) -> None:
    x, a, rank = v["x"], v["lora_a"], v["rank"]
    h = _first_partial(v["h_part"])
    h[:, rank:].zero_()
    for begin, end in _row_blocks(v["rows"], v["cols"]):
        h[begin:end, :rank] = torch.mm(_dropped(v, x, begin, end), a[:rank].t())


def _up(v: dict) -> None:
    h, bt, bias, rank = v["h"], v["lora_bt"], v["bias"], v["rank"]
    out = v["out"]
    for begin, end in _row_blocks(v["rows"], v["cols"]):
        term = torch.mm(h[begin:end, :rank], bt[:rank]).mul_(v["scaling"])
        if bias is not None:
            term.add_(bias.float())
        out[begin:end].copy_(term)  # one rounding into out's dtype


def _grad_out(v: dict) -> None:
    g, h, bt, rank, s = v["grad"], v["h"], v["lora_bt"], v["rank"], v["scaling"]
    dh = _first_partial(v["dh_part"])
    db = _first_partial(v["db_part"])
    dh[:, rank:].zero_()
    db.zero_()
    for begin, end in _row_blocks(v["rows"], v["cols"]):
        g32 = g[begin:end].float()
        dh[begin:end, :rank] = torch.mm(g32, bt[:rank].t()).mul_(s)
        db.addmm_(g32.t(), h[begin:end], alpha=s)


def _grad_in(v: dict) -> None:
    x, dh, a, rank = v["x"], v["dh"], v["lora_a"], v["rank"]
    gx, da = v["grad_x_lora"], _first_partial(v["da_part"])
    da.zero_()
    for begin, end in _row_blocks(v["rows"], v["cols"]):
        da[:rank].addmm_(dh[begin:end, :rank].t(), _dropped(v, x, begin, end))
        if gx is not None:
            term = torch.mm(dh[begin:end, :rank], a[:rank])
            mask = _scaled_mask(v, begin, end, term.device)
            gx[begin:end].copy_(term if mask is None else term.mul_(mask))


_KERNELS = {"lora_down": _down, "lora_up": _up, "lora_grad_out": _grad_out, "lora_grad_in": _grad_in}


class TorchKernels:
    """Runs the LoRA kernels' computations with torch operations; see the module docstring."""

    def target_blocks(self, device: torch.device) -> int:
        """One block: the torch path needs no split reductions."""
        return 1

    def launch(
        self,
        spec: KernelSpec,
        variant: Variant,
        grid: tuple[int, int],
        args: Sequence[object],
        device: torch.device,
    ) -> None:
        """Compute what kernel ``spec`` computes for ``args`` (``variant`` and ``grid`` do not matter).

        Raises:
            KeyError: ``spec`` is not one of the four LoRA kernels.
        """
        run = _KERNELS.get(spec.name)
        if run is None:
            raise KeyError(f"loragen.cuda.torch_kernels: no torch path for kernel {spec.name!r}")
        with torch.no_grad():
            run({param.name: value for param, value in zip(spec.params, args)})
