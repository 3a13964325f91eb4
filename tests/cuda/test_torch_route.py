"""The CUDA op's torch route on CPU tensors: a variant on it (``LORAGEN_CUDA_KERNELS=torch``, a failed
self-check, a :class:`~loragen.cuda.selfcheck.TorchKernels` launcher) runs the reference composition with
the kernels' Philox mask; the four passes on :class:`TorchKernels` (what the self-check compares the
kernels with, and what the custom op runs on this route) give the same results. Every path is judged
against float64."""

from __future__ import annotations

import collections
import inspect

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from loragen import philox
from loragen.cuda import selfcheck
from loragen.cuda.kernels import LORA_DOWN, LORA_GRAD_IN, LORA_GRAD_OUT, LORA_UP
from loragen.cuda.linear_op import lora_linear_cuda
from loragen.cuda.selfcheck import TorchKernels
from loragen.reference import lora_linear_reference
from tests.cuda.lora_reference import make_inputs, mask_for, reference, relative_error


class _Dispatches(TorchDispatchMode):
    """Counts every aten operation dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _training_step_dispatches(p: float) -> collections.Counter[str]:
    x = torch.randn(4, 16, 64, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(48, 64, dtype=torch.bfloat16)
    a = torch.randn(8, 64, requires_grad=True)
    b = torch.randn(48, 8, requires_grad=True)
    with _Dispatches() as mode:
        y = lora_linear_cuda(x, w, None, a, b, 2.0, p, True, launcher=TorchKernels())
        y.float().sum().backward()
    return mode.counts


def test_a_training_step_dispatches_few_operations():
    """One forward + backward on the torch route (the composition with torch's autograd): 50 operations
    without dropout; the Philox mask adds 185 (about 16 per round on one counter per 8 elements, its
    constants made on the device from aranges: no host-to-device copy), made once in forward and kept by
    autograd for backward."""
    without = _training_step_dispatches(0.0)
    with_dropout = _training_step_dispatches(0.1)
    assert sum(without.values()) <= 52
    assert sum(with_dropout.values()) - sum(without.values()) <= 190


def test_torch_route_step_matches_the_float64_reference_with_dropout():
    (x, w, b, a, bb), (xr, wr, br, ar, bbr) = make_inputs(70, 72, 40, 8, torch.bfloat16, seed=12)
    state = torch.get_rng_state()
    y = lora_linear_cuda(x, w, b, a, bb, 0.5, 0.2, True, launcher=TorchKernels())
    want = reference(xr, wr, br, ar, bbr, 0.5, mask_for(state, (70, 72), 0.2), False)
    assert relative_error(y, want) < 1.5e-2
    grad = torch.randn(70, 40, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    y.backward(grad)
    want.backward(grad.double())
    for got, expected in ((x, xr), (a, ar), (bb, bbr)):
        assert relative_error(got.grad, expected.grad) < 1.5e-2


def test_checkpoint_recomputes_the_torch_routes_mask():
    from torch.utils.checkpoint import checkpoint

    def run(use_checkpoint: bool) -> tuple[torch.Tensor, ...]:
        (x, w, b, a, bb), _ = make_inputs(33, 40, 24, 4, torch.float32, seed=8)
        torch.manual_seed(7)
        args = (x, w, b, a, bb, 1.0, 0.4, True)
        if use_checkpoint:
            y = checkpoint(lora_linear_cuda, *args, use_reentrant=False, launcher=TorchKernels())
        else:
            y = lora_linear_cuda(*args, launcher=TorchKernels())
        y.square().sum().backward()
        return y.detach(), a.grad, x.grad

    for got, want in zip(run(True), run(False)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("fan_in_fan_out", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_torch_route_and_the_passes_match_the_float64_reference(p, dtype, fan_in_fan_out):
    """The torch route (the composition) and the four passes on :class:`TorchKernels` (``whole_op=False``)
    against the float64 reference with the kernels' Philox mask: output and every gradient, the base
    trainable too, for a 3-D x with a bias."""
    (_, high) = make_inputs(42, 40, 24, 5, dtype, seed=13, fan_in_fan_out=fan_in_fan_out)
    grad = torch.randn(6, 7, 24, generator=torch.Generator().manual_seed(2)).to(dtype)
    keep = None if p == 0 else philox.dropout_keep_mask((42, 40), p, 321).double() / (1 - p)
    xr, wr, br, ar, bbr = high
    want = reference(xr, wr, br, ar, bbr, 0.75, keep, fan_in_fan_out)
    want.backward(grad.view(42, 24).double())
    bound = 1e-5 if dtype == torch.float32 else 1.5e-2
    for launcher in (TorchKernels(), TorchKernels(whole_op=False)):
        (x, w, b, a, bb), _ = make_inputs(42, 40, 24, 5, dtype, seed=13, fan_in_fan_out=fan_in_fan_out)
        x3 = x.detach().view(6, 7, 40).requires_grad_()
        y = lora_linear_cuda(
            x3, w, b, a, bb, 0.75, p, True, fan_in_fan_out=fan_in_fan_out, seed=321, launcher=launcher
        )
        y.backward(grad)
        got = (y, x3.grad, w.grad, b.grad, a.grad, bb.grad)
        for g, expected in zip(got, (want, xr.grad, wr.grad, br.grad, ar.grad, bbr.grad)):
            assert relative_error(g.reshape(expected.shape), expected) < bound


def test_torch_route_backward_can_be_differentiated_through_the_mask():
    """The torch route's mask is its own adjoint: a gradient of a gradient (here d/dA of ||grad_x||^2)
    goes through the same keep-mask, equal to the plain composition with that mask."""
    p, seed = 0.4, 77
    (x, w, b, a, bb), _ = make_inputs(16, 24, 12, 4, torch.float32, seed=3)
    grad = torch.randn(16, 12, generator=torch.Generator().manual_seed(4))
    keep = philox.dropout_keep_mask((16, 24), p, seed)

    def second_order(op, **kwargs):
        y = op(x, w, b, a, bb, 1.5, p, True, **kwargs)
        (gx,) = torch.autograd.grad(y, x, grad, create_graph=True)
        (ga,) = torch.autograd.grad(gx.square().sum(), a)
        return gx.detach(), ga

    got = second_order(lora_linear_cuda, seed=seed, launcher=TorchKernels())
    want = second_order(lora_linear_reference, keep=keep)
    for g, expected in zip(got, want):
        torch.testing.assert_close(g, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("spec", [LORA_DOWN, LORA_UP, LORA_GRAD_OUT, LORA_GRAD_IN], ids=lambda s: s.name)
def test_each_torch_kernel_takes_its_kernels_arguments_in_order(spec):
    """TorchKernels reads a launch's arguments by position: its functions name them as the kernel does."""
    assert list(inspect.signature(selfcheck.KERNELS[spec.name]).parameters) == [p.name for p in spec.params]


@pytest.mark.parametrize("cols", [24, 21])
def test_row_blocks_give_the_whole_tensor_results(monkeypatch, cols):
    """Past BLOCK_ELEMENTS the passes on TorchKernels work in row blocks (8-row multiples, so every block
    starts on a Philox group): the same masks, and results equal up to float32 summation order."""

    def step() -> list[torch.Tensor]:
        (x, w, b, a, bb), _ = make_inputs(37, cols, 16, 4, torch.float32, seed=4)
        y = lora_linear_cuda(x, w, b, a, bb, 0.5, 0.4, True, seed=99, launcher=TorchKernels(whole_op=False))
        y.square().sum().backward()
        return [y.detach(), x.grad, a.grad, bb.grad]

    whole = step()
    monkeypatch.setattr(selfcheck, "BLOCK_ELEMENTS", 8 * cols)  # blocks of 8 rows: 5 blocks
    assert len(selfcheck._row_blocks(37, cols)) == 5
    blocked = step()
    for got, want in zip(blocked, whole):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(blocked[1] == 0, whole[1] == 0)  # grad_x: the same dropped elements
