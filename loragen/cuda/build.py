"""From kernel template to cubin: Jinja rendering, NVRTC compilation and the kernel cache.

``kernels/*.cu.j2`` render with ``StrictUndefined`` and only ``{{ value }}`` substitutions (every
decision is made in :mod:`loragen.cuda.kernels`); NVRTC compiles them without a GPU. Cubins are kept in
memory and on disk, keyed by source, architecture and NVRTC version, written atomically with a checksum.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import threading
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import jinja2
import jinja2.meta

from loragen import resources
from loragen.atomic import atomic_write_bytes

__all__ = [
    "COMMON_HEADER",
    "CompiledKernel",
    "FunctionResources",
    "KernelCache",
    "KernelCompileError",
    "KernelRenderError",
    "NvrtcUnavailableError",
    "RenderedKernel",
    "cache_key",
    "compile_kernel",
    "default_cache",
    "nvrtc_version",
    "parse_ptxas_log",
    "render_common_header",
    "render_kernel",
]

# ---- rendering ---------------------------------------------------------------------------------------

# The header every kernel includes; NVRTC receives it in memory under this name.
COMMON_HEADER = "lora_common.cuh"


class KernelRenderError(ValueError):
    """A kernel template could not be rendered with the given parameters."""


@dataclass(frozen=True)
class RenderedKernel:
    """CUDA C source ready for NVRTC: one ``extern "C"`` kernel plus the headers it includes."""

    name: str  # the kernel function's name
    template: str
    params: tuple[tuple[str, str], ...]  # the substituted values, as C++ text, sorted by name
    source: str
    headers: tuple[tuple[str, str], ...]  # (include name, text)

    @property
    def description(self) -> str:
        """``lora_down(aligned=true, rank_bucket=16, ...)``: names the kernel in errors and logs."""
        shown = ", ".join(f"{k}={v}" for k, v in self.params if k != "variant")
        return f"{self.name}({shown})"


def _cpp_literal(name: str, value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, str)):
        return str(value)
    raise KernelRenderError(
        f"loragen.cuda.build: parameter {name}={value!r} ({type(value).__name__}); expected a bool, int or str"
    )


@functools.lru_cache(maxsize=8)
def _environment(search_path: str | None) -> jinja2.Environment:
    loader: jinja2.BaseLoader = jinja2.FunctionLoader(resources.read_kernel)
    if search_path is not None:  # the caller's folder first, then the shipped templates
        loader = jinja2.ChoiceLoader([jinja2.FileSystemLoader(search_path), loader])
    return jinja2.Environment(
        loader=loader, undefined=jinja2.StrictUndefined, keep_trailing_newline=True, autoescape=False
    )


def _render(
    template: str, name: str, params: Mapping[str, object], search_path: str | None = None
) -> tuple[tuple[tuple[str, str], ...], str]:
    values = {key: _cpp_literal(key, value) for key, value in params.items()}
    env = _environment(search_path)
    try:
        assert env.loader is not None
        used = jinja2.meta.find_undeclared_variables(env.parse(env.loader.get_source(env, template)[0]))
        unused = sorted(set(values) - used)
        if unused:
            raise KernelRenderError(
                f"loragen.cuda.build: kernel {name} (kernels/{template}) does not use parameter(s) "
                f"{', '.join(unused)}; it uses {', '.join(sorted(used)) or 'none'}"
            )
        source = env.get_template(template).render(values)
    except jinja2.UndefinedError as exc:
        raise KernelRenderError(
            f"loragen.cuda.build: kernel {name} (kernels/{template}): {exc.message}; "
            f"parameters given: {', '.join(sorted(values)) or 'none'}"
        ) from exc
    except jinja2.TemplateError as exc:
        where = f"kernels/{template}:{getattr(exc, 'lineno', '?')}"
        raise KernelRenderError(f"loragen.cuda.build: kernel {name} ({where}): {exc}") from exc
    return tuple(sorted(values.items())), source


def render_common_header() -> str:
    """The text of ``lora_common.cuh`` (its template takes no parameters)."""
    return _render(f"{COMMON_HEADER}.j2", COMMON_HEADER, {})[1]


def render_kernel(
    name: str,
    params: Mapping[str, object],
    *,
    template: str | None = None,
    search_path: str | os.PathLike[str] | None = None,
) -> RenderedKernel:
    """Render the ``extern "C"`` kernel ``name`` from ``kernels/<name>.cu.j2`` (or ``template``) with
    ``params`` (bools, ints and strings only), looking in ``search_path`` first where given; the result
    records the parameters for error messages.

    Raises:
        KernelRenderError: a variable is missing, a parameter is unused or has an unsupported type,
            or the template is malformed.
        FileNotFoundError: no such template.
    """
    template = template or f"{name}.cu.j2"
    values, source = _render(template, name, params, None if search_path is None else os.fspath(search_path))
    return RenderedKernel(name, template, values, source, ((COMMON_HEADER, render_common_header()),))


# ---- NVRTC -------------------------------------------------------------------------------------------

# the architecture is added per call; no fast-math: the mask comparison must match the CPU bit for bit
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
        raise RuntimeError(f"loragen.cuda.build: {what} failed: {message.decode(errors='replace')}")
    return result[1:]


def nvrtc_version() -> tuple[int, int]:
    """The NVRTC library's (major, minor) version; :class:`NvrtcUnavailableError` without the bindings."""
    nvrtc = _nvrtc()
    major, minor = _check(nvrtc, nvrtc.nvrtcVersion(), "nvrtc.nvrtcVersion")
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
        raise ValueError(f"loragen.cuda.build: arch={arch!r}; expected e.g. 'sm_80' or 'sm_90'")
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
        "nvrtc.nvrtcCreateProgram",
    )
    try:
        (status,) = nvrtc.nvrtcCompileProgram(program, len(options), [o.encode() for o in options])
        (log_size,) = _check(nvrtc, nvrtc.nvrtcGetProgramLogSize(program), "nvrtc.nvrtcGetProgramLogSize")
        log_buffer = b" " * log_size
        _check(nvrtc, nvrtc.nvrtcGetProgramLog(program, log_buffer), "nvrtc.nvrtcGetProgramLog")
        log = log_buffer.rstrip(b"\x00").decode(errors="replace")
        if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            _, message = nvrtc.nvrtcGetErrorString(status)
            raise KernelCompileError(kernel, arch, options, log, message.decode(errors="replace"))
        (cubin_size,) = _check(nvrtc, nvrtc.nvrtcGetCUBINSize(program), "nvrtc.nvrtcGetCUBINSize")
        cubin = b" " * cubin_size
        _check(nvrtc, nvrtc.nvrtcGetCUBIN(program, cubin), "nvrtc.nvrtcGetCUBIN")
    finally:
        nvrtc.nvrtcDestroyProgram(program)
    return CompiledKernel(kernel.name, arch, cubin, log, parse_ptxas_log(log))


# ---- the kernel cache --------------------------------------------------------------------------------

CACHE_FORMAT = 1


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
    """Compile-once store of cubins: memory first, then the disk folder, then NVRTC. Thread-safe, and
    safe across processes sharing a folder."""

    def __init__(
        self,
        directory: str | os.PathLike[str] | None,
        *,
        compiler: Callable[[RenderedKernel, str], CompiledKernel] = compile_kernel,
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
        """The compiled ``kernel`` for ``arch``, compiling it at most once per key (a
        :class:`KernelCompileError` is not cached)."""
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
            # corrupt or foreign: rebuilt by the caller (a read-only folder keeps the file; the rebuilt
            # kernel then stays in memory)
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


@functools.cache
def default_cache() -> KernelCache:
    """The process-wide cache in :func:`loragen.resources.kernel_cache_dir`."""
    return KernelCache(resources.kernel_cache_dir())
