"""Sanitized CPU execution of the CUDA kernels, and planted bugs that show each check fires.

The emulation (tests/cuda/cuda_emulation.h) runs every block's threads as real threads with barriers
ThreadSanitizer understands, blocks in a shuffled order, shared memory poisoned with NaNs before each
block, and 16-byte vector types whose misaligned use is a fatal UBSan error. Here:

- loragen's real kernels run forward and backward under ASan + UBSan and under TSan and must give
  the float64 reference's results with no report;
- small kernels in tests/cuda/fixtures/ are built as written and with a bug planted (-DPLANT_...):
  the clean build passes every check, the planted one is caught -- an insufficient and a missing
  barrier by TSan, a discarded out-of-bounds read (results still right) by ASan, a misaligned float4
  by the alignment trap, a read of unwritten shared memory by the poison, a dependence on block
  order by the shuffle; and the race the old emulation missed (lora_grad_out's double buffer made
  single) is planted in the real kernel and reported by TSan.

Select with ``pytest -k "emulat or sanitiz"``. Builds are cached by content hash (pytest's cache).
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import pytest
import torch

from loragen.cuda import kernels as kern
from loragen.cuda.kernels import Param
from loragen.cuda.linear_op import lora_linear_cuda
from tests.cuda.cuda_emulation import (
    CXX,
    EmulatedLauncher,
    Kernel,
    SanitizerError,
    build,
    cache_folder,
    prebuild,
    run_program,
    variant_of,
)
from tests.cuda.lora_reference import TOLERANCE, make_inputs, mask_for, reference, relative_error

pytestmark = pytest.mark.skipif(CXX is None, reason="g++ is needed to build the emulated kernels")

FIXTURES = Path(__file__).parent / "fixtures"
TSAN_RACE = r"WARNING: ThreadSanitizer: data race"


@pytest.fixture(scope="session")
def folder(request) -> Path:
    return cache_folder(request.config, "loragen-emulated-kernels")


# ---- the real kernels under the sanitizers -------------------------------------------------------------

CASES = [
    # n, k, o, r, dtype, p, fan_in_fan_out: aligned and unaligned variants, every rank-tiling regime
    pytest.param(33, 64, 24, 16, torch.bfloat16, 0.1, False, id="bf16-r16-aligned"),
    pytest.param(29, 45, 37, 5, torch.float32, 0.25, True, id="f32-r8-unaligned-fifo"),
    pytest.param(21, 24, 16, 64, torch.float16, 0.2, False, id="f16-r64-aligned"),
    # tensor cores in every kernel; lora_grad_in's four warps all take rows, then share dA in shared memory
    pytest.param(150, 40, 24, 27, torch.bfloat16, 0.2, False, id="bf16-r32-aligned-mma"),
]


def run_lora(launcher: EmulatedLauncher, n, k, o, r, dtype, p, fifo) -> None:
    """Forward and backward through the CUDA Function with ``launcher``, checked against float64."""
    (x, w, b, a, bb), (xr, wr, br, ar, bbr) = make_inputs(n, k, o, r, dtype, fan_in_fan_out=fifo)
    state = torch.get_rng_state()
    y = lora_linear_cuda(x, w, b, a, bb, 0.7, p, True, fan_in_fan_out=fifo, launcher=launcher)
    want = reference(xr, wr, br, ar, bbr, 0.7, mask_for(state, (n, k), p), fifo)
    assert relative_error(y, want) < TOLERANCE[dtype]
    grad = torch.randn(n, o, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y.backward(grad.to(dtype))
    want.backward(grad)
    for name, got, expected in (("x", x, xr), ("A", a, ar), ("B", bb, bbr), ("bias", b, br)):
        assert relative_error(got.grad, expected.grad) < TOLERANCE[dtype], name


SANITIZERS = ("address", "thread")


@pytest.mark.sanitizers
@pytest.mark.parametrize("sanitizer", SANITIZERS)
@pytest.mark.parametrize(("n", "k", "o", "r", "dtype", "p", "fifo"), CASES)
def test_sanitizers_pass_the_real_kernels(folder, sanitizer, n, k, o, r, dtype, p, fifo):
    launchers = {s: EmulatedLauncher(folder, target_blocks=4, sanitizer=s, block_seed=n) for s in SANITIZERS}
    # every kernel of this variant for both sanitizers at once, one g++ per core (one build each; the
    # other sanitizer's test finds its build in the cache)
    variant = variant_of(k, o, r, dtype)
    prebuild((each, spec, variant) for each in launchers.values() for spec in kern.KERNELS.values())
    launcher = launchers[sanitizer]
    run_lora(launcher, n, k, o, r, dtype, p, fifo)
    assert {name for name, _, _ in launcher.launches} == set(kern.KERNELS)


def test_emulated_results_do_not_depend_on_block_order(folder, monkeypatch):
    """Blocks run shuffled in-process too; the kernels' results are bit for bit the same in any order."""
    launcher = EmulatedLauncher(folder, target_blocks=4)
    results = []
    for seed in (0, 1, 7):
        monkeypatch.setenv("EMU_BLOCK_SEED", str(seed))
        (x, w, b, a, bb), _ = make_inputs(70, 264, 296, 8, torch.float32)
        torch.manual_seed(5)
        y = lora_linear_cuda(x, w, b, a, bb, 0.5, 0.1, True, launcher=launcher)
        y.square().sum().backward()
        results.append([t.detach().clone() for t in (y, x.grad, a.grad, bb.grad)])
    assert any(grid[0] * grid[1] > 1 for _, _, grid in launcher.launches)
    for other in results[1:]:
        for got, want in zip(other, results[0]):
            assert torch.equal(got, want)


