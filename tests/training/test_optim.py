"""loragen.training: the dynamic table, block-wise quantization, AdamW8bit, make_optimizer."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from loragen.training.adamw8bit import AdamW8bit, dequantize_blockwise, dynamic_code, quantize_blockwise
from loragen.training.optimizers import make_optimizer, optimizer_state_bytes, trainable_parameters


def _regression_model(seed: int = 0, width: int = 96) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(48, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 4)
    )


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int = 1) -> list[float]:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(64, 48, generator=generator)
    targets = torch.randn(64, 4, generator=generator)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


# --- the table -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("signed", [True, False])
def test_dynamic_code_is_256_sorted_values_with_exact_zero_and_one(signed: bool) -> None:
    table = dynamic_code(signed)
    assert table.shape == (256,) and table.dtype == torch.float32
    assert bool((table[1:] > table[:-1]).all())
    assert 0.0 in table.tolist() and table[-1].item() == 1.0
    assert (table.min().item() < -0.99) if signed else (table.min().item() == 0.0)


def test_dynamic_code_keeps_relative_precision_over_decades() -> None:
    # The point of the dynamic table: a value 1e-5 of the block maximum is not rounded to zero.
    table = dynamic_code(False)
    for magnitude in (1e-6, 1e-5, 1e-3, 0.5):
        nearest = table[(table - magnitude).abs().argmin()].item()
        assert abs(nearest - magnitude) / magnitude < 0.5
    positive = dynamic_code(True)
    assert positive[positive > 0].min().item() < 1e-6


# --- block-wise quantization ---------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    numel=st.integers(1, 700),
    block_size=st.sampled_from([16, 64, 256]),
    scale=st.floats(1e-6, 1e4),
    signed=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_quantize_roundtrip_error_is_bounded_by_the_block_maximum(
    numel: int, block_size: int, scale: float, signed: bool, seed: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(numel, generator=generator) * scale
    if not signed:
        values = values.abs()
    table = dynamic_code(signed)
    codes, absmax = quantize_blockwise(values, table, block_size)
    assert codes.dtype == torch.uint8 and codes.shape == (-(-numel // block_size), block_size)
    restored = dequantize_blockwise(codes, absmax, table, values.shape)
    assert restored.shape == values.shape
    # The widest gap in either table is in its top decade: 0.9 / 64 for signed, 0.9 / 128 unsigned.
    half_gap = (0.9 / 64 if signed else 0.9 / 128) / 2
    per_element_max = absmax.repeat_interleave(block_size)[:numel]
    # a value on a midpoint may round either way; allow a few float32 ulps of the block maximum for that
    slack = 4 * torch.finfo(torch.float32).eps * per_element_max
    assert bool(((restored - values).abs() <= half_gap * per_element_max + slack).all())
    # The element holding each block's maximum magnitude is exact when positive.
    block_of_max = values.abs().max()
    if values[values.abs().argmax()] > 0:
        assert restored[values.abs().argmax()].item() == pytest.approx(block_of_max.item(), rel=1e-6)


def test_quantize_keeps_zeros_and_all_zero_blocks() -> None:
    values = torch.zeros(300)
    values[5] = 0.25
    table = dynamic_code(True)
    codes, absmax = quantize_blockwise(values, table, 256)
    assert absmax.tolist() == [0.25, 0.0]
    restored = dequantize_blockwise(codes, absmax, table, values.shape)
    assert restored[5].item() == 0.25
    assert int((restored != 0).sum()) == 1


@settings(max_examples=40, deadline=None)
@given(signed=st.booleans(), exponent=st.floats(-12, 0), seed=st.integers(0, 2**16))
def test_quantize_picks_the_nearest_table_entry(signed: bool, exponent: float, seed: int) -> None:
    # The fast bucket lookup must agree with a brute-force nearest-entry search (ties may go either way).
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(4, 256, generator=generator) * torch.logspace(exponent, 0, 256)
    table = dynamic_code(signed)
    if not signed:
        values = values.abs()
    values[0] = torch.cat((table[:128], (table[1:129] + table[:128]) / 2))  # entries and midpoints
    codes, absmax = quantize_blockwise(values, table, 256)
    normalized = values / torch.where(absmax > 0, absmax, torch.ones_like(absmax))[:, None]
    best = (table[None, None, :] - normalized[..., None]).abs().min(dim=-1).values
    chosen = (table[codes.long()] - normalized).abs()
    torch.testing.assert_close(chosen, best, rtol=0, atol=1e-7)


def test_second_moments_are_never_rounded_to_zero() -> None:
    values = torch.tensor([1.0, 1e-8, 0.0, 3e-7])
    table = dynamic_code(False)
    plain, _ = quantize_blockwise(values, table, 4)
    kept, _ = quantize_blockwise(values, table, 4, keep_nonzero=True)
    assert table[plain.long()][0, :3].tolist() == [1.0, 0.0, 0.0]
    assert table[kept.long()][0, 1] > 0 and table[kept.long()][0, 2] == 0


def test_adamw8bit_steps_stay_bounded_when_gradients_vanish() -> None:
    # Rows of an embedding absent from later batches get zero gradients. Had their tiny second moments
    # been rounded to 0 while the first moments were not, the next steps would be m / eps (~1e4 x lr).
    param = nn.Parameter(torch.zeros(256))
    optimizer = AdamW8bit([param], lr=1e-3, weight_decay=0.0, min_8bit_size=0)
    scales = torch.logspace(0, -6, 256)
    for step in range(6):
        grad = scales.clone()
        if step >= 3:
            grad[1:] = 0.0
        param.grad = grad
        optimizer.step()
    assert bool(torch.isfinite(param).all()) and float(param.abs().max()) < 10 * 1e-3


def test_quantize_with_another_table_uses_a_search() -> None:
    table = torch.linspace(-1, 1, 256)
    values = torch.tensor([0.5, -0.25, 1.0, 0.001])
    codes, absmax = quantize_blockwise(values, table, 4)
    torch.testing.assert_close(
        dequantize_blockwise(codes, absmax, table, values.shape), values, atol=4e-3, rtol=0
    )


def test_quantize_rejects_a_bad_block_size() -> None:
    with pytest.raises(ValueError, match="block_size must be a positive integer, got 0"):
        quantize_blockwise(torch.ones(4), dynamic_code(True), 0)


# --- AdamW8bit -----------------------------------------------------------------------------------------


def test_adamw8bit_with_fp32_states_matches_torch_adamw() -> None:
    reference = _regression_model()
    ours = copy.deepcopy(reference)
    ref_losses = _train(reference, torch.optim.AdamW(reference.parameters(), lr=3e-3, weight_decay=0.1), 20)
    our_losses = _train(
        ours, AdamW8bit(ours.parameters(), lr=3e-3, weight_decay=0.1, min_8bit_size=10**9), 20
    )
    assert our_losses == pytest.approx(ref_losses, rel=1e-5)
    for a, b in zip(reference.parameters(), ours.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_adamw8bit_tracks_torch_adamw() -> None:
    reference = _regression_model()
    ours = copy.deepcopy(reference)
    ref_losses = _train(reference, torch.optim.AdamW(reference.parameters(), lr=2e-3), 40)
    optimizer = AdamW8bit(ours.parameters(), lr=2e-3, min_8bit_size=0)
    our_losses = _train(ours, optimizer, 40)
    assert all("exp_avg_codes" in state for state in optimizer.state.values())
    assert our_losses[-1] < 0.2 * our_losses[0]
    # While the loss is still far from zero the two curves agree to a few per mille.
    assert our_losses[:30] == pytest.approx(ref_losses[:30], rel=0.01)
    for a, b in zip(reference.parameters(), ours.parameters()):
        assert (a - b).norm() <= 0.05 * a.norm()


def test_adamw8bit_state_is_at_least_70_percent_smaller() -> None:
    model = _regression_model(width=512)
    fp32 = torch.optim.AdamW(model.parameters(), lr=1e-3)
    eight = AdamW8bit(model.parameters(), lr=1e-3)
    _train(model, fp32, 1)
    _train(model, eight, 1)
    fp32_bytes, eight_bytes = optimizer_state_bytes(fp32), optimizer_state_bytes(eight)
    assert fp32_bytes >= 8 * sum(p.numel() for p in model.parameters())
    assert eight_bytes <= 0.30 * fp32_bytes
    # Biases are below min_8bit_size: they keep fp32 moments.
    assert "exp_avg" in eight.state[model[0].bias] and "exp_avg_codes" in eight.state[model[2].weight]


def test_adamw8bit_state_dict_roundtrip_resumes_identically() -> None:
    model = _regression_model()
    model[2].to(torch.bfloat16)
    model[2].register_forward_pre_hook(lambda m, args: (args[0].to(torch.bfloat16),))
    model[2].register_forward_hook(lambda m, args, out: out.float())
    optimizer = AdamW8bit(model.parameters(), lr=1e-3, min_8bit_size=64)
    _train(model, optimizer, 3)
    saved_model, saved_optimizer = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
    expected = _train(model, optimizer, 3, seed=2)

    resumed = _regression_model(seed=5)
    resumed[2].to(torch.bfloat16)
    resumed[2].register_forward_pre_hook(lambda m, args: (args[0].to(torch.bfloat16),))
    resumed[2].register_forward_hook(lambda m, args, out: out.float())
    resumed.load_state_dict(saved_model)
    resumed_optimizer = AdamW8bit(resumed.parameters(), lr=1e-3, min_8bit_size=64)
    resumed_optimizer.load_state_dict(saved_optimizer)
    state = resumed_optimizer.state[resumed[2].weight]
    assert state["exp_avg_codes"].dtype == torch.uint8 and state["exp_avg_absmax"].dtype == torch.float32
    assert _train(resumed, resumed_optimizer, 3, seed=2) == expected


def test_adamw8bit_skips_parameters_without_grad_and_refuses_sparse() -> None:
    frozen, sparse = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(5, 2))
    optimizer = AdamW8bit([frozen, sparse])
    optimizer.step()
    assert not optimizer.state and frozen.tolist() == [1.0, 1.0, 1.0]
    sparse.grad = torch.ones(5, 2).to_sparse()
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        optimizer.step()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": -1.0}, "lr must be >= 0, got -1.0"),
        ({"betas": (0.9, 1.0)}, r"betas must each lie in \[0, 1\)"),
        ({"eps": -1e-8}, "eps must be >= 0"),
        ({"weight_decay": -0.1}, "weight_decay must be >= 0"),
        ({"block_size": 0}, "block_size must be a positive integer, got 0"),
        ({"min_8bit_size": -1}, "min_8bit_size must be a non-negative integer, got -1"),
    ],
)
def test_adamw8bit_rejects_bad_hyperparameters(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AdamW8bit([nn.Parameter(torch.ones(2))], **kwargs)


# --- make_optimizer ------------------------------------------------------------------------------------


def _half_frozen() -> nn.Module:
    model = _regression_model()
    for param in model[0].parameters():
        param.requires_grad_(False)
    return model


def test_make_optimizer_sees_only_trainable_parameters() -> None:
    model = _half_frozen()
    optimizer = make_optimizer(model, lr=1e-3)
    assert isinstance(optimizer, torch.optim.AdamW)
    seen = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert seen == {id(p) for _, p in trainable_parameters(model)}
    assert id(model[0].weight) not in seen and len(seen) == 4


def test_make_optimizer_puts_1d_parameters_in_a_group_without_decay() -> None:
    model = _half_frozen()
    optimizer = make_optimizer(model, lr=1e-3, weight_decay=0.1, eight_bit=True, block_size=64)
    assert isinstance(optimizer, AdamW8bit) and optimizer.block_size == 64
    decays = {p.ndim: group["weight_decay"] for group in optimizer.param_groups for p in group["params"]}
    assert decays == {2: 0.1, 1: 0.0}
    everything = make_optimizer(model, lr=1e-3, weight_decay=0.1, decay_1d=True)
    assert [group["weight_decay"] for group in everything.param_groups] == [0.1]


def test_make_optimizer_errors() -> None:
    model = _regression_model()
    with pytest.raises(ValueError, match="only apply with eight_bit=True"):
        make_optimizer(model, lr=1e-3, block_size=64)
    with pytest.raises(ValueError, match=r"unknown 8-bit option\(s\) \['percentile'\]"):
        make_optimizer(model, lr=1e-3, eight_bit=True, percentile=5)
    model.requires_grad_(False)
    with pytest.raises(ValueError, match="Sequential has no trainable parameter"):
        make_optimizer(model, lr=1e-3)
