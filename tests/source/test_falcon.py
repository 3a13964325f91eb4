"""Falcon's ``FalconLinear(nn.Linear)`` through all three entry points, against peft.

``get_lora_model`` on transformers' Falcon, ``loragen rewrite`` of the real ``modeling_falcon.py`` (the
rewrite binds ``LoraFalconLinear = lora_class_for(FalconLinear)`` and swaps the constructor calls) and
``@lora_convert`` on Falcon's classes: with the A/B values of one peft adapter all three give peft's outputs
and LoRA gradients (fp32), keep the base model's state-dict keys, and merge exactly.
"""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from transformers.models.falcon import modeling_falcon  # noqa: E402

import loragen  # noqa: E402
from loragen import LoraConfig, lora_convert, rewrite_source  # noqa: E402
from loragen.adapters.load import load_adapter  # noqa: E402
from loragen.convert import find_lora_layers  # noqa: E402
from loragen.source.decorator import GENERATED_METHODS  # noqa: E402
from loragen.source.rewriter import module_name_for_path  # noqa: E402

TARGETS = ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"]
SOURCE = Path(modeling_falcon.__file__)
ARCHITECTURES = {
    "classic": {"new_decoder_architecture": False, "multi_query": True, "parallel_attn": True},
    "new": {"new_decoder_architecture": True, "num_kv_heads": 2, "bias": True},
}


def falcon_config(architecture: str) -> transformers.FalconConfig:
    return transformers.FalconConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        **ARCHITECTURES[architecture],
    )


@pytest.fixture(scope="module")
def rewritten(tmp_path_factory):
    """The real modeling_falcon.py rewritten into a temporary folder and imported from there (its relative
    imports made absolute, so it runs in the context of transformers.models.falcon)."""
    config = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS)
    result = rewrite_source(
        SOURCE.read_text(), config, filename=str(SOURCE), package=module_name_for_path(SOURCE)[1]
    )
    assert result.ok and result.changed, [str(e) for e in result.errors]
    target = tmp_path_factory.mktemp("rewritten") / "modeling_falcon_lora.py"
    target.write_text(result.code)
    name = "loragen_rewritten_falcon"
    spec = importlib.util.spec_from_file_location(name, target)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    yield module, result
    sys.modules.pop(name, None)


@pytest.fixture
def decorated():
    """Falcon's classes decorated for one test, then restored."""
    classes = (modeling_falcon.FalconAttention, modeling_falcon.FalconMLP, modeling_falcon.FalconForCausalLM)
    for cls in classes:
        lora_convert(cls)
    yield
    for cls in classes:
        for name in (*GENERATED_METHODS, "lora_fields", "lora_unresolved", "__lora_source__"):
            if name in vars(cls):
                delattr(cls, name)


def test_the_rewrite_binds_the_subclass_lora_class_and_swaps_its_calls(rewritten):
    module, result = rewritten
    code = result.code
    assert "\nLoraFalconLinear = lora_class_for(FalconLinear)\n" in code
    assert code.index("class FalconLinear(nn.Linear)") < code.index("LoraFalconLinear = lora_class_for")
    assert "from loragen.layers import LoraLayer, lora_class_for" in code
    assert (
        "self.query_key_value = LoraFalconLinear(self.hidden_size, qkv_out_dim, bias=config.bias, r=4, lora_alpha=8)"
        in code
    )
    assert code.count("= LoraFalconLinear(") == 4
    assert "self.lm_head = nn.Linear(" in code  # not targeted
    assert sorted({c.lora_name for c in result.rewritten}) == ["LoraFalconLinear"]
    assert issubclass(module.LoraFalconLinear, module.FalconLinear)
    again = rewrite_source(code, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    assert again.ok and not again.changed, [str(e) for e in again.errors]
    assert len(again.rewritten) == 4 and all(c.field.is_lora for c in again.rewritten)


def test_all_linear_rewrites_subclasses_and_leaves_the_head_out():
    package = module_name_for_path(SOURCE)[1]
    result = rewrite_source(
        SOURCE.read_text(), LoraConfig(target_modules="all-linear"), filename=str(SOURCE), package=package
    )
    assert result.ok, [str(e) for e in result.errors]
    assert sorted({c.field.path for c in result.rewritten}) == sorted(
        ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h", "score", "classifier", "qa_outputs"]
    )


def _peft_adapter(base: torch.nn.Module, folder: Path) -> torch.nn.Module:
    peft_config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False)
    torch.manual_seed(3)
    model = peft.get_peft_model(copy.deepcopy(base), peft_config)
    model.save_pretrained(folder)
    return model


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits
    weights = torch.linspace(-1, 1, logits.numel()).reshape(logits.shape)
    return (logits * weights).sum()


