"""Every fast op against the one reference composition (loragen.reference, peft's math): outputs and the
gradients of every input, with the dropout mask the op drew given to the reference. The CPU ops
(lora_linear, lora_branch, dora_linear) in float64; the CUDA op's torch path (the launcher the
kernels fall back to) in float32, its only dtype of products, against the float64 reference; the expert
products (weight space) against a per-expert loop written from the layout's definition. Each op's
backward is hand-written; this is where all of them are held to one definition."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from loragen import philox
from loragen.cuda.linear_op import lora_linear_cuda
from loragen.cuda.selfcheck import TorchKernels
from loragen.layers.expert_parameters import effective_weight, recompute_on_backward
from loragen.layouts import EXPERTS, EXPERTS_TRANSPOSED, ParameterLayout
from loragen.ops.fused import DoraLinearFunction, LoraBranchFunction, LoraLinearFunction
from loragen.ops.masks import dropout_keep_bits, unpack_keep_mask
from loragen.reference import dora_linear_reference, lora_branch_reference, lora_linear_reference

SEED = 1234
SCALING = 1.5
Tensors = dict[str, torch.Tensor | None]


def _tensors(ffo: bool, bias: bool, seed: int = 0, out: int = 5) -> Tensors:
    g = torch.Generator().manual_seed(seed)
    k, r = 7, 3

    def t(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_(True)

    weight = t(k, out) if ffo else t(out, k)
    return {
        "weight": weight,
        "bias": t(out) if bias else None,
        "lora_A": t(r, k),
        "lora_B": t(out, r),
        "magnitude": (torch.rand(out, generator=g, dtype=torch.float64) + 0.5).requires_grad_(True),
    }


def _keep(x: torch.Tensor, p: float) -> torch.Tensor | None:
    if p == 0.0:
        return None
    return unpack_keep_mask(dropout_keep_bits(x.numel(), p, SEED), x.numel()).view(x.shape)


# each case: (fast, reference), both (x, tensors, p, ffo) -> output; the reference gets the mask
def _linear(x, t, p, ffo):
    args = (x, t["weight"], t["bias"], t["lora_A"], t["lora_B"], SCALING, p)
    return LoraLinearFunction.apply(*args, SEED, ffo)


def _linear_ref(x, t, p, ffo):
    args = (x, t["weight"], t["bias"], t["lora_A"], t["lora_B"], SCALING, p, True)
    return lora_linear_reference(*args, fan_in_fan_out=ffo, keep=_keep(x, p))


def _base(x, t, ffo):
    return F.linear(x, t["weight"].t() if ffo else t["weight"], t["bias"])


def _branch(x, t, p, ffo):
    return LoraBranchFunction.apply(_base(x, t, ffo), x, t["lora_A"], t["lora_B"], SCALING, p, SEED)


def _branch_ref(x, t, p, ffo):
    args = (_base(x, t, ffo), x, t["lora_A"], t["lora_B"], SCALING, p, True)
    return lora_branch_reference(*args, keep=_keep(x, p))


def _dora(x, t, p, ffo):
    args = (x, t["weight"], t["bias"], t["lora_A"], t["lora_B"], t["magnitude"], SCALING, p, SEED, ffo)
    return DoraLinearFunction.apply(*args)


def _dora_ref(x, t, p, ffo):
    args = (x, t["weight"], t["bias"], t["lora_A"], t["lora_B"], t["magnitude"], SCALING, p, True)
    return dora_linear_reference(*args, fan_in_fan_out=ffo, keep=_keep(x, p))


OPS: dict[str, tuple[Callable, Callable]] = {
    "lora_linear": (_linear, _linear_ref),
    "lora_branch": (_branch, _branch_ref),
    "dora_linear": (_dora, _dora_ref),
}


def _check(fast: Callable, reference: Callable, tensors: Tensors, x: torch.Tensor) -> None:
    inputs = [x, *(v for v in tensors.values() if v is not None and v.requires_grad)]
    got, want = fast(), reference()
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    grad = torch.randn(got.shape, generator=torch.Generator().manual_seed(5), dtype=got.dtype)
    got_grads = torch.autograd.grad(got, inputs, grad, allow_unused=True)
    want_grads = torch.autograd.grad(want, inputs, grad, allow_unused=True)
    for g_got, g_want in zip(got_grads, want_grads):
        if g_want is None:  # an input the op does not use (DoRA's magnitude in the others)
            assert g_got is None
        else:
            torch.testing.assert_close(g_got, g_want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("ffo", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_op_equals_the_reference_in_float64(op: str, p: float, ffo: bool, bias: bool) -> None:
    tensors = _tensors(ffo, bias)
    if op == "dora_linear":  # the fused DoRA op takes a frozen base (dora_linear routes others away)
        tensors["weight"].requires_grad_(False)
    else:
        tensors["magnitude"].requires_grad_(False)
    x = torch.randn(2, 4, 7, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    x.requires_grad_(True)
    fast, reference = OPS[op]
    _check(lambda: fast(x, tensors, p, ffo), lambda: reference(x, tensors, p, ffo), tensors, x)


@pytest.mark.parametrize("whole_op", [True, False], ids=["composition", "passes"])
@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("ffo", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_cuda_torch_path_equals_the_reference(
    monkeypatch: pytest.MonkeyPatch, p: float, ffo: bool, bias: bool, whole_op: bool
) -> None:
    """The CUDA op on its torch route -- the composition with the kernels' Philox mask, or the four passes
    with the hand-written backward -- against the float64 composition with the same mask."""
    from loragen.cuda import linear_op

    high = _tensors(ffo, bias)
    high["magnitude"].requires_grad_(False)
    low = {
        k: None if v is None else v.detach().float().requires_grad_(v.requires_grad) for k, v in high.items()
    }
    x_high = torch.randn(2, 4, 7, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    x_high.requires_grad_(True)
    x_low = x_high.detach().float().requires_grad_(True)
    # with a seed, the CUDA op's mask is the Philox mask at offset 0, element (row-major) by element
    keep = philox.dropout_keep_mask(x_high.shape, p, SEED) if p else None

    got = lora_linear_cuda(
        x_low,
        *(low[k] for k in ("weight", "bias", "lora_A", "lora_B")),
        SCALING,
        p,
        True,
        fan_in_fan_out=ffo,
        seed=SEED,
        launcher=TorchKernels(whole_op=whole_op),
    )
    args = (x_low, *(low[k] for k in ("weight", "bias", "lora_A", "lora_B")))
    assert linear_op.unsupported_reason(*args, fan_in_fan_out=ffo) is None  # not the fallback for inputs
    if not whole_op:
        assert type(got.grad_fn).__name__ == "_LoraLinearFunctionBackward"
    want = lora_linear_reference(
        x_high,
        *(high[k] for k in ("weight", "bias", "lora_A", "lora_B")),
        SCALING,
        p,
        True,
        fan_in_fan_out=ffo,
        keep=keep,
    )
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    grad = torch.randn(got.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    names = [k for k in ("weight", "bias", "lora_A", "lora_B") if high[k] is not None]
    got_grads = torch.autograd.grad(got, [x_low, *(low[k] for k in names)], grad.float())
    want_grads = torch.autograd.grad(want, [x_high, *(high[k] for k in names)], grad)
    for name, g_got, g_want in zip(["x", *names], got_grads, want_grads):
        torch.testing.assert_close(
            g_got.double(), g_want, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}"
        )


def _expert_weights_by_loop(
    weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float, layout: ParameterLayout
) -> torch.Tensor:
    """``W_e + s B_e A_e`` one expert at a time, read off the factor layout peft stores: expert e owns rows
    e*r .. e*r+r-1 of A and columns e, e+E, ... of B; a transposed stack stores each update transposed."""
    experts = weight.shape[0]
    r = a.shape[0] // experts
    updated = []
    for e in range(experts):
        update = b[:, e::experts] @ a[e * r : (e + 1) * r]  # (out, in)
        updated.append(weight[e] + scaling * (update.t() if layout is EXPERTS_TRANSPOSED else update))
    return torch.stack(updated)


@pytest.mark.parametrize("layout", [EXPERTS, EXPERTS_TRANSPOSED], ids=lambda layout: layout.name)
@pytest.mark.parametrize("recompute", [False, True])
def test_expert_products_equal_the_per_expert_reference(layout: ParameterLayout, recompute: bool) -> None:
    g = torch.Generator().manual_seed(3)
    experts, in_features, out_features, r = 3, 6, 4, 2
    shape = (
        (experts, in_features, out_features)
        if layout is EXPERTS_TRANSPOSED
        else (experts, out_features, in_features)
    )
    weight = torch.randn(*shape, generator=g, dtype=torch.float64)
    a = torch.randn(r * experts, in_features, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(out_features, r * experts, generator=g, dtype=torch.float64, requires_grad=True)
    x = torch.randn(experts, 5, in_features, generator=g, dtype=torch.float64, requires_grad=True)

    def apply(w: torch.Tensor) -> torch.Tensor:  # each expert's product on its own tokens, as a MoE block
        return torch.bmm(x, w if layout is EXPERTS_TRANSPOSED else w.transpose(1, 2))

    def fast() -> torch.Tensor:
        w = effective_weight(weight, a, b, SCALING, layout)
        if not recompute:
            return apply(w)
        with recompute_on_backward({w: (weight, a, b, SCALING, layout)}):  # w rebuilt in the backward
            return apply(w)

    got, want = fast(), apply(_expert_weights_by_loop(weight, a, b, SCALING, layout))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    grad = torch.randn(got.shape, generator=torch.Generator().manual_seed(5), dtype=got.dtype)
    for g_got, g_want in zip(
        torch.autograd.grad(got, [x, a, b], grad), torch.autograd.grad(want, [x, a, b], grad)
    ):
        torch.testing.assert_close(g_got, g_want, rtol=1e-10, atol=1e-10)


def test_a_keep_mask_of_another_shape_is_refused() -> None:
    from loragen.reference import lora_dropout

    with pytest.raises(ValueError, match=r"keep-mask of shape \(3,\) for x of shape \(2, 3\)"):
        lora_dropout(torch.zeros(2, 3), 0.5, True, torch.ones(3, dtype=torch.bool))
