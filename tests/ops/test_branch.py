"""The LoRA branch op (base output computed elsewhere + scaling * B A dropout(x)) against the formula with
the same keep-mask, in float64 and float32 (the compiled dropout kernels where the CPU has them)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from loragen import switches
from loragen.ops.fused import lora_branch
from loragen.ops.masks import dropout_keep_bits, unpack_keep_mask
from loragen.reference import lora_branch_reference


def _inputs(dtype: torch.dtype, rows: int = 6, d_in: int = 24, d_out: int = 20, r: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, rows, d_in, generator=g, dtype=dtype, requires_grad=True)
    base_in = torch.randn(2, rows, d_out, generator=g, dtype=dtype, requires_grad=True)
    a = torch.randn(r, d_in, generator=g, dtype=dtype, requires_grad=True)
    b = torch.randn(d_out, r, generator=g, dtype=dtype, requires_grad=True)
    return x, base_in, a, b


def _expected(x, base, a, b, scaling, p, seed):
    numel = x.numel()
    keep = unpack_keep_mask(dropout_keep_bits(numel, p, seed), numel).view(x.shape).to(x.dtype)
    return base + ((x * keep / (1 - p)) @ a.t() @ b.t()) * scaling


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@given(p=st.sampled_from([0.0, 0.1, 0.5]), seed=st.integers(0, 2**32))
def test_branch_matches_formula_with_the_same_mask(dtype: torch.dtype, p: float, seed: int) -> None:
    # float32: values of magnitude ~10 (sums of products of unit normals), summed in another order by the
    # compiled kernels (their reduction order depends on the thread count)
    tol = dict(rtol=1e-9, atol=1e-9) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-4)
    x, base_in, a, b = _inputs(dtype, seed=seed % 100)
    out = lora_branch(base_in * 1.0, x, a, b, 0.75, p, True, seed=seed)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (x, base_in, a, b), grad)
    expected = _expected(x, base_in * 1.0, a, b, 0.75, p, seed)
    want = torch.autograd.grad(expected, (x, base_in, a, b), grad)
    torch.testing.assert_close(out, expected, **tol)
    for g_got, g_want in zip(got, want):
        torch.testing.assert_close(g_got, g_want, **tol)


def test_sum_is_written_into_the_base_output() -> None:
    x, base_in, a, b = _inputs(torch.float32)
    base = base_in.detach() * 1.0
    out = lora_branch(base, x, a, b, 2.0, 0.0, True)
    assert out.data_ptr() == base.data_ptr()
    view_owner = torch.zeros(2, 6, 30)
    view = view_owner[..., :20]
    out = lora_branch(view, x, a, b, 2.0, 0.0, True)  # a view is left alone
    assert out.data_ptr() != view.data_ptr() and not view_owner.any()


def test_half_precision_base_matches_peft_order_bit_for_bit() -> None:
    x, base_in, a, b = _inputs(torch.float32)
    x16, base16 = x.detach().bfloat16(), base_in.detach().bfloat16()
    out = lora_branch(base16.clone(), x16, a, b, 0.5, 0.0, True)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, lora_branch_reference(base16, x16, a, b, 0.5, 0.0, True))


def test_empty_input_and_errors() -> None:
    a, b = torch.randn(2, 8, requires_grad=True), torch.randn(3, 2, requires_grad=True)
    out = lora_branch(torch.zeros(0, 3), torch.zeros(0, 8), a, b, 1.0, 0.2, True)
    out.sum().backward()
    assert out.shape == (0, 3) and a.grad is not None and not a.grad.any()
    with pytest.raises(ValueError, match=r"dropout_p=1\.0"):
        lora_branch(torch.zeros(1, 3), torch.zeros(1, 8), a, b, 1.0, 1.0, True)
    with pytest.raises(ValueError, match=r"leading \(batch\) dimensions"):
        lora_branch(torch.zeros(2, 3), torch.zeros(1, 8), a, b, 1.0, 0.0, True)


@pytest.mark.parametrize("compiled_kernels", [True, False])
def test_dropout_with_an_input_that_needs_no_gradient(compiled_kernels: bool) -> None:
    """QLoRA's usual case: the base output and x carry no gradient (a frozen 4-bit model's first layer),
    dropout is on, only A and B train. Both dropout paths (compiled kernels and numpy/BLAS) give A and B
    the formula's gradients."""
    x, base_in, a, b = _inputs(torch.float32, rows=10)
    x, base = x.detach(), base_in.detach()
    with switches.cpu_kernels.using(compiled_kernels):
        out = lora_branch(base.clone(), x, a, b, 0.5, 0.05, True, seed=11)
        grad = torch.randn_like(out)
        got = torch.autograd.grad(out, (a, b), grad)
    want = torch.autograd.grad(_expected(x, base, a, b, 0.5, 0.05, 11), (a, b), grad)
    for g_got, g_want in zip(got, want):
        torch.testing.assert_close(g_got, g_want, rtol=1e-5, atol=1e-5)
