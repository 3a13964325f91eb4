"""Sibling groups on the CUDA path (loragen.cuda.group_op), on the CPU: the group's kernels run on the
torch path (:class:`~loragen.cuda.torch_kernels.TorchKernels`), emulated thread by thread
(tests/cuda/cuda_emulation.py), or on the null driver (launches counted, nothing run).

What must hold: outputs and every gradient -- x's included -- as k separate ``lora_linear_cuda`` calls give
them (both within float32 rounding of a float64 reference); 2 + 2k launches where separate layers make 4k;
the stacked A refreshed when a member's A changes; groups the kernels cannot take declined (None); and,
through the layers (sibling fusion routed to the CUDA group), every rule of the CPU group: a member takes
the leader's output only for the very input tensor at the same version, merged, disabled and unfused
members run alone, outputs are fresh tensors.
"""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import loragen
from loragen import switches
from loragen._benchmarks.cuda_group_host import device_work, group_counts, group_step
from loragen._benchmarks.cuda_host import NullLauncher, SyncRecorder
from loragen.cuda import group_op, specs, streams
from loragen.cuda.group_op import group_reason, lora_group_cuda
from loragen.cuda.kernel_variants import Variant
from loragen.cuda.linear_op import lora_linear_cuda
from loragen.cuda.op_inputs import CudaLoraError
from loragen.cuda.torch_kernels import TorchKernels
from loragen.ops import siblings
from loragen.reference import lora_linear_reference
from loragen.sibling_planning import fused_groups
from tests.conftest import autograd_node_names
from tests.cuda.cuda_emulation import CXX, EmulatedLauncher, cache_folder
from tests.cuda.lora_reference import TOLERANCE, reference, relative_error

TORCH_PATH = TorchKernels(whole_op=False)  # the four passes on torch, as the kernels run them


def _members(k_in, outs, ranks, dtype, *, bias=True, fifo=False, seed=0, lora_dtype=torch.float32):
    """Random members (leaves that require grads) and float64 copies."""
    gen = torch.Generator().manual_seed(seed)
    low, high = [], []
    for i, (out, r) in enumerate(zip(outs, ranks)):
        w = torch.randn(out, k_in, generator=gen) / k_in**0.5
        if fifo and i % 2 == 1:  # every other member stores its weight (in, out), as transformers' Conv1D
            w = w.t().contiguous()
        b = torch.randn(out, generator=gen) if bias else None
        a = torch.randn(r, k_in, generator=gen) / k_in**0.5
        bb = torch.randn(out, r, generator=gen)
        t = fifo and i % 2 == 1
        tensors = [
            None if v is None else v.to(dtype if j < 2 else lora_dtype).requires_grad_()
            for j, v in enumerate((w, b, a, bb))
        ]
        low.append((*tensors, 0.5 + 0.25 * i, t))
        high.append(tuple(None if v is None else v.detach().double().requires_grad_() for v in tensors))
    return low, high


def _leaves(x, members):
    return [x] + [t for m in members for t in m[:4] if t is not None]


def _grads(x, members, outputs, grads):
    for t in _leaves(x, members):
        t.grad = None
    torch.autograd.backward(list(outputs), list(grads))
    return [t.grad for t in _leaves(x, members)]


def _error(got, want, magnitude):
    """||got - want|| relative to ||want||, or to ||magnitude|| / 16 where that is larger: ``magnitude`` is
    the same quantity computed from the absolute values of every input, so where the drawn terms cancel by
    more than 16x (hypothesis finds 1 x 1 layers of rank 20 that do) the bound is on the terms' rounding,
    not on the cancellation, and everywhere else it is the plain relative error."""
    want = want.detach()
    denominator = max(want.norm().item(), magnitude.detach().norm().item() / 16)
    return (got.detach().cpu().double() - want).norm().item() / denominator


def _check_group(x, low, high, launcher, dtype, tolerance=None):
    """The group against k separate lora_linear_cuda calls and a float64 reference (see :func:`_error`)."""
    tolerance = TOLERANCE[dtype] if tolerance is None else tolerance
    gen = torch.Generator().manual_seed(7)
    group = lora_group_cuda(x, low, launcher=launcher)
    assert group is not None
    separate = [
        lora_linear_cuda(x, *m[:4], m[4], 0.0, True, fan_in_fan_out=m[5], launcher=launcher) for m in low
    ]
    grads = [torch.randn(y.shape, generator=gen).to(dtype) for y in separate]
    xr = x.detach().double().requires_grad_()
    wanted = [reference(xr, *h, m[4], None, m[5]) for m, h in zip(low, high)]
    xa = x.detach().double().abs().requires_grad_()
    magnitudes = [tuple(None if t is None else t.detach().abs().requires_grad_() for t in h) for h in high]
    scales = [reference(xa, *h, m[4], None, m[5]) for m, h in zip(low, magnitudes)]
    for y, s, want, scale in zip(group, separate, wanted, scales):
        assert y.dtype == dtype and y.shape == s.shape
        assert _error(y, want, scale) < tolerance
        assert _error(y, s.double(), scale) < tolerance
    got = _grads(x, low, group, grads)
    per_layer = _grads(x, low, separate, grads)
    torch.autograd.backward(wanted, [g.double() for g in grads])
    torch.autograd.backward(scales, [g.double().abs() for g in grads])
    exact = [xr.grad] + [t.grad for h in high for t in h if t is not None]
    bounds = [xa.grad] + [t.grad for h in magnitudes for t in h if t is not None]
    for i, (g, s, e, bound) in enumerate(zip(got, per_layer, exact, bounds)):
        assert g.shape == s.shape and g.dtype == s.dtype, i
        assert _error(g, e, bound) < tolerance, i
        assert _error(g, s.double(), bound) < tolerance, i
    return group


# ---- values and gradients ------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.integers(1, 40),
    k_in=st.integers(1, 40),
    outs=st.lists(st.integers(1, 24), min_size=2, max_size=4),
    ranks=st.lists(st.integers(1, 20), min_size=4, max_size=4),
    bias=st.booleans(),
    fifo=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    lead=st.sampled_from([(), (2,)]),
)
def test_group_equals_separate_layers_and_the_float64_reference(
    rows, k_in, outs, ranks, bias, fifo, dtype, lead
):
    ranks = ranks[: len(outs)]
    low, high = _members(k_in, outs, ranks, dtype, bias=bias, fifo=fifo)
    x = torch.randn(*lead, rows, k_in, generator=torch.Generator().manual_seed(3)).to(dtype).requires_grad_()
    if group_reason(x, low) is not None:  # the stacked buckets past 64: declined (tested below)
        assert lora_group_cuda(x, low, launcher=TORCH_PATH) is None
        return
    _check_group(x, low, high, TORCH_PATH, dtype)


