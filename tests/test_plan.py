"""loragen.plan: the one reader of a config's matching rules, on live models and on module descriptions."""

from __future__ import annotations

import ast
from pathlib import Path

import peft
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from peft.tuners.tuners_utils import check_target_module_exists
from torch import nn

import loragen
from loragen import LoraConfig
from loragen.errors import LoraConversionError
from loragen.layers.adapter_set import has_adapter
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


# ---- peft's habits: default targets per architecture, task heads --------------------------------------

transformers = pytest.importorskip("transformers")


def _tiny(kind: str) -> nn.Module:
    t = transformers
    if kind == "llama":
        return t.LlamaForCausalLM(
            t.LlamaConfig(
                vocab_size=64,
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=1,
            )
        )
    if kind == "gpt2":
        return t.GPT2LMHeadModel(t.GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=32))
    if kind == "opt":
        return t.OPTForCausalLM(
            t.OPTConfig(
                vocab_size=64,
                hidden_size=16,
                ffn_dim=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                word_embed_proj_dim=16,
                max_position_embeddings=32,
            )
        )
    if kind == "falcon":
        return t.FalconForCausalLM(
            t.FalconConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2)
        )
    if kind == "bloom":
        return t.BloomForCausalLM(t.BloomConfig(vocab_size=64, hidden_size=16, n_layer=2, n_head=2))
    raise ValueError(kind)


def _peft_adapted(model: nn.Module) -> set[str]:
    return {
        name.removeprefix("base_model.model.")
        for name, module in model.named_modules()
        if hasattr(module, "lora_A") and name.startswith("base_model.model.")
    }


@pytest.mark.parametrize("kind", ["llama", "gpt2", "opt", "falcon", "bloom"])
def test_no_target_modules_adapts_what_peft_adapts(kind: str) -> None:
    """``target_modules=None`` resolves per architecture as peft does (q_proj/v_proj on Llama and OPT, c_attn
    on GPT-2, query_key_value on Falcon and BLOOM), and the kept config names them."""
    base = _tiny(kind)
    ours = loragen.get_lora_model(_copy(base), LoraConfig())
    theirs = peft.get_peft_model(_copy(base), peft.LoraConfig())
    assert set(loragen.convert.find_lora_layers(ours)) == _peft_adapted(theirs) != set()
    assert sorted(ours.loragen_config.target_modules) == sorted(theirs.peft_config["default"].target_modules)
    # a peft config without targets, through from_peft, too
    again = loragen.get_lora_model(_copy(base), LoraConfig.from_peft(peft.LoraConfig().to_dict()))
    assert set(loragen.convert.find_lora_layers(again)) == _peft_adapted(theirs)


def test_no_target_modules_on_a_model_peft_has_no_default_for_names_the_fields() -> None:
    with pytest.raises(LoraConversionError, match=r"target_modules is None: name the modules to adapt"):
        loragen.get_lora_model(_Model(), LoraConfig())


def _copy(model: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(model)


def _trainable(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize(
    ("task", "make", "head"),
    [
        ("SEQ_CLS", "LlamaForSequenceClassification", "score"),
        ("TOKEN_CLS", "LlamaForTokenClassification", "score"),
        ("QUESTION_ANS", "LlamaForQuestionAnswering", "qa_outputs"),
    ],
)
def test_task_type_trains_the_head_as_peft_does(task: str, make: str, head: str, tmp_path: Path) -> None:
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_labels=3,
        pad_token_id=0,
    )
    base = getattr(transformers, make)(config)
    peft_config = peft.LoraConfig(task_type=task, target_modules=["q_proj"])
    theirs = peft.get_peft_model(_copy(base), peft_config)
    ours_config = LoraConfig.from_peft(peft_config.to_dict())
    assert ours_config.task_type == task
    assert LoraConfig.from_peft(ours_config.to_peft()) == ours_config
    assert ours_config.to_peft()["task_type"] == task
    ours = loragen.get_lora_model(_copy(base), ours_config)
    head_module = ours.get_submodule(head)
    assert all(p.requires_grad for p in head_module.parameters())
    assert _trainable(ours) == _trainable(theirs)
    # peft loads the saved folder with the head, and so does loragen
    with torch.no_grad():
        for p in head_module.parameters():
            p.add_(1.0)
    loragen.save_adapter(ours, tmp_path)
    loaded = peft.PeftModel.from_pretrained(_copy(base), str(tmp_path))
    ours.eval()

    def out(model: nn.Module) -> torch.Tensor:
        result = model(input_ids=torch.tensor([[1, 2, 3, 4]]))
        return result.start_logits if task == "QUESTION_ANS" else result.logits

    with torch.no_grad():
        torch.testing.assert_close(out(loaded), out(ours))
    again = loragen.load_adapter(_copy(base), tmp_path)
    torch.testing.assert_close(again.get_submodule(head).weight, head_module.weight)


def test_a_further_adapter_without_targets_takes_peft_defaults_too() -> None:
    model = loragen.get_lora_model(_tiny("llama"), LoraConfig(target_modules=["o_proj"]))
    loragen.add_adapter(model, LoraConfig(), "second")
    layers = loragen.convert.find_lora_layers(model)
    holding = {path for path, layer in layers.items() if has_adapter(layer, "second")}
    assert holding == {f"model.layers.{i}.self_attn.{m}" for i in (0, 1) for m in ("q_proj", "v_proj")}
