"""Compile rendered kernels to cubin with NVRTC (``cuda.bindings.nvrtc``).

NVRTC needs neither a GPU nor a driver, so every kernel variant is compiled in CI. Compiling straight
to machine code (``--gpu-architecture=sm_XX`` and ``nvrtcGetCUBIN``) means the driver never JIT-compiles
PTX at load time. The ptxas report (``--ptxas-options=-v``) is kept with each result, parsed into
registers, stack frame and spill bytes per function, so tests can assert that nothing spills.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import ModuleType

from loragen.cuda.render import RenderedKernel

__all__ = [
    "NVRTC_OPTIONS",
    "CompiledKernel",
    "FunctionResources",
    "KernelCompileError",
    "NvrtcUnavailableError",
    "compile_kernel",
    "nvrtc_version",
    "parse_ptxas_log",
]

# Options shared by every compile; the architecture is added per call. No fast-math: the kernels
# accumulate in float32 and the mask comparison must match the CPU bit for bit.
NVRTC_OPTIONS: tuple[str, ...] = ("--std=c++17", "--ptxas-options=-v")


class NvrtcUnavailableError(ImportError):
    """cuda-python's NVRTC bindings (``pip install -e '.[cuda]'`` from the loragen checkout) are not installed or cannot load."""


class KernelCompileError(RuntimeError):
    """NVRTC rejected a kernel. Carries the kernel, its render parameters, the options and the full log."""

    def __init__(
        self, kernel: RenderedKernel, arch: str, options: tuple[str, ...], log: str, status: str
    ) -> None:
        self.kernel = kernel
        self.arch = arch
        self.options = options
        self.log = log
        params = "\n".join(f"    {k} = {v}" for k, v in kernel.params if k != "variant")
        super().__init__(
            f"NVRTC could not compile kernel {kernel.name} (kernels/{kernel.template}) for {arch}: {status}\n"
            f"  render parameters:\n{params or '    (none)'}\n"
            f"  options: {' '.join(options)}\n"
            f"  NVRTC log:\n{log.rstrip() or '(empty)'}"
        )


@dataclass(frozen=True)
class FunctionResources:
    """What ptxas reported for one function."""

    registers: int
    stack_frame_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int
    shared_bytes: int = 0

    @property
    def spills(self) -> bool:
        return self.spill_store_bytes > 0 or self.spill_load_bytes > 0


@dataclass(frozen=True)
class CompiledKernel:
    """A kernel compiled for one architecture."""

    name: str
    arch: str
    cubin: bytes
    log: str
    resources: Mapping[str, FunctionResources] = field(default_factory=dict)


def _nvrtc() -> ModuleType:
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise NvrtcUnavailableError(
            "loragen.cuda needs cuda-python's NVRTC bindings: pip install -e '.[cuda]' (from the loragen checkout) "
            "(cuda-bindings, nvidia-cuda-nvrtc)"
        ) from exc
    return nvrtc


def _check(nvrtc: ModuleType, result: tuple, what: str) -> tuple:
    status = result[0]
    if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        _, message = nvrtc.nvrtcGetErrorString(status)
        raise RuntimeError(f"loragen.cuda.nvrtc: {what} failed: {message.decode(errors='replace')}")
    return result[1:]


def nvrtc_version() -> tuple[int, int]:
    """The NVRTC library's (major, minor) version.

    Raises:
        NvrtcUnavailableError: cuda-python's NVRTC bindings are missing.
    """
    nvrtc = _nvrtc()
    major, minor = _check(nvrtc, nvrtc.nvrtcVersion(), "nvrtcVersion")
    return int(major), int(minor)


_ENTRY = re.compile(r"Compiling entry function '(?P<name>[^']+)' for '(?P<arch>[^']+)'")
_FRAME = re.compile(
    r"(?P<stack>\d+) bytes stack frame, (?P<stores>\d+) bytes spill stores, (?P<loads>\d+) bytes spill loads"
)
_REGS = re.compile(r"Used (?P<regs>\d+) registers")
_SMEM = re.compile(r"(?P<smem>\d+) bytes smem")


def parse_ptxas_log(log: str) -> dict[str, FunctionResources]:
    """Per-function resources from a ``--ptxas-options=-v`` log (functions ptxas did not report are absent)."""
    found: dict[str, FunctionResources] = {}
    name: str | None = None
    frame: re.Match[str] | None = None
    for line in log.splitlines():
        if entry := _ENTRY.search(line):
            name, frame = entry["name"], None
        elif name is not None and (match := _FRAME.search(line)):
            frame = match
        elif name is not None and frame is not None and (regs := _REGS.search(line)):
            smem = _SMEM.search(line)
            found[name] = FunctionResources(
                registers=int(regs["regs"]),
                stack_frame_bytes=int(frame["stack"]),
                spill_store_bytes=int(frame["stores"]),
                spill_load_bytes=int(frame["loads"]),
                shared_bytes=int(smem["smem"]) if smem else 0,
            )
            name = frame = None
    return found


def compile_kernel(kernel: RenderedKernel, arch: str) -> CompiledKernel:
    """Compile ``kernel`` to a cubin for ``arch`` (e.g. ``"sm_90"``).

    Raises:
        KernelCompileError: NVRTC rejected the source; the message has the kernel name, its render
            parameters, the options and the full NVRTC log.
        NvrtcUnavailableError: cuda-python's NVRTC bindings are missing.
        ValueError: ``arch`` is not of the form ``sm_<digits>``.
    """
    if not re.fullmatch(r"sm_\d+[a-z]?", arch):
        raise ValueError(f"loragen.cuda.nvrtc: arch={arch!r}; expected e.g. 'sm_80' or 'sm_90'")
    nvrtc = _nvrtc()
    options = (*NVRTC_OPTIONS, f"--gpu-architecture={arch}")
    header_names = [name.encode() for name, _ in kernel.headers]
    header_texts = [text.encode() for _, text in kernel.headers]
    (program,) = _check(
        nvrtc,
        nvrtc.nvrtcCreateProgram(
            kernel.source.encode(),
            f"{kernel.name}.cu".encode(),
            len(header_names),
            header_texts,
            header_names,
        ),
        "nvrtcCreateProgram",
    )
    try:
        (status,) = nvrtc.nvrtcCompileProgram(program, len(options), [o.encode() for o in options])
        (log_size,) = _check(nvrtc, nvrtc.nvrtcGetProgramLogSize(program), "nvrtcGetProgramLogSize")
        log_buffer = b" " * log_size
        _check(nvrtc, nvrtc.nvrtcGetProgramLog(program, log_buffer), "nvrtcGetProgramLog")
        log = log_buffer.rstrip(b"\x00").decode(errors="replace")
        if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            _, message = nvrtc.nvrtcGetErrorString(status)
            raise KernelCompileError(kernel, arch, options, log, message.decode(errors="replace"))
        (cubin_size,) = _check(nvrtc, nvrtc.nvrtcGetCUBINSize(program), "nvrtcGetCUBINSize")
        cubin = b" " * cubin_size
        _check(nvrtc, nvrtc.nvrtcGetCUBIN(program, cubin), "nvrtcGetCUBIN")
    finally:
        nvrtc.nvrtcDestroyProgram(program)
    return CompiledKernel(kernel.name, arch, cubin, log, parse_ptxas_log(log))
