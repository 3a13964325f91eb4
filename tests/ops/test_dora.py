"""The fused DoRA op (loragen.ops.dora_linear): gradients against finite differences in float64, values
against peft's formula written out with the same dropout mask, fresh outputs, empty inputs, what it
saves, and where it hands over to the plain composition."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from loragen import switches
from loragen.ops.fused import DoraLinearFunction, dora_linear
from loragen.ops.masks import dropout_keep_bits, unpack_keep_mask
from loragen.reference import dora_linear_reference, dora_weight_norm


def _tensors(
    rows: int,
    d_in: int,
    d_out: int,
    r: int,
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
    ffo: bool = False,
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=dtype)

    weight = rand(d_out, d_in)
    return {
        "x": rand(rows, d_in).requires_grad_(),
        "weight": (weight.t().contiguous() if ffo else weight),
        "bias": rand(d_out).requires_grad_(),
        "lora_A": rand(r, d_in).requires_grad_(),
        "lora_B": rand(d_out, r).requires_grad_(),
        "magnitude": (torch.rand(d_out, generator=g, dtype=dtype) + 0.5).requires_grad_(),
    }


def _by_formula(
    t: dict[str, torch.Tensor], scaling: float, keep: torch.Tensor, p: float, ffo: bool
) -> torch.Tensor:
    """peft's DoRA written out: x W^T + b + (c - 1) (xd W^T) + c s (xd A^T) B^T, c = m / ||W + s B A||."""
    w = t["weight"].t() if ffo else t["weight"]
    norm = torch.linalg.vector_norm(w + scaling * t["lora_B"] @ t["lora_A"], dim=1).detach()
    c = t["magnitude"] / norm
    xd = t["x"] * keep / (1 - p)
    return (
        t["x"] @ w.t()
        + t["bias"]
        + (c - 1) * (xd @ w.t())
        + c * scaling * (xd @ t["lora_A"].t() @ t["lora_B"].t())
    )


def _keep(numel: int, p: float, seed: int) -> torch.Tensor:
    return unpack_keep_mask(dropout_keep_bits(numel, p, seed), numel).to(torch.float64)


@pytest.mark.parametrize("ffo", [False, True], ids=["linear", "conv1d-layout"])
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_gradcheck_float64(p: float, ffo: bool) -> None:
    t = _tensors(7, 6, 5, 3, ffo=ffo)
    w = t["weight"].t() if ffo else t["weight"]
    # the norm is a constant of the backward (detached, as in peft), but moves with A and B under finite
    # differences: pass it fixed
    norm = dora_weight_norm(t["weight"], t["lora_A"], t["lora_B"], 1.5, fan_in_fan_out=ffo)
    assert torch.allclose(norm, torch.linalg.vector_norm(w + 1.5 * t["lora_B"] @ t["lora_A"], dim=1))

    def fn(x, bias, a, b, m):  # type: ignore[no-untyped-def]
        return DoraLinearFunction.apply(x, t["weight"], bias, a, b, m, 1.5, p, 11, ffo, norm)

    inputs = (t["x"], t["bias"], t["lora_A"], t["lora_B"], t["magnitude"])
    assert torch.autograd.gradcheck(fn, inputs)


@given(
    rows=st.integers(0, 9),
    d_in=st.integers(1, 7),
    d_out=st.integers(1, 7),
    r=st.integers(1, 4),
    p=st.sampled_from([0.0, 0.1, 0.5]),
    ffo=st.booleans(),
    seed=st.integers(0, 2**32),
)
def test_equals_peft_formula_with_the_same_mask(
    rows: int, d_in: int, d_out: int, r: int, p: float, ffo: bool, seed: int
) -> None:
    t = _tensors(rows, d_in, d_out, r, ffo=ffo, seed=seed % 1000)
    args = (t["x"], t["weight"], t["bias"], t["lora_A"], t["lora_B"], t["magnitude"], 0.7, p, True)
    y = dora_linear(*args, fan_in_fan_out=ffo, seed=seed)
    expected = _by_formula(t, 0.7, _keep(rows * d_in, p, seed).view(rows, d_in), p, ffo)
    torch.testing.assert_close(y, expected, rtol=1e-10, atol=1e-10)
    g = torch.randn(rows, d_out, dtype=torch.float64, generator=torch.Generator().manual_seed(seed % 1000))
    names = ("x", "bias", "lora_A", "lora_B", "magnitude")
    got = torch.autograd.grad(y, [t[n] for n in names], g)
    want = torch.autograd.grad(expected, [t[n] for n in names], g)
    for name, a, b in zip(names, got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=name)


