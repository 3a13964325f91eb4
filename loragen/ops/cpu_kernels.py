"""Compiled CPU kernels for the dropout path of the LoRA op (``kernels/lora_dropout_cpu.c``).

With dropout, each rank-r product that touches x goes through the packed keep-mask. In numpy and
BLAS that is an unpack pass, a masked copy of x and a GEMM, with numpy on one core while the other
idles. The C kernels read the mask bits where they use them, so x is read once per product, no masked
copy exists and both cores work (OpenMP, ``torch.get_num_threads()`` threads):

``masked_down(x, bits, A, scale)``   ``scale * (x * m) A^T``   (N, r)
``masked_grad_a(x, bits, gh)``       ``gh^T (x * m)``          (r, in)
``masked_grad_x(gh, A, bits)``       ``(gh A) * m``            (N, in)

The source is compiled on first use with the C compiler (``$CC``, else ``cc``) as
``-O3 -march=native -fopenmp -shared -fPIC`` and cached on disk in the ``cpu/`` folder of
:func:`loragen.resources.kernel_cache_dir` (``$LORAGEN_CACHE_DIR``, else ``~/.cache/loragen/kernels``),
keyed by the source, the flags, the compiler's version and the CPU's feature flags; the file is written atomically. Without a compiler, when compiling or loading
fails, for dtypes other than float32, or with ``LORAGEN_CPU_KERNELS=0``, :func:`available` is False and
:mod:`loragen.ops` runs its numpy/BLAS path, which computes the same products (results agree to float32
rounding; the masks are the same bits).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch
from torch import Tensor

from loragen import resources, switches

__all__ = [
    "MAX_RANK",
    "SOURCE",
    "available",
    "masked_down",
    "masked_grad_a",
    "masked_grad_x",
    "status",
]

SOURCE = "lora_dropout_cpu.c"
FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-shared", "-fPIC")

_log = logging.getLogger(__name__)
_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_status: str | None = None  # None: not tried yet; "" loaded; otherwise why not


def _cache_dir() -> Path:
    return resources.kernel_cache_dir() / "cpu"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            return next((line for line in info if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")


def _build(source: str, compiler: str) -> Path:
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=60, check=False
    ).stdout
    key = hashlib.sha256(
        "\0".join([source, *FLAGS, version, _cpu_flags(), platform.machine()]).encode()
    ).hexdigest()
    target = _cache_dir() / f"lora_dropout_cpu.{key[:16]}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        src = Path(work) / SOURCE
        src.write_text(source, encoding="utf-8")
        built = Path(work) / target.name
        command = [compiler, *FLAGS, "-o", str(built), str(src)]
        done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} {' '.join(FLAGS)} {SOURCE} failed:\n{done.stderr.strip()}")
        os.replace(built, target)  # atomic: a reader sees the whole library or none
    return target


def _load() -> ctypes.CDLL | None:
    global _library, _status
    with _lock:
        if _status is not None:
            return _library
        try:
            compiler = _compiler()
            if compiler is None:
                raise RuntimeError("no C compiler found ($CC, cc, gcc or clang)")
            library = ctypes.CDLL(str(_build(resources.read_kernel(SOURCE), compiler)))
            i64, ptr, f32, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
            library.lora_masked_down.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, f32, i64, i32]
            library.lora_masked_grad_a.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, i64, i32]
            library.lora_masked_grad_x.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, i64, i32]
            for name in ("lora_masked_down", "lora_masked_grad_a", "lora_masked_grad_x"):
                getattr(library, name).restype = None
            library.lora_kernels_isa.restype = ctypes.c_int
            if library.lora_kernels_isa() != 512:
                raise RuntimeError("the CPU has no AVX-512 (the numpy/BLAS path is as fast without it)")
            _library, _status = library, ""
        except (OSError, RuntimeError, subprocess.SubprocessError) as error:
            _status = str(error)
            _log.info("loragen.ops.cpu_kernels: using the numpy/BLAS dropout path: %s", error)
        return _library


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
    """ "loaded", "disabled", or why the kernels could not be built or loaded (compiles on first call)."""
    if not switches.cpu_kernels.get():
        return "disabled"
    return "loaded" if _load() is not None else str(_status)


def _lib() -> ctypes.CDLL:
    library = _load()
    if library is None:
        raise RuntimeError(f"loragen.ops.cpu_kernels: not available: {_status}")
    return library


def _check(name: str, **tensors: Tensor) -> None:
    for arg, t in tensors.items():
        expected = torch.uint8 if arg == "bits" else torch.float32
        if t.dtype != expected or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(
                f"loragen.ops.cpu_kernels.{name}: {arg} must be a contiguous CPU {expected} tensor, "
                f"got {t.dtype} on {t.device} (contiguous={t.is_contiguous()})"
            )


def _check_bits(name: str, bits: Tensor, numel: int) -> None:
    if bits.numel() * 8 < numel:
        raise ValueError(
            f"loragen.ops.cpu_kernels.{name}: bits has {bits.numel()} bytes for {numel} elements"
        )


def masked_down(x: Tensor, bits: Tensor, lora_A: Tensor, scale: float) -> Tensor:
    """``scale * (x * m) A^T`` for x (N, in), lora_A (r, in) and the packed keep-mask of x: (N, r)."""
    (n, width), r = x.shape, lora_A.shape[0]
    r16 = _rank16(r)
    at = _pad_rank(lora_A.t(), r16)  # (in, r16): a row of A^T is whole vector registers
    _check("masked_down", x=x, bits=bits)
    _check_bits("masked_down", bits, n * width)
    h = torch.empty(n, r16, dtype=torch.float32)
    _lib().lora_masked_down(
        x.data_ptr(),
        bits.data_ptr(),
        at.data_ptr(),
        h.data_ptr(),
        n,
        width,
        r16,
        scale,
        bits.numel(),
        torch.get_num_threads(),
    )
    return h if r16 == r else h[:, :r].contiguous()


def masked_grad_a(x: Tensor, bits: Tensor, gh: Tensor) -> Tensor:
    """``gh^T (x * m)`` for x (N, in), gh (N, r) and the packed keep-mask of x: (r, in)."""
    (n, width), r = x.shape, gh.shape[1]
    r16 = _rank16(r)
    gh = _pad_rank(gh, r16)
    _check("masked_grad_a", x=x, bits=bits, gh=gh)
    _check_bits("masked_grad_a", bits, n * width)
    at = torch.empty(width, r16, dtype=torch.float32)
    _lib().lora_masked_grad_a(
        x.data_ptr(),
        bits.data_ptr(),
        gh.data_ptr(),
        at.data_ptr(),
        n,
        width,
        r16,
        bits.numel(),
        torch.get_num_threads(),
    )
    return at[:, :r].t().contiguous()


def masked_grad_x(gh: Tensor, lora_A: Tensor, bits: Tensor) -> Tensor:
    """``(gh A) * m`` for gh (N, r), lora_A (r, in) and the packed keep-mask of an (N, in) tensor."""
    lora_A = lora_A.contiguous()
    gh = gh.contiguous()
    _check("masked_grad_x", gh=gh, lora_A=lora_A, bits=bits)
    (n, r), width = gh.shape, lora_A.shape[1]
    _check_bits("masked_grad_x", bits, n * width)
    dx = torch.empty(n, width, dtype=torch.float32)
    _lib().lora_masked_grad_x(
        gh.data_ptr(),
        lora_A.data_ptr(),
        bits.data_ptr(),
        dx.data_ptr(),
        n,
        width,
        r,
        bits.numel(),
        torch.get_num_threads(),
    )
    return dx
