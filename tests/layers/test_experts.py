"""LoRA on MoE experts stored as 3-D parameters (target_parameters): parity with peft, merging, errors."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.multiprocessing.reductions import StorageWeakRef

import loragen
from loragen import switches
from loragen.config import TargetWarning
from loragen.errors import LoraConfigError, LoraConversionError, MixedBatchError
from loragen.layers.expert_parameters import LoraParametersLayer
from loragen.layouts import EXPERTS, EXPERTS_TRANSPOSED
from tests.layers.experts_models import lora_grads, make, peft_grads, peft_twin, tokens

BOTH = ["gate_up_proj", "down_proj"]


def _config(**kwargs: object) -> loragen.LoraConfig:
    defaults: dict[str, object] = {
        "r": 2,
        "lora_alpha": 5,
        "target_modules": [],
        "target_parameters": BOTH,
        "init_lora_weights": False,
    }
    return loragen.LoraConfig(**{**defaults, **kwargs})  # type: ignore[arg-type]


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(ids).logits.square().mean()


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe", "olmoe"])
@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"target_parameters": ["experts.down_proj"]},
        {
            "target_modules": ["q_proj", "o_proj"],
            "rank_pattern": {"down_proj": 3},
            "alpha_pattern": {"gate_up_proj": 2},
        },
        {"use_rslora": True, "r": 4},
        {"target_parameters": ["experts.down_proj", "mlp.gate.weight"]},
    ],
    ids=["both", "down-only", "with-modules-and-patterns", "rslora", "router-2d"],
)
def test_outputs_and_gradients_equal_peft(kind: str, kwargs: dict) -> None:
    base = make(kind)
    config = _config(**kwargs)
    model = loragen.get_lora_model(copy.deepcopy(base), config)
    twin = peft_twin(base, model, config)
    ids = tokens()
    ours, theirs = _loss(model, ids), _loss(twin, ids)
    torch.testing.assert_close(model(ids).logits, twin(ids).logits, rtol=1e-5, atol=1e-5)
    ours.backward()
    theirs.backward()
    expected = peft_grads(twin)
    got = lora_grads(model)
    assert set(got) == set(expected)
    for key, grad in expected.items():
        torch.testing.assert_close(got[key], grad, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("implementation", ["eager", "batched_mm", "grouped_mm"])
def test_every_experts_implementation_matches_peft(implementation: str) -> None:
    base = make("mixtral")
    base.set_experts_implementation(implementation)
    config = _config()
    model = loragen.get_lora_model(copy.deepcopy(base), config)
    twin = peft_twin(base, model, config)
    ids = tokens(seed=3)
    _loss(model, ids).backward()
    _loss(twin, ids).backward()
    expected = peft_grads(twin)
    for key, grad in lora_grads(model).items():
        torch.testing.assert_close(grad, expected[key], rtol=1e-5, atol=1e-6, msg=key)


def test_recomputing_the_effective_weight_changes_no_gradient_and_holds_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import loragen.layers.expert_parameters as experts_module

    made: list[StorageWeakRef] = []
    original = experts_module.effective_weight

    def recording(*args: object) -> torch.Tensor:
        out = original(*args)  # type: ignore[arg-type]
        made.append(StorageWeakRef(out.untyped_storage()))
        return out

    monkeypatch.setattr(experts_module, "effective_weight", recording)
    base = make("mixtral")
    ids = tokens()
    grads, alive = {}, {}
    for fused in (True, False):
        made.clear()
        torch.manual_seed(0)
        model = loragen.get_lora_model(copy.deepcopy(base), _config())
        with switches.fused.using(fused):
            loss = _loss(model, ids)
            gc.collect()
            alive[fused] = sum(not ref.expired() for ref in made)
            loss.backward()
        grads[fused] = lora_grads(model)
    assert len(made) == 4  # gate_up_proj and down_proj of both layers
    # plain autograd holds the effective weights' storage until the backward (as peft's does); fused, none
    assert alive[True] == 0 and alive[False] >= 2
    for key, grad in grads[False].items():
        torch.testing.assert_close(grads[True][key], grad, rtol=0, atol=0)


def test_merge_and_unload_is_exact_and_gives_the_base_class_back() -> None:
    base = make("qwen3_moe")
    config = _config(target_modules=["q_proj"])
    model = loragen.get_lora_model(copy.deepcopy(base), config)
    ids = tokens()
    with torch.no_grad():
        before = model(ids).logits
        loragen.merge_adapter(model)
        merged = model(ids).logits
        loragen.unmerge_adapter(model)
        again = model(ids).logits
    torch.testing.assert_close(merged, before, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(again, before, rtol=1e-5, atol=1e-6)
    twin = peft_twin(base, model, config)
    plain = loragen.merge_and_unload(model)
    reference = twin.merge_and_unload()
    experts = plain.model.layers[0].mlp.experts
    assert type(experts) is type(base.model.layers[0].mlp.experts)
    assert set(plain.state_dict()) == set(base.state_dict())
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(plain.state_dict()[key], value, rtol=1e-6, atol=1e-6, msg=key)
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, before, rtol=1e-5, atol=1e-5)


def test_default_init_is_a_no_op_and_only_factors_train() -> None:
    base = make("mixtral")
    model = loragen.get_lora_model(copy.deepcopy(base), _config(init_lora_weights=True))
    ids = tokens()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, base(ids).logits, rtol=0, atol=0)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_targets." in name for name in trainable)
    assert set(base.state_dict()) <= set(model.state_dict())  # the base checkpoint's keys stay


def test_a_target_that_matches_nothing_is_named() -> None:
    """A warning naming the entry, as for target_modules (peft converts with the others), and an error
    with strict_targets=True."""
    with pytest.warns(TargetWarning, match=r"'experts.up_proj' match no parameter.*gate_up_proj"):
        model = loragen.get_lora_model(
            make("mixtral"), _config(target_parameters=["gate_up_proj", "experts.up_proj"])
        )
    assert any(".lora_targets.gate_up_proj." in name for name, _ in model.named_parameters())
    with pytest.raises(
        LoraConversionError, match=r"\['experts.up_proj'\] match no parameter.*strict_targets"
    ):
        loragen.get_lora_model(
            make("mixtral"),
            _config(target_parameters=["gate_up_proj", "experts.up_proj"], strict_targets=True),
        )


def test_parameters_alone_that_match_nothing_are_an_error() -> None:
    with pytest.raises(
        LoraConversionError, match=r"\['experts.up_proj'\] match no parameter of MixtralForCausalLM"
    ):
        loragen.get_lora_model(
            make("mixtral"), _config(target_modules=None, target_parameters=["experts.up_proj"])
        )


def test_a_module_targeted_both_ways_is_refused() -> None:
    model = make("mixtral")
    with pytest.raises(
        LoraConversionError, match=r"layers.0.self_attn.q_proj, .*: targeted by target_modules and by"
    ):
        loragen.get_lora_model(model, _config(target_modules=["q_proj"], target_parameters=["q_proj.weight"]))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"target_parameters": "experts.down_proj"}, "a regex string is not accepted"),
        ({"target_parameters": ["down_proj", ""]}, "'' is not a parameter name"),
    ],
)
def test_config_refuses_what_is_no_parameter_name(kwargs: dict, message: str) -> None:
    with pytest.raises(LoraConfigError, match=message):
        _config(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lora_dropout": 0.1}, "lora_dropout=0.1: LoRA on a parameter"),
        ({"fan_in_fan_out": True}, "fan_in_fan_out=True"),
        ({"use_dora": True}, "use_dora=True: DoRA on targeted parameters"),
    ],
)
def test_conversion_refuses_what_peft_refuses_where_a_parameter_is_selected(
    kwargs: dict, message: str
) -> None:
    """As peft: the config is accepted, selecting a parameter with it is not (peft's own all-linear writes
    such a config for a model without MoE layers, where nothing is selected)."""
    config = _config(**kwargs)
    with pytest.raises(LoraConfigError, match=rf"selects model\.layers\.0\.mlp\.experts\.\w+.*{message}"):
        loragen.get_lora_model(make("mixtral"), config)
    nothing = _config(target_modules=["q_proj"], target_parameters=["experts.w9"], **kwargs)
    with pytest.warns(TargetWarning, match="'experts.w9' match no parameter"):
        model = loragen.get_lora_model(make("mixtral"), nothing)
    assert any(name.endswith("q_proj.lora_A") for name, _ in model.named_parameters())


def test_config_round_trips_through_peft() -> None:
    config = _config(rank_pattern={"down_proj": 4})
    data = config.to_peft()
    assert data["target_parameters"] == BOTH
    assert loragen.LoraConfig.from_peft(data) == config
    assert peft.LoraConfig(**{k: v for k, v in data.items() if k != "peft_type"}).target_parameters == BOTH


peft = pytest.importorskip("peft")


@given(
    experts=st.integers(1, 4),
    r=st.integers(1, 3),
    rows=st.integers(1, 5),
    cols=st.integers(1, 5),
    transposed=st.booleans(),
)
def test_delta_matches_a_per_expert_loop(
    experts: int, r: int, rows: int, cols: int, transposed: bool
) -> None:
    layout = EXPERTS_TRANSPOSED if transposed else EXPERTS
    shape = (experts, rows, cols)
    _, in_features, out_features = layout.features(shape)
    a_shape, b_shape = layout.factor_shapes(shape, r)
    gen = torch.Generator().manual_seed(experts * 100 + r * 10 + rows)
    a, b = torch.randn(a_shape, generator=gen), torch.randn(b_shape, generator=gen)
    delta = layout.delta(a, b, shape)
    for e in range(experts):
        a_e = a[e * r : (e + 1) * r]  # expert e's rows of A
        b_e = b[:, [k * experts + e for k in range(r)]]  # its columns of B, peft's interleaved order
        want = b_e @ a_e
        torch.testing.assert_close(delta[e], want.t() if transposed else want)
    assert (a_shape, b_shape) == ((r * experts, in_features), (out_features, r * experts))


def test_transposed_experts_follow_peft() -> None:
    """A module with ``is_transposed = True`` stores (E, in, out): peft's layout for gpt-oss and friends."""

    class Experts(torch.nn.Module):
        is_transposed = True

        def __init__(self) -> None:
            super().__init__()
            self.down_proj = torch.nn.Parameter(torch.randn(3, 6, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.einsum("ei,eio->eo", x, self.down_proj)

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.experts = Experts()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.experts(x)

    torch.manual_seed(0)
    base = Block()
    config = _config(target_parameters=["down_proj"])
    model = loragen.get_lora_model(copy.deepcopy(base), config)
    layer = model.experts
    assert isinstance(layer, LoraParametersLayer)
    assert tuple(layer.lora_targets.down_proj.lora_A.shape) == (6, 6)  # (r*E, in)
    twin = peft_twin(base, model, config)
    x = torch.randn(3, 6)
    torch.testing.assert_close(model(x), twin(x), rtol=1e-5, atol=1e-5)


def test_parameters_alone_need_no_target_modules() -> None:
    model = loragen.get_lora_model(make("olmoe"), loragen.LoraConfig(target_parameters=["down_proj"]))
    adapted = loragen.convert.find_lora_layers(model)
    assert list(adapted) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert all(list(layer.parameter_targets) == ["down_proj"] for layer in adapted.values())


def test_gradient_checkpointing_and_outer_hooks_still_apply() -> None:
    base = make("qwen3_moe")
    config = _config()
    model = loragen.get_lora_model(copy.deepcopy(base), config)
    twin = peft_twin(base, model, config)
    for m in (model, twin):
        m.train()
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = tokens()
    with torch.autograd.graph.save_on_cpu():
        _loss(model, ids).backward()
    _loss(twin, ids).backward()
    expected = peft_grads(twin)
    for key, grad in lora_grads(model).items():
        torch.testing.assert_close(grad, expected[key], rtol=1e-5, atol=1e-6, msg=key)


def test_bf16_experts_follow_peft() -> None:
    """A bf16 base keeps float32 factors (as peft does by default); the update is folded in bf16, as in peft."""
    base = make("mixtral").to(torch.bfloat16)
    config = _config()
    model = loragen.get_lora_model(copy.deepcopy(base), config)
    factor = model.model.layers[0].mlp.experts.lora_targets.gate_up_proj.lora_A
    assert factor.dtype == torch.float32
    twin = peft_twin(base, model, config)
    ids = tokens()
    _loss(model, ids).backward()
    _loss(twin, ids).backward()
    torch.testing.assert_close(model(ids).logits, twin(ids).logits, rtol=0, atol=0)
    expected = peft_grads(twin)
    for key, grad in lora_grads(model).items():
        torch.testing.assert_close(grad, expected[key], rtol=1e-2, atol=1e-4, msg=key)


def test_named_adapters_leave_expert_parameters_alone_when_another_adapter_runs() -> None:
    base = make("mixtral")
    model = loragen.get_lora_model(copy.deepcopy(base), _config(target_modules=["q_proj"]))
    loragen.add_adapter(
        model, loragen.LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False), "other"
    )
    ids = tokens()
    with torch.no_grad():
        with_experts = model(ids).logits
        with loragen.disable_adapter(model):
            torch.testing.assert_close(model(ids).logits, base(ids).logits, rtol=0, atol=0)
        loragen.set_adapter(model, "other")
        only_q = copy.deepcopy(base)
        loragen.get_lora_model(only_q, loragen.LoraConfig(r=2, target_modules=["q_proj"]))
        for path, layer in loragen.convert.find_lora_layers(only_q).items():
            source = model.get_submodule(path).lora_adapters["other"]
            layer.lora_A.copy_(source.lora_A)
            layer.lora_B.copy_(source.lora_B)
        torch.testing.assert_close(model(ids).logits, only_q(ids).logits, rtol=1e-5, atol=1e-6)
        loragen.set_adapter(model, "default")
        torch.testing.assert_close(model(ids).logits, with_experts, rtol=0, atol=0)
    with pytest.raises(
        LoraConfigError, match=r"target_parameters=\['gate_up_proj', 'down_proj'\]: LoRA on parameters"
    ):
        loragen.add_adapter(model, _config(), "third")


def test_a_mixed_batch_is_refused_on_expert_parameters() -> None:
    model = loragen.get_lora_model(make("mixtral"), _config(target_modules=["q_proj"]))
    loragen.add_adapter(model, loragen.LoraConfig(r=2, target_modules=["q_proj"]), "other")
    with (
        pytest.raises(MixedBatchError, match="LoraMixtralExperts: a mixed batch"),
        loragen.mixed_batch(model, ["default", "other"]),
        torch.no_grad(),
    ):
        model(tokens())
