"""The CUDA op's C++ host path (loragen.cuda.native_host) on the CPU: kernels/lora_host.cpp built against
torch, its launches going to a stand-in driver (tests/cuda/native_shim.c) whose cuLaunchKernel runs the
emulated kernels on CPU tensors. It must give the Python host path's outputs and gradients bit for bit."""

from __future__ import annotations

import ctypes
import functools
import gc
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import loragen.cuda
from loragen import switches
from loragen.cuda import hostcache, native_host, specs
from loragen.cuda.launch import NativeKernels
from loragen.cuda.linear_op import lora_linear_cuda
from loragen.cuda.op_inputs import CudaLoraError
from loragen.reference import lora_linear_reference
from tests.cuda.cuda_emulation import CXX, EmulatedLauncher, cache_folder, variant_of
from tests.cuda.lora_reference import make_inputs
from tests.cuda.raw_writes import RawWriteSGD

pytestmark = pytest.mark.skipif(
    CXX is None or shutil.which("cc") is None, reason="g++ and cc build the host path and its stand-in driver"
)

CONTEXT = 0x5000  # the stand-in primary context


@pytest.fixture(scope="module")
def shim(tmp_path_factory) -> ctypes.CDLL:
    folder = tmp_path_factory.mktemp("native-shim")
    built = folder / "native_shim.so"
    source = Path(__file__).with_name("native_shim.c")
    subprocess.run(["cc", "-O1", "-shared", "-fPIC", "-o", str(built), str(source)], check=True)
    library = ctypes.CDLL(str(built))
    library.shim_set_current.argtypes = [ctypes.c_void_p]
    library.shim_set_capturing.argtypes = [ctypes.c_int]
    return library


def _address(function: object) -> int:
    return int(ctypes.cast(function, ctypes.c_void_p).value or 0)


class NativeEmulatedLauncher(EmulatedLauncher):
    """The emulated kernels, also handed to the C++ host path: each kernel's emu entry stands for its
    CUfunction, and the shim's calls for the driver's."""

    def __init__(self, folder: Path, shim: ctypes.CDLL) -> None:
        super().__init__(folder, target_blocks=4)
        self.shim = shim

    def native_kernels(self, variant, device) -> NativeKernels:
        functions = []
        order = (specs.LORA_DOWN, specs.LORA_UP, specs.LORA_GRAD_OUT, specs.LORA_GRAD_IN)
        for spec in order:
            program = self.program(spec, variant)
            library = self._libraries.setdefault(program, ctypes.CDLL(str(program)))
            library.emu_find.restype = ctypes.c_void_p
            library.emu_find.argtypes = [ctypes.c_char_p]
            functions.append(int(library.emu_find(spec.name.encode())))
        s = self.shim
        driver = (
            CONTEXT,
            _address(s.shim_launch),
            _address(s.shim_get_current),
            _address(s.shim_push_current),
            _address(s.shim_pop_current),
            _address(s.shim_is_capturing),
            _address(s.shim_error_name),
        )
        return NativeKernels(tuple(functions), tuple(spec.threads(variant) for spec in order), driver)


@pytest.fixture(scope="module")
def launcher(request, shim) -> NativeEmulatedLauncher:
    if not native_host.available():
        pytest.fail(f"the C++ host path did not build: {native_host.status()}")
    return NativeEmulatedLauncher(cache_folder(request.config, "loragen-emulated-kernels"), shim)


CASES = [
    # n, k, o, r, dtype, p, bias, fan_in_fan_out, leading dims; with the emulator's small target_blocks the
    # split sums run: lora_down's column splits, lora_grad_out's row splits and column blocks (the dh sum),
    # lora_grad_in's row splits
    pytest.param(37, 48, 40, 5, torch.float32, 0.3, True, False, (), id="f32-r5-dropout"),
    pytest.param(29, 45, 37, 8, torch.float32, 0.25, True, True, (), id="f32-r8-unaligned-fifo"),
    pytest.param(70, 264, 296, 1, torch.float32, 0.0, True, False, (), id="f32-r1-split-grids"),
    pytest.param(40, 64, 296, 16, torch.bfloat16, 0.1, True, False, (5, 8), id="bf16-r16-dh-blocks-3d"),
    pytest.param(21, 24, 16, 64, torch.float16, 0.2, False, False, (), id="f16-r64-nobias"),
]


def _run(launcher, inputs, p, fifo, lead, native, seed=7, scaling=0.7):
    x, w, b, a, bb = (None if t is None else t.detach().clone().requires_grad_() for t in inputs)
    xin = x.view(*lead, x.shape[-1]) if lead else x
    with switches.cuda_native_host.using(native):
        y = lora_linear_cuda(
            xin, w, b, a, bb, scaling, p, True, fan_in_fan_out=fifo, seed=seed, launcher=launcher
        )
        grad = torch.randn(y.shape, generator=torch.Generator().manual_seed(3)).to(y.dtype)
        y.backward(grad)
    return y, [None if t is None else t.grad for t in (x, w, b, a, bb)]


