"""loragen.philox: Philox4x32-10 known answers, the documented mask layout, and agreement with the
device code in kernels/lora_common.cuh.j2 (built on the host against tests/cuda_emulation.h)."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loragen import philox

M32 = 0xFFFFFFFF


def philox_scalar(counter: tuple[int, int, int, int], key: tuple[int, int]) -> tuple[int, int, int, int]:
    """Philox4x32-10 written out with Python ints, straight from the paper's definition."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for round_index in range(10):
        if round_index:
            k0, k1 = (k0 + 0x9E3779B9) & M32, (k1 + 0xBB67AE85) & M32
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & M32, (p0 >> 32) ^ c3 ^ k1, p0 & M32
    return c0, c1, c2, c3


def keep_scalar(index: int, p: float, seed: int, offset: int) -> bool:
    """Element ``index``'s keep bit, per the layout documented in loragen/philox.py."""
    words = philox_scalar(
        (index // 8 & M32, index // 8 >> 32, offset & M32, offset >> 32), (seed & M32, seed >> 32)
    )
    lane = index % 8
    bits = (words[lane // 2] >> (16 * (lane % 2))) & 0xFFFF
    return bits >= round(p * 65536)


# Random123's kat_vectors: counter, key -> output.
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((M32, M32, M32, M32), (M32, M32), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize(("counter", "key", "expected"), KNOWN_ANSWERS)
def test_known_answers(counter, key, expected):
    out = philox.philox4x32_10(torch.tensor([counter], dtype=torch.int64), key)
    assert tuple(out[0].tolist()) == expected
    assert philox_scalar(counter, key) == expected


words = st.integers(0, M32)


@given(st.lists(st.tuples(words, words, words, words), min_size=1, max_size=16), st.tuples(words, words))
def test_vectorised_matches_scalar(counters, key):
    out = philox.philox4x32_10(torch.tensor(counters, dtype=torch.int64), key)
    assert [tuple(row) for row in out.tolist()] == [philox_scalar(c, key) for c in counters]


@given(
    rows=st.integers(1, 9),
    cols=st.integers(1, 23),
    p=st.floats(0.0, 0.95),
    seed=st.integers(0, 2**64 - 1),
    offset=st.integers(0, 2**64 - 1),
)
def test_mask_follows_documented_layout(rows, cols, p, seed, offset):
    mask = philox.dropout_keep_mask((rows, cols), p, seed, offset)
    assert mask.shape == (rows, cols) and mask.dtype == torch.bool
    expected = [keep_scalar(i, p, seed, offset) for i in range(rows * cols)]
    assert mask.reshape(-1).tolist() == expected


def test_keep_fraction_and_independence():
    p = 0.3
    mask = philox.dropout_keep_mask((400, 250), p, seed=1234)
    assert abs(mask.float().mean().item() - (1 - p)) < 0.01
    other_seed = philox.dropout_keep_mask((400, 250), p, seed=1235)
    other_offset = philox.dropout_keep_mask((400, 250), p, seed=1234, offset=1)
    # independent masks agree on about p^2 + (1-p)^2 = 58% of the elements
    for other in (other_seed, other_offset):
        assert abs((mask == other).float().mean().item() - 0.58) < 0.02
    assert torch.equal(mask, philox.dropout_keep_mask((400, 250), p, seed=1234))


def test_no_dropout_keeps_everything():
    assert philox.dropout_keep_mask((5, 7), 0.0, seed=99).all()
    assert philox.keep_threshold(0.0) == 0 and philox.keep_scale(0.0) == 1.0
    assert philox.keep_threshold(0.1) == 6554 and philox.keep_scale(0.5) == 2.0


def test_random_seed_follows_torch_manual_seed():
    torch.manual_seed(5)
    first = [philox.random_seed() for _ in range(3)]
    torch.manual_seed(5)
    assert [philox.random_seed() for _ in range(3)] == first
    assert all(0 <= s < 2**63 for s in first) and len(set(first)) == 3
    generator = torch.Generator().manual_seed(5)
    assert philox.random_seed(generator) == first[0]


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5])
def test_bad_probability(p):
    with pytest.raises(ValueError, match=r"loragen\.philox: dropout probability p=.*expected 0 <= p < 1"):
        philox.dropout_keep_mask((3,), p, seed=1)


def test_bad_seed_offset_and_inputs():
    with pytest.raises(ValueError, match=r"seed=-1; expected an unsigned 64-bit integer"):
        philox.dropout_keep_mask((3,), 0.5, seed=-1)
    with pytest.raises(ValueError, match=r"offset=18446744073709551616; expected an unsigned 64-bit"):
        philox.dropout_keep_mask((3,), 0.5, seed=1, offset=2**64)
    with pytest.raises(ValueError, match=r"counter must be int64 of shape \(\.\.\., 4\)"):
        philox.philox4x32_10(torch.zeros(2, 3, dtype=torch.int64), (0, 0))
    with pytest.raises(ValueError, match=r"key words must be in \[0, 2\*\*32\)"):
        philox.philox4x32_10(torch.zeros(1, 4, dtype=torch.int64), (2**32, 0))


# ---- the kernels' device code, built on the host ----------------------------------------------------

HARNESS = r"""
#include "lora_common.cuh"
using namespace loragen;
extern "C" void keep_bits(u64 seed, u64 offset, unsigned threshold, u64 first, int count, int n, unsigned* out) {
    const Dropout d{seed, offset, threshold, 1.0f};
    for (int i = 0; i < n; ++i) out[i] = keep_bits_span(d, first + 8 * static_cast<u64>(i), count);
}
"""


@pytest.fixture(scope="module")
def device_mask_code(tmp_path_factory) -> ctypes.CDLL:
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("g++ is needed to build the kernels' mask code on the host")
    from loragen.cuda.build import COMMON_HEADER, render_common_header

    work = tmp_path_factory.mktemp("philox_device")
    (work / COMMON_HEADER).write_text(render_common_header())
    (work / "harness.cpp").write_text(HARNESS)
    emulation = Path(__file__).parent / "cuda" / "cuda_emulation.h"
    subprocess.run(
        [
            cxx,
            "-std=c++20",
            "-O1",
            "-w",
            "-shared",
            "-fPIC",
            "-pthread",
            "-include",
            str(emulation),
            "-I",
            str(work),
            str(work / "harness.cpp"),
            "-o",
            str(work / "harness.so"),
        ],
        check=True,
        capture_output=True,
    )
    lib = ctypes.CDLL(str(work / "harness.so"))
    lib.keep_bits.argtypes = [
        ctypes.c_uint64,
        ctypes.c_uint64,
        ctypes.c_uint,
        ctypes.c_uint64,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.POINTER(ctypes.c_uint),
    ]
    return lib


@pytest.mark.parametrize("start", [0, 3, 8 * 1000 + 5])
@pytest.mark.parametrize("count", [1, 5, 8])
def test_device_mask_code_matches_cpu(device_mask_code, start, count):
    p, seed, offset, n = 0.37, 2**63 + 12345, 7, 64
    out = (ctypes.c_uint * n)()
    device_mask_code.keep_bits(seed, offset, philox.keep_threshold(p), start, count, n, out)
    cpu = philox.dropout_keep_mask((start + 8 * n + 8,), p, seed, offset)
    for i in range(n):
        first = start + 8 * i
        expected = sum(int(cpu[first + e]) << e for e in range(count))
        assert out[i] == expected, f"group starting at element {first}"


@settings(max_examples=60, deadline=None)
@given(
    start=st.integers(0, 2**40),
    numel=st.integers(1, 300),
    p=st.floats(0.01, 0.95),
    seed=st.integers(0, 2**64 - 1),
    offset=st.integers(0, 2**64 - 1),
)
def test_rng_keep_mask_is_the_documented_mask_from_any_element(start, numel, p, seed, offset):
    """Any span of the mask read from an rng tensor, including spans starting mid-group and counters past
    2**32 groups, is the documented layout at its true position."""
    threshold = philox.keep_threshold(p)
    got = philox.rng_keep_mask(philox.rng_tensor(seed, offset, "cpu"), start, numel, threshold)
    assert got.shape == (numel,) and got.dtype == torch.bool
    first = start // 8 * 8
    groups = torch.arange(first // 8, (start + numel + 7) // 8, dtype=torch.int64)
    counter = torch.stack(
        [
            groups & 0xFFFFFFFF,
            groups >> 32,
            torch.full_like(groups, offset & 0xFFFFFFFF),
            torch.full_like(groups, offset >> 32),
        ],
        dim=-1,
    )
    words = philox.philox4x32_10(counter, (seed & 0xFFFFFFFF, seed >> 32))
    lanes = torch.arange(8)
    bits = (words[:, lanes // 2] >> (16 * (lanes % 2))) & 0xFFFF
    assert torch.equal(got, (bits >= threshold).reshape(-1)[start - first : start - first + numel])


@pytest.mark.parametrize(("rows", "cols"), [(1, 1), (3, 5), (17, 40), (64, 8)])
def test_rng_keep_mask_in_row_blocks_is_the_whole_mask(rows, cols):
    seed, offset, p = 2**64 - 3, 2**63 + 11, 0.3
    rng = philox.rng_tensor(seed, offset, "cpu")
    want = philox.dropout_keep_mask((rows, cols), p, seed, offset).reshape(-1)
    assert torch.equal(philox.rng_keep_mask(rng, 0, rows * cols, philox.keep_threshold(p)), want)
    for begin in range(rows):
        part = philox.rng_keep_mask(rng, begin * cols, cols, philox.keep_threshold(p))
        assert torch.equal(part, want[begin * cols : (begin + 1) * cols])
