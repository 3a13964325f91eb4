"""save_adapter / load_adapter: peft's on-disk format both ways, all-or-nothing loading, clear errors."""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Callable
from pathlib import Path

import peft
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from peft.utils import set_peft_model_state_dict
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from loragen import (
    LoraConfig,
    LoraConfigError,
    LoraConversionError,
    LoraLinear,
    get_lora_model,
    merge_adapter,
)
from loragen.adapters.folder import CONFIG_DIGEST_KEY
from loragen.adapters.load import load_adapter
from loragen.adapters.save import adapter_state_dict, save_adapter
from loragen.convert import find_lora_layers
from loragen.errors import AdapterError
from tests.adapters.helpers import (
    CASES,
    WEIGHTS,
    assert_same_state,
    loragen_adapter,
    make_model,
    model_state,
    peft_adapter,
    perturb_trainable,
    run_model,
)

# ---- interop with peft ----------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_peft_adapter_loads_in_loragen(case: str, tmp_path: Path) -> None:
    kind, kwargs = CASES[case]
    reference = run_model(peft_adapter(kind, kwargs, tmp_path), kind)

    model = load_adapter(make_model(kind), tmp_path)

    torch.testing.assert_close(run_model(model, kind), reference, rtol=1e-5, atol=1e-6)
    assert find_lora_layers(model)


@pytest.mark.parametrize("case", CASES)
def test_loragen_adapter_loads_in_peft(case: str, tmp_path: Path) -> None:
    kind, kwargs = CASES[case]
    reference = run_model(loragen_adapter(kind, kwargs, tmp_path), kind)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = peft.PeftModel.from_pretrained(make_model(kind), str(tmp_path)).eval()
        result = set_peft_model_state_dict(peft_model, load_file(tmp_path / WEIGHTS))

    adapter_missing = [k for k in result.missing_keys if "lora_" in k or "modules_to_save" in k]
    assert adapter_missing == []
    assert result.unexpected_keys == []
    torch.testing.assert_close(run_model(peft_model, kind), reference, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", CASES)
def test_saved_keys_and_shapes_equal_peft(case: str, tmp_path: Path) -> None:
    kind, kwargs = CASES[case]
    peft_adapter(kind, kwargs, tmp_path / "peft")
    loragen_adapter(kind, kwargs, tmp_path / "loragen")

    theirs = load_file(tmp_path / "peft" / WEIGHTS)
    ours = load_file(tmp_path / "loragen" / WEIGHTS)
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs.items()}


def test_bf16_adapters_both_ways(tmp_path: Path) -> None:
    kwargs = dict(r=4, target_modules=["q_proj", "v_proj"])
    peft_model = peft_adapter("llama", kwargs, tmp_path / "peft", dtype=torch.bfloat16)
    assert (
        load_file(tmp_path / "peft" / WEIGHTS)[
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
        ].dtype
        == torch.bfloat16
    )
    ours = load_adapter(make_model("llama", torch.bfloat16), tmp_path / "peft")
    torch.testing.assert_close(run_model(ours, "llama"), run_model(peft_model, "llama"), rtol=0, atol=2e-2)
    # the bf16 factors were loaded exactly (into float32 factors, loragen's default for bf16 bases)
    saved = load_file(tmp_path / "peft" / WEIGHTS)
    layer = find_lora_layers(ours)["model.layers.1.self_attn.v_proj"]
    assert torch.equal(
        layer.lora_B.to(torch.bfloat16),
        saved["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"],
    )

    model = get_lora_model(make_model("llama"), LoraConfig(**kwargs))
    perturb_trainable(model, seed=3)
    model.to(torch.bfloat16)
    save_adapter(model, tmp_path / "ours")
    assert {t.dtype for t in load_file(tmp_path / "ours" / WEIGHTS).values()} == {torch.bfloat16}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = peft.PeftModel.from_pretrained(
            make_model("llama", torch.bfloat16), str(tmp_path / "ours"), autocast_adapter_dtype=False
        )
    torch.testing.assert_close(run_model(theirs, "llama"), run_model(model, "llama"), rtol=0, atol=2e-2)


# ---- save_adapter -----------------------------------------------------------------------------------


