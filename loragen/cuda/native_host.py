"""The CUDA LoRA op's per-call host work in C++ (opt-in: ``LORAGEN_CUDA_NATIVE_HOST=1``).

At batch 1 a training step is bound by the host, and most of a LoRA layer's host work in the eager op is
the Python around its torch calls and launches (docs/performance.md, "The host path"). Here the same passes
as the eager ``torch.autograd.Function`` of :mod:`loragen.cuda.linear_op` run in C++
(``kernels/lora_host.cpp``): a C++ autograd node whose forward and backward call ATen for allocations,
sums and cuBLAS, and the driver's ``cuLaunchKernel`` for the four kernels, on torch's current stream.
The arithmetic is the eager op's, pass by pass, so its results are the eager op's bit for bit.

What stays in Python, once per plan (sizes, dtype, device, launcher, switch): the self-check and routing
of the kernel variant, the grids, loading the modules (:class:`~loragen.cuda.passes.Plan`); its numbers,
the four function handles and the driver's entry points go to the C++ side once
(:func:`plan_id`). Per call Python looks up the plan and the dropout constants (two dictionary lookups)
and calls the op, which checks the inputs against the plan (a call that does not fit takes the Python
path). Under autocast it casts x, weight and bias to the autocast dtype, as the Python path does, and runs
with autocast off.

The op is registered with torch's dispatcher (``torch.ops.loragen_host.lora_linear``). Where Python's
headers are installed the library also has a direct Python entry to the same C++ function, which takes
the arguments as they are instead of matching them against the op's schema and boxing them (about 20 k
host instructions per call, BENCHMARKS.md); it hands a call back to ``torch.ops`` (``NotImplemented``)
wherever ``torch.ops`` would do more than call the op: a tensor subclass that may override
``__torch_function__``, or an active ``TorchFunctionMode``. ``LORAGEN_CUDA_NATIVE_DIRECT_CALL=0``
(:data:`loragen.switches.cuda_native_direct_call`, read at the build) leaves it out.

The library is built on first use with the C++ compiler (``$CXX``, ``c++``, ``g++`` or ``clang++``)
against the installed torch's headers (and Python's, where installed) -- no CUDA toolkit: the driver's
entry points arrive as addresses -- and cached under :func:`loragen.resources.kernel_cache_dir`. Where it
cannot be built the op runs its Python path, with one warning saying why (:func:`status`).

Not taken here (the Python path runs them): the torch path, ``torch.compile``,
empty inputs, and launchers that cannot hand over native kernels (:meth:`native_kernels`). A variant the
self-check passed that fails at a launch raises here (the Python path would move it to the torch path).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from loragen import resources, switches
from loragen.cuda import hostcache
from loragen.cuda.launch import NativeKernels
from loragen.cuda.op_inputs import autocast_anywhere, autocast_dtype

__all__ = [
    "available",
    "kernel_signatures",
    "lora_linear_native",
    "plan_id",
    "status",
    "try_lora_linear",
]

SOURCE = "lora_host.cpp"

_lock = threading.Lock()
_library: list[Path | str] = []  # [the loaded library's path, or why it could not be had], once tried
# Once loaded: [the op's callable, torch.ops.loragen_host.lora_linear.default's own callable]. The first is
# the direct Python entry where the library has one (it returns NotImplemented for a call torch.ops must
# take), else the second again; the overload object's __call__ would be a Python frame that only passes
# its arguments on.
_op: list[Any] = []


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and (found := shutil.which(name)):
            return found
    return None


def _flags() -> list[str]:
    root = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        "-O2",
        "-std=c++20",
        "-fPIC",
        "-shared",
        "-w",  # torch's headers warn about themselves
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f"-I{root / 'include'}",
        f"-I{root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
        f"-L{root / 'lib'}",
        f"-Wl,-rpath,{root / 'lib'}",
    ]


_LIBRARIES = ["-lc10", "-ltorch_cpu", "-ltorch"]


def _python_include() -> Path | None:
    """The folder of Python's headers where they are installed (``Python.h``), else None."""
    include = sysconfig.get_paths().get("include")
    return Path(include) if include and (Path(include) / "Python.h").is_file() else None


