"""Compiled-kernel cache: in memory per process, and on disk across processes.

An entry is keyed by the SHA-256 of everything that determines the cubin -- the rendered source, its
headers, the NVRTC options, the target architecture, the NVRTC version and this file's format
version -- so a changed template, a new NVRTC or another GPU never reuses a stale binary. File names
also carry the kernel, variant and architecture so the folder reads like a table of contents:
``lora_down.bfloat16-r16-aligned.sm_90.3f2a...c1.cubin``.

Entry file format: one JSON header line (key, NVRTC version, ptxas log, SHA-256 and size of the cubin)
followed by the raw cubin. Every write goes to a temporary file in the cache folder and is renamed into
place, so readers never see half an entry; an entry that does not parse, whose key differs or whose
checksum fails is deleted (where the folder allows) and rebuilt, never loaded.

The folder is ``$LORAGEN_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/loragen/kernels``, else
``~/.cache/loragen/kernels``. If it cannot be written, compiled kernels are kept in memory only.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

from loragen import resources
from loragen.atomic import atomic_write_bytes
from loragen.cuda.nvrtc import NVRTC_OPTIONS, CompiledKernel, compile_kernel, nvrtc_version, parse_ptxas_log
from loragen.cuda.render import RenderedKernel

__all__ = ["CACHE_FORMAT", "KernelCache", "cache_key", "default_cache", "default_cache_dir"]

CACHE_FORMAT = 1

Compiler = Callable[[RenderedKernel, str], CompiledKernel]


def default_cache_dir() -> Path:
    """Where compiled kernels are stored by default (see the module docstring)."""
    return resources.kernel_cache_dir()


def cache_key(kernel: RenderedKernel, arch: str, nvrtc: tuple[int, int]) -> str:
    """SHA-256 (hex) of everything that determines the cubin of ``kernel`` for ``arch``."""
    material = json.dumps(
        {
            "format": CACHE_FORMAT,
            "name": kernel.name,
            "source": kernel.source,
            "headers": [list(h) for h in kernel.headers],
            "options": list(NVRTC_OPTIONS),
            "arch": arch,
            "nvrtc": list(nvrtc),
        },
        sort_keys=True,
    )
    return hashlib.sha256(material.encode()).hexdigest()


def _file_label(kernel: RenderedKernel) -> str:
    params = dict(kernel.params)
    dtype = {"float": "float32", "f16_t": "float16", "bf16_t": "bfloat16"}.get(params.get("scalar_t", ""), "")
    parts = [kernel.name]
    if dtype and "rank_bucket" in params:
        aligned = "aligned" if params.get("aligned") == "true" else "unaligned"
        parts.append(f"{dtype}-r{params['rank_bucket']}-{aligned}")
    return ".".join(parts)


class KernelCache:
    """Compile-once store of cubins: memory first, then the disk folder, then NVRTC.

    Thread-safe (autograd runs backward on its own threads); safe across processes sharing a folder.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | None,
        *,
        compiler: Compiler = compile_kernel,
        nvrtc: tuple[int, int] | None = None,
    ) -> None:
        """``directory=None`` keeps kernels in memory only; ``nvrtc`` overrides the detected version."""
        self.directory = None if directory is None else Path(directory)
        self._compiler = compiler
        self._nvrtc = nvrtc
        self._memory: dict[str, CompiledKernel] = {}
        self._lock = threading.Lock()
        self.compiles = 0  # how many times NVRTC actually ran (tests and diagnostics)

    @property
    def nvrtc(self) -> tuple[int, int]:
        if self._nvrtc is None:
            self._nvrtc = nvrtc_version()
        return self._nvrtc

    def key(self, kernel: RenderedKernel, arch: str) -> str:
        return cache_key(kernel, arch, self.nvrtc)

    def path(self, kernel: RenderedKernel, arch: str) -> Path | None:
        """The entry's file, or None for a memory-only cache."""
        if self.directory is None:
            return None
        return self.directory / f"{_file_label(kernel)}.{arch}.{self.key(kernel, arch)[:32]}.cubin"

    def get(self, kernel: RenderedKernel, arch: str) -> CompiledKernel:
        """The compiled ``kernel`` for ``arch``, compiling it at most once per key.

        Raises:
            KernelCompileError: NVRTC rejected the kernel (nothing is cached).
        """
        key = self.key(kernel, arch)
        with self._lock:
            hit = self._memory.get(key)
            if hit is not None:
                return hit
            path = self.path(kernel, arch)
            compiled = self._load(path, key, kernel.name, arch) if path is not None else None
            if compiled is None:
                compiled = self._compiler(kernel, arch)
                self.compiles += 1
                if path is not None:
                    self._store(path, key, compiled)
            self._memory[key] = compiled
            return compiled

    # ---- disk entries ----

    def _load(self, path: Path, key: str, name: str, arch: str) -> CompiledKernel | None:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError:
            return None
        newline = data.find(b"\n")
        try:
            if newline < 0:
                raise ValueError("no header line")
            header = json.loads(data[:newline])
            cubin = data[newline + 1 :]
            if header.get("key") != key:
                raise ValueError("key mismatch")
            if header.get("size") != len(cubin) or header.get("sha256") != hashlib.sha256(cubin).hexdigest():
                raise ValueError("checksum mismatch")
            log = str(header.get("log", ""))
        except (ValueError, TypeError, AttributeError):
            # corrupt or foreign: rebuilt by the caller. A folder this process may not change (a shared,
            # read-only cache) keeps the file; the caller's store then finds it cannot write either and
            # keeps the rebuilt kernel in memory.
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
            return None
        return CompiledKernel(name, arch, cubin, log, parse_ptxas_log(log))

    def _store(self, path: Path, key: str, compiled: CompiledKernel) -> None:
        header = {
            "key": key,
            "kernel": compiled.name,
            "arch": compiled.arch,
            "nvrtc": list(self.nvrtc),
            "size": len(compiled.cubin),
            "sha256": hashlib.sha256(compiled.cubin).hexdigest(),
            "log": compiled.log,
        }
        try:
            atomic_write_bytes(path, json.dumps(header).encode() + b"\n" + compiled.cubin)
        except OSError as exc:
            warnings.warn(
                f"loragen.cuda: cannot write the kernel cache in {self.directory} ({exc}); "
                "compiled kernels are kept in memory only. Set LORAGEN_CACHE_DIR to a writable folder.",
                RuntimeWarning,
                stacklevel=3,
            )
            self.directory = None


_default: KernelCache | None = None
_default_lock = threading.Lock()


def default_cache() -> KernelCache:
    """The process-wide cache in :func:`default_cache_dir`."""
    global _default
    with _default_lock:
        if _default is None:
            _default = KernelCache(default_cache_dir())
        return _default