@pytest.mark.parametrize("p", [0.0, 0.2])
def test_fresh_output_may_be_modified_in_place(p: float) -> None:
    t = _tensors(4, 6, 5, 2, dtype=torch.float32)
    args = (t["x"], t["weight"], t["bias"], t["lora_A"], t["lora_B"], t["magnitude"], 2.0, p, True)
    y = dora_linear(*args, seed=3)
    assert y._base is None and y.data_ptr() != t["x"].data_ptr()
    grads = torch.autograd.grad(y.sum(), [t["x"], t["lora_A"], t["magnitude"]])
    y2 = dora_linear(*args, seed=3)
    y2.mul_(1.0)  # an in-place change, as LED or Longformer make to a projection output
    y2.add_(0.0).sum().backward()
    for got, want in zip((t["x"].grad, t["lora_A"].grad, t["magnitude"].grad), grads):
        torch.testing.assert_close(got, want)


def test_empty_batch() -> None:
    t = _tensors(0, 6, 5, 2, dtype=torch.float32)
    x = t["x"].view(0, 0, 6)
    y = dora_linear(x, t["weight"], t["bias"], t["lora_A"], t["lora_B"], t["magnitude"], 2.0, 0.1, True)
    assert y.shape == (0, 0, 5)
    y.sum().backward()
    assert t["lora_A"].grad is not None and not t["lora_A"].grad.any()
    assert t["magnitude"].grad is not None and not t["magnitude"].grad.any()


@pytest.mark.parametrize(("p", "training"), [(0.0, True), (0.3, False)], ids=["no-dropout", "eval"])
def test_fused_equals_the_composition_in_float32(p: float, training: bool) -> None:
    t = _tensors(16, 12, 10, 4, dtype=torch.float32)
    inputs = [t[n] for n in ("x", "bias", "lora_A", "lora_B", "magnitude")]
    args = (t["weight"], t["bias"], t["lora_A"], t["lora_B"], t["magnitude"], 2.0, p, training)
    fused = dora_linear(t["x"], *args)
    with switches.fused.using(False):
        reference = dora_linear(t["x"], *args)
    assert fused.grad_fn is not None and "DoraLinearFunction" in type(fused.grad_fn).__name__
    torch.testing.assert_close(fused, reference, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(fused)
    for a, b in zip(torch.autograd.grad(fused, inputs, g), torch.autograd.grad(reference, inputs, g)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_saves_no_x_sized_copy() -> None:
    """Saved for backward with dropout: x (a view), h (N, r), the direction's output (N, out), the packed
    mask bits and two (out,) vectors -- no float copy of the mask or of the dropped-out x."""
    t = _tensors(64, 32, 8, 2, dtype=torch.float32)
    saved: list[torch.Tensor] = []

    def pack(s: torch.Tensor) -> torch.Tensor:
        saved.append(s)
        return s

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda s: s):
        dora_linear(t["x"], t["weight"], t["bias"], t["lora_A"], t["lora_B"], t["magnitude"], 2.0, 0.2, True)
    params = {id(t[n]) for n in ("weight", "lora_A", "lora_B")}
    others = [s for s in saved if id(s) not in params]
    big = [s for s in others if s.numel() >= 64 * 8 and s.data_ptr() != t["x"].data_ptr()]
    assert [tuple(s.shape) for s in big] == [(64, 8)]  # the direction's output only
    bits = [s for s in others if s.dtype == torch.uint8]
    assert len(bits) == 1 and bits[0].numel() * 8 >= 64 * 32


def test_training_weight_runs_the_composition_with_a_weight_gradient() -> None:
    t = _tensors(5, 6, 4, 2, dtype=torch.float32)
    weight = t["weight"].clone().requires_grad_()
    args = (t["bias"], t["lora_A"], t["lora_B"], t["magnitude"], 2.0, 0.0, True)
    dora_linear(t["x"], weight, *args).sum().backward()
    expected = weight.detach().clone().requires_grad_()
    dora_linear_reference(t["x"], expected, *args).sum().backward()
    assert weight.grad is not None
    torch.testing.assert_close(weight.grad, expected.grad)


def test_errors_name_the_argument() -> None:
    t = _tensors(2, 6, 4, 2, dtype=torch.float32)
    args = (t["x"], t["weight"], t["bias"], t["lora_A"], t["lora_B"])
    with pytest.raises(ValueError, match=r"dora_linear: dropout_p=1\.0; expected 0 <= p < 1"):
        dora_linear(*args, t["magnitude"], 1.0, 1.0, True)
    with pytest.raises(ValueError, match=r"magnitude has shape \(1, 4\); expected \(4,\)"):
        dora_linear(*args, t["magnitude"].view(1, 4), 1.0, 0.0, True)
