"""``loragen merge``: streaming merge of an adapter into safetensors checkpoints, checked against peft."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from torch import nn

from loragen.adapters.offline_merge import MergeError, merge_checkpoint
from loragen.layouts import LAYOUTS
from tests.adapters.helpers import (
    CASES,
    loragen_adapter,
    main,
    make_model,
    peft_adapter,
    run_model,
    save_checkpoint,
)

HF_CASES = [case for case, (kind, _) in CASES.items() if kind != "convnet"]


def load_merged(kind: str, output: Path) -> nn.Module:
    """A fresh model of ``kind`` with the merged checkpoint ``output`` (file or folder) loaded."""
    model = make_model(kind)
    files = sorted(output.glob("*.safetensors")) if output.is_dir() else [output]
    state = {k: v for f in files for k, v in load_file(f).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert unexpected == [] and all(k in model.state_dict() for k in missing)  # only tied copies are absent
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return model


def raw_tensor_bytes(path: Path) -> dict[str, bytes]:
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    header = json.loads(path.read_bytes()[8 : 8 + header_len])
    data = path.read_bytes()[8 + header_len :]
    return {
        name: data[info["data_offsets"][0] : info["data_offsets"][1]]
        for name, info in header.items()
        if name != "__metadata__"
    }


@pytest.mark.parametrize("sharded", [False, True], ids=["file", "shards"])
@pytest.mark.parametrize("case", HF_CASES)
def test_merge_equals_peft_merge_and_unload(case: str, sharded: bool, tmp_path: Path, monkeypatch) -> None:
    kind, kwargs = CASES[case]
    if sharded:  # stream in tiny blocks: every merged tensor is computed a few rows at a time
        monkeypatch.setattr("loragen.adapters.offline_merge._BLOCK_BYTES", 200)
    base = save_checkpoint(make_model(kind), tmp_path / "base", sharded)
    peft_model = peft_adapter(kind, kwargs, tmp_path / "adapter")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = peft_model.merge_and_unload()
    output = tmp_path / ("out" if sharded else "out.safetensors")

    assert (
        main(["merge", "--base", str(base), "--adapter", str(tmp_path / "adapter"), "-o", str(output)]) == 0
    )

    merged = load_merged(kind, output)
    expected = reference.state_dict()
    for key, value in merged.state_dict().items():
        torch.testing.assert_close(value, expected[key], rtol=1e-6, atol=1e-6, msg=key)
    torch.testing.assert_close(run_model(merged, kind), run_model(reference, kind), rtol=1e-5, atol=1e-5)
    if sharded:
        # the base's files, and the marker a later merge recognises its own output by
        assert sorted(p.name for p in output.iterdir()) == sorted(
            [p.name for p in base.iterdir()] + ["loragen_merge.json"]
        )
        index = "model.safetensors.index.json"
        assert (output / index).read_bytes() == (base / index).read_bytes()


@pytest.mark.parametrize("block_bytes", [16 << 20, 50], ids=["whole", "blocks"])
def test_merge_conv_model_equals_peft(block_bytes: int, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr("loragen.adapters.offline_merge._BLOCK_BYTES", block_bytes)
    kind, kwargs = CASES["convnet"]
    save_file(make_model(kind).state_dict(), tmp_path / "base.safetensors")
    peft_model = peft_adapter(kind, kwargs, tmp_path / "adapter")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = peft_model.merge_and_unload()

    merge_checkpoint(tmp_path / "base.safetensors", tmp_path / "adapter", tmp_path / "out.safetensors")

    merged = load_merged(kind, tmp_path / "out.safetensors")
    for key, value in merged.state_dict().items():
        torch.testing.assert_close(value, reference.state_dict()[key], rtol=1e-6, atol=1e-6, msg=key)


def test_untouched_tensors_are_byte_identical(tmp_path: Path) -> None:
    kind, kwargs = CASES["llama-embedding-modules-to-save"]
    base = save_checkpoint(make_model(kind), tmp_path / "base", sharded=False)
    loragen_adapter(kind, kwargs, tmp_path / "adapter")

    report = merge_checkpoint(base, tmp_path / "adapter", tmp_path / "out.safetensors")

    before, after = raw_tensor_bytes(base), raw_tensor_bytes(tmp_path / "out.safetensors")
    changed = {k for k in before if before[k] != after[k]}
    assert changed == set(report.merged) | set(report.replaced)
    assert set(report.merged) == {f"model.layers.{i}.self_attn.q_proj.weight" for i in (0, 1)} | {
        "model.embed_tokens.weight"
    }
    assert set(report.replaced) == {"lm_head.weight", "model.embed_tokens.weight"}
    assert report.copied == len(before) - 4
    assert base.read_bytes()[:100] == (tmp_path / "out.safetensors").read_bytes()[:100]  # same header


@given(
    shape=st.tuples(st.integers(1, 9), st.integers(1, 9)),
    rank=st.integers(1, 4),
    alpha=st.sampled_from([1.0, 8.0, 3.5]),
    rslora=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    transposed=st.booleans(),
)
def test_merged_value_is_fp32_math_rounded_once(
    tmp_path_factory,
    shape: tuple[int, int],
    rank: int,
    alpha: float,
    rslora: bool,
    dtype: torch.dtype,
    transposed: bool,
) -> None:
    folder = tmp_path_factory.mktemp("merge")
    out_features, in_features = shape
    g = torch.Generator().manual_seed(rank)
    weight = torch.randn(out_features, in_features, generator=g).to(dtype)
    a, b = torch.randn(rank, in_features, generator=g), torch.randn(out_features, rank, generator=g)
    stored = weight.t().contiguous() if transposed else weight  # a Conv1D weight is stored (in, out)
    save_file({"layer.weight": stored, "other": torch.arange(5)}, folder / "base.safetensors")
    (folder / "adapter").mkdir()
    save_file(
        {"base_model.model.layer.lora_A.weight": a, "base_model.model.layer.lora_B.weight": b},
        folder / "adapter" / "adapter_model.safetensors",
    )
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha,
        "use_rslora": rslora,
        "target_modules": ["layer"],
        "fan_in_fan_out": transposed,
    }
    (folder / "adapter" / "adapter_config.json").write_text(json.dumps(config))
    if transposed:  # a square weight's layer type comes from the architecture, as a checkpoint records it
        (folder / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))

    merge_checkpoint(folder / "base.safetensors", folder / "adapter", folder / "out.safetensors")

    scaling = alpha / (math.sqrt(rank) if rslora else rank)
    expected = (weight.double() + scaling * (b.double() @ a.double())).to(dtype)  # exact math, one rounding
    result = load_file(folder / "out.safetensors")
    assert result["layer.weight"].dtype == dtype
    torch.testing.assert_close(result["layer.weight"], expected.t().contiguous() if transposed else expected)
    assert torch.equal(result["other"], torch.arange(5))


# ---- refusals ------------------------------------------------------------------------------------------


@pytest.fixture
def llama_files(tmp_path: Path) -> tuple[Path, Path]:
    kind, kwargs = CASES["llama-patterns-rslora"]
    base = save_checkpoint(make_model(kind), tmp_path / "base", sharded=True)
    peft_adapter(kind, kwargs, tmp_path / "adapter")
    return base, tmp_path / "adapter"


def test_adapter_for_another_model_is_refused_naming_keys(llama_files, tmp_path: Path, capsys) -> None:
    base, _ = llama_files
    peft_adapter("gpt2", CASES["gpt2-conv1d-bias"][1], tmp_path / "gpt2")

    status = main(
        ["merge", "--base", str(base), "--adapter", str(tmp_path / "gpt2"), "-o", str(tmp_path / "out")]
    )

    err = capsys.readouterr().err
    assert status == 1
    assert "loragen merge: error: the adapter does not fit the checkpoint" in err
    assert "transformer.h.0.attn.c_attn.weight" in err and "transformer.h.1.mlp.c_fc.bias" in err
    assert not (tmp_path / "out").exists()


def test_shape_mismatch_is_refused(llama_files, tmp_path: Path) -> None:
    base, adapter = llama_files
    key = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    tensors = load_file(adapter / "adapter_model.safetensors")
    tensors[key] = torch.zeros(24, 4)
    save_file(tensors, adapter / "adapter_model.safetensors")

    with pytest.raises(
        MergeError,
        match=r"model\.layers\.1\.self_attn\.v_proj\.weight: the checkpoint tensor has "
        r"shape \[16, 32\] but the adapter's .* needs \[24, 32\]",
    ):
        merge_checkpoint(base, adapter, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_refuses_to_write_over_the_base(llama_files, tmp_path: Path) -> None:
    base, adapter = llama_files
    before = {p.name: p.read_bytes() for p in base.iterdir()}
    for output in (base, base / "merged", tmp_path):
        with pytest.raises(MergeError, match="refusing to write"):
            merge_checkpoint(base, adapter, output)
    single = save_checkpoint(make_model("llama"), tmp_path / "single", sharded=False)
    with pytest.raises(MergeError, match=r"refusing to write .*: it is, or lies inside, the base checkpoint"):
        merge_checkpoint(single, adapter, tmp_path / "single" / "." / "model.safetensors")
    assert {p.name: p.read_bytes() for p in base.iterdir()} == before


def test_failure_mid_merge_writes_nothing(llama_files, tmp_path: Path, monkeypatch) -> None:
    base, adapter = llama_files
    merge_checkpoint(base, adapter, tmp_path / "out")
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    calls = []

    def fail_on_second(*args):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("killed")
        return original(*args)

    import loragen.adapters.offline_merge

    original = loragen.adapters.offline_merge._merge_tensor
    monkeypatch.setattr(loragen.adapters.offline_merge, "_merge_tensor", fail_on_second)
    with pytest.raises(RuntimeError, match="killed"):
        merge_checkpoint(base, adapter, tmp_path / "out")
    calls.clear()
    with pytest.raises(RuntimeError, match="killed"):
        merge_checkpoint(base, adapter, tmp_path / "fresh")

    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "base", "out"]


def test_corrupt_base_is_named(tmp_path: Path, llama_files) -> None:
    _, adapter = llama_files
    (tmp_path / "bad.safetensors").write_bytes(b"\x00\x01")
    with pytest.raises(MergeError, match=r"bad\.safetensors: truncated safetensors file"):
        merge_checkpoint(tmp_path / "bad.safetensors", adapter, tmp_path / "out.safetensors")


def test_progress_bar_only_when_asked_or_on_a_terminal(llama_files, tmp_path: Path, capsys) -> None:
    base, adapter = llama_files
    assert main(["merge", "--base", str(base), "--adapter", str(adapter), "-o", str(tmp_path / "a")]) == 0
    quiet = capsys.readouterr()
    assert quiet.err == "" and quiet.out.startswith("merged 4 tensors, copied")

    merge_checkpoint(base, adapter, tmp_path / "b", progress=True)
    assert "merging" in capsys.readouterr().err


def test_folder_with_one_file_and_no_index(tmp_path: Path) -> None:
    kind, kwargs = CASES["gpt2-conv1d-bias"]
    single = save_checkpoint(make_model(kind), tmp_path / "base", sharded=False)
    (tmp_path / "base" / "pytorch_model.bin").write_bytes(b"unmerged weights in another format")
    peft_adapter(kind, kwargs, tmp_path / "adapter")

    report = merge_checkpoint(tmp_path / "base", tmp_path / "adapter", tmp_path / "out")

    assert report.files == (tmp_path / "out" / "model.safetensors",)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(
        ["config.json", "generation_config.json", "loragen_merge.json", "model.safetensors"]
    )
    reference = merge_checkpoint(single, tmp_path / "adapter", tmp_path / "single.safetensors")
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == reference.output.read_bytes()


@given(
    layout=st.sampled_from(sorted(LAYOUTS)),
    r=st.integers(1, 4),
    rows=st.integers(1, 9),
    cols=st.integers(1, 9),
    kernel=st.sampled_from([(), (3,), (2, 2)]),
    block=st.integers(1, 9),
)
def test_row_blocks_of_every_layout_add_up_to_its_delta(
    layout: str, r: int, rows: int, cols: int, kernel: tuple[int, ...], block: int
) -> None:
    """The streaming merge adds ``Layout.delta_row_factors`` block by block: together, exactly ``delta``."""
    lay = LAYOUTS[layout]
    kernel = kernel if lay.name == "plain" else ()
    g = torch.Generator().manual_seed(r * 100 + rows)
    if lay.name == "plain":  # A (r, in, *kernel), B (out, r, 1, ...); rows of W are its out
        a, b = (
            torch.randn(r, cols, *kernel, generator=g),
            torch.randn(rows, r, *[1] * len(kernel), generator=g),
        )
    else:  # A (r, rows), B (cols, r); rows of W are A's columns
        a, b = torch.randn(r, rows, generator=g), torch.randn(cols, r, generator=g)
    assert lay.fits(tuple(a.shape), tuple(b.shape))
    delta = lay.delta(a, b)
    assert tuple(delta.shape) == lay.weight_shape(tuple(a.shape), tuple(b.shape))
    for start in range(0, delta.shape[0], block):
        stop = min(start + block, delta.shape[0])
        left, right = lay.delta_row_factors(a, b, start, stop)
        torch.testing.assert_close(left @ right, delta[start:stop].flatten(1))
