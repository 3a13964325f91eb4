"""``nn.Conv3d`` (a video model's patch embedding) as peft adapts it: the same factors, keys and outputs as
peft's ``Conv3d`` LoRA layer (and its DoRA), in both directions; merged and unmerged outputs agree; ``loragen
merge`` merges it offline; the three ways in give the same model; the patch embeddings of transformers'
VideoMAE, ViViT and Qwen2-VL's vision tower adapt as in peft."""

from __future__ import annotations

import copy
import importlib.util
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import loragen
from loragen import LoraConfig, LoraConv3d
from loragen.cli import main as cli_main
from loragen.convert import find_lora_layers

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

SOURCE = textwrap.dedent(
    """\
    import torch
    from torch import nn


    class TinyVideo(nn.Module):
        def __init__(self):
            super().__init__()
            self.patch = nn.Conv3d(3, 8, (2, 4, 4), stride=(2, 4, 4))
            self.mix = nn.Conv3d(8, 8, 3, padding=1, bias=False)
            self.head = nn.Linear(8, 4)

        def forward(self, video):
            h = self.mix(torch.relu(self.patch(video)))  # (N, 8, T/2, H/4, W/4)
            return self.head(h.flatten(2).mean(-1))
    """
)


def _import_file(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def video_module(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("video")
    (folder / "tiny_video.py").write_text(SOURCE)
    yield _import_file(folder / "tiny_video.py", "tiny_video")
    sys.modules.pop("tiny_video", None)


def _base(video_module) -> nn.Module:
    torch.manual_seed(0)
    return video_module.TinyVideo().double().eval()


def _video() -> torch.Tensor:
    return torch.randn(2, 3, 4, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def _perturb(parameters: Callable[[], list[torch.Tensor]], seed: int = 2) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)


def _peft_lora_parameters(model: nn.Module) -> list[torch.Tensor]:
    return [p for n, p in sorted(model.named_parameters()) if "lora_" in n]


@pytest.mark.parametrize("use_dora", [False, True], ids=["lora", "dora"])
def test_a_peft_conv3d_adapter_loads_in_loragen_and_back(
    video_module, tmp_path: Path, use_dora: bool
) -> None:
    targets = dict(r=4, lora_alpha=8, target_modules=["patch", "mix"], use_dora=use_dora)
    x = _video()
    # peft writes, loragen reads
    theirs = peft.get_peft_model(_base(video_module), peft.LoraConfig(init_lora_weights=False, **targets))
    _perturb(lambda: _peft_lora_parameters(theirs))
    theirs.save_pretrained(tmp_path / "from_peft")
    ours = loragen.load_adapter(_base(video_module), tmp_path / "from_peft")
    assert isinstance(ours.patch, LoraConv3d) and isinstance(ours.mix, LoraConv3d)
    assert ours.patch.lora_A.shape == (4, 3, 2, 4, 4) and ours.patch.lora_B.shape == (8, 4, 1, 1, 1)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-10, atol=1e-12)

    # loragen writes, peft reads: the same file keys, the values unchanged, the same outputs
    mine = loragen.get_lora_model(_base(video_module), LoraConfig(init_lora_weights=False, **targets))
    _perturb(
        lambda: [p for layer in find_lora_layers(mine).values() for p in layer.lora_parameters().values()]
    )
    loragen.save_adapter(mine, tmp_path / "from_loragen")
    written = load_file(str(tmp_path / "from_loragen" / "adapter_model.safetensors"))
    assert sorted(written) == sorted(load_file(str(tmp_path / "from_peft" / "adapter_model.safetensors")))
    loaded = peft.PeftModel.from_pretrained(_base(video_module), tmp_path / "from_loragen")
    held = peft.get_peft_model_state_dict(loaded)  # what peft holds, under its file keys
    assert sorted(held) == sorted(written)
    for key, value in held.items():
        torch.testing.assert_close(value, written[key], rtol=0, atol=0, msg=key)
    torch.testing.assert_close(loaded(x), mine(x), rtol=1e-10, atol=1e-12)
    peft_trainable = {
        n.replace(".default", "").removeprefix("base_model.model.")
        for n, p in peft.get_peft_model(_base(video_module), peft.LoraConfig(**targets)).named_parameters()
        if p.requires_grad
    }
    assert {n for n, p in mine.named_parameters() if p.requires_grad} == {
        n.replace(".weight", "") for n in peft_trainable
    }


@pytest.mark.parametrize("use_dora", [False, True], ids=["lora", "dora"])
def test_merged_unmerged_and_unloaded_agree(video_module, use_dora: bool) -> None:
    model = loragen.get_lora_model(
        _base(video_module),
        LoraConfig(
            r=3, lora_alpha=5, target_modules=["patch", "mix"], init_lora_weights=False, use_dora=use_dora
        ),
    )
    _perturb(
        lambda: [p for layer in find_lora_layers(model).values() for p in layer.lora_parameters().values()]
    )
    x = _video()
    before = model(x)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    for _ in range(3):  # merging twice is a no-op; unmerging restores the weights
        loragen.merge_adapter(model)
        loragen.merge_adapter(model)
        torch.testing.assert_close(model(x), before, rtol=1e-10, atol=1e-12)
        loragen.unmerge_adapter(model)
        for key, value in model.state_dict().items():
            torch.testing.assert_close(value, weights[key], rtol=1e-12, atol=1e-12, msg=key)
    unloaded = loragen.merge_and_unload(model)
    assert type(unloaded.patch) is nn.Conv3d and type(unloaded.mix) is nn.Conv3d
    torch.testing.assert_close(unloaded(x), before, rtol=1e-10, atol=1e-12)


def test_loragen_merge_merges_a_conv3d_adapter_offline(video_module, tmp_path: Path) -> None:
    model = loragen.get_lora_model(
        _base(video_module),
        LoraConfig(r=2, lora_alpha=4, target_modules=["patch", "mix"], init_lora_weights=False),
    )
    x = _video()
    expected = model(x)
    loragen.save_adapter(model, tmp_path / "adapter")
    base_state = {k: v.contiguous() for k, v in model.state_dict().items() if "lora_" not in k}
    save_file(base_state, str(tmp_path / "base.safetensors"))
    out = tmp_path / "merged.safetensors"
    args = ["merge", "--base", str(tmp_path / "base.safetensors"), "--adapter", str(tmp_path / "adapter")]
    assert cli_main([*args, "-o", str(out), "--quiet"]) == 0
    plain = _base(video_module)
    plain.load_state_dict(load_file(str(out)))
    torch.testing.assert_close(plain(x), expected, rtol=1e-10, atol=1e-12)


def test_the_three_ways_in_give_the_same_model(video_module, tmp_path: Path) -> None:
    config = LoraConfig(r=2, lora_alpha=4, target_modules=["patch", "mix"])
    x = _video().float()
    torch.manual_seed(0)
    runtime = loragen.get_lora_model(video_module.TinyVideo(), config)
    _perturb(
        lambda: [p for layer in find_lora_layers(runtime).values() for p in layer.lora_parameters().values()]
    )
    expected = runtime.eval()(x)

    decorated = loragen.lora_convert(video_module.TinyVideo, config)().get_lora_model()

    result = loragen.rewrite_source(SOURCE, config, filename="tiny_video.py")
    assert result.ok, [str(e) for e in result.errors]
    assert "self.patch = LoraConv3d(3, 8, (2, 4, 4), stride=(2, 4, 4), r=2, lora_alpha=4)" in result.code
    assert "self.mix = LoraConv3d(8, 8, 3, padding=1, bias=False, r=2, lora_alpha=4)" in result.code
    (tmp_path / "tiny_video_lora.py").write_text(result.code)
    try:
        rewritten = _import_file(tmp_path / "tiny_video_lora.py", "tiny_video_lora").TinyVideo()
        loragen.mark_trainable(rewritten)  # a rewritten model trains what its LORA_CONFIG says
    finally:
        sys.modules.pop("tiny_video_lora", None)

    for model in (decorated, rewritten):
        assert list(model.state_dict()) == list(runtime.state_dict())
        assert {p: type(m) for p, m in find_lora_layers(model).items()} == {
            "patch": LoraConv3d,
            "mix": LoraConv3d,
        }
        assert {n for n, p in model.named_parameters() if p.requires_grad} == {
            n for n, p in runtime.named_parameters() if p.requires_grad
        }
        model.load_state_dict(runtime.state_dict())
        torch.testing.assert_close(model.eval()(x), expected)


def test_a_second_adapter_and_a_mixed_batch_equal_peft(video_module, tmp_path: Path) -> None:
    rows = ["default", "__base__", "other"]
    x = torch.randn(3, 3, 4, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    first = dict(r=2, lora_alpha=4, target_modules=["patch", "mix"], init_lora_weights=False)
    second = dict(r=3, lora_alpha=3, target_modules=["patch"], init_lora_weights=False)
    theirs = peft.get_peft_model(_base(video_module), peft.LoraConfig(**first))
    theirs.add_adapter("other", peft.LoraConfig(**second))
    theirs.eval()
    _perturb(lambda: _peft_lora_parameters(theirs))
    theirs.save_pretrained(tmp_path)  # the default adapter at the root, "other" in its subfolder
    ours = loragen.load_adapter(_base(video_module), tmp_path)
    loragen.load_adapter(ours, tmp_path / "other", adapter_name="other")
    with torch.no_grad():
        expected = theirs(x, adapter_names=rows)
        with loragen.mixed_batch(ours, rows):
            actual = ours(x)
    torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-12)
    theirs.set_adapter("other")
    loragen.set_adapter(ours, "other")
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-10, atol=1e-12)


