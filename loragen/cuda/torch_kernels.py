"""The torch path: what each LoRA kernel computes, with torch products (cuBLAS on a GPU) instead.

:class:`TorchKernels` is a :class:`~loragen.cuda.launch.KernelLauncher`: it takes a kernel's launch
exactly as :mod:`loragen.cuda.passes` makes it -- the same argument list, read by parameter name -- and
writes the same outputs, so the autograd Function and its hand-written backward run unchanged on it. It
is what a kernel variant runs on when it fails its self-check (:mod:`loragen.cuda.selfcheck`), what
``LORAGEN_CUDA_KERNELS=torch`` selects, and the reference the self-check compares the kernels with.

Products are taken in float32 (x, g cast up per row block), every output is rounded once into its dtype,
and the dropout mask is the Philox mask of :mod:`loragen.philox`, generated on the tensors' device: a
variant that falls back keeps the exact masks the kernels would have drawn, and so does
``torch.utils.checkpoint`` recomputation. Split reductions write the whole sum into partial 0 and zeros
into the other partials, whose sum is all the caller reads.

Dropout on a CUDA device costs a kernel or two per masked tensor (:mod:`loragen.cuda.torch_dropout`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from loragen.cuda.kernel_variants import Variant
from loragen.cuda.specs import KernelSpec
from loragen.cuda.torch_dropout import BlockDropout, keep_mask

__all__ = ["TorchKernels", "keep_mask", "rng_values"]

# elements per row block: a float32 block is 128 MiB, and a batch of 16k rows of 2048 features is one
# block (each block costs a dozen launches; the Philox temporaries of the torch formulation stay < 1 GiB)
_BLOCK_ELEMS = 1 << 25
_MASK64 = (1 << 64) - 1


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


def _block_dropout(v: dict, begin: int) -> BlockDropout:
    """The dropout of the row block of an x-shaped tensor that starts at row ``begin``."""
    seed, offset = rng_values(v["rng"]) if v["threshold"] else (0, 0)
    return BlockDropout(begin * v["cols"], v["threshold"], v["keep_scale"], seed, offset)


def _first_partial(parts: Tensor) -> Tensor:
    """Zero every partial but the first, and return the first (which then holds the whole sum)."""
    parts[1:].zero_()
    return parts[0]


def _down(v: dict) -> None:
    x, a, rank = v["x"], v["lora_a"], v["rank"]
    h = _first_partial(v["h_part"])
    h[:, rank:].zero_()
    for begin, end in _row_blocks(v["rows"], v["cols"]):
        h[begin:end, :rank] = torch.mm(_block_dropout(v, begin)(x[begin:end]), a[:rank].t())


def _up(v: dict) -> None:
    h, bt, bias, rank = v["h"], v["lora_bt"], v["bias"], v["rank"]
    out = v["out"]
    scaled_bt = bt[:rank] * v["scaling"]  # (r, out): s folded into the small operand
    bias32 = None if bias is None else bias.float()
    for begin, end in _row_blocks(v["rows"], v["cols"]):
        block = out[begin:end]  # the base product, as cuBLAS wrote it
        if block.dtype == torch.float32:  # the op's float32 variant: in place, no temporary
            if bias32 is not None:
                block.add_(bias32)
            block.addmm_(h[begin:end, :rank], scaled_bt)
        else:
            term = block.float()
            if bias32 is not None:
                term.add_(bias32)
            block.copy_(term.addmm_(h[begin:end, :rank], scaled_bt))  # onto the base product, one rounding


def _grad_out(v: dict) -> None:
    g, h, bt, rank, s = v["grad"], v["h"], v["lora_bt"], v["rank"], v["scaling"]
    dh = _first_partial(v["dh_part"])
    db = _first_partial(v["db_part"])
    dh[:, rank:].zero_()
    db.zero_()
    scaled_b = (bt[:rank] * s).t()  # (out, r): s folded into the small operand
    for begin, end in _row_blocks(v["rows"], v["cols"]):
        g32 = g[begin:end].float()
        dh[begin:end, :rank] = torch.mm(g32, scaled_b)
        db.addmm_(g32.t(), h[begin:end], alpha=s)


def _grad_in(v: dict) -> None:
    x, dh, a, rank = v["x"], v["dh"], v["lora_a"], v["rank"]
    gx, da = v["grad_x_lora"], _first_partial(v["da_part"])
    da.zero_()
    for begin, end in _row_blocks(v["rows"], v["cols"]):
        drop = _block_dropout(v, begin)  # one keep-mask for both products
        da[:rank].addmm_(dh[begin:end, :rank].t(), drop(x[begin:end]))
        if gx is not None:
            gx[begin:end].copy_(drop(torch.mm(dh[begin:end, :rank], a[:rank])))  # one rounding into gx


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
