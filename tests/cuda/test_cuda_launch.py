"""loragen.cuda.launch against a fake driver: the device's primary context is current during every launch
and the thread's previous context is current again afterwards (also when a launch fails), modules load
once per device and variant, and the kernel-parameter array holds exactly the values the kernel's
signature asks for. (The real driver is exercised by tests/cuda/test_cuda_gpu.py.)"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loragen.cuda import kernels as kern
from loragen.cuda import launch
from loragen.cuda.build import CompiledKernel, KernelCache
from tests.cuda.fake_driver import FakeDriver


@pytest.fixture
def fake(monkeypatch, tmp_path):
    spec = kern.KERNELS["lora_up"]
    driver = FakeDriver(spec)
    monkeypatch.setattr(launch.DriverLauncher, "_driver", staticmethod(lambda: driver))
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda index: SimpleNamespace(multi_processor_count=132)
    )
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SimpleNamespace(cuda_stream=4242))
    # the stream handle the launch passes comes from torch.cuda.current_stream, patched above (and by tests
    # that switch streams): a CUDA build of torch would otherwise ask the real device, where cuda:1 may
    # not exist
    monkeypatch.setattr(launch, "raw_handle", lambda index: torch.cuda.current_stream(index).cuda_stream)

    def compiler(kernel, arch):
        return CompiledKernel(kernel.name, arch, f"cubin for {kernel.name} {arch}".encode(), "")

    launcher = launch.DriverLauncher(KernelCache(tmp_path, compiler=compiler, nvrtc=(13, 5)))
    return SimpleNamespace(driver=driver, launcher=launcher, spec=spec)


def test_launch_sets_context_loads_once_and_packs_arguments(fake):
    variant = kern.Variant("bfloat16", 16, True)
    h = torch.zeros(5, 16)
    bt = torch.zeros(4, 16)
    out = torch.zeros(5, 16, dtype=torch.bfloat16)
    device = torch.device("cuda", 1)
    args = (h, bt, None, out, 5, 16, 4, 0.5)
    fake.launcher.launch(fake.spec, variant, (3, 2), args, device)
    fake.launcher.launch(fake.spec, variant, (3, 2), args, device)

    kinds = [call[0] for call in fake.driver.calls]
    # loading happens once in the device's context; each launch pushes it only because none is current
    assert kinds == [
        "cuInit",
        "retain",
        "push",
        "load",
        "pop",
        "push",
        "launch",
        "pop",
        "push",
        "launch",
        "pop",
    ]
    assert ("push", "ctx:device1") in fake.driver.calls
    loads = [call for call in fake.driver.calls if call[0] == "load"]
    assert loads == [("load", b"cubin for lora_up sm_90")]  # the device's architecture, loaded once
    _, function, grid, block, shared, stream, values = fake.driver.calls[-2]
    assert function == ("function", b"lora_up") and grid == (3, 2, 1) and block == (128, 1, 1)
    assert shared == 0 and stream == 4242  # the raw handle: no stream object per launch
    assert values == [h.data_ptr(), bt.data_ptr(), None, out.data_ptr(), 5, 16, 4, 0.5]
    assert fake.launcher.target_blocks(device) == 264


def test_launch_error_names_the_call_and_kernel(fake):
    fake.driver.fail_launch = True
    args = (torch.zeros(1, 8), torch.zeros(1, 8), None, torch.zeros(1, 8), 1, 8, 1, 1.0)
    with pytest.raises(
        launch.CudaDriverError,
        match=r"cuLaunchKernel failed \(kernel lora_up float32-r8-aligned grid=\(1, 1\)\): CUDA_ERROR_ILLEGAL_ADDRESS",
    ):
        fake.launcher.launch(
            fake.spec, kern.Variant("float32", 8, True), (1, 1), args, torch.device("cuda", 0)
        )


def test_pack_arguments_checks_the_signature():
    spec = kern.KERNELS["lora_up"]
    with pytest.raises(TypeError, match=r"kernel lora_up takes 8 arguments, got 2"):
        launch.pack_arguments(spec, (None, None))
    with pytest.raises(TypeError, match=r"kernel lora_up parameter h needs a tensor, got 3"):
        launch.pack_arguments(spec, (3, None, None, None, 1, 1, 1, 1.0))


def _current(driver):
    return driver.cuCtxGetCurrent()[1]


@pytest.mark.parametrize("fail", [None, "launch", "load", "argument"])
def test_launch_on_another_device_leaves_the_threads_context_current(fake, fail):
    """A thread working on cuda:0 launches on cuda:1: cuda:0 is current afterwards, whether the launch
    succeeds or raises; nothing is left on the thread's context stack."""
    fake.driver.cuCtxSetCurrent("ctx:device0")
    fake.driver.fail_launch = fail == "launch"
    fake.driver.fail_load = fail == "load"
    rows = 2**31 if fail == "argument" else 1
    args = (torch.zeros(1, 8), torch.zeros(1, 8), None, torch.zeros(1, 8), rows, 8, 1, 1.0)
    variant = kern.Variant("float32", 8, True)
    if fail is None:
        fake.launcher.launch(fake.spec, variant, (1, 1), args, torch.device("cuda", 1))
    else:
        with pytest.raises((launch.CudaDriverError, launch.KernelArgumentRangeError)):
            fake.launcher.launch(fake.spec, variant, (1, 1), args, torch.device("cuda", 1))
    assert _current(fake.driver) == "ctx:device0"
    assert fake.driver.stack() == ["ctx:device0"]
    pushes = [call for call in fake.driver.calls if call[0] == "push"]
    # one push to load the module, one to launch; a bad argument touches no context at all
    assert pushes == [("push", "ctx:device1")] * {"argument": 0, "load": 1}.get(fail, 2)