def test_float32_gradients_of_x_and_factors_match_the_per_layer_op_closely():
    """float32 x: every output and every gradient but x's is the per-layer op's, term for term; x's
    differs only in the order its terms are summed."""
    low, high = _members(48, [40, 24, 40], [16, 5, 16], torch.float32, fifo=True)
    x = torch.randn(3, 37, 48, generator=torch.Generator().manual_seed(3)).requires_grad_()
    _check_group(x, low, high, TORCH_PATH, torch.float32, tolerance=1e-6)


def test_frozen_members_and_an_unused_output():
    """Gradients only where asked (a frozen base, a frozen adapter), and an output nobody used."""
    low, high = _members(16, [8, 8, 16], [4, 8, 8], torch.float32)
    low[0][0].requires_grad_(False)
    low[1][2].requires_grad_(False)  # member 1's A frozen: its dh still feeds x's gradient
    x = torch.randn(10, 16).requires_grad_()
    ys = lora_group_cuda(x, low, launcher=TORCH_PATH)
    g0, g2 = torch.randn(10, 8), torch.randn(10, 16)
    torch.autograd.backward([ys[0], ys[2]], [g0, g2])
    xr = x.detach().double().requires_grad_()
    want = [reference(xr, *high[i], low[i][4], None, False) for i in (0, 2)]
    torch.autograd.backward(want, [g0.double(), g2.double()])
    assert low[0][0].grad is None and low[1][2].grad is None
    assert relative_error(x.grad, xr.grad) < 1e-5
    for name, got, exact in (
        ("A0", low[0][2], high[0][2]),
        ("B2", low[2][3], high[2][3]),
        ("W2", low[2][0], high[2][0]),
    ):
        assert relative_error(got.grad, exact.grad) < 1e-5, name
    assert all(t.grad is None for t in low[1][:4] if t is not None)  # never used: no gradients, as a layer


def test_an_unused_member_with_a_trainable_adapter_gets_no_gradient():
    """A member whose output reached no loss leaves its A and B without gradients, as a layer run alone
    (a zero gradient would still move them under weight decay or momentum)."""
    low, _ = _members(16, [8, 8, 16], [4, 8, 8], torch.float32)
    x = torch.randn(10, 16).requires_grad_()
    ys = lora_group_cuda(x, low, launcher=TORCH_PATH)
    torch.autograd.backward([ys[0], ys[2]], [torch.randn(10, 8), torch.randn(10, 16)])
    assert low[1][2].grad is None and low[1][3].grad is None
    assert low[0][2].grad is not None and low[2][2].grad is not None


