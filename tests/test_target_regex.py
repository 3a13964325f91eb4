"""Regular expressions in a config (``target_modules``, ``exclude_modules``, ``rank_pattern``,
``alpha_pattern``, ``layers_pattern``, ``rewrite --target-regex``): patterns people write match exactly as
``re`` (and peft) match them, and patterns that backtrack catastrophically are refused, never run."""

from __future__ import annotations

import contextlib
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import peft
import pytest
from hypothesis import given
from hypothesis import strategies as st
from peft.tuners.tuners_utils import check_target_module_exists
from transformers import LlamaConfig, LlamaForCausalLM

import loragen
from loragen import LoraConfig
from loragen.errors import LoraConfigError
from loragen.plan import Candidate, _analysed, _sre_module, check_pattern, entry_for, resolve_candidates
from tests.cli.test_rewrite import run_cli

# Patterns from peft's tests and docs, transformers' and other projects' LoRA recipes, and loragen's own
# (peft's per-architecture defaults, the keys loragen writes for fused experts).
REALISTIC = [
    r".*\.(q_proj|v_proj)",
    r".*\.(q_proj|v_proj)$",
    r".*(q_proj|v_proj)$",
    "model.layers.*.self_attn.(q|k|v)_proj",
    "model.layers.*.self_attn.q_proj",
    "model.layers.*.mlp.down_proj",
    r"^(?!.*vision).*\.(q_proj|k_proj)$",
    r"^model(?!\.(language_model|visual))",
    r"^(model(?=\.).*\.(q_proj|k_proj|v_proj|gate_proj|up_proj|down_proj))$",
    r".*\.[0-5]\.self_attn\.v_proj|.*\.[4-7]\.self_attn\.k_proj",
    r".*\.(q_proj|k_proj|v_proj|gate_proj|up_proj|down_proj)",
    r".*\.mlp\.fc\d",
    r".*\.embed_tokens",
    r".*(embed_tokens|lm_head)$",
    r".*\.gate_up_proj",
    ".*.(SelfAttention|EncDecAttention|DenseReluDense).*(q|v|wo)$",
    ".*encoder.*block.0.*(SelfAttention|EncDecAttention|DenseReluDense).(k|q|v|wo|wi)$",
    "(l1|vera_A).*",
    ".*lin.*",
    "^embed_tokens",
    r".*language_model\..*\.(q_proj|v_proj)",
    r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)",
    r"model\.layers\.[0-3]\.(self_attn|mlp)\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)",
    r"model\.layers\.0\.self_attn\.(q_proj|v_proj)",
    r"model\.layers\..*\.self_attn\.(?:q|v)_proj",
    r"language_model\.layers\.\d+\.self_attn\.(q|k|v)_proj",
    r"language_model.model.layers.[\d]+.(mlp|cross_attn|self_attn).(up|down|gate|q|k|v|o)_proj",
    r"^blocks\.\d+\.(attn\.(qkv|proj)|mlp\.(fc1|fc2))$",
    r".*visual\.transformer\.resblocks\.\d+\.(attn\.out_proj|mlp\.c_fc|mlp\.c_proj)",
    r"(.*(model.text_model).*(down_proj|gate_proj|up_proj|k_proj|q_proj|v_proj|o_proj).*$|.*(custom_text_proj).*$)",
    r".*multi_modal_projector.*linear.*",
    r"(.*self_attn\.(q|v)_proj)",
    r"layers\.\d+\.attn\.(Wqkv|Wo)",
    r".*\.conv2",
    r"(\w+\.)*q_proj",
    r"(.*\.)?q_proj",
    r"(?i).*\.Q_PROJ",
    r".*\.layers\.(1[0-9]|2[0-3])\.mlp\..*",
    r".*layers.*mlp.*proj",
    r"(?:(?:model\.)?layers\.\d{1,3}\.)?self_attn\.o_proj",
]

