"""The CUDA LoRA op end to end on the CPU: the rendered kernels, built with g++ against
tests/cuda_emulation.h, run thread by thread under loragen.cuda.linear_op's real autograd Function.

This checks the kernels' arithmetic, indexing, warp shuffles, split reductions and Philox masks against a
float64 reference without a GPU; tests/test_cuda_gpu.py repeats the numeric checks on a real device.
Built kernel libraries are kept in pytest's cache folder.
"""

from __future__ import annotations

import pytest
import torch

from loragen import philox
from loragen.cuda import kernels as kern
from loragen.cuda.linear_op import CudaLoraError, draw_rng, lora_linear_cuda
from loragen.cuda.selfcheck import rng_values
from tests.cuda.cuda_emulation import CXX, EmulatedLauncher, cache_folder, variant_of
from tests.cuda.lora_reference import TOLERANCE, make_inputs, mask_for, reference, relative_error

pytestmark = pytest.mark.skipif(CXX is None, reason="g++ is needed to build the emulated kernels")


CASES = [
    # n, k, o, r, dtype, p, bias, fan_in_fan_out
    pytest.param(37, 48, 40, 5, torch.float32, 0.3, True, False, id="f32-r5-dropout"),
    pytest.param(29, 45, 37, 8, torch.float32, 0.25, True, True, id="f32-r8-unaligned-fifo"),
    pytest.param(70, 264, 296, 1, torch.float32, 0.0, True, False, id="f32-r1-split-grids"),
    pytest.param(33, 64, 24, 16, torch.bfloat16, 0.1, True, False, id="bf16-r16-dropout"),
    pytest.param(21, 24, 16, 64, torch.float16, 0.2, False, False, id="f16-r64-nobias"),
    pytest.param(45, 96, 40, 40, torch.bfloat16, 0.2, True, False, id="bf16-r40-mma-split"),
    pytest.param(19, 40, 24, 32, torch.float16, 0.0, True, True, id="f16-r32-mma-fifo"),
    # the split grids of two waves: lora_down's column splits on tensor cores (3 splits of 384, 384 and
    # 264 columns), the row splits of lora_grad_out (4: 3 x 160 + 120 rows) and of lora_grad_in on
    # tensor cores (3: 256, 256, 88, so two of the last split's four warps have no rows) -- row counts
    # that are no multiple of the split
    pytest.param(41, 1032, 24, 16, torch.bfloat16, 0.1, True, False, id="bf16-r16-mma-down-column-splits"),
    pytest.param(600, 48, 40, 16, torch.bfloat16, 0.2, False, False, id="bf16-r16-backward-row-splits"),
    pytest.param(600, 48, 40, 16, torch.float16, 0.2, True, False, id="f16-r16-backward-row-splits"),
    pytest.param(1, 64, 48, 16, torch.bfloat16, 0.1, True, False, id="bf16-r16-one-row"),
    pytest.param(67, 136, 72, 1, torch.float16, 0.2, True, True, id="f16-r1-odd-rows-fifo"),
    pytest.param(53, 45, 41, 12, torch.bfloat16, 0.3, True, False, id="bf16-r12-unaligned"),
    pytest.param(37, 72, 40, 64, torch.float32, 0.1, True, False, id="f32-r64-rank-tiles"),
    # lora_grad_in on tensor cores (bf16, aligned, R >= 16): a padded rank (9 of 16), R = 32 with a partial
    # last 32-column block (88 = 2 x 32 + 24), rows that are no multiple of 16, R = 64 with p = 0
    pytest.param(35, 40, 16, 9, torch.bfloat16, 0.3, True, False, id="bf16-r9-mma-grad-in-padded-rank"),
    pytest.param(77, 88, 40, 27, torch.bfloat16, 0.15, False, True, id="bf16-r27-mma-grad-in-fifo"),
    pytest.param(18, 56, 24, 64, torch.bfloat16, 0.0, True, False, id="bf16-r64-mma-grad-in"),
]


