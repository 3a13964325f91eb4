"""Run loragen's rendered CUDA kernels on the CPU: g++ builds each variant against cuda_emulation.h.

:class:`EmulatedLauncher` implements loragen.cuda.launch.KernelLauncher for CPU tensors, so the whole
CUDA autograd Function (planning, partial sums, cuBLAS-side addmm) runs unchanged with the kernels
emulated thread by thread. Every build, sanitized or not, runs blocks in a shuffled order with their
shared memory poisoned, and traps misaligned vector accesses (-fsanitize=alignment, fatal).

``sanitizer=None`` loads the kernels into this process. ``"address"`` (ASan + UBSan) and ``"thread"``
(TSan) build emulation_driver.cpp around them and run every launch as its own process, since the
sanitizers' runtimes cannot be loaded into Python: the arguments go through a file, the outputs come
back, and a sanitizer report becomes a :class:`SanitizerError` carrying it.

One build holds all four LoRA kernels of a variant (:func:`translation_unit`): parsing the emulation
header and the standard library takes most of a build's time, so one g++ run per variant instead of
one per kernel makes a cold build about three times cheaper. Builds are cached by content hash (sources,
headers, emulation, driver and flags) in the given folder, and written there atomically.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import struct
import subprocess
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from loragen.cuda.build import render_kernel
from loragen.cuda.kernels import KERNELS, KernelSpec, Param, Variant, rank_bucket, render_params
from loragen.cuda.launch import pack_arguments

HERE = Path(__file__).parent
HEADER = HERE / "cuda_emulation.h"
DRIVER = HERE / "emulation_driver.cpp"
CXX = shutil.which(os.environ.get("CXX", "g++"))

# Every build: C++20, no warnings (the kernels are CUDA C++), misaligned accesses through a typed
# pointer are fatal run-time errors naming the type and the address. The in-process library is optimized
# (-O1: the emulated tests launch it thousands of times). The sanitized programs are not: at -O0 every
# load and store stays in the code, so ASan, UBSan and TSan check at least what they check at -O1, g++
# builds them two to three times faster, and their launches take about as long (the emulation's thread
# switches, not the kernels' arithmetic, dominate them).
COMMON_FLAGS = ("-std=c++20", "-w", "-pthread", "-fsanitize=alignment", "-fno-sanitize-recover=alignment")
SANITIZER_FLAGS: dict[str | None, tuple[str, ...]] = {
    None: ("-O1", "-shared", "-fPIC"),
    "address": (
        "-O0",
        "-g",
        "-fno-omit-frame-pointer",
        "-fsanitize=address,undefined",
        "-fno-sanitize-recover=all",
        "-fsanitize-sections=emu_shared",  # red zones around the __shared__ arrays too
    ),
    "thread": ("-O0", "-g", "-fsanitize=thread"),
}
# Reports stop the run at once with exit code 66; leaks are not the kernels' business.
SANITIZER_ENV = {
    "ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1:exitcode=66:detect_stack_use_after_return=0",
    "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1:exitcode=66",
    "TSAN_OPTIONS": "halt_on_error=1:exitcode=66:report_signal_unsafe=0",
}
SCALARS = {"int": "<i", "unsigned": "<I", "float": "<f", "u64": "<Q"}


class SanitizerError(RuntimeError):
    """An emulated launch failed under a sanitizer; ``report`` is the sanitizer's output."""

    def __init__(self, what: str, report: str) -> None:
        self.report = report
        super().__init__(f"{what}:\n{report[:8000]}")


def cache_folder(config: object, name: str) -> Path:
    """pytest's cache folder ``name``, or one in the temporary folder when the cache plugin is off."""
    cache = getattr(config, "cache", None)
    if cache is not None:
        return Path(cache.mkdir(name))
    folder = Path(tempfile.gettempdir()) / f"{name}-{os.getuid()}"
    folder.mkdir(exist_ok=True)
    return folder


@dataclass(frozen=True)
class Kernel:
    """One kernel of a build: its name, its parameters (in order) and its C++ source."""

    name: str
    params: Sequence[Param]
    source: str


