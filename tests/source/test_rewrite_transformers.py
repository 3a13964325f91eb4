"""``loragen rewrite`` on transformers' own modeling files (Llama, Mistral, GPT-2 with Conv1D, BERT, T5).

Each rewritten file is imported from a temporary folder and must be a drop-in: same class names, the
original model's state dict loads with only LoRA keys missing, a peft adapter loads with
``loragen.adapters.load.load_adapter``, and the outputs equal peft's and the runtime path's for that adapter.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import loragen  # noqa: E402
from loragen import LoraConfig, rewrite_source  # noqa: E402
from loragen.adapters.load import load_adapter  # noqa: E402
from loragen.convert import find_lora_layers  # noqa: E402
from loragen.source.rewriter import module_name_for_path  # noqa: E402

SMALL = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "vocab_size": 100,
    "max_position_embeddings": 64,
}


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    model_class: str
    config: Any
    targets: Any


CASES = [
    Case(
        "llama",
        "LlamaForCausalLM",
        lambda: transformers.LlamaConfig(num_key_value_heads=2, **SMALL),
        ["q_proj", "v_proj", "down_proj"],
    ),
    Case(
        "mistral",
        "MistralForCausalLM",
        lambda: transformers.MistralConfig(num_key_value_heads=2, **SMALL),
        "all-linear",
    ),
    Case(
        "gpt2",
        "GPT2LMHeadModel",
        lambda: transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=100, n_positions=64),
        ["c_attn", "c_proj"],
    ),
    Case(
        "bert",
        "BertForSequenceClassification",
        lambda: transformers.BertConfig(num_labels=3, **SMALL),
        ["query", "value", "dense"],
    ),
    Case(
        "t5",
        "T5ForConditionalGeneration",
        lambda: transformers.T5Config(
            d_model=32,
            d_ff=64,
            d_kv=8,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=4,
            vocab_size=100,
            decoder_start_token_id=0,
        ),
        ["q", "v", "wo"],
    ),
]


def inputs(case: Case) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 100, (2, 7), generator=g)
    if case.name == "t5":
        return {"input_ids": ids, "decoder_input_ids": torch.randint(0, 100, (2, 5), generator=g)}
    return {"input_ids": ids}


def output(model: torch.nn.Module, case: Case) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs(case)).logits


@pytest.fixture(scope="module")
def rewritten(tmp_path_factory) -> dict[str, Any]:
    """Each case's modeling file rewritten into a temporary folder and imported from there."""
    folder = tmp_path_factory.mktemp("rewritten")
    modules: dict[str, Any] = {}
    for case in CASES:
        source = Path(transformers.__file__).parent / "models" / case.name / f"modeling_{case.name}.py"
        config = LoraConfig(r=4, lora_alpha=8, target_modules=case.targets)
        result = rewrite_source(
            source.read_text(), config, filename=str(source), package=module_name_for_path(source)[1]
        )
        assert result.ok and result.changed, [str(e) for e in result.errors]
        target = folder / f"modeling_{case.name}_lora.py"
        target.write_text(result.code)
        name = f"loragen_rewritten_{case.name}"
        spec = importlib.util.spec_from_file_location(name, target)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        modules[case.name] = (module, result)
    return modules


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_rewritten_transformers_model_is_a_drop_in_equal_to_peft_and_the_runtime(
    case: Case, rewritten, tmp_path
):
    module, result = rewritten[case.name]
    assert "from ..." not in result.code and "from ." not in result.code  # standalone: absolute imports only
    torch.manual_seed(0)
    original = getattr(transformers, case.model_class)(case.config()).eval()
    model = getattr(module, case.model_class)(case.config()).eval()

    # built from a config, the adapter is a no-op: peft's init, B = 0 (despite transformers' _init_weights)
    layers = find_lora_layers(model)
    assert layers and all(torch.count_nonzero(layer.factor_b) == 0 for layer in layers.values())
    assert all(torch.count_nonzero(layer.factor_a) > 0 for layer in layers.values())

    missing, unexpected = model.load_state_dict(original.state_dict(), strict=False)
    assert unexpected == []
    assert missing and all(k.rpartition(".")[2] in ("lora_A", "lora_B") for k in missing)
    torch.testing.assert_close(output(model, case), output(original, case))

    # a peft adapter with non-zero B, saved in peft's format
    peft_config = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=case.targets,
        init_lora_weights=False,
        fan_in_fan_out=case.name == "gpt2",
    )
    peft_model = peft.get_peft_model(copy.deepcopy(original), peft_config).eval()
    peft_model.save_pretrained(tmp_path / "adapter")

    load_adapter(model, tmp_path / "adapter")
    runtime = load_adapter(copy.deepcopy(original), tmp_path / "adapter")
    assert sorted(find_lora_layers(model)) == sorted(find_lora_layers(runtime))
    expected = output(peft_model, case)
    assert not torch.allclose(expected, output(original, case), atol=1e-4)
    torch.testing.assert_close(output(model, case), expected, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(output(runtime, case), expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_rewriting_the_output_again_changes_nothing(name: str, rewritten):
    _, result = rewritten[name]
    case = next(c for c in CASES if c.name == name)
    again = rewrite_source(result.code, LoraConfig(r=4, lora_alpha=8, target_modules=case.targets))
    assert again.ok and not again.changed and again.code == result.code
    assert len(again.rewritten) == len(result.rewritten)


def test_rewritten_model_matches_get_lora_model_layer_for_layer(rewritten):
    module, _ = rewritten["mistral"]
    case = CASES[1]
    torch.manual_seed(0)
    runtime = loragen.get_lora_model(
        transformers.MistralForCausalLM(case.config()),
        LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"),
    )
    model = getattr(module, case.model_class)(case.config())
    assert sorted(model.state_dict()) == sorted(runtime.state_dict())
    mine, theirs = find_lora_layers(model), find_lora_layers(runtime)
    assert {p: (type(m).__name__, m.r, m.scaling) for p, m in mine.items()} == {
        p: (type(m).__name__, m.r, m.scaling) for p, m in theirs.items()
    }
    assert "lm_head" not in mine  # all-linear leaves the output head out, as peft does
    assert model.loragen_config == runtime.loragen_config  # the file's PreTrainedModel class carries it
    model.requires_grad_(True)
    loragen.mark_trainable(model)
    assert [n for n, p in model.named_parameters() if p.requires_grad] == [
        n for n, p in runtime.named_parameters() if p.requires_grad
    ]


def test_from_pretrained_on_a_base_checkpoint_initialises_lora_like_peft(rewritten, tmp_path):
    """``from_pretrained`` builds on the meta device and fills missing parameters with ``_init_weights``
    only: the rewrite's hook there is what gives the LoRA factors peft's init instead of garbage."""
    module, result = rewritten["llama"]
    assert "module.reset_lora_parameters(True)" in result.code
    case = CASES[0]
    torch.manual_seed(0)
    original = transformers.LlamaForCausalLM(case.config()).eval()
    original.save_pretrained(tmp_path / "base")
    model = module.LlamaForCausalLM.from_pretrained(tmp_path / "base").eval()
    layers = find_lora_layers(model)
    assert len(layers) == 6
    for layer in layers.values():
        assert torch.count_nonzero(layer.lora_B) == 0
        assert torch.isfinite(layer.lora_A).all() and layer.lora_A.abs().max() < 1.0
    torch.testing.assert_close(output(model, case), output(original, case))
