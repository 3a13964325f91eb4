"""Composite models through ``loragen rewrite``: sub-models built with ``AutoModel.from_config``.

Gemma 3 builds its text model (defined in modeling_gemma3.py) and its SigLIP vision tower (another file) with
``AutoModel.from_config``; LLaVA builds both (CLIP, Llama) from other files, Qwen3-VL both from its own. The
rewritten files build them through ``LoraAutoModel = lora_auto_class(AutoModel, [...], LORA_CONFIG)``: the
file's own rewritten class when the config selects one, transformers' class converted at build time
otherwise. Each call is reported at its line. With one peft adapter's A/B values the rewritten composites
give peft's outputs and LoRA gradients.
"""

from __future__ import annotations

import copy
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
from loragen.cli import main as cli_main  # noqa: E402
from loragen.convert import find_lora_layers  # noqa: E402
from loragen.source.composite import convert_sub_model, lora_auto_class  # noqa: E402
from loragen.source.rewriter import module_name_for_path  # noqa: E402

TARGETS = ["q_proj", "v_proj"]
MODELS = Path(transformers.__file__).parent / "models"
TEXT = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 300,
    "max_position_embeddings": 64,
}
VISION = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "image_size": 16,
    "patch_size": 4,
}


def gemma3_config() -> Any:
    return transformers.Gemma3Config(
        text_config={**TEXT, "head_dim": 8},
        vision_config=VISION,
        mm_tokens_per_image=4,
        image_token_index=299,
        boi_token_index=297,
        eoi_token_index=298,
    )


def llava_config() -> Any:
    return transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(**VISION),
        text_config=transformers.LlamaConfig(**TEXT),
        image_token_index=299,
    )


CASES = {
    "gemma3": ("Gemma3ForConditionalGeneration", gemma3_config),
    "llava": ("LlavaForConditionalGeneration", llava_config),
}


def _rewrite(name: str) -> Any:
    source = MODELS / name / f"modeling_{name}.py"
    config = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS)
    return source, rewrite_source(
        source.read_text(), config, filename=str(source), package=module_name_for_path(source)[1]
    )


@pytest.fixture(scope="module")
def rewritten(tmp_path_factory) -> dict[str, Any]:
    """Each composite's modeling file rewritten and imported as a module of its transformers package (so that
    transformers applies its checkpoint key conversions to it, as to its own file)."""
    folder = tmp_path_factory.mktemp("rewritten")
    modules: dict[str, Any] = {}
    for name in CASES:
        _, result = _rewrite(name)
        assert result.ok and result.changed, [str(e) for e in result.errors]
        target = folder / f"modeling_{name}_lora.py"
        target.write_text(result.code)
        module_name = f"transformers.models.{name}.modeling_{name}_lora"
        spec = importlib.util.spec_from_file_location(module_name, target)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
        modules[name] = (module, result)
    yield modules
    for name in CASES:
        sys.modules.pop(f"transformers.models.{name}.modeling_{name}_lora", None)