@pytest.mark.parametrize(("n", "k", "o", "r", "dtype", "p", "bias", "fifo", "lead"), CASES)
def test_native_host_path_equals_the_python_path_bit_for_bit(
    launcher, shim, n, k, o, r, dtype, p, bias, fifo, lead
):
    inputs, _ = make_inputs(n, k, o, r, dtype, bias=bias, fan_in_fan_out=fifo)
    before = shim.shim_launches()
    y_native, grads_native = _run(launcher, inputs, p, fifo, lead, native=True)
    assert shim.shim_launches() - before == 4  # every pass went through the C++ launches
    before = shim.shim_launches()
    y_python, grads_python = _run(launcher, inputs, p, fifo, lead, native=False)
    assert shim.shim_launches() == before  # ... and none of the Python path's
    assert y_native.shape == (*lead, o) if lead else (n, o)
    assert y_native.dtype == dtype
    assert torch.equal(y_native, y_python)
    for name, got, want in zip(("x", "weight", "bias", "A", "B"), grads_native, grads_python):
        assert (got is None) == (want is None), name
        if got is not None:
            assert got.dtype == want.dtype and torch.equal(got, want), name


def test_the_cpp_launches_fill_the_parameter_lists_of_the_kernel_specs(launcher):
    want = [f"{s.name}({','.join(p.ctype for p in s.params)})" for s in specs.KERNELS.values()]
    assert sorted(native_host.kernel_signatures()) == sorted(want)


@pytest.mark.parametrize("needs", ["x only", "adapter only", "base trainable", "nothing but x"])
def test_only_the_gradients_asked_for_are_made(launcher, needs):
    (x, w, b, a, bb), _ = make_inputs(33, 64, 24, 8, torch.float32)
    want_grad = {
        "x only": (True, False, False, False, False),
        "adapter only": (False, False, False, True, True),
        "base trainable": (True, True, True, True, True),
        "nothing but x": (True, False, False, False, False),
    }[needs]
    results = {}
    for native in (True, False):
        tensors = [t.detach().clone().requires_grad_(flag) for t, flag in zip((x, w, b, a, bb), want_grad)]
        with switches.cuda_native_host.using(native):
            y = lora_linear_cuda(*tensors, 2.0, 0.0, True, launcher=launcher)
            y.square().sum().backward()
        results[native] = [t.grad for t in tensors]
    for flag, got, want in zip(want_grad, results[True], results[False]):
        assert (got is not None) == flag
        if flag:
            assert torch.equal(got, want)


def test_factors_are_copied_again_after_an_optimizer_step(launcher):
    """The padded float32 A and B^T are kept per parameter: a step that changes them in place must reach
    the next forward (their version counters move), and a parameter given new storage too."""
    inputs, _ = make_inputs(16, 40, 24, 5, torch.float32)
    x, w, b, a, bb = (t.detach().clone() for t in inputs)
    a.requires_grad_()
    bb.requires_grad_()
    optimizer = torch.optim.SGD([a, bb], lr=0.5)
    for step in range(3):
        with switches.cuda_native_host.using(True):
            y = lora_linear_cuda(x, w, b, a, bb, 1.0, 0.0, True, launcher=launcher)
        with switches.cuda_native_host.using(False):
            want = lora_linear_cuda(x, w, b, a, bb, 1.0, 0.0, True, launcher=launcher)
        assert torch.equal(y, want), step
        optimizer.zero_grad()
        y.square().sum().backward()
        optimizer.step()
    with torch.no_grad():
        bb.data = bb.data * 2  # new storage, version counter of the new tensor
    with switches.cuda_native_host.using(True):
        y = lora_linear_cuda(x, w, b, a, bb, 1.0, 0.0, False, launcher=launcher)
    with switches.cuda_native_host.using(False):
        assert torch.equal(y, lora_linear_cuda(x, w, b, a, bb, 1.0, 0.0, False, launcher=launcher))


def test_factors_follow_inference_mode_steps_that_keep_version_counters_and_a_smaller_rank(launcher):
    """The C++ cache as the Python one: a buffer first made under ``torch.inference_mode`` takes later
    values, an optimizer step that moves no version counter reaches the next forward, and a rank that
    shrinks within its bucket leaves zero rows."""
    inputs, _ = make_inputs(16, 40, 24, 5, torch.float32)
    x, w, b, a, bb = (t.detach().clone() for t in inputs)
    a.requires_grad_()
    bb.requires_grad_()

    def native_call(train: bool) -> torch.Tensor:
        with switches.cuda_native_host.using(True):
            y = lora_linear_cuda(x, w, b, a, bb, 1.0, 0.0, train, launcher=launcher)
        torch.testing.assert_close(
            y, lora_linear_reference(x, w, b, a, bb, 1.0, 0.0, False), rtol=1e-4, atol=1e-4
        )
        return y

    before = torch.ops.loragen_host.cached_factors()
    with torch.inference_mode():
        for _ in range(2):  # the first call registers the plan (Python path), the second runs in C++
            native_call(False)
    assert torch.ops.loragen_host.cached_factors() > before
    optimizer = RawWriteSGD([a, bb])
    for _ in range(3):
        versions = a._version, bb._version
        native_call(True).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        assert (a._version, bb._version) == versions
    a.data, bb.data = a.data[:3].clone(), bb.data[:, :3].clone()  # rank 5 -> 3, both in bucket 8
    for _ in range(2):
        native_call(False)