class _RawWriteStep(torch.optim.Optimizer):
    """A step that writes the factors through ``.data`` (as kernels writing through a raw pointer do): no
    version counter moves."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        super().__init__(params, {})

    def step(self, closure: None = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                p.data.mul_(-1.5)


def test_a_group_first_run_under_inference_mode_follows_steps_that_keep_version_counters():
    """The stacked A made under ``torch.inference_mode`` takes later values outside it, and is copied again
    after an optimizer step that moves no version counter."""
    low, _ = _members(16, [8, 8, 16], [4, 8, 8], torch.float32, bias=False)
    x = torch.randn(10, 16)
    optimizer = _RawWriteStep([m[2] for m in low])
    with torch.inference_mode():
        lora_group_cuda(x, low, launcher=TORCH_PATH)
    for step in range(3):
        ys = lora_group_cuda(x, low, launcher=TORCH_PATH)
        for i, (y, (w, _, a, bb, s, t)) in enumerate(zip(ys, low)):
            want = reference(x.double(), w.double(), None, a.double(), bb.double(), s, None, t)
            assert relative_error(y, want) < 1e-5, (step, i)
        optimizer.step()


def test_outputs_are_fresh_tensors():
    low, _ = _members(16, [8, 8], [4, 4], torch.float32)
    x = torch.randn(2, 5, 16)
    ys = lora_group_cuda(x, low, launcher=TORCH_PATH)
    assert ys[0].untyped_storage().data_ptr() != ys[1].untyped_storage().data_ptr()
    assert all(y._base is None and y.is_contiguous() for y in ys)


def _autocast_group(x, members, *, backward_inside):
    """The group's outputs and every leaf's gradient with the forward under the CPU's bf16 autocast, and
    backward() called inside that region or after it."""
    gen = torch.Generator().manual_seed(11)
    for t in _leaves(x, members):
        t.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ys = lora_group_cuda(x, members, launcher=TORCH_PATH)
        assert ys is not None
        grads = [torch.randn(y.shape, generator=gen).to(y.dtype) for y in ys]
        if backward_inside:
            torch.autograd.backward(list(ys), grads)
    if not backward_inside:
        torch.autograd.backward(list(ys), grads)
    return [y.detach() for y in ys], [t.grad for t in _leaves(x, members)], grads


@pytest.mark.parametrize("backward_inside", [False, True], ids=["backward-after", "backward-inside"])
def test_under_autocast_a_group_runs_on_its_cast_inputs(backward_inside):
    """A float32 model under bf16 autocast: the group is the group of x, weights and biases cast to bf16
    (the factors as they are), bit for bit, outputs and gradients -- the float32 leaves' through their
    casts --, wherever backward() is called (inside the region autocast must not recast its products)."""
    low, _ = _members(48, [40, 24, 40], [16, 5, 16], torch.float32, fifo=True)
    x = torch.randn(3, 7, 48, generator=torch.Generator().manual_seed(3)).requires_grad_()
    ys, got, grads = _autocast_group(x, low, backward_inside=backward_inside)
    assert all(y.dtype == torch.bfloat16 for y in ys)
    assert [g.dtype for g in got] == [t.dtype for t in _leaves(x, low)]  # float32, as the leaves

    def cast(t, j):  # weight and bias in bf16 (j < 2), the factors as float32 copies
        return None if t is None else t.detach().to(torch.bfloat16 if j < 2 else t.dtype).requires_grad_()

    xc = x.detach().to(torch.bfloat16).requires_grad_()
    cast_members = [(*(cast(t, j) for j, t in enumerate(m[:4])), m[4], m[5]) for m in low]
    want_ys = lora_group_cuda(xc, cast_members, launcher=TORCH_PATH)
    torch.autograd.backward(list(want_ys), grads)
    for y, want in zip(ys, want_ys):
        assert torch.equal(y, want)
    for i, (g, leaf) in enumerate(zip(got, _leaves(xc, cast_members))):
        assert torch.equal(g, leaf.grad.to(g.dtype)), i


def test_under_autocast_a_bf16_model_casts_nothing():
    """A bf16 model under bf16 autocast: the same node as without autocast, gradients land on the leaves
    themselves."""
    low, _ = _members(32, [16, 16], [8, 8], torch.bfloat16)
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).requires_grad_()
    ys, got, grads = _autocast_group(x, low, backward_inside=False)
    plain = lora_group_cuda(x, low, launcher=TORCH_PATH)
    want = _grads(x, low, plain, grads)
    assert all(torch.equal(y, p) for y, p in zip(ys, plain))
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_a_member_whose_terms_cancel_stays_within_float32_rounding_of_its_largest_term():
    """v's LoRA term cancels its base term in x's gradient (W_v = -s B_v A_v, terms ~3e4, their sum ~10).
    The group adds every member's rank-r term in one buffer before the base terms, so q's and k's terms
    are rounded against v's; the per-layer op rounds v's rank-r term alone before adding its base term.
    Both land within float32 rounding of the largest term, the group no further than the per-layer op."""
    gen = torch.Generator().manual_seed(2)
    members = []
    for _ in range(2):
        w, a, b = (
            torch.randn(16, 16, generator=gen) / 4,
            torch.randn(4, 16, generator=gen) / 4,
            torch.randn(16, 4, generator=gen),
        )
        members.append((w, None, a, b, 1.25, False))
    big_a = torch.randn(4, 16, generator=gen, dtype=torch.float64) * 30
    big_b = torch.randn(16, 4, generator=gen, dtype=torch.float64) * 30
    members.append(((-1.25 * big_b @ big_a).float(), None, big_a.float(), big_b.float(), 1.25, False))
    x = torch.randn(15, 16, generator=gen).requires_grad_()
    grads = [torch.randn(15, 16, generator=gen) for _ in members]
    terms = [
        (m[4] * (g.double() @ m[3].double()) @ m[2].double(), g.double() @ m[0].double())
        for m, g in zip(members, grads)
    ]
    exact = sum(lora + base for lora, base in terms)
    largest = max(lora.abs().max().item() for lora, _ in terms)
    assert largest > 100 * exact.abs().max().item()  # the cancellation is real
    torch.autograd.backward(list(lora_group_cuda(x, members, launcher=TORCH_PATH)), grads)
    group = (x.grad.double() - exact).abs().max().item()
    x.grad = None
    separate = [lora_linear_cuda(x, *m[:4], m[4], 0.0, True, launcher=TORCH_PATH) for m in members]
    torch.autograd.backward(separate, grads)
    per_layer = (x.grad.double() - exact).abs().max().item()
    eps = torch.finfo(torch.float32).eps
    assert per_layer < 16 * eps * largest and group < 16 * eps * largest
    assert group <= 1.5 * per_layer


# ---- launches, caches and what is declined ---------------------------------------------------------------


def test_a_group_launches_two_plus_two_k_kernels_where_layers_launch_four_k():
    low, _ = _members(64, [64, 32, 32], [16, 16, 16], torch.bfloat16)
    x = torch.randn(8, 64).to(torch.bfloat16).requires_grad_()
    launcher = NullLauncher()
    ys = lora_group_cuda(x, low, launcher=launcher)
    torch.autograd.backward(list(ys), [torch.ones_like(y) for y in ys])
    names = [name for name, _, _ in launcher.launches]
    assert names == ["lora_down"] + ["lora_up"] * 3 + ["lora_grad_out"] * 3 + ["lora_grad_in"]
    labels = {name: label for name, label, _ in launcher.launches}
    assert labels["lora_down"] == labels["lora_grad_in"] == "bfloat16-r64-aligned"  # 3 x 16 -> bucket 64
    assert labels["lora_up"] == labels["lora_grad_out"] == "bfloat16-r16-aligned"  # each member's own
    launcher.launches.clear()
    separate = [lora_linear_cuda(x, *m[:4], m[4], 0.0, True, launcher=launcher) for m in low]
    torch.autograd.backward(separate, [torch.ones_like(y) for y in separate])
    assert len(launcher.launches) == 12


def test_the_stacked_factor_is_kept_and_refreshed_when_a_member_changes():
    low, high = _members(16, [8, 8, 8], [3, 8, 5], torch.float32)
    x = torch.randn(6, 16)
    first = lora_group_cuda(x, low, launcher=TORCH_PATH)
    (entry,) = [e for key, e in group_op._stacked.items() if key == tuple(id(m[2]) for m in low)]
    buffer = entry.buffer
    assert buffer.shape == (32, 16)  # blocks of 8, 8 and 8 rows (3 -> 8, 5 -> 8), bucket 32
    assert torch.equal(buffer[8:16], low[1][2].detach()) and not buffer[3:8].any() and not buffer[24:].any()
    with torch.no_grad():
        low[1][2].mul_(-2)  # in place: a new version
    again = lora_group_cuda(x, low, launcher=TORCH_PATH)
    assert group_op._stacked[tuple(id(m[2]) for m in low)].buffer is buffer  # refreshed, not replaced
    assert torch.equal(buffer[8:16], low[1][2].detach())
    assert torch.equal(again[0], first[0]) and torch.equal(again[2], first[2])
    alone = lora_linear_cuda(x, *low[1][:4], low[1][4], 0.0, True, launcher=TORCH_PATH)
    torch.testing.assert_close(again[1], alone, rtol=1e-6, atol=1e-6)
    del low, high, first, again, alone, entry
    import gc

    gc.collect()
    assert buffer.shape == (32, 16) and not any(e.buffer is buffer for e in group_op._stacked.values())


def test_after_a_capture_the_group_copies_its_factors_on_every_call(monkeypatch):
    """A CUDA graph's replay changes parameters in place without moving their version counters (a captured
    optimizer step): once a capture has read a group's stacked A and its B^T buffers, every call copies
    them again, so an eager call after replays computes with the values the replays left (``.data``
    changes stand in for a replay's: they do not move the counter either)."""
    low, _ = _members(16, [8, 12], [3, 8], torch.float32)
    x = torch.randn(6, 16)
    lora_group_cuda(x, low, launcher=TORCH_PATH)
    monkeypatch.setattr(streams, "capturing", lambda device: True)
    lora_group_cuda(x, low, launcher=TORCH_PATH)
    monkeypatch.setattr(streams, "capturing", lambda device: False)
    for step in range(2):
        for _w, _b, a, bb, _, _ in low:
            a.data.mul_(-2.0)
            bb.data.add_(1.0)
        got = lora_group_cuda(x, low, launcher=TORCH_PATH)
        for y, (w, b, a, bb, s, _) in zip(got, low):
            want = lora_linear_reference(x, w, b, a, bb, s, 0.0, False)
            torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5, msg=str(step))