# ---- planted bugs in the real kernels -------------------------------------------------------------------


def single_buffer(name: str, source: str) -> str:
    """lora_grad_out with its double-buffered shared partial sums made single (one barrier per step)."""
    if name != "lora_grad_out":
        return source
    planted = re.sub(r"(__shared__\s+float\s+\w+)\[2\]", r"\1[1]", source, count=1)
    planted = planted.replace("buffer ^= 1", "buffer = 0")
    if planted == source:
        pytest.skip("lora_grad_out no longer double-buffers its shared partial sums (nothing to plant)")
    return planted


@pytest.mark.sanitizers
def test_sanitizer_tsan_reports_the_single_buffer_race_in_lora_grad_out(folder):
    """The race issue 16 planted by hand, which passed the old emulation 3 times out of 3."""
    launcher = EmulatedLauncher(folder, target_blocks=1, sanitizer="thread", edit=single_buffer)
    with pytest.raises(SanitizerError, match=TSAN_RACE) as caught:
        run_lora(launcher, 40, 64, 24, 16, torch.float32, 0.0, False)
    assert "lora_grad_out" in str(caught.value) and "kernel.cpp" in caught.value.report


class ForceAligned(EmulatedLauncher):
    """Launches the aligned variant whatever loragen chose: a vector access on rows that are not aligned."""

    def launch(self, spec, variant, grid, args, device):
        super().launch(spec, dataclasses.replace(variant, aligned=True), grid, args, device)


@pytest.mark.sanitizers
def test_sanitizer_traps_misaligned_vector_access_in_the_real_kernels(folder):
    """k = 36 bf16: rows start 72 bytes apart, so the aligned variant's 16-byte loads are misaligned."""
    launcher = ForceAligned(folder, target_blocks=4, sanitizer="address")
    with pytest.raises(SanitizerError, match=r"misaligned address 0x[0-9a-f]+ for type .*16 byte alignment"):
        run_lora(launcher, 9, 36, 16, 16, torch.bfloat16, 0.0, False)


def _at_offset(t: torch.Tensor, elements: int) -> torch.Tensor:
    """A contiguous copy of ``t`` whose data starts ``elements`` elements into its storage: for 16-bit
    dtypes and one element, 2 bytes past a 16-byte boundary."""
    flat = torch.empty(t.numel() + elements, dtype=t.dtype)
    view = flat[elements:].view(t.shape)
    view.copy_(t.detach())
    return view.requires_grad_(t.requires_grad)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["offset", "strided", "offset-3d"])
