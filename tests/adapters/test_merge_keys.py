"""``loragen merge`` maps adapter keys to checkpoint keys one to one, explained, and never guesses.

The two reported cases first: an adapter for a 2-layer Llama and an adapter for ``blocks.N.q_proj``
merged into a 1-layer Llama checkpoint must both be refused (exit 1, keys named, nothing written).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file
from torch import nn

from loragen import LoraConfig, get_lora_model, save_adapter
from loragen.adapters import offline_merge
from loragen.adapters.offline_merge import (
    Checkpoint,
    KeyMap,
    MergeError,
    PrefixRule,
    explicit_key_map,
    merge_checkpoint,
    resolve_keys,
)
from tests.adapters.helpers import main, make_model, peft_adapter, perturb_trainable, save_checkpoint

LLAMA_ADAPTER = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])


def llama(layers: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(layers)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config).eval()


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(32, 32, bias=False)  # the shape of the tiny Llama's q_proj


class Blocks(nn.Module):
    """A model whose modules are named blocks.0.q_proj, blocks.1.q_proj."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])


def blocks_adapter(folder: Path) -> nn.Module:
    torch.manual_seed(3)
    model = get_lora_model(Blocks(), LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"]))
    perturb_trainable(model, seed=4)
    save_adapter(model, folder)
    return model


def merge_cli(base: Path, adapter: Path, out: Path, *options: str) -> int:
    return main(["merge", "--base", str(base), "--adapter", str(adapter), "-o", str(out), *options])


def assert_nothing_written(out: Path) -> None:
    assert not out.exists()
    assert not [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]  # no temp left


# ---- the reported cases --------------------------------------------------------------------------------


def test_two_layer_adapter_into_one_layer_checkpoint_is_refused(tmp_path: Path, capsys) -> None:
    base = save_checkpoint(llama(1), tmp_path / "base", sharded=False)
    peft_adapter("llama", LLAMA_ADAPTER, tmp_path / "adapter")  # the tiny Llama of the suite: 2 layers
    out = tmp_path / "out.safetensors"

    status = merge_cli(base, tmp_path / "adapter", out)

    err = capsys.readouterr().err
    assert status == 1
    assert "loragen merge: error: the adapter does not fit the checkpoint" in err
    for proj in ("q_proj", "v_proj"):
        key = f"base_model.model.model.layers.1.self_attn.{proj}"
        assert f"{key}.lora_A.weight, {key}.lora_B.weight: no checkpoint tensor " in err
        assert f"no checkpoint tensor model.layers.1.self_attn.{proj}.weight" in err
    assert not [line for line in err.splitlines() if "layers.0" in line]  # only modules that do not fit
    assert_nothing_written(out)


def test_adapter_with_other_module_names_is_refused(tmp_path: Path, capsys) -> None:
    base = save_checkpoint(llama(1), tmp_path / "base", sharded=False)
    blocks_adapter(tmp_path / "adapter")
    out = tmp_path / "out.safetensors"

    status = merge_cli(base, tmp_path / "adapter", out)

    err = capsys.readouterr().err
    assert status == 1
    for i in (0, 1):
        assert f"base_model.model.blocks.{i}.q_proj.lora_A.weight" in err
        assert f"no checkpoint tensor blocks.{i}.q_proj.weight" in err
    assert "--key-map OLD=NEW or --strip-prefix PREFIX" in err
    assert "LlamaForCausalLM.base_model_prefix is 'model'" in err  # the wrapper tried, and why
    assert_nothing_written(out)


def test_explicit_map_that_leaves_a_module_without_tensor_is_refused(tmp_path: Path, capsys) -> None:
    base = save_checkpoint(llama(1), tmp_path / "base", sharded=False)
    blocks_adapter(tmp_path / "adapter")
    out = tmp_path / "out.safetensors"

    status = merge_cli(base, tmp_path / "adapter", out, "--key-map", "blocks.0=model.layers.0.self_attn")

    err = capsys.readouterr().err
    assert status == 1
    assert "base_model.model.blocks.1.q_proj.lora_A.weight" in err
    assert "no checkpoint tensor blocks.1.q_proj.weight" in err
    assert "'blocks.0.' -> 'model.layers.0.self_attn.' (as given)" in err
    assert_nothing_written(out)


def test_two_adapter_modules_on_one_tensor_are_refused(tmp_path: Path, capsys) -> None:
    base = save_checkpoint(llama(2), tmp_path / "base", sharded=True)
    blocks_adapter(tmp_path / "adapter")
    out = tmp_path / "out"
    rules = [
        "--key-map",
        "blocks.0=model.layers.0.self_attn",
        "--key-map",
        "blocks.1=model.layers.0.self_attn",
    ]

    status = merge_cli(base, tmp_path / "adapter", out, *rules)

    err = capsys.readouterr().err
    assert status == 1
    assert (
        "base_model.model.blocks.0.q_proj.lora_A.weight, base_model.model.blocks.0.q_proj.lora_B.weight; "
        "base_model.model.blocks.1.q_proj.lora_A.weight, base_model.model.blocks.1.q_proj.lora_B.weight: "
        "2 adapter tensors would land on one checkpoint tensor model.layers.0.self_attn.q_proj.weight"
    ) in err
    assert_nothing_written(out)


def test_explicit_one_to_one_map_merges(tmp_path: Path, capsys) -> None:
    base = save_checkpoint(llama(2), tmp_path / "base", sharded=False)
    model = blocks_adapter(tmp_path / "adapter")
    out = tmp_path / "out.safetensors"
    rules = [
        "--key-map",
        "blocks.0=model.layers.0.self_attn",
        "--key-map",
        "blocks.1=model.layers.1.self_attn",
    ]

    assert merge_cli(base, tmp_path / "adapter", out, *rules) == 0

    assert "'blocks.0.' -> 'model.layers.0.self_attn.'" in capsys.readouterr().out
    before, after = load_file(base), load_file(out)
    for i, block in enumerate(model.blocks):
        key = f"model.layers.{i}.self_attn.q_proj.weight"
        expected = before[key] + block.q_proj.scaling * (block.q_proj.lora_B @ block.q_proj.lora_A).detach()
        torch.testing.assert_close(after[key], expected)
    assert {k for k in before if not torch.equal(before[k], after[k])} == {
        f"model.layers.{i}.self_attn.q_proj.weight" for i in (0, 1)
    }


# ---- the checkpoint's known wrapper ---------------------------------------------------------------------


def _reference(tmp_path: Path) -> dict[str, torch.Tensor]:
    """The adapter merged into the suite's Llama checkpoint under its own keys."""
    base = save_checkpoint(make_model("llama"), tmp_path / "causal", sharded=False)
    merge_checkpoint(base, tmp_path / "adapter", tmp_path / "causal.safetensors")
    return load_file(tmp_path / "causal.safetensors")


def test_task_model_adapter_into_base_model_checkpoint(tmp_path: Path) -> None:
    peft_adapter("llama", LLAMA_ADAPTER, tmp_path / "adapter")
    bare = save_checkpoint(make_model("llama").model, tmp_path / "bare", sharded=True)  # config: LlamaModel

    report = merge_checkpoint(bare, tmp_path / "adapter", tmp_path / "out")

    assert report.mapping == "adapter paths with 'model.' removed (LlamaModel.base_model_prefix is 'model')"
    assert report.keys["model.layers.1.self_attn.v_proj.weight"] == "layers.1.self_attn.v_proj.weight"
    reference = _reference(tmp_path)
    merged = {k: v for f in sorted((tmp_path / "out").glob("*.safetensors")) for k, v in load_file(f).items()}
    assert merged.keys() == {k.removeprefix("model.") for k in reference if k != "lm_head.weight"}
    for key, value in merged.items():
        assert torch.equal(value, reference["model." + key]), key


def test_base_model_adapter_into_task_model_checkpoint(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import peft

        torch.manual_seed(0)
        bare = peft.get_peft_model(make_model("llama").model, peft.LoraConfig(**LLAMA_ADAPTER))
        perturb_trainable(bare, seed=1)
        bare.save_pretrained(str(tmp_path / "bare-adapter"))
    base = save_checkpoint(make_model("llama"), tmp_path / "base", sharded=False)

    report = merge_checkpoint(base, tmp_path / "bare-adapter", tmp_path / "out.safetensors")

    assert (
        report.mapping == "adapter paths with 'model.' added (LlamaForCausalLM.base_model_prefix is 'model')"
    )
    assert len(report.merged) == 4
    q = bare.base_model.model.layers[0].self_attn.q_proj
    delta = (q.lora_B["default"].weight @ q.lora_A["default"].weight) * q.scaling["default"]
    key = "model.layers.0.self_attn.q_proj.weight"
    torch.testing.assert_close(load_file(tmp_path / "out.safetensors")[key], load_file(base)[key] + delta)


def _add_prefix(path: Path, prefix: str) -> None:
    from safetensors.torch import save_file

    save_file({prefix + k: v for k, v in load_file(path).items()}, path)


def test_unknown_wrapper_needs_an_explicit_map(tmp_path: Path, capsys) -> None:
    peft_adapter("llama", LLAMA_ADAPTER, tmp_path / "adapter")
    base = save_checkpoint(make_model("llama"), tmp_path / "base", sharded=False)
    _add_prefix(base, "backbone.")  # a checkpoint of some model wrapping the Llama
    out = tmp_path / "out.safetensors"

    assert merge_cli(base, tmp_path / "adapter", out) == 1
    err = capsys.readouterr().err
    assert "no checkpoint tensor model.layers.0.self_attn.q_proj.weight" in err
    assert_nothing_written(out)

    report = merge_checkpoint(base, tmp_path / "adapter", out, key_map={"": "backbone"})

    assert report.mapping == "adapter paths with 'backbone.' added (as given)"
    reference = _reference(tmp_path)
    merged = load_file(out)
    assert merged.keys() == {"backbone." + k for k in reference}
    assert all(torch.equal(merged["backbone." + k], v) for k, v in reference.items())


def test_without_config_json_the_wrapper_is_unknown(tmp_path: Path, capsys) -> None:
    peft_adapter("llama", LLAMA_ADAPTER, tmp_path / "adapter")
    bare = save_checkpoint(make_model("llama").model, tmp_path / "bare", sharded=False)
    (tmp_path / "bare" / "config.json").unlink()

    assert merge_cli(bare, tmp_path / "adapter", tmp_path / "out.safetensors") == 1
    assert "the checkpoint's wrapper: no config.json beside the checkpoint" in capsys.readouterr().err
    assert_nothing_written(tmp_path / "out.safetensors")

    assert merge_cli(bare, tmp_path / "adapter", tmp_path / "out.safetensors", "--strip-prefix", "model") == 0
    assert "'model.' removed (as given)" in capsys.readouterr().out


def test_without_transformers_the_wrapper_is_unknown(tmp_path: Path, monkeypatch) -> None:
    peft_adapter("llama", LLAMA_ADAPTER, tmp_path / "adapter")
    bare = save_checkpoint(make_model("llama").model, tmp_path / "bare", sharded=False)
    real_import = offline_merge.importlib.import_module

    def no_transformers(name: str, *args):
        if name == "transformers":
            raise ImportError("No module named 'transformers'")
        return real_import(name, *args)

    monkeypatch.setattr(offline_merge.importlib, "import_module", no_transformers)
    with pytest.raises(
        MergeError, match=r"transformers is not installed, so the wrapper of LlamaModel is unknown"
    ):
        merge_checkpoint(bare, tmp_path / "adapter", tmp_path / "out.safetensors")
    merge_checkpoint(bare, tmp_path / "adapter", tmp_path / "out.safetensors", strip_prefix="model.")
    assert (tmp_path / "out.safetensors").is_file()


# ---- options -------------------------------------------------------------------------------------------


def test_dry_run_explains_and_writes_nothing(tmp_path: Path, capsys) -> None:
    peft_adapter("llama", LLAMA_ADAPTER, tmp_path / "adapter")
    bare = save_checkpoint(make_model("llama").model, tmp_path / "bare", sharded=False)
    out = tmp_path / "out.safetensors"

    assert merge_cli(bare, tmp_path / "adapter", out, "--dry-run") == 0

    lines = capsys.readouterr().out.splitlines()
    assert "model.layers.1.self_attn.q_proj.weight -> layers.1.self_attn.q_proj.weight" in lines
    assert len(lines) == 5 and lines[-1].startswith("would merge 4 tensors, replace 0, copy 16 unchanged")
    assert lines[-1].endswith("; nothing written")
    assert_nothing_written(out)


def test_rule_that_matches_nothing_is_refused(tmp_path: Path) -> None:
    peft_adapter("llama", LLAMA_ADAPTER, tmp_path / "adapter")
    base = save_checkpoint(make_model("llama"), tmp_path / "base", sharded=False)
    with pytest.raises(MergeError, match=r"rule 'base_model\.model\.' removed matches no adapter path"):
        merge_checkpoint(
            base, tmp_path / "adapter", tmp_path / "o.safetensors", strip_prefix="base_model.model"
        )
    with pytest.raises(MergeError, match=r"key_map: 'model\.\.layers' is not a dotted path prefix"):
        merge_checkpoint(
            base, tmp_path / "adapter", tmp_path / "o.safetensors", key_map={"model..layers": "x"}
        )
    with pytest.raises(MergeError, match=r"rule '' -> '' changes nothing"):
        merge_checkpoint(base, tmp_path / "adapter", tmp_path / "o.safetensors", strip_prefix=".")
    with pytest.raises(MergeError, match=r"rewrites 'model' more than once"):
        merge_checkpoint(
            base,
            tmp_path / "adapter",
            tmp_path / "o.safetensors",
            key_map={"model": "x"},
            strip_prefix="model",
        )
    assert not (tmp_path / "o.safetensors").exists()


def test_cli_rejects_a_malformed_key_map(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        merge_cli(tmp_path, tmp_path, tmp_path / "o", "--key-map", "blocks")
    assert exit_info.value.code == 2
    assert "'blocks' is not OLD=NEW" in capsys.readouterr().err


def test_prefix_rules_work_on_whole_path_components() -> None:
    rules = KeyMap((PrefixRule("model", ""), PrefixRule("model.layers.1", "decoder.7"), PrefixRule("", "x")))
    assert rules.apply("model.layers.0.q.weight") == "layers.0.q.weight"
    assert rules.apply("model.layers.1.q.weight") == "decoder.7.q.weight"  # the longest old wins
    assert rules.apply("model.layers.10.q.weight") == "layers.10.q.weight"  # "layers.1" is not "layers.10"
    assert rules.apply("models.q.weight") == "x.models.q.weight"  # "model" is not "models"
    assert rules.apply("model") == ""
    assert explicit_key_map({"a.b.": "c"}, ["d"]) == KeyMap(
        (PrefixRule("d", ""), PrefixRule("a.b", "c")), "as given"
    )
    assert explicit_key_map(None, None) is None


# ---- the mapping is one to one, whatever the names ---------------------------------------------------

_part = st.sampled_from(["model", "layers", "0", "1", "q", "blocks", "weight"])
_path = st.lists(_part, min_size=1, max_size=4).map(".".join)


@given(
    targets=st.sets(_path, min_size=1, max_size=6),
    names=st.sets(_path, max_size=12),
    rules=st.dictionaries(
        st.lists(_part, max_size=2).map(".".join), st.lists(_part, max_size=2).map(".".join), max_size=3
    ),
    complete=st.booleans(),
)
def test_resolved_keys_are_one_to_one_or_refused(
    targets: set[str], names: set[str], rules: dict[str, str], complete: bool
) -> None:
    rules = {old: new for old, new in rules.items() if old != new}  # a rule that changes nothing is refused
    explicit = explicit_key_map(rules) if rules else None
    if complete:  # the checkpoint holds every mapped path (two may still land on one tensor)
        names = names | {(explicit or KeyMap()).apply(t) for t in targets}
    checkpoint = Checkpoint(Path("ckpt"), (), None, {}, dict.fromkeys(names, Path("ckpt")))
    adapter_keys = {t: (f"base_model.model.{t}.lora_A.weight",) for t in targets}
    try:
        used, keys = resolve_keys(adapter_keys, checkpoint, explicit)
    except MergeError as exc:  # refused: the message names adapter keys (or the rule that matched nothing)
        message = str(exc)
        assert_named = "base_model.model." in message or "matches no adapter path" in message
    else:
        assert keys.keys() == targets
        assert set(keys.values()) <= names
        assert len(set(keys.values())) == len(keys)  # one to one
        assert used == (explicit or KeyMap())  # no config.json: paths as they are, or the explicit rules
        assert all(keys[t] == used.apply(t) for t in targets)
        assert_named = True
    assert assert_named
