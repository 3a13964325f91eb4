"""Sibling fusion (loragen.sibling_planning, loragen.ops.siblings): the plan made at conversion, and fused
results that equal the per-layer op in values and gradients, under checkpointing, hooks, copies and every
base setting. Reading the groups from source is tested in tests/test_forward_calls.py."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call

import loragen
from loragen import switches
from loragen.ops import siblings
from loragen.sibling_planning import fused_groups
from tests.conftest import autograd_node_names, tiny_inputs

# ---- fused results equal the per-layer op ----------------------------------------------------------------


class _Siblings(nn.Module):
    """q, k, v read x; o reads something else; a Conv1D pair reads x too."""

    def __init__(self, d: int = 6, conv1d: bool = False, bias: bool = True) -> None:
        super().__init__()
        if conv1d:
            from transformers.pytorch_utils import Conv1D

            self.q, self.k, self.v = Conv1D(d, d), Conv1D(d + 1, d), Conv1D(d, d)
        else:
            self.q, self.k, self.v = (
                nn.Linear(d, d, bias=bias),
                nn.Linear(d, d + 1, bias=bias),
                nn.Linear(d, d),
            )
        self.o = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q(x)
        k = self.k(x)
        v = self.v(x)
        return self.o(q * v) + k[..., :-1].tanh()


def _lora(model: nn.Module, **kwargs) -> nn.Module:
    config = loragen.LoraConfig(
        r=kwargs.pop("r", 3), lora_alpha=5, target_modules=["q", "k", "v", "o"], **kwargs
    )
    lora = loragen.get_lora_model(model, config)
    torch.manual_seed(1)
    for name, p in lora.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p, std=0.3)  # B = 0 at init would hide the rank-r terms
    return lora


def _run(model: nn.Module, x: torch.Tensor, fuse: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    with switches.sibling_fusion.using(fuse):
        y = model(x)
        (y * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return torch.cat([y.detach().flatten(), x.grad.flatten()]), grads


@pytest.mark.parametrize("conv1d", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("trainable_base", [False, True])
def test_fused_equals_unfused_values_and_gradients(conv1d: bool, bias: bool, trainable_base: bool) -> None:
    torch.manual_seed(0)
    model = _lora(_Siblings(conv1d=conv1d, bias=bias))
    if trainable_base:
        for layer in (model.q, model.k):
            layer.weight.requires_grad_(True)
            if layer.bias is not None:
                layer.bias.requires_grad_(True)
    x = torch.randn(2, 5, 6)
    for _ in range(2):  # the first call resolves the groups and already fuses
        fused_out, fused_grads = _run(model, x, True)
        assert "_GroupFunctionBackward" in autograd_node_names(model(x))
        plain_out, plain_grads = _run(model, x, False)
        torch.testing.assert_close(fused_out, plain_out, atol=1e-6, rtol=1e-5)
        assert fused_grads.keys() == plain_grads.keys()
        for name in plain_grads:
            torch.testing.assert_close(fused_grads[name], plain_grads[name], atol=1e-6, rtol=1e-5, msg=name)
    assert fused_groups(model) == [("q", "k", "v")]
    assert getattr(siblings._local, "handout", None) is None  # every hand-out was taken


@pytest.mark.parametrize("conv1d", [False, True])
def test_gradcheck_through_the_fused_group(conv1d: bool) -> None:
    torch.manual_seed(0)
    model = _lora(_Siblings(d=4, conv1d=conv1d)).double()
    model.q.weight.requires_grad_(True)  # hybrid: a trainable base weight in the leader
    model.v.bias.requires_grad_(True)
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    params = [
        p.detach().clone().requires_grad_(True) for name, p in model.named_parameters() if p.requires_grad
    ]
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)

    def f(x: torch.Tensor, *ps: torch.Tensor) -> torch.Tensor:
        return functional_call(model, dict(zip(names, ps)), (x,))

    assert "_GroupFunctionBackward" in autograd_node_names(f(x, *params))
    assert torch.autograd.gradcheck(f, (x, *params))


def test_tiny_llama_fuses_qkv_and_gate_up_and_equals_peft(make_tiny_model) -> None:
    import peft

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    base = make_tiny_model("llama").train()
    theirs = peft.get_peft_model(
        copy.deepcopy(base),
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False),
    )
    ours = loragen.get_lora_model(
        copy.deepcopy(base), loragen.LoraConfig(r=4, lora_alpha=8, target_modules=targets)
    )
    their_layers = {
        n.removeprefix("base_model.model."): m
        for n, m in theirs.named_modules()
        if isinstance(m, peft.tuners.lora.Linear)
    }
    our_layers = {n: m for n, m in ours.named_modules() if isinstance(m, loragen.LoraLinear)}
    with torch.no_grad():
        for name, layer in our_layers.items():
            layer.lora_A.copy_(their_layers[name].lora_A["default"].weight)
            layer.lora_B.copy_(their_layers[name].lora_B["default"].weight)
    ids = tiny_inputs("llama")["input_ids"]
    for _ in range(2):
        for model in (ours, theirs):
            model.zero_grad(set_to_none=True)
            model(input_ids=ids, labels=ids).loss.backward()
        for name, layer in our_layers.items():
            for ours_p, theirs_p in (
                (layer.lora_A, their_layers[name].lora_A["default"].weight),
                (layer.lora_B, their_layers[name].lora_B["default"].weight),
            ):
                torch.testing.assert_close(ours_p.grad, theirs_p.grad, rtol=0, atol=1e-6, msg=name)
    groups = fused_groups(ours)
    assert len(groups) == 4
    assert (
        "model.layers.1.self_attn.q_proj",
        "model.layers.1.self_attn.k_proj",
        "model.layers.1.self_attn.v_proj",
    ) in groups
    assert ("model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj") in groups


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpointing_from_the_first_step_and_across_two_forwards(use_reentrant: bool) -> None:
    """The grouping is fixed before the first fused call, so a forward and its recomputation agree even
    when two forwards share one backward (non-reentrant checkpointing checks that)."""
    torch.manual_seed(0)
    model = _lora(_Siblings())
    reference = copy.deepcopy(model)
    # reentrant checkpointing passes gradients only when an input requires them
    x1, x2 = torch.randn(2, 3, 6, requires_grad=True), torch.randn(2, 3, 6, requires_grad=True)

    def loss(m: nn.Module, x: torch.Tensor, checkpoint: bool) -> torch.Tensor:
        if checkpoint:
            return torch.utils.checkpoint.checkpoint(m, x, use_reentrant=use_reentrant).square().sum()
        return m(x).square().sum()

    for _ in range(2):
        for m, checkpoint in ((model, True), (reference, False)):
            m.zero_grad(set_to_none=True)
            with switches.sibling_fusion.using(m is model):
                (loss(m, x1, checkpoint) + loss(m, x2, checkpoint)).backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            if p.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5, msg=name)
    assert fused_groups(model) == [("q", "k", "v")]


def test_a_sibling_called_with_another_tensor_computes_its_own() -> None:
    """A forward pre-hook replaces k's input: the plan says "sibling", the run time says no."""
    torch.manual_seed(0)
    model = _lora(_Siblings())
    reference = copy.deepcopy(model)
    for m in (model, reference):
        m.k.register_forward_pre_hook(lambda module, args: (args[0] * 2,))
    x = torch.randn(4, 6)
    fused_out, fused_grads = _run(model, x, True)
    plain_out, plain_grads = _run(reference, x, False)
    torch.testing.assert_close(fused_out, plain_out, atol=1e-6, rtol=1e-5)
    for name in plain_grads:
        torch.testing.assert_close(fused_grads[name], plain_grads[name], atol=1e-6, rtol=1e-5, msg=name)