def test_launch_from_a_thread_without_a_context_leaves_none(fake):
    """Autograd's backward threads start with no current context; a launch must not leave one behind."""
    seen = []

    def work():
        args = (torch.zeros(1, 8), torch.zeros(1, 8), None, torch.zeros(1, 8), 1, 8, 1, 1.0)
        fake.launcher.launch(
            fake.spec, kern.Variant("float32", 8, True), (1, 1), args, torch.device("cuda", 1)
        )
        seen.append(_current(fake.driver))

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert seen == [None]


def test_integer_arguments_outside_their_c_type_are_refused():
    spec = kern.KERNELS["lora_up"]
    args = (None, None, None, None, 2**31, 8, 1, 1.0)
    with pytest.raises(
        launch.KernelArgumentRangeError,
        match=r"kernel lora_up parameter rows=2147483648 does not fit its C type int \(accepted: -2147483648 \.\. 2147483647\)",
    ):
        launch.pack_arguments(spec, args)
    spec = kern.KERNELS["lora_down"]
    ok = (None, None, None, 2**31 - 1, 8, 1, 8, None, 2**32 - 1, 1.0)
    assert launch.pack_arguments(spec, ok)[3].value == 2**31 - 1
    with pytest.raises(
        launch.KernelArgumentRangeError, match=r"parameter threshold=-1 does not fit its C type unsigned"
    ):
        launch.pack_arguments(spec, (*ok[:8], -1, *ok[9:]))


def test_row_counts_past_int32_take_the_plain_composition():
    from loragen.cuda.linear_op import unsupported_reason

    x = torch.zeros(1, 8).expand(2**31, 8)  # 2**31 rows, no memory
    w, a, bb = torch.zeros(4, 8), torch.zeros(2, 8), torch.zeros(4, 2)
    assert (
        unsupported_reason(x, w, None, a, bb)
        == "2**31 or more rows (the kernels take row counts as 32-bit int)"
    )
    assert unsupported_reason(x[: 2**31 - 1], w, None, a, bb) is None


def test_launch_with_the_devices_context_current_pushes_nothing(fake):
    """The common case -- PyTorch's primary context already current on the thread -- launches with no
    context push/pop; the record's parameter block is rewritten with each launch's values."""
    fake.driver.cuCtxSetCurrent("ctx:device0")
    variant = kern.Variant("float32", 8, True)
    device = torch.device("cuda", 0)
    first = (torch.zeros(1, 8), torch.zeros(1, 8), None, torch.zeros(1, 8), 1, 8, 1, 1.0)
    second = (torch.zeros(2, 8), torch.zeros(1, 8), torch.zeros(8), torch.zeros(2, 8), 2, 8, 1, 0.5)
    fake.launcher.launch(fake.spec, variant, (1, 1), first, device)
    fake.driver.calls.clear()
    fake.launcher.launch(fake.spec, variant, (2, 1), second, device)
    assert [call[0] for call in fake.driver.calls] == ["launch"]
    values = fake.driver.calls[0][-1]
    assert values == [
        second[0].data_ptr(),
        second[1].data_ptr(),
        second[2].data_ptr(),
        second[3].data_ptr(),
        2,
        8,
        1,
        0.5,
    ]


