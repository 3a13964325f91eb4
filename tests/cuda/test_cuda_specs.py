"""Kernel plans of loragen.cuda.kernels: every grid covers every row, column and rank tile exactly, the
adapters are padded to the rank bucket, and the tensor-core passes are chosen where the model says."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loragen.cuda import kernels as kern

any_variant = st.builds(
    kern.Variant,
    st.sampled_from(list(kern.DTYPES)),
    st.sampled_from(kern.RANK_BUCKETS),
    st.booleans(),
)
sizes = st.integers(1, 70_000)
features = st.integers(1, 20_000)


@settings(max_examples=300, deadline=None)
@given(any_variant, sizes, features, st.integers(1, 600))
def test_down_grid_covers_rows_columns_and_rank_tiles(variant, rows, cols, target):
    plan = kern.plan_down(rows, cols, variant, target)
    tile = kern.LORA_DOWN.tile(variant)
    tiles = kern.rank_tiles(kern.LORA_DOWN, variant)
    assert tiles * tile["rank_tile"] == variant.rank_bucket
    row_blocks, splits = plan.grid
    assert row_blocks % tiles == 0 and (row_blocks // tiles) * tile["warps"] * tile["rows_per_warp"] >= rows
    assert splits == plan.splits and (splits - 1) * plan.cols_per_split < cols <= splits * plan.cols_per_split
    step = (32 if tile["mma"] else 256) * tile["steps"]
    assert plan.cols_per_split % step == 0  # every split starts on a whole step
    if splits > 1:  # h partials stay under a quarter of x
        assert (
            splits * rows * variant.rank_bucket * 4 * 2 <= rows * cols * kern.ELEMENT_BYTES[variant.dtype] / 2
        )


@settings(max_examples=300, deadline=None)
@given(any_variant, sizes, features, st.integers(1, 600), st.sampled_from(["lora_grad_out", "lora_grad_in"]))
def test_backward_grids_cover_columns_rank_tiles_and_rows(variant, rows, cols, target, name):
    spec = kern.KERNELS[name]
    plan = (kern.plan_grad_out if name == "lora_grad_out" else kern.plan_grad_in)(rows, cols, variant, target)
    tile = spec.tile(variant)
    tiles = kern.rank_tiles(spec, variant)
    if tile.get("mma") and name == "lora_grad_in":  # on tensor cores the warps share 32 columns
        block_cols = 32
    elif tile.get("mma"):  # lora_grad_out on tensor cores: col_chunks chunks of 32 columns per warp
        block_cols = tile["warps"] * 32 * tile["col_chunks"]
    else:
        block_cols = 256 if name == "lora_grad_in" else tile["warps"] * 256
    assert plan.grid[0] == plan.col_blocks * tiles
    assert (plan.col_blocks - 1) * block_cols < cols <= plan.col_blocks * block_cols
    assert plan.grid[1] == plan.splits
    assert (plan.splits - 1) * plan.rows_per_split < rows <= plan.splits * plan.rows_per_split


@settings(max_examples=200, deadline=None)
@given(any_variant, sizes, features)
def test_up_grid_covers_the_output(variant, rows, cols):
    tile = kern.LORA_UP.tile(variant)
    row_blocks, col_blocks = kern.plan_up(rows, cols, variant)
    rows_per_block = tile["warps"] * tile["rows_per_thread"] * (16 if tile["mma"] else 1)
    cols_per_block = 32 * tile["col_chunks"] if tile["mma"] else 256
    assert (row_blocks - 1) * rows_per_block < rows <= row_blocks * rows_per_block
    assert (col_blocks - 1) * cols_per_block < cols <= col_blocks * cols_per_block


@pytest.mark.parametrize("rank", [1, 5, 8, 9, 33, 64])
def test_pad_rank_adds_zero_rows_up_to_the_bucket(rank):
    adapter = torch.randn(rank, 24)
    variant = kern.Variant("float32", kern.rank_bucket(rank), True)
    padded = kern.pad_rank(adapter, variant)
    assert padded.shape == (variant.rank_bucket, 24) and padded.is_contiguous()
    assert torch.equal(padded[:rank], adapter) and not padded[rank:].any()
    assert padded.data_ptr() != adapter.data_ptr()  # a fresh tensor: the caller's adapter is not touched


def test_tensor_cores_where_the_cuda_cores_would_bind():
    chosen = {
        (v.dtype, v.rank_bucket, v.aligned)
        for spec, v in kern.all_variants()
        if spec is kern.LORA_DOWN and kern.uses_mma(v)
    }
    assert chosen == {(d, r, True) for d in ("bfloat16", "float16") for r in (16, 32, 64)}
    assert [r for r in kern.RANK_BUCKETS if kern.up_uses_mma(kern.Variant("bfloat16", r, True))] == [
        16,
        32,
        64,
    ]
    assert not kern.up_uses_mma(kern.Variant("float16", 64, True))  # h would be rounded to float16's range
    assert not kern.up_uses_mma(kern.Variant("bfloat16", 64, False))
    grad_out = [
        v for spec, v in kern.all_variants() if spec is kern.LORA_GRAD_OUT and kern.grad_out_uses_mma(v)
    ]
    assert {(v.dtype, v.rank_bucket, v.aligned) for v in grad_out} == {
        ("bfloat16", r, True) for r in (16, 32, 64)
    }
    grad_in = [v for spec, v in kern.all_variants() if spec is kern.LORA_GRAD_IN and kern.grad_in_uses_mma(v)]
    assert {(v.dtype, v.rank_bucket, v.aligned) for v in grad_in} == {
        ("bfloat16", r, True) for r in (16, 32, 64)
    }
    for v in grad_in:  # every rank in one block (x read once), whole 16-row tiles per step
        tile = kern.LORA_GRAD_IN.tile(v)
        assert tile["mma"] and tile["rank_tile"] == v.rank_bucket and tile["rows_per_step"] % 16 == 0


@pytest.mark.parametrize("rank", [8, 16, 32])
def test_grids_fill_two_waves_on_an_h100_layer(rank):
    """4096 x 4096 layer, 4096 tokens, 132 SMs (target_blocks 264): lora_down, lora_up and lora_grad_in
    launch about two waves of the blocks per SM their launch bounds ask for (issue 20: the first grids
    were 0.48 waves); lora_grad_out stops at its partial-sum cap (half of g's bytes)."""
    variant = kern.Variant("bfloat16", rank, True)
    sms, target, n = 132, 264, 4096

    def waves(spec: kern.KernelSpec, blocks: int) -> float:
        return blocks / (sms * spec.tile(variant)["min_blocks"])

    down = kern.plan_down(n, n, variant, target)
    row_blocks, col_blocks = kern.plan_up(n, n, variant)
    grad_in = kern.plan_grad_in(n, n, variant, target)
    assert waves(kern.LORA_DOWN, down.grid[0] * down.grid[1]) >= (1.9 if rank <= 16 else 0.9)
    assert waves(kern.LORA_UP, row_blocks * col_blocks) >= 1.5
    assert waves(kern.LORA_GRAD_IN, grad_in.grid[0] * grad_in.grid[1]) >= 1.9
    grad_out = kern.plan_grad_out(n, n, variant, target)
    per_split = 16 * rank  # the dB partials stay under half of g's bytes
    assert (
        grad_out.splits == n * 2 // per_split
        or waves(kern.LORA_GRAD_OUT, grad_out.grid[0] * grad_out.grid[1]) >= 1.9
    )


def test_a_variant_keeps_its_hash_across_processes():
    """A variant's hash is worked out once; one pickled in another process (another string hash seed)
    is rebuilt from its fields, so it finds the same dict entries as one made here."""
    import os
    import pickle
    import subprocess
    import sys

    code = (
        "import pickle, sys; from loragen.cuda.kernels import Variant; "
        "sys.stdout.buffer.write(pickle.dumps(Variant('bfloat16', 16, True)))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    made_there = pickle.loads(
        subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, check=True).stdout
    )
    made_here = kern.Variant("bfloat16", 16, True)
    assert made_there == made_here and hash(made_there) == hash(made_here)
    assert {made_here: "found"}[made_there] == "found"


def test_an_empty_input_gets_a_down_grid_with_no_row_blocks():
    variant = kern.Variant("float32", 16, True)
    assert kern.plan_down(0, 64, variant, 264).grid[0] == 0