class _DroppedValue(_Siblings):
    """q, k and v read x, and v's output is dropped."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k = self.q(x), self.k(x)
        self.v(x)
        return self.o(q) + k[..., :-1].tanh()


def test_a_sibling_whose_output_is_dropped_gets_no_gradient() -> None:
    """As a layer run alone: no gradient at all (a zero one would still move it under weight decay)."""
    torch.manual_seed(0)
    model = _lora(_DroppedValue())
    reference = copy.deepcopy(model)
    x = torch.randn(4, 6)
    fused_out, fused_grads = _run(model, x, True)
    plain_out, plain_grads = _run(reference, x, False)
    assert not any(name.startswith("v.") for name in plain_grads)
    assert fused_grads.keys() == plain_grads.keys()
    torch.testing.assert_close(fused_out, plain_out, atol=1e-6, rtol=1e-5)


def test_an_input_modified_in_place_between_calls_is_not_shared() -> None:
    class InPlace(_Siblings):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q = self.q(x)
            x.mul_(3)  # same tensor object, new version: k must not use q's h
            return q + self.k(x)[..., :-1] + self.v(x)

    torch.manual_seed(0)
    model = _lora(InPlace())
    x = torch.randn(4, 6)
    with switches.sibling_fusion.using(True):
        fused = model(x.clone())
    with switches.sibling_fusion.using(False):
        plain = model(x.clone())
    torch.testing.assert_close(fused, plain, atol=1e-6, rtol=1e-5)


def test_dropout_in_training_runs_alone_and_eval_fuses() -> None:
    torch.manual_seed(0)
    model = _lora(_Siblings(), lora_dropout=0.1)
    x = torch.randn(4, 6)
    assert "_GroupFunctionBackward" not in autograd_node_names(model.train()(x))
    assert "_GroupFunctionBackward" in autograd_node_names(model.eval()(x.requires_grad_(True)))


def test_direct_calls_copies_and_switches() -> None:
    torch.manual_seed(0)
    model = _lora(_Siblings())
    x = torch.randn(4, 6, requires_grad=True)
    model.k(x)  # called from outside its parent: no hand-out waits for it, it runs alone
    assert fused_groups(model) == [("q", "k", "v")]  # planned at conversion, before any call

    clone = copy.deepcopy(model)  # the plan lives on the layers: the copy's refer to the copy's
    clone(x).sum().backward()
    assert fused_groups(clone) == [("q", "k", "v")]
    assert all(p.grad is None for p in model.parameters())  # nothing of the original in the copy's graph

    for switch in (switches.sibling_fusion.using(False), switches.fused.using(False)):
        with switch:
            assert "_GroupFunctionBackward" not in autograd_node_names(model(x))
    model.k.fused = False  # a sibling that opts out is left out; q and v still share
    assert "_GroupFunctionBackward" in autograd_node_names(model(x))


# ---- rounding: fused as close to peft as the per-layer op --------------------------------------------------


def _peft_and_ours(base: nn.Module, targets: list[str], seed: int = 1) -> tuple[nn.Module, nn.Module, dict]:
    """peft's and loragen's LoRA models of ``base`` with the same random A and B (B nonzero, so every
    LoRA term shows), and {layer path: (our layer, their layer)}."""
    import peft

    theirs = peft.get_peft_model(
        copy.deepcopy(base), peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets)
    )
    ours = loragen.get_lora_model(
        copy.deepcopy(base), loragen.LoraConfig(r=4, lora_alpha=8, target_modules=targets)
    )
    their_layers = {
        n.removeprefix("base_model.model."): m
        for n, m in theirs.named_modules()
        if isinstance(m, peft.tuners.lora.Linear)
    }
    layers = {n: (m, their_layers[n]) for n, m in ours.named_modules() if isinstance(m, loragen.LoraLinear)}
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mine, theirs_layer in layers.values():
            for a, b in (
                (mine.lora_A, theirs_layer.lora_A["default"].weight),
                (mine.lora_B, theirs_layer.lora_B["default"].weight),
            ):
                b.copy_(torch.randn(b.shape, generator=g, dtype=b.dtype) * 0.3)
                a.copy_(b)
    return theirs, ours, layers


def _step(model: nn.Module, run, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Output and the LoRA gradients (float64 copies) of one forward and backward."""
    model.zero_grad(set_to_none=True)
    out = run(model)
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)).sum().backward()
    return {"output": out.detach().double(), **{n: p.grad.double() for n, p in params.items()}}