def wrapper(name: str, params: Sequence[Param]) -> str:
    """``extern "C" emu_run_<name>``: unpacks a void* argument array and launches kernel ``name`` emulated."""
    args = ", ".join(f"*reinterpret_cast<{p.ctype}*>(args[{i}])" for i, p in enumerate(params))
    return (
        f'\nextern "C" void emu_run_{name}(void** args, unsigned grid_x, unsigned grid_y, unsigned threads) {{\n'
        f"    emu::launch(grid_x, grid_y, threads, [args] {{ {name}({args}); }});\n}}\n"
    )


def translation_unit(kernels: Sequence[Kernel], headers: Mapping[str, str]) -> str:
    """One C++ file holding ``kernels``: each in a namespace of its own (their constants and typedefs
    have the same names) with its ``emu_run_<name>`` entry point, and ``emu_find(name)`` returning it.

    The headers are included once, at file scope, before the namespaces; each kernel's own
    ``#include`` of them is then empty (``#pragma once``), so their declarations stay shared.

    Raises:
        ValueError: a header without ``#pragma once`` (it would be expanded inside every namespace).
    """
    for name, text in headers.items():
        if "#pragma once" not in text:
            raise ValueError(f"header {name} has no #pragma once; it cannot be shared by merged kernels")
    parts = [f'#include "{name}"\n' for name in sorted(headers)]
    for kernel in kernels:
        namespace = f"emu_kernel_{kernel.name}"
        parts.append(f"namespace {namespace} {{\n{kernel.source}\n{wrapper(kernel.name, kernel.params)}}}\n")
    lookup = "".join(
        f'    if (std::strcmp(name, "{k.name}") == 0) return emu_kernel_{k.name}::emu_run_{k.name};\n'
        for k in kernels
    )
    parts.append('extern "C" emu_entry emu_find(const char* name) {\n' + lookup + "    return nullptr;\n}\n")
    return "".join(parts)


def build(
    build_dir: Path,
    label: str,
    kernels: Sequence[Kernel],
    headers: Mapping[str, str] | None = None,
    sanitizer: str | None = None,
    defines: Sequence[str] = (),
) -> Path:
    """Build ``kernels`` (one translation unit) into a shared library or, sanitized, a driver program.

    Cached by content: unchanged sources, headers, emulation, driver and flags reuse the earlier build.
    The build happens in a temporary folder beside the target and is renamed into place, so concurrent
    builders (threads or pytest processes) never see a partial file.
    """
    if CXX is None:
        raise RuntimeError("g++ is needed to build emulated kernels")
    flags = [*COMMON_FLAGS, *SANITIZER_FLAGS[sanitizer], *(f"-D{d}" for d in defines)]
    driver = DRIVER.read_text() if sanitizer else ""
    headers = dict(headers or {})
    source = translation_unit(kernels, headers)
    parts = [HEADER.read_text(), driver, source, *sorted(headers.items()), *flags]
    digest = hashlib.sha256(repr(parts).encode()).hexdigest()[:20]
    suffix = ".so" if sanitizer is None else f".{sanitizer}.exe"
    target = Path(build_dir) / f"{label}.{digest}{suffix}"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix="build-") as work:
        folder = Path(work)
        for name, text in headers.items():
            (folder / name).write_text(text)
        (folder / "kernel.cpp").write_text(source)
        inputs = [str(folder / "kernel.cpp")] + ([str(DRIVER)] if sanitizer else [])
        partial = folder / "out"
        command = [str(CXX), *flags, "-include", str(HEADER), "-I", str(folder), *inputs, "-o", str(partial)]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"g++ failed for {label} ({sanitizer or 'plain'}):\n{done.stderr[-6000:]}")
        os.replace(partial, target)
    return target


def _buffer(tensor: torch.Tensor) -> bytes:
    return tensor.detach().reshape(-1).view(torch.uint8).numpy().tobytes()


