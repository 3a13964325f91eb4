"""The self-check and the torch route (loragen.cuda.selfcheck) without a GPU.

A variant on the torch route (``LORAGEN_CUDA_KERNELS=torch``, a failed self-check, a ``TorchKernels``
launcher) runs the reference composition with the kernels' Philox mask; the four passes on
``TorchKernels`` (what the self-check compares the kernels with, and what the custom op runs on that
route) give the same results; both are judged against float64.

Failures are staged with the fake driver of test_cuda_launch (compile, load and launch errors, NVRTC
missing, an architecture NVRTC does not know, bfloat16 before sm_80, kernels that compute nothing) and
with the emulated kernels (a planted wrong result): each gives exactly one warning naming the variant
and the reason, and the op's outputs and gradients still match the float64 reference, from the torch
path. The torch path itself is checked against the float64 reference, masks included; the forward's
single rounding and its fresh (in-place safe) output are checked bit for bit with the emulated kernels.
"""

from __future__ import annotations

import collections
import inspect
import os
import re
import subprocess
import sys
import warnings
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from loragen import philox, switches
from loragen.cuda import kernels as kern
from loragen.cuda import launch, selfcheck
from loragen.cuda.build import CompiledKernel, KernelCache, KernelCompileError
from loragen.cuda.linear_op import lora_linear_cuda
from loragen.cuda.selfcheck import TorchKernels
from loragen.reference import lora_linear_reference
from tests.cuda.cuda_emulation import CXX, EmulatedLauncher
from tests.cuda.fake_driver import FakeDriver
from tests.cuda.lora_reference import TOLERANCE, make_inputs, mask_for, reference, relative_error

KNOWN_ARCHS = ("sm_80", "sm_86", "sm_90")


def run_twice(launcher, **kwargs):
    run_and_compare(launcher, **kwargs)
    run_and_compare(launcher, **kwargs)


def run_and_compare(launcher, dtype=torch.float32, n=29, k=45, o=37, r=5, p=0.25, fifo=False):
    """lora_linear_cuda forward + backward through ``launcher``, checked against the float64 reference."""
    (x, w, b, a, bb), (xr, wr, br, ar, bbr) = make_inputs(n, k, o, r, dtype, fan_in_fan_out=fifo, seed=n)
    state = torch.get_rng_state()
    y = lora_linear_cuda(x, w, b, a, bb, 0.5, p, True, fan_in_fan_out=fifo, launcher=launcher)
    want = reference(xr, wr, br, ar, bbr, 0.5, mask_for(state, (n, k), p), fifo)
    assert y.dtype == dtype and relative_error(y, want) < TOLERANCE[dtype]
    grad = torch.randn(n, o, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    y.backward(grad.to(dtype))
    want.backward(grad)
    for got, expected in ((x, xr), (w, wr), (b, br), (a, ar), (bb, bbr)):
        assert relative_error(got.grad, expected.grad) < TOLERANCE[dtype]


def fallback_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "runs on the torch path" in str(w.message)]


class Counting:
    """Wraps a launcher; counts launches per device and can fail the n-th launch."""

    def __init__(self, inner, fail_at: int | None = None) -> None:
        self.inner = inner
        self.launches: list[tuple[str, str, str]] = []
        self.fail_at = fail_at

    def target_blocks(self, device):
        return self.inner.target_blocks(device)

    def launch(self, spec, variant, grid, args, device):
        self.launches.append((spec.name, variant.label, str(device)))
        if self.fail_at is not None and len(self.launches) >= self.fail_at:
            raise launch.CudaDriverError(
                "loragen.cuda: cuLaunchKernel failed: CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES"
            )
        self.inner.launch(spec, variant, grid, args, device)


# ---- the torch path ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "n", "k", "o", "r", "p", "fifo"),
    [
        (torch.float32, 37, 48, 40, 5, 0.3, False),
        (torch.float32, 29, 45, 37, 8, 0.25, True),
        (torch.bfloat16, 33, 64, 24, 16, 0.1, False),
        (torch.float16, 21, 24, 16, 64, 0.0, False),
    ],
)
def test_torch_path_matches_the_float64_reference(dtype, n, k, o, r, p, fifo):
    run_and_compare(TorchKernels(), dtype, n, k, o, r, p, fifo)


