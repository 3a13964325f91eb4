"""A stand-in for ``cuda.bindings.driver`` that records the calls :class:`loragen.cuda.launch.DriverLauncher`
makes: the launch and self-check tests run the host path without a GPU."""

from __future__ import annotations

import ctypes
import threading
from types import SimpleNamespace

from loragen.cuda import kernels as kern

__all__ = ["FakeDriver"]

# how a scalar kernel parameter of each C type is read back from the argument block
_READ = {"int": ctypes.c_int, "unsigned": ctypes.c_uint, "float": ctypes.c_float, "u64": ctypes.c_uint64}


class FakeDriver:
    """The handful of cuda.bindings.driver calls DriverLauncher makes; records them."""

    CUresult = SimpleNamespace(CUDA_SUCCESS=0)

    def __init__(self, spec: kern.KernelSpec) -> None:
        self.spec = spec
        self.calls: list[tuple] = []
        self.fail_launch = False
        self.fail_load = False
        self._threads = threading.local()  # each thread's context stack, as the driver keeps it

    def stack(self) -> list:
        if not hasattr(self._threads, "stack"):
            self._threads.stack = []
        return self._threads.stack

    def cuCtxGetCurrent(self):
        stack = self.stack()
        return (0, stack[-1] if stack else None)

    def cuInit(self, flags):
        self.calls.append(("cuInit",))
        return (0,)

    def cuDeviceGet(self, index):
        return (0, f"device{index}")

    def cuDevicePrimaryCtxRetain(self, device):
        self.calls.append(("retain", device))
        return (0, f"ctx:{device}")

    def cuCtxSetCurrent(self, ctx):
        self.calls.append(("current", ctx))
        stack = self.stack()
        if stack:
            stack[-1] = ctx
        else:
            stack.append(ctx)
        return (0,)

    def cuCtxPushCurrent(self, ctx):
        self.calls.append(("push", ctx))
        self.stack().append(ctx)
        return (0,)

    def cuCtxPopCurrent(self):
        self.calls.append(("pop",))
        stack = self.stack()
        return (0, stack.pop()) if stack else (201, None)

    def cuModuleLoadData(self, image):
        self.calls.append(("load", bytes(image)))
        if self.fail_load:
            return (218, None)
        return (0, "module")

    def cuModuleGetFunction(self, module, name):
        return (0, ("function", name))

    def CUstream(self, handle):
        return ("stream", handle)

    def cuLaunchKernel(self, function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        pointers = (ctypes.c_void_p * len(self.spec.params)).from_address(params)
        values = []
        for param, address in zip(self.spec.params, pointers):
            kind = ctypes.c_void_p if param.ctype.endswith("*") else _READ[param.ctype]
            values.append(kind.from_address(address).value)
        self.calls.append(("launch", function, (gx, gy, gz), (bx, by, bz), shared, stream, values))
        return (700 if self.fail_launch else 0,)

    def cuGetErrorName(self, status):
        return (0, b"CUDA_ERROR_ILLEGAL_ADDRESS")

    def cuGetErrorString(self, status):
        return (0, b"an illegal memory access was encountered")
