"""Every layer kind under ``torch.inference_mode()`` and ``torch.no_grad()``, in eval and in train mode:
one adapter or two, DoRA, merged or not, gives the outputs the same model gives with autograd on; a tiny
Llama (q_proj + v_proj, and all-linear) also under ``generate``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn

import loragen
from loragen import LoraConfig

transformers = pytest.importorskip("transformers")

MODES = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad}


class _OwnForwardLinear(nn.Linear):
    """A Linear subclass with a forward of its own (as Falcon's ``FalconLinear``)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return input @ self.weight.t() + (0.0 if self.bias is None else self.bias)


def _conv1d_hf() -> nn.Module:
    return transformers.pytorch_utils.Conv1D(6, 8)


# kind -> (module factory, input factory, DoRA supported)
KINDS: dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor], bool]] = {
    "linear": (lambda: nn.Linear(8, 6), lambda: torch.randn(2, 3, 8), True),
    "linear_subclass": (lambda: _OwnForwardLinear(8, 6), lambda: torch.randn(2, 3, 8), True),
    "hf_conv1d": (_conv1d_hf, lambda: torch.randn(2, 3, 8), True),
    "embedding": (lambda: nn.Embedding(10, 6), lambda: torch.randint(0, 10, (2, 5)), True),
    "conv1d": (lambda: nn.Conv1d(4, 6, 3, padding=1), lambda: torch.randn(2, 4, 9), True),
    "conv2d": (lambda: nn.Conv2d(4, 6, 3, stride=2), lambda: torch.randn(2, 4, 9, 9), True),
    "conv3d": (
        lambda: nn.Conv3d(4, 6, (2, 3, 3), stride=(2, 2, 2)),
        lambda: torch.randn(2, 4, 4, 7, 7),
        True,
    ),
}


def _layer_model(kind: str, *, adapters: int, dora: bool, dropout: float) -> tuple[nn.Module, torch.Tensor]:
    make, inputs, _ = KINDS[kind]
    torch.manual_seed(0)
    model = nn.Sequential(make())
    config = LoraConfig(
        r=2, lora_alpha=4, target_modules=["0"], init_lora_weights=False, use_dora=dora, lora_dropout=dropout
    )
    loragen.get_lora_model(model, config)
    if adapters == 2:
        loragen.add_adapter(
            model, LoraConfig(r=3, lora_alpha=3, target_modules=["0"], init_lora_weights=False), "second"
        )
        loragen.set_adapter(model, "second")
    return model, inputs()


def _same_outputs(model: nn.Module, run: Callable[[], torch.Tensor], mode: str) -> None:
    """``run()`` under ``mode`` equals ``run()`` with autograd on (the same dropout draw for both)."""
    torch.manual_seed(3)
    expected = run().detach()
    torch.manual_seed(3)
    with MODES[mode]():
        got = run()
    assert not got.requires_grad
    torch.testing.assert_close(got, expected)


@contextlib.contextmanager
def _merged(model: nn.Module, merged: bool) -> Iterator[None]:
    if merged:
        loragen.merge_adapter(model)
    try:
        yield
    finally:
        if merged:
            loragen.unmerge_adapter(model)


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("merged", [False, True], ids=["unmerged", "merged"])
@pytest.mark.parametrize(
    ("adapters", "dora"), [(1, False), (2, False), (1, True)], ids=["one", "two", "dora"]
)
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_layer_kind_runs_without_autograd(
    kind: str, adapters: int, dora: bool, merged: bool, training: bool, mode: str
) -> None:
    dropout = 0.1 if training and kind != "embedding" else 0.0
    model, x = _layer_model(kind, adapters=adapters, dora=dora, dropout=dropout)
    model.train(training)
    if x.is_floating_point():
        x.requires_grad_(True)
    with _merged(model, merged):
        _same_outputs(model, lambda: model(x), mode)


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("merged", [False, True], ids=["unmerged", "merged"])
def test_experts_run_without_autograd(merged: bool, training: bool, mode: str) -> None:
    from tests.layers.experts_models import make, tokens

    model = make("mixtral")
    config = LoraConfig(
        r=2,
        lora_alpha=5,
        target_modules=[],
        target_parameters=["gate_up_proj", "down_proj"],
        init_lora_weights=False,
    )
    loragen.get_lora_model(model, config)
    model.train(training)
    ids = tokens()
    with _merged(model, merged):
        _same_outputs(model, lambda: model(ids).logits, mode)


@pytest.mark.parametrize("kind", ["4bit", "8bit"])
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_quantized_linears_run_without_autograd(kind: str, mode: str, training: bool) -> None:
    pytest.importorskip("bitsandbytes")
    from loragen.layers.bnb import LoraLinear4bit, LoraLinear8bitLt

    torch.manual_seed(0)
    if kind == "4bit":
        layer: nn.Module = LoraLinear4bit(
            64, 32, quant_type="nf4", compute_dtype=torch.float32, r=4, lora_dropout=0.1
        )
    else:
        layer = LoraLinear8bitLt(64, 32, has_fp16_weights=False, r=4, lora_dropout=0.1)
    layer = layer.to("cpu").train(training)
    with torch.no_grad():
        layer.lora_B.normal_()
    x = torch.randn(3, 64)
    _same_outputs(layer, lambda: layer(x), mode)


def _llama() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return transformers.LlamaForCausalLM(config)


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], "all-linear"], ids=["q_v", "all_linear"])
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_a_llama_runs_and_generates_without_autograd(targets: object, mode: str, training: bool) -> None:
    model = _llama()
    loragen.get_lora_model(model, LoraConfig(target_modules=targets, init_lora_weights=False))  # type: ignore[arg-type]
    model.train(training)
    ids = torch.tensor([[0, 1, 2]])
    _same_outputs(model, lambda: model(ids).logits, mode)
    model.eval()
    expected = model.generate(ids, max_new_tokens=5, do_sample=False)
    with MODES[mode]():
        assert torch.equal(model.generate(ids, max_new_tokens=5, do_sample=False), expected)
    loragen.merge_adapter(model)
    with MODES[mode]():
        merged = model(ids).logits
    loragen.unmerge_adapter(model)
    torch.testing.assert_close(merged, model(ids).logits.detach(), rtol=1e-4, atol=1e-5)