@pytest.fixture(scope="session")
def launcher(request) -> EmulatedLauncher:
    """The in-process kernels; a cold cache builds every variant CASES use up front, one g++ per core."""
    launcher = EmulatedLauncher(cache_folder(request.config, "loragen-emulated-kernels"), target_blocks=4)
    launcher.prebuild(
        (spec, variant_of(*case.values[1:5])) for case in CASES for spec in kern.KERNELS.values()
    )
    return launcher


@pytest.mark.parametrize(("n", "k", "o", "r", "dtype", "p", "bias", "fifo"), CASES)
def test_matches_float64_reference(launcher, n, k, o, r, dtype, p, bias, fifo):
    (x, w, b, a, bb), (xr, wr, br, ar, bbr) = make_inputs(n, k, o, r, dtype, bias=bias, fan_in_fan_out=fifo)
    state = torch.get_rng_state()
    y = lora_linear_cuda(x, w, b, a, bb, 0.7, p, True, fan_in_fan_out=fifo, launcher=launcher)
    want = reference(xr, wr, br, ar, bbr, 0.7, mask_for(state, (n, k), p), fifo)
    assert y.dtype == dtype and y.shape == (n, o)
    assert relative_error(y, want) < TOLERANCE[dtype]

    grad = torch.randn(n, o, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grad = grad.to(dtype).double()  # the gradient as the op receives it
    y.backward(grad.to(dtype))
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


@pytest.mark.parametrize("kernels", ["emulated", "torch path"])
def test_one_row_rank_one_bfloat16_gradient(launcher, kernels):
    """tests/cuda/test_cuda_gpu.py's case 1x8x8, r=1, bfloat16, p=0 with its exact inputs. dA = dh x with
    dh = s g . B, one dot product of 8 terms that cancel (sum of |terms| 84 times |sum|): rounding g to
    bfloat16 moves dh by 7.5%. The op gets the rounded g, so the float64 reference must get it too;
    against the unrounded g, peft's bfloat16 composition is 7.9% off as well."""
    import zlib

    from loragen.cuda.selfcheck import TorchKernels

    dtype, shape, r, p = torch.bfloat16, (1, 8, 8), 1, 0.0
    seed = zlib.crc32(repr((dtype, r, shape, p)).encode())
    (x, w, b, a, bb), (xr, wr, br, ar, bbr) = make_inputs(*shape, r, dtype, bias=True, seed=seed)
    run_on = launcher if kernels == "emulated" else TorchKernels()
    y = lora_linear_cuda(x, w, b, a, bb, 0.5, p, True, launcher=run_on)
    want = reference(xr, wr, br, ar, bbr, 0.5, None, False)
    exact = torch.randn(
        *shape[:1], shape[2], dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 1)
    )
    rounded = exact.to(dtype)
    y.backward(rounded)
    want.backward(rounded.double())
    for got, expected in ((x, xr), (w, wr), (b, br), (a, ar), (bb, bbr)):
        assert relative_error(got.grad, expected.grad) < TOLERANCE[dtype]
    # the cancellation is real: with the unrounded gradient the exact dA differs by more than the bound
    unrounded = (exact @ bbr.detach()) * 0.5 * xr.detach()
    assert relative_error(ar.grad, unrounded) > 5 * TOLERANCE[dtype]


def test_partial_sums_are_exercised(launcher):
    """The split-grids case must really split its reductions (target_blocks is small on purpose)."""
    variant = kern.Variant("float32", 8, True)
    assert kern.plan_down(70, 264, variant, 4).splits == 2
    assert kern.plan_grad_out(70, 296, variant, 4).splits == 2
    assert kern.plan_grad_in(70, 264, variant, 4).splits > 1
    bf16 = kern.Variant("bfloat16", 16, True)
    down = kern.plan_down(41, 1032, bf16, 4)
    assert (down.splits, down.cols_per_split) == (3, 384)  # the last split: 264 columns
    grad_out = kern.plan_grad_out(600, 40, bf16, 4)
    assert (grad_out.splits, grad_out.rows_per_split) == (4, 160)
    grad_in = kern.plan_grad_in(600, 48, bf16, 4)
    assert (grad_in.splits, grad_in.rows_per_split, grad_in.col_blocks) == (3, 256, 2)
    # the CUDA-core pass's rank tiles: float16 at R = 16, 4 tiles of 4 (3 splits of 208, 208, 184 rows)
    f16 = kern.Variant("float16", 16, True)
    grad_in = kern.plan_grad_in(600, 48, f16, 4)
    assert (grad_in.splits, grad_in.rows_per_split, kern.rank_tiles(kern.LORA_GRAD_IN, f16)) == (3, 208, 4)