def test_the_whole_op_hands_the_kernels_aligned_rows_whatever_the_inputs(folder, layout):
    """The host side of the op is part of what is emulated: x, the output gradient and the bias reach an
    aligned variant's 16-byte vector loads aligned, whatever the caller passed -- contiguous tensors at an
    odd storage offset (2 bytes past a 16-byte boundary), strided views, a 3-D x at an offset. Under ASan
    + UBSan a misaligned vector access is a report (:class:`SanitizerError`), so a host side that handed
    such a tensor over as it came fails here; outputs and gradients are held to float64."""
    n, k, o, r, dtype, p = 33, 64, 24, 16, torch.bfloat16, 0.1
    launcher = EmulatedLauncher(folder, target_blocks=4, sanitizer="address", block_seed=n)
    prebuild((launcher, spec, variant_of(k, o, r, dtype)) for spec in kern.KERNELS.values())
    (x, w, b, a, bb), (xr, wr, br, ar, bbr) = make_inputs(n, k, o, r, dtype)
    grad = torch.randn(n, o, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    g = grad.to(dtype)
    if layout == "strided":  # every other row of a taller tensor, every other column of a wider one
        x = torch.zeros(2 * n, 2 * k, dtype=dtype)[::2, ::2].copy_(x.detach()).requires_grad_()
        g = torch.zeros(n, 2 * o, dtype=dtype)[:, ::2].copy_(g)
        b = torch.zeros(2 * o, dtype=dtype)[::2].copy_(b.detach()).requires_grad_()
    else:
        x, g, b = _at_offset(x, 1), _at_offset(g, 1), _at_offset(b, 1)
        assert x.data_ptr() % 16 == 2 and g.data_ptr() % 16 == 2 and b.data_ptr() % 16 == 2
    x_in = x.view(3, 11, k) if layout == "offset-3d" else x
    state = torch.get_rng_state()
    y = lora_linear_cuda(x_in, w, b, a, bb, 0.7, p, True, launcher=launcher)
    want = reference(xr, wr, br, ar, bbr, 0.7, mask_for(state, (n, k), p), False)
    assert relative_error(y.reshape(n, o), want) < TOLERANCE[dtype]
    y.backward(g.view(y.shape))
    want.backward(grad)
    for name, got, expected in (("x", x, xr), ("A", a, ar), ("B", bb, bbr), ("bias", b, br)):
        assert relative_error(got.grad, expected.grad) < TOLERANCE[dtype], name
    assert {name for name, _, _ in launcher.launches} == set(kern.KERNELS)


# ---- planted bugs in small kernels ------------------------------------------------------------------------


def fixture(folder: Path, name: str, params: tuple[Param, ...], sanitizer: str, plant: str | None) -> Path:
    """tests/cuda/fixtures/<name>.cu built for ``sanitizer``, with ``plant`` defined when given."""
    kernel = Kernel(name, params, (FIXTURES / f"{name}.cu").read_text())
    label = f"fixture-{name}-{plant or 'clean'}"
    return build(folder, label, [kernel], sanitizer=sanitizer, defines=[plant] if plant else [])


def floats(*shape: int, seed: int = 0) -> torch.Tensor:
    """Small integers as float32: every sum below is exact, whatever the order."""
    return torch.randint(-8, 9, shape, generator=torch.Generator().manual_seed(seed)).float()


ROW_SUMS = (
    Param("x", "const float*"),
    Param("out", "float*"),
    Param("rows", "int"),
    Param("rows_per_block", "int"),
)


def row_sums(program: Path, seed: int = 1) -> None:
    x, out = floats(24, 128), torch.zeros(24)
    run_program(program, "row_sums", (3, 1), 128, ROW_SUMS, (x, out, 24, 8), block_seed=seed)
    assert torch.equal(out, x.sum(1))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sanitizer_tsan_passes_the_double_buffered_barrier(folder, seed):
    row_sums(fixture(folder, "row_sums", ROW_SUMS, "thread", None), seed)


@pytest.mark.parametrize("plant", ["PLANT_SINGLE_BUFFER", "PLANT_NO_BARRIER"])
def test_sanitizer_tsan_reports_insufficient_or_missing_barrier(folder, plant):
    with pytest.raises(SanitizerError, match=TSAN_RACE) as caught:
        row_sums(fixture(folder, "row_sums", ROW_SUMS, "thread", plant))
    assert "row_sums" in caught.value.report  # the report names the kernel's frames


SCALE4 = (Param("x", "const float*"), Param("out", "float*"), Param("n", "int"))


def scale4(program: Path, n: int = 4 * 70 + 2) -> None:
    x, out = floats(n), torch.zeros(n)
    run_program(program, "scale4", (math.ceil(n / 4 / 32), 1), 32, SCALE4, (x, out, n))
    assert torch.equal(out, 2 * x)  # the planted over-read leaves the results right


def test_sanitizer_asan_reports_a_discarded_out_of_bounds_read(folder):
    scale4(fixture(folder, "scale4", SCALE4, "address", None))
    scale4(fixture(folder, "scale4", SCALE4, "thread", "PLANT_OVERREAD"))  # right results, no report
    with pytest.raises(SanitizerError, match=r"AddressSanitizer: heap-buffer-overflow") as caught:
        scale4(fixture(folder, "scale4", SCALE4, "address", "PLANT_OVERREAD"))
    assert re.search(r"READ of size \d+ .*\n.*in scale4 .*kernel\.cpp:\d+", caught.value.report)


BLOCK_TOTAL = (Param("x", "const float*"), Param("out", "float*"), Param("n", "int"))


def block_total(program: Path, n: int = 300) -> tuple[torch.Tensor, torch.Tensor]:
    x, out = floats(n), torch.zeros(math.ceil(n / 128))
    run_program(program, "block_total", (out.numel(), 1), 128, BLOCK_TOTAL, (x, out, n))
    want = torch.nn.functional.pad(x, (0, 128 * out.numel() - n)).view(-1, 128).sum(1)
    return out, want


def test_sanitizer_asan_reports_a_shared_memory_overread(folder):
    got, want = block_total(fixture(folder, "block_total", BLOCK_TOTAL, "address", None))
    assert torch.equal(got, want)
    # UBSan's bounds check sees the index first; built without it, ASan's red zone around the
    # __shared__ array reports a global-buffer-overflow (-fsanitize-sections=emu_shared)
    found = r"index 128 out of bounds for type 'float \[128\]'|AddressSanitizer: global-buffer-overflow"
    with pytest.raises(SanitizerError, match=found) as caught:
        block_total(fixture(folder, "block_total", BLOCK_TOTAL, "address", "PLANT_SHARED_OVERREAD"))
    assert "in block_total" in caught.value.report


def test_emulation_poisons_shared_memory_before_every_block(folder):
    """Slots no thread wrote hold NaNs, in the first block as in the later ones (no zeros, no leftovers)."""
    program = fixture(folder, "block_total", BLOCK_TOTAL, "address", "PLANT_UNWRITTEN_SHARED")
    got, want = block_total(program, n=256 + 40)  # the last block writes 40 of its 128 slots
    assert torch.equal(got[:2], want[:2]) and torch.isnan(got[2])
    got, _ = block_total(program, n=100)  # a single block
    assert torch.isnan(got).all()


COPY_ROWS = (Param("x", "const float*"), Param("out", "float*"), Param("rows", "int"), Param("cols", "int"))


def copy_rows(program: Path, rows: int, cols: int) -> None:
    x, out = floats(rows, cols), torch.zeros(rows, cols)
    run_program(program, "copy_rows", (rows, 1), 32, COPY_ROWS, (x, out, rows, cols))
    assert torch.equal(out, x)


@pytest.mark.parametrize("sanitizer", ["address", "thread"])
def test_emulation_traps_a_misaligned_vector_access(folder, sanitizer):
    copy_rows(fixture(folder, "copy_rows", COPY_ROWS, sanitizer, None), 5, 6)
    planted = fixture(folder, "copy_rows", COPY_ROWS, sanitizer, "PLANT_MISALIGNED")
    copy_rows(planted, 5, 8)  # rows of 32 bytes: every float4 aligned, nothing to trap
    with pytest.raises(
        SanitizerError,
        match=r"misaligned address 0x[0-9a-f]+ for type 'const (struct )?float4', which requires 16 byte",
    ):
        copy_rows(planted, 5, 6)  # row 1 starts at byte 24


RUNNING_TOTALS = (Param("x", "const float*"), Param("totals", "float*"), Param("per_block", "int"))


def running_totals(program: Path, seed: int) -> bool:
    x, totals = floats(16 * 10), torch.zeros(16)
    run_program(program, "running_totals", (16, 1), 32, RUNNING_TOTALS, (x, totals, 10), block_seed=seed)
    return torch.equal(totals, x.view(16, 10).sum(1).cumsum(0))


def test_emulation_shuffles_blocks(folder):
    clean = fixture(folder, "running_totals", RUNNING_TOTALS, "address", None)
    planted = fixture(folder, "running_totals", RUNNING_TOTALS, "address", "PLANT_BLOCK_ORDER")
    assert all(running_totals(clean, seed) for seed in (0, 1, 2))
    assert running_totals(planted, 0)  # launch order: what the old emulation ran, and it passed
    assert not running_totals(planted, 1) and not running_totals(planted, 2)