def test_gemma3_rewrite_builds_sub_models_through_a_lora_auto_class_and_reports_each_call():
    source, result = _rewrite("gemma3")
    code = result.code
    lines = source.read_text().splitlines()
    calls = [i + 1 for i, line in enumerate(lines) if "AutoModel.from_config(" in line]
    assert len(calls) == 2
    reported = [w for w in result.warnings if "AutoModel.from_config" in w.message]
    assert [w.line for w in reported] == calls
    assert all(str(w).startswith(f"{source}:{w.line}: Gemma3Model.") for w in reported)
    assert "self.language_model = LoraAutoModel.from_config(config.text_config)" in code
    assert "self.vision_tower = LoraAutoModel.from_config(config.vision_config)" in code
    assert "AutoModel.from_config(" not in code.replace("LoraAutoModel.from_config(", "")
    assert (
        "\nLoraAutoModel = lora_auto_class(AutoModel, [Gemma3TextModel, Gemma3ForCausalLM], LORA_CONFIG)\n"
        in code
    )
    assert "from loragen.source.composite import lora_auto_class" in code
    assert result.sub_models == ("Gemma3Model.vision_tower", "Gemma3Model.language_model")
    assert "2 sub-models through LoRA auto classes" in result.summary()
    again = rewrite_source(code, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    assert again.ok and not again.changed and again.code == code, [str(e) for e in again.errors]
    other = rewrite_source(code, LoraConfig(r=8, target_modules=["q_proj"]))
    assert other.ok and other.changed and other.code.count("lora_auto_class(AutoModel") == 1


def test_a_composite_without_own_layers_still_gets_lora_sub_models_and_no_unmatched_target():
    _, result = _rewrite("llava")
    assert result.ok and result.changed and not result.rewritten
    assert result.unmatched_targets == ()
    assert "LoraAutoModel = lora_auto_class(AutoModel, [], LORA_CONFIG)" in result.code
    assert "loragen_config = LORA_CONFIG" in result.code


def test_the_cli_prints_each_sub_model_call_at_file_line_and_exits_0(tmp_path, capsys):
    source = MODELS / "gemma3" / "modeling_gemma3.py"
    status = cli_main(
        ["rewrite", str(source), "--target-modules", "q_proj,v_proj", "-o", str(tmp_path / "out.py")]
    )
    assert status == 0
    err = capsys.readouterr().err
    line = next(
        i + 1
        for i, text in enumerate(source.read_text().splitlines())
        if "self.vision_tower = AutoModel" in text
    )
    assert f"{source}:{line}: warning: Gemma3Model.vision_tower = AutoModel.from_config(...)" in err
    assert "LoraAutoModel.from_config(config.text_config)" in (tmp_path / "out.py").read_text()


def _peft(original: torch.nn.Module, folder: Path) -> torch.nn.Module:
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False)
    torch.manual_seed(3)
    model = peft.get_peft_model(copy.deepcopy(original), config)
    model.save_pretrained(folder)
    return model.eval()


def _loss(model: torch.nn.Module, ids: torch.Tensor, pixels: torch.Tensor) -> torch.Tensor:
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    logits = model(input_ids=ids).logits
    vision = inner.model.vision_tower(pixel_values=pixels).last_hidden_state
    total = torch.zeros(())
    for out in (logits, vision):
        total = total + (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum()
    return total


def _lora_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {}
    for name, p in model.named_parameters():
        if "lora_" in name and p.grad is not None:
            grads[name.removeprefix("base_model.model.").replace(".default.weight", "")] = p.grad
    return grads


@pytest.mark.parametrize("name", list(CASES))
def test_rewritten_composite_equals_peft_and_get_lora_model(name, rewritten, tmp_path):
    module, _ = rewritten[name]
    class_name, make_config = CASES[name]
    torch.manual_seed(0)
    original = getattr(transformers, class_name)(make_config()).eval()
    model = getattr(module, class_name)(make_config()).eval()
    runtime = loragen.get_lora_model(
        copy.deepcopy(original), LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS)
    )
    layers = find_lora_layers(model)
    assert sorted(layers) == sorted(find_lora_layers(runtime))
    assert any(".vision_tower." in path for path in layers) and any(
        ".language_model." in path for path in layers
    )
    if name == "gemma3":  # the text model is the rewritten file's own class
        assert type(model.model.language_model) is module.Gemma3TextModel
    assert sorted(model.state_dict()) == sorted(runtime.state_dict())
    missing, unexpected = model.load_state_dict(original.state_dict(), strict=False)
    assert unexpected == [] and all(k.rpartition(".")[2] in ("lora_A", "lora_B") for k in missing)
    assert model.loragen_config == LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS)
    loragen.mark_trainable(model)

    peft_model = _peft(original, tmp_path / "adapter")
    load_adapter(model, tmp_path / "adapter", trainable=True)
    ids = torch.randint(0, 290, (2, 7), generator=torch.Generator().manual_seed(1))
    pixels = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert not torch.allclose(peft_model(input_ids=ids).logits, original(input_ids=ids).logits, atol=1e-3)
    mine, theirs = _loss(model, ids, pixels), _loss(peft_model, ids, pixels)
    torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)
    mine.backward()
    theirs.backward()
    grads, expected = _lora_grads(model), _lora_grads(peft_model)
    assert sorted(grads) == sorted(expected) and len(grads) == 2 * len(layers)
    for key in expected:
        torch.testing.assert_close(grads[key], expected[key], atol=1e-5, rtol=1e-5, msg=key)