def test_saved_file_format(tmp_path: Path) -> None:
    kind, kwargs = CASES["llama-embedding-modules-to-save"]
    model = loragen_adapter(kind, kwargs, tmp_path)

    with safe_open(tmp_path / WEIGHTS, "pt") as fh:
        metadata = fh.metadata()
    config_bytes = (tmp_path / "adapter_config.json").read_bytes()
    # peft's format marker, and the digest tying the weights to the config saved with them
    assert metadata == {"format": "pt", CONFIG_DIGEST_KEY: hashlib.sha256(config_bytes).hexdigest()}
    config = json.loads(config_bytes)
    assert config["peft_type"] == "LORA" and config["inference_mode"] is True
    assert config["target_modules"] == ["embed_tokens", "q_proj"]
    assert config["modules_to_save"] == ["lm_head"]
    # every saved tensor is a contiguous copy: no storage shared with the model or with each other
    tensors = adapter_state_dict(model, model.loragen_config)
    model_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved_ptrs = [t.untyped_storage().data_ptr() for t in tensors.values()]
    assert all(t.is_contiguous() for t in tensors.values())
    assert len(set(saved_ptrs)) == len(saved_ptrs) and not set(saved_ptrs) & model_ptrs


def test_save_failure_keeps_old_adapter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kind, kwargs = CASES["gpt2-conv1d-bias"]
    model = loragen_adapter(kind, kwargs, tmp_path / "adapter")
    (tmp_path / "adapter" / "README.md").write_text("notes")
    before = {p.name: p.read_bytes() for p in (tmp_path / "adapter").iterdir()}

    def write_half_then_fail(fd: int, data: bytes) -> None:
        os.write(fd, data[: len(data) // 2])
        raise OSError("disk full")

    monkeypatch.setattr("loragen.atomic._write_all", write_half_then_fail)
    perturb_trainable(model, seed=5)
    with pytest.raises(OSError, match="disk full"):
        save_adapter(model, tmp_path / "adapter")

    assert {p.name: p.read_bytes() for p in (tmp_path / "adapter").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]  # no temporary folder left behind


def test_save_over_existing_keeps_other_files(tmp_path: Path) -> None:
    kind, kwargs = CASES["bert-modules-to-save"]
    loragen_adapter(kind, kwargs, tmp_path / "adapter")
    (tmp_path / "adapter" / "README.md").write_text("notes")
    (tmp_path / "adapter" / "adapter_model.bin").write_bytes(b"stale pickle")

    (tmp_path / "adapter" / "extra").mkdir()
    (tmp_path / "adapter" / "extra" / "tokenizer.json").write_text("{}")

    model = loragen_adapter(kind, kwargs, tmp_path / "adapter")

    assert (tmp_path / "adapter" / "README.md").read_text() == "notes"
    assert (tmp_path / "adapter" / "extra" / "tokenizer.json").read_text() == "{}"
    # not a file the save writes: kept (the safetensors file is read first, by loragen as by peft)
    assert (tmp_path / "adapter" / "adapter_model.bin").read_bytes() == b"stale pickle"
    loaded = load_adapter(make_model(kind), tmp_path / "adapter")
    torch.testing.assert_close(run_model(loaded, kind), run_model(model, kind))


class RewrittenMLP(nn.Module):
    """What ``loragen rewrite`` makes of an MLP: LoRA layers in the source, no stored config."""

    def __init__(self, lora: bool = True) -> None:
        super().__init__()
        self.up = LoraLinear(8, 16, r=4, lora_alpha=8) if lora else nn.Linear(8, 16)
        self.down = (
            LoraLinear(16, 8, r=2, lora_alpha=8, init_lora_weights=False) if lora else nn.Linear(16, 8)
        )
        self.out = LoraLinear(8, 8, r=4, lora_alpha=2, use_rslora=False) if lora else nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.down(torch.relu(self.up(x)))))