def _direct_call_build() -> tuple[list[str], list[str]]:
    """The flags and libraries that build the direct Python entry in (none without Python's headers, or
    with the switch off)."""
    include = _python_include()
    if include is None or not switches.cuda_native_direct_call.get():
        return [], []
    return ["-DLORAGEN_PYTHON_ENTRY", f"-I{include}"], ["-ltorch_python"]


def _build(source: str, compiler: str) -> Path:
    """The built library, from the cache when this source, compiler, flags and torch were built before."""
    flags, libraries = _direct_call_build()
    return resources.build_library(
        resources.kernel_cache_dir() / "host",
        "lora_host",
        SOURCE,
        source,
        [compiler, *_flags(), *flags],
        [*_LIBRARIES, *libraries],
        key=[torch.__version__, sys.platform],
    )


def _direct_entry(path: Path) -> Any:
    """The library's direct Python entry (a new callable), or None where it was built without one."""
    try:
        make = ctypes.PyDLL(str(path)).loragen_host_python_entry
    except AttributeError:
        return None
    make.restype = ctypes.py_object
    return make()


def _load() -> Path | str:
    """Build and load the library once per process; its path, or why it could not be had."""
    with _lock:
        if not _library:
            compiler = _compiler()
            try:
                if compiler is None:
                    raise RuntimeError("no C++ compiler found ($CXX, c++, g++ or clang++)")
                path = _build(resources.read_kernel(SOURCE), compiler)
                torch.ops.load_library(str(path))
                overload = torch.ops.loragen_host.lora_linear.default
                boxed = getattr(overload, "_op", overload)
                direct = _direct_entry(path)
                _op.extend([boxed if direct is None else direct, boxed])
                _library.append(path)
                # its factor cache copies parameters again after every optimizer step, as the Python one
                hostcache.watch_optimizer_steps(torch.ops.loragen_host.optimizer_stepped)
            except (OSError, RuntimeError, subprocess.SubprocessError) as error:
                _library.append(f"the C++ host path could not be built: {error}")
                warnings.warn(
                    f"loragen.cuda: {_library[0]}; LORAGEN_CUDA_NATIVE_HOST=1 falls back to the Python host path",
                    RuntimeWarning,
                    stacklevel=3,
                )
        return _library[0]


def available() -> bool:
    """Whether the C++ host path is built and loaded (builds it on the first call)."""
    return isinstance(_load(), Path)


def status() -> str:
    """``"loaded: <path>"`` (with ``", called directly"`` where the op has its direct Python entry, else
    ``", called through torch.ops"``) or why the C++ host path could not be built (builds it on the first
    call)."""
    found = _load()
    if not isinstance(found, Path):
        return found
    return f"loaded: {found}, called {'through torch.ops' if _op[0] is _op[1] else 'directly'}"


_MISSING = object()
# The C++ side's plan (None: the call cannot run there) per key of what decides it: x's shape, dtype and
# device, the factors' shapes, the layout, the launcher and the kernel switch. An entry is made only after
# a call's inputs passed the Python checks, so :func:`try_lora_linear` runs later calls of a key that has a
# plan without them (the C++ side repeats them in the terms the plan fixes).
_plans: dict[tuple[Any, ...], int | None] = {}


def _key(
    x: Tensor, dtype: torch.dtype, lora_A: Tensor, lora_B: Tensor, fan_in_fan_out: bool, handle: int
) -> tuple[Any, ...]:
    return (
        x.shape,
        dtype,
        x.device,
        lora_A.shape,
        lora_B.shape,
        fan_in_fan_out,
        handle,
        switches.cuda_kernels.get(),
    )


def plan_id(x: Tensor, lora_A: Tensor, lora_B: Tensor, fan_in_fan_out: bool, handle: int) -> int | None:
    """The C++ side's plan for these inputs (which the caller has checked), registered on first use; None
    where the call cannot run there (an empty input, a launcher without native kernels, the library not
    built)."""
    key = _key(x, x.dtype, lora_A, lora_B, fan_in_fan_out, handle)
    found = _plans.get(key, _MISSING)
    if found is _MISSING:
        found = _plans[key] = _register(x, lora_B.shape[0], lora_A.shape[0], handle)
    return found  # type: ignore[return-value]