def test_a_backward_that_would_record_a_graph_is_refused(launcher):
    """No graph of the C++ backward is recorded: create_graph=True is refused, not answered with gradients
    that lack their second-order terms."""
    inputs, _ = make_inputs(16, 40, 24, 5, torch.float32)
    x, w, b, a, bb = (t.detach().clone().requires_grad_() for t in inputs)
    with switches.cuda_native_host.using(True):
        for _ in range(2):  # the first call registers the plan (Python path), the second runs in C++
            y = lora_linear_cuda(x, w, b, a, bb, 1.0, 0.0, True, launcher=launcher)
    with pytest.raises(RuntimeError, match=r"differentiable once.*create_graph=True"):
        torch.autograd.grad(y.square().sum(), x, create_graph=True)
    (grad_x,) = torch.autograd.grad(y.square().sum(), x)  # without a graph: as before
    assert grad_x.shape == x.shape


@pytest.mark.parametrize("rng", [None, torch.zeros(1, dtype=torch.int64), torch.zeros(2)], ids=str)
def test_the_op_refuses_dropout_without_a_usable_rng_tensor(launcher, rng):
    """Called directly, the registered op refuses what its kernels would read out of bounds."""
    tensors, (_, _, plan, scaling, threshold, keep_scale, fifo) = _op_args(launcher, p=0.2)
    with pytest.raises(ValueError, match=r"dropout needs rng, an int64 \(seed, offset\) tensor"):
        torch.ops.loragen_host.lora_linear(*tensors, rng, False, plan, scaling, threshold, keep_scale, fifo)


def test_backward_refuses_a_factor_changed_after_the_forward(launcher):
    (x, w, b, a, bb), _ = make_inputs(16, 40, 24, 5, torch.float32)
    with switches.cuda_native_host.using(True):
        y = lora_linear_cuda(x, w, b, a, bb, 1.0, 0.0, True, launcher=launcher)
    with torch.no_grad():
        a.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_after_a_capture_the_factors_are_copied_on_every_call(launcher, shim):
    """A CUDA graph's replay changes parameters in place without moving their version counters (a captured
    optimizer step): once a capture (the stand-in driver's cuStreamIsCapturing saying so) has read the
    factors, every call copies them again, so an eager call after replays computes with the values the
    replays left (``.data`` changes stand in for a replay's: they do not move the counter either)."""
    inputs, _ = make_inputs(16, 40, 24, 5, torch.float32)
    x, w, b, a, bb = (t.detach().clone() for t in inputs)
    with switches.cuda_native_host.using(True):
        lora_linear_cuda(x, w, b, a, bb, 1.0, 0.0, True, launcher=launcher)
        shim.shim_set_capturing(1)
        try:
            lora_linear_cuda(x, w, b, a, bb, 1.0, 0.0, True, launcher=launcher)
        finally:
            shim.shim_set_capturing(0)
        for step in range(2):
            versions = a._version, bb._version
            a.data.mul_(-2.0)
            bb.data.add_(1.0)
            assert (a._version, bb._version) == versions
            got = lora_linear_cuda(x, w, b, a, bb, 1.0, 0.0, True, launcher=launcher)
            want = lora_linear_reference(x, w, b, a, bb, 1.0, 0.0, False)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=str(step))


def test_factor_cache_drops_the_entries_of_parameters_that_are_gone(launcher):
    x = torch.randn(8, 40)
    w = torch.randn(24, 40)
    with switches.cuda_native_host.using(True):
        for _ in range(200):  # 400 entries made, each pair dead by the next call; swept past 256
            a, bb = torch.randn(5, 40), torch.randn(24, 5)  # rank 5: both padded, so both cached
            lora_linear_cuda(x, w, None, a, bb, 1.0, 0.0, False, launcher=launcher)
    del a, bb
    gc.collect()
    assert torch.ops.loragen_host.cached_factors() < 300


def test_a_failed_launch_names_the_kernel_and_the_driver_error(launcher, shim):
    (x, w, b, a, bb), _ = make_inputs(16, 40, 24, 5, torch.float32)
    shim.shim_fail_with(700)
    try:
        with switches.cuda_native_host.using(True):
            with pytest.raises(
                RuntimeError, match=r"cuLaunchKernel failed \(kernel lora_down .*CUDA_ERROR_ILLEGAL_ADDRESS"
            ):
                lora_linear_cuda(x, w, b, a, bb, 1.0, 0.0, True, launcher=launcher)
    finally:
        shim.shim_fail_with(0)