def test_rewritten_model_without_config_round_trips(tmp_path: Path) -> None:
    torch.manual_seed(0)
    rewritten = RewrittenMLP()
    perturb_trainable(rewritten, seed=4)
    save_adapter(rewritten, tmp_path)

    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (4, 8)
    assert config["rank_pattern"] == {"down": 2} and config["alpha_pattern"] == {"out": 2}
    assert config["target_modules"] == ["down", "out", "up"]
    plain = RewrittenMLP(lora=False)
    plain.load_state_dict(rewritten.state_dict(), strict=False)
    x = torch.randn(3, 8)
    loaded = load_adapter(plain, tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), rewritten(x))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = RewrittenMLP(lora=False)
        base.load_state_dict(rewritten.state_dict(), strict=False)
        theirs = peft.PeftModel.from_pretrained(base, str(tmp_path))
    with torch.no_grad():
        torch.testing.assert_close(theirs(x), rewritten(x))


def test_save_refuses_a_model_without_lora_layers(tmp_path: Path) -> None:
    with pytest.raises(AdapterError, match="RewrittenMLP has no LoRA layers"):
        save_adapter(RewrittenMLP(lora=False), tmp_path / "a")
    assert not (tmp_path / "a").exists()


@given(
    ranks=st.lists(st.integers(1, 6), min_size=3, max_size=3),
    alphas=st.lists(st.sampled_from([1, 2, 8, 16.5]), min_size=3, max_size=3),
    rslora=st.booleans(),
)
def test_round_trip_property(tmp_path_factory, ranks: list[int], alphas: list[float], rslora: bool) -> None:
    folder = tmp_path_factory.mktemp("adapter")
    torch.manual_seed(0)
    model = RewrittenMLP(lora=False)
    for name, r, alpha in zip(("up", "down", "out"), ranks, alphas):
        setattr(
            model,
            name,
            LoraLinear.from_module(
                getattr(model, name), r=r, lora_alpha=alpha, use_rslora=rslora, init_lora_weights=False
            ),
        )
    save_adapter(model, folder)

    loaded = load_adapter(RewrittenMLP(lora=False), folder)
    loaded.load_state_dict(model.state_dict(), strict=False)  # the base weights, not part of the adapter
    for name in ("up", "down", "out"):
        ours, theirs = getattr(model, name), getattr(loaded, name)
        assert (theirs.r, theirs.scaling) == (ours.r, pytest.approx(ours.scaling))
        assert torch.equal(theirs.lora_A, ours.lora_A) and torch.equal(theirs.lora_B, ours.lora_B)


# ---- load_adapter -----------------------------------------------------------------------------------


def test_load_into_converted_model_adopts_the_adapter_scaling(tmp_path: Path) -> None:
    kind, kwargs = CASES["llama-patterns-rslora"]
    reference = run_model(peft_adapter(kind, kwargs, tmp_path), kind)
    model = get_lora_model(make_model(kind), LoraConfig(**{**kwargs, "lora_alpha": 1, "use_rslora": False}))

    load_adapter(model, tmp_path)

    torch.testing.assert_close(run_model(model, kind), reference, rtol=1e-5, atol=1e-6)
    assert model.loragen_config.use_rslora


def test_trainable_flags(tmp_path: Path) -> None:
    kind, kwargs = CASES["bert-modules-to-save"]
    peft_adapter(kind, kwargs, tmp_path)

    frozen = load_adapter(make_model(kind), tmp_path)
    assert not any(p.requires_grad for p in frozen.parameters())

    trainable = load_adapter(make_model(kind), tmp_path, trainable=True)
    reference = get_lora_model(make_model(kind), LoraConfig(**kwargs))
    assert {n for n, p in trainable.named_parameters() if p.requires_grad} == {
        n for n, p in reference.named_parameters() if p.requires_grad
    }
    assert any("lora_A" in n for n, p in trainable.named_parameters() if p.requires_grad)


def test_pickled_adapter_refused_unless_allowed(tmp_path: Path) -> None:
    kind, kwargs = CASES["gpt2-conv1d-bias"]
    reference = run_model(peft_adapter(kind, kwargs, tmp_path), kind)
    torch.save(load_file(tmp_path / WEIGHTS), tmp_path / "adapter_model.bin")
    os.remove(tmp_path / WEIGHTS)
    model = make_model(kind)
    before = model_state(model)

    with pytest.raises(
        AdapterError, match=r"adapter_model\.bin: refusing to load a pickle.*allow_pickle=True"
    ):
        load_adapter(model, tmp_path)
    assert_same_state(model, before)

    load_adapter(model, tmp_path, allow_pickle=True)
    torch.testing.assert_close(run_model(model, kind), reference, rtol=1e-5, atol=1e-6)


