"""The driver side: modules loaded and kernels launched in PyTorch's primary context, on PyTorch's
current stream, from parameter blocks built once per kernel variant and thread.

Nothing here imports ``cuda.bindings`` before :func:`loragen.cuda.is_available` says a GPU is there.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import struct
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from loragen.cuda.build import KernelCache, default_cache, render_kernel
from loragen.cuda.kernels import Grid, KernelSpec, Variant, render_params
from loragen.errors import LoraError

__all__ = [
    "CudaDriverError",
    "DriverLauncher",
    "KernelArgumentRangeError",
    "capturing",
    "default_launcher",
    "pack_arguments",
    "raw_handle",
]

# ---- streams -----------------------------------------------------------------------------------------


def raw_handle(index: int) -> int:
    """PyTorch's current stream on CUDA device ``index`` as the driver's handle (an int), without building
    a ``torch.cuda.Stream`` object where PyTorch offers the raw handle."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return int(raw(index))
    return int(torch.cuda.current_stream(index).cuda_stream)


def capturing(device: torch.device) -> bool:
    """Whether work queued on ``device``'s current stream is being captured into a CUDA graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


# ---- the driver launcher -----------------------------------------------------------------------------

# each scalar C type's ``struct`` code (native size and alignment, for the parameter block), ctype and,
# for an integer type, the values it holds (ctypes would wrap anything outside silently)
_SCALAR_TYPES: dict[str, tuple[str, type, tuple[int, int] | None]] = {
    "int": ("i", ctypes.c_int, (-(2**31), 2**31 - 1)),
    "unsigned": ("I", ctypes.c_uint, (0, 2**32 - 1)),
    "float": ("f", ctypes.c_float, None),
    "u64": ("Q", ctypes.c_uint64, (0, 2**64 - 1)),
}


class KernelArgumentRangeError(LoraError, OverflowError):
    """An integer kernel argument does not fit its C type (a row count of 2**31 or more for an ``int``)."""


class CudaDriverError(RuntimeError):
    """A CUDA driver call failed; the message names the call, the error and the kernel."""


def pack_arguments(spec: KernelSpec, args: Sequence[object]) -> list[Any]:
    """``args`` as ctypes values in the order of ``spec.params``: tensors (or None) for pointers.

    Raises:
        TypeError: wrong number of arguments, or a non-tensor for a pointer parameter.
        KernelArgumentRangeError: an integer outside its C type's range (ctypes would wrap it silently).
    """
    if len(args) != len(spec.params):
        raise TypeError(
            f"loragen.cuda: kernel {spec.name} takes {len(spec.params)} arguments, got {len(args)}"
        )
    packed: list[Any] = []
    for param, value in zip(spec.params, args):
        if param.ctype.endswith("*"):
            if value is not None and not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"loragen.cuda: kernel {spec.name} parameter {param.name} needs a tensor, got {value!r}"
                )
            packed.append(ctypes.c_void_p(0 if value is None else value.data_ptr()))
            continue
        _, ctype, bounds = _SCALAR_TYPES[param.ctype]
        if bounds is not None and not bounds[0] <= int(value) <= bounds[1]:  # type: ignore[call-overload]
            raise KernelArgumentRangeError(
                f"loragen.cuda: kernel {spec.name} parameter {param.name}={value} does not fit its C type "
                f"{param.ctype} (accepted: {bounds[0]} .. {bounds[1]})"
            )
        packed.append(ctype(value))
    return packed


class _LaunchRecord:
    """One kernel variant ready to launch on one device from one thread: its function, threads per block
    and parameter block (``struct``'s native ``"@"`` layout), with ``pointers`` the ``void**`` to it."""

    __slots__ = (
        "block",
        "context",
        "function",
        "label",
        "layout",
        "params_address",
        "pointer_params",
        "pointers",
        "spec",
        "threads",
    )

    def __init__(self, spec: KernelSpec, variant: Variant, function: Any, context: Any) -> None:
        self.spec = spec
        self.label = variant.label
        self.function = function
        self.context = context
        self.threads = spec.threads(variant)
        codes = ["P" if p.ctype.endswith("*") else _SCALAR_TYPES[p.ctype][0] for p in spec.params]
        self.layout = struct.Struct("@" + "".join(codes))
        self.block = ctypes.create_string_buffer(max(self.layout.size, 1))
        base = ctypes.addressof(self.block)
        # a field's offset: the size of the fields before it plus its alignment padding
        offsets = [
            struct.calcsize("@" + "".join(codes[: i + 1])) - struct.calcsize("@" + code)
            for i, code in enumerate(codes)
        ]
        self.pointers = (ctypes.c_void_p * len(codes))(*(base + offset for offset in offsets))
        self.params_address = ctypes.addressof(self.pointers)
        self.pointer_params = tuple(i for i, code in enumerate(codes) if code == "P")

    def fill(self, args: Sequence[object]) -> None:
        """Write ``args`` into the parameter block; raises as :func:`pack_arguments`."""
        values = list(args)
        try:
            for i in self.pointer_params:
                value = values[i]
                values[i] = 0 if value is None else value.data_ptr()  # type: ignore[attr-defined]
            self.layout.pack_into(self.block, 0, *values)
        except (struct.error, TypeError, AttributeError, IndexError, OverflowError):
            pack_arguments(self.spec, args)  # raises the error naming the parameter
            raise


class DriverLauncher:
    """Launches kernels through the CUDA driver API on PyTorch's current stream; modules are loaded once
    per device and variant. A launch takes no lock and pushes the device's primary context only when it
    is not current."""

    def __init__(self, cache: KernelCache | None = None) -> None:
        self._cache = cache
        self._lock = threading.Lock()
        self._contexts: dict[int, Any] = {}
        self._functions: dict[tuple[int, str, Variant, str], Any] = {}
        # (kernel name, variant, device index, thread id) -> record: each thread fills its own block
        self._records: dict[tuple[str, Variant, int, int], _LaunchRecord] = {}
        # the driver's cuCtxGetCurrent, cuLaunchKernel and CUDA_SUCCESS, looked up with the first record
        self._calls: tuple[Any, Any, Any] = (None, None, None)

    @staticmethod
    def _driver() -> Any:
        from cuda.bindings import driver

        return driver

    def _fail(self, status: Any, call: str, kernel: str = "") -> CudaDriverError:
        driver = self._driver()
        _, name = driver.cuGetErrorName(status)
        _, text = driver.cuGetErrorString(status)
        where = f" (kernel {kernel})" if kernel else ""
        return CudaDriverError(f"loragen.cuda: {call} failed{where}: {name.decode()}: {text.decode()}")

    def _check(self, result: tuple, call: str, kernel: str = "") -> tuple:
        if result[0] != self._driver().CUresult.CUDA_SUCCESS:
            raise self._fail(result[0], call, kernel)
        return result[1:]

    def _context(self, index: int) -> Any:
        """PyTorch's primary context of device ``index`` (retained once, kept for the process)."""
        ctx = self._contexts.get(index)
        if ctx is None:
            torch.cuda.init()  # PyTorch creates the primary context; the driver API then shares it
            driver = self._driver()
            self._check(driver.cuInit(0), "cuInit")
            (device,) = self._check(driver.cuDeviceGet(index), "cuDeviceGet")
            (ctx,) = self._check(driver.cuDevicePrimaryCtxRetain(device), "cuDevicePrimaryCtxRetain")
            self._contexts[index] = ctx
        return ctx

    def target_blocks(self, device: torch.device) -> int:
        return 2 * torch.cuda.get_device_properties(_index(device)).multi_processor_count

    def _function(self, spec: KernelSpec, variant: Variant, index: int) -> Any:
        arch = self.arch(torch.device("cuda", index))
        key = (index, spec.name, variant, arch)
        function = self._functions.get(key)
        if function is None:
            kernel = render_kernel(spec.name, render_params(spec, variant))
            compiled = (self._cache or default_cache()).get(kernel, arch)
            driver = self._driver()
            (module,) = self._check(
                driver.cuModuleLoadData(compiled.cubin), "cuModuleLoadData", kernel.description
            )
            (function,) = self._check(
                driver.cuModuleGetFunction(module, spec.name.encode()),
                "cuModuleGetFunction",
                kernel.description,
            )
            self._functions[key] = function
        return function

    def arch(self, device: torch.device) -> str:
        """The device's architecture as NVRTC names it: ``"sm_90"``."""
        major, minor = torch.cuda.get_device_capability(_index(device))
        return f"sm_{major}{minor}"

    def _record(self, spec: KernelSpec, variant: Variant, index: int, key: tuple) -> _LaunchRecord:
        """Load the variant's module (in the device's context) and build this thread's launch record."""
        with self._lock:
            context = self._context(index)
        with self._current(context, spec.name):
            with self._lock:
                function = self._function(spec, variant, index)
        record = self._records[key] = _LaunchRecord(spec, variant, function, context)
        driver = self._driver()
        self._calls = (driver.cuCtxGetCurrent, driver.cuLaunchKernel, driver.CUresult.CUDA_SUCCESS)
        return record

    def launch(
        self, spec: KernelSpec, variant: Variant, grid: Grid, args: Sequence[object], device: torch.device
    ) -> None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        key = (spec.name, variant, index, threading.get_ident())
        record = self._records.get(key)
        if record is None:
            pack_arguments(spec, args)  # a bad argument changes nothing: checked before any driver call
            record = self._record(spec, variant, index, key)
        record.fill(args)
        get_current, launch_kernel, success = self._calls
        stream = raw_handle(index)
        call = (record.function, *grid, 1, record.threads, 1, 1, 0, stream, record.params_address, 0)
        if get_current()[1] == record.context:
            status = launch_kernel(*call)[0]
        else:  # another context (or none) is current on this thread: push the device's, pop it after
            with self._current(record.context, spec.name):
                status = launch_kernel(*call)[0]
        if status != success:
            raise self._fail(status, "cuLaunchKernel", f"{spec.name} {record.label} grid={grid}")

    @contextlib.contextmanager
    def _current(self, context: Any, kernel: str) -> Iterator[None]:
        """``context`` is current inside; the thread's previous one (or none) again afterwards."""
        driver = self._driver()
        self._check(driver.cuCtxPushCurrent(context), "cuCtxPushCurrent", kernel)
        try:
            yield
        finally:
            self._check(driver.cuCtxPopCurrent(), "cuCtxPopCurrent", kernel)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def default_launcher() -> DriverLauncher:
    """The process-wide :class:`DriverLauncher` (kernels cached in :func:`~loragen.cuda.build.default_cache`)."""
    return DriverLauncher()
