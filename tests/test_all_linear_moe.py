"""``all-linear`` on transformers 5 MoE models adapts what peft 0.21's adapts: the attention and other linear
layers, the routers and the fused expert parameters (``gate_up_proj`` at twice the rank), on five
architectures. loragen also keeps the dense layers' and shared experts' ``gate_proj``/``up_proj``/
``down_proj``, which peft's conversion drops from ``all-linear``: the one documented difference."""

from __future__ import annotations

import copy
import json
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import loragen
from loragen.adapters.save import adapter_state_dict
from loragen.config import LoraConfigWarning
from tests.layers.experts_models import VOCAB, mixtral, olmoe, qwen3_moe

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=16,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=32,
)
_DENSE = ("gate_proj", "up_proj", "down_proj")  # nn.Linear names peft's conversion moves to the experts


def _deepseek_v3() -> nn.Module:
    config = transformers.DeepseekV3Config(
        **_COMMON,
        intermediate_size=24,
        moe_intermediate_size=12,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        q_lora_rank=8,
        kv_lora_rank=8,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=8,
    )
    return transformers.DeepseekV3ForCausalLM(config)


def _glm4_moe() -> nn.Module:
    config = transformers.Glm4MoeConfig(
        **_COMMON,
        intermediate_size=24,
        moe_intermediate_size=12,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        head_dim=8,
    )
    return transformers.Glm4MoeForCausalLM(config)


def _minimax() -> nn.Module:
    config = transformers.MiniMaxConfig(
        **_COMMON,
        intermediate_size=24,
        num_local_experts=4,
        num_experts_per_tok=2,
        head_dim=8,
        layer_types=["full_attention", "full_attention"],
    )
    return transformers.MiniMaxForCausalLM(config)


def _qwen2_moe() -> nn.Module:
    config = transformers.Qwen2MoeConfig(
        **_COMMON,
        intermediate_size=24,
        moe_intermediate_size=12,
        shared_expert_intermediate_size=20,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )
    return transformers.Qwen2MoeForCausalLM(config)


MODELS: dict[str, Callable[[], nn.Module]] = {
    "mixtral": mixtral,
    "qwen3_moe": qwen3_moe,
    "olmoe": olmoe,
    "deepseek_v3": _deepseek_v3,
    "glm4_moe": _glm4_moe,
    "minimax": _minimax,
}


def _make(kind: str) -> nn.Module:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return MODELS[kind]().eval()


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))


