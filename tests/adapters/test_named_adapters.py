"""Several named adapters on one model, against peft: set / disable / mixed batch / weighted / delete /
save and load both ways, on tiny Llama, GPT-2 and BERT (fp32, 1e-5).

Each case builds a peft model with three adapters whose targets differ per layer (so sibling fusion sees
layers whose adapters differ), moves every factor off its init, saves it with peft (the default adapter at
the root, the others in subfolders) and loads that folder into loragen adapter by adapter.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import peft
import pytest
import torch
from torch import nn

import loragen
from loragen import LoraConfig, load_adapter
from tests.adapters.helpers import make_model
from tests.conftest import tiny_inputs

ATOL = 1e-5

# kind -> {adapter name: LoraConfig keyword arguments}; "third" has the default's rank (for "linear")
CASES: dict[str, dict[str, dict]] = {
    "llama": {
        "default": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
        "other": dict(r=2, lora_alpha=6, target_modules=["q_proj", "k_proj", "o_proj"]),
        "third": dict(r=4, lora_alpha=4, target_modules=["v_proj", "gate_proj"]),
    },
    "gpt2": {
        "default": dict(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"]),
        "other": dict(r=2, lora_alpha=6, target_modules=["c_attn", "c_fc"]),
        "third": dict(r=4, lora_alpha=4, target_modules=["c_proj"]),
    },
    "bert": {
        "default": dict(r=4, lora_alpha=8, target_modules=["query", "value"]),
        "other": dict(r=2, lora_alpha=6, target_modules=["query", "key"]),
        "third": dict(r=4, lora_alpha=4, target_modules=["value"]),
    },
}
ROWS = ["default", "other", "__base__", "third", "other"]


def _inputs(kind: str) -> dict[str, torch.Tensor]:
    return tiny_inputs(kind, batch=len(ROWS), seq=6, seed=3)


@torch.no_grad()
def _run(model: nn.Module, kind: str, **kwargs: object) -> torch.Tensor:
    out = model(**_inputs(kind), **kwargs)
    return out if isinstance(out, torch.Tensor) else out.logits


def _peft_model(kind: str, folder: Path) -> peft.PeftModel:
    """peft's model with the case's adapters, factors moved off init, saved in ``folder``."""
    configs = CASES[kind]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.get_peft_model(make_model(kind), peft.LoraConfig(**configs["default"]))
        for name, kwargs in configs.items():
            if name != "default":
                model.add_adapter(name, peft.LoraConfig(**kwargs))
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for param_name, p in model.named_parameters():
                if "lora_" in param_name:
                    p.add_(torch.randn(p.shape, generator=g) * 0.2)
        model.save_pretrained(str(folder))
    return model.eval()


def _loragen_model(kind: str, folder: Path) -> nn.Module:
    """loragen's model loaded from peft's multi-adapter folder: the root, then each subfolder."""
    model = load_adapter(make_model(kind), folder)
    for name in CASES[kind]:
        if name != "default":
            load_adapter(model, folder / name, adapter_name=name)
    return model.eval()


@pytest.fixture(params=list(CASES))
def pair(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, peft.PeftModel, nn.Module]:
    kind = request.param
    theirs = _peft_model(kind, tmp_path / "peft")
    ours = _loragen_model(kind, tmp_path / "peft")
    return kind, theirs, ours


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, atol=ATOL, rtol=ATOL)


def test_keys_single_adapter_unchanged_further_adapters_named(tmp_path: Path) -> None:
    model = loragen.get_lora_model(make_model("llama"), LoraConfig(**CASES["llama"]["default"]))
    before = set(model.state_dict())
    loragen.add_adapter(model, LoraConfig(**CASES["llama"]["other"]), "other")
    added = set(model.state_dict()) - before
    q = "model.layers.0.self_attn.q_proj"
    assert f"{q}.lora_A" in before and f"{q}.lora_adapters.other.lora_A" in added
    # k_proj had no adapter: "other" is its first, in its own lora_A
    assert "model.layers.0.self_attn.k_proj.lora_A" in added
    assert loragen.list_adapters(model) == ["default", "other"]
    assert loragen.active_adapter(model) == "default"


def test_set_adapter_equals_peft(pair: tuple[str, peft.PeftModel, nn.Module]) -> None:
    kind, theirs, ours = pair
    for name in ("default", "other", "third", "default"):
        theirs.set_adapter(name)
        loragen.set_adapter(ours, name)
        _close(_run(ours, kind), _run(theirs, kind))


def test_disable_adapter_gives_the_base_model(pair: tuple[str, peft.PeftModel, nn.Module]) -> None:
    kind, theirs, ours = pair
    base = _run(make_model(kind), kind)
    loragen.set_adapter(ours, "other")
    with_adapter = _run(ours, kind)
    with loragen.disable_adapter(ours):
        torch.testing.assert_close(_run(ours, kind), base, atol=0, rtol=0)
    with theirs.disable_adapter():
        _close(_run(theirs, kind), base)
    _close(_run(ours, kind), with_adapter)
    assert loragen.active_adapter(ours) == "other"


def test_mixed_batch_equals_peft(pair: tuple[str, peft.PeftModel, nn.Module]) -> None:
    kind, theirs, ours = pair
    expected = _run(theirs, kind, adapter_names=ROWS)
    with loragen.mixed_batch(ours, ROWS):
        _close(_run(ours, kind), expected)
    # each row is the model with that row's adapter
    for i, name in enumerate(ROWS):
        if name == "__base__":
            with loragen.disable_adapter(ours):
                _close(_run(ours, kind)[i], expected[i])
        else:
            loragen.set_adapter(ours, name)
            _close(_run(ours, kind)[i], expected[i])


@pytest.mark.parametrize(
    ("combination", "adapters", "weights"),
    [
        ("cat", ["default", "other"], [0.7, -0.4]),
        ("linear", ["default", "third"], [0.6, 0.5]),
        ("svd", ["default", "other"], [1.0, 0.5]),
        ("linear", ["other"], [2.0]),
    ],
)
def test_weighted_adapter_equals_peft(
    pair: tuple[str, peft.PeftModel, nn.Module], combination: str, adapters: list[str], weights: list[float]
) -> None:
    kind, theirs, ours = pair
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs.add_weighted_adapter(adapters, weights, "mix", combination_type=combination)
    loragen.add_weighted_adapter(ours, adapters, weights, "mix", combination_type=combination)
    theirs.set_adapter("mix")
    loragen.set_adapter(ours, "mix")
    _close(_run(ours, kind), _run(theirs, kind))


def test_weighted_cat_is_exact(pair: tuple[str, peft.PeftModel, nn.Module]) -> None:
    kind, _, ours = pair
    deltas = {}
    for name in ("default", "other"):
        loragen.set_adapter(ours, name)
        deltas[name] = _run(ours, kind) - _run(make_model(kind), kind)
    loragen.add_weighted_adapter(ours, ["default", "other"], [1.0, 1.0], "both", combination_type="cat")
    loragen.set_adapter(ours, "both")
    # not linear in the output (attention, norms), but the layers' updates add exactly
    for layer in loragen.convert.find_lora_layers(ours).values():
        held = [n for n in ("default", "other") if n in loragen.layers.adapter_set.adapter_names(layer)]
        if not held:
            continue
        expected = sum(layer.delta_weight(n) for n in held)
        _close(layer.delta_weight("both"), expected)


def test_delete_adapter_equals_peft(pair: tuple[str, peft.PeftModel, nn.Module]) -> None:
    kind, theirs, ours = pair
    theirs.delete_adapter("default")
    loragen.delete_adapter(ours, "default")
    assert theirs.active_adapter == loragen.active_adapter(ours) == "other"
    # peft picks the new active adapter per layer (a layer holding "default" and "third" goes on with
    # "third"); loragen makes the model's choice active in every layer: set it on peft's side too
    assert {layer.active_adapter for layer in loragen.convert.find_lora_layers(ours).values()} == {"other"}
    theirs.set_adapter("other")
    _close(_run(ours, kind), _run(theirs, kind))
    for name in ("third", "other"):
        theirs.set_adapter(name)
        loragen.set_adapter(ours, name)
        _close(_run(ours, kind), _run(theirs, kind))
    loragen.delete_adapter(ours, "third")
    loragen.delete_adapter(ours, "other")
    assert not loragen.convert.find_lora_layers(ours)
    torch.testing.assert_close(_run(ours, kind), _run(make_model(kind), kind), atol=0, rtol=0)


def test_save_loads_in_peft_and_back(pair: tuple[str, peft.PeftModel, nn.Module], tmp_path: Path) -> None:
    kind, theirs, ours = pair
    folder = loragen.save_adapter(ours, tmp_path / "ours")
    assert (folder / "adapter_model.safetensors").is_file()
    assert sorted(p.name for p in folder.iterdir() if p.is_dir()) == ["other", "third"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reloaded = peft.PeftModel.from_pretrained(make_model(kind), str(folder)).eval()
        for name in ("other", "third"):
            result = reloaded.load_adapter(str(folder / name), adapter_name=name)
            assert not result.unexpected_keys
            assert not [k for k in result.missing_keys if "lora_" in k]
    again = _loragen_model(kind, folder)
    for name in CASES[kind]:
        theirs.set_adapter(name)
        reloaded.set_adapter(name)
        loragen.set_adapter(again, name)
        expected = _run(theirs, kind)
        _close(_run(reloaded, kind), expected)
        _close(_run(again, kind), expected)


def test_merge_merges_the_active_adapter(pair: tuple[str, peft.PeftModel, nn.Module]) -> None:
    kind, theirs, ours = pair
    loragen.set_adapter(ours, "other")
    unmerged = _run(ours, kind)
    loragen.merge_adapter(ours)
    _close(_run(ours, kind), unmerged)
    with pytest.raises(loragen.LoraMergeError, match="'other' while it is merged"):
        loragen.delete_adapter(ours, "other")
    with loragen.disable_adapter(ours):  # unmerged inside, merged again after
        torch.testing.assert_close(_run(ours, kind), _run(make_model(kind), kind), atol=ATOL, rtol=ATOL)
    _close(_run(ours, kind), unmerged)
    theirs.set_adapter("other")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain_theirs = theirs.merge_and_unload()
    plain_ours = loragen.merge_and_unload(ours)
    assert not loragen.convert.find_lora_layers(plain_ours)
    assert not any("lora" in k for k in plain_ours.state_dict())
    _close(_run(plain_ours, kind), _run(plain_theirs, kind))


def test_loading_a_further_adapter_is_all_or_nothing(tmp_path: Path) -> None:
    _peft_model("llama", tmp_path / "peft")
    model = load_adapter(make_model("llama"), tmp_path / "peft")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    types = {name: type(m) for name, m in model.named_modules()}
    # "other"'s file under a config of another rank: the factors do not fit
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_model.safetensors").write_bytes(
        (tmp_path / "peft/other/adapter_model.safetensors").read_bytes()
    )
    config = LoraConfig(**{**CASES["llama"]["other"], "r": 3}).to_peft()
    (bad / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(loragen.AdapterError, match="shape mismatch"):
        load_adapter(model, bad, adapter_name="other")
    assert loragen.list_adapters(model) == ["default"]
    assert {name: type(m) for name, m in model.named_modules()} == types
    assert model.state_dict().keys() == before.keys()
    for key, value in before.items():
        assert torch.equal(model.state_dict()[key], value), key


def test_training_the_active_adapter_gives_peft_gradients(
    pair: tuple[str, peft.PeftModel, nn.Module],
) -> None:
    kind, theirs, ours = pair
    theirs.set_adapter("other")
    loragen.set_adapter(ours, "other")
    for model in (theirs, ours):
        out = model(**_inputs(kind))
        (out if isinstance(out, torch.Tensor) else out.logits).pow(2).mean().backward()
    trained = 0
    for path, layer in loragen.convert.find_lora_layers(ours).items():
        peft_layer = theirs.base_model.model.get_submodule(path)
        for name in loragen.layers.adapter_set.adapter_names(layer):
            factors = loragen.layers.adapter_set.adapter_factors(layer, name)
            peft_a, peft_b = peft_layer.lora_A[name].weight, peft_layer.lora_B[name].weight
            assert factors.factor_a.requires_grad == peft_a.requires_grad == (name == "other")
            if name == "other":
                _close(factors.factor_a.grad, peft_a.grad)
                _close(factors.factor_b.grad, peft_b.grad)
                trained += 1
    assert trained == len([m for m in theirs.modules() if hasattr(m, "lora_A") and "other" in m.lora_A])


def test_deleting_the_adapter_that_saves_a_module_freezes_it_again() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    loragen.get_lora_model(model, LoraConfig(r=2, target_modules=["0"], modules_to_save=["1"]))
    assert all(p.requires_grad for p in model[1].parameters())
    loragen.delete_adapter(model, "default")
    assert not any(p.requires_grad for p in model.parameters())  # as in peft: with no adapter, nothing trains