def encode_launch(
    grid: tuple[int, int], threads: int, params: Sequence[Param], args: Sequence[object]
) -> bytes:
    """The launch file emulation_driver.cpp reads (format in its header comment)."""
    out = [b"EMU1", struct.pack("<4I", grid[0], grid[1], threads, len(params))]
    for param, value in zip(params, args, strict=True):
        if param.ctype.endswith("*"):
            if value is None:
                out.append(struct.pack("<I", 2))
                continue
            if not isinstance(value, torch.Tensor) or not value.is_contiguous():
                raise TypeError(f"parameter {param.name}: a contiguous tensor or None, got {value!r}")
            data = _buffer(value)
            out += [struct.pack("<IQQ", 1, value.data_ptr() % 64, len(data)), data]
        else:
            raw = struct.pack(SCALARS[param.ctype], value)
            out += [struct.pack("<II", 0, len(raw)), raw]
    return b"".join(out)


def run_program(
    program: Path,
    kernel: str,
    grid: tuple[int, int],
    threads: int,
    params: Sequence[Param],
    args: Sequence[object],
    *,
    block_seed: int = 1,
    env: Mapping[str, str] | None = None,
    what: str | None = None,
    timeout: float = 600,
) -> str:
    """One launch of ``kernel`` in a sanitized build: non-const tensors receive the kernel's writes.

    Returns the program's stderr. Raises :class:`SanitizerError` on a report (or any failure), and
    also when the kernel wrote to a ``const`` pointer's buffer. ``what`` names the launch in errors
    (default: the kernel's name); ``timeout`` bounds the launch (seconds).
    """
    what = what or kernel
    with tempfile.TemporaryDirectory(prefix="emu-launch-") as work:
        launch_file, output_file = Path(work) / "launch.bin", Path(work) / "output.bin"
        launch_file.write_bytes(encode_launch(grid, threads, params, args))
        environment = {**os.environ, **SANITIZER_ENV, "EMU_BLOCK_SEED": str(block_seed), **(env or {})}
        done = subprocess.run(
            [str(program), kernel, str(launch_file), str(output_file)],
            capture_output=True,
            text=True,
            env=environment,
            timeout=timeout,
            check=False,
        )
        if done.returncode != 0:
            raise SanitizerError(f"{what} exited with {done.returncode}", done.stderr)
        output = output_file.read_bytes()
    offset = 0
    for param, value in zip(params, args):
        if isinstance(value, torch.Tensor) and param.ctype.endswith("*"):
            size = value.numel() * value.element_size()
            data = output[offset : offset + size]
            offset += size
            if param.ctype.startswith("const"):
                if data != _buffer(value):
                    raise SanitizerError(f"{what} wrote to const parameter {param.name}", done.stderr)
            elif size:
                flat = value.detach().reshape(-1).view(torch.uint8)
                flat.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    return done.stderr


def kernel_source(spec: KernelSpec, variant: Variant) -> tuple[Kernel, dict[str, str]]:
    """The rendered kernel, and the headers it includes."""
    rendered = render_kernel(spec.name, render_params(spec, variant))
    return Kernel(spec.name, spec.params, rendered.source), dict(rendered.headers)


def variant_of(in_features: int, out_features: int, rank: int, dtype: torch.dtype) -> Variant:
    """The variant loragen.cuda.kernels.Plan picks for these sizes (tests prebuild it)."""
    name = str(dtype).removeprefix("torch.")
    aligned = in_features % 8 == 0 and out_features % 8 == 0
    return Variant(name, rank_bucket(rank), aligned)


def build_group(spec: KernelSpec) -> tuple[KernelSpec, ...]:
    """The kernels built together with ``spec``: all four LoRA kernels (they share their variants), or
    ``spec`` alone (the optimizer's kernel)."""
    return tuple(KERNELS.values()) if spec.name in KERNELS else (spec,)