def _edit_weights(folder: Path, edit: Callable[[dict], None]) -> None:
    tensors = load_file(folder / WEIGHTS)
    edit(tensors)
    save_file(tensors, folder / WEIGHTS, metadata={"format": "pt"})


def _edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "adapter_config.json").read_text())
    config.update(changes)
    (folder / "adapter_config.json").write_text(json.dumps(config))


Q0 = "base_model.model.model.layers.0.self_attn.q_proj"


def _drop_keys(tensors: dict) -> None:
    del tensors[f"{Q0}.lora_A.weight"]
    del tensors["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"]


def _add_key(tensors: dict) -> None:
    tensors["base_model.model.model.norm.extra"] = torch.zeros(3)


def _wrong_shape(tensors: dict) -> None:
    tensors[f"{Q0}.lora_B.weight"] = torch.zeros(31, 4)


def _truncate(folder: Path) -> None:
    data = (folder / WEIGHTS).read_bytes()
    (folder / WEIGHTS).write_bytes(data[: len(data) - 100])


def _garbage_header(folder: Path) -> None:
    (folder / WEIGHTS).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all" + b"\x00" * 64)


LOAD_ERRORS: dict[str, tuple[Callable[[Path], None], type[Exception], str]] = {
    "missing-keys": (
        lambda f: _edit_weights(f, _drop_keys),
        AdapterError,
        (
            r"missing keys \(2;.*\n.*layers\.0\.self_attn\.q_proj\.lora_A\.weight"
            r"\n.*layers\.1\.self_attn\.v_proj\.lora_B\.weight"
        ),
    ),
    "unexpected-keys": (
        lambda f: _edit_weights(f, _add_key),
        AdapterError,
        r"unexpected keys \(1; .*strict=False.*\n.*base_model\.model\.model\.norm\.extra",
    ),
    "shape-mismatch": (
        lambda f: _edit_weights(f, _wrong_shape),
        AdapterError,
        r"q_proj\.lora_B\.weight: expected shape \(32, 4\), found \(31, 4\)",
    ),
    "rank-pattern-mismatch": (
        lambda f: _edit_config(f, rank_pattern={"q_proj": 2}),
        AdapterError,
        (
            r"layers\.1\.self_attn\.q_proj\.lora_A\.weight: (expected shape \(2, 32\), found \(4, 32\)"
            r"|the adapter config gives model\.layers\.1\.self_attn\.q_proj rank 2, "
            r"the file and the model's layer have rank 4)"
        ),
    ),
    "truncated": (_truncate, AdapterError, r"adapter_model\.safetensors: truncated safetensors file"),
    "corrupt": (_garbage_header, AdapterError, r"adapter_model\.safetensors: corrupt safetensors header"),
    "invalid-field": (lambda f: _edit_config(f, r=-1), LoraConfigError, r"adapter_config\.json: r=-1"),
    "unsupported-field": (
        lambda f: _edit_config(f, lora_bias=True),
        LoraConfigError,
        r"lora_bias=True is not supported",
    ),
    "dora-config-without-magnitudes": (
        lambda f: _edit_config(f, use_dora=True),
        AdapterError,
        r"(missing keys .*\n.*lora_magnitude_vector|the adapter config has use_dora=True but these LoRA layers have "
        r"use_dora=False:\n.*q_proj)",
    ),
    "bad-json": (
        lambda f: (f / "adapter_config.json").write_text('{"r": 4,\n  "lora_alpha": }'),
        AdapterError,
        r"adapter_config\.json:2:\d+: invalid JSON",
    ),
    "other-architecture": (
        lambda f: _edit_config(f, target_modules=["c_attn", "c_fc"]),
        LoraConversionError,
        r"target_modules=\['c_attn', 'c_fc'\].*matched no module of LlamaForCausalLM",
    ),
    "no-config": (lambda f: os.remove(f / "adapter_config.json"), AdapterError, r"no adapter_config\.json"),
}