def test_a_stacked_factor_made_inside_a_capture_gets_its_zeros_outside_it(monkeypatch):
    """Work queued inside a CUDA-graph capture runs only when the graph replays: a stacked A made there is
    zeroed again by each call until one outside a capture has done it. (Inside a real capture the fill
    does not run; NaN stands in for what the buffer holds then.)"""
    low, _ = _members(16, [8, 8, 8], [8, 8, 8], torch.float32)  # blocks of 8: 24 rows, bucket 32
    x = torch.randn(5, 16, requires_grad=True)
    monkeypatch.setattr(streams, "capturing", lambda device: True)
    lora_group_cuda(x, low, launcher=TORCH_PATH)
    entry = group_op._stacked[tuple(id(m[2]) for m in low)]
    assert not entry.zeroed and all(entry.captured)
    entry.buffer[24:] = float("nan")
    monkeypatch.setattr(streams, "capturing", lambda device: False)
    got = lora_group_cuda(x, low, launcher=TORCH_PATH)
    assert entry.zeroed and not entry.buffer[24:].any()
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(y.shape, generator=gen) for y in got]
    torch.autograd.backward(got, grads)
    group_grad = x.grad
    x.grad = None
    separate = [lora_linear_cuda(x, *m[:4], m[4], 0.0, True, launcher=TORCH_PATH) for m in low]
    torch.autograd.backward(separate, grads)
    for y, want in zip(got, separate):
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(group_grad, x.grad, rtol=1e-5, atol=1e-5)


def test_the_zero_columns_of_dh_are_kept_per_stream_and_width_not_per_sequence_length(monkeypatch):
    """Plans are kept per shape, so zeros held by each plan would keep device memory for every sequence
    length a run meets: the padding columns are views of one buffer per (device, stream, width) instead, grown to
    a power of two of rows; the outgrown ones stay (a captured graph may read them), and a capture that
    finds the buffer too small gets zeros of its own, kept nowhere."""
    monkeypatch.setattr(group_op, "_zeros", {})
    monkeypatch.setattr(group_op, "_outgrown", [])
    low, _ = _members(16, [8, 8, 8], [8, 8, 8], torch.float32)  # 24 rows of A, bucket 32: 8 zero columns
    for rows in (3, 5, 7, 8):  # 4 rows of zeros, then 8
        x = torch.randn(rows, 16, requires_grad=True)
        outputs = lora_group_cuda(x, low, launcher=TORCH_PATH)
        torch.autograd.backward(outputs, [torch.ones_like(y) for y in outputs])
        alone = [lora_linear_cuda(x, *m[:4], m[4], 0.0, True, launcher=TORCH_PATH) for m in low]
        want = torch.autograd.grad(alone, x, [torch.ones_like(y) for y in alone])[0]
        torch.testing.assert_close(x.grad, want, rtol=1e-5, atol=1e-5)
    (kept,) = group_op._zeros.values()
    assert kept.shape == (8, 8) and not kept.any()
    assert [t.shape for t in group_op._outgrown] == [(4, 8)]
    in_capture = group_op._zero_columns(20, 8, torch.device("cpu"), in_capture=True)
    assert in_capture.shape == (20, 8) and group_op._zeros[(torch.device("cpu"), 0, 8)] is kept
    view = group_op._zero_columns(6, 8, torch.device("cpu"), in_capture=False)
    assert view.shape == (6, 8) and view.data_ptr() == kept.data_ptr()
    grown = group_op._zero_columns(9, 8, torch.device("cpu"), in_capture=False)
    assert grown.shape == (9, 8) and group_op._zeros[(torch.device("cpu"), 0, 8)].shape == (16, 8)
    assert group_op._outgrown[-1] is kept


def test_groups_the_kernels_cannot_take_are_declined():
    x = torch.randn(4, 16)
    wide, _ = _members(16, [8, 8, 8], [16, 16, 32], torch.float32)  # 16 + 16 + 32 = 64: taken
    assert group_reason(x, wide) is None
    wider, _ = _members(16, [8, 8, 8], [16, 17, 32], torch.float32)  # 16 + 32 + 32 = 80
    assert "sum to 80" in group_reason(x, wider)
    assert lora_group_cuda(x, wider, launcher=TORCH_PATH) is None
    assert "empty" in group_reason(torch.randn(0, 16), wide)
    doubles, _ = _members(16, [8, 8], [4, 4], torch.float64, lora_dtype=torch.float64)
    assert lora_group_cuda(torch.randn(4, 16, dtype=torch.float64), doubles, launcher=TORCH_PATH) is None


def test_bad_members_raise_as_the_single_layer_op_words_it():
    low, _ = _members(16, [8, 8], [4, 4], torch.float32)
    bad = [low[0], (low[1][0], low[1][1], torch.randn(4, 15), low[1][3], 1.0, False)]
    with pytest.raises(CudaLoraError, match=r"lora_A \(4, 15\); expected \(r, 16\)"):
        lora_group_cuda(torch.randn(3, 16), bad, launcher=TORCH_PATH)
    with pytest.raises(CudaLoraError, match="must be on one CUDA device"):
        lora_group_cuda(torch.randn(3, 16), low)  # no launcher: CUDA tensors required


# ---- the kernels themselves, emulated ------------------------------------------------------------------

EMULATED = [
    # rows, in, outs, ranks, dtype, bias, fifo
    pytest.param(45, 64, [64, 32, 40], [16, 16, 16], torch.bfloat16, True, False, id="bf16-qkv-r16-mma"),
    # blocks of 8 and 16 rows, padded to 32: the h_i are copied out one by one
    pytest.param(29, 45, [37, 21], [5, 16], torch.float32, False, True, id="f32-unaligned-fifo-mixed-blocks"),
]


