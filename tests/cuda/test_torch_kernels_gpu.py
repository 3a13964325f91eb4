"""The torch path's dropout kernels (torch.cuda.jiterator, loragen.cuda.torch_dropout) on a GPU:
bit-identical to the torch formulation CI tests on the CPU, to loragen.philox, and to the CUDA kernels'
own mask; no host <-> device wait in a step (torch's sync debug mode), and dropout inside a CUDA graph
(skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

import loragen.cuda
from loragen import philox, switches
from loragen.cuda import torch_dropout
from loragen.cuda.linear_op import lora_linear_cuda
from loragen.cuda.op_inputs import draw_rng
from loragen.cuda.torch_dropout import dropped, keep_mask, rng_tensor
from loragen.cuda.torch_kernels import TorchKernels, rng_values
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
    seed, offset = rng_values(draw_rng(torch.device("cuda")))  # the op's draw from the CUDA generator
    expected = philox.dropout_keep_mask((n, k), 0.3, seed, offset)
    assert torch.equal(masks[0], expected), "the kernels' mask"
    assert torch.equal(masks[1], expected), "the torch path's mask"


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


@pytest.mark.parametrize("seed", [None, 2**64 - 5])
@pytest.mark.parametrize("jiterator", [True, False], ids=["jiterator", "torch-formulation"])
def test_torch_path_step_never_waits_for_the_device(monkeypatch, jiterator, seed):
    """The torch path reads seed and offset on the device: a forward + backward with dropout queues all
    its work without a single host <-> device wait (a wait per mask made batch-1 steps crawl)."""
    if not jiterator:
        monkeypatch.setattr(torch_dropout, "JIT_DEVICE_TYPES", frozenset())
    (x, w, b, a, bb), _ = make_inputs(96, 72, 40, 8, torch.bfloat16, seed=3, device="cuda")
    grad = torch.randn(96, 40, device="cuda", dtype=torch.bfloat16)
    launcher = TorchKernels()
    for _ in range(2):  # warm-up: jiterator compiles, cuBLAS handles, the op's caches
        lora_linear_cuda(x, w, b, a, bb, 0.5, 0.2, True, seed=seed, launcher=launcher).backward(grad)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        lora_linear_cuda(x, w, b, a, bb, 0.5, 0.2, True, seed=seed, launcher=launcher).backward(grad)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    if jiterator:
        assert torch_dropout.jiterator_status() == "ok"


def _identity_dropout_step(n: int, k: int, p: float):
    """x (n, k) through the torch path's op with A = B = identity and no base weight (y = x * keep / (1 - p)),
    drawing its (seed, offset) on the device; warmed up twice on a side stream (the jiterator kernels
    compile there). Returns (step, side stream); step() returns (rng, y)."""
    from loragen.cuda.hostcache import launcher_handle
    from loragen.cuda.op_inputs import draw_rng

    static_x = (torch.rand(n, k) + 0.5).cuda()
    eye, zeros = torch.eye(k, device="cuda"), torch.zeros(k, k, device="cuda")
    handle = launcher_handle(TorchKernels())

    def step():
        rng = draw_rng(static_x.device)
        y, _ = torch.ops.loragen.lora_linear(static_x, zeros, None, eye, eye, rng, 1.0, p, False, handle)
        return rng, y

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(2):
            step()
    return step, side


def _replayed_masks(graph, static_rng, static_y, p, replays=2):
    """Replay ``graph`` ``replays`` times; after each, the keep-mask seen in ``static_y`` (nonzero
    entries) and the Philox mask of the (seed, offset) the replay drew, which must be equal. Yields
    (mask, expected) after the check, with the graph's outputs of that replay still in place."""
    for _ in range(replays):
        graph.replay()
        seed, offset = (value & (2**64 - 1) for value in static_rng.tolist())
        expected = philox.dropout_keep_mask(tuple(static_y.shape), p, seed, offset)
        mask = (static_y != 0).cpu()
        assert torch.equal(mask, expected)
        yield mask, expected


def test_torch_path_captured_with_dropout_draws_the_replays_mask():
    """The torch path inside a CUDA graph: each replay draws a fresh (seed, offset) on the device and
    applies exactly its Philox mask (A = B = identity, no base weight: y = x * keep / (1 - p))."""
    n, k, p = 300, 64, 0.3
    step, side = _identity_dropout_step(n, k, p)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        static_rng, static_y = step()
    masks = [mask for mask, _ in _replayed_masks(graph, static_rng, static_y, p)]
    assert not torch.equal(masks[0], masks[1])
    assert torch_dropout.jiterator_status() == "ok"


