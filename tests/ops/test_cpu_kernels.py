"""The compiled CPU kernels of the dropout path (loragen.ops.cpu_kernels): the products equal a float64
reference for every shape and rank, the op gives the same values and gradients with and without them,
and anything the kernels cannot serve falls back or fails with a message."""

from __future__ import annotations

import platform

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from loragen import ops, switches
from loragen.ops import cpu_kernels

needs_kernels = pytest.mark.skipif(
    not cpu_kernels.available(), reason=f"compiled CPU kernels unavailable: {cpu_kernels.status()}"
)


def _reference(x: torch.Tensor, bits: torch.Tensor, a: torch.Tensor, gh: torch.Tensor):
    n, width = x.shape
    m = ops.unpack_keep_mask(bits, n * width).view(n, width).double()
    xm = x.double() * m
    return xm @ a.double().t(), gh.double().t() @ xm, (gh.double() @ a.double()) * m


@needs_kernels
@given(
    n=st.integers(1, 23),
    width=st.integers(1, 70),
    r=st.sampled_from([1, 3, 8, 15, 16, 17, 32, 48, 64, 100]),
    p=st.sampled_from([0.05, 0.5]),
    generator=st.sampled_from(["bits", "philox"]),
    seed=st.integers(0, 2**32),
)
def test_products_equal_the_float64_reference(n, width, r, p, generator, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    x, a, gh = (
        torch.randn(n, width, generator=g),
        torch.randn(r, width, generator=g),
        torch.randn(n, r, generator=g),
    )
    make = ops.dropout_keep_bits if generator == "bits" else ops.philox_keep_bits
    bits = make(n * width, p, seed)
    h, grad_a, grad_x = _reference(x, bits, a, gh)
    torch.testing.assert_close(
        cpu_kernels.masked_down(x, bits, a, 1.5).double(), 1.5 * h, rtol=1e-5, atol=1e-5
    )
    torch.testing.assert_close(cpu_kernels.masked_grad_a(x, bits, gh).double(), grad_a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cpu_kernels.masked_grad_x(gh, a, bits).double(), grad_x, rtol=1e-5, atol=1e-5)


@needs_kernels
def test_large_shapes_and_one_thread() -> None:
    x, a, gh = torch.randn(1030, 1376), torch.randn(16, 1376), torch.randn(1030, 16)
    bits = ops.dropout_keep_bits(x.numel(), 0.05, 7)
    h, grad_a, grad_x = _reference(x, bits, a, gh)
    previous = torch.get_num_threads()
    for threads in (1, 2):
        torch.set_num_threads(threads)
        try:
            torch.testing.assert_close(
                cpu_kernels.masked_down(x, bits, a, 1.0).double(), h, rtol=1e-4, atol=1e-3
            )
            torch.testing.assert_close(
                cpu_kernels.masked_grad_a(x, bits, gh).double(), grad_a, rtol=1e-4, atol=1e-3
            )
            torch.testing.assert_close(
                cpu_kernels.masked_grad_x(gh, a, bits).double(), grad_x, rtol=1e-4, atol=1e-4
            )
        finally:
            torch.set_num_threads(previous)


@needs_kernels
@pytest.mark.parametrize("rng", ["bits", "philox"])
@pytest.mark.parametrize("bias", [False, True])
def test_the_op_gives_the_same_values_and_gradients_with_and_without_them(rng: str, bias: bool) -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 37, 40, requires_grad=True)
    w = torch.randn(24, 40, requires_grad=True)  # trainable base: every gradient is checked
    b = torch.randn(24, requires_grad=True) if bias else None
    a, bb = torch.randn(16, 40, requires_grad=True), torch.randn(24, 16, requires_grad=True)
    grad = torch.randn(3, 37, 24)
    results = []
    for compiled in (True, False):
        with switches.cpu_kernels.using(compiled):
            y = ops.lora_linear(x, w, b, a, bb, 2.0, 0.2, True, rng=rng, seed=11)
            inputs = [t for t in (x, w, b, a, bb) if t is not None]
            results.append((y, *torch.autograd.grad(y, inputs, grad)))
    for with_kernels, without in zip(*results):
        torch.testing.assert_close(with_kernels, without, rtol=1e-5, atol=1e-5)