# ---- transformers' video models: the patch embedding's Conv3d -------------------------------------------


def _videomae() -> nn.Module:
    config = transformers.VideoMAEConfig(
        image_size=16,
        patch_size=8,
        num_frames=4,
        tubelet_size=2,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        num_labels=3,
    )
    return transformers.VideoMAEForVideoClassification(config)


def _vivit() -> nn.Module:
    config = transformers.VivitConfig(
        image_size=16,
        num_frames=4,
        tubelet_size=[2, 8, 8],
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        num_labels=3,
    )
    return transformers.VivitForVideoClassification(config)


def _qwen2_vl_vision() -> nn.Module:
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    config = Qwen2VLVisionConfig(
        depth=1, embed_dim=16, hidden_size=16, num_heads=2, mlp_ratio=2, patch_size=4, temporal_patch_size=2
    )
    return Qwen2VisionTransformerPretrainedModel(config)


def _clips() -> dict[str, torch.Tensor]:
    """Two clips of 4 frames, 3 x 16 x 16: (N, T, C, H, W)."""
    g = torch.Generator().manual_seed(1)
    return {"pixel_values": torch.randn(2, 4, 3, 16, 16, dtype=torch.float64, generator=g)}


def _patches() -> dict[str, torch.Tensor]:
    """Qwen2-VL's flattened patches: one 2-frame 16 x 16 clip as 4 x 4 patches of (C=3, 2, 4, 4)."""
    g = torch.Generator().manual_seed(1)
    return {
        "hidden_states": torch.randn(16, 3 * 2 * 4 * 4, dtype=torch.float64, generator=g),
        "grid_thw": torch.tensor([[1, 4, 4]]),
    }