@pytest.fixture(scope="module")
def emulated(request) -> EmulatedLauncher:
    if CXX is None:
        pytest.skip("g++ is needed to build the emulated kernels")
    launcher = EmulatedLauncher(cache_folder(request.config, "loragen-emulated-kernels"), target_blocks=4)
    variants = {
        Variant(str(dtype).removeprefix("torch."), bucket, aligned)
        for dtype, buckets, aligned in (
            (torch.bfloat16, (16, 64), True),
            (torch.float32, (8, 16, 32), False),
        )
        for bucket in buckets
    }
    launcher.prebuild((specs.LORA_DOWN, v) for v in variants)
    return launcher


@pytest.mark.parametrize(("rows", "k_in", "outs", "ranks", "dtype", "bias", "fifo"), EMULATED)
def test_emulated_kernels_group_equals_separate_layers(emulated, rows, k_in, outs, ranks, dtype, bias, fifo):
    low, high = _members(k_in, outs, ranks, dtype, bias=bias, fifo=fifo)
    x = torch.randn(rows, k_in, generator=torch.Generator().manual_seed(5)).to(dtype).requires_grad_()
    emulated.launches.clear()
    _check_group(x, low, high, emulated, dtype)
    assert sum(name == "lora_down" for name, _, _ in emulated.launches) == 1 + len(outs)  # group + separate