def test_switch_and_status() -> None:
    with switches.cpu_kernels.using(False):
        assert not cpu_kernels.available()
        assert cpu_kernels.status() == "disabled"
    assert not cpu_kernels.available(torch.float64)
    assert not cpu_kernels.available(torch.float32, rank=cpu_kernels.MAX_RANK + 1)


@needs_kernels
def test_bad_arguments_are_refused_with_the_argument_named() -> None:
    x, a, gh = torch.randn(4, 8), torch.randn(2, 8), torch.randn(4, 2)
    bits = ops.dropout_keep_bits(32, 0.1, 0)
    with pytest.raises(ValueError, match=r"masked_down: x must be a contiguous CPU torch.float32 tensor"):
        cpu_kernels.masked_down(x.double(), bits, a, 1.0)
    with pytest.raises(ValueError, match=r"masked_grad_a: x must be a contiguous.*contiguous=False"):
        cpu_kernels.masked_grad_a(torch.randn(8, 4).t(), bits, gh)
    with pytest.raises(ValueError, match=r"masked_grad_x: bits has 1 bytes for 32 elements"):
        cpu_kernels.masked_grad_x(gh, a, bits[:1])


def test_a_failing_compiler_is_reported_with_its_output(tmp_path, monkeypatch) -> None:
    compiler = tmp_path / "cc"
    compiler.write_text(
        "#!/bin/sh\n[ \"$1\" = --version ] && exit 0\necho 'error: out of luck' >&2\nexit 1\n"
    )
    compiler.chmod(0o755)
    monkeypatch.setenv("LORAGEN_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(RuntimeError, match=r"lora_dropout_cpu.c failed:\nerror: out of luck"):
        cpu_kernels._build("int x;", str(compiler))
    assert not list((tmp_path / "cache").rglob("*.so"))  # nothing half-written is left to be loaded


@pytest.mark.skipif(cpu_kernels._compiler() is None, reason="no C compiler")
def test_a_build_without_avx512_falls_back_to_the_numpy_path(tmp_path, monkeypatch) -> None:
    # the same source built for a CPU without AVX-512 (x86-64-v3: AVX2, FMA) must compile, say so and be
    # refused, and the op must still run -- on the numpy/BLAS path, with the same masks
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86-64 only")
    flags = tuple("-march=x86-64-v3" if flag == "-march=native" else flag for flag in cpu_kernels.FLAGS)
    monkeypatch.setattr(cpu_kernels, "FLAGS", (*flags, "-mno-avx512f"))
    monkeypatch.setenv("LORAGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_kernels, "_library", None)
    monkeypatch.setattr(cpu_kernels, "_status", None)
    with switches.cpu_kernels.using(True):  # on, also in a run with LORAGEN_CPU_KERNELS=0
        assert cpu_kernels.status() == "the CPU has no AVX-512 (the numpy/BLAS path is as fast without it)"
        assert not cpu_kernels.available()
        assert list((tmp_path / "cache").rglob("*.so"))  # it was built, loaded, asked and refused
        torch.manual_seed(0)
        x, w = torch.randn(5, 24, requires_grad=True), torch.randn(8, 24)
        a, b = torch.randn(4, 24, requires_grad=True), torch.randn(8, 4, requires_grad=True)
        y = ops.lora_linear(x, w, None, a, b, 2.0, 0.25, True, seed=3)
        keep = ops.unpack_keep_mask(ops.dropout_keep_bits(x.numel(), 0.25, 3), x.numel()).view(5, 24)
        expected = x @ w.t() + 2.0 * ((x * keep / 0.75) @ a.t()) @ b.t()
        torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
