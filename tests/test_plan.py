"""loragen.plan: the one reader of a config's matching rules, on live models and on module descriptions."""

from __future__ import annotations

import ast
from pathlib import Path

import peft
import pytest
from hypothesis import given
from hypothesis import strategies as st
from peft.tuners.tuners_utils import check_target_module_exists
from torch import nn

import loragen
from loragen import LoraConfig
from loragen.errors import LoraConversionError
from loragen.plan import Candidate, candidates_of, entry_for, resolve, resolve_candidates

ROOT = Path(__file__).resolve().parents[1]


def test_rank_and_alpha_patterns() -> None:
    cfg = LoraConfig(
        r=8,
        lora_alpha=16,
        rank_pattern={"q_proj": 2, r"layers\.1\..*v_proj": 4},
        alpha_pattern={"v_proj": 3},
        use_rslora=True,
    )
    assert entry_for(cfg, "model.layers.0.self_attn.q_proj").r == 2
    assert entry_for(cfg, "model.layers.1.self_attn.v_proj").r == 4
    assert entry_for(cfg, "model.layers.0.self_attn.v_proj").r == 8
    assert entry_for(cfg, "model.layers.0.self_attn.v_proj").lora_alpha == 3
    assert entry_for(cfg, "model.layers.1.self_attn.v_proj").scaling == pytest.approx(3 / 2)


# ---- matching equals peft's check_target_module_exists -----------------------------------------

names = st.sampled_from(
    ["q_proj", "v_proj", "o_proj", "mlp", "up_proj", "layers", "h", "attn", "0", "1", "2", "11"]
)
paths = st.lists(names, min_size=1, max_size=5).map(".".join)


@given(
    path=paths,
    targets=st.one_of(
        st.lists(names, min_size=1, max_size=3), st.sampled_from([r".*q_proj", r".*\.1\..*", "mlp"])
    ),
    exclude=st.one_of(st.none(), st.lists(names, min_size=1, max_size=2)),
    layers=st.one_of(st.none(), st.lists(st.integers(0, 12), min_size=1, max_size=3)),
    pattern=st.one_of(st.none(), st.sampled_from(["layers", "h"])),
)
def test_target_matching_equals_peft(path, targets, exclude, layers, pattern) -> None:
    if isinstance(targets, str) and layers is not None:
        layers = None
    if layers is None:
        pattern = None
    cfg = dict(
        target_modules=targets, exclude_modules=exclude, layers_to_transform=layers, layers_pattern=pattern
    )
    theirs = bool(check_target_module_exists(peft.LoraConfig(**cfg), path))
    theirs = (
        theirs
        and type(check_target_module_exists(peft.LoraConfig(**cfg), path)).__name__ != "_ExcludedModule"
    )
    plan = resolve_candidates(LoraConfig(**cfg), [Candidate(path, "torch.nn.Linear")])
    assert (path in plan) == theirs


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 2)

    def get_output_embeddings(self) -> nn.Module:
        return self.head


def test_a_live_model_and_its_description_get_the_same_plan() -> None:
    model = _Model()
    for config in (
        LoraConfig(target_modules="all-linear", rank_pattern={"q_proj": 4}),
        LoraConfig(target_modules=["q_proj", "head"], alpha_pattern={"head": 3.0}),
    ):
        live = resolve(model, config)
        described = resolve_candidates(config, candidates_of(model))
        assert live == described
    assert list(resolve(model, LoraConfig(target_modules="all-linear")).entries) == ["q_proj"]


def test_resolve_changes_nothing_and_raises_up_front() -> None:
    model = _Model()
    before = {name: type(m) for name, m in model.named_modules()}
    with pytest.raises(LoraConversionError, match=r"norm \(torch.nn.modules.normalization.LayerNorm\)"):
        resolve(model, LoraConfig(target_modules=["q_proj", "norm"]))
    resolve(model, LoraConfig(target_modules=["q_proj"], modules_to_save=["norm"], bias="all"))
    assert {name: type(m) for name, m in model.named_modules()} == before
    plan = resolve(model, LoraConfig(target_modules=["q_proj"], modules_to_save=["norm"], bias="all"))
    assert plan.modules_to_save == ("norm",) and plan.bias == "all"


# ---- nothing outside the plan reads the matching rules -----------------------------------------

# LoraConfig methods that interpreted the matching rules before the plan existed, and the fields only the
# plan (and the config's own validation) reads
_RULE_METHODS = {
    "matches_target",
    "is_excluded",
    "rank_for",
    "alpha_for",
    "scaling_for",
    "is_module_to_save",
    "unmatched_entries",
    "layer_index",
}
_RULE_FIELDS = {"exclude_modules", "rank_pattern", "alpha_pattern", "layers_to_transform", "layers_pattern"}


def test_nothing_outside_the_plan_interprets_the_matching_rules() -> None:
    offenders = []
    for file in sorted((ROOT / "loragen").rglob("*.py")):
        if file.name in ("plan.py", "config.py") and file.parent.name == "loragen":
            continue
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            if isinstance(node, ast.Attribute) and (
                node.attr in _RULE_METHODS
                or (
                    node.attr in _RULE_FIELDS
                    and not (isinstance(node.value, ast.Name) and node.value.id == "args")
                )
            ):
                offenders.append(f"{file.relative_to(ROOT)}:{node.lineno}: .{node.attr}")
    for template in sorted((ROOT / "templates").rglob("*.j2")):
        for number, line in enumerate(template.read_text().splitlines(), 1):
            offenders += [
                f"{template.relative_to(ROOT)}:{number}: .{m}" for m in _RULE_METHODS if f".{m}(" in line
            ]
    assert offenders == []
    assert not any(hasattr(LoraConfig, m) for m in _RULE_METHODS)


def test_the_runtime_path_goes_through_resolve(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    original = loragen.plan.resolve

    def spy(model, config, **kwargs):
        seen.append(type(model).__name__)
        return original(model, config, **kwargs)

    monkeypatch.setattr(loragen.convert, "resolve", spy)
    loragen.get_lora_model(_Model(), LoraConfig(target_modules=["q_proj"]))
    assert seen == ["_Model"]