def test_the_group_emulation_script_checks_every_pass(emulated, capsys):
    """scripts/emulate_group_kernels.py (the group's passes at a model's sizes under a sanitizer, by hand:
    minutes per pass) at tiny sizes without a sanitizer: each pass launched as the group launches it, and
    within tolerance."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "scripts" / "emulate_group_kernels.py"
    spec = importlib.util.spec_from_file_location("emulate_group_kernels", path)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    argv = ["--rows", "45", "--features", "64", "--outs", "64,32,40", "--sanitizer", "none"]
    argv += ["--target-blocks", "4", "--build-dir", str(emulated.build_dir)]
    assert script.main(argv) == 0
    out = capsys.readouterr().out
    for name, launches in (("down", 1), ("up", 3), ("grad_out", 3), ("grad_in", 1)):
        (line,) = [line for line in out.splitlines() if line.startswith(f"{name}: ")]
        assert "(ok)" in line and line.count(f"lora_{name} (") == launches, line


@pytest.mark.sanitizers
def test_address_sanitizer_passes_the_group(request):
    """The group's launches under ASan + UBSan: lora_up and lora_grad_out read each h_i through a view
    into the copy of H (an offset into one buffer), lora_grad_in the concatenated dh -- every launch's
    buffers are copied out as the tensors the kernels are handed, so a read past a view is a report."""
    if CXX is None:
        pytest.skip("g++ is needed to build the emulated kernels")
    launcher = EmulatedLauncher(
        cache_folder(request.config, "loragen-emulated-kernels"), target_blocks=4, sanitizer="address"
    )
    launcher.prebuild((specs.LORA_DOWN, Variant("bfloat16", bucket, True)) for bucket in (16, 64))
    low, high = _members(64, [64, 32, 40], [16, 16, 16], torch.bfloat16)
    x = torch.randn(21, 64, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16).requires_grad_()
    ys = lora_group_cuda(x, low, launcher=launcher)
    grads = [
        torch.randn(y.shape, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
        for i, y in enumerate(ys)
    ]
    torch.autograd.backward(list(ys), grads)
    xr = x.detach().double().requires_grad_()
    wanted = [reference(xr, *h, m[4], None, m[5]) for m, h in zip(low, high)]
    torch.autograd.backward(wanted, [g.double() for g in grads])
    for y, want in zip(ys, wanted):
        assert relative_error(y, want) < TOLERANCE[torch.bfloat16]
    assert relative_error(x.grad, xr.grad) < TOLERANCE[torch.bfloat16]
    for m, h in zip(low, high):
        for got, exact in zip(m[:4], h):
            if got is not None:
                assert relative_error(got.grad, exact.grad) < TOLERANCE[torch.bfloat16]
    assert [name for name, _, _ in launcher.launches].count("lora_grad_in") == 1


# ---- through the layers: the CUDA group behind sibling fusion ------------------------------------------


class _Attention(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, 8, bias=False), nn.Linear(d, d)
        self.o = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q(x)
        k = self.k(x)
        v = self.v(x)
        return self.o(q * v) + k.sum(-1, keepdim=True)


@pytest.fixture
def cuda_groups(monkeypatch):
    """Sibling fusion runs CPU tensors through the CUDA group op, its kernels on the torch path."""
    monkeypatch.setattr(siblings, "_runner", lambda x: siblings._cuda_group)
    monkeypatch.setattr(siblings, "_cuda_launcher", TORCH_PATH)


def _model(**kwargs) -> nn.Module:
    torch.manual_seed(0)
    model = loragen.get_lora_model(
        _Attention(),
        loragen.LoraConfig(
            r=kwargs.pop("r", 8), lora_alpha=16, target_modules=["q", "k", "v", "o"], **kwargs
        ),
    )
    for name, p in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p, std=0.3)
    return model


def _run(model, x, fuse):
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    with switches.sibling_fusion.using(fuse):
        y = model(x)
        # weights that do not sum to zero: k's term reaches every column alike, so its gradient would vanish
        (y * torch.linspace(-0.5, 1.5, y.shape[-1], device=y.device, dtype=y.dtype)).sum().backward()
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(a, b):
    torch.testing.assert_close(a[0], b[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a[1], b[1], atol=1e-5, rtol=1e-5)
    assert a[2].keys() == b[2].keys()
    for name in a[2]:
        torch.testing.assert_close(a[2][name], b[2][name], atol=1e-5, rtol=1e-5, msg=name)


def test_layers_fuse_through_the_cuda_group_and_equal_unfused_layers(cuda_groups):
    model = _model()
    x = torch.randn(2, 5, 16)
    assert fused_groups(model) == [("q", "k", "v")]
    assert "_CudaGroupFunctionBackward" in autograd_node_names(model(x.requires_grad_()))
    for _ in range(2):
        _assert_same(_run(model, x, True), _run(model, x, False))
    assert getattr(siblings._local, "handout", None) is None  # every hand-out was taken


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_under_autocast_layers_fuse_through_the_cuda_group_and_match_unfused_layers(cuda_groups, x_dtype):
    """Trainer's bf16=True on a float32 model: the group runs (one node) -- on a bf16 input too, whose
    dtype is not the weights' --, its outputs bf16 as each layer's under autocast, and its outputs and
    gradients within bf16 rounding of the unfused layers'."""
    model = _model()
    x = torch.randn(2, 5, 16).to(x_dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert "_CudaGroupFunctionBackward" in autograd_node_names(model(x.requires_grad_()))
        fused, plain = _run(model, x, True), _run(model, x, False)
    assert fused[0].dtype == plain[0].dtype == torch.bfloat16
    assert fused[1].dtype == x_dtype
    assert relative_error(fused[0], plain[0]) < 2e-2
    assert relative_error(fused[1], plain[1]) < 2e-2
    assert fused[2].keys() == plain[2].keys()
    for name in fused[2]:
        assert relative_error(fused[2][name], plain[2][name]) < 2e-2, name


@pytest.mark.parametrize("kind", ["llama", "bert", "t5"])
def test_under_autocast_real_architectures_train_through_cuda_groups(cuda_groups, kind, monkeypatch):
    """Tiny transformers models (their own modeling files: Llama's q/k/v and gate/up, BERT's
    query/key/value, T5's q/k/v), every linear adapted, the forward under bf16 autocast as Trainer's
    ``bf16=True`` runs it, each layer on the CUDA op as on a GPU: the sibling groups run as CUDA group
    nodes, the logits equal the unfused model's, and every gradient is within bf16 rounding of the unfused
    model's (the group rounds each dx once, in float32, where separate layers round each member's term)."""
    from loragen.ops import dispatch
    from tests.conftest import TINY_MODELS, tiny_inputs

    class CudaOpOnCpuTensors:
        @staticmethod
        def apply(x, w, b, a, bb, scaling, p, rng, seed, fifo):
            return lora_linear_cuda(
                x, w, b, a, bb, scaling, p, True, fan_in_fan_out=fifo, launcher=TORCH_PATH
            )

    monkeypatch.setattr(dispatch, "LoraLinearFunction", CudaOpOnCpuTensors)
    monkeypatch.setattr(dispatch, "fallback_reason", lambda x, dropout: None)  # as for CUDA tensors
    torch.manual_seed(0)
    config = loragen.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    model = loragen.get_lora_model(TINY_MODELS[kind](), config).train()
    with torch.no_grad():  # B starts at zero: make the LoRA terms count
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.3)
    assert fused_groups(model)
    results = {}
    for fuse in (True, False):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)  # the model's own dropout draws the same masks in both runs
        with switches.sibling_fusion.using(fuse), torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(**tiny_inputs(kind)).logits
        assert logits.dtype == torch.bfloat16
        assert ("_CudaGroupFunctionBackward" in autograd_node_names(logits)) == fuse
        logits.float().square().mean().backward()
        results[fuse] = (logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    (fused, fused_grads), (plain, plain_grads) = results[True], results[False]
    assert torch.equal(fused, plain)
    assert fused_grads.keys() == plain_grads.keys()
    for name, grad in fused_grads.items():
        assert grad.dtype == torch.float32 and relative_error(grad, plain_grads[name]) < 3e-2, name


def test_a_member_called_with_another_tensor_or_a_modified_one_computes_its_own(cuda_groups):
    class Rebound(_Attention):
        def forward(self, x):
            q = self.q(x)
            x.mul_(3)  # the same object, a new version: k must not take q's hand-out
            return q + self.k(x).sum(-1, keepdim=True) + self.v(x * 1)  # v: another tensor

    torch.manual_seed(0)
    model = loragen.get_lora_model(Rebound(), loragen.LoraConfig(r=4, target_modules=["q", "k", "v"]))
    x = torch.randn(4, 16)
    with switches.sibling_fusion.using(True):
        fused = model(x.clone())
    with switches.sibling_fusion.using(False):
        plain = model(x.clone())
    torch.testing.assert_close(fused, plain, atol=1e-6, rtol=1e-5)


def test_a_member_called_outside_the_leaders_autocast_computes_its_own(cuda_groups):
    """The leader ran under autocast (its hooks enter and leave the region around its call), which made
    bf16 outputs for every member; k and v, called after the region, compute their own float32 outputs,
    as they would unfused."""
    torch.manual_seed(0)
    model = _model()
    region = torch.autocast("cpu", dtype=torch.bfloat16)

    def enter(module, args):
        region.__enter__()

    def leave(module, args, output):
        region.__exit__(None, None, None)

    model.q.register_forward_pre_hook(enter)
    model.q.register_forward_hook(leave)
    outputs = {}
    for name in ("q", "k", "v"):
        getattr(model, name).register_forward_hook(lambda m, a, y, name=name: outputs.__setitem__(name, y))
    x = torch.randn(4, 16)
    with switches.sibling_fusion.using(True):
        model(x)
        fused = dict(outputs)
    with switches.sibling_fusion.using(False):
        model(x)
    assert [fused[n].dtype for n in ("q", "k", "v")] == [torch.bfloat16, torch.float32, torch.float32]
    assert relative_error(fused["q"], outputs["q"]) < 2e-2  # the group's float32 h against bf16 products
    for name in ("k", "v"):
        torch.testing.assert_close(fused[name], outputs[name], atol=1e-6, rtol=1e-5, msg=name)


def test_a_member_whose_parameters_changed_after_the_leader_ran_computes_its_own(cuda_groups):
    class Bumped(_Attention):
        def forward(self, x):
            q = self.q(x)
            with torch.no_grad():
                self.k.lora_A.add_(0.5)  # after the leader computed k's output
            return q + self.k(x).sum(-1, keepdim=True) + self.v(x)

    torch.manual_seed(0)
    model = loragen.get_lora_model(Bumped(), loragen.LoraConfig(r=4, target_modules=["q", "k", "v"]))
    reference = copy.deepcopy(model)
    x = torch.randn(4, 16)
    with switches.sibling_fusion.using(True):
        fused = model(x)
    with switches.sibling_fusion.using(False):
        plain = reference(x)
    torch.testing.assert_close(fused, plain, atol=1e-6, rtol=1e-5)


def test_merged_disabled_unfused_and_dropout_members_fall_back(cuda_groups):
    model = _model()
    x = torch.randn(4, 16, requires_grad=True)
    model.k.fused = False  # opts out: q and v still share
    assert "_CudaGroupFunctionBackward" in autograd_node_names(model(x))
    model.k.fused = True
    loragen.merge_adapter(model)
    assert "_CudaGroupFunctionBackward" not in autograd_node_names(model(x))
    loragen.unmerge_adapter(model)
    with loragen.disable_adapter(model):
        assert "_CudaGroupFunctionBackward" not in autograd_node_names(model(x))
    dropout = _model(lora_dropout=0.1).train()
    assert "_CudaGroupFunctionBackward" not in autograd_node_names(dropout(x))
    assert "_CudaGroupFunctionBackward" in autograd_node_names(dropout.eval()(x))


def test_ranks_past_the_largest_bucket_run_each_layer_alone(cuda_groups):
    model = _model(r=32)  # 32 + 32 + 32 > 64
    x = torch.randn(3, 16)
    assert "_CudaGroupFunctionBackward" not in autograd_node_names(model(x.requires_grad_()))
    assert getattr(siblings._local, "handout", None) is None
    _assert_same(_run(model, x, True), _run(model, x, False))


# ---- host work: counted on the null driver (benchmarks/cuda_group_host.py) ---------------------------------

# Ceilings per forward + backward of q, k, v (64 tokens, 1024 -> 3 x 1024, r=16, float32 adapters, torch
# 2.13) for Python calls / C calls / torch ops / allocations, plus a margin. Counted: the group op
# 158 / 256-258 / 104-106 / 15-17 against 266 / 338 / 108 / 25 for three lora_linear_cuda calls; through
# the layers 305 / 357-359 / 104-106 / 15-17 against 369 / 395 / 108 / 25. Under bf16 autocast (x and
# weights float32, cast by each op and by the group): the group op 174 / 303 / 126 / 22, the layers
# 321 / 404 / 126 / 22 against 391 / 489 / 144 / 33. (Before each call asked once whether a CUDA graph is
# being captured and the dh padding became a view of zeros kept per stream: the group op 155 / 255-257 /
# 102-104 / 15-17, the layers 302 / 353-355.)
GROUP_CEILINGS = {
    "group op": {"python_calls": 161, "c_calls": 262, "torch_ops": 109, "allocations": 18},
    "group layers": {"python_calls": 310, "c_calls": 362, "torch_ops": 109, "allocations": 18},
}


@pytest.mark.parametrize(
    ("dtype", "autocast"),
    [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)],
    ids=["float32", "bfloat16", "float32-autocast"],
)
def test_a_group_does_less_host_work_than_separate_layers(dtype, autocast):
    """Counted on the null driver; under bf16 autocast (a float32 model as Trainer's bf16=True runs it)
    the group runs too, on x and weights cast to bf16 (its ceilings are those without autocast's casts)."""
    counts = group_counts("q, k, v", dtype, autocast=autocast)
    print(f"\n{dtype}: " + ", ".join(f"{kind}: {c}" for kind, c in counts.items()))
    assert counts["separate ops"].launches == counts["separate layers"].launches == 12
    assert counts["group op"].launches == counts["group layers"].launches == 8
    for field in ("python_calls", "c_calls", "allocations"):
        assert getattr(counts["group op"], field) < getattr(counts["separate ops"], field), field
        assert getattr(counts["group layers"], field) < getattr(counts["separate layers"], field), field
    for kind, ceilings in GROUP_CEILINGS.items() if not autocast else ():
        for field, ceiling in ceilings.items():
            assert getattr(counts[kind], field) <= ceiling, (kind, field, counts[kind])