def _register(x: Tensor, out_features: int, rank: int, handle: int) -> int | None:
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] == 0 or not available():
        return None
    plan = hostcache.plan(x2, out_features, rank, handle)
    native = getattr(plan.launcher, "native_kernels", None)
    kernels: NativeKernels | None = None if native is None else native(plan.variant, plan.device)
    if kernels is None:
        return None
    down, grad_out, grad_in = plan.down_grid, plan.grad_out_grid, plan.grad_in_grid
    sizes = [
        plan.rows,
        plan.in_features,
        plan.out_features,
        plan.rank,
        plan.variant.rank_bucket,
        int(plan.variant.aligned),
        *down.grid,
        down.splits,
        down.cols_per_split,
        *plan.up_grid,
        *grad_out.grid,
        grad_out.col_blocks,
        grad_out.splits,
        grad_out.rows_per_split,
        *grad_in.grid,
        grad_in.splits,
        grad_in.rows_per_split,
    ]
    functions = [value for pair in zip(kernels.functions, kernels.threads) for value in pair]
    return int(torch.ops.loragen_host.register_plan(x2, sizes, functions, list(kernels.driver)))


def lora_linear_native(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    lora_A: Tensor,
    lora_B: Tensor,
    rng: Tensor | None,
    draw_rng: bool,
    plan: int,
    scaling: float,
    dropout_p: float,
    fan_in_fan_out: bool,
) -> Tensor:
    """The eager op through the C++ host path: inputs as :func:`~loragen.cuda.linear_op.lora_linear_cuda`
    takes them once checked, ``plan`` from :func:`plan_id`. With dropout the mask's (seed, offset) is
    ``rng``, or with ``draw_rng`` drawn by the C++ side from the device's generator as
    :func:`~loragen.cuda.op_inputs.draw_rng` draws it (one ``randint`` either way).

    Raises:
        ValueError: the inputs do not fit ``plan`` (nothing ran; the caller takes the Python path).
    """
    rng, threshold, keep_scale = hostcache.dropout_args(rng, dropout_p)
    args = (
        x,
        weight,
        bias,
        lora_A,
        lora_B,
        rng,
        draw_rng,
        plan,
        scaling,
        threshold,
        keep_scale,
        fan_in_fan_out,
    )
    y = _op[0](*args)
    if y is NotImplemented:  # a call torch.ops must take (a tensor subclass, a TorchFunctionMode)
        y = _op[1](*args)
    return y


def try_lora_linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    lora_A: Tensor,
    lora_B: Tensor,
    scaling: float,
    dropout_p: float,
    training: bool,
    fan_in_fan_out: bool,
    seed: int | None,
    handle: int,
) -> Tensor | None:
    """The op on the C++ host path when a call like this one ran there before (:func:`plan_id`) and
    the inputs fit its plan; None otherwise (nothing ran: the caller takes the whole Python path, which
    checks the inputs and words any error). Eager calls only: the caller keeps ``torch.compile`` away.

    Per call this is the hot path of a LoRA layer at small batches, so it does only what the C++ side
    cannot: find the plan, and the dropout constants of a probability some call validated before (the
    C++ side refuses inputs that do not fit the plan). Under autocast the plan is the one of x cast to the
    autocast dtype, which the C++ side casts x, weight and bias to, as the Python path does."""
    cast = autocast_dtype(x) if autocast_anywhere() else None
    plan = _plans.get(_key(x, x.dtype if cast is None else cast, lora_A, lora_B, fan_in_fan_out, handle))
    if plan is None or seed is not None:
        return None
    constants = hostcache.dropout_constants.get(dropout_p)  # checked even where it is not used
    if constants is None:
        return None
    if not training:
        constants = hostcache.dropout_constants[0.0]
    try:
        y = _op[0](
            x, weight, bias, lora_A, lora_B, None, True, plan, float(scaling), *constants, fan_in_fan_out
        )
        if y is NotImplemented:  # a call torch.ops must take (a tensor subclass, a TorchFunctionMode)
            y = _op[1](
                x, weight, bias, lora_A, lora_B, None, True, plan, float(scaling), *constants, fan_in_fan_out
            )
    except ValueError:
        return None
    return y


def kernel_signatures() -> list[str]:
    """The parameter lists the C++ launches fill in (``"lora_down(const scalar_t*,...)"``), for checking
    them against :mod:`loragen.cuda.specs`."""
    if not available():
        raise RuntimeError(status())
    return list(torch.ops.loragen_host.kernel_signatures())