def test_the_primary_context_is_pushed_only_when_another_is_current(launcher, shim):
    (x, w, b, a, bb), _ = make_inputs(16, 40, 24, 5, torch.float32)
    with switches.cuda_native_host.using(True):
        lora_linear_cuda(x, w, b, a, bb, 1.0, 0.0, False, launcher=launcher)  # plans, builds
        shim.shim_set_current(None)
        before = shim.shim_pushes()
        lora_linear_cuda(x, w, b, a, bb, 1.0, 0.0, False, launcher=launcher)
        assert shim.shim_pushes() - before == 2  # lora_down, lora_up
        shim.shim_set_current(CONTEXT)
        before = shim.shim_pushes()
        lora_linear_cuda(x, w, b, a, bb, 1.0, 0.0, False, launcher=launcher)
        assert shim.shim_pushes() == before


def test_launchers_without_native_kernels_and_empty_inputs_take_the_python_path(request, shim):
    plain = EmulatedLauncher(cache_folder(request.config, "loragen-emulated-kernels"), target_blocks=4)
    (x, w, b, a, bb), _ = make_inputs(16, 40, 24, 5, torch.float32)
    before = shim.shim_launches()
    with switches.cuda_native_host.using(True):
        y = lora_linear_cuda(x, w, b, a, bb, 1.0, 0.0, True, launcher=plain)
        y.sum().backward()
        assert len(plain.launches) == 4
        assert variant_of(40, 24, 5, torch.float32) == plain.launches[0][1]
        empty = lora_linear_cuda(
            x[:0], w, b, a, bb, 1.0, 0.0, True, launcher=NativeEmulatedLauncher(plain.build_dir, shim)
        )
    assert empty.shape == (0, 24)
    assert shim.shim_launches() == before


def test_a_library_that_cannot_be_built_warns_once_and_the_python_path_runs(monkeypatch, launcher):
    monkeypatch.setattr(native_host, "_library", [])
    monkeypatch.setattr(native_host, "_plans", {})
    monkeypatch.setattr(native_host, "_compiler", lambda: None)
    (x, w, b, a, bb), _ = make_inputs(16, 40, 24, 5, torch.float32)
    with switches.cuda_native_host.using(True):
        with pytest.warns(
            RuntimeWarning, match=r"no C\+\+ compiler found.*falls back to the Python host path"
        ):
            y = lora_linear_cuda(x, w, b, a, bb, 1.0, 0.0, False, launcher=launcher)
        assert native_host.status().startswith("the C++ host path could not be built")
    with switches.cuda_native_host.using(False):
        assert torch.equal(y, lora_linear_cuda(x, w, b, a, bb, 1.0, 0.0, False, launcher=launcher))


needs_direct_entry = pytest.mark.skipif(
    native_host._python_include() is None, reason="the direct entry is built only against Python's headers"
)


def _op_args(launcher, dtype=torch.float32, p=0.2):
    """Leaf inputs and the registered op's arguments for them (the plan registered, an explicit rng)."""
    (x, w, b, a, bb), _ = make_inputs(24, 40, 32, 6, dtype)
    handle = hostcache.launcher_handle(launcher)
    plan = native_host.plan_id(x, a, bb, False, handle)
    assert plan is not None
    rng, threshold, keep_scale = hostcache.dropout_args(torch.tensor([7, 3], dtype=torch.int64), p)
    return (x, w, b, a, bb), (rng, False, plan, 0.75, threshold, keep_scale, False)


@needs_direct_entry
def test_the_direct_entry_equals_the_op_through_torch_ops(launcher):
    """The library's direct Python entry and torch.ops call one C++ function: the same output and
    gradients bit for bit, and the same ValueError for inputs that do not fit the plan."""
    assert native_host.status().endswith("called directly")
    direct, boxed = native_host._op
    assert direct is not boxed
    inputs, scalars = _op_args(launcher)
    results = []
    for op in (direct, boxed):
        x, w, b, a, bb = (t.detach().clone().requires_grad_() for t in inputs)
        y = op(x, w, b, a, bb, *scalars)
        y.square().sum().backward()
        results.append([y, x.grad, w.grad, b.grad, a.grad, bb.grad])
    for got, want in zip(*results):
        assert torch.equal(got, want)
    x, w, b, a, bb = inputs
    for op in (direct, boxed):
        with pytest.raises(ValueError, match=r"the inputs do not fit plan \d+"):
            op(x[:, :39], w, b, a, bb, *scalars)
    with pytest.raises(TypeError, match="expected 12 arguments"):
        direct(x, w, b, a, bb)


