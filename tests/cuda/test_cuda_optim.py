"""The 8-bit AdamW kernel (kernels/adamw8bit.cu.j2) against the torch path of loragen.training.adamw8bit.

Without a GPU: every variant compiles with NVRTC for sm_80 and sm_90 without spills, and the rendered
kernel, built with g++ against tests/cuda_emulation.h, reproduces ``adamw8bit_update_`` step by step:
the same codes (except values on a midpoint of the table up to float32 rounding), the same block scales
and parameters up to float32 rounding. With a GPU the CUDA path is compared with the CPU path.
"""

from __future__ import annotations

import pytest
import torch

import loragen.cuda
from loragen.cuda import kernels as kern
from loragen.cuda.optim import adamw8bit_update_cuda, kernel_supports
from loragen.training.adamw8bit import AdamW8bit, adamw8bit_update_, dequantize_blockwise, dynamic_code
from tests.cuda.cuda_emulation import CXX, EmulatedLauncher
from tests.cuda.rendering import rendered

SIGNED, UNSIGNED = dynamic_code(True), dynamic_code(False)


def zero_state(numel: int, block_size: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    n_blocks = -(-numel // block_size)
    state = {}
    for name in ("exp_avg", "exp_avg_sq"):
        state[f"{name}_codes"] = torch.zeros(n_blocks, block_size, dtype=torch.uint8, device=device)
        state[f"{name}_absmax"] = torch.zeros(n_blocks, dtype=torch.float32, device=device)
    return state


def clone_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: value.clone() for key, value in state.items()}


def pre_quantization(param, grad, state, hyper):
    """The torch path's fp32 moments after the update, normalized by their block's new largest magnitude."""
    n_blocks, block_size = state["exp_avg_codes"].shape
    g = torch.nn.functional.pad(grad.reshape(-1).float(), (0, n_blocks * block_size - grad.numel()))
    g = g.view(n_blocks, block_size)
    m = dequantize_blockwise(state["exp_avg_codes"], state["exp_avg_absmax"], SIGNED)
    v = dequantize_blockwise(state["exp_avg_sq_codes"], state["exp_avg_sq_absmax"], UNSIGNED)
    m.lerp_(g, 1.0 - hyper["beta1"])
    v.mul_(hyper["beta2"]).addcmul_(g, g, value=1.0 - hyper["beta2"])
    normalized = []
    for moment in (m, v):
        scale = moment.abs().amax(dim=1)
        normalized.append(moment / torch.where(scale > 0, scale, torch.ones_like(scale))[:, None])
    return normalized


def assert_codes_match(got, want, normalized, table):
    """Equal codes, except neighbours where the value lies on their midpoint up to float32 rounding."""
    differ = got != want
    if not bool(differ.any()):
        return
    low = torch.minimum(got[differ], want[differ]).long()
    high = torch.maximum(got[differ], want[differ]).long()
    assert bool((high - low == 1).all()), "codes differ by more than one entry"
    midpoint = (table[low] + table[high]) / 2
    off = (normalized[differ] - midpoint).abs()
    assert bool((off <= 4e-7 * midpoint.abs() + 1e-12).all()), f"codes differ off a tie: {off.max()}"


HYPER = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}

CASES = [
    # numel, block_size, dtype, hyper-parameter overrides
    pytest.param(1000, 256, torch.float32, {}, id="f32-1000-b256"),
    pytest.param(777, 128, torch.bfloat16, {}, id="bf16-777-b128"),
    pytest.param(301, 64, torch.float16, {"weight_decay": 0.0, "beta1": 0.3}, id="f16-301-b64-lerp-high"),
    pytest.param(2100, 2048, torch.float32, {"lr": 1e-3, "beta2": 0.95}, id="f32-2100-b2048"),
]


@pytest.fixture(scope="module")
def launcher(request) -> EmulatedLauncher:
    return EmulatedLauncher(request.config.cache.mkdir("loragen-emulated-kernels"))