VIDEO_MODELS = {
    # model, the patch embedding's path, the attention's query projection, inputs, the output compared
    "videomae": (_videomae, "videomae.embeddings.patch_embeddings.projection", "query", _clips, "logits"),
    "vivit": (_vivit, "vivit.embeddings.patch_embeddings.projection", "q_proj", _clips, "logits"),
    "qwen2_vl_vision": (_qwen2_vl_vision, "patch_embed.proj", "qkv", _patches, "last_hidden_state"),
}


@pytest.mark.parametrize("name", sorted(VIDEO_MODELS))
def test_video_models_patch_embeddings_adapt_as_in_peft(name: str, tmp_path: Path) -> None:
    make, path, query, inputs, output = VIDEO_MODELS[name]
    torch.manual_seed(0)
    base = make().double().eval()
    targets = dict(r=4, lora_alpha=8, target_modules=[path, query], init_lora_weights=False)
    x = inputs()

    def run(model: nn.Module) -> torch.Tensor:
        return getattr(model(**x), output)

    theirs = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(**targets))
    _perturb(lambda: _peft_lora_parameters(theirs))
    theirs.save_pretrained(tmp_path / "peft")
    ours = loragen.load_adapter(copy.deepcopy(base), tmp_path / "peft", trainable=True)
    assert isinstance(ours.get_submodule(path), LoraConv3d)
    assert sum(isinstance(m, loragen.LoraLinear) for m in ours.modules()) == 1  # the one layer's query
    torch.testing.assert_close(run(ours), run(theirs), rtol=1e-10, atol=1e-12)
    peft_trainable = {n.replace(".default", "") for n, p in theirs.named_parameters() if p.requires_grad}
    assert {f"base_model.model.{n}" for n, p in ours.named_parameters() if p.requires_grad} == {
        n.replace(".lora_A.weight", ".lora_A").replace(".lora_B.weight", ".lora_B") for n in peft_trainable
    }

    loragen.save_adapter(ours, tmp_path / "loragen")
    written = load_file(str(tmp_path / "loragen" / "adapter_model.safetensors"))
    assert sorted(written) == sorted(load_file(str(tmp_path / "peft" / "adapter_model.safetensors")))
    assert f"base_model.model.{path}.lora_A.weight" in written
    again = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "loragen")
    torch.testing.assert_close(run(again), run(theirs), rtol=1e-10, atol=1e-12)
