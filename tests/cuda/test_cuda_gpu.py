"""loragen's CUDA kernels on a real GPU (skipped without CUDA and cuda-python).

Fresh random inputs every check, outputs compared with a float64 CPU reference by relative error with
per-dtype bounds; the CUDA caching allocator is filled with NaN before each run, so an output element no
kernel wrote shows up as NaN. Odd sizes (rows, in and out not multiples of any tile), ranks 1, 8, 16, 64.

The numeric tests run with ``LORAGEN_CUDA_KERNELS=trust`` semantics (the kernels themselves, no
fallback), so a wrong kernel fails here instead of being replaced by the torch path; the self-check is
tested on its own (every variant must pass it on this GPU). ``LORAGEN_GPU_REPORT=folder`` writes the
self-check outcomes there as JSON (scripts/first_gpu_run.sh sets it).
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import pytest
import torch

import loragen.cuda
from loragen import philox, switches
from loragen.cuda.linear_op import draw_rng
from loragen.cuda.selfcheck import rng_values
from tests.cuda.lora_reference import TOLERANCE, make_inputs, mask_for, reference, relative_error

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not loragen.cuda.is_available(), reason="needs a CUDA device and cuda-python"),
]


@pytest.fixture(autouse=True)
def kernels_unchecked():
    """The kernels themselves, never the torch path (tests that want the check switch it back on)."""
    with switches.cuda_kernels.using("trust"):
        yield


@pytest.fixture(autouse=True)
def poisoned_allocator():
    """Leave NaN in the caching allocator's free blocks, where the op's outputs will be carved from."""
    torch.cuda.synchronize()
    poison = torch.full((256 << 20,), float("nan"), device="cuda")  # 1 GiB of float32 NaN
    del poison
    yield
    torch.cuda.synchronize()


def run(x, w, b, a, bb, scaling, p, training=True, fan_in_fan_out=False):
    from loragen.cuda import lora_linear_cuda

    return lora_linear_cuda(x, w, b, a, bb, scaling, p, training, fan_in_fan_out=fan_in_fan_out)


SHAPES = [(1, 8, 8), (37, 200, 72), (515, 1000, 1032), (129, 4104, 520), (300, 45, 37)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("r", [1, 8, 16, 64])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("p", [0.0, 0.1])
def test_matches_float64_reference(dtype, r, shape, p):
    n, k, o = shape
    seed = zlib.crc32(repr((dtype, r, shape, p)).encode())
    fifo = (n + r) % 3 == 0
    (x, w, b, a, bb), (xr, wr, br, ar, bbr) = make_inputs(
        n, k, o, r, dtype, bias=n % 2 == 1, fan_in_fan_out=fifo, seed=seed, device="cuda"
    )
    state = torch.cuda.get_rng_state()
    y = run(x, w, b, a, bb, 0.5, p, fan_in_fan_out=fifo)
    want = reference(xr, wr, br, ar, bbr, 0.5, mask_for(state, (n, k), p, "cuda"), fifo)
    assert y.dtype == dtype and y.shape == (n, o)
    assert relative_error(y, want) < TOLERANCE[dtype]

    # the gradient as the op receives it, rounded to dtype: with one row and rank 1, dA is x times one dot
    # product g . B, whose cancellation turns bf16's rounding of g into a 7% scale error against the
    # unrounded g (peft's bf16 composition is as far off)
    grad = torch.randn(n, o, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 1))
    grad = grad.to(dtype).double()
    y.backward(grad.to(device="cuda", dtype=dtype))
    want.backward(grad)
    for name, got, expected in (
        ("x", x, xr),
        ("weight", w, wr),
        ("bias", b, br),
        ("A", a, ar),
        ("B", bb, bbr),
    ):
        if got is not None:
            assert relative_error(got.grad, expected.grad) < TOLERANCE[dtype], name


@pytest.mark.parametrize("shape", [(13, 8), (1000, 64), (4097, 40)])
def test_mask_is_bit_identical_to_the_cpu(shape):
    n, k = shape
    p = 0.3
    x = (torch.rand(n, k) + 0.5).cuda()
    eye = torch.eye(k, device="cuda")
    torch.manual_seed(21)
    y = run(x, torch.zeros(k, k, device="cuda"), None, eye, eye, 1.0, p)
    torch.manual_seed(21)
    seed, offset = rng_values(draw_rng(torch.device("cuda")))  # the op's draw from the CUDA generator
    expected = philox.dropout_keep_mask((n, k), p, seed, offset)
    assert torch.equal((y != 0).cpu(), expected)


def test_lora_params_in_float32_with_a_bf16_base():
    """peft's default for 16-bit models: base in bf16, adapter in float32."""
    (x, w, b, _, _), (xr, wr, br, _, _) = make_inputs(
        300, 512, 264, 16, torch.bfloat16, seed=5, device="cuda"
    )
    (_, _, _, a, bb), (_, _, _, ar, bbr) = make_inputs(
        300, 512, 264, 16, torch.float32, seed=6, device="cuda"
    )
    y = run(x, w, b, a, bb, 2.0, 0.0)
    want = reference(xr, wr, br, ar, bbr, 2.0, None, False)
    assert y.dtype == torch.bfloat16 and relative_error(y, want) < TOLERANCE[torch.bfloat16]
    y.float().square().sum().backward()
    want.square().sum().backward()
    assert a.grad.dtype == torch.float32 and relative_error(a.grad, ar.grad) < 2e-2


