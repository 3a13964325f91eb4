"""Fixtures the CUDA tests share: NVRTC's presence and the on-disk cache of compiled cubins."""

from __future__ import annotations

import pytest

from loragen.cuda.build import KernelCache


@pytest.fixture(scope="session")
def nvrtc_available() -> tuple[int, int]:
    """NVRTC's (major, minor) version; skips the test where cuda-python or NVRTC cannot load."""
    pytest.importorskip("cuda.bindings", reason="cuda-python is not installed (pip install -e '.[cuda]')")
    from loragen.cuda.build import NvrtcUnavailableError, nvrtc_version

    try:
        return nvrtc_version()
    except (NvrtcUnavailableError, RuntimeError, OSError) as exc:  # pragma: no cover - installation
        pytest.skip(f"NVRTC cannot load: {exc}")


@pytest.fixture(scope="session")
def persistent_cache(request, nvrtc_available) -> KernelCache:
    """A kernel cache in pytest's cache folder: later runs recompile only what changed."""
    return KernelCache(request.config.cache.mkdir("loragen-cubins"))