def _shapes(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {key.replace(".default", ""): tuple(t.shape) for key, t in tensors.items()}


def _is_dense(key: str) -> bool:
    module = key.removeprefix("base_model.model.").split(".lora_")[0]
    return module.rpartition(".")[2] in _DENSE


@pytest.mark.parametrize("kind", list(MODELS))
def test_all_linear_trains_what_peft_trains(kind: str) -> None:
    base = _make(kind)
    lora = loragen.get_lora_model(copy.deepcopy(base), loragen.LoraConfig(target_modules="all-linear"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        twin = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(target_modules="all-linear"))
    ours = _shapes(adapter_state_dict(lora, lora.loragen_config))
    theirs = _shapes(peft.get_peft_model_state_dict(twin))
    # the fused expert parameters and the routers are in both, with peft's ranks (gate_up_proj at 2r)
    assert any(".experts.base_layer.lora_A" in key for key in ours)
    assert any(".mlp.gate.lora_A" in key for key in ours)
    assert {k: v for k, v in ours.items() if not _is_dense(k)} == theirs
    extra = {k for k in ours if _is_dense(k)}
    assert not any(_is_dense(k) for k in theirs)
    if kind in ("deepseek_v3", "glm4_moe"):  # dense first layer and shared experts: loragen keeps them
        assert any(".layers.0.mlp.gate_proj." in k for k in extra)
        assert any(".shared_experts.down_proj." in k for k in extra)
    else:
        assert not extra


@pytest.mark.parametrize("kind", ["mixtral", "deepseek_v3"])
@pytest.mark.parametrize(
    "target_parameters", [None, ["experts.gate_up_proj", "experts.down_proj"]], ids=["plain", "readme"]
)
def test_peft_loads_the_all_linear_adapter_with_equal_outputs(
    kind: str, target_parameters: list[str] | None, tmp_path: Path
) -> None:
    base = _make(kind)
    config = loragen.LoraConfig(
        target_modules="all-linear", target_parameters=target_parameters, init_lora_weights=False
    )
    lora = loragen.get_lora_model(copy.deepcopy(base), config)
    loragen.save_adapter(lora, tmp_path)
    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    # all-linear named as peft saves it after its own conversion (a string would be converted again on load)
    assert isinstance(saved["target_modules"], list) and "o_proj" in saved["target_modules"]
    assert not set(saved["target_modules"]) & {"gate", "w1", "w2", "w3", "gate_proj", "up_proj", "down_proj"}
    # gate_up_proj fuses two linears: twice the rank, under a key that also names one adapted module, whose own
    # key comes first (so peft, which checks pattern keys against modules only, loads it without a warning)
    (anchor, anchor_r), (key, r) = saved["rank_pattern"].items()
    assert key == anchor + r"|.*\.gate_up_proj" and r == 16 and anchor_r == 8
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        twin = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path))
    assert not [str(w.message) for w in caught if "did not match any targeted module" in str(w.message)]
    loaded = _shapes(peft.get_peft_model_state_dict(twin))
    assert loaded == _shapes(adapter_state_dict(lora, lora.loragen_config))
    with torch.no_grad():
        torch.testing.assert_close(lora(_tokens()).logits, twin(_tokens()).logits)
    # and loragen reads its own folder back into a plain model identically
    again = loragen.load_adapter(copy.deepcopy(base), tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(again(_tokens()).logits, lora(_tokens()).logits)


def test_qwen2_moe_adapts_the_experts_peft_leaves_out_and_peft_loads_them(tmp_path: Path) -> None:
    # peft 0.21 does not convert Qwen2-MoE's own model type (its family's name is no entry of transformers'
    # table): its all-linear trains the linears only, loragen's the experts and routers too
    torch.manual_seed(0)
    base = _qwen2_moe().eval()
    lora = loragen.get_lora_model(
        copy.deepcopy(base), loragen.LoraConfig(target_modules="all-linear", init_lora_weights=False)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        twin = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(target_modules="all-linear"))
    ours = _shapes(adapter_state_dict(lora, lora.loragen_config))
    theirs = _shapes(peft.get_peft_model_state_dict(twin))
    assert set(theirs) < set(ours)
    assert {key: ours[key] for key in theirs} == theirs
    extra = {
        key.removeprefix("base_model.model.model.").split(".lora_")[0] for key in set(ours) - set(theirs)
    }
    layers = ("layers.0.mlp", "layers.1.mlp")
    assert extra == {f"{layer}.{m}" for layer in layers for m in ("experts", "experts.base_layer", "gate")}
    # the shared experts' linears stay module targets: the saved config lists only the fused parameters
    loragen.save_adapter(lora, tmp_path)
    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    assert saved["target_parameters"] == ["gate.weight", "gate_up_proj", "down_proj"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path))
    assert _shapes(peft.get_peft_model_state_dict(loaded)) == ours
    with torch.no_grad():
        torch.testing.assert_close(loaded(_tokens()).logits, lora(_tokens()).logits)