def _lora_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {}
    for name, p in model.named_parameters():
        if "lora_" in name and p.grad is not None:
            key = (
                name.removeprefix("base_model.model.").replace(".default.weight", "").replace(".default", "")
            )
            grads[key] = p.grad
    return grads


@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
@pytest.mark.parametrize("entry", ["runtime", "rewrite", "decorator"])
def test_falcon_equals_peft_in_outputs_gradients_keys_and_merges(
    entry, architecture, rewritten, tmp_path, request
):
    torch.manual_seed(0)
    original = transformers.FalconForCausalLM(falcon_config(architecture)).eval()
    peft_model = _peft_adapter(original, tmp_path / "adapter").eval()
    config = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS)
    if entry == "runtime":
        model = loragen.get_lora_model(copy.deepcopy(original), config)
    elif entry == "rewrite":
        model = rewritten[0].FalconForCausalLM(falcon_config(architecture))
        missing, unexpected = model.load_state_dict(original.state_dict(), strict=False)
        assert unexpected == [] and all(k.rpartition(".")[2] in ("lora_A", "lora_B") for k in missing)
        loragen.mark_trainable(model)
    else:
        request.getfixturevalue("decorated")
        model = copy.deepcopy(original).get_lora_model(config)
    model.eval()
    load_adapter(model, tmp_path / "adapter", trainable=True)
    layers = find_lora_layers(model)
    assert sorted(layers) == sorted(
        f"transformer.h.{i}.{name}"
        for i in range(2)
        for name in (
            "self_attention.query_key_value",
            "self_attention.dense",
            "mlp.dense_h_to_4h",
            "mlp.dense_4h_to_h",
        )
    )
    # the rewritten file defines its own FalconLinear (a copy of transformers' class)
    falcon_linear = rewritten[0].FalconLinear if entry == "rewrite" else modeling_falcon.FalconLinear
    assert all(isinstance(layer, falcon_linear) for layer in layers.values())
    # the base model's keys stay; only LoRA keys are new
    keys = set(model.state_dict())
    assert {k for k in keys if ".lora_" not in k} == set(original.state_dict())

    ids = torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert not torch.allclose(peft_model(input_ids=ids).logits, original(input_ids=ids).logits, atol=1e-3)
    mine, theirs = _loss(model, ids), _loss(peft_model, ids)
    torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)
    mine.backward()
    theirs.backward()
    grads, expected = _lora_grads(model), _lora_grads(peft_model)
    assert sorted(grads) == sorted(expected) and len(grads) == 16
    for name in expected:
        torch.testing.assert_close(grads[name], expected[name], atol=1e-5, rtol=1e-5, msg=name)
    assert all(p.grad is None for n, p in model.named_parameters() if "lora_" not in n)

    with torch.no_grad():
        unmerged = model(input_ids=ids).logits
        loragen.merge_adapter(model)
        torch.testing.assert_close(model(input_ids=ids).logits, unmerged, atol=1e-5, rtol=1e-5)
        loragen.unmerge_adapter(model)
        torch.testing.assert_close(model(input_ids=ids).logits, unmerged, atol=1e-5, rtol=1e-5)
        plain = loragen.merge_and_unload(model)
        torch.testing.assert_close(plain(input_ids=ids).logits, unmerged, atol=1e-5, rtol=1e-5)
    assert find_lora_layers(plain) == {}
    assert type(plain.transformer.h[0].self_attention.query_key_value).__name__ == "FalconLinear"
    assert sorted(plain.state_dict()) == sorted(original.state_dict())


def test_from_pretrained_on_a_base_checkpoint_initialises_the_subclass_lora_factors(rewritten, tmp_path):
    module, _ = rewritten
    torch.manual_seed(0)
    original = transformers.FalconForCausalLM(falcon_config("new")).eval()
    original.save_pretrained(tmp_path / "base")
    model = module.FalconForCausalLM.from_pretrained(tmp_path / "base").eval()
    layers = find_lora_layers(model)
    assert len(layers) == 8 and all(isinstance(layer, module.FalconLinear) for layer in layers.values())
    for layer in layers.values():
        assert torch.count_nonzero(layer.lora_B) == 0
        assert torch.isfinite(layer.lora_A).all() and 0 < layer.lora_A.abs().max() < 1.0
    ids = torch.randint(0, 100, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, original(input_ids=ids).logits)