def test_grads_accumulate_across_micro_batches():
    (x, w, b, a, bb), (xr, wr, br, ar, bbr) = make_inputs(
        256, 264, 136, 8, torch.float32, seed=7, device="cuda"
    )
    for micro in range(4):
        part = slice(64 * micro, 64 * micro + 64)
        state = torch.cuda.get_rng_state()
        run(x[part], w, b, a, bb, 1.0, 0.2).square().sum().backward()
        reference(
            xr[part], wr, br, ar, bbr, 1.0, mask_for(state, (64, 264), 0.2, "cuda"), False
        ).square().sum().backward()
    for got, want in ((a, ar), (bb, bbr), (x, xr), (w, wr)):
        assert relative_error(got.grad, want.grad) < 1e-5


def test_runs_are_bitwise_deterministic():
    def once():
        (x, w, b, a, bb), _ = make_inputs(777, 1024, 512, 16, torch.bfloat16, seed=9, device="cuda")
        torch.manual_seed(0)
        y = run(x, w, b, a, bb, 1.0, 0.1)
        y.float().sum().backward()
        return y, a.grad, bb.grad, x.grad

    for first, second in zip(once(), once()):
        assert torch.equal(first, second)


def test_ops_dispatches_cuda_tensors_here():
    from loragen import ops

    (x, w, b, a, bb), _ = make_inputs(64, 128, 64, 8, torch.float16, seed=3, device="cuda")
    with torch.no_grad():
        assert torch.equal(ops.lora_linear(x, w, b, a, bb, 1.0, 0.0, False), run(x, w, b, a, bb, 1.0, 0.0))


def test_autocast_computes_in_the_autocast_dtype():
    (x, w, b, a, bb), (xr, wr, br, ar, bbr) = make_inputs(
        64, 256, 128, 8, torch.float32, seed=4, device="cuda"
    )
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = run(x, w, b, a, bb, 1.0, 0.0)
    assert y.dtype == torch.bfloat16
    assert relative_error(y, reference(xr, wr, br, ar, bbr, 1.0, None, False)) < TOLERANCE[torch.bfloat16]


def test_cuda_graph_capture_and_replay():
    (x, w, b, a, bb), _ = make_inputs(128, 256, 64, 16, torch.bfloat16, seed=8, device="cuda")
    static_x = x.detach().clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(2):  # warm-up: renders, compiles and loads the kernels outside the capture
            run(static_x, w, b, a, bb, 1.0, 0.0, training=False)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        static_y = run(static_x, w, b, a, bb, 1.0, 0.0, training=False)
    fresh = torch.randn_like(static_x)
    static_x.copy_(fresh)
    graph.replay()
    with torch.no_grad():
        assert torch.equal(static_y, run(fresh, w, b, a, bb, 1.0, 0.0, training=False))