@pytest.mark.parametrize("fields", [{"lora_dropout": 0.1}, {"use_dora": True}], ids=["dropout", "dora"])
def test_qwen2_moe_with_what_parameters_cannot_take_adapts_what_peft_adapts(fields: dict) -> None:
    """Where peft's all-linear leaves the experts out anyway (Qwen2-MoE's own type), a config that cannot
    adapt parameters converts the linears only, with a warning, instead of being refused."""
    torch.manual_seed(0)
    base = _qwen2_moe().eval()
    with pytest.warns(LoraConfigWarning, match=r"leaves the fused expert parameters .* out"):
        lora = loragen.get_lora_model(
            copy.deepcopy(base), loragen.LoraConfig(target_modules="all-linear", **fields)
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        twin = peft.get_peft_model(
            copy.deepcopy(base), peft.LoraConfig(target_modules="all-linear", **fields)
        )
    assert _shapes(adapter_state_dict(lora, lora.loragen_config)) == _shapes(
        peft.get_peft_model_state_dict(twin)
    )


def test_all_linear_with_dropout_on_an_moe_model_says_why() -> None:
    with pytest.raises(loragen.LoraConfigError, match=r"all-linear.*fused expert parameters.*lora_dropout"):
        loragen.get_lora_model(
            _make("mixtral"), loragen.LoraConfig(target_modules="all-linear", lora_dropout=0.1)
        )


def test_an_explicit_module_list_leaves_the_experts_out() -> None:
    model = loragen.get_lora_model(_make("mixtral"), loragen.LoraConfig(target_modules=["q_proj", "v_proj"]))
    assert not model.loragen_config.target_parameters
    assert not any("experts" in n for n, p in model.named_parameters() if p.requires_grad)


def test_a_dense_model_is_unchanged_by_the_expansion() -> None:
    config = transformers.LlamaConfig(**_COMMON, intermediate_size=24)
    torch.manual_seed(0)
    model = loragen.get_lora_model(
        transformers.LlamaForCausalLM(config), loragen.LoraConfig(target_modules="all-linear")
    )
    assert model.loragen_config == loragen.LoraConfig(target_modules="all-linear")


@pytest.mark.parametrize("kind", ["mixtral", "deepseek_v3"])
def test_loragen_loads_what_peft_all_linear_saves(kind: str, tmp_path: Path) -> None:
    base = _make(kind)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        twin = peft.get_peft_model(
            copy.deepcopy(base), peft.LoraConfig(target_modules="all-linear", init_lora_weights=False)
        )
        twin.save_pretrained(str(tmp_path))
    loaded = loragen.load_adapter(copy.deepcopy(base), tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(loaded(_tokens()).logits, twin(_tokens()).logits)


# ---- the three ways in give the same model ---------------------------------------------------------------


def test_decorator_and_runtime_adapt_the_same_experts_and_the_rewrite_refuses_them() -> None:
    """``all-linear`` on Mixtral: ``@lora_convert``'s generated ``get_lora_model`` adapts the fused expert
    parameters and the router as ``loragen.get_lora_model`` does (the same plan: layers, ranks, keys,
    trainable set, saved config); ``loragen rewrite`` cannot express LoRA on a parameter and says so."""
    import inspect

    from transformers.models.mixtral import modeling_mixtral as m

    from loragen.source.decorator import GENERATED_METHODS, lora_convert

    config = loragen.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    torch.manual_seed(0)
    base = mixtral()
    runtime = loragen.get_lora_model(copy.deepcopy(base), config)
    classes = (m.MixtralAttention, m.MixtralSparseMoeBlock, m.MixtralForCausalLM)
    try:
        for cls in classes:
            lora_convert(cls, config)
        decorated = copy.deepcopy(base).get_lora_model()
    finally:
        for cls in classes:
            for name in (*GENERATED_METHODS, "lora_fields", "lora_unresolved", "__lora_source__"):
                if name in vars(cls):
                    delattr(cls, name)

    def described(model: nn.Module) -> dict[str, tuple[str, int]]:
        return {
            path: (type(layer).__name__, getattr(layer, "r", 0))
            for path, layer in loragen.convert.find_lora_layers(model).items()
        }

    assert described(decorated) == described(runtime)
    experts = [p for p, (kind, _) in described(runtime).items() if p.endswith("experts")]
    assert experts, "all-linear adapts Mixtral's fused experts"
    trainable = {n: tuple(p.shape) for n, p in runtime.named_parameters() if p.requires_grad}
    assert {n: tuple(p.shape) for n, p in decorated.named_parameters() if p.requires_grad} == trainable
    assert decorated.loragen_config == runtime.loragen_config
    assert "gate_up_proj" in runtime.loragen_config.target_parameters
    with torch.no_grad():  # a trained-looking adapter, then the same weights in both: the same outputs
        for name, p in runtime.named_parameters():
            if "lora_B" in name:
                p.normal_(generator=torch.Generator().manual_seed(len(name)))
    assert decorated.state_dict().keys() == runtime.state_dict().keys()
    decorated.load_state_dict(runtime.state_dict())
    tokens = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        expected, got = runtime(tokens).logits, decorated(tokens).logits
        assert not torch.allclose(expected, base(tokens).logits, atol=1e-3)  # the adapters count
        assert torch.allclose(got, expected, atol=1e-6)
    assert (
        adapter_state_dict(decorated, decorated.loragen_config).keys()
        == adapter_state_dict(runtime, runtime.loragen_config).keys()
    )

    result = loragen.rewrite_source(
        inspect.getsource(m), config, filename=m.__file__, package="transformers.models.mixtral"
    )
    assert not result.ok and not result.changed
    (error,) = result.errors
    assert (
        "MixtralExperts.gate_up_proj" in error.message
        and "cannot express LoRA on a parameter" in error.message
    )
    listed = loragen.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    assert loragen.rewrite_source(
        inspect.getsource(m), listed, filename=m.__file__, package="transformers.models.mixtral"
    ).ok