@settings(max_examples=15, deadline=None)
@given(
    n=st.integers(0, 40),
    k=st.integers(1, 70),
    o=st.integers(1, 70),
    r=st.integers(1, 64),
    p=st.sampled_from([0.0, 0.1, 0.5]),
    fifo=st.booleans(),
)
def test_torch_path_property(n, k, o, r, p, fifo):
    """Any shape, rank and dropout: the torch path is the float64 composition (with the Philox mask)."""
    if n == 0:
        (x, w, b, a, bb), _ = make_inputs(1, k, o, r, torch.float32, fan_in_fan_out=fifo)
        y = lora_linear_cuda(x[:0], w, b, a, bb, 0.5, p, True, fan_in_fan_out=fifo, launcher=TorchKernels())
        assert y.shape == (0, o)
        return
    run_and_compare(TorchKernels(), torch.float32, n, k, o, r, p, fifo)


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


@pytest.mark.parametrize(
    "spec", [kern.LORA_DOWN, kern.LORA_UP, kern.LORA_GRAD_OUT, kern.LORA_GRAD_IN], ids=lambda s: s.name
)
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


def test_environment_sets_the_switch():

    code = "from loragen import switches; print(switches.cuda_kernels.get())"
    env = {**os.environ, "LORAGEN_CUDA_KERNELS": "torch"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    assert done.stdout.strip() == "torch"
    env["LORAGEN_CUDA_KERNELS"] = "off"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    assert (
        done.returncode != 0
        and "LORAGEN_CUDA_KERNELS='off': expected one of 'check', 'trust', 'torch'" in done.stderr
    )


# ---- failures staged with the fake driver -------------------------------------------------------------


@pytest.fixture
def fake(monkeypatch, tmp_path):
    """A DriverLauncher on the fake driver; its 'device' is whichever the CPU tensors are on."""
    driver = FakeDriver(kern.LORA_UP)
    driver.capability = (9, 0)
    driver.compile_error = None
    monkeypatch.setattr(launch.DriverLauncher, "_driver", staticmethod(lambda: driver))
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: driver.capability)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda index: SimpleNamespace(multi_processor_count=4)
    )
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SimpleNamespace(cuda_stream=1))
    monkeypatch.setattr(driver, "cuLaunchKernel", lambda *args: (700 if driver.fail_launch else 0,))

    def compiler(kernel, arch):
        if arch not in KNOWN_ARCHS:  # what NVRTC says for an architecture it does not know
            log = f"nvrtc: error: invalid value for --gpu-architecture (-arch): {arch}"
            raise KernelCompileError(kernel, arch, ("--std=c++17",), log, "NVRTC_ERROR_INVALID_OPTION")
        if driver.compile_error:
            raise KernelCompileError(
                kernel, arch, ("--std=c++17",), driver.compile_error, "NVRTC_ERROR_COMPILATION"
            )
        return CompiledKernel(kernel.name, arch, f"cubin {kernel.name} {arch}".encode(), "")

    cache = KernelCache(tmp_path, compiler=compiler, nvrtc=(13, 5))
    checker = selfcheck.CheckedLauncher(launch.DriverLauncher(cache))
    return SimpleNamespace(driver=driver, cache=cache, checker=checker)


def stage(fake, monkeypatch, failure):
    if failure == "compile":
        fake.driver.compile_error = "kernel.cu(12): error: identifier 'load_vec' is undefined"
    elif failure == "load":
        fake.driver.fail_load = True
    elif failure == "launch":
        fake.driver.fail_launch = True
    elif failure == "no libnvrtc":
        fake.cache._nvrtc = None  # the version is asked of NVRTC first, as on a real first compile
        monkeypatch.setitem(sys.modules, "cuda.bindings", None)  # as if cuda-python could not load it
        monkeypatch.setitem(sys.modules, "cuda.bindings.nvrtc", None)
    elif failure == "unknown arch":
        fake.driver.capability = (12, 7)
    elif failure == "bf16 before sm_80":
        fake.driver.capability = (7, 5)
    # "computes nothing": the fake kernels launch fine and write nothing


