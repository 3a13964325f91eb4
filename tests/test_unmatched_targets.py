"""A ``target_modules`` entry that matches nothing: a warning per entry at run time (the rule ``loragen
rewrite`` applies to a file), an error with ``strict_targets=True``; the field stays out of peft's config."""

from __future__ import annotations

import warnings

import pytest
from torch import nn

import loragen
from loragen.config import TargetWarning
from loragen.plan import Candidate, resolve_candidates


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(8, 8)
        self.v_proj = nn.Linear(8, 8)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Attention()
        self.mlp = nn.Linear(8, 8)


SOURCE = """
from torch import nn


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(8, 8)
        self.v_proj = nn.Linear(8, 8)
"""


def test_each_unmatched_entry_warns_and_the_rest_converts() -> None:
    config = loragen.LoraConfig(target_modules=["q_prj", "v_proj", "k_prj"])
    with pytest.warns(TargetWarning) as caught:
        model = loragen.get_lora_model(Block(), config)
    messages = [str(w.message) for w in caught if issubclass(w.category, TargetWarning)]
    assert len(messages) == 2
    assert "'q_prj' matches no module of Block" in messages[0] and "attn.q_proj" in messages[0]
    assert "'k_prj'" in messages[1] and "strict_targets=True" in messages[1]
    assert isinstance(model.attn.v_proj, loragen.LoraLinear) and not isinstance(
        model.attn.q_proj, loragen.LoraLinear
    )


def test_strict_targets_makes_it_an_error_and_changes_nothing() -> None:
    model = Block()
    config = loragen.LoraConfig(target_modules=["q_prj", "v_proj"], strict_targets=True)
    with pytest.raises(
        loragen.LoraConversionError, match=r"\['q_prj'\] match no module of Block \(strict_targets=True\)"
    ):
        loragen.get_lora_model(model, config)
    assert not any(isinstance(m, loragen.LoraLayer) for m in model.modules())


def test_entries_that_all_match_are_silent() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loragen.get_lora_model(Block(), loragen.LoraConfig(target_modules=["q_proj", "attn.v_proj", "mlp"]))


def test_an_entry_ruled_out_by_exclude_modules_counts_as_unmatched() -> None:
    config = loragen.LoraConfig(target_modules=["q_proj", "mlp"], exclude_modules=["mlp"])
    with pytest.warns(TargetWarning, match="'mlp' matches no module"):
        loragen.get_lora_model(Block(), config)


def test_rewrite_and_run_time_report_the_same_entries() -> None:
    config = loragen.LoraConfig(target_modules=["q_prj", "v_proj"])
    result = loragen.rewrite_source(SOURCE, config)
    assert result.unmatched_targets == ("q_prj",)
    paths = [name for name, _ in Attention().named_modules() if name]
    assert resolve_candidates(config, [Candidate(path, None) for path in paths]).unmatched == ("q_prj",)


def test_strict_targets_is_not_written_for_peft() -> None:
    config = loragen.LoraConfig(target_modules=["q_proj"], strict_targets=True)
    assert "strict_targets" not in config.to_peft()
    assert loragen.LoraConfig.from_peft(config.to_peft()).strict_targets is False
    with pytest.raises(loragen.LoraConfigError, match="strict_targets"):
        loragen.LoraConfig(strict_targets="yes")  # type: ignore[arg-type]