NAMES = [
    "model.embed_tokens",
    "model.layers.0.self_attn.q_proj",
    "model.layers.0.self_attn.k_proj",
    "model.layers.0.self_attn.v_proj",
    "model.layers.3.self_attn.v_proj",
    "model.layers.5.self_attn.k_proj",
    "model.layers.12.mlp.gate_proj",
    "model.layers.21.mlp.down_proj",
    "model.language_model.layers.0.self_attn.q_proj",
    "model.vision_tower.vision_model.encoder.layers.0.self_attn.q_proj",
    "model.visual.blocks.0.attn.qkv",
    "model.multi_modal_projector.linear_1",
    "model.text_model.layers.1.mlp.up_proj",
    "custom_text_proj",
    "encoder.block.0.layer.0.SelfAttention.q",
    "decoder.block.1.layer.1.EncDecAttention.v",
    "encoder.block.0.layer.1.DenseReluDense.wo",
    "blocks.7.attn.proj",
    "blocks.7.mlp.fc2",
    "visual.transformer.resblocks.11.mlp.c_fc",
    "backbone.layers.2.mixer.in_proj",
    "layers.4.attn.Wqkv",
    "layer1.0.conv2",
    "lin0",
    "l1",
    "embed_tokens",
    "lm_head",
    "self_attn.o_proj",
    "model.layers.0.mlp.experts.gate_up_proj",
]


def llama() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    return LlamaForCausalLM(config)


@contextlib.contextmanager
def finishes_within(seconds: int) -> Iterator[None]:
    """Fail (instead of hanging the suite) if the block runs past ``seconds``: a generous bound for work
    that takes milliseconds, where the failure it guards against runs for minutes."""

    def expired(signum: int, frame: object) -> None:
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


# ---- patterns people write: accepted, and matched as re (and peft) match them ------------------


@pytest.mark.parametrize("pattern", REALISTIC)
def test_a_realistic_target_regex_selects_what_re_and_peft_select(pattern: str) -> None:
    check_pattern("target_modules", pattern)
    plan = resolve_candidates(
        LoraConfig(target_modules=pattern), [Candidate(n, "torch.nn.Linear") for n in NAMES]
    )
    expected = [n for n in NAMES if re.fullmatch(pattern, n)]
    assert list(plan.entries) == expected
    theirs = peft.LoraConfig(target_modules=pattern)
    assert expected == [n for n in NAMES if check_target_module_exists(theirs, n)]


@pytest.mark.parametrize("pattern", REALISTIC)
def test_a_realistic_pattern_key_and_exclusion_match_as_peft_matches_them(pattern: str) -> None:
    if pattern.startswith("(?i)"):  # global flags must open the expression, not follow peft's "(.*\.)?("
        pattern = pattern.replace("(?i)", "(?i:", 1) + ")"
    config = LoraConfig(target_modules=list(NAMES), rank_pattern={pattern: 4}, alpha_pattern={pattern: 3.0})
    for name in NAMES:
        wanted = re.match(rf"(.*\.)?({pattern})$", name) is not None
        entry = entry_for(config, name)
        assert (entry.r, entry.lora_alpha) == ((4, 3.0) if wanted else (8, 8.0)), name
    plan = resolve_candidates(
        LoraConfig(target_modules=list(NAMES), exclude_modules=pattern),
        [Candidate(n, "torch.nn.Linear") for n in NAMES],
    )
    assert list(plan.entries) == [n for n in NAMES if not re.fullmatch(pattern, n)]


def test_layers_pattern_finds_the_layer_index_as_before() -> None:
    config = LoraConfig(target_modules=["q_proj"], layers_to_transform=[1], layers_pattern=["layers", "h"])
    plan = resolve_candidates(
        config,
        [
            Candidate(n, "torch.nn.Linear")
            for n in ("model.layers.1.q_proj", "model.layers.0.q_proj", "h.1.q_proj")
        ],
    )
    assert list(plan.entries) == ["model.layers.1.q_proj", "h.1.q_proj"]


def test_chained_repeats_are_accepted_on_names_of_any_realistic_length() -> None:
    pattern = r".*layers.*mlp.*proj"
    long_name = "model." + "sub_module." * 40 + "layers.0.mlp.down_proj"  # 460 characters
    plan = resolve_candidates(LoraConfig(target_modules=pattern), [Candidate(long_name, "torch.nn.Linear")])
    assert list(plan.entries) == [long_name]


# ---- patterns that backtrack catastrophically: refused, naming the field and the pattern ---------