def _lora_params(layers: dict, ours: bool) -> dict[str, torch.Tensor]:
    params = {}
    for name, (mine, theirs) in layers.items():
        a, b = (
            (mine.lora_A, mine.lora_B)
            if ours
            else (theirs.lora_A["default"].weight, theirs.lora_B["default"].weight)
        )
        params[f"{name}.lora_A"], params[f"{name}.lora_B"] = a, b
    return params


def _distance(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, float]:
    """Relative Frobenius distance per tensor."""
    return {n: ((got[n] - w).norm() / w.norm()).item() for n, w in want.items()}


def test_tiny_llama_fused_is_as_close_to_peft_as_the_unfused_op(make_tiny_model) -> None:
    """fp32: sibling fusion sums the input gradient of a group in the order peft's separate layers do
    (members last to first, each one's rank-r term before its base term), so the fused group rounds no
    differently from the per-layer op; before, its one rank-R GEMM summed every member's term first."""
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    theirs, ours, layers = _peft_and_ours(make_tiny_model("llama").train(), targets)
    ids = tiny_inputs("llama")["input_ids"]

    def logits(model: nn.Module) -> torch.Tensor:
        return model(input_ids=ids).logits

    want = _step(theirs, logits, _lora_params(layers, ours=False))
    worst = {}
    for fuse in (True, False):
        with switches.sibling_fusion.using(fuse):
            worst[fuse] = max(_distance(_step(ours, logits, _lora_params(layers, ours=True)), want).values())
    assert len(fused_groups(ours)) == 4
    assert worst[False] < 1e-5  # the per-layer op: fp32 rounding
    assert worst[True] <= worst[False] + 1e-7


