"""Rendering a kernel variant's CUDA source, as the launcher does, for tests that read or compile it,
and compiling many of them ahead of the tests that check them one by one."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import pytest

from loragen.cuda import kernels as kern
from loragen.cuda.build import KernelCache, RenderedKernel, render_kernel

__all__ = ["precompile", "rendered", "selected_params"]


def rendered(spec: kern.KernelSpec, variant: kern.Variant) -> RenderedKernel:
    """The CUDA source of ``spec`` at ``variant``."""
    return render_kernel(spec.name, kern.render_params(spec, variant))


def precompile(cache: KernelCache, kernels: Iterable[tuple[RenderedKernel, str]]) -> None:
    """Put every (kernel, architecture) pair into ``cache``'s folder, one NVRTC compile per core.

    A test that walks many variants through ``cache.get`` compiles them one after another on a cold
    cache (the cache compiles under its lock); compiled ahead here in threads (NVRTC releases the GIL
    and is thread-safe), the tests then only read them. Each thread uses a cache object of its own on
    the same folder, whose entries are written atomically: as safe as several processes sharing the
    folder. A memory-only cache gets nothing ahead of time.
    """
    if cache.directory is None:
        return
    folder, version = cache.directory, cache.nvrtc

    def compile_one(pair: tuple[RenderedKernel, str]) -> None:
        KernelCache(folder, nvrtc=version).get(*pair)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for done in [pool.submit(compile_one, pair) for pair in kernels]:
            done.result()


def selected_params(
    request: pytest.FixtureRequest, test: Callable[..., object], *names: str
) -> list[tuple[object, ...]]:
    """The values of parameters ``names`` of every selected (collected, not deselected) item of the test
    function ``test``, so that a fixture prepares only what the session will check."""
    return [
        tuple(item.callspec.params[name] for name in names)
        for item in request.session.items
        if getattr(item, "obj", None) is test and hasattr(item, "callspec")
    ]
