"""SASS checks: every kernel variant, compiled by NVRTC for sm_80 and sm_90, disassembled with nvdisasm.

- no local memory: cuobjdump reports LOCAL 0 and STACK 0, and no LDL/STL instruction exists;
- the intended access widths: a variant for aligned rows (every row a multiple of 8 elements, 16-byte
  aligned pointers) moves its tensors 16 bytes at a time -- at least one 128-bit global load and no
  global load or store narrower than 32 bits, at every rank (issue 16: 2-byte accesses at r = 64 are
  what made the first kernels latency-bound);
- registers as ptxas reported them, and the occupancy they allow at least the blocks per SM that the
  kernel's __launch_bounds__ asks for.

The numbers for every variant are written by ``python -m tests.cuda.sass --json benchmarks/kernel_sass.json``.
Needs cuda-python, NVRTC and the nvdisasm / cuobjdump wheels (all in the [dev] extra); skipped without.
Cubins come from the same pytest cache as tests/cuda/test_cuda_compile.py.
"""

from __future__ import annotations

import json
import math
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from loragen.cuda import kernels as kern
from loragen.cuda.build import KernelCache, render_kernel
from tests.cuda.cuda_emulation import cache_folder
from tests.cuda.rendering import precompile, rendered, selected_params
from tests.cuda.sass import (
    ARCH_LIMITS,
    SassReport,
    analyse,
    instructions,
    load_bytes_before_use,
    loop_load_bytes_before_use,
    loops,
    memory_op,
    occupancy,
    tool,
)

MISSING = [name for name in ("nvdisasm", "cuobjdump") if tool(name) is None]


@pytest.fixture(scope="session")
def cubins(request) -> KernelCache:
    pytest.importorskip("cuda.bindings", reason="cuda-python is not installed (pip install 'loragen[dev]')")
    from loragen.cuda.build import NvrtcUnavailableError, nvrtc_version

    try:
        nvrtc_version()
    except (NvrtcUnavailableError, RuntimeError, OSError) as exc:  # pragma: no cover - installation
        pytest.skip(f"NVRTC cannot load: {exc}")
    if MISSING:
        pytest.skip(
            f"{' and '.join(MISSING)} not found (pip install nvidia-cuda-nvdisasm nvidia-cuda-cuobjdump)"
        )
    cache = KernelCache(cache_folder(request.config, "loragen-cubins"))
    # a cold cache compiles the selected variants ahead, one NVRTC per core, not one by one in the tests
    selected = selected_params(request, test_sass_of_every_variant, "spec", "variant", "arch")
    precompile(cache, [(rendered(spec, variant), arch) for spec, variant, arch in selected])
    return cache


@pytest.fixture(scope="session")
def reports(request, cubins) -> dict[tuple[str, str, str], Future[tuple[SassReport, int]]]:
    """Every selected variant's SASS report and ptxas's register count, disassembled ahead, one nvdisasm
    per core (each takes about half a second; one after another they were most of this file's time).
    Each is a finished future: a variant whose analysis failed fails its own test."""

    def report(spec, variant, arch):
        compiled = cubins.get(render_kernel(spec.name, kern.render_params(spec, variant)), arch)
        ptxas = compiled.resources[spec.name]
        sass = analyse(compiled.cubin, spec.name, arch, spec.threads(variant), ptxas.shared_bytes)
        return sass, ptxas.registers

    selected = selected_params(request, test_sass_of_every_variant, "spec", "variant", "arch")
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return {(s.name, v.label, arch): pool.submit(report, s, v, arch) for s, v, arch in selected}


ALL_VARIANTS = [*kern.all_variants(), *kern.optimizer_variants()]


def check_no_local_memory(report: SassReport, where: str) -> None:
    assert report.local_bytes == 0 and report.stack_bytes == 0, f"{where} uses local memory: {report}"
    assert report.count("local", "load") == report.count("local", "store") == 0, f"{where}: {report.memory}"


@pytest.mark.sass  # disassembles ~200 cubins; NVRTC compiles them first when the cache is cold
@pytest.mark.parametrize("arch", kern.ARCHS)
@pytest.mark.parametrize(
    ("spec", "variant"), ALL_VARIANTS, ids=[f"{s.name}-{v.label}" for s, v in ALL_VARIANTS]
)
def test_sass_of_every_variant(reports, spec, variant, arch):
    report, ptxas_registers = reports[(spec.name, variant.label, arch)].result()
    where = f"{spec.name} {variant.label} on {arch}"
    check_no_local_memory(report, where)
    assert report.registers == ptxas_registers, where  # cuobjdump agrees with ptxas
    wanted = spec.tile(variant)["min_blocks"]
    assert report.occupancy["blocks_per_sm"] >= max(2, wanted), (
        f"{where}: {report.occupancy}, launch bounds want {wanted} (and every kernel at least 2)"
    )
    assert report.registers <= register_bound(arch, spec.threads(variant), max(2, wanted)), where

    if spec.name in kern.KERNELS and variant.aligned:
        narrow = {b for b in report.widths("global", "load") | report.widths("global", "store") if b < 32}
        assert not narrow, (
            f"{where}: {sorted(narrow)}-bit global accesses in an aligned variant: {report.memory}"
        )
        assert report.count("global", "load", 128) > 0, f"{where}: no 16-byte global load: {report.memory}"