@pytest.mark.parametrize(("group", "separate", "grouped"), [("q, k, v", 32, 24), ("gate, up", 21, 18)])
def test_a_group_launches_fewer_kernels_at_model_sizes(group, separate, grouped):
    """At 2048 tokens and 2048 features (meta tensors): loragen's launches plus torch's kernel-launching ops.
    The group drops k - 1 lora_down and lora_grad_in launches, their partial sums and autograd's k - 1
    additions of x-gradients, and adds one copy (the h_i) and one concatenation (the dh_i)."""
    work = device_work(group)
    print(f"\n{group}: {work}")
    assert work["separate ops"]["loragen launches"] + work["separate ops"]["torch kernels"] == separate
    assert work["group op"]["loragen launches"] + work["group op"]["torch kernels"] == grouped
    assert "add" not in work["group op"] and work["group op"]["cat"] == work["group op"]["clone"] == 1


def test_no_group_step_waits_for_the_device():
    """On ``meta`` tensors (no values), no op of a group's forward + backward reads a device value or copies
    between host and device: the stacked A is refreshed on the device, the padding is kept there."""
    launcher = NullLauncher()
    step = group_step("group op", launcher, device="meta", dtype=torch.bfloat16)
    recorder = SyncRecorder()
    with recorder.watching():
        step()  # plans and fills the caches
        recorder.syncs.clear()
        step()
    assert recorder.syncs == []


# ---- on a GPU (skipped without one) ----------------------------------------------------------------------

needs_gpu = pytest.mark.skipif(
    not loragen.cuda.is_available(), reason="needs a CUDA GPU and cuda-python (pip install -e '.[cuda]')"
)


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_on_a_gpu_layers_fuse_through_the_kernels_and_equal_separate_layers(dtype):
    torch.manual_seed(0)
    model = _model().to(device="cuda", dtype=dtype)
    x = torch.randn(2, 37, 16, device="cuda", dtype=dtype)
    with switches.cuda_sibling_fusion.using(True):
        assert "_CudaGroupFunctionBackward" in autograd_node_names(model(x.requires_grad_()))
        fused, plain = _run(model, x, True), _run(model, x, False)
    for got, want in ((fused[0], plain[0]), (fused[1], plain[1])):
        assert relative_error(got, want.cpu().double()) < TOLERANCE[dtype]
    for name in plain[2]:
        assert relative_error(fused[2][name], plain[2][name].cpu().double()) < TOLERANCE[dtype], name


@needs_gpu
def test_on_a_gpu_under_autocast_layers_fuse_and_equal_separate_layers():
    """A float32 model under CUDA bf16 autocast: the group runs, in bf16, and matches separate layers."""
    torch.manual_seed(0)
    model = _model().to(device="cuda")
    x = torch.randn(2, 37, 16, device="cuda")
    with switches.cuda_sibling_fusion.using(True), torch.autocast("cuda", dtype=torch.bfloat16):
        assert "_CudaGroupFunctionBackward" in autograd_node_names(model(x.requires_grad_()))
        fused, plain = _run(model, x, True), _run(model, x, False)
    assert fused[0].dtype == plain[0].dtype == torch.bfloat16 and fused[1].dtype == torch.float32
    for got, want in ((fused[0], plain[0]), (fused[1], plain[1])):
        assert relative_error(got, want.cpu().double()) < TOLERANCE[torch.bfloat16]
    for name in plain[2]:
        want = plain[2][name].cpu().double()
        assert relative_error(fused[2][name], want) < TOLERANCE[torch.bfloat16], name