@pytest.mark.parametrize("case", LOAD_ERRORS)
def test_load_errors_leave_the_model_untouched(case: str, tmp_path: Path) -> None:
    break_it, error, message = LOAD_ERRORS[case]
    peft_adapter("llama", dict(r=4, target_modules=["q_proj", "v_proj"]), tmp_path)
    break_it(tmp_path)
    plain = make_model("llama")
    converted = get_lora_model(make_model("llama"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    perturb_trainable(converted, seed=6)

    for model in (plain, converted):
        if case == "other-architecture" and model is converted:
            continue  # a converted model loads into its own layers: the targets do not matter there
        before = model_state(model)
        with pytest.raises(error, match=message):
            load_adapter(model, tmp_path)
        assert_same_state(model, before)


def test_strict_false_ignores_unexpected_and_missing_keys(tmp_path: Path) -> None:
    peft_adapter("llama", dict(r=4, target_modules=["q_proj", "v_proj"]), tmp_path)
    _edit_weights(tmp_path, lambda t: (_add_key(t), _drop_keys(t)))

    model = load_adapter(make_model("llama"), tmp_path, strict=False)

    assert len(find_lora_layers(model)) == 4
    torch.testing.assert_close(
        find_lora_layers(model)["model.layers.1.self_attn.q_proj"].lora_A,
        load_file(tmp_path / WEIGHTS)["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"],
    )


def test_load_refuses_merged_layers(tmp_path: Path) -> None:
    kind, kwargs = CASES["llama-patterns-rslora"]
    peft_adapter(kind, kwargs, tmp_path)
    model = get_lora_model(make_model(kind), LoraConfig(**kwargs))
    merge_adapter(model)
    before = model_state(model)
    with pytest.raises(
        AdapterError, match=r"merged LoRA layers \(model\.layers\.0\.self_attn\.q_proj.*unmerge_adapter"
    ):
        load_adapter(model, tmp_path)
    assert_same_state(model, before)


@pytest.mark.parametrize("converted", [False, True], ids=["plain", "converted"])
def test_failure_while_applying_restores_the_model(converted: bool, tmp_path: Path, monkeypatch) -> None:
    kind, kwargs = CASES["bert-modules-to-save"]
    peft_adapter(kind, kwargs, tmp_path)
    model = make_model(kind)
    if converted:
        model = get_lora_model(model, LoraConfig(**{**kwargs, "lora_alpha": 3}))
        perturb_trainable(model, seed=7)
    before = model_state(model)

    def fail(*args, **kwargs):
        raise RuntimeError("interrupted")

    monkeypatch.setattr("loragen.adapters.load.mark_trainable", fail)
    with pytest.raises(RuntimeError, match="interrupted"):
        load_adapter(model, tmp_path, trainable=True)  # fails after every tensor was copied in
    assert_same_state(model, before)
    if converted:
        assert {layer.scaling for layer in find_lora_layers(model).values()} == {3 / 4}


def test_missing_folder_is_named(tmp_path: Path) -> None:
    with pytest.raises(AdapterError, match=r"nowhere does not exist: an adapter is a folder"):
        load_adapter(make_model("llama"), tmp_path / "nowhere")


@pytest.mark.parametrize("base_mode", ["train", "eval"])
@pytest.mark.parametrize("trainable", [False, True])
def test_load_adapter_sets_modes_as_peft_is_trainable_does(
    tmp_path: Path, base_mode: str, trainable: bool
) -> None:
    """peft's ``is_trainable=False`` puts the model in eval mode; ``True`` leaves the base's mode and its new
    LoRA layers train. loragen's ``trainable`` does the same, so dropout is on where peft's is."""

    def base() -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 6), nn.Dropout(0.1), nn.Linear(6, 3))
        return model.train(base_mode == "train")

    peft.get_peft_model(base(), peft.LoraConfig(target_modules=["0", "2"], r=2)).save_pretrained(tmp_path)
    theirs = peft.PeftModel.from_pretrained(base(), tmp_path, is_trainable=trainable).base_model.model
    ours = load_adapter(base(), tmp_path, trainable=trainable)
    modes = {name: module.training for name, module in ours.named_modules()}
    assert modes[""] == (base_mode == "train" and trainable)
    for name in ("0", "1", "2"):
        assert modes[name] == theirs.get_submodule(name).training, name