FAILURES = {
    "compile": r"compile: NVRTC could not compile kernel lora_down .*identifier 'load_vec' is undefined",
    "load": r"load: loragen.cuda: cuModuleLoadData failed \(kernel lora_down",
    "launch": r"launch: loragen.cuda: cuLaunchKernel failed \(kernel lora_down .* grid=",
    "no libnvrtc": r"NVRTC unavailable: loragen.cuda needs cuda-python's NVRTC bindings",
    "unknown arch": r"compile: NVRTC could not compile kernel lora_down \(kernels/lora_down.cu.j2\) for sm_127.*invalid value for --gpu-architecture",
    "bf16 before sm_80": r"unsupported: bfloat16 kernels need sm_80 or newer, cpu is sm_75",
    "computes nothing": r"numeric: lora_down h differs from the torch path by \S+ of its largest value",
}


@pytest.mark.parametrize("failure", list(FAILURES))
def test_failure_gives_one_warning_and_the_torch_path(fake, monkeypatch, failure):
    stage(fake, monkeypatch, failure)
    dtype = torch.bfloat16 if failure == "bf16 before sm_80" else torch.float32
    label = f"{'bfloat16' if dtype == torch.bfloat16 else 'float32'}-r8-unaligned"
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        run_and_compare(fake.checker, dtype)
        launches = len(fake.driver.calls)
        run_and_compare(fake.checker, dtype)  # decided once: nothing is tried again
    assert len(fake.driver.calls) == launches
    (message,) = fallback_warnings(record)
    assert f"kernel variant {label} on cpu runs on the torch path" in message
    (reason,) = fake.checker.outcomes().values()
    assert reason in message
    assert re.search(FAILURES[failure], reason, flags=re.DOTALL), reason
    if failure == "bf16 before sm_80":
        assert fake.cache.compiles == 0 and not fake.driver.calls  # nothing compiled or launched


class PaddingNaN(TorchKernels):
    """The torch path's passes, but one pass leaves NaN in its output's columns past the rank (unwritten
    memory would hold anything), where the next pass reads them against zero rows."""

    def __init__(self, kernel: str, output: str) -> None:
        super().__init__()
        self.kernel, self.output = kernel, output

    def launch(self, spec, variant, grid, args, device):
        super().launch(spec, variant, grid, args, device)
        if spec.name == self.kernel:
            names = [p.name for p in spec.params]
            args[names.index(self.output)][..., -1] = float("nan")  # the bucket's last column


@pytest.mark.parametrize(("kernel", "output"), [("lora_down", "h_part"), ("lora_grad_out", "dh_part")])
def test_a_pass_that_leaves_nan_past_the_rank_fails_the_check(kernel, output):
    variant = kern.Variant("float32", 8, True)  # the check problem's rank is 8 - 3
    reason = selfcheck.check_variant(variant, torch.device("cpu"), PaddingNaN(kernel, output))
    assert reason is not None
    assert re.search(rf"numeric: {kernel} left non-zero values in d?h's columns past the rank", reason), (
        reason
    )


def test_trust_mode_runs_unchecked_and_raises(fake):
    fake.driver.compile_error = "kernel.cu(1): error: planted"
    (x, w, b, a, bb), _ = make_inputs(9, 16, 8, 4, torch.float32)
    with switches.cuda_kernels.using("trust"), pytest.raises(KernelCompileError, match="planted"):
        lora_linear_cuda(x, w, b, a, bb, 1.0, 0.0, True, launcher=fake.checker)
    assert fake.checker.outcomes() == {}


def test_real_nvrtc_refuses_an_unknown_arch_and_the_op_falls_back(monkeypatch, tmp_path, fake):
    pytest.importorskip("cuda.bindings", reason="cuda-python is not installed")
    from loragen.cuda.build import compile_kernel

    fake.cache._compiler = compile_kernel
    fake.cache._nvrtc = None
    fake.driver.capability = (9, 9)  # sm_99: no such GPU
    with pytest.warns(RuntimeWarning, match=r"float32-r8-unaligned on cpu runs on the torch path.*compile"):
        run_and_compare(fake.checker)


# ---- once per variant per device; switches; later launch errors ----------------------------------------


def test_check_runs_once_per_variant_and_device():
    kernels = Counting(TorchKernels())  # correct "kernels": every check passes
    checker = selfcheck.CheckedLauncher(kernels)
    for _ in range(3):
        run_and_compare(checker, torch.float32)  # r=5 -> bucket 8, unaligned
    checks = [launch for launch in kernels.launches if launch[2] == "cpu"]
    per_call = 4  # down, up, grad_out, grad_in
    assert len(checks) == 4 + 3 * per_call  # one self-check (four passes), then three forward + backward
    run_and_compare(checker, torch.float32, r=16)  # another variant: one more check
    assert len(kernels.launches) == len(checks) + 4 + per_call
    # the same variant on another device is checked there too
    variant = kern.Variant("float32", 8, False)
    before = len(kernels.launches)
    checker.route(variant, torch.device("cpu", 0))
    checker.route(variant, torch.device("cpu", 0))
    assert len(kernels.launches) == before + 4
    assert set(checker.outcomes().values()) == {"ok"} and len(checker.outcomes()) == 3