@pytest.mark.skipif(CXX is None, reason="g++ is needed to build the emulated kernels")
@pytest.mark.parametrize(("numel", "block_size", "dtype", "overrides"), CASES)
def test_emulated_kernel_matches_torch_path(launcher, numel, block_size, dtype, overrides):
    generator = torch.Generator().manual_seed(numel)
    hyper = {**HYPER, **overrides}
    param = torch.randn(numel, generator=generator).to(dtype)
    state = zero_state(numel, block_size)
    for step in range(1, 5):
        grad = (torch.randn(numel, generator=generator) * 10.0 ** (step - 3)).to(dtype)
        grad[: block_size // 2] = 0  # zeros inside the first block
        if step == 2:
            grad[:block_size] = 0  # a block whose moments only decay
        want_param, want_state = param.clone(), clone_state(state)
        adamw8bit_update_(
            want_param, grad, want_state, signed_code=SIGNED, unsigned_code=UNSIGNED, step=step, **hyper
        )
        got_param, got_state = param.clone(), clone_state(state)
        version = got_param._version
        assert adamw8bit_update_cuda(
            got_param,
            grad,
            got_state,
            signed_code=SIGNED,
            unsigned_code=UNSIGNED,
            step=step,
            launcher=launcher,
            **hyper,
        )
        assert got_param._version > version  # written in place, as torch's in-place ops report it
        m_normalized, v_normalized = pre_quantization(param, grad, state, hyper)
        assert_codes_match(got_state["exp_avg_codes"], want_state["exp_avg_codes"], m_normalized, SIGNED)
        assert_codes_match(
            got_state["exp_avg_sq_codes"], want_state["exp_avg_sq_codes"], v_normalized, UNSIGNED
        )
        for key in ("exp_avg_absmax", "exp_avg_sq_absmax"):
            torch.testing.assert_close(got_state[key], want_state[key], rtol=1e-6, atol=0, msg=key)
        if dtype == torch.float32:
            torch.testing.assert_close(got_param, want_param, rtol=1e-6, atol=1e-9)
        else:  # both round the same float32 result; a one-ulp float32 difference may flip the rounding
            torch.testing.assert_close(got_param.float(), want_param.float(), rtol=1e-2, atol=0)
            assert (got_param != want_param).float().mean() < 0.01
        param, state = want_param, want_state


def test_kernel_refuses_what_it_cannot_take():
    param, grad = torch.randn(5000), torch.randn(5000)
    state = zero_state(5000, 4096)  # blocks larger than the kernel's 2048
    before = clone_state(state)

    class NoLaunch:
        def launch(self, *args):
            raise AssertionError("must not launch")

    common = {"signed_code": SIGNED, "unsigned_code": UNSIGNED, "step": 1, "launcher": NoLaunch(), **HYPER}
    assert kern.max_optimizer_block(kern.ADAMW8BIT) == 2048
    assert not adamw8bit_update_cuda(param, grad, state, **common)
    assert all(torch.equal(state[k], before[k]) for k in state)
    small = zero_state(5000, 256)
    assert kernel_supports(param, grad, small, SIGNED, UNSIGNED)
    assert not kernel_supports(param, grad.half(), small, SIGNED, UNSIGNED)  # gradient dtype differs
    assert not kernel_supports(param.view(50, 100).t(), grad.view(50, 100).t(), small, SIGNED, UNSIGNED)
    assert not kernel_supports(param, grad, small, SIGNED.double(), UNSIGNED)
    assert not kernel_supports(param, grad, zero_state(4000, 256), SIGNED, UNSIGNED)  # wrong block count


def test_every_variant_renders_with_its_dtype():
    optimizer_variants = list(kern.optimizer_variants())
    assert [v.dtype for _, v in optimizer_variants] == list(kern.DTYPES)
    for spec, variant in optimizer_variants:
        source = rendered(spec, variant).source
        assert "{{" not in source and f"typedef {kern.DTYPES[variant.dtype]} scalar_t;" in source
        assert 'extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS) adamw8bit(' in source


@pytest.mark.parametrize(
    ("name", "variant"),
    [(s.name, v) for s, v in kern.optimizer_variants()],
    ids=lambda x: getattr(x, "dtype", x),
)
def test_variant_compiles_without_spills(persistent_cache, name, variant):
    spec = kern.OPTIMIZER_KERNELS[name]
    kernel = rendered(spec, variant)
    for arch in kern.ARCHS:
        usage = persistent_cache.get(kernel, arch).resources[name]
        where = f"{kernel.description} on {arch}"
        assert not usage.spills, f"{where} spills: {usage}"
        assert usage.stack_frame_bytes == 0, f"{where} uses local memory: {usage}"
        assert usage.shared_bytes < 48 * 1024, where


@pytest.mark.gpu
@pytest.mark.skipif(not loragen.cuda.is_available(), reason="needs a CUDA device and cuda-python")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_path_matches_cpu_path(dtype):
    torch.manual_seed(0)
    cpu = torch.nn.Parameter(torch.randn(3001, 7).to(dtype))
    gpu = torch.nn.Parameter(cpu.detach().cuda())
    options = {"lr": 1e-2, "weight_decay": 0.01, "block_size": 256, "min_8bit_size": 16}
    cpu_opt, gpu_opt = AdamW8bit([cpu], **options), AdamW8bit([gpu], **options)
    for step in range(3):
        grad = torch.randn(cpu.shape).to(dtype) * 10.0 ** (-step)
        cpu.grad, gpu.grad = grad, grad.cuda()
        cpu_opt.step()
        gpu_opt.step()
        cpu_state, gpu_state = cpu_opt.state[cpu], gpu_opt.state[gpu]
        for key in ("exp_avg_codes", "exp_avg_sq_codes"):
            assert (gpu_state[key].cpu() != cpu_state[key]).float().mean() < 1e-3, key
        for key in ("exp_avg_absmax", "exp_avg_sq_absmax"):
            torch.testing.assert_close(gpu_state[key].cpu(), cpu_state[key], rtol=1e-5, atol=0)
        torch.testing.assert_close(gpu.detach().cpu().float(), cpu.detach().float(), rtol=1e-2, atol=1e-6)