def register_bound(arch: str, threads: int, blocks: int) -> int:
    """The most registers per thread that let ``blocks`` blocks of ``threads`` share an SM's register file
    (allocated per warp in units of 256 registers, at most 255 per thread)."""
    warps = blocks * math.ceil(threads / 32)
    per_warp = ARCH_LIMITS[arch]["registers"] // warps // 256 * 256
    return min(255, per_warp // 32)


RECORDED = Path(__file__).resolve().parents[2] / "benchmarks" / "kernel_sass.json"


def test_recorded_sass_table_covers_every_variant_within_its_register_bound():
    """benchmarks/kernel_sass.json (``python -m tests.cuda.sass --json ...``, needs NVRTC) as CI sees it
    without NVRTC: every variant on every architecture, block sizes as the tiles now have them, no local
    memory, and registers that allow the blocks per SM its launch bounds ask for (at least 2)."""
    table = json.loads(RECORDED.read_text())
    rows = {(row["kernel"], row["variant"], row["arch"]): row for row in table["kernels"]}
    for spec, variant in ALL_VARIANTS:
        wanted = max(2, spec.tile(variant)["min_blocks"])
        for arch in kern.ARCHS:
            where = f"{spec.name} {variant.label} {arch}"
            row = rows[(spec.name, variant.label, arch)]
            assert row["threads"] == spec.threads(variant), f"{where}: regenerate benchmarks/kernel_sass.json"
            assert row["local_bytes"] == 0 and row["stack_bytes"] == 0, where
            assert not any(op.startswith("local-") for op in row["memory"]), where
            assert row["registers"] <= register_bound(arch, row["threads"], wanted), where
            assert row["occupancy"]["blocks_per_sm"] >= wanted, where


def test_register_bound():
    assert register_bound("sm_90", 128, 2) == 255
    assert register_bound("sm_90", 128, 3) == 168  # 5 376 registers a warp
    assert register_bound("sm_90", 128, 4) == 128
    assert register_bound("sm_90", 256, 3) == 80
    assert occupancy("sm_90", 256, register_bound("sm_90", 256, 3), 0)["blocks_per_sm"] == 3
    assert occupancy("sm_90", 128, register_bound("sm_90", 128, 3) + 8, 0)["blocks_per_sm"] == 2


# ---- the parser and the occupancy model, on fixed inputs ------------------------------------------------

SASS = """\
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/              @!P0 LDG.E.128.CONSTANT R4, desc[UR8][R2.64] ;
        /*0020*/                   LDG.E.U16 R9, desc[UR8][R2.64+0x10] ;
        /*0030*/                   LDS.64 R10, [R12] ;
        /*0040*/                   FFMA R20, R10, R11, R20 ;
        /*0050*/                   FFMA R21, R6, R9, R21 ;
        /*0060*/                   STL [R1+0x4], R21 ;
        /*0070*/                   STG.E.128 desc[UR8][R14.64], R20 ;
        /*0080*/                   LDG.E R22, desc[UR8][R2.64+0x20] ;
        /*0090*/                   EXIT ;
"""


def test_sass_parser_reads_opcodes_widths_and_spaces():
    code = instructions(SASS)
    assert [op for op, _ in code][:3] == ["LDC", "LDG.E.128.CONSTANT", "LDG.E.U16"] and len(code) == 10
    ops = [memory_op(op) for op, _ in code]
    assert [(o.space, o.kind, o.bits) for o in ops if o is not None] == [
        ("global", "load", 128),
        ("global", "load", 16),
        ("shared", "load", 64),
        ("local", "store", 32),
        ("global", "store", 128),
        ("global", "load", 32),
    ]
    assert memory_op("LDC") is None and memory_op("FFMA") is None and memory_op("LDGSTS.E.128") is None


def test_sass_loads_in_flight_end_at_the_first_use():
    # 16 + 2 bytes issued before FFMA R21 reads R6 (written by the 128-bit load) and R9; then 4 more
    assert load_bytes_before_use(instructions(SASS)) == 18


LOOP = """\
        /*0000*/                   LDG.E.128 R4, desc[UR8][R2.64] ;
        /*0010*/                   LDG.E.128 R8, desc[UR8][R2.64+0x10] ;
.L_x_1:
        /*0020*/                   FFMA R20, R4, R8, R20 ;
        /*0030*/                   LDG.E.128 R4, desc[UR8][R2.64+0x20] ;
        /*0040*/                   LDG.E.128 R8, desc[UR8][R2.64+0x30] ;
        /*0050*/                   LDG.E R12, desc[UR8][R2.64+0x40] ;
        /*0060*/               @P0 BRA `(.L_x_1) ;
        /*0070*/                   EXIT ;
"""


def test_sass_loop_batches_count_loads_carried_over_the_back_branch():
    assert loops(LOOP) == [(2, 6)]
    # the loop issues 16 + 16 + 4 bytes for the next iteration, first used after the back branch
    assert loop_load_bytes_before_use(LOOP) == 36
    assert load_bytes_before_use(instructions(LOOP)) == 36


def test_sass_occupancy_model():
    # 255 registers, 128 threads: 8160 registers a warp -> 2 warps per scheduler, 8 per SM (issue 16)
    assert occupancy("sm_90", 128, 255, 2048) == {
        "blocks_per_sm": 2,
        "warps_per_sm": 8,
        "occupancy": 0.125,
        "limited_by": "registers",
    }
    # 32 registers: the thread limit (2048) binds first at 256 threads per block -> 8 blocks
    assert occupancy("sm_80", 256, 32, 0)["blocks_per_sm"] == 8
    # 100 KB of shared memory: two blocks fit in sm_90's 228 KB, one in sm_80's 164 KB
    assert occupancy("sm_90", 128, 32, 100 * 1024)["blocks_per_sm"] == 2
    assert occupancy("sm_80", 128, 32, 100 * 1024) == {
        "blocks_per_sm": 1,
        "warps_per_sm": 4,
        "occupancy": 0.0625,
        "limited_by": "shared",
    }
