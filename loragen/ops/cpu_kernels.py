"""Compiled CPU kernels for the dropout path of the LoRA ops (``kernels/lora_dropout_cpu.c``): they read the
packed keep-mask bits where they use them (no masked copy of x) on all threads (OpenMP):

``masked_down(x, bits, A, scale)``   ``scale * (x * m) A^T``   (N, r)
``masked_grad_a(x, bits, gh)``       ``gh^T (x * m)``          (r, in)
``masked_grad_x(gh, A, bits)``       ``(gh A) * m``            (N, in)

The source is built, on first use with ``$CC`` (else ``cc``), in the best :data:`VARIANTS` the CPU runs
(``avx512``, else ``avx2``; ``LORAGEN_CPU_KERNEL_VARIANT`` forces one, which is how both are tested on one
machine) and cached under :func:`loragen.resources.kernel_cache_dir`. Without a compiler, for dtypes
other than float32, or with ``LORAGEN_CPU_KERNELS=0``, :func:`available` is False and the ops compute the
same products from the same bits with numpy/BLAS.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import shutil
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from loragen import resources, switches

__all__ = [
    "COMMON_FLAGS",
    "MAX_RANK",
    "SOURCE",
    "VARIANTS",
    "Variant",
    "available",
    "candidates",
    "cpu_features",
    "masked_down",
    "masked_grad_a",
    "masked_grad_x",
    "status",
    "variant",
]

SOURCE = "lora_dropout_cpu.c"
COMMON_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC")
_X86 = frozenset({"x86_64", "amd64", "i686", "i386"})


@dataclass(frozen=True)
class Variant:
    """One build of the kernels: ``name`` (for ``LORAGEN_CPU_KERNEL_VARIANT``), compiler ``flags``, the
    ``isa`` (vector width) its library must report, the ``cpu_flags`` and ``machines`` it needs."""

    name: str
    flags: tuple[str, ...]
    isa: int
    cpu_flags: frozenset[str] = frozenset()
    machines: frozenset[str] = frozenset()


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant("avx512", ("-march=native", "-mprefer-vector-width=512"), 512, frozenset({"avx512f"}), _X86),
        Variant("avx2", ("-mavx2", "-mfma", "-mtune=native"), 256, frozenset({"avx2", "fma"}), _X86),
    )
}


_log = logging.getLogger(__name__)
_lock = threading.Lock()
_built: dict[str, ctypes.CDLL | str] = {}  # variant name -> its library, or why it could not be had
_chosen: dict[str, tuple[Variant | None, str]] = {}  # requested -> (variant, "") or (None, why not)


def _cpu_flags_line() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            return next((line for line in info if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def cpu_features() -> frozenset[str]:
    """This CPU's feature flags as ``/proc/cpuinfo`` names them (``avx2``, ``fma``, ``avx512f``; on
    aarch64 ``asimd`` ...); empty where the file cannot be read."""
    line = _cpu_flags_line()
    return frozenset(line.partition(":")[2].split()) if ":" in line else frozenset()


def candidates(features: frozenset[str], machine: str, requested: str = "auto") -> list[Variant]:
    """The variants to try, best first, on a CPU with ``features`` (:func:`cpu_features`) and
    ``platform.machine()`` ``machine``; ``requested`` (``"auto"`` or a name) keeps that one alone, if the CPU
    runs it. With no flags known only ``avx512`` is tried: its ``-march=native`` build checks itself.

    Raises:
        ValueError: ``requested`` is neither ``"auto"`` nor a variant's name.
    """
    if requested != "auto" and requested not in VARIANTS:
        raise ValueError(
            f"loragen.ops.cpu_kernels: variant {requested!r}; expected 'auto' or one of "
            f"{', '.join(map(repr, VARIANTS))}"
        )
    unknown = not features  # no /proc/cpuinfo: -march=native reports 512 only where it found AVX-512
    runnable = [
        v
        for v in VARIANTS.values()
        if (not v.machines or machine.lower() in v.machines)
        and (v.cpu_flags <= features or (unknown and v.name == "avx512"))
    ]
    return runnable if requested == "auto" else [v for v in runnable if v.name == requested]


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")


def _build(source: str, compiler: str, variant: Variant) -> Path:
    flags = (COMMON_FLAGS[0], *variant.flags, *COMMON_FLAGS[1:])
    return resources.build_library(
        resources.kernel_cache_dir() / "cpu",
        f"lora_dropout_cpu.{variant.name}",
        SOURCE,
        source,
        [compiler, *flags],
        key=[_cpu_flags_line(), platform.machine()],
    )


def _open(variant: Variant) -> ctypes.CDLL:
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C compiler found ($CC, cc, gcc or clang)")
    library = ctypes.CDLL(str(_build(resources.read_kernel(SOURCE), compiler, variant)))
    i64, ptr, f32, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
    library.lora_masked_down.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, f32, i64, i32]
    library.lora_masked_grad_a.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, i64, i32]
    library.lora_masked_grad_x.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, i64, i32]
    for name in ("lora_masked_down", "lora_masked_grad_a", "lora_masked_grad_x"):
        getattr(library, name).restype = None
    library.lora_kernels_isa.restype = ctypes.c_int
    isa = library.lora_kernels_isa()
    if isa != variant.isa:  # e.g. a compiler that ignored or lacks the variant's target flags
        raise RuntimeError(f"the build targets {isa}-bit vectors, not {variant.isa}")
    return library


def _choice() -> Variant | None:
    """The variant in use for the requested one, the first candidate that builds and loads, or None."""
    requested = switches.cpu_kernel_variant.get()
    with _lock:
        if requested not in _chosen:
            tried = candidates(cpu_features(), platform.machine(), requested)
            reasons = []
            for candidate in tried:
                if candidate.name not in _built:  # built and loaded once per process, or why not
                    try:
                        _built[candidate.name] = _open(candidate)
                    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
                        _built[candidate.name] = f"{candidate.name}: {error}"
                library = _built[candidate.name]
                if not isinstance(library, str):
                    _chosen[requested] = (candidate, "")
                    break
                reasons.append(library)
            else:
                if not tried:
                    reasons.append(
                        "no variant runs on this CPU"
                        if requested == "auto"
                        else f"{switches.cpu_kernel_variant.env_var}={requested}: this CPU cannot run it"
                    )
                _chosen[requested] = (None, "; ".join(reasons))
                _log.info("loragen.ops.cpu_kernels: using the numpy/BLAS dropout path: %s", reasons)
        return _chosen[requested][0]


def _load() -> ctypes.CDLL | None:
    chosen = _choice()
    library = None if chosen is None else _built[chosen.name]
    return None if isinstance(library, str) else library


def variant() -> str | None:
    """The name of the variant in use (compiles on first call), or None when the kernels are not."""
    if not switches.cpu_kernels.get():
        return None
    chosen = _choice()
    return None if chosen is None else chosen.name


MAX_RANK = 256


def available(dtype: torch.dtype = torch.float32, rank: int = 16) -> bool:
    """Whether the compiled kernels serve tensors of ``dtype`` (float32 only) and this rank (at most
    :data:`MAX_RANK`); compiles on first call."""
    return (
        switches.cpu_kernels.get() and dtype == torch.float32 and 0 < rank <= MAX_RANK and _load() is not None
    )


def _pad_rank(t: Tensor, r16: int) -> Tensor:
    """(rows, r) -> (rows, r16) contiguous, zero columns appended."""
    if t.shape[1] == r16 and t.is_contiguous():
        return t
    out = torch.zeros(t.shape[0], r16, dtype=t.dtype)
    out[:, : t.shape[1]] = t
    return out


def _rank16(r: int) -> int:
    return (r + 15) // 16 * 16


def status() -> str:
    """ "loaded: <variant>", "disabled", or why no variant could be had (compiles on first call)."""
    if not switches.cpu_kernels.get():
        return "disabled"
    if _load() is None:
        return _chosen[switches.cpu_kernel_variant.get()][1]
    return f"loaded: {variant()}"


def _call(name: str, numel: int, *args: Tensor | int | float, **tensors: Tensor) -> None:
    """Check ``tensors`` (contiguous CPU float32, ``bits`` uint8 covering ``numel``), call ``lora_<name>``."""
    for arg, t in tensors.items():
        expected = torch.uint8 if arg == "bits" else torch.float32
        if t.dtype != expected or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(
                f"loragen.ops.cpu_kernels.{name}: {arg} must be a contiguous CPU {expected} tensor, "
                f"got {t.dtype} on {t.device} (contiguous={t.is_contiguous()})"
            )
    bits = tensors["bits"]
    if bits.numel() * 8 < numel:
        raise ValueError(
            f"loragen.ops.cpu_kernels.{name}: bits has {bits.numel()} bytes for {numel} elements"
        )
    library = _load()
    if library is None:
        raise RuntimeError(f"loragen.ops.cpu_kernels: not available: {status()}")
    values = [a.data_ptr() if isinstance(a, Tensor) else a for a in args]
    getattr(library, f"lora_{name}")(*values, bits.numel(), torch.get_num_threads())


def masked_down(x: Tensor, bits: Tensor, lora_A: Tensor, scale: float) -> Tensor:
    """``scale * (x * m) A^T`` for x (N, in), lora_A (r, in) and the packed keep-mask of x: (N, r)."""
    (n, width), r = x.shape, lora_A.shape[0]
    r16 = _rank16(r)
    at = _pad_rank(lora_A.t(), r16)  # (in, r16): a row of A^T is whole vector registers
    h = torch.empty(n, r16, dtype=torch.float32)
    _call("masked_down", n * width, x, bits, at, h, n, width, r16, scale, x=x, bits=bits)
    return h if r16 == r else h[:, :r].contiguous()


def masked_grad_a(x: Tensor, bits: Tensor, gh: Tensor) -> Tensor:
    """``gh^T (x * m)`` for x (N, in), gh (N, r) and the packed keep-mask of x: (r, in)."""
    (n, width), r = x.shape, gh.shape[1]
    r16 = _rank16(r)
    gh = _pad_rank(gh, r16)
    at = torch.empty(width, r16, dtype=torch.float32)
    _call("masked_grad_a", n * width, x, bits, gh, at, n, width, r16, x=x, bits=bits, gh=gh)
    return at[:, :r].t().contiguous()


def masked_grad_x(gh: Tensor, lora_A: Tensor, bits: Tensor) -> Tensor:
    """``(gh A) * m`` for gh (N, r), lora_A (r, in) and the packed keep-mask of an (N, in) tensor."""
    lora_A, gh = lora_A.contiguous(), gh.contiguous()
    (n, r), width = gh.shape, lora_A.shape[1]
    dx = torch.empty(n, width, dtype=torch.float32)
    _call("masked_grad_x", n * width, gh, lora_A, bits, dx, n, width, r, gh=gh, lora_A=lora_A, bits=bits)
    return dx