def test_from_pretrained_initialises_every_sub_models_lora_factors(rewritten, tmp_path):
    """``from_pretrained`` fills missing parameters with each sub-model's own ``_init_weights``: the vision tower
    (transformers' class) gets its LoRA init from the LoRA auto class."""
    module, _ = rewritten["gemma3"]
    torch.manual_seed(0)
    original = transformers.Gemma3ForConditionalGeneration(gemma3_config()).eval()
    original.save_pretrained(tmp_path / "base")
    model = module.Gemma3ForConditionalGeneration.from_pretrained(tmp_path / "base").eval()
    layers = find_lora_layers(model)
    assert len(layers) == 6
    for layer in layers.values():
        assert torch.count_nonzero(layer.lora_B) == 0
        assert torch.isfinite(layer.lora_A).all() and 0 < layer.lora_A.abs().max() < 1.0
    ids = torch.randint(0, 290, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, original(input_ids=ids).logits)


def test_lora_auto_class_builds_own_classes_and_converts_others():
    text = transformers.LlamaConfig(**TEXT)
    plain = lora_auto_class(transformers.AutoModel, [], LoraConfig(target_modules=["q_proj"]))
    model = plain.from_config(text)
    assert type(model) is transformers.LlamaModel and len(find_lora_layers(model)) == 2

    class LlamaModel(transformers.LlamaModel):  # stands for the rewritten file's class
        pass

    own = lora_auto_class(transformers.AutoModel, [LlamaModel], LoraConfig(target_modules=["q_proj"]))
    assert type(own.from_config(text)) is LlamaModel
    untouched = convert_sub_model(transformers.LlamaModel(text), LoraConfig(target_modules=["nothing_here"]))
    assert find_lora_layers(untouched) == {}
    with pytest.raises(TypeError, match="LoraConfig"):
        lora_auto_class(transformers.AutoModel, [], {"r": 8})  # type: ignore[arg-type]


def qwen3_vl_config() -> Any:
    rope = {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    }
    return transformers.Qwen3VLConfig(
        text_config={**TEXT, "head_dim": 8, "rope_parameters": rope},
        vision_config={
            "depth": 1,
            "hidden_size": 32,
            "num_heads": 4,
            "intermediate_size": 64,
            "patch_size": 4,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "out_hidden_size": 32,
            "deepstack_visual_indexes": [0],
            "num_position_embeddings": 16,
        },
        image_token_id=299,
        video_token_id=298,
        vision_start_token_id=297,
    )


def test_qwen3_vl_builds_both_sub_models_from_the_rewritten_file(tmp_path):
    source = MODELS / "qwen3_vl" / "modeling_qwen3_vl.py"
    targets = ["q_proj", "v_proj", "qkv"]
    result = rewrite_source(
        source.read_text(),
        LoraConfig(r=4, lora_alpha=8, target_modules=targets),
        filename=str(source),
        package=module_name_for_path(source)[1],
    )
    assert result.ok and "[Qwen3VLVisionModel, Qwen3VLTextModel]" in result.code
    name = "transformers.models.qwen3_vl.modeling_qwen3_vl_lora"
    (tmp_path / "modeling_qwen3_vl_lora.py").write_text(result.code)
    spec = importlib.util.spec_from_file_location(name, tmp_path / "modeling_qwen3_vl_lora.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        torch.manual_seed(0)
        original = transformers.Qwen3VLForConditionalGeneration(qwen3_vl_config()).eval()
        model = module.Qwen3VLForConditionalGeneration(qwen3_vl_config()).eval()
        assert type(model.model.visual) is module.Qwen3VLVisionModel
        assert type(model.model.language_model) is module.Qwen3VLTextModel
        runtime = loragen.get_lora_model(
            copy.deepcopy(original), LoraConfig(r=4, lora_alpha=8, target_modules=targets)
        )
        assert (
            sorted(find_lora_layers(model)) == sorted(find_lora_layers(runtime))
            and len(find_lora_layers(model)) == 5
        )
        assert sorted(model.state_dict()) == sorted(runtime.state_dict())
        model.load_state_dict(original.state_dict(), strict=False)
        peft_model = peft.get_peft_model(
            copy.deepcopy(original),
            peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False),
        ).eval()
        peft_model.save_pretrained(tmp_path / "adapter")
        load_adapter(model, tmp_path / "adapter")
        ids = torch.randint(0, 290, (2, 7), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            expected = peft_model(input_ids=ids).logits
            assert not torch.allclose(expected, original(input_ids=ids).logits, atol=1e-3)
            torch.testing.assert_close(model(input_ids=ids).logits, expected, atol=1e-5, rtol=1e-5)
    finally:
        sys.modules.pop(name, None)