def test_torch_switch_never_touches_the_kernels():
    kernels = Counting(TorchKernels())
    checker = selfcheck.CheckedLauncher(kernels)
    with switches.cuda_kernels.using("torch"):
        run_and_compare(checker, torch.bfloat16, n=17, k=40, o=24, r=3)
    assert kernels.launches == [] and checker.outcomes() == {}


def test_a_launch_error_after_the_check_moves_the_variant_to_the_torch_path():
    kernels = Counting(TorchKernels(), fail_at=6)  # the check's four pass, then the forward's up fails
    checker = selfcheck.CheckedLauncher(kernels)
    with pytest.warns(RuntimeWarning, match=r"float32-r8-unaligned on cpu .*launch \(lora_up\)") as record:
        run_twice(checker)
    assert len(fallback_warnings(record)) == 1
    assert len(kernels.launches) == 6  # nothing launched on the kernels after the failure


def test_routing_after_the_first_use_takes_no_lock_and_allocates_nothing():
    """The fast path: the same routed launcher object every time, without touching the lock; a failure
    later moves the cached route to the torch path."""

    class NoLock:
        def __enter__(self):
            raise AssertionError("route took the lock after the variant's first use")

        def __exit__(self, *exc):
            return False

    checker = selfcheck.CheckedLauncher(TorchKernels())
    variant, device = kern.Variant("float32", 8, True), torch.device("cpu")
    first = checker.route(variant, device)
    lock = checker._lock
    checker._lock = NoLock()
    assert checker.route(variant, device) is first and checker.route(variant, device) is first
    checker._lock = lock
    with pytest.warns(RuntimeWarning, match=r"float32-r8-aligned on cpu runs on the torch path"):
        checker.fail(variant, "cpu", "planted")
    assert checker.route(variant, device) is checker.torch_path


def test_capture_before_the_check_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    checker = selfcheck.CheckedLauncher(TorchKernels())
    with pytest.raises(
        RuntimeError, match=r"float32-r8-aligned is used for the first time on cuda:0 while a CUDA graph"
    ):
        checker.route(kern.Variant("float32", 8, True), torch.device("cuda", 0))


def test_a_cuda_device_without_index_is_the_current_device(monkeypatch):
    """Pre-checking with check_all("cuda") covers the op's later calls on cuda:N (N the current device),
    inside a capture too; outcome() and fail() take either spelling."""
    from loragen.cuda import launch

    checked: list[torch.device] = []
    monkeypatch.setattr(
        selfcheck, "check_variant", lambda variant, device, kernels, torch_path=None: checked.append(device)
    )
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    capturing = [False]
    monkeypatch.setattr(launch, "capturing", lambda device: capturing[0])
    checker = selfcheck.CheckedLauncher(TorchKernels())
    variant = kern.Variant("bfloat16", 16, True)
    assert checker.check_all(torch.device("cuda"), [variant]) == {"bfloat16-r16-aligned on cuda:1": "ok"}
    capturing[0] = True  # the op, inside a capture, routes with its tensors' device
    routed = checker.route(variant, torch.device("cuda", 1))
    assert checker.route(variant, torch.device("cuda")) is routed
    assert checked == [torch.device("cuda", 1)]
    assert checker.outcome(variant, "cuda") == checker.outcome(variant, torch.device("cuda", 1)) == "ok"
    with pytest.warns(
        RuntimeWarning, match=r"bfloat16-r16-aligned on cuda:1 runs on the torch path .*: planted"
    ):
        checker.fail(variant, "cuda", "planted")
    assert checker.route(variant, torch.device("cuda", 1)) is checker.torch_path
    with pytest.raises(
        RuntimeError, match=r"bfloat16-r16-aligned is used for the first time on cuda:0 while"
    ):
        checker.route(variant, torch.device("cuda", 0))  # another device: not checked there yet


