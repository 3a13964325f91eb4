"""Run loragen's rendered CUDA kernels on the CPU: g++ builds each variant against cuda_emulation.h.

:class:`EmulatedLauncher` implements loragen.cuda.launch.KernelLauncher for CPU tensors, so the whole
CUDA autograd Function (planning, partial sums, cuBLAS-side addmm) runs unchanged with the kernels
emulated thread by thread. Built libraries are cached by content hash in the given folder.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

import torch

from loragen.cuda.launch import pack_arguments
from loragen.cuda.render import COMMON_HEADER, render_common_header, render_kernel
from loragen.cuda.specs import KernelSpec, Variant, render_params

HEADER = Path(__file__).with_name("cuda_emulation.h")
CXX = shutil.which(os.environ.get("CXX", "g++"))


def _wrapper(spec: KernelSpec) -> str:
    args = ", ".join(f"*reinterpret_cast<{p.ctype}*>(args[{i}])" for i, p in enumerate(spec.params))
    return (
        f'\nextern "C" void run_{spec.name}(void** args, unsigned grid_x, unsigned grid_y, unsigned threads) {{\n'
        f"    emu::launch(grid_x, grid_y, threads, [args] {{ {spec.name}({args}); }});\n}}\n"
    )


class EmulatedLauncher:
    """Launches kernels as host threads; ``target_blocks`` is small so tests exercise split grids."""

    def __init__(self, build_dir: Path, target_blocks: int = 4) -> None:
        self.build_dir = Path(build_dir)
        self.build_dir.mkdir(parents=True, exist_ok=True)
        self._target_blocks = target_blocks
        self._libraries: dict[tuple[str, Variant], ctypes.CDLL] = {}
        self.launches: list[tuple[str, Variant, tuple[int, int]]] = []

    def target_blocks(self, device: torch.device) -> int:
        return self._target_blocks

    def library(self, spec: KernelSpec, variant: Variant) -> ctypes.CDLL:
        lib = self._libraries.get((spec.name, variant))
        if lib is not None:
            return lib
        kernel = render_kernel(spec.name, render_params(spec, variant))
        header = render_common_header()
        source = kernel.source + _wrapper(spec)
        digest = hashlib.sha256((HEADER.read_text() + header + source).encode()).hexdigest()[:20]
        target = self.build_dir / f"{spec.name}.{variant.label}.{digest}.so"
        if not target.exists():
            work = self.build_dir / f"src-{digest}"
            work.mkdir(exist_ok=True)
            (work / COMMON_HEADER).write_text(header)
            (work / "kernel.cpp").write_text(source)
            partial = work / "kernel.so"
            command = [
                str(CXX),
                "-std=c++20",
                "-O1",
                "-w",
                "-shared",
                "-fPIC",
                "-pthread",
                "-include",
                str(HEADER),
                "-I",
                str(work),
                str(work / "kernel.cpp"),
                "-o",
                str(partial),
            ]
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"g++ failed for {spec.name} {variant.label}:\n{done.stderr[-6000:]}")
            os.replace(partial, target)
            shutil.rmtree(work, ignore_errors=True)
        lib = ctypes.CDLL(str(target))
        self._libraries[(spec.name, variant)] = lib
        return lib

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
        run = getattr(self.library(spec, variant), f"run_{spec.name}")
        values = pack_arguments(spec, args)
        pointers = (ctypes.c_void_p * len(values))(*(ctypes.addressof(v) for v in values))
        run(pointers, ctypes.c_uint(grid[0]), ctypes.c_uint(grid[1]), ctypes.c_uint(spec.threads(variant)))
        self.launches.append((spec.name, variant, grid))
