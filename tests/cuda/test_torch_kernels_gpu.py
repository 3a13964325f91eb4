"""The torch path's dropout kernels (torch.cuda.jiterator, loragen.cuda.torch_dropout) on a GPU:
bit-identical to the torch formulation CI tests on the CPU, to loragen.philox, and to the CUDA kernels'
own mask (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

import loragen.cuda
from loragen import philox, switches
from loragen.cuda import torch_dropout
from loragen.cuda.linear_op import lora_linear_cuda
from loragen.cuda.torch_dropout import dropped, keep_mask, rng_tensor
from loragen.cuda.torch_kernels import TorchKernels
from tests.cuda.lora_reference import make_inputs, relative_error

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    ("rows", "cols", "start"),
    [(1, 8, 0), (37, 45, 3), (300, 4104, 40 * 4104), (5, 7, 2**36 + 5), (6, 16, 2**36)],
)
def test_jiterator_mask_is_the_torch_formulation(dtype, rows, cols, start):
    seed, offset, p = 2**64 - 17, 2**33 + 1, 0.3
    threshold, scale = philox.keep_threshold(p), philox.keep_scale(p)
    x = torch.randn(rows, cols, device="cuda").to(dtype)
    got = dropped(x, rng_tensor(seed, offset, x.device), start, threshold, scale)
    assert torch_dropout.jiterator_status() == "ok"
    keep = keep_mask(start, rows * cols, threshold, seed, offset, torch.device("cpu")).view(rows, cols)
    assert torch.equal(keep_mask(start, rows * cols, threshold, seed, offset, x.device).cpu(), keep.view(-1))
    want = torch.where(keep, x.cpu().float() * scale, 0.0)
    assert got.dtype == torch.float32 and torch.equal(got.cpu(), want)


@pytest.mark.parametrize("cols", [40, 45])
def test_one_block_masks_x_and_the_product_alike(cols):
    """Backward masks x and dh A of one row block: the keep bits are made once and serve both."""
    seed, p = 12345, 0.5
    threshold, scale = philox.keep_threshold(p), philox.keep_scale(p)
    drop = torch_dropout.BlockDropout(rng_tensor(seed, 0, torch.device("cuda")), 64 * cols, threshold, scale)
    keep = keep_mask(64 * cols, 64 * cols, threshold, seed, 0, torch.device("cpu")).view(64, cols)
    for dtype in (torch.bfloat16, torch.float32):
        values = torch.randn(64, cols, device="cuda").to(dtype)
        want = torch.where(keep, values.cpu().float() * scale, 0.0)
        assert torch.equal(drop(values).cpu(), want)
    assert torch_dropout.jiterator_status() == "ok"


@pytest.mark.parametrize("shape", [(13, 8), (1000, 64), (4097, 40)])
def test_torch_path_draws_the_kernels_mask(shape):
    """LORAGEN_CUDA_KERNELS=torch (and a variant that falls back) keeps the kernels' exact mask."""
    if not loragen.cuda.is_available():
        pytest.skip("needs cuda-python for the kernels")
    n, k = shape
    x = (torch.rand(n, k) + 0.5).cuda()
    eye = torch.eye(k, device="cuda")
    masks = []
    for mode in ("trust", "torch"):
        with switches.cuda_kernels.using(mode):
            torch.manual_seed(21)
            y = lora_linear_cuda(x, torch.zeros(k, k, device="cuda"), None, eye, eye, 1.0, 0.3, True)
        masks.append((y != 0).cpu())
    torch.manual_seed(21)
    expected = philox.dropout_keep_mask((n, k), 0.3, philox.random_seed())
    assert torch.equal(masks[0], expected) and torch.equal(masks[1], expected)


def test_torch_path_on_the_gpu_equals_the_torch_path_on_the_cpu():
    """The same step on both devices: the same mask, results equal up to float32 summation order."""
    results = []
    for device in ("cpu", "cuda"):
        (x, w, b, a, bb), _ = make_inputs(64, 96, 40, 8, torch.float32, seed=2, device=device)
        y = lora_linear_cuda(x, w, b, a, bb, 0.5, 0.25, True, seed=77, launcher=TorchKernels())
        y.square().sum().backward()
        results.append([t.detach().cpu() for t in (y, x.grad, a.grad, bb.grad)])
    for cpu, gpu in zip(*results):
        assert relative_error(gpu, cpu.double()) < 1e-5  # a different mask would be off by far more