def test_switch_value_is_checked(monkeypatch):
    assert switches.cuda_kernels.choices == ("check", "trust", "torch")
    with pytest.raises(ValueError, match=r"loragen.switches.cuda_kernels='on': expected one of"):
        with switches.cuda_kernels.using("on"):
            pass


class Aborting:
    """Kernels that fault the way a sticky CUDA error does: the process dies."""

    def target_blocks(self, device):
        return 1

    def launch(self, spec, variant, grid, args, device):
        os.abort()


@pytest.mark.slow
def test_isolated_check_runs_in_a_child_process():
    from loragen.cuda.selfcheck import check_in_child

    variant = kern.Variant("float32", 8, False)
    assert check_in_child(variant, torch.device("cpu"), "loragen.cuda.selfcheck:TorchKernels") is None
    reason = check_in_child(variant, torch.device("cpu"), "tests.cuda.test_cuda_selfcheck:Aborting")
    assert reason.startswith("crashed: the isolated self-check's process exited with status")


def test_an_isolated_check_that_cannot_start_says_why(monkeypatch):
    from loragen.cuda.selfcheck import check_in_child

    monkeypatch.setattr(sys, "executable", "/nonexistent/python3")  # e.g. a virtualenv removed under a job
    reason = check_in_child(kern.Variant("float32", 8, False), torch.device("cpu"))
    assert re.fullmatch(
        r"not checked: cannot start the isolated self-check's process '/nonexistent/python3': "
        r"\[Errno 2\] No such file or directory.*",
        reason,
    ), reason


def test_a_child_that_cannot_start_is_one_warning_and_not_retried(monkeypatch):
    from loragen.cuda import selfcheck

    starts = []

    def no_process(*args, **kwargs):  # what a container at its process limit answers
        starts.append(args)
        raise BlockingIOError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(selfcheck.subprocess, "run", no_process)
    kernels = Counting(TorchKernels())
    checker = selfcheck.CheckedLauncher(kernels, isolate=True)
    with pytest.warns(
        RuntimeWarning,
        match=r"float32-r8-unaligned on cpu runs on the torch path .*cannot start the isolated self-check's "
        r"process .*Resource temporarily unavailable",
    ) as record:
        run_twice(checker)
    assert len(fallback_warnings(record)) == 1 and len(starts) == 1  # decided once, not on every call
    assert kernels.launches == []


@pytest.mark.slow
def test_a_kernel_that_kills_the_process_only_kills_the_child():
    kernels = Counting(TorchKernels())
    checker = selfcheck.CheckedLauncher(
        kernels, isolate=True, child_launcher="tests.cuda.test_cuda_selfcheck:Aborting"
    )
    with pytest.warns(RuntimeWarning, match=r"float32-r8-unaligned on cpu runs on the torch path .*crashed"):
        run_and_compare(checker)
    assert kernels.launches == []  # the variant never ran here


# ---- the check computes as designed whatever the caller set, and leaves the caller's settings as found ----

PER_BACKEND = hasattr(torch.backends.cuda.matmul, "fp32_precision")  # torch >= 2.9
needs_per_backend = pytest.mark.skipif(not PER_BACKEND, reason="this torch has no per-backend fp32_precision")


def fp32_precision_owners() -> dict[str, object]:
    """The objects whose ``fp32_precision`` a user may set (mkldnn's own is read only: its setter writes
    the global one)."""
    if not PER_BACKEND:
        return {}
    backends = torch.backends
    return {
        "global": backends,
        "cuda.matmul": backends.cuda.matmul,
        "cudnn": backends.cudnn,
        "cudnn.conv": backends.cudnn.conv,
        "cudnn.rnn": backends.cudnn.rnn,
        "mkldnn.matmul": backends.mkldnn.matmul,
        "mkldnn.conv": backends.mkldnn.conv,
        "mkldnn.rnn": backends.mkldnn.rnn,
    }


def precision_settings() -> dict[str, object]:
    """Every float32 precision setting as a user (or torch.compile) reads it; a read that raises is
    recorded with its message."""
    reads = {
        "float32_matmul_precision": torch.get_float32_matmul_precision,
        "cuda.matmul.allow_tf32": lambda: torch.backends.cuda.matmul.allow_tf32,
        "cudnn.allow_tf32": lambda: torch.backends.cudnn.allow_tf32,
        **{
            name: (lambda owner=owner: owner.fp32_precision)
            for name, owner in fp32_precision_owners().items()
        },
    }
    if PER_BACKEND:
        reads["mkldnn"] = lambda: torch.backends.mkldnn.fp32_precision
    found: dict[str, object] = {}
    for name, read in reads.items():
        try:
            found[name] = read()
        except RuntimeError as exc:
            found[name] = f"raises: {str(exc)[:60]}"
    return found