def prebuild(builds: Iterable[tuple[EmulatedLauncher, KernelSpec, Variant]]) -> None:
    """Make each launcher's build of each (spec, variant), one g++ per core: a cold cache builds in
    parallel what the tests would otherwise build one after another. Pairs that share a build (the four
    LoRA kernels of one variant, for one launcher) are built once."""
    distinct = {
        (id(launcher), build_group(spec), variant): (launcher, spec, variant)
        for launcher, spec, variant in builds
    }
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for done in [
            pool.submit(launcher.program, spec, variant) for launcher, spec, variant in distinct.values()
        ]:
            done.result()


class EmulatedLauncher:
    """Launches kernels as host threads; ``target_blocks`` is small so tests exercise split grids.

    With ``sanitizer`` ("address" or "thread") each launch is a sanitized process of its own, its
    blocks shuffled with ``block_seed`` (in-process launches read EMU_BLOCK_SEED, default 1), given
    ``timeout`` seconds. ``edit(kernel name, source)`` may change a rendered kernel before it is built
    (planted bugs).
    """

    def __init__(
        self,
        build_dir: Path,
        target_blocks: int = 4,
        sanitizer: str | None = None,
        block_seed: int = 1,
        edit: Callable[[str, str], str] | None = None,
        timeout: float = 600,
    ) -> None:
        if sanitizer not in SANITIZER_FLAGS:
            raise ValueError(f"sanitizer={sanitizer!r}; expected one of {list(SANITIZER_FLAGS)}")
        self.build_dir = Path(build_dir)
        self.sanitizer = sanitizer
        self.block_seed = block_seed
        self.edit = edit
        self.timeout = timeout
        self._target_blocks = target_blocks
        self._builds: dict[tuple[tuple[str, ...], Variant], Path] = {}
        self._libraries: dict[Path, ctypes.CDLL] = {}
        self.launches: list[tuple[str, Variant, tuple[int, int]]] = []

    def target_blocks(self, device: torch.device) -> int:
        return self._target_blocks

    def program(self, spec: KernelSpec, variant: Variant) -> Path:
        """The build holding ``spec`` for ``variant`` (a library, or a driver program when sanitized)."""
        group = build_group(spec)
        key = (tuple(s.name for s in group), variant)
        if key not in self._builds:
            kernels, headers = [], {}
            for member in group:
                kernel, included = kernel_source(member, variant)
                if self.edit is not None:
                    kernel = Kernel(kernel.name, kernel.params, self.edit(kernel.name, kernel.source))
                kernels.append(kernel)
                headers.update(included)
            label = f"{spec.name if len(group) == 1 else 'lora'}.{variant.label}"
            self._builds[key] = build(self.build_dir, label, kernels, headers, self.sanitizer)
        return self._builds[key]

    def prebuild(self, pairs: Iterable[tuple[KernelSpec, Variant]]) -> None:
        """Build several variants at once (see :func:`prebuild`)."""
        prebuild((self, spec, variant) for spec, variant in pairs)

    def launch(
        self,
        spec: KernelSpec,
        variant: Variant,
        grid: tuple[int, int],
        args: Sequence[object],
        device: torch.device,
    ) -> None:
        for value in args:
            if isinstance(value, torch.Tensor) and not value.is_contiguous():
                raise AssertionError(f"{spec.name}: non-contiguous tensor argument")
        program = self.program(spec, variant)
        threads = spec.threads(variant)
        if self.sanitizer is not None:
            what = f"{spec.name} {variant.label} grid={grid} under {self.sanitizer}"
            run_program(
                program,
                spec.name,
                grid,
                threads,
                spec.params,
                args,
                block_seed=self.block_seed,
                what=what,
                timeout=self.timeout,
            )
        else:
            if program not in self._libraries:
                self._libraries[program] = ctypes.CDLL(str(program))
            values = pack_arguments(spec, args)
            pointers = (ctypes.c_void_p * len(values))(*(ctypes.addressof(v) for v in values))
            run = getattr(self._libraries[program], f"emu_run_{spec.name}")
            run(pointers, ctypes.c_uint(grid[0]), ctypes.c_uint(grid[1]), ctypes.c_uint(threads))
        self.launches.append((spec.name, variant, grid))
