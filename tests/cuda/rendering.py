"""Rendering a kernel variant's CUDA source, as the launcher does, for tests that read or compile it."""

from __future__ import annotations

from loragen.cuda import kernel_variants, specs
from loragen.cuda.render import RenderedKernel, render_kernel

__all__ = ["rendered"]


def rendered(spec: specs.KernelSpec, variant: kernel_variants.Variant) -> RenderedKernel:
    """The CUDA source of ``spec`` at ``variant``."""
    return render_kernel(spec.name, specs.render_params(spec, variant))
