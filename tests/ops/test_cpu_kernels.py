"""The compiled CPU kernels of the dropout path (loragen.ops.cpu_kernels): every variant's products equal
a float64 reference for every shape and rank, the op applies the generator's mask bit for bit and gives
the same values and gradients on every path (each variant and numpy/BLAS), the variant is chosen by the
CPU's flags, and anything the kernels cannot serve falls back or fails with a message."""

from __future__ import annotations

import contextlib
import dataclasses
import platform
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from loragen import ops, switches
from loragen.ops import cpu_kernels

needs_kernels = pytest.mark.skipif(
    not cpu_kernels.available(), reason=f"compiled CPU kernels unavailable: {cpu_kernels.status()}"
)


def _runs(variant: str) -> bool:
    with switches.cpu_kernels.using(True), switches.cpu_kernel_variant.using(variant):
        return cpu_kernels.available()


# the variants this machine can run (an AVX-512 CPU runs both); the others are skipped, not faked
VARIANTS = [
    pytest.param(v, marks=pytest.mark.skipif(not _runs(v), reason=f"this CPU cannot run the {v} kernels"))
    for v in cpu_kernels.VARIANTS
]
RUNNABLE = [v for v in cpu_kernels.VARIANTS if _runs(v)]
# every path of the op's dropout products: the kernels off, or one variant forced
PATHS = ["numpy", *VARIANTS]


@contextlib.contextmanager
def _path(path: str) -> Iterator[None]:
    if path == "numpy":
        with switches.cpu_kernels.using(False):
            yield
        return
    with switches.cpu_kernels.using(True), switches.cpu_kernel_variant.using(path):
        assert cpu_kernels.variant() == path
        yield