CATASTROPHIC = [
    "(.|.)*Z",
    "(a+)+Z",
    "(a*)*Z",
    "(.*)*Z",
    r"(\w+\.?)*Z",
    r"(.*\.)*q_proj",
    "(a|aa)*Z",
    "(a|a?)+Z",
    "(a?a?)*Z",
    r"(\d{1,3})+Z",
    "(.{0,10})*Z",
    r"^(\w+\s?)*$",
    "(x+x+)+y",
    r"(?!(a|a)*Z).*q_proj",
    r"(?:.*a){12}Z",
]


@pytest.mark.parametrize("pattern", CATASTROPHIC)
def test_a_pattern_that_backtracks_exponentially_is_refused(pattern: str) -> None:
    with pytest.raises(LoraConfigError, match=rf"target_modules {re.escape(repr(pattern))} can backtrack"):
        check_pattern("target_modules", pattern)


def test_the_catastrophic_target_regex_on_a_llama_is_refused_at_once() -> None:
    model = llama()
    before = {name: type(m) for name, m in model.named_modules()}
    with (
        finishes_within(60),
        pytest.raises(LoraConfigError, match=r"target_modules '\(\.\|\.\)\*Z' can backtrack"),
    ):
        loragen.get_lora_model(model, LoraConfig(target_modules="(.|.)*Z"))
    assert {name: type(m) for name, m in model.named_modules()} == before


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        (dict(target_modules=["q_proj"], exclude_modules="(.|.)*Z"), "exclude_modules '(.|.)*Z'"),
        (dict(target_modules=["q_proj"], rank_pattern={"(a+)+Z": 4}), "rank_pattern key '(a+)+Z'"),
        (dict(target_modules=["q_proj"], alpha_pattern={"(a+)+Z": 4.0}), "alpha_pattern key '(a+)+Z'"),
        (
            dict(target_modules=["q_proj"], layers_to_transform=[0], layers_pattern="(.|.)*Z"),
            "layers_pattern '(.|.)*Z'",
        ),
    ],
)
def test_every_pattern_field_is_checked_and_named(fields: dict, named: str) -> None:
    with finishes_within(60), pytest.raises(LoraConfigError, match=re.escape(named) + " can backtrack"):
        loragen.get_lora_model(llama(), LoraConfig(**fields))


def test_chained_repeats_bound_the_length_of_the_names_they_are_run_on() -> None:
    pattern = ".*" * 10 + "Z"  # ten repeats that can each take any part of a name: ~n**10 steps
    name = "model.layers.0.self_attn.q_proj"
    with (
        finishes_within(60),
        pytest.raises(
            LoraConfigError,
            match=rf"target_modules '{re.escape(pattern)}': matching it against the module path '{name}'",
        ),
    ):
        resolve_candidates(LoraConfig(target_modules=pattern), [Candidate(name, "torch.nn.Linear")])
    short = resolve_candidates(LoraConfig(target_modules=pattern), [Candidate("aZ", "torch.nn.Linear")])
    assert list(short.entries) == ["aZ"]


# ---- loragen rewrite --target-regex: the same checks ---------------------------------------------


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    path = tmp_path / "model.py"
    path.write_text(
        "from torch import nn\n\nclass Attention(nn.Module):\n    def __init__(self):\n"
        "        super().__init__()\n        self.q_proj = nn.Linear(2, 2)\n        self.v_proj = nn.Linear(2, 2)\n"
    )
    return path


def test_rewrite_refuses_a_catastrophic_target_regex_naming_the_flag(model_file: Path, capsys) -> None:
    before = model_file.read_text()
    with finishes_within(60):
        status = run_cli(str(model_file), "--target-regex", "(.|.)*Z", "--in-place")
    assert status == 2
    assert "--target-regex '(.|.)*Z' can backtrack catastrophically" in capsys.readouterr().err
    assert model_file.read_text() == before


def test_rewrite_refuses_a_catastrophic_pattern_from_a_config_file(
    model_file: Path, tmp_path: Path, capsys
) -> None:
    config = tmp_path / "adapter_config.json"
    config.write_text('{"peft_type": "LORA", "target_modules": ["q_proj"], "rank_pattern": {"(a+)+Z": 4}}')
    with finishes_within(60):
        status = run_cli(str(model_file), "--config", str(config), "--in-place")
    assert status == 1
    assert "rank_pattern key '(a+)+Z' can backtrack catastrophically" in capsys.readouterr().err