@needs_gpu
def test_on_a_gpu_a_captured_group_reads_its_factors_afresh_on_every_replay():
    low, _ = _members(64, [64, 32, 64], [16, 16, 16], torch.bfloat16)
    low = [tuple(t.cuda().detach() if isinstance(t, torch.Tensor) else t for t in m) for m in low]
    x = torch.randn(40, 64, device="cuda").to(torch.bfloat16)
    lora_group_cuda(x, low)  # checks the variants and fills the caches before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = lora_group_cuda(x, low)
    with torch.no_grad():
        low[1][2].mul_(-3)  # in place, between replays
    graph.replay()
    for y, m in zip(captured, low):
        want = lora_linear_cuda(x, *m[:4], m[4], 0.0, False)
        assert relative_error(y, want.cpu().double()) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("on_cuda_path", [False, True])
def test_a_member_called_with_gradients_on_does_not_take_an_output_made_without(on_cuda_path, monkeypatch):
    """The leader runs under ``torch.no_grad()``, a follower with gradients on: the follower's output must
    carry its graph, so it computes its own rather than taking the leader's graph-less one."""
    if on_cuda_path:
        monkeypatch.setattr(siblings, "_runner", lambda x: siblings._cuda_group)
        monkeypatch.setattr(siblings, "_cuda_launcher", TORCH_PATH)

    torch.manual_seed(0)
    model = loragen.get_lora_model(_Attention(), loragen.LoraConfig(r=4, target_modules=["q", "k", "v"]))
    assert fused_groups(model) == [("q", "k", "v")]

    # q (the leader) runs without gradients: hooks switch them off around its call only
    def gradients_off(module, args):
        torch.set_grad_enabled(False)

    def gradients_on(module, args, output):
        torch.set_grad_enabled(True)

    model.q.register_forward_pre_hook(gradients_off)
    model.q.register_forward_hook(gradients_on)
    x = torch.randn(4, 16)
    model(x).sum().backward()
    assert model.k.lora_A.grad is not None and model.v.lora_A.grad is not None
    assert model.q.lora_A.grad is None
    reference = copy.deepcopy(model)
    for m in (model, reference):
        m.zero_grad(set_to_none=True)
    with switches.sibling_fusion.using(True):
        model(x).sum().backward()
    with switches.sibling_fusion.using(False):
        reference(x).sum().backward()
    for name in ("k", "v"):
        torch.testing.assert_close(getattr(model, name).lora_A.grad, getattr(reference, name).lora_A.grad)


def _replace_factor(model):
    with torch.no_grad():
        model.k.lora_A = nn.Parameter(model.k.lora_A * -2)  # another tensor object, its version 0


def _change_scaling(model):
    model.k.running_adapter().scaling *= 3


def _switch_adapter(model):
    model.k.active_adapter = "other"  # k now runs its second adapter, not the one the leader read


@pytest.mark.parametrize("on_cuda_path", [False, True])
@pytest.mark.parametrize("change", [_replace_factor, _change_scaling, _switch_adapter])
def test_a_member_changed_after_the_leader_ran_computes_its_own(change, on_cuda_path, monkeypatch):
    """q's forward hook changes k after q (the leader) computed k's output: k must not take it."""
    if on_cuda_path:
        monkeypatch.setattr(siblings, "_runner", lambda x: siblings._cuda_group)
        monkeypatch.setattr(siblings, "_cuda_launcher", TORCH_PATH)
    outputs = {}
    for fuse in (True, False):
        model = _model()
        # the same scaling as the first adapter (16 / 8): only the adapter itself differs
        loragen.add_adapter(model, loragen.LoraConfig(r=2, lora_alpha=4, target_modules=["k"]), "other")
        with torch.no_grad():
            model.k.lora_adapters.other.lora_B.normal_()  # B = 0 at init would make its term vanish
        model.q.register_forward_hook(lambda module, args, output, model=model: change(model))
        model.k.register_forward_hook(
            lambda module, args, output, fuse=fuse: outputs.__setitem__(fuse, output)
        )
        with switches.sibling_fusion.using(fuse):
            model(torch.randn(4, 16, generator=torch.Generator().manual_seed(0)))
    assert not torch.allclose(
        outputs[True], _model().k(torch.randn(4, 16, generator=torch.Generator().manual_seed(0)))
    )
    torch.testing.assert_close(outputs[True], outputs[False], atol=1e-6, rtol=1e-5)


def test_a_group_routed_to_the_whole_op_torch_path_runs_its_members_alone():
    """Where the torch path runs the whole op as a composition with torch's autograd (the switch set to
    torch, a failed self-check, a whole-op TorchKernels), the group declines and each member takes that
    leaner path."""
    low, _ = _members(32, (24, 16), (4, 8), torch.float32)
    x = torch.randn(5, 32, requires_grad=True)
    assert lora_group_cuda(x, low, launcher=TorchKernels()) is None
    assert lora_group_cuda(x, low, launcher=TORCH_PATH) is not None


def test_cuda_tensors_run_as_groups_only_with_the_cuda_switch_on(monkeypatch):
    """Sibling fusion on CUDA tensors is opt-in (switches.cuda_sibling_fusion): off, each layer runs alone."""
    monkeypatch.setattr(siblings.cuda, "is_available", lambda: True)
    x = SimpleNamespace(is_cpu=False, is_cuda=True)
    assert siblings._runner(x) is None
    with switches.cuda_sibling_fusion.using(True):
        assert siblings._runner(x) is siblings._cuda_group


@pytest.mark.parametrize("built", [True, False])
def test_with_the_cpp_host_path_on_cuda_layers_take_it_instead_of_groups(monkeypatch, built):
    """Both switches on: where the C++ host path is built each layer takes it (its host work per layer is
    a fraction of a group member's); where it is not, the groups run."""
    from loragen.cuda import native_host

    monkeypatch.setattr(siblings.cuda, "is_available", lambda: True)
    monkeypatch.setattr(native_host, "available", lambda: built)
    x = SimpleNamespace(is_cpu=False, is_cuda=True)
    with switches.cuda_sibling_fusion.using(True), switches.cuda_native_host.using(True):
        assert siblings._runner(x) is (None if built else siblings._cuda_group)