def test_torch_path_composition_captured_with_dropout_trains_on_the_replays_mask(monkeypatch):
    """The eager torch path (one composition, ``TorchKernels()``) with dropout inside a CUDA graph, forward
    and backward: each replay draws a fresh (seed, offset) on the device, the output holds exactly that
    Philox mask (A = B = identity, no base weight: y = x * keep / (1 - p)), and grad_x is the same mask
    applied to the output gradient (the mask autograd kept from forward)."""
    from loragen.cuda import linear_op
    from loragen.cuda.op_inputs import draw_rng

    n, k, p = 300, 64, 0.3
    static_x = (torch.rand(n, k, device="cuda") + 0.5).requires_grad_()
    eye, zeros = torch.eye(k, device="cuda"), torch.zeros(k, k, device="cuda")
    grad = torch.ones(n, k, device="cuda")
    launcher = TorchKernels()
    rngs = []

    def step():
        static_x.grad = None
        y = lora_linear_cuda(static_x, zeros, None, eye, eye, 1.0, p, True, launcher=launcher)
        y.backward(grad)
        return y.detach()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up: jiterator compiles, the group counter, the route
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()

    def recording_draw(device):  # the (seed, offset) tensor the captured forward draws into
        rngs.append(draw_rng(device))
        return rngs[-1]

    monkeypatch.setattr(linear_op, "draw_rng", recording_draw)
    with torch.cuda.graph(graph):
        static_y = step()
    (static_rng,) = rngs
    masks = []
    for mask, expected in _replayed_masks(graph, static_rng, static_y, p):
        masks.append(mask)
        assert torch.equal((static_x.grad != 0).cpu(), expected)
        torch.testing.assert_close(static_x.grad.cpu(), expected.float() / (1 - p))
    assert not torch.equal(masks[0], masks[1])
    assert torch_dropout.jiterator_status() == "ok"


@pytest.mark.parametrize(("rows", "cols"), [(64, 40), (37, 45)])
def test_pair_kernel_masks_x_and_the_product_as_two_applies(rows, cols):
    """Backward's one kernel for x and dh A (apply_pair, or the per-element keep flags for a block whose
    size is not a multiple of 8): the same numbers as the torch formulation on the CPU."""
    seed, p = 2**64 - 99, 0.35
    threshold, scale = philox.keep_threshold(p), philox.keep_scale(p)
    start = 8 * 1001
    keep = keep_mask(start, rows * cols, threshold, seed, 0, torch.device("cpu")).view(rows, cols)
    x = torch.randn(rows, cols, device="cuda").to(torch.bfloat16)
    product = torch.randn(rows, cols, device="cuda")
    drop = torch_dropout.BlockDropout(rng_tensor(seed, 0, x.device), start, threshold, scale)
    first, second = drop.pair(x, product)
    assert torch_dropout.jiterator_status() == "ok"
    assert torch.equal(first.cpu(), torch.where(keep, x.cpu().float() * scale, 0.0))
    assert torch.equal(second.cpu(), torch.where(keep, product.cpu() * scale, 0.0))


def test_group_numbers_are_kept_per_stream():
    device = torch.device("cuda")
    groups, lanes = torch_dropout.group_numbers(device, 1000)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        other, other_lanes = torch_dropout.group_numbers(device, 1000)
    torch.cuda.synchronize()
    assert other.data_ptr() != groups.data_ptr() and other_lanes.data_ptr() != lanes.data_ptr()
    assert torch.equal(groups.view(-1).cpu(), torch.arange(1000)) and torch.equal(other.cpu(), groups.cpu())
    assert torch_dropout.group_numbers(device, 1000)[0] is groups


def test_graph_captured_on_a_warmed_stream_survives_the_counter_growing():
    """A capture on the stream the warm-up ran on reads that stream's cached counter; when a later eager
    call outgrows it, the old counter is kept, so replays still draw the exact mask."""
    n, k, p = 96, 64, 0.3
    step, side = _identity_dropout_step(n, k, p)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side), torch.no_grad():
        static_rng, static_y = step()
    with torch.cuda.stream(side), torch.no_grad():  # outgrows the counter the graph reads
        big = torch.rand(8 * torch_dropout._MIN_GROUPS * 4, 16, device="cuda")
        lora_linear_cuda(
            big,
            torch.zeros(16, 16, device="cuda"),
            None,
            torch.eye(16, device="cuda"),
            torch.eye(16, device="cuda"),
            1.0,
            p,
            True,
            launcher=TorchKernels(),
        )
        torch.empty(8 * torch_dropout._MIN_GROUPS * 8, dtype=torch.int64, device="cuda").fill_(-1)
    torch.cuda.synchronize()
    for _ in range(2):
        graph.replay()
        seed, offset = (value & (2**64 - 1) for value in static_rng.tolist())
        assert torch.equal((static_y != 0).cpu(), philox.dropout_keep_mask((n, k), p, seed, offset))