def _capture(step):
    """Warm ``step`` up on a side stream (kernels loaded, allocator primed), then capture it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    return graph, outputs


def test_dropout_under_graph_capture_draws_a_fresh_mask_per_replay():
    """With A = B = identity and no base weight, y = x * keep / (1 - p): each replay's mask is visible."""
    n, k, p = 512, 64, 0.3
    static_x = (torch.rand(n, k) + 0.5).cuda()
    eye = torch.eye(k, device="cuda")
    zeros = torch.zeros(k, k, device="cuda")
    with torch.no_grad():
        graph, static_y = _capture(lambda: run(static_x, zeros, None, eye, eye, 1.0, p))
    masks = []
    for _ in range(2):
        graph.replay()
        masks.append((static_y != 0).cpu())
    assert not torch.equal(masks[0], masks[1])
    for keep in masks:
        assert abs(keep.float().mean().item() - (1 - p)) < 0.02


def test_captured_training_step_with_dropout_equals_the_eager_step():
    """A captured forward + backward with dropout: each replay equals the eager op run with the (seed,
    offset) that replay drew on the device, bit for bit; two replays draw different ones."""
    from loragen.cuda.linear_op import launcher_handle

    (x, w, b, a, bb), _ = make_inputs(256, 264, 136, 16, torch.bfloat16, seed=14, device="cuda")
    static_x, w, b = x.detach().clone(), w.detach(), b.detach()
    a = a.detach().float().requires_grad_()  # float32 adapters on a bf16 base, as peft makes them
    bb = bb.detach().float().requires_grad_()
    grad = torch.randn(256, 136, device="cuda", dtype=torch.bfloat16)
    default = launcher_handle(None)

    def step():
        rng = draw_rng(static_x.device)
        y, _ = torch.ops.loragen.lora_linear(static_x, w, b, a, bb, rng, 0.5, 0.3, False, default)
        y.backward(grad)
        return rng, y

    graph, (static_rng, static_y) = _capture(step)
    replays = []
    for _ in range(2):
        a.grad.zero_()
        bb.grad.zero_()
        graph.replay()
        torch.cuda.synchronize()
        replays.append([t.clone() for t in (static_rng, static_y, a.grad, bb.grad)])
    assert not torch.equal(replays[0][0], replays[1][0])
    assert not torch.equal(replays[0][1], replays[1][1])
    for rng, y, grad_a, grad_b in replays:
        a.grad = bb.grad = None
        eager, _ = torch.ops.loragen.lora_linear(static_x, w, b, a, bb, rng, 0.5, 0.3, False, default)
        eager.backward(grad)
        assert torch.equal(eager, y)
        assert torch.equal(a.grad, grad_a) and torch.equal(bb.grad, grad_b)


def test_graph_replay_reads_parameters_updated_between_replays():
    """The padded factors are refreshed inside the graph: an in-place update of A and B between replays
    (an optimizer step) shows in the next replay's output."""
    (x, w, b, a, bb), _ = make_inputs(64, 128, 64, 8, torch.float32, seed=15, device="cuda")
    static_x, w, b, a, bb = (t.detach() for t in (x, w, b, a, bb))
    with torch.no_grad():
        graph, static_y = _capture(lambda: run(static_x, w, b, a, bb, 1.0, 0.0, training=False))
        a.mul_(3)
        bb.add_(1)
        graph.replay()
        want = run(static_x, w, b, a, bb, 1.0, 0.0, training=False)
    assert torch.equal(static_y, want)