def test_mask_is_the_cpu_philox_mask(launcher):
    """With A = B = identity and no base weight, y = x * keep / (1 - p): the kernel's mask, exactly."""
    n, k, p = 13, 8, 0.4
    x = torch.rand(n, k) + 0.5  # no zeros
    eye = torch.eye(k)
    torch.manual_seed(11)
    y = lora_linear_cuda(x, torch.zeros(k, k), None, eye, eye, 1.0, p, True, launcher=launcher)
    torch.manual_seed(11)
    expected = philox.dropout_keep_mask((n, k), p, *rng_values(draw_rng(torch.device("cpu"))))
    assert torch.equal(y != 0, expected)
    torch.testing.assert_close(y[expected], x[expected] / (1 - p))


def test_grads_accumulate_across_micro_batches(launcher):
    (x, w, b, a, bb), (xr, wr, br, ar, bbr) = make_inputs(24, 16, 8, 4, torch.float32)
    w.requires_grad_(False)
    wr.requires_grad_(False)
    for micro in range(2):
        part = slice(12 * micro, 12 * micro + 12)
        state = torch.get_rng_state()
        lora_linear_cuda(x[part], w, b, a, bb, 2.0, 0.2, True, launcher=launcher).square().sum().backward()
        keep = mask_for(state, (12, 16), 0.2)
        reference(xr[part], wr, br, ar, bbr, 2.0, keep, False).square().sum().backward()
    for got, want in ((a, ar), (bb, bbr), (b, br), (x, xr)):
        assert relative_error(got.grad, want.grad) < 1e-5
    assert w.grad is None


def test_same_seed_same_bits_and_checkpoint_recomputes_the_mask(launcher):
    from torch.utils.checkpoint import checkpoint

    def run(use_checkpoint: bool):
        (x, w, b, a, bb), _ = make_inputs(20, 16, 8, 4, torch.float32, seed=3)
        torch.manual_seed(123)
        if use_checkpoint:
            y = checkpoint(
                lora_linear_cuda, x, w, b, a, bb, 1.5, 0.5, True, use_reentrant=False, launcher=launcher
            )
        else:
            y = lora_linear_cuda(x, w, b, a, bb, 1.5, 0.5, True, launcher=launcher)
        y.sum().backward()
        return y.detach(), a.grad, x.grad

    first, second, checkpointed = run(False), run(False), run(True)
    for got, want in zip(second, first):
        assert torch.equal(got, want)  # deterministic: no atomics anywhere
    for got, want in zip(checkpointed, first):
        assert torch.equal(got, want)


def test_explicit_seed_fixes_the_mask(launcher):
    (x, w, b, a, bb), (xr, wr, br, ar, bbr) = make_inputs(16, 24, 8, 4, torch.float32, seed=4)
    y = lora_linear_cuda(x, w, b, a, bb, 1.0, 0.5, True, seed=2**64 - 5, launcher=launcher)
    keep = philox.dropout_keep_mask((16, 24), 0.5, 2**64 - 5).double() * 2
    assert relative_error(y, reference(xr, wr, br, ar, bbr, 1.0, keep, False)) < 1e-5
    with pytest.raises(CudaLoraError, match=r"seed=-1; expected an unsigned 64-bit integer"):
        lora_linear_cuda(x, w, b, a, bb, 1.0, 0.5, True, seed=-1, launcher=launcher)