@needs_direct_entry
def test_the_direct_entry_hands_subclasses_and_torch_function_modes_to_torch_ops(launcher):
    """A tensor subclass may override __torch_function__ and a TorchFunctionMode sees every op: only the
    call through torch.ops honours them, so the direct entry returns NotImplemented (having run nothing)
    and the op goes through torch.ops, with the same result."""
    from torch.overrides import TorchFunctionMode

    seen = []

    class Traced(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return super().__torch_function__(func, types, args, kwargs or {})

    class Recording(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    inputs, scalars = _op_args(launcher, p=0.0)
    x, w, b, a, bb = inputs
    want = native_host._op[1](x, w, b, a, bb, *scalars)
    assert native_host._op[0](x.as_subclass(Traced), w, b, a, bb, *scalars) is NotImplemented
    with Recording():
        assert native_host._op[0](x, w, b, a, bb, *scalars) is NotImplemented
    assert not seen  # nothing ran
    with switches.cuda_native_host.using(True):
        got = native_host.lora_linear_native(
            x.as_subclass(Traced), w, b, a, bb, None, False, scalars[2], 0.75, 0.0, False
        )
        assert any("loragen_host.lora_linear" in name for name in seen)
        seen.clear()
        with Recording():
            moded = native_host.lora_linear_native(x, w, b, a, bb, None, False, scalars[2], 0.75, 0.0, False)
        assert any("loragen_host.lora_linear" in name for name in seen)
    assert torch.equal(got.as_subclass(torch.Tensor), want) and torch.equal(moded, want)


def test_without_the_direct_entry_the_op_goes_through_torch_ops():
    """LORAGEN_CUDA_NATIVE_DIRECT_CALL=0 (as where Python's headers are missing) builds the library without
    the direct entry: in a fresh process the op goes through torch.ops, the C++ path's outputs and
    gradients still equal the Python path's bit for bit, and its host work (float32; bfloat16 differs only
    in the C++ side's own torch ops) stays under its ceilings."""
    env = {**os.environ, "LORAGEN_CUDA_NATIVE_DIRECT_CALL": "0"}
    status = subprocess.run(
        [sys.executable, "-c", "from loragen.cuda import native_host; print(native_host.status())"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=600,
    )
    assert status.returncode == 0, status.stderr
    assert status.stdout.strip().endswith("called through torch.ops")
    selected = "(bit_for_bit and (f32-r5-dropout or bf16-r16)) or (ceilings and dtype0)"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", str(Path(__file__)), "-k", selected],
        capture_output=True,
        text=True,
        env=env,
        cwd=Path(__file__).resolve().parents[2],
        check=False,
        timeout=900,
    )
    assert run.returncode == 0 and "3 passed" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]


# per forward + backward of one layer (64 tokens, 64 -> 64, r = 16, dropout 0.05), counted as
# benchmarks/cuda_host.py counts it, with the op called through torch.ops: 35 Python calls (the step's own,
# the op's input checks and its call), 40 C calls, 32 / 29 torch ops (float32 / bfloat16, the C++ side's
# included); through the direct Python entry 28 Python calls and 33 C calls (torch.ops' own Python and C
# calls left out); the Python path on the same emulated launcher makes about 190 Python calls
NATIVE_CEILINGS = {"python_calls": 36, "c_calls": 42, "torch_ops": 32}
DIRECT_CEILINGS = {"python_calls": 30, "c_calls": 35, "torch_ops": 32}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_host_work_of_the_native_path_stays_under_its_ceilings(launcher, dtype):
    from benchmarks.cuda_host import count_host_work, lora_step

    with switches.cuda_native_host.using(True):
        native = count_host_work(lora_step(launcher, tokens=64, features=64, dtype=dtype))
    with switches.cuda_native_host.using(False):
        python = count_host_work(lora_step(launcher, tokens=64, features=64, dtype=dtype))
    print(f"\n{dtype}: native {native}\npython {python}")
    direct = native_host._op[0] is not native_host._op[1]
    for name, ceiling in (DIRECT_CEILINGS if direct else NATIVE_CEILINGS).items():
        assert getattr(native, name) <= ceiling, (name, native)
    assert native.python_calls * 4 < python.python_calls


@pytest.mark.parametrize(
    ("kind", "autocast"),
    [("llama", False), ("gpt2", False), ("bert", False), ("t5", False), ("llama", True), ("gpt2", True)],
)
def test_real_architectures_train_the_same_on_both_host_paths(launcher, kind, autocast, monkeypatch):
    """Tiny transformers models (their own modeling files; GPT-2's Conv1D is fan_in_fan_out), every linear
    adapted, dropout on, the forward under bf16 autocast or not (as Trainer's ``bf16=True`` runs it): each
    LoRA linear runs the CUDA op on the emulated kernels (as on a GPU) with the C++ host path and with the
    Python one; losses and every gradient are equal."""
    import loragen
    from loragen.ops import dispatch
    from tests.conftest import TINY_MODELS, tiny_inputs

    class CudaOpOnCpuTensors:
        @staticmethod
        def apply(x, w, b, a, bb, scaling, p, rng, seed, fifo):
            return lora_linear_cuda(x, w, b, a, bb, scaling, p, True, fan_in_fan_out=fifo, launcher=launcher)

    monkeypatch.setattr(dispatch, "LoraLinearFunction", CudaOpOnCpuTensors)
    # as for CUDA tensors, which go to the CUDA op under autocast too (CPU ones take the composition)
    monkeypatch.setattr(dispatch, "fallback_reason", lambda x, dropout: None)
    results = {}
    for native in (True, False):
        torch.manual_seed(0)
        config = loragen.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules="all-linear")
        model = loragen.get_lora_model(TINY_MODELS[kind](), config).train()
        with torch.no_grad():  # B starts at zero: make the LoRA terms count
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_()
        before = shim_launches = launcher.shim.shim_launches()
        torch.manual_seed(1)
        with switches.sibling_fusion.using(False), switches.cuda_native_host.using(native):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                logits = model(**tiny_inputs(kind)).logits
            assert logits.dtype == (torch.bfloat16 if autocast else torch.float32)
            loss = logits.float().square().mean()
            loss.backward()
        launched = launcher.shim.shim_launches() - shim_launches
        assert (launched > 0) == native, (kind, before, launched)
        results[native] = (loss, {n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    (loss_native, grads_native), (loss_python, grads_python) = results[True], results[False]
    assert torch.equal(loss_native, loss_python)
    assert grads_native.keys() == grads_python.keys() and len(grads_native) >= 8
    for name, grad in grads_native.items():
        assert torch.equal(grad, grads_python[name]), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_repeated_calls_draw_the_same_masks_as_the_python_path(launcher, monkeypatch, dtype):
    """After the first call (the whole Python path, which registers the plan) calls like it go straight
    to the C++ side, which checks the inputs itself and draws (seed, offset) with the generator, as the
    Python path does: step for step the same masks, outputs and gradients."""
    from loragen.cuda import linear_op

    checked = []
    monkeypatch.setattr(linear_op, "check_inputs", lambda *args, **kwargs: checked.append(1))
    inputs, _ = make_inputs(24, 40, 32, 6, dtype)
    runs = {}
    for native in (True, False):
        x, w, b, a, bb = (t.detach().clone().requires_grad_() for t in inputs)
        torch.manual_seed(11)
        outputs = []
        checked.clear()
        with switches.cuda_native_host.using(native):
            for _ in range(3):
                y = lora_linear_cuda(x.view(4, 6, 40), w, b, a, bb, 0.5, 0.3, True, launcher=launcher)
                y.square().sum().backward()
                outputs.append((y, x.grad.clone(), a.grad.clone(), bb.grad.clone()))
        runs[native] = (outputs, len(checked))
    assert runs[True][1] == 1 and runs[False][1] == 3  # the C++ side checked the second and third calls
    for got, want in zip(runs[True][0], runs[False][0]):
        for g, e in zip(got, want):
            assert torch.equal(g, e)


def test_inputs_that_do_not_fit_the_plan_take_the_python_path(launcher):
    (x, w, b, a, bb), _ = make_inputs(16, 40, 24, 5, torch.float32)
    with switches.cuda_native_host.using(True):
        lora_linear_cuda(x, w, b, a, bb, 1.0, 0.0, False, launcher=launcher)  # the plan is known now
        # float64 factors: the kernels do not take them, the composition runs (as without the C++ path)
        got = lora_linear_cuda(x, w, b, a.double(), bb.double(), 1.0, 0.0, False, launcher=launcher)
        with pytest.raises(CudaLoraError, match=r"bias \(23,\); expected \(24,\)"):
            lora_linear_cuda(x, w, b[:23], a, bb, 1.0, 0.0, False, launcher=launcher)
        with pytest.raises(CudaLoraError, match=r"weight \(24, 39\) is not \(out, in\)"):
            lora_linear_cuda(x, w[:, :39], b, a, bb, 1.0, 0.0, False, launcher=launcher)
        # a probability no call validated: checked (and refused) even where it is not used
        with pytest.raises(CudaLoraError, match=r"dropout_p=1.5; expected 0 <= p < 1"):
            lora_linear_cuda(x, w, b, a, bb, 1.0, 1.5, False, launcher=launcher)
    with switches.cuda_native_host.using(False):
        want = lora_linear_cuda(x, w, b, a.double(), bb.double(), 1.0, 0.0, False, launcher=launcher)
    assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize(
    ("x_dtype", "base_dtype", "backward_under_autocast"),
    [
        # a float32 model under bf16 autocast: x, weight and bias cast on the way in
        pytest.param(torch.float32, torch.float32, False, id="f32-model"),
        # a bf16 model (Trainer's bf16=True on a bf16 checkpoint): the casts are no-ops
        pytest.param(torch.bfloat16, torch.bfloat16, False, id="bf16-model"),
        # backward called inside the autocast region: the op's backward runs without autocast all the same
        pytest.param(torch.float32, torch.float32, True, id="f32-backward-inside"),
    ],
)
def test_autocast_runs_on_the_cpp_side_as_on_the_python_path(
    launcher, monkeypatch, x_dtype, base_dtype, backward_under_autocast
):
    """Under autocast for x's device (the CPU here, CUDA for users) the C++ side casts x, weight and bias
    to the autocast dtype, as the Python path does, and runs the op with autocast off: after the first
    call, which registers the plan of the cast x, calls go straight to it; outputs, masks and every
    gradient (x's through its cast) equal the Python path's bit for bit."""
    from loragen.cuda import linear_op

    calls, checked = [], []
    op = native_host._op[0]

    def counted(*args):
        calls.append(args[7])  # the calls the C++ side ran
        return op(*args)

    monkeypatch.setattr(native_host, "_op", [counted, native_host._op[1]])
    monkeypatch.setattr(linear_op, "check_inputs", lambda *args, **kwargs: checked.append(1))
    inputs, _ = make_inputs(24, 40, 32, 6, torch.float32)
    runs = {}
    for native in (True, False):
        x, w, b, a, bb = inputs
        x, w, b = (
            t.detach().to(d).requires_grad_() for t, d in ((x, x_dtype), (w, base_dtype), (b, base_dtype))
        )
        a, bb = (t.detach().clone().requires_grad_() for t in (a, bb))
        torch.manual_seed(5)
        outputs = []
        calls.clear()
        checked.clear()
        with switches.cuda_native_host.using(native):
            for _ in range(3):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    y = lora_linear_cuda(x.view(4, 6, 40), w, b, a, bb, 0.5, 0.2, True, launcher=launcher)
                    if backward_under_autocast:
                        y.float().square().sum().backward()
                if not backward_under_autocast:
                    y.float().square().sum().backward()
                grads = [t.grad.clone() for t in (x, w, b, a, bb)]
                outputs.append((y, *grads))
        runs[native] = (outputs, len(calls), len(checked))
    # every call of the first run went to the C++ side; at least the second and third without the Python
    # path's checks (the first too where an earlier case registered the plan of these inputs)
    assert runs[True][1] == 3 and runs[True][2] <= 1 and runs[False][1:] == (0, 3)
    for got, want in zip(runs[True][0], runs[False][0]):
        assert got[0].dtype == torch.bfloat16  # the output in the autocast dtype, as F.linear's
        assert [g.dtype for g in got[1:]] == [x_dtype, base_dtype, base_dtype, torch.float32, torch.float32]
        for g, e in zip(got, want):
            assert g.dtype == e.dtype and torch.equal(g, e)


def test_a_backward_inside_autocast_computes_in_the_forwards_dtypes(launcher):
    """A float32 forward without autocast, its backward called inside an autocast region: the C++
    backward turns autocast off as the Python path's does, so the base weight's gradient is a float32
    product on both paths (autocast would make it a bfloat16 one)."""
    inputs, _ = make_inputs(24, 40, 32, 6, torch.float32)
    grads = {}
    for native in (True, False, True):  # the second native run goes straight to the C++ side
        x, w, b, a, bb = (t.detach().clone().requires_grad_() for t in inputs)
        with switches.cuda_native_host.using(native):
            y = lora_linear_cuda(x, w, b, a, bb, 0.5, 0.0, True, launcher=launcher)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y.square().sum().backward()
        grads.setdefault(native, []).append([t.grad for t in (x, w, b, a, bb)])
    for got in grads[True]:
        for g, e in zip(got, grads[False][0]):
            assert g.dtype == torch.float32 and torch.equal(g, e)


def test_the_cpp_side_refuses_an_autocast_dtype_that_is_not_its_plans(launcher):
    """A plan fixes the kernels' dtype: called under autocast to another dtype, the registered op raises
    a ValueError before anything runs (the Python path then casts and takes that dtype's plan)."""
    (x, w, b, a, bb), _ = make_inputs(16, 40, 24, 5, torch.float32)
    plan = native_host.plan_id(x, a, bb, False, hostcache.launcher_handle(launcher))
    assert plan is not None
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError, match="autocast dtype"):
        native_host.lora_linear_native(x, w, b, a, bb, None, False, plan, 1.0, 0.0, False)
    with switches.cuda_native_host.using(True), torch.autocast("cpu", dtype=torch.bfloat16):
        got = lora_linear_cuda(x, w, b, a, bb, 1.0, 0.0, False, launcher=launcher)
    with switches.cuda_native_host.using(False), torch.autocast("cpu", dtype=torch.bfloat16):
        want = lora_linear_cuda(x, w, b, a, bb, 1.0, 0.0, False, launcher=launcher)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_recomputes_the_mask_the_cpp_side_drew(launcher, reentrant, autocast):
    """torch.utils.checkpoint restores the generator's state (and autocast's) before recomputing: the C++
    side's draw must give the same (seed, offset) again, and its casts the same inputs, so the recomputed
    forward and the gradients equal a plain step's (the Python path's, as the reference)."""
    from torch.utils.checkpoint import checkpoint

    def run(native: bool, use_checkpoint: bool):
        (x, w, b, a, bb), _ = make_inputs(20, 16, 8, 4, torch.float32, seed=3)
        with switches.cuda_native_host.using(native):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                lora_linear_cuda(x.detach(), w, b, a, bb, 1.5, 0.5, False, launcher=launcher)  # known plan
                torch.manual_seed(123)
                if use_checkpoint:
                    op = functools.partial(lora_linear_cuda, launcher=launcher)  # reentrant: no keywords
                    y = checkpoint(op, x, w, b, a, bb, 1.5, 0.5, True, use_reentrant=reentrant)
                else:
                    y = lora_linear_cuda(x, w, b, a, bb, 1.5, 0.5, True, launcher=launcher)
            y.float().square().sum().backward()
        return y.detach(), a.grad, bb.grad, x.grad

    want = run(False, False)
    for got, expected in zip(run(True, True), want):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("native", [True, False])
def test_backward_refuses_an_input_changed_in_place_after_the_forward(launcher, native):
    """The saved 2-D x is a view of x (x contiguous and aligned): it must share x's version counter, or a
    backward after ``x.add_`` would use the changed values for dA without a word."""
    (x, w, b, a, bb), _ = make_inputs(16, 40, 24, 5, torch.float32)
    x = x.detach().view(2, 8, 40)  # no grad: only A and B's gradients need x
    with switches.cuda_native_host.using(native):
        lora_linear_cuda(x, w, b, a, bb, 1.0, 0.0, True, launcher=launcher)  # the plan is known
        y = lora_linear_cuda(x, w, b, a, bb, 1.0, 0.0, True, launcher=launcher)
        x.add_(1.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()


def test_a_failing_cpp_compiler_is_reported_with_its_output(tmp_path, monkeypatch):
    compiler = tmp_path / "c++"
    compiler.write_text("#!/bin/sh\n[ \"$1\" = --version ] && exit 0\necho 'error: no luck' >&2\nexit 1\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("LORAGEN_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(RuntimeError, match=r"-std=c\+\+20 .* lora_host.cpp failed:\nerror: no luck"):
        native_host._build("int x;", str(compiler))
    assert not list((tmp_path / "cache").rglob("*.so"))  # nothing half-written is left to be loaded


def test_torch_compile_traces_the_custom_op_with_the_switch_on(launcher):
    """torch.compile sees the custom op (fake implementation included), as without the C++ host path:
    no graph break, and the compiled step's loss and gradients are the eager C++ path's."""
    (x, w, b, a, bb), _ = make_inputs(16, 40, 24, 5, torch.float32)

    def step(x, a, bb):
        return lora_linear_cuda(x, w, b, a, bb, 0.5, 0.0, True, launcher=launcher).square().sum()

    with switches.cuda_native_host.using(True):
        want = step(x, a, bb)  # eager: registers the launcher and the plan
        want.backward()
        wanted = [t.grad.clone() for t in (x, a, bb)]
        for t in (x, a, bb):
            t.grad = None
        loss = torch.compile(step, fullgraph=True, backend="aot_eager")(x, a, bb)
        loss.backward()
    torch.testing.assert_close(loss, want)
    for want_grad, t in zip(wanted, (x, a, bb)):
        torch.testing.assert_close(t.grad, want_grad)


# ---- on a GPU (scripts/first_gpu_run.sh's native step) ------------------------------------------------

needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or not loragen.cuda.is_available(),
    reason="needs a CUDA device and cuda-python",
)


@needs_gpu
@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_a_gpu_the_cpp_path_equals_the_python_path(dtype, p, autocast):
    """The real kernels, driver and cuBLAS: two steps of each host path from one generator state give the
    same outputs and gradients, bit for bit (the same kernels and products run in the same order), with
    the forward under bf16 autocast or not."""
    assert native_host.available(), native_host.status()
    inputs, _ = make_inputs(257, 264, 136, 16, dtype, device="cuda")
    runs = {}
    for native in (True, False):
        x, w, b, a, bb = (t.detach().clone().requires_grad_() for t in inputs)
        torch.manual_seed(5)
        steps = []
        with switches.cuda_native_host.using(native):
            for _ in range(2):
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                    y = lora_linear_cuda(x, w, b, a, bb, 0.5, p, True)
                y.float().square().sum().backward()
                steps.append([y.detach().clone()] + [t.grad.clone() for t in (x, w, b, a, bb)])
        runs[native] = steps
    assert any(key[2].type == "cuda" and plan is not None for key, plan in native_host._plans.items())
    for got_step, want_step in zip(runs[True], runs[False]):
        for got, want in zip(got_step, want_step):
            assert torch.equal(got, want)


@needs_gpu
def test_on_a_gpu_a_captured_forward_reads_the_factors_of_each_replay():
    """Inside a CUDA-graph capture the padded factors are copied on every call (cuStreamIsCapturing), so
    a replay after an in-place change of A computes with the new A; with dropout each replay draws a fresh
    mask."""
    (x, w, b, a, bb), _ = make_inputs(64, 128, 96, 8, torch.bfloat16, device="cuda")
    x, w, b, a, bb = (t.detach() for t in (x, w, b, a, bb))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with switches.cuda_native_host.using(True):
        with torch.cuda.stream(side):
            for _ in range(2):  # plans, modules and the call table made before the capture
                lora_linear_cuda(x, w, b, a, bb, 0.5, 0.0, True)
                lora_linear_cuda(x, w, b, a, bb, 0.5, 0.2, True)
        torch.cuda.current_stream().wait_stream(side)
        graph, dropped = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = lora_linear_cuda(x, w, b, a, bb, 0.5, 0.0, True)
        with torch.cuda.graph(dropped):
            y_dropped = lora_linear_cuda(x, w, b, a, bb, 0.5, 0.2, True)
    with torch.no_grad():
        a.mul_(2.0)
    graph.replay()
    with switches.cuda_native_host.using(False):
        want = lora_linear_cuda(x, w, b, a, bb, 0.5, 0.0, True)
    assert torch.equal(y, want)
    dropped.replay()
    first = y_dropped.clone()
    dropped.replay()
    assert not torch.equal(y_dropped, first)