def test_bad_arguments_to_a_recorded_kernel_raise_as_before(fake):
    """The fast path's checks word their errors exactly as pack_arguments does."""
    variant = kern.Variant("float32", 8, True)
    good = (torch.zeros(1, 8), torch.zeros(1, 8), None, torch.zeros(1, 8), 1, 8, 1, 1.0)
    fake.launcher.launch(fake.spec, variant, (1, 1), good, torch.device("cuda", 0))
    with pytest.raises(TypeError, match=r"kernel lora_up parameter h needs a tensor, got 3"):
        fake.launcher.launch(fake.spec, variant, (1, 1), (3, *good[1:]), torch.device("cuda", 0))
    with pytest.raises(launch.KernelArgumentRangeError, match=r"parameter rows=2147483648 does not fit"):
        fake.launcher.launch(
            fake.spec, variant, (1, 1), (*good[:4], 2**31, *good[5:]), torch.device("cuda", 0)
        )
    with pytest.raises(TypeError, match=r"kernel lora_up takes 8 arguments, got 2"):
        fake.launcher.launch(fake.spec, variant, (1, 1), good[:2], torch.device("cuda", 0))


_C_VALUES = {
    "int": st.integers(-(2**31), 2**31 - 1),
    "unsigned": st.integers(0, 2**32 - 1),
    "u64": st.integers(0, 2**64 - 1),
    "float": st.floats(width=32, allow_nan=False),
}


@st.composite
def _kernel_arguments(draw: st.DrawFn) -> tuple[kern.KernelSpec, list[object]]:
    spec = draw(st.sampled_from(sorted(kern.KERNELS.values(), key=lambda s: s.name)))
    args: list[object] = []
    for param in spec.params:
        if param.ctype.endswith("*"):
            args.append(draw(st.sampled_from([None, torch.zeros(draw(st.integers(1, 5)))])))
        else:
            args.append(draw(_C_VALUES[param.ctype]))
    return spec, args


@settings(max_examples=60, deadline=None)
@given(_kernel_arguments())
def test_the_parameter_block_holds_each_value_at_its_own_address(case):
    """Each kernel's parameter block, read back through its pointer array as the driver reads it, holds
    exactly the launch's values in their C types (pointers as data pointers, None as 0), whatever the mix
    of 4- and 8-byte parameters."""
    spec, args = case
    record = launch._LaunchRecord(spec, kern.Variant("float32", 16, True), None, None)
    record.fill(args)
    record.fill(args)  # a second fill rewrites in place
    driver = FakeDriver(spec)
    driver.cuLaunchKernel(None, 1, 1, 1, 1, 1, 1, 0, 0, record.params_address, 0)
    read = driver.calls[-1][-1]
    expected = [
        (0 if a is None else a.data_ptr()) if p.ctype.endswith("*") else a for p, a in zip(spec.params, args)
    ]
    assert [v or 0 if p.ctype.endswith("*") else v for p, v in zip(spec.params, read)] == expected


def test_an_unsigned_argument_out_of_range_is_refused_by_the_fast_path():
    variant = kern.Variant("float32", 8, True)
    spec = kern.KERNELS["lora_down"]
    x, a, h = torch.zeros(1, 8), torch.zeros(8, 8), torch.zeros(1, 1, 8)
    good = (x, a, h, 1, 8, 1, 8, None, 0, 1.0)
    record = launch._LaunchRecord(spec, variant, None, None)
    record.fill(good)
    with pytest.raises(
        launch.KernelArgumentRangeError, match=r"parameter threshold=-1 does not fit its C type unsigned"
    ):
        record.fill((*good[:8], -1, 1.0))