@pytest.fixture
def precision_kept():
    """Puts the process's float32 precision settings back after the test."""
    before = precision_settings()
    yield
    torch.set_float32_matmul_precision(str(before["float32_matmul_precision"]))
    torch.backends.cudnn.allow_tf32 = bool(before["cudnn.allow_tf32"])
    for name, owner in fp32_precision_owners().items():
        owner.fp32_precision = before[name]
    assert precision_settings() == before


USER_SETTINGS = {
    "untouched": lambda: None,
    "medium": lambda: torch.set_float32_matmul_precision("medium"),
    "high": lambda: torch.set_float32_matmul_precision("high"),
    "legacy cuBLAS and cuDNN flags": lambda: (
        setattr(torch.backends.cuda.matmul, "allow_tf32", True),
        setattr(torch.backends.cudnn, "allow_tf32", False),
    ),
    "cuBLAS tf32": pytest.param(
        lambda: setattr(torch.backends.cuda.matmul, "fp32_precision", "tf32"), marks=needs_per_backend
    ),
    "global tf32": pytest.param(
        lambda: setattr(torch.backends, "fp32_precision", "tf32"), marks=needs_per_backend
    ),
    "cuDNN ieee": pytest.param(
        lambda: setattr(torch.backends.cudnn, "fp32_precision", "ieee"), marks=needs_per_backend
    ),
}