def test_a_member_whose_terms_cancel_sums_as_the_per_layer_op() -> None:
    """v's LoRA term cancels its base term in the input gradient (W_v = -s B_v A_v, both ~1e3), so the
    order of the sum decides what of q's and k's O(1) terms survives. Separate layers (and peft) add v's
    two terms first; the fused group does too and agrees with the per-layer op to 1e-7 (a rank-R GEMM
    adding q's, k's and v's LoRA terms first rounded q's and k's away against v's: 4e-4 apart)."""
    torch.manual_seed(0)
    model = _lora(_Siblings(d=16), r=4)
    g = torch.Generator().manual_seed(2)
    big_a = torch.randn(4, 16, generator=g, dtype=torch.float64) * 30
    big_b = torch.randn(16, 4, generator=g, dtype=torch.float64) * 30
    with torch.no_grad():
        model.v.lora_A.copy_(big_a)
        model.v.lora_B.copy_(big_b)
        model.v.weight.copy_(-model.v.scaling * big_b @ big_a)
    x = torch.randn(3, 5, 16, generator=g).requires_grad_(True)
    grads = {}
    for fuse in (True, False):
        with switches.sibling_fusion.using(fuse):
            grads[fuse] = _input_grad(model, x)
    assert "_GroupFunctionBackward" in autograd_node_names(model(x))
    torch.testing.assert_close(
        grads[True], grads[False], rtol=1e-5, atol=1e-5 * grads[False].abs().max().item()
    )


def _input_grad(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    y = model(x)
    return torch.autograd.grad((y * torch.linspace(-1, 1, y.shape[-1])).sum(), x)[0].double()


def test_fastspeech2_conformer_encoder_differs_from_peft_by_conditioning_only() -> None:
    """A relative-position conformer (q, k and v fused) in fp32: against peft's float64 run, the fused
    group's LoRA gradients are no further than peft's own fp32 ones are (what differences from peft's fp32
    run remain are fp32 rounding amplified by the network, not an error of the fused path)."""
    from transformers import FastSpeech2ConformerConfig, FastSpeech2ConformerModel

    torch.manual_seed(0)
    config = FastSpeech2ConformerConfig(
        hidden_size=32, encoder_layers=2, decoder_layers=1, encoder_linear_units=64, vocab_size=40
    )
    encoder = FastSpeech2ConformerModel(config).encoder.eval()
    theirs, ours, layers = _peft_and_ours(
        encoder, ["linear_q", "linear_k", "linear_v", "linear_out", "linear_pos"]
    )
    ids = torch.randint(0, 40, (2, 9), generator=torch.Generator().manual_seed(3))

    def hidden(model: nn.Module) -> torch.Tensor:
        return model(ids, torch.ones(2, 1, 9), return_dict=True)[0]

    peft32 = _step(theirs, hidden, _lora_params(layers, ours=False))
    with switches.sibling_fusion.using(True):
        fused = _step(ours, hidden, _lora_params(layers, ours=True))
    assert len(fused_groups(ours)) == 2
    theirs.double()
    wide = _step(theirs, hidden, _lora_params(layers, ours=False))
    peft_error, fused_error = _distance(peft32, wide), _distance(fused, wide)
    for name, error in fused_error.items():
        assert error <= 2 * peft_error[name] + 1e-6, name
