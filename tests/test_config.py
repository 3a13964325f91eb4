"""LoraConfig: validation messages, peft round trips, and matching rules equal to peft's."""

from __future__ import annotations

import dataclasses
import warnings

import peft
import pytest

from loragen import LoraConfig, LoraConfigError
from loragen.config import LoraConfigWarning


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"r": 0}, r"^r=0: the rank must be a positive integer$"),
        ({"r": True}, r"^r=True"),
        ({"lora_alpha": "16"}, r"^lora_alpha='16': expected a finite number$"),
        ({"lora_dropout": -0.1}, r"^lora_dropout=-0.1: expected a probability with 0 <= p < 1$"),
        ({"lora_dropout": 1}, r"^lora_dropout=1:"),
        ({"bias": "some"}, r"^bias='some': expected one of 'none', 'all', 'lora_only'$"),
        ({"use_rslora": "yes"}, r"^use_rslora='yes': expected True or False$"),
        ({"init_lora_weights": "pissa"}, r"^init_lora_weights='pissa'.*not supported"),
        (
            {"target_modules": ["q", 3]},
            r"^target_modules=\['q', 3\]: expected None, a regex string, or a list",
        ),
        ({"target_modules": "q_proj("}, r"^target_modules='q_proj\(' is not a valid regular expression"),
        ({"exclude_modules": "all-linear"}, r"exclude_modules='all-linear'"),
        ({"modules_to_save": "lm_head"}, r"^modules_to_save='lm_head': expected a list"),
        ({"rank_pattern": {"q": 0}}, r"^rank_pattern\['q'\]=0: the rank must be a positive integer$"),
        ({"rank_pattern": {"q": 2.5}}, r"^rank_pattern\['q'\]=2.5: expected a int$"),
        ({"alpha_pattern": ["q"]}, r"^alpha_pattern=\['q'\]: expected a dict"),
        ({"alpha_pattern": {"(": 2}}, r"alpha_pattern\['\('\]='\(' is not a valid regular expression"),
        ({"layers_to_transform": [-1]}, r"^layers_to_transform=\[-1\]: expected a non-negative int"),
        (
            {"layers_to_transform": [0], "target_modules": "q.*"},
            r"layers_to_transform cannot be used when target_modules is a regex",
        ),
        (
            {"layers_pattern": "layers"},
            r"^layers_pattern='layers' is only meaningful with layers_to_transform$",
        ),
    ],
)
def test_validation_names_field_and_value(kwargs: dict, message: str) -> None:
    with pytest.raises(LoraConfigError, match=message):
        LoraConfig(**kwargs)


def test_frozen_and_immutable_collections() -> None:
    cfg = LoraConfig(target_modules=["q", "v"], rank_pattern={"q": 2})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.r = 4  # type: ignore[misc]
    with pytest.raises(TypeError):
        cfg.rank_pattern["v"] = 3  # type: ignore[index]
    assert cfg.target_modules == ("q", "v")


def test_config_pickles_and_deep_copies() -> None:
    import copy
    import pickle

    cfg = LoraConfig(target_modules=["q"], rank_pattern={"q": 2}, alpha_pattern={"q": 3})
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    clone = copy.deepcopy(cfg)
    assert clone == cfg and clone.rank_pattern == {"q": 2}
    with pytest.raises(TypeError, match="read-only"):
        clone.alpha_pattern.update({"v": 1})


def test_to_peft_loads_in_peft_and_round_trips() -> None:
    cfg = LoraConfig(
        r=4,
        lora_alpha=16,
        lora_dropout=0.1,
        target_modules=["q_proj", "v_proj"],
        modules_to_save=["lm_head"],
        bias="lora_only",
        use_rslora=True,
        init_lora_weights="gaussian",
        rank_pattern={"q_proj": 2},
        alpha_pattern={"v_proj": 4},
        layers_to_transform=[0, 1],
        layers_pattern="layers",
    )
    data = cfg.to_peft()
    assert data["peft_type"] == "LORA" and data["inference_mode"] is True
    theirs = peft.LoraConfig.from_peft_type(**data)
    assert theirs.r == 4 and theirs.use_rslora and set(theirs.target_modules) == {"q_proj", "v_proj"}
    assert theirs.rank_pattern == {"q_proj": 2} and theirs.layers_to_transform == [0, 1]
    assert LoraConfig.from_peft(data) == cfg
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert LoraConfig.from_peft(theirs.to_dict()) == cfg.replace(target_modules=("q_proj", "v_proj"))