def test_eval_mode_has_no_dropout_and_empty_batches_work(launcher):
    (x, w, b, a, bb), (xr, wr, br, ar, bbr) = make_inputs(9, 16, 8, 4, torch.float32)
    y = lora_linear_cuda(x, w, b, a, bb, 1.0, 0.5, False, launcher=launcher)
    assert relative_error(y, reference(xr, wr, br, ar, bbr, 1.0, None, False)) < 1e-5

    empty = x[:0].detach().requires_grad_()
    out = lora_linear_cuda(empty, w, b, a, bb, 1.0, 0.5, True, launcher=launcher)
    assert out.shape == (0, 8)
    out.sum().backward()
    assert torch.count_nonzero(a.grad) == 0 and empty.grad.shape == (0, 16)


def test_batched_input_shape_is_kept(launcher):
    (x, w, b, a, bb), _ = make_inputs(12, 16, 8, 4, torch.float32)
    y = lora_linear_cuda(x.view(3, 4, 16), w, b, a, bb, 1.0, 0.0, True, launcher=launcher)
    assert y.shape == (3, 4, 8)
    y.sum().backward()
    assert x.grad.shape == (12, 16)


def test_unsupported_rank_falls_back_to_the_composition(launcher):
    (x, w, b, a, bb), (xr, wr, br, ar, bbr) = make_inputs(5, 8, 8, 65, torch.float32)
    before = len(launcher.launches)
    y = lora_linear_cuda(x, w, b, a, bb, 1.0, 0.0, True, launcher=launcher)
    assert len(launcher.launches) == before
    assert relative_error(y, reference(xr, wr, br, ar, bbr, 1.0, None, False)) < 1e-5


def test_bad_inputs_name_the_argument(launcher):
    (x, w, b, a, bb), _ = make_inputs(5, 8, 6, 2, torch.float32)
    with pytest.raises(CudaLoraError, match=r"lora_linear_cuda: all tensors must be on one CUDA device"):
        lora_linear_cuda(x, w, b, a, bb, 1.0, 0.0, True)
    with pytest.raises(CudaLoraError, match=r"dropout_p=1\.0; expected 0 <= p < 1"):
        lora_linear_cuda(x, w, b, a, bb, 1.0, 1.0, True, launcher=launcher)
    with pytest.raises(CudaLoraError, match=r"lora_B \(6, 3\); expected \(6, 2\) for r=2"):
        lora_linear_cuda(x, w, b, a, torch.zeros(6, 3), 1.0, 0.0, True, launcher=launcher)
    with pytest.raises(
        CudaLoraError, match=r"weight \(6, 8\) is not \(in, out\) with fan_in_fan_out for x \(\.\.\., 8\)"
    ):
        lora_linear_cuda(x, w, b, a, bb, 1.0, 0.0, True, fan_in_fan_out=True, launcher=launcher)
    with pytest.raises(CudaLoraError, match=r"bias \(5,\); expected \(6,\)"):
        lora_linear_cuda(x, w, torch.zeros(5), a, bb, 1.0, 0.0, True, launcher=launcher)