def test_an_eager_call_after_replays_reads_the_factors_the_replays_left():
    """A captured step that updates A and B in place (as a captured optimizer step does) moves no version
    counter when it replays; an eager call after the replays computes with the updated factors. The
    factors are first read inside the capture (their padded buffers made there, where the zero fill runs
    only on replay), so the eager call between capture and replay checks the zeros too."""
    (x, w, b, a, bb), _ = make_inputs(64, 128, 72, 5, torch.float32, seed=16, device="cuda")  # r 5: padded
    static_x, w, b, a, bb = (t.detach() for t in (x, w, b, a, bb))

    def composed() -> torch.Tensor:
        return static_x @ w.t() + b + (static_x @ a.t()) @ bb.t()

    with torch.no_grad():
        run(static_x, w, b, a.clone(), bb.clone(), 1.0, 0.0, training=False)  # kernels loaded, not these A, B
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # on a stream of its own
            run(static_x, w, b, a, bb, 1.0, 0.0, training=False)
            a.mul_(0.5)  # the captured optimizer step
            bb.add_(0.25)
        close = {"rtol": 1e-4, "atol": 1e-4}  # stale factors would be off by a quarter of LoRA's term or more
        torch.testing.assert_close(run(static_x, w, b, a, bb, 1.0, 0.0, training=False), composed(), **close)
        for _ in range(2):
            graph.replay()
        torch.testing.assert_close(run(static_x, w, b, a, bb, 1.0, 0.0, training=False), composed(), **close)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph_trains_a_lora_model(backend):
    """torch.compile(fullgraph=True) traces LoRA layers through the CUDA op (custom ops with fake
    implementations): no graph break, and the compiled step equals the eager one."""
    from loragen.layers import LoraLinear

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        LoraLinear(96, 64, r=8, lora_alpha=16, lora_dropout=0.0), torch.nn.GELU(), LoraLinear(64, 40, r=4)
    ).cuda()
    for layer in (model[0], model[2]):
        torch.nn.init.normal_(layer.lora_B)
    x = torch.randn(4, 33, 96, device="cuda")
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    results = []
    for step in (compiled, model):
        model.zero_grad(set_to_none=True)
        y = step(x)
        y.square().sum().backward()
        results.append([y.detach(), *(p.grad.clone() for p in model.parameters() if p.requires_grad)])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_lora_linear_layer_trains_on_the_gpu():
    from loragen.layers import LoraLinear

    torch.manual_seed(0)
    layer = LoraLinear(96, 40, r=8, lora_alpha=16, lora_dropout=0.0).cuda()
    torch.nn.init.normal_(layer.lora_B)
    x = torch.randn(33, 96, device="cuda")
    y = layer(x)
    expected = x @ layer.weight.t() + layer.bias + layer.scaling * (x @ layer.lora_A.t()) @ layer.lora_B.t()
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    y.sum().backward()
    assert layer.lora_A.grad is not None and torch.isfinite(layer.lora_A.grad).all()


# ---- self-check, fallback, context safety, and the forward's details on the real device --------------


def test_every_variant_passes_its_self_check():
    from loragen.cuda.launch import DriverLauncher
    from loragen.cuda.selfcheck import CheckedLauncher

    checker = CheckedLauncher(DriverLauncher())
    with switches.cuda_kernels.using("check"):
        outcomes = checker.check_all(torch.device("cuda", torch.cuda.current_device()))
    report = os.environ.get("LORAGEN_GPU_REPORT")
    if report:
        Path(report).mkdir(parents=True, exist_ok=True)
        (Path(report) / "selfcheck.json").write_text(json.dumps(outcomes, indent=2))
    failed = {variant: reason for variant, reason in outcomes.items() if reason != "ok"}
    assert not failed, failed


def test_torch_path_matches_the_kernels():
    from loragen.cuda.selfcheck import TorchKernels

    (x, w, b, a, bb), _ = make_inputs(257, 520, 136, 12, torch.bfloat16, seed=12, device="cuda")
    torch.manual_seed(5)
    y = run(x, w, b, a, bb, 0.5, 0.1)
    y.float().sum().backward()
    kernel_grads = [t.grad.clone() for t in (x, a, bb)]
    for t in (x, a, bb):
        t.grad = None
    torch.manual_seed(5)
    from loragen.cuda import lora_linear_cuda

    y_torch = lora_linear_cuda(x, w, b, a, bb, 0.5, 0.1, True, launcher=TorchKernels())
    y_torch.float().sum().backward()
    assert relative_error(y, y_torch.double().cpu()) < TOLERANCE[torch.bfloat16]
    for got, want in zip(kernel_grads, (x.grad, a.grad, bb.grad)):
        assert relative_error(got, want.double().cpu()) < TOLERANCE[torch.bfloat16]


def test_forward_rounds_once():
    x = torch.ones(4, 8, dtype=torch.bfloat16, device="cuda")
    w = torch.full((8, 8), 32.0, dtype=torch.bfloat16, device="cuda")
    b = torch.ones(8, dtype=torch.bfloat16, device="cuda")
    a = torch.zeros(1, 8, device="cuda")
    a[0, 0] = 2.0**-9
    bb = torch.ones(8, 1, device="cuda")
    y = run(x, w, b, a, bb, 1.0, 0.0, training=False)
    assert torch.equal(y.cpu(), torch.full((4, 8), 258.0, dtype=torch.bfloat16))  # 256 with two roundings