class Watching(TorchKernels):
    """The torch path, noting the precision settings (as read) at each of its launches."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[dict[str, object]] = []

    def launch(self, spec, variant, grid, args, device):
        self.seen.append(precision_settings())
        super().launch(spec, variant, grid, args, device)


def raising(settings: dict[str, object]) -> set[str]:
    return {name for name, value in settings.items() if str(value).startswith("raises")}


@pytest.mark.parametrize("setting", list(USER_SETTINGS.values()), ids=list(USER_SETTINGS))
def test_check_runs_in_full_float32_and_leaves_the_precision_settings_as_found(precision_kept, setting):
    setting()
    before = precision_settings()
    watching = Watching()
    variant = kern.Variant("float32", 8, True)
    assert selfcheck.check_variant(variant, torch.device("cpu"), TorchKernels(), watching) is None
    assert len(watching.seen) == 4
    for inside in watching.seen:
        if PER_BACKEND:
            assert inside["cuda.matmul"] == inside["mkldnn.matmul"] == "ieee"
        else:
            assert inside["float32_matmul_precision"] == "highest"
        assert raising(inside) <= raising(before)  # another thread reading them meanwhile gets an answer
    assert precision_settings() == before


def test_check_on_a_torch_with_one_precision_setting_keeps_medium(precision_kept, monkeypatch):
    """torch before 2.9 has one process-wide setting, of which allow_tf32 is only a view."""
    from loragen.cuda import selfcheck

    monkeypatch.setattr(selfcheck, "_PER_BACKEND_PRECISION", False)
    torch.set_float32_matmul_precision("medium")
    seen: list[str] = []
    with selfcheck.exact_float32_products():
        seen.append(torch.get_float32_matmul_precision())
    assert seen == ["highest"] and torch.get_float32_matmul_precision() == "medium"


class NotingAutocast(TorchKernels):
    """The torch path, noting whether the CPU's autocast is on at each of its launches."""

    def __init__(self) -> None:
        super().__init__()
        self.autocast: list[bool] = []

    def launch(self, spec, variant, grid, args, device):
        self.autocast.append(torch.is_autocast_enabled("cpu"))
        super().launch(spec, variant, grid, args, device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_check_runs_without_the_callers_autocast(dtype):
    """The op's first call, under the caller's autocast, runs the check: autocast would cast the torch
    path's float32 products to 16 bits and move the reference by a third of the tolerance."""
    kernels, reference = NotingAutocast(), NotingAutocast()
    variant = kern.Variant("bfloat16", 64, False)
    with torch.autocast("cpu", dtype=dtype):
        reason = selfcheck.check_variant(variant, torch.device("cpu"), kernels, reference)
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == dtype  # as found
    assert reason is None
    assert kernels.autocast == reference.autocast == [False] * 4


# ---- with the emulated kernels ------------------------------------------------------------------------

needs_cxx = pytest.mark.skipif(CXX is None, reason="g++ is needed to build the emulated kernels")


@pytest.fixture(scope="module")
def emulated(request, tmp_path_factory) -> EmulatedLauncher:
    cache = getattr(request.config, "cache", None)
    folder = cache.mkdir("loragen-emulated-kernels") if cache else tmp_path_factory.mktemp("emulated")
    return EmulatedLauncher(folder, target_blocks=4)


class PlantedBug:
    """The emulated kernels, with one kernel's output damaged after it runs: its last row zeroed."""

    def __init__(self, inner: EmulatedLauncher, kernel: str, output: str) -> None:
        self.inner, self.kernel, self.output = inner, kernel, output

    def target_blocks(self, device):
        return self.inner.target_blocks(device)

    def launch(self, spec, variant, grid, args, device):
        self.inner.launch(spec, variant, grid, args, device)
        if spec.name == self.kernel:
            names = [p.name for p in spec.params]
            args[names.index(self.output)][..., -1, :].zero_()


@needs_cxx
@pytest.mark.parametrize(
    "variant",
    [
        kern.Variant("float32", 8, True),
        kern.Variant("float32", 8, False),  # the x and g views are misaligned
        kern.Variant("bfloat16", 64, True),  # tensor cores where the kernels use them: A rounded to bf16
        kern.Variant("bfloat16", 16, True),  # every kernel on tensor cores at the common rank
    ],
    ids=lambda v: v.label,
)
def test_emulated_kernels_pass_their_self_check(emulated, variant):
    assert selfcheck.check_variant(variant, torch.device("cpu"), emulated) is None


@needs_cxx
def test_planted_wrong_result_gives_one_warning_and_the_torch_path(emulated):
    checker = selfcheck.CheckedLauncher(PlantedBug(emulated, "lora_grad_in", "grad_x_lora"))
    with pytest.warns(
        RuntimeWarning, match=r"float32-r8-aligned on cpu .*numeric: lora_grad_in dx differs"
    ) as rec:
        run_twice(checker, n=20, k=48, o=40, r=6)
    assert len(fallback_warnings(rec)) == 1


@needs_cxx
def test_forward_rounds_once_and_the_torch_route_rounds_as_peft(emulated):
    """base = 256 and the rank-r term 2**-9, bias 1: the kernels add bias and term to the base product in
    float32 and round once (257.0019... -> 258); the torch route is peft's composition, whose base layer
    rounds x W^T + b first (257, a tie, to even: 256), and equals it bit for bit."""
    n, k, o = 4, 8, 8
    x = torch.ones(n, k, dtype=torch.bfloat16)
    w = torch.full((o, k), 32.0, dtype=torch.bfloat16)
    b = torch.ones(o, dtype=torch.bfloat16)
    a = torch.zeros(1, k)
    a[0, 0] = 2.0**-9
    bb = torch.ones(o, 1)
    y = lora_linear_cuda(x, w, b, a, bb, 1.0, 0.0, False, launcher=emulated)
    once = (x.double() @ w.double().t() + b.double() + (x.double() @ a.double().t()) @ bb.double().t()).to(
        torch.bfloat16
    )
    assert torch.equal(y, once) and torch.equal(y, torch.full((n, o), 258.0, dtype=torch.bfloat16))
    routed = lora_linear_cuda(x, w, b, a, bb, 1.0, 0.0, False, launcher=TorchKernels())
    assert torch.equal(routed, lora_linear_reference(x, w, b, a, bb, 1.0, 0.0, False))


@needs_cxx
def test_output_is_fresh_and_may_be_modified_in_place(emulated):
    (x, w, b, a, bb), (xr, wr, br, ar, bbr) = make_inputs(12, 16, 8, 4, torch.float32)
    y = lora_linear_cuda(x.view(3, 4, 16), w, b, a, bb, 1.0, 0.0, True, launcher=emulated)
    assert y._base is None and y.shape == (3, 4, 8)
    y.mul_(2.0)  # a view of the Function's output would refuse this
    y.sum().backward()
    (2.0 * reference(xr, wr, br, ar, bbr, 1.0, None, False)).sum().backward()
    for got, want in ((x, xr), (a, ar), (bb, bbr), (w, wr), (b, br)):
        assert relative_error(got.grad, want.grad) < 1e-5