@pytest.mark.parametrize(
    ("rows", "cols", "bucket", "p"),
    [
        pytest.param(67, 264, 16, 0.2, id="r16-odd-rows-partial-block"),
        pytest.param(1, 8, 16, 0.0, id="r16-one-row-eight-columns"),
        pytest.param(300, 40, 16, 0.1, id="r16-row-splits"),
        pytest.param(45, 88, 32, 0.3, id="r32"),
        pytest.param(19, 72, 64, 0.05, id="r64"),
        pytest.param(0, 48, 16, 0.2, id="empty"),
    ],
)
def test_grad_in_on_tensor_cores_keeps_float32_accuracy(launcher, rows, cols, bucket, p):
    """lora_grad_in's tensor-core pass against float64: dA to float32 accuracy (x is exact in bf16 and
    dh is split into two bf16 terms, so 1e-5 fails if the second term is lost: one bf16 rounding of dh
    is ~2e-3), grad_x to bf16 rounding (A is rounded to bf16 once), and both zero where dropped."""
    from loragen import philox

    gen = torch.Generator().manual_seed(rows * 1000 + cols + bucket)
    x = torch.randn(rows, cols, generator=gen).to(torch.bfloat16)
    # dh over six decades, so a split that loses the small term shows in dA
    dh = torch.randn(rows, bucket, generator=gen) * 10 ** (6 * torch.rand(rows, bucket, generator=gen) - 3)
    a = torch.randn(bucket, cols, generator=gen) / cols**0.5
    plan = kern.Plan(x, 8, bucket, launcher)
    assert kern.grad_in_uses_mma(plan.variant)
    seed, offset = 1234567, 89
    rng = torch.tensor([seed, offset], dtype=torch.int64)
    gx, da = kern.grad_in(plan, x, dh, a, (rng, philox.keep_threshold(p), philox.keep_scale(p)), True)

    keep = philox.dropout_keep_mask((rows, cols), p, seed, offset).double() / (1 - p)
    xd = x.double() * keep
    want_da = dh.double().t() @ xd
    assert da.shape == (bucket, cols) and gx is not None and gx.dtype == torch.bfloat16
    if rows == 0:
        assert torch.count_nonzero(da) == 0 and gx.shape == (0, cols)
        return
    assert relative_error(da, want_da) < 1e-5
    a_rounded = a.to(torch.bfloat16).double()  # the one rounding the pass makes on purpose
    want_gx = (dh.double() @ a_rounded) * keep
    assert relative_error(gx, want_gx) < 4e-3
    assert torch.equal(gx == 0, want_gx == 0)


@pytest.mark.parametrize(
    ("rows", "cols", "bucket"),
    [
        pytest.param(37, 264, 16, id="r16-odd-rows-partial-chunk"),
        pytest.param(1, 8, 16, id="r16-one-row"),
        pytest.param(130, 40, 32, id="r32"),
        pytest.param(21, 72, 64, id="r64"),
    ],
)
def test_up_on_tensor_cores_rounds_once(launcher, rows, cols, bucket):
    """lora_up's tensor-core pass with a zero base product: out = bf16(s h B^T) with B^T rounded to bf16
    once and h split into two bf16 terms, so out is the float64 result rounded once -- but where it lies
    within float32 noise of a rounding boundary. One bf16 rounding of h instead makes about a quarter of
    the elements differ (this bound fails)."""

    gen = torch.Generator().manual_seed(rows + cols + bucket)
    h = torch.randn(rows, bucket, generator=gen) * 10 ** (2 * torch.rand(rows, bucket, generator=gen) - 1)
    bt = torch.randn(bucket, cols, generator=gen)
    plan = kern.Plan(torch.zeros(rows, 8, dtype=torch.bfloat16), cols, bucket, launcher)
    assert kern.up_uses_mma(plan.variant)
    out = torch.zeros(rows, cols, dtype=torch.bfloat16)
    kern.up(plan, h, bt, None, 0.75, out)
    want = 0.75 * h.double() @ bt.to(torch.bfloat16).double()
    differ = out.double() != want.to(torch.bfloat16).double()
    assert differ.float().mean().item() < 0.02
    # and those that differ are at most one bf16 step (2^-7 relative) away, but for float32 noise in
    # sums that cancel (relative to the sum of the terms' magnitudes)
    terms = 0.75 * h.double().abs() @ bt.to(torch.bfloat16).double().abs()
    assert bool(((out.double() - want).abs() <= 2**-7 * want.abs() + 1e-5 * terms).all())


def test_empty_batch_on_tensor_cores(launcher):
    """bf16, aligned, r = 16: every kernel on its tensor-core pass with no rows -- zero gradients for the
    adapter, an empty input gradient, and nothing read out of bounds (the emulation traps it)."""
    (x, w, b, a, bb), _ = make_inputs(8, 64, 24, 16, torch.bfloat16)
    empty = x[:0].detach().requires_grad_()
    out = lora_linear_cuda(empty, w, b, a, bb, 1.0, 0.1, True, launcher=launcher)
    assert out.shape == (0, 24)
    out.sum().backward()
    assert empty.grad.shape == (0, 64)
    assert torch.count_nonzero(a.grad) == 0 and torch.count_nonzero(bb.grad) == 0