@pytest.fixture
def fresh_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget which variants were built and chosen (restored afterwards), for tests that fake the CPU."""
    monkeypatch.setattr(cpu_kernels, "_built", {})
    monkeypatch.setattr(cpu_kernels, "_chosen", {})


def _reference(x: torch.Tensor, bits: torch.Tensor, a: torch.Tensor, gh: torch.Tensor):
    n, width = x.shape
    m = ops.unpack_keep_mask(bits, n * width).view(n, width).double()
    xm = x.double() * m
    return xm @ a.double().t(), gh.double().t() @ xm, (gh.double() @ a.double()) * m


@pytest.mark.skipif(not RUNNABLE, reason="no kernel variant runs on this CPU")
@given(
    variant=st.sampled_from(RUNNABLE or ["none"]),
    n=st.integers(1, 23),
    width=st.integers(1, 70),
    r=st.sampled_from([1, 3, 8, 15, 16, 17, 32, 48, 64, 100]),
    p=st.sampled_from([0.05, 0.5]),
    seed=st.integers(0, 2**32),
)
def test_products_equal_the_float64_reference(variant, n, width, r, p, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    x, a, gh = (
        torch.randn(n, width, generator=g),
        torch.randn(r, width, generator=g),
        torch.randn(n, r, generator=g),
    )
    bits = ops.dropout_keep_bits(n * width, p, seed)
    h, grad_a, grad_x = _reference(x, bits, a, gh)
    with _path(variant):
        down = cpu_kernels.masked_down(x, bits, a, 1.5)
        da = cpu_kernels.masked_grad_a(x, bits, gh)
        dx = cpu_kernels.masked_grad_x(gh, a, bits)
    torch.testing.assert_close(down.double(), 1.5 * h, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(da.double(), grad_a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx.double(), grad_x, rtol=1e-5, atol=1e-5)
    # exactly zero where dropped, also for inputs that are not finite: a select, not a multiply
    assert not dx[~ops.unpack_keep_mask(bits, n * width).view(n, width)].any()


@pytest.mark.parametrize("variant", VARIANTS)
def test_large_shapes_and_one_thread(variant: str) -> None:
    x, a, gh = torch.randn(1030, 1376), torch.randn(16, 1376), torch.randn(1030, 16)
    bits = ops.dropout_keep_bits(x.numel(), 0.05, 7)
    h, grad_a, grad_x = _reference(x, bits, a, gh)
    previous = torch.get_num_threads()
    for threads in (1, 2):
        torch.set_num_threads(threads)
        try:
            with _path(variant):
                down = cpu_kernels.masked_down(x, bits, a, 1.0)
                da = cpu_kernels.masked_grad_a(x, bits, gh)
                dx = cpu_kernels.masked_grad_x(gh, a, bits)
        finally:
            torch.set_num_threads(previous)
        torch.testing.assert_close(down.double(), h, rtol=1e-4, atol=1e-3)
        torch.testing.assert_close(da.double(), grad_a, rtol=1e-4, atol=1e-3)
        torch.testing.assert_close(dx.double(), grad_x, rtol=1e-4, atol=1e-4)


def _op_results(path: str, bias: bool, p: float = 0.2, seed: int = 11) -> list[torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(3, 37, 40, requires_grad=True)
    w = torch.randn(24, 40, requires_grad=True)  # trainable base: every gradient is checked
    b = torch.randn(24, requires_grad=True) if bias else None
    a, bb = torch.randn(16, 40, requires_grad=True), torch.randn(24, 16, requires_grad=True)
    grad = torch.randn(3, 37, 24)
    inputs = [t for t in (x, w, b, a, bb) if t is not None]
    with _path(path):
        y = ops.lora_linear(x, w, b, a, bb, 2.0, p, True, seed=seed)
        return [y, *torch.autograd.grad(y, inputs, grad)]


@pytest.mark.parametrize("path", VARIANTS)
@pytest.mark.parametrize("bias", [False, True])
def test_the_op_gives_the_same_values_and_gradients_on_every_path(path: str, bias: bool) -> None:
    # float32 sums over 111 rows in different orders (BLAS vs the kernels' row blocks): a few ulps of the
    # largest terms apart
    for kernels, numpy in zip(_op_results(path, bias), _op_results("numpy", bias)):
        torch.testing.assert_close(kernels, numpy, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("path", PATHS)
@given(
    rows=st.integers(1, 40),
    width=st.integers(1, 70),
    r=st.sampled_from([1, 4, 16, 24]),
    p=st.sampled_from([0.01, 0.05, 0.3, 0.9]),
    seed=st.integers(0, 2**63 - 2),
)
def test_every_path_applies_the_generators_mask_and_peft_math(path, rows, width, r, p, seed) -> None:
    # peft's composition y = x W^T + b + s * B(A(dropout(x))) in float64 with the generator's mask is the
    # reference for y and every gradient; with W = 0 the zeros of dx are exactly the dropped elements, so
    # the mask each path applies is the generator's, bit for bit
    g = torch.Generator().manual_seed(seed % 2**32)
    x = torch.randn(rows, width, generator=g, requires_grad=True)
    w = torch.zeros(8, width)
    b = torch.randn(8, generator=g)
    a = torch.randn(r, width, generator=g, requires_grad=True)
    bb = torch.randn(8, r, generator=g, requires_grad=True)
    grad = torch.randn(rows, 8, generator=g)
    with _path(path):
        y = ops.lora_linear(x, w, b, a, bb, 0.5, p, True, seed=seed)
        dx, da, db = torch.autograd.grad(y, (x, a, bb), grad)
    keep = ops.unpack_keep_mask(ops.dropout_keep_bits(x.numel(), p, seed), x.numel()).view(rows, width)
    assert torch.equal(dx != 0, keep)
    x64, a64, b64 = (t.detach().double().requires_grad_() for t in (x, a, bb))
    scale = 1.0 / (1.0 - p)
    y64 = x64 @ w.double().t() + b.double() + 0.5 * ((x64 * keep * scale) @ a64.t()) @ b64.t()
    expected = (y64, *torch.autograd.grad(y64, (x64, a64, b64), grad.double()))
    for got, want in zip((y, dx, da, db), expected):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


def test_switch_and_status() -> None:
    with switches.cpu_kernels.using(False):
        assert not cpu_kernels.available()
        assert cpu_kernels.status() == "disabled"
        assert cpu_kernels.variant() is None
    assert not cpu_kernels.available(torch.float64)
    assert not cpu_kernels.available(torch.float32, rank=cpu_kernels.MAX_RANK + 1)
    with pytest.raises(
        ValueError, match=r"loragen.switches.cpu_kernel_variant='sse2': expected one of 'auto'"
    ):
        with switches.cpu_kernel_variant.using("sse2"):
            pass


AVX512_CPU = frozenset({"sse2", "avx", "avx2", "fma", "avx512f", "avx512bw"})
AVX2_CPU = frozenset({"sse2", "avx", "avx2", "fma"})


@pytest.mark.parametrize(
    ("features", "machine", "requested", "expected"),
    [
        (AVX512_CPU, "x86_64", "auto", ["avx512", "avx2"]),  # best first, the other if it fails
        (AVX2_CPU, "x86_64", "auto", ["avx2"]),
        (AVX2_CPU, "AMD64", "auto", ["avx2"]),
        (frozenset({"sse2", "avx", "avx2"}), "x86_64", "auto", []),  # AVX2 without FMA
        (frozenset({"sse2", "avx"}), "x86_64", "auto", []),
        (AVX512_CPU, "aarch64", "auto", []),  # the flags mean nothing off x86
        (frozenset({"fp", "asimd"}), "aarch64", "auto", []),
        (frozenset(), "x86_64", "auto", ["avx512"]),  # flags unknown: only the self-checking native build
        (AVX512_CPU, "x86_64", "avx2", ["avx2"]),  # forced: that variant alone
        (AVX512_CPU, "x86_64", "avx512", ["avx512"]),
        (AVX2_CPU, "x86_64", "avx512", []),  # forced, but the CPU cannot run it: none, not another
    ],
)
def test_candidates_follow_the_cpu_flags(features, machine, requested, expected) -> None:
    assert [v.name for v in cpu_kernels.candidates(features, machine, requested)] == expected


def test_candidates_refuse_an_unknown_variant() -> None:
    with pytest.raises(ValueError, match=r"variant 'neon'; expected 'auto' or one of 'avx512', 'avx2'"):
        cpu_kernels.candidates(AVX2_CPU, "x86_64", "neon")


def test_cpu_features_reads_the_flags_line() -> None:
    features = cpu_kernels.cpu_features()
    if platform.machine() in ("x86_64", "AMD64") and features:
        assert "sse2" in features  # every x86-64 CPU has it: the line was split into names


@pytest.mark.skipif(cpu_kernels._compiler() is None, reason="no C compiler")
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 only")
@pytest.mark.skipif("avx2" not in RUNNABLE, reason="this CPU cannot run the avx2 kernels")
@pytest.mark.usefixtures("fresh_choice")
def test_a_cpu_without_avx512_gets_the_avx2_kernels(monkeypatch) -> None:
    monkeypatch.setattr(cpu_kernels, "cpu_features", lambda: AVX2_CPU)
    with switches.cpu_kernels.using(True), switches.cpu_kernel_variant.using("auto"):
        assert cpu_kernels.available()
        assert cpu_kernels.variant() == "avx2"
        assert cpu_kernels.status() == "loaded: avx2"
        assert list(cpu_kernels._built) == ["avx2"]  # the AVX-512 build was never tried


@pytest.mark.usefixtures("fresh_choice")
def test_a_variant_that_fails_to_build_gives_way_to_the_next(monkeypatch) -> None:
    opened = []

    def fake_open(variant: cpu_kernels.Variant) -> object:
        opened.append(variant.name)
        if variant.name == "avx512":
            raise RuntimeError("cc -march=native failed: unknown target")
        return object()

    monkeypatch.setattr(cpu_kernels, "cpu_features", lambda: AVX512_CPU)
    monkeypatch.setattr(cpu_kernels.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(cpu_kernels, "_open", fake_open)
    with switches.cpu_kernels.using(True), switches.cpu_kernel_variant.using("auto"):
        assert cpu_kernels.variant() == "avx2"
        assert cpu_kernels.status() == "loaded: avx2"
    with switches.cpu_kernels.using(True), switches.cpu_kernel_variant.using("avx512"):
        assert not cpu_kernels.available()
        assert cpu_kernels.status() == "avx512: cc -march=native failed: unknown target"
        with pytest.raises(RuntimeError, match=r"not available: avx512: cc -march=native failed"):
            cpu_kernels.masked_grad_x(torch.zeros(2, 1), torch.zeros(1, 8), torch.zeros(8, dtype=torch.uint8))
    assert opened == ["avx512", "avx2"]  # each variant built once per process, the failure remembered


@pytest.mark.usefixtures("fresh_choice")
def test_a_forced_variant_the_cpu_cannot_run_leaves_the_numpy_path(monkeypatch) -> None:
    monkeypatch.setattr(cpu_kernels, "cpu_features", lambda: AVX2_CPU)
    monkeypatch.setattr(cpu_kernels.platform, "machine", lambda: "x86_64")
    with switches.cpu_kernels.using(True), switches.cpu_kernel_variant.using("avx512"):
        assert not cpu_kernels.available()
        assert cpu_kernels.status() == "LORAGEN_CPU_KERNEL_VARIANT=avx512: this CPU cannot run it"
    monkeypatch.setattr(cpu_kernels, "cpu_features", lambda: frozenset({"sse2"}))
    with switches.cpu_kernels.using(True), switches.cpu_kernel_variant.using("auto"):
        assert not cpu_kernels.available()
        assert cpu_kernels.status() == "no variant runs on this CPU"


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
    with pytest.raises(
        RuntimeError,
        match=r"-O3 -mavx2 -mfma -mtune=native .* lora_dropout_cpu.c failed:\nerror: out of luck",
    ):
        cpu_kernels._build("int x;", str(compiler), cpu_kernels.VARIANTS["avx2"])
    assert not list((tmp_path / "cache").rglob("*.so"))  # nothing half-written is left to be loaded


@pytest.mark.skipif(cpu_kernels._compiler() is None, reason="no C compiler")
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 only")
@pytest.mark.usefixtures("fresh_choice")
def test_a_build_for_the_wrong_vector_width_is_refused_and_the_op_falls_back(tmp_path, monkeypatch) -> None:
    # the AVX-512 variant built by a compiler that does not target AVX-512 (here: told not to) reports
    # 256-bit vectors; it must be refused, and the op must still run -- on the numpy/BLAS path, with the
    # same masks
    avx512 = cpu_kernels.VARIANTS["avx512"]
    crippled = dataclasses.replace(avx512, flags=(*avx512.flags, "-mno-avx512f"))
    monkeypatch.setitem(cpu_kernels.VARIANTS, "avx512", crippled)
    monkeypatch.setattr(cpu_kernels, "cpu_features", lambda: frozenset({"avx512f"}))  # no AVX2 to fall to
    monkeypatch.setenv("LORAGEN_CACHE_DIR", str(tmp_path / "cache"))
    with switches.cpu_kernels.using(True), switches.cpu_kernel_variant.using("auto"):
        assert cpu_kernels.status() == "avx512: the build targets 256-bit vectors, not 512"
        assert not cpu_kernels.available()
        assert list((tmp_path / "cache").rglob("*.so"))  # it was built, loaded, asked and refused
        torch.manual_seed(0)
        x, w = torch.randn(5, 24, requires_grad=True), torch.randn(8, 24)
        a, b = torch.randn(4, 24, requires_grad=True), torch.randn(8, 4, requires_grad=True)
        y = ops.lora_linear(x, w, None, a, b, 2.0, 0.25, True, seed=3)
        keep = ops.unpack_keep_mask(ops.dropout_keep_bits(x.numel(), 0.25, 3), x.numel()).view(5, 24)
        expected = x @ w.t() + 2.0 * ((x * keep / 0.75) @ a.t()) @ b.t()
        torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)


def test_the_variant_switch_offers_every_build() -> None:
    # the switch sits below ops and names the builds itself; a build added here must be offered there
    assert switches.cpu_kernel_variant.choices == ("auto", *cpu_kernels.VARIANTS)