def test_rewrite_takes_a_realistic_target_regex(model_file: Path, capsys) -> None:
    assert run_cli(str(model_file), "--target-regex", r"^(?!.*vision).*(q_proj|v_proj)$") == 0
    assert capsys.readouterr().out.count("LoraLinear(2, 2") == 2


# ---- any pattern: the check never fails on it, and what it accepts matches as re does -------------

_ATOMS = ["a", "b", ".", r"\.", r"\d", "[ab]", "[^.]", r"\w", "_proj"]


def _patterns() -> st.SearchStrategy[str]:
    def extend(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
        return st.one_of(
            st.tuples(inner, inner).map("".join),
            st.tuples(inner, inner).map(lambda p: f"(?:{p[0]}|{p[1]})"),
            inner.map(lambda p: f"({p})"),
            st.tuples(inner, st.sampled_from(["*", "+", "?", "{1,3}", "{2,}", "*?", "{0,6}"])).map(
                lambda p: f"(?:{p[0]}){p[1]}"
            ),
            st.tuples(st.sampled_from(["(?=", "(?!", "(?<=a)", "(?>"]), inner).map(
                lambda p: f"{p[0]}{p[1]})" if p[0] != "(?<=a)" else f"{p[0]}{p[1]}"
            ),
            inner.map(lambda p: f"^{p}$"),
        )

    return st.recursive(st.sampled_from(_ATOMS), extend, max_leaves=8)


_SHORT_NAMES = ["a", "ab", "a.b", "a1.b_proj", "q_proj", "x.y.z", "aaaa", "ab.ab.ab", "a_proj.b", ""]


@given(pattern=_patterns())
def test_any_pattern_is_checked_without_error_and_accepted_ones_match_as_re(pattern: str) -> None:
    if _analysed(pattern).refusal is not None:
        with pytest.raises(LoraConfigError, match=r"can backtrack catastrophically|too large to check"):
            check_pattern("target_modules", pattern)
        return
    candidates = [Candidate(n, "torch.nn.Linear") for n in _SHORT_NAMES if n]
    plan = resolve_candidates(LoraConfig(target_modules=pattern), candidates)
    assert list(plan.entries) == [c.path for c in candidates if re.fullmatch(pattern, c.path)]


@given(atom=st.sampled_from(_ATOMS), repeat=st.sampled_from(["*", "+", "{1,9}"]))
def test_a_repeat_of_two_ways_to_match_the_same_text_is_always_refused(atom: str, repeat: str) -> None:
    for pattern in (
        f"(?:{atom}|{atom}){repeat}Z",
        f"(?:(?:{atom})+){repeat}Z",
        f"(?:{atom}(?:{atom})?){repeat}Z",
    ):
        with pytest.raises(LoraConfigError, match="can backtrack catastrophically"):
            check_pattern("target_modules", pattern)


def test_a_pattern_key_that_is_no_regex_inside_peft_wrapper_is_an_error_naming_it() -> None:
    config = LoraConfig(target_modules=["q_proj"], rank_pattern={"(?i)Q_PROJ": 4})
    with pytest.raises(
        LoraConfigError, match=r"rank_pattern key '\(\?i\)Q_PROJ' is not a valid regular expression"
    ):
        entry_for(config, "model.layers.0.q_proj")


def test_rewrite_reports_an_invalid_target_regex_as_the_config_does(model_file: Path, capsys) -> None:
    assert run_cli(str(model_file), "--target-regex", "(q_proj", "--diff") == 2
    assert "target_modules='(q_proj' is not a valid regular expression" in capsys.readouterr().err


def test_the_regex_modules_are_found_by_their_python_3_10_names_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """Python 3.10 has no ``re._parser`` / ``re._compiler``: the check then uses ``sre_parse`` / ``sre_compile``."""
    import importlib
    import warnings

    real = importlib.import_module

    def without_re_private(name: str, package: str | None = None) -> object:
        if name.startswith("re._"):
            raise ImportError(name)
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", without_re_private)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the 3.10 names are deprecated aliases later
        parser = _sre_module("parser", "sre_parse")
        compiler = _sre_module("compiler", "sre_compile")
    assert hasattr(parser, "parse") and hasattr(compiler, "compile")
