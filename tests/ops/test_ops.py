"""loragen.ops: the fused LoRA op against gradcheck, peft and the plain composition; dropout masks;
checkpointing, compile, dtypes, saved tensors and the fused switch."""

from __future__ import annotations

import copy

import numpy as np
import peft
import pytest
import torch
import torch.utils.checkpoint
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from transformers.pytorch_utils import Conv1D

import loragen
from loragen import LoraConv1D, LoraLinear, ops, philox, switches
from loragen.ops import masks

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_inputs(batch=(7,), k=6, o=5, r=3, *, dtype=torch.float64, bias=True, fan_in_fan_out=False, seed=0):
    """x (*batch, k), weight (o, k) or (k, o), bias (o,), A (r, k), B (o, r); plain tensors."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*batch, k, generator=g, dtype=dtype)
    w = torch.randn(o, k, generator=g, dtype=dtype) / k**0.5
    b = torch.randn(o, generator=g, dtype=dtype) if bias else None
    a = torch.randn(r, k, generator=g, dtype=dtype) / k**0.5
    bb = torch.randn(o, r, generator=g, dtype=dtype)
    if fan_in_fan_out:
        w = w.t().contiguous()
    return x, w, b, a, bb


def grads_of(y: torch.Tensor, grad: torch.Tensor, tensors) -> list:
    wanted = [t for t in tensors if t is not None and t.requires_grad]
    return list(torch.autograd.grad(y, wanted, grad))


# ---- gradcheck and the plain composition --------------------------------------------------------


@pytest.mark.parametrize("p", [0.0, 0.4])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("trainable_base", [False, True])
@pytest.mark.parametrize("fan_in_fan_out", [False, True])
@pytest.mark.parametrize("batch", [(7,), (2, 3)])
def test_gradcheck_every_path(p, bias, trainable_base, fan_in_fan_out, batch) -> None:
    x, w, b, a, bb = make_inputs(batch, bias=bias, fan_in_fan_out=fan_in_fan_out)
    for t in (x, a, bb):
        t.requires_grad_()
    if trainable_base:
        w.requires_grad_()
        if b is not None:
            b.requires_grad_()

    def fn(x, w, b, a, bb):  # a fixed seed fixes the mask across gradcheck's evaluations
        return ops.lora_linear(x, w, b, a, bb, 0.7, p, True, fan_in_fan_out=fan_in_fan_out, seed=1234)

    assert fn(x, w, b, a, bb).grad_fn.name() == "LoraLinearFunctionBackward"
    assert torch.autograd.gradcheck(fn, (x, w, b, a, bb))


@given(
    batch=st.lists(st.integers(1, 4), min_size=1, max_size=3),
    k=st.integers(1, 12),
    o=st.integers(1, 12),
    r=st.integers(1, 5),
    bias=st.booleans(),
    fan_in_fan_out=st.booleans(),
)
def test_equals_the_plain_composition_for_any_shape(batch, k, o, r, bias, fan_in_fan_out) -> None:
    tensors = [
        t if t is None else t.requires_grad_()
        for t in make_inputs(tuple(batch), k, o, r, bias=bias, fan_in_fan_out=fan_in_fan_out)
    ]
    args = (*tensors, 1.5, 0.0, True)
    y = ops.lora_linear(*args, fan_in_fan_out=fan_in_fan_out)
    want = ops.lora_linear_reference(*args, fan_in_fan_out=fan_in_fan_out)
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(y)
    for got, expected in zip(grads_of(y, grad, tensors), grads_of(want, grad, tensors)):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("needs", ["x", "adapter", "base", "x+base"])
def test_only_the_requested_gradients_are_computed(needs: str) -> None:
    tensors = list(make_inputs((4, 3)))
    x, w, b, a, bb = tensors
    chosen = {"x": [x], "adapter": [a, bb], "base": [w, b], "x+base": [x, w, b]}[needs]
    for t in chosen:
        t.requires_grad_()
    y = ops.lora_linear(x, w, b, a, bb, 2.0, 0.0, True)
    want = ops.lora_linear_reference(x, w, b, a, bb, 2.0, 0.0, True)
    grad = torch.randn_like(y)
    for got, expected in zip(grads_of(y, grad, tensors), grads_of(want, grad, tensors)):
        torch.testing.assert_close(got, expected)


def test_non_contiguous_input_and_empty_batch() -> None:
    x, w, b, a, bb = make_inputs((6,), k=5)
    x_t = x.t().contiguous().t().requires_grad_()  # same values, column-major
    assert not x_t.is_contiguous()
    torch.testing.assert_close(
        ops.lora_linear(x_t, w, b, a, bb, 1.0, 0.0, True),
        ops.lora_linear_reference(x, w, b, a, bb, 1.0, 0.0, True),
    )
    torch.testing.assert_close(
        ops.lora_linear(x_t, w, b, a, bb, 1.0, 0.5, True, seed=4),
        ops.lora_linear(x, w, b, a, bb, 1.0, 0.5, True, seed=4),
    )
    empty = torch.zeros(0, 3, 5, dtype=torch.float64, requires_grad=True)
    a.requires_grad_()
    y = ops.lora_linear(empty, w, b, a, bb, 1.0, 0.3, True)
    assert y.shape == (0, 3, 5)
    y.sum().backward()
    assert empty.grad.shape == empty.shape and torch.equal(a.grad, torch.zeros_like(a))


def test_backward_twice_with_retain_graph_gives_the_same_gradients() -> None:
    x, w, b, a, bb = make_inputs((8,))
    a.requires_grad_()
    y = ops.lora_linear(x, w, b, a, bb, 1.0, 0.5, True)
    grad = torch.randn_like(y)
    first = torch.autograd.grad(y, a, grad, retain_graph=True)[0]
    second = torch.autograd.grad(y, a, grad)[0]
    assert torch.equal(first, second)


# ---- peft parity ----------------------------------------------------------------------------------


class Holder(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


def _peft_and_ours(base: nn.Module, fan_in_fan_out: bool, r: int = 4, alpha: float = 6.0):
    config = peft.LoraConfig(
        target_modules=["layer"],
        r=r,
        lora_alpha=alpha,
        init_lora_weights=False,
        fan_in_fan_out=fan_in_fan_out,
    )
    theirs = peft.get_peft_model(Holder(copy.deepcopy(base)), config).base_model.model.layer
    cls = LoraConv1D if fan_in_fan_out else LoraLinear
    ours = cls.from_module(copy.deepcopy(base), r=r, lora_alpha=alpha)
    with torch.no_grad():
        ours.lora_A.copy_(theirs.lora_A["default"].weight)
        ours.lora_B.copy_(theirs.lora_B["default"].weight)
    return theirs, ours


@pytest.mark.parametrize(("kind", "bias"), [("linear", False), ("linear", True), ("conv1D", True)])
@pytest.mark.parametrize("trainable_base", [False, True])
@pytest.mark.parametrize("batch", [(9,), (2, 3, 4)])
def test_outputs_and_gradients_equal_peft_at_dropout_zero(kind, bias, trainable_base, batch) -> None:
    torch.manual_seed(0)
    base = nn.Linear(24, 20, bias=bias) if kind == "linear" else Conv1D(20, 24)  # Conv1D always has a bias
    theirs, ours = _peft_and_ours(base, fan_in_fan_out=kind == "conv1D")
    assert ours.fused
    for layer in (theirs.base_layer, ours):
        layer.weight.requires_grad_(trainable_base)
        if layer.bias is not None:
            layer.bias.requires_grad_(trainable_base)
    x = torch.randn(*batch, 24) / 4  # values and gradients of order 1, where 1e-6 is a few roundings
    x_theirs, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_theirs, y_ours = theirs(x_theirs), ours(x_ours)
    assert y_ours.grad_fn.name() == "ViewBackward0" or "LoraLinearFunction" in y_ours.grad_fn.name()
    torch.testing.assert_close(y_ours, y_theirs, rtol=0, atol=1e-6)
    grad = torch.randn_like(y_ours) / 4
    y_theirs.backward(grad)
    y_ours.backward(grad)
    pairs = [
        (x_ours, x_theirs),
        (ours.lora_A, theirs.lora_A["default"].weight),
        (ours.lora_B, theirs.lora_B["default"].weight),
    ]
    if trainable_base:
        pairs.append((ours.weight, theirs.base_layer.weight))
        if bias:
            pairs.append((ours.bias, theirs.base_layer.bias))
    for mine, reference in pairs:
        torch.testing.assert_close(mine.grad, reference.grad, rtol=0, atol=1e-6)


def _tiny_llama(seed: int = 0) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(
        LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=100,
            max_position_embeddings=64,
        )
    )


def test_tiny_llama_through_get_lora_model_equals_peft() -> None:
    base = _tiny_llama()
    theirs = peft.get_peft_model(
        copy.deepcopy(base),
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False),
    )
    ours = loragen.get_lora_model(
        copy.deepcopy(base), loragen.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS)
    )
    their_layers = {
        n.removeprefix("base_model.model."): m
        for n, m in theirs.named_modules()
        if isinstance(m, peft.tuners.lora.Linear)
    }
    our_layers = {n: m for n, m in ours.named_modules() if isinstance(m, LoraLinear)}
    assert sorted(our_layers) == sorted(their_layers) and len(our_layers) == 14
    with torch.no_grad():
        for name, layer in our_layers.items():
            layer.lora_A.copy_(their_layers[name].lora_A["default"].weight)
            layer.lora_B.copy_(their_layers[name].lora_B["default"].weight)
    ids = torch.randint(0, 100, (2, 11), generator=torch.Generator().manual_seed(3))
    loss_theirs = theirs(input_ids=ids, labels=ids).loss
    loss_ours = ours(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(loss_ours, loss_theirs, rtol=0, atol=1e-6)
    loss_theirs.backward()
    loss_ours.backward()
    for name, layer in our_layers.items():
        torch.testing.assert_close(
            layer.lora_A.grad, their_layers[name].lora_A["default"].weight.grad, rtol=0, atol=1e-6
        )
        torch.testing.assert_close(
            layer.lora_B.grad, their_layers[name].lora_B["default"].weight.grad, rtol=0, atol=1e-6
        )


# ---- dropout masks --------------------------------------------------------------------------------


@pytest.mark.parametrize("p", [0.05, 0.1, 0.5, 0.9])
def test_masks_keep_with_probability_one_minus_p(p: float) -> None:
    n = 200_003
    keep = ops.unpack_keep_mask(ops.dropout_keep_bits(n, p, 17), n).double()
    q = 1 - philox.keep_threshold(p) / 65536
    assert abs(keep.mean().item() - q) < 5 * (q * (1 - q) / n) ** 0.5
    # neighbours (same byte, next byte, next 64-bit word) are uncorrelated
    centered = keep - keep.mean()
    for lag in (1, 8, 64):
        corr = (centered[:-lag] * centered[lag:]).mean() / centered.var()
        assert abs(corr.item()) < 5 / n**0.5


def test_bits_generator_rounds_p_like_philox() -> None:
    assert masks._keep_fraction(0.05) == (65536 - 3277, 16)
    assert masks._keep_fraction(0.5) == (1, 1)  # one random word per 64 elements
    assert masks._keep_fraction(0.25) == (3, 2)
    assert masks._keep_fraction(1e-9) == (1, 0)  # rounds to "keep all"
    assert torch.equal(ops.dropout_keep_bits(100, 1e-9, 1), torch.full((16,), 255, dtype=torch.uint8))


@given(st.lists(st.booleans(), min_size=0, max_size=300))
def test_unpack_reads_the_documented_bit_order(values: list) -> None:
    mask = np.array(values, dtype=bool)
    bits = torch.from_numpy(np.packbits(mask, bitorder="little"))  # element i is bit i % 8 of byte i // 8
    assert torch.equal(ops.unpack_keep_mask(bits, len(values)), torch.from_numpy(mask))


def _identity_setup(n: int, k: int, dtype=torch.float32):
    """W = 0, A = B = I, scaling 1: y = dropout(x), dx = mask / (1 - p) for dy = 1."""
    x = (torch.rand(n, k, dtype=dtype) + 0.5).requires_grad_()
    eye_a = torch.eye(k, dtype=dtype).requires_grad_()
    eye_b = torch.eye(k, dtype=dtype).requires_grad_()
    return x, torch.zeros(k, k, dtype=dtype), eye_a, eye_b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_and_backward_use_the_same_mask(dtype: torch.dtype) -> None:
    p = 0.3
    x, w, a, bb = _identity_setup(50, 40, dtype)
    y = ops.lora_linear(x, w, None, a, bb, 1.0, p, True)
    kept = y != 0
    assert 0.6 < kept.float().mean().item() < 0.8
    torch.testing.assert_close(y[kept], (x / (1 - p))[kept])
    g = torch.ones_like(y)
    y.backward(g)
    assert torch.equal(x.grad != 0, kept)
    torch.testing.assert_close(x.grad[kept], torch.full_like(x.grad[kept], 1 / (1 - p)))
    torch.testing.assert_close(a.grad, (g @ bb).t() @ y.detach())  # dA = (dy B)^T dropout(x)


def test_manual_seed_reproduces_and_eval_disables_dropout() -> None:
    x, w, a, bb = _identity_setup(20, 16)
    torch.manual_seed(5)
    first = ops.lora_linear(x, w, None, a, bb, 1.0, 0.5, True)
    torch.manual_seed(5)
    again = ops.lora_linear(x, w, None, a, bb, 1.0, 0.5, True)
    later = ops.lora_linear(x, w, None, a, bb, 1.0, 0.5, True)
    assert torch.equal(first, again) and not torch.equal(first, later)
    assert torch.equal(ops.lora_linear(x, w, None, a, bb, 1.0, 0.5, False), x)


def test_dropout_output_is_unbiased() -> None:
    x, w, b, a, bb = make_inputs((64,), k=32, o=8, r=4, dtype=torch.float32)
    want = ops.lora_linear(x, w, b, a, bb, 1.0, 0.0, True)
    mean = torch.stack([ops.lora_linear(x, w, b, a, bb, 1.0, 0.2, True) for _ in range(400)]).mean(0)
    assert (mean - want).abs().mean().item() < 0.05 * want.abs().mean().item()


# ---- accumulation and checkpointing ----------------------------------------------------------------


def test_micro_batches_accumulate_to_the_big_batch_result() -> None:
    torch.manual_seed(0)
    layer = LoraLinear(16, 12, r=4, lora_alpha=8, init_lora_weights=False)  # base trainable too (hybrid)
    x = torch.randn(10, 16)
    for p in layer.parameters():
        p.grad = torch.full_like(p, 0.25)  # gradients already there are added to, not replaced
    layer(x).square().sum().backward()
    big = {n: p.grad.clone() for n, p in layer.named_parameters()}
    for p in layer.parameters():
        p.grad = torch.full_like(p, 0.25)
    for part in (x[:3], x[3:7], x[7:]):
        layer(part).square().sum().backward()
    for name, p in layer.named_parameters():
        torch.testing.assert_close(p.grad, big[name], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_torch_checkpoint_recomputes_the_same_mask(use_reentrant: bool) -> None:
    layer = LoraLinear(16, 12, r=4, lora_alpha=8, lora_dropout=0.4, init_lora_weights=False)
    layer.weight.requires_grad_(False)
    x = torch.randn(3, 5, 16, requires_grad=True)

    def grads(checkpointed: bool) -> list:
        tensors = [x, layer.lora_A, layer.lora_B, layer.bias]
        for t in tensors:
            t.grad = None
        torch.manual_seed(11)
        y = (
            torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=use_reentrant)
            if checkpointed
            else layer(x)
        )
        y.square().sum().backward()  # reentrant checkpointing supports .backward() only
        return [t.grad for t in tensors]

    for got, want in zip(grads(True), grads(False)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("kwargs", [None, {"use_reentrant": False}])
def test_transformers_gradient_checkpointing(kwargs) -> None:
    def run(checkpointing: bool):
        model = loragen.get_lora_model(
            _tiny_llama(),
            loragen.LoraConfig(
                r=4, lora_alpha=8, lora_dropout=0.2, target_modules=TARGETS, init_lora_weights=False
            ),
        )
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(1))
        torch.manual_seed(2)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    loss_plain, grads_plain = run(False)
    loss_ckpt, grads_ckpt = run(True)
    assert torch.equal(loss_plain, loss_ckpt)
    assert grads_plain.keys() == grads_ckpt.keys() and len(grads_plain) == 28
    for name, grad in grads_plain.items():
        torch.testing.assert_close(grads_ckpt[name], grad, rtol=0, atol=1e-7)


# ---- torch.compile ---------------------------------------------------------------------------------


def test_compile_traces_the_fused_op_without_dropout() -> None:
    x, w, b, a, bb = make_inputs((4, 5), dtype=torch.float32)
    a.requires_grad_()
    compiled = torch.compile(
        lambda x: ops.lora_linear(x, w, b, a, bb, 2.0, 0.0, True), backend="aot_eager", fullgraph=True
    )  # fullgraph: no graph break anywhere in the op
    x_c, x_e = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_c = compiled(x_c)
    y_e = ops.lora_linear(x_e, w, b, a, bb, 2.0, 0.0, True)
    torch.testing.assert_close(y_c, y_e)
    (g_c,) = torch.autograd.grad(y_c.sum(), [a])
    (g_e,) = torch.autograd.grad(y_e.sum(), [a])
    torch.testing.assert_close(g_c, g_e)


def test_compile_with_dropout_falls_back_to_the_composition() -> None:
    x, w, a, bb = _identity_setup(30, 20)
    compiled = torch.compile(
        lambda x: ops.lora_linear(x, w, None, a, bb, 1.0, 0.5, True), backend="aot_eager"
    )
    y = compiled(x)
    kept = y != 0
    assert 0.3 < kept.float().mean().item() < 0.7
    torch.testing.assert_close(y[kept], (2 * x)[kept])
    y.sum().backward()
    assert torch.equal(x.grad != 0, kept)
    assert ops.fallback_reason(x, dropout=True) is None  # outside compile the fused op runs


@pytest.mark.kernels  # inductor compiles C++ for about a minute
def test_compile_with_inductor() -> None:
    x, w, b, a, bb = make_inputs((4, 5), dtype=torch.float32)
    compiled = torch.compile(lambda x: ops.lora_linear(x, w, b, a, bb, 2.0, 0.0, True))
    torch.testing.assert_close(compiled(x), ops.lora_linear(x, w, b, a, bb, 2.0, 0.0, True))


# ---- dtypes ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_base_with_float32_adapters_matches_peft(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    theirs, ours = _peft_and_ours(nn.Linear(32, 24), fan_in_fan_out=False)
    theirs.to(dtype)
    ours.weight.data, ours.bias.data = ours.weight.data.to(dtype), ours.bias.data.to(dtype)
    for factor in ("lora_A", "lora_B"):  # float32 adapters on a half base, as peft keeps them by default
        param = getattr(theirs, factor)["default"].weight
        param.data = param.data.float()
        getattr(ours, factor).data = param.data.clone()
    x = torch.randn(3, 7, 32, dtype=dtype)
    y_theirs, y_ours = theirs(x), ours(x)
    assert y_ours.dtype == dtype
    torch.testing.assert_close(y_ours, y_theirs)  # dtype-aware tolerance: at most a rounding apart
    grad = torch.randn_like(y_ours)
    y_theirs.backward(grad)
    y_ours.backward(grad)
    torch.testing.assert_close(ours.lora_A.grad, theirs.lora_A["default"].weight.grad, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(ours.lora_B.grad, theirs.lora_B["default"].weight.grad, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_half_precision_adapters_follow_the_float64_math(dtype: torch.dtype, p: float) -> None:
    x, w, b, a, bb = make_inputs((6, 5), k=16, o=12, r=4, dtype=torch.float64)
    args_64 = [t.requires_grad_() for t in (x, w, b, a, bb)]
    args_16 = [t.detach().to(dtype).requires_grad_() for t in args_64]
    y16 = ops.lora_linear(*args_16, 0.5, p, True, seed=3)
    y64 = ops.lora_linear(*args_64, 0.5, p, True, seed=3)  # same seed: same mask
    assert y16.dtype == dtype

    def relative_error(low: torch.Tensor, high: torch.Tensor) -> float:
        return ((low.double() - high).norm() / high.norm()).item()

    assert relative_error(y16, y64) < 1e-2
    grad = torch.randn_like(y64)
    y16.backward(grad.to(dtype))
    y64.backward(grad)
    for low, high in zip(args_16, args_64):  # inputs and grad_out rounded to 8 (bf16) or 11 bits
        assert low.grad.dtype == dtype and relative_error(low.grad, high.grad) < 2e-2


# ---- what is saved for backward ----------------------------------------------------------------------


def _saved(fn) -> list[torch.Tensor]:
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fn()
    return saved


def test_saves_x_itself_h_and_a_bit_mask() -> None:
    n, k, o, r = 40, 24, 16, 4
    x = torch.randn(2, n // 2, k, requires_grad=True)
    w = torch.randn(o, k)
    a = torch.randn(r, k, requires_grad=True)
    bb = torch.randn(o, r, requires_grad=True)
    saved = _saved(lambda: ops.lora_linear(x, w, None, a, bb, 1.0, 0.1, True))
    params = {t.untyped_storage().data_ptr() for t in (w, a, bb)}
    activations = [t for t in saved if t.untyped_storage().data_ptr() not in params]
    by_storage = {t.untyped_storage().data_ptr(): t for t in activations}
    assert x.untyped_storage().data_ptr() in by_storage  # x itself, no copy
    others = [t for ptr, t in by_storage.items() if ptr != x.untyped_storage().data_ptr()]
    kinds = sorted((str(t.dtype), t.untyped_storage().nbytes()) for t in others)
    h_bytes = n * r * 4
    mask_bytes = (n * k + 63) // 64 * 8  # one bit per element, whole 64-bit words
    expected = [("torch.float32", h_bytes), ("torch.uint8", mask_bytes)]
    assert kinds == sorted(expected)


# ---- switches and errors -------------------------------------------------------------------------


def test_the_fused_switch_and_the_layer_flag_select_the_composition() -> None:
    layer = LoraLinear(8, 6, r=2)
    x = torch.randn(3, 8, requires_grad=True)

    def node(y):
        return (
            y.grad_fn.name() if y.grad_fn.name() != "ViewBackward0" else y.grad_fn.next_functions[0][0].name()
        )

    assert node(layer(x)) == "LoraLinearFunctionBackward"
    assert switches.fused.get()
    with switches.fused.using(False):
        assert not switches.fused.get()
        assert node(layer(x)) != "LoraLinearFunctionBackward"
    assert switches.fused.get()
    with pytest.raises(RuntimeError, match="boom"), switches.fused.using(False):
        raise RuntimeError("boom")
    assert switches.fused.get()  # restored after an exception
    layer.fused = False
    assert node(layer(x)) != "LoraLinearFunctionBackward"


def test_autocast_runs_the_composition() -> None:
    x, w, b, a, bb = make_inputs((3,), dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert "autocast" in ops.fallback_reason(x, dropout=False)
        y = ops.lora_linear(x, w, b, a, bb, 1.0, 0.0, True)
    assert y.dtype == torch.bfloat16  # what F.linear gives under autocast


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dropout_p": 1.0}, r"loragen.ops.lora_linear: dropout_p=1.0; expected 0 <= p < 1"),
        ({"dropout_p": -0.1}, r"dropout_p=-0.1"),
    ],
)
def test_invalid_arguments(kwargs: dict, message: str) -> None:
    x, w, b, a, bb = make_inputs((3,))
    call = {"dropout_p": 0.0, **kwargs}
    p = call.pop("dropout_p")
    with pytest.raises(ValueError, match=message):
        ops.lora_linear(x, w, b, a, bb, 1.0, p, True, **call)


def test_invalid_generator_arguments() -> None:
    with pytest.raises(ValueError, match=r"p=1.5"):
        ops.dropout_keep_bits(10, 1.5, 1)