def test_from_peft_reports_unknown_fields() -> None:
    data = LoraConfig(target_modules=["q"]).to_peft() | {"shiny_new_option": 3, "other": None}
    with pytest.warns(
        LoraConfigWarning,
        match=r"adapter_config\.json: ignoring peft fields loragen does not know: other, shiny_new_option",
    ):
        LoraConfig.from_peft(data)


@pytest.mark.parametrize(
    ("field", "value"), [("use_qalora", True), ("lora_bias", True), ("layer_replication", [[0, 2]])]
)
def test_from_peft_refuses_features_it_would_silently_drop(field: str, value) -> None:
    data = LoraConfig(target_modules=["q"]).to_peft() | {field: value}
    with pytest.raises(LoraConfigError, match=rf"^cfg\.json: {field}=.* is not supported by loragen"):
        LoraConfig.from_peft(data, source="cfg.json")


def test_from_peft_names_the_source_and_field() -> None:
    with pytest.raises(
        LoraConfigError, match=r"^a/adapter_config\.json: r=-2: the rank must be a positive integer$"
    ):
        LoraConfig.from_peft({"peft_type": "LORA", "r": -2}, source="a/adapter_config.json")
    with pytest.raises(LoraConfigError, match=r"peft_type='IA3': loragen reads LoRA adapters only"):
        LoraConfig.from_peft({"peft_type": "IA3"})


@pytest.mark.parametrize("init", ["eva", "orthogonal"])
def test_from_peft_loads_values_only_inits_as_plain_lora(init):
    config = LoraConfig.from_peft(
        {"peft_type": "LORA", "r": 4, "target_modules": ["q"], "init_lora_weights": init}
    )
    assert config.init_lora_weights is True


@pytest.mark.parametrize("init", ["pissa", "pissa_niter_16", "olora", "corda", "lora_ga", "loftq"])
def test_from_peft_refuses_inits_that_changed_the_base_weights(init):
    with pytest.raises(
        LoraConfigError, match=rf"init_lora_weights='{init}': peft changed the base model's weights"
    ):
        LoraConfig.from_peft(
            {"peft_type": "LORA", "r": 4, "target_modules": ["q"], "init_lora_weights": init}
        )


def test_from_peft_refuses_mica_because_it_trains_only_a():
    with pytest.raises(LoraConfigError, match=r"'mica': peft trains only lora_A"):
        LoraConfig.from_peft(
            {"peft_type": "LORA", "r": 4, "target_modules": ["q"], "init_lora_weights": "mica"}
        )


def test_from_peft_refuses_unknown_init_schemes_by_name():
    with pytest.raises(LoraConfigError, match=r"init_lora_weights='sparkle' is not a scheme loragen knows"):
        LoraConfig.from_peft(
            {"peft_type": "LORA", "r": 4, "target_modules": ["q"], "init_lora_weights": "sparkle"}
        )


def test_a_comma_in_a_target_string_gets_a_hint_to_pass_a_list() -> None:
    with pytest.raises(
        LoraConfigError,
        match=r"target_modules='q_proj,v_proj'.*pass a list: target_modules=\['q_proj', 'v_proj'\]",
    ):
        LoraConfig(target_modules="q_proj,v_proj")
    with pytest.raises(LoraConfigError, match=r"exclude_modules='a, b'.*pass a list"):
        LoraConfig(target_modules=["a"], exclude_modules="a, b")
    assert (
        LoraConfig(target_modules=r".*\.layers\.\d{1,2}\.q_proj").target_modules
        == r".*\.layers\.\d{1,2}\.q_proj"
    )