def test_output_may_be_modified_in_place():
    (x, w, b, a, bb), (xr, wr, br, ar, bbr) = make_inputs(
        48, 64, 40, 8, torch.float32, seed=13, device="cuda"
    )
    y = run(x.view(6, 8, 64), w, b, a, bb, 1.0, 0.0)
    y.mul_(2.0)
    y.sum().backward()
    (2.0 * reference(xr, wr, br, ar, bbr, 1.0, None, False)).sum().backward()
    assert relative_error(a.grad, ar.grad) < 1e-5 and relative_error(x.grad, xr.grad) < 1e-5


def test_ops_passes_the_seed_to_the_kernels():
    from loragen import ops

    (x, w, b, a, bb), _ = make_inputs(64, 128, 64, 8, torch.float32, seed=3, device="cuda")
    with torch.no_grad():
        first = ops.lora_linear(x, w, b, a, bb, 1.0, 0.5, True, seed=77)
        second = ops.lora_linear(x, w, b, a, bb, 1.0, 0.5, True, seed=77)
        other = ops.lora_linear(x, w, b, a, bb, 1.0, 0.5, True, seed=78)
        direct = run_seeded(x, w, b, a, bb, 77)
    assert torch.equal(first, second) and torch.equal(first, direct) and not torch.equal(first, other)


def run_seeded(x, w, b, a, bb, seed):
    from loragen.cuda import lora_linear_cuda

    return lora_linear_cuda(x, w, b, a, bb, 1.0, 0.5, True, seed=seed)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_launch_on_another_device_leaves_the_current_device():
    from cuda.bindings import driver

    (x, w, b, a, bb), _ = make_inputs(33, 64, 40, 8, torch.float32, seed=4, device="cuda:1")
    torch.cuda.set_device(0)
    before = driver.cuCtxGetCurrent()[1]
    with torch.no_grad():
        run(x, w, b, a, bb, 1.0, 0.0)
    assert torch.cuda.current_device() == 0
    assert int(driver.cuCtxGetCurrent()[1]) == int(before)


def test_default_checker_checks_in_a_child_process_first():
    from loragen.cuda.kernels import Variant
    from loragen.cuda.selfcheck import CheckedLauncher

    checker = CheckedLauncher()  # the driver launcher: isolated check on CUDA devices
    with switches.cuda_kernels.using("check"):
        checker.route(Variant("bfloat16", 16, True), torch.device("cuda", torch.cuda.current_device()))
    assert set(checker.outcomes().values()) == {"ok"}, checker.outcomes()


@pytest.mark.parametrize(("start", "numel"), [(0, 4096), (13, 1000)])
def test_the_python_philox_on_the_gpu_draws_the_cpu_mask(start, numel):
    """loragen.philox's one definition, run with torch operations on the GPU from a device rng tensor (as
    the torch route runs it), gives the CPU's mask bit for bit."""
    seed, offset, p = 2**64 - 5, 2**40 + 3, 0.3
    rng = philox.rng_tensor(seed, offset, "cuda")
    got = philox.rng_keep_mask(rng, start, numel, philox.keep_threshold(p)).cpu()
    assert torch.equal(got, philox.dropout_keep_mask((start + numel,), p, seed, offset)[start:])


def test_torch_route_captured_with_dropout_draws_a_fresh_mask_per_replay():
    from loragen.cuda import lora_linear_cuda
    from loragen.cuda.selfcheck import TorchKernels

    (x, w, b, a, bb), _ = make_inputs(64, 128, 72, 8, torch.float32, seed=3, device="cuda")
    x, w, b, a, bb = (t.detach() for t in (x, w, b, a, bb))
    launcher = TorchKernels()
    lora_linear_cuda(x, w, b, a, bb, 1.0, 0.5, True, launcher=launcher)  # routed outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = lora_linear_cuda(x, w, b, a, bb, 1.0, 0.5, True, launcher=launcher)
    graph.replay()
    first = y.clone()
    graph.replay()
    assert torch.isfinite(y).all() and not torch.equal(first, y)
